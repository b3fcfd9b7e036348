"""The text encoder: token + position embedding as the stem, then the ViT's own Block and Head.

    ids (B, T) -> TextStem -> (B, T, D) -> Block x depth (any order, padding masked) -> Head ([CLS]) -> logits

Only the stem differs from the image model, so a node serves a text block with the same code and the
family, lineage and merging rules are unchanged. T may be anything up to the config's max_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ViTConfig
from ..vit import Block, Head, ViT, _init_weights
from .specials import PAD_ID

# Small, as in BERT: with unit-scale embeddings each block adds little to the residual stream, and
# a sequentially trained encoder keeps working in any block order (no contrast with LayerShuffle).
TOKEN_EMBED_STD = 0.02


class TextStem(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.token_embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.max_tokens, cfg.dim) * cfg.pos_embed_init_std)
        self.dropout = nn.Dropout(cfg.dropout)
        self.max_tokens = cfg.max_tokens

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens; this model takes at most {self.max_tokens}")
        return self.dropout(self.token_embed(ids) + self.pos_embed[:, :t])


def key_mask_of(ids: Tensor) -> Tensor:
    """(B, T) bool: the tokens that may be attended to (everything but [PAD])."""
    return ids != PAD_ID


class TextEncoder(ViT):
    """A ViT whose stem reads token ids: same blocks, same head, same orders."""

    def __init__(self, cfg: ViTConfig) -> None:
        if not cfg.is_text:
            raise ValueError("TextEncoder needs a config of kind 'text'")
        nn.Module.__init__(self)
        self.cfg = cfg
        stem = TextStem(cfg)
        self.stem = stem  # type: ignore[assignment]
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.depth)])
        self.head = Head(cfg)
        self.apply(_init_weights)
        nn.init.normal_(stem.token_embed.weight, std=TOKEN_EMBED_STD)
        # Per-token depth while training (`train --token-depth`): (V,) hops per token id; None: all.
        # A plain attribute, not a buffer: it is not part of the weights, ids or hashes.
        self.token_depth_table: Tensor | None = None

    def _run_block(self, block: nn.Module, x: Tensor, hops_run: int, ids: Tensor, mask: Tensor) -> Tensor:
        """One block; with a depth table, tokens that already ran their depth keep their state (they
        are still keys and values): the same result as a node computing only the active tokens."""
        out: Tensor = block(x, hops_run, mask)
        if self.token_depth_table is None:
            return out
        active = self.token_depth_table.to(ids.device)[ids] > hops_run
        return torch.where(active[..., None], out, x)

    def features(self, images: Tensor, order: Sequence[int] | None = None) -> Tensor:
        ids = images
        x, mask = self.stem(ids), key_mask_of(ids)
        for position, index in enumerate(self.default_order() if order is None else order):
            x = self._run_block(self.blocks[index], x, position, ids, mask)
        return x

    def training_loss(self, ids: Tensor, labels: Tensor, order: list[int], exit_loss: float = 0.0) -> Tensor:
        """The trainer's loss for text (train.training_loss defers here): task cross-entropy, plus the
        position loss of layershuffle-predict blocks, plus the optional early-exit loss."""
        x, mask = self.stem(ids), key_mask_of(ids)
        loss = ids.new_zeros((), dtype=torch.float32)
        early: list[Tensor] = []
        for position, index in enumerate(order):
            block: Block = self.blocks[index]  # type: ignore[assignment]
            x = self._run_block(block, x, position, ids, mask)
            if block.position_head is not None:
                target = torch.full((x.shape[0],), position, dtype=torch.long, device=x.device)
                loss = loss + F.cross_entropy(block.position_logits(x), target)
            if exit_loss > 0 and position + 1 < len(order):
                early.append(F.cross_entropy(self.head(x), labels))
        loss = loss + F.cross_entropy(self.head(x), labels)
        if early:
            loss = loss + exit_loss * torch.stack(early).mean()
        return loss
