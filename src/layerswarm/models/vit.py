"""A pre-norm Vision Transformer in three parts that can run on different machines.

    image (B, C, H, W) -> Stem -> (B, T, D) -> Block x depth (any order) -> (B, T, D) -> Head -> (B, classes)

Every block takes its current position in the path, so position-aware variants can adapt to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ViTConfig


class ConvEmbed(nn.Module):
    """A convolutional stem (Xiao et al. 2021, "Early convolutions help transformers see better"):
    3x3 stride-2 convolutions halve the image until one position covers a patch, then a 1x1 conv to D.

    It gives a from-scratch ViT the locality a CNN has, which it cannot learn from a few thousand images;
    the tokens it makes have the same shape as the patch embedding's, so blocks and head are unchanged."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels, width, side = cfg.in_channels, max(8, cfg.dim // 2), 1
        while side < cfg.patch_size:  # patch_size is a power of two (the config checks): log2(P) halvings
            layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width)]
            layers.append(nn.ReLU())
            channels, width, side = width, min(width * 2, cfg.dim), side * 2
        layers.append(nn.Conv2d(channels, cfg.dim, kernel_size=1))
        self.layers = nn.Sequential(*layers)

    def forward(self, images: Tensor) -> Tensor:
        return self.layers(images)  # (B, C, H, W) -> (B, D, H/P, W/P)


class ShallowConvEmbed(nn.Module):
    """One 3x3 convolution at full resolution (BatchNorm, ReLU), then the patch embedding's PxP strided conv:
    the tokens ConvEmbed makes, from far less work before the blocks. Each token sees its patch and a pixel
    around it, no more, so the blocks (not the stem) find and relate the objects, and a conventionally
    trained model then depends on its block order (docs/own-data.md, "A stem that leaves the work to the
    blocks")."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        width = max(8, cfg.dim // 2)
        self.layers = nn.Sequential(
            nn.Conv2d(cfg.in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size),
        )

    def forward(self, images: Tensor) -> Tensor:
        return self.layers(images)  # (B, C, H, W) -> (B, D, H/P, W/P)


# The convolutional stems, by ViTConfig.stem; "patch" is the plain strided conv, kept apart for its weight key.
CONV_EMBEDS: dict[str, type[nn.Module]] = {"conv": ConvEmbed, "shallow": ShallowConvEmbed}


class Stem(nn.Module):
    """Normalisation, patch embedding (a strided conv, a ConvEmbed or a ShallowConvEmbed), class token and
    learned position embedding.

    Takes images in [0, 1]; the mean and std come from the config, so every caller agrees on them."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.mean: Tensor
        self.std: Tensor
        self.register_buffer("mean", torch.tensor(cfg.image_mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(cfg.image_std).view(1, -1, 1, 1), persistent=False)
        # The attribute name is the weight-file key: a patch stem keeps the name every shipped model has.
        self.embed_name = "conv_embed" if cfg.stem in CONV_EMBEDS else "patch_embed"
        if cfg.stem in CONV_EMBEDS:
            self.conv_embed = CONV_EMBEDS[cfg.stem](cfg)
        else:
            self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.num_tokens, cfg.dim) * cfg.pos_embed_init_std)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, images: Tensor) -> Tensor:
        embed: nn.Module = getattr(self, self.embed_name)
        x = embed((images - self.mean) / self.std)  # (B, D, H/P, W/P)
        x = x.flatten(2).transpose(1, 2)  # (B, N, D)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, D)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, T, D)
        return self.dropout(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """key_mask: (B, T) bool, True where a token may be attended to (text padding is False)."""
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, heads, T, D/heads)
        drop = self.dropout if self.training else 0.0
        if key_mask is None:  # images: exactly the call they always made
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :], dropout_p=drop)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward_queries(self, x: Tensor, rows: Tensor, key_mask: Tensor) -> Tensor:
        """Attention output for the tokens at `rows` only ((B, A) indices), attending to every unmasked
        token of x: frozen tokens still serve as keys and values, only active ones need queries."""
        b, t, d = x.shape
        hd = d // self.heads
        w_q, w_kv = torch.split(self.qkv.weight, [d, 2 * d])
        b_q, b_kv = torch.split(self.qkv.bias, [d, 2 * d])
        picked = x.gather(1, rows[..., None].expand(-1, -1, d))  # (B, A, D)
        q = F.linear(picked, w_q, b_q).reshape(b, -1, self.heads, hd).transpose(1, 2)
        k, v = F.linear(x, w_kv, b_kv).reshape(b, t, 2, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return self.proj(out.transpose(1, 2).reshape(b, -1, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class PositionAdapter(nn.Module):
    """LayerShuffle-position: concatenate a learned embedding of the current position to every
    token, then LN -> Linear(D + P -> D) -> GELU -> Dropout, added to the input."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.depth, cfg.position_dim)
        self.norm = nn.LayerNorm(cfg.dim + cfg.position_dim, eps=cfg.layer_norm_eps)
        self.proj = nn.Linear(cfg.dim + cfg.position_dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, position: int) -> Tensor:
        pos = self.embed.weight[position].expand(x.shape[0], x.shape[1], -1)  # (B, T, P)
        h = torch.cat([x, pos], dim=-1)  # (B, T, D + P)
        return x + self.dropout(F.gelu(self.proj(self.norm(h))))


class Block(nn.Module):
    """One pre-norm transformer block: the unit a node serves."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.depth = cfg.depth
        self.position_adapter = PositionAdapter(cfg) if cfg.variant == "layershuffle-position" else None
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dropout)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(cfg.dim, int(cfg.dim * cfg.mlp_ratio), cfg.dropout)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        # LayerShuffle-predict: a linear head that guesses the block's current position.
        self.position_head = nn.Linear(cfg.dim, cfg.depth) if cfg.variant == "layershuffle-predict" else None
        # Stochastic depth (Huang et al. 2016): in training only, each sample skips each residual branch
        # with this probability. Set by the trainer from its recipe; not a weight, not in the config.
        self.drop_path = 0.0

    def forward(self, x: Tensor, position: int = 0, key_mask: Tensor | None = None) -> Tensor:
        """key_mask: (B, T) bool, True for tokens that may be attended to (None: all, as for images)."""
        if not 0 <= position < self.depth:
            raise ValueError(f"position {position} outside [0, {self.depth})")
        if self.position_adapter is not None:
            x = self.position_adapter(x, position)
        if key_mask is None:
            x = x + self._kept(self.attn_dropout(self.attn(self.norm1(x))))
        else:
            x = x + self._kept(self.attn_dropout(self.attn(self.norm1(x), key_mask)))
        return x + self._kept(self.mlp(self.norm2(x)))

    def _kept(self, branch: Tensor) -> Tensor:
        """A residual branch, dropped per sample at the drop-path rate while training (and the kept ones
        scaled up, so its expected value is unchanged); the branch itself at inference."""
        if not self.training or self.drop_path == 0.0:
            return branch
        keep = 1.0 - self.drop_path
        mask = torch.empty(branch.shape[0], *(1,) * (branch.dim() - 1), device=branch.device).bernoulli_(keep)
        return branch * mask / keep  # (B, 1, 1)

    def forward_active(self, x: Tensor, position: int, key_mask: Tensor, rows: Tensor) -> Tensor:
        """The block's output for the tokens at `rows` ((B, A) indices) only: per-token depth. Frozen
        tokens are read as keys and values but get no query and no MLP, so compute shrinks with them."""
        if not 0 <= position < self.depth:
            raise ValueError(f"position {position} outside [0, {self.depth})")
        if self.position_adapter is not None:
            x = self.position_adapter(x, position)
        picked = x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))  # (B, A, D)
        h = picked + self.attn_dropout(self.attn.forward_queries(self.norm1(x), rows, key_mask))
        return h + self.mlp(self.norm2(h))

    def position_logits(self, out: Tensor) -> Tensor:
        """(B, T, D) block output -> (B, depth) logits of the position it held (predict variant)."""
        if self.position_head is None:
            raise RuntimeError("this block has no position head (variant is not layershuffle-predict)")
        return self.position_head(F.layer_norm(out.mean(dim=1), out.shape[-1:]))


class Head(nn.Module):
    """Final LayerNorm and the classifier on the class token."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.classifier = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.norm(x[:, 0]))  # (B, classes)


class ViT(nn.Module):
    """Stem, blocks and head, runnable in any block order (`order` lists block indices)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.stem = Stem(cfg)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.depth)])
        self.head = Head(cfg)
        self.apply(_init_weights)

    def forward(self, images: Tensor, order: Sequence[int] | None = None) -> Tensor:
        return self.head(self.features(images, order))

    def features(self, images: Tensor, order: Sequence[int] | None = None) -> Tensor:
        x = self.stem(images)
        for position, index in enumerate(self.default_order() if order is None else order):
            x = self.blocks[index](x, position)
        return x

    def default_order(self) -> list[int]:
        return list(range(len(self.blocks)))

    def set_drop_path(self, rate: float) -> None:
        """Stochastic depth for training (Block.drop_path): every block the same rate."""
        for block in self.blocks:
            assert isinstance(block, Block)
            block.drop_path = rate


def run_blocks(blocks: Sequence[nn.Module], x: Tensor, key_mask: Tensor | None = None) -> Tensor:
    """Run an explicit list of blocks (possibly from several models) at positions 0..k-1."""
    for position, block in enumerate(blocks):
        x = block(x, position) if key_mask is None else block(x, position, key_mask)
    return x


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
