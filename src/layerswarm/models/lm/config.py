"""The decoder's hyperparameters: one frozen dataclass, saved in every model directory's manifest.

Its dict carries "kind": "lm", which is how a manifest says which family its config belongs to
(checkpoint.config_from_dict); classifier configs never carry that value, so their ids are unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import is_shuffle_robust

KIND = "lm"
# The training approaches a decoder takes: the paper's LayerShuffle, LayerDrop, and in-order training.
LM_VARIANTS = ("baseline", "layershuffle", "layerdrop")


def swiglu_hidden(dim: int, multiple_of: int = 16) -> int:
    """Llama's MLP width for a model of width `dim`: 2/3 of 4 x dim (so the gated MLP costs what a 4 x dim
    GELU MLP does), rounded up to a multiple of `multiple_of`."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 512
    dim: int = 64  # D: the width of the residual stream, what travels between nodes
    depth: int = 6  # blocks, one node each
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads (grouped-query attention: heads is a multiple of kv_heads)
    head_dim: int = 0  # 0: dim // heads (some imported checkpoints set their own)
    hidden_dim: int = 0  # the gated MLP's width; 0: swiglu_hidden(dim)
    max_seq_len: int = 256  # the context: prompt plus generated tokens
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # the LM head reuses the token embedding (no matrix of its own)
    qkv_bias: bool = False  # Qwen2's layout: biases on the query, key and value projections
    variant: str = "layershuffle"
    layerdrop: float = 0.2  # variant layerdrop: the chance that a block sits out a training batch
    bos_id: int = 1  # the tokenizer's begin-of-sequence id, put before every prompt (-1: none)
    eos_id: int = 2  # generation stops at this id
    pad_id: int = 0  # fills batches; never a target, never attended to
    kind: str = KIND

    def __post_init__(self) -> None:
        if self.kind != KIND:
            raise ValueError(f"an LMConfig has kind {KIND!r}, got {self.kind!r}")
        if self.variant not in LM_VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r} for a language model; choose one of {LM_VARIANTS}")
        if min(self.vocab_size, self.dim, self.depth, self.heads, self.kv_heads, self.max_seq_len) < 1:
            raise ValueError("vocab_size, dim, depth, heads, kv_heads and max_seq_len must be at least 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if not self.head_dim and self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not a multiple of heads {self.heads} (or set head_dim)")
        if self.head_size % 2:
            raise ValueError(f"rotary positions need an even head size, got {self.head_size}")
        if not 0.0 <= self.layerdrop < 1.0:
            raise ValueError("layerdrop must be in [0, 1)")
        for name in ("bos_id", "eos_id", "pad_id"):
            if not -1 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name} {getattr(self, name)} outside the vocabulary of {self.vocab_size}")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def mlp_hidden(self) -> int:
        return self.hidden_dim or swiglu_hidden(self.dim)

    @property
    def shuffle_robust(self) -> bool:
        return is_shuffle_robust(self.variant)

    @property
    def is_text(self) -> bool:
        """Not the text classifier's kind (its [CLS]-led tokens): a decoder has its own tokenizer rules."""
        return False

    def architecture(self) -> dict[str, Any]:
        """The fields that decide tensor shapes and what a block computes: blocks mix only when these agree."""
        keys = ("kind", "vocab_size", "dim", "depth", "heads", "kv_heads", "head_size", "mlp_hidden")
        arch = {k: getattr(self, k) for k in keys}
        arch.update(rope_theta=self.rope_theta, norm_eps=self.norm_eps, qkv_bias=self.qkv_bias)
        return arch

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LMConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        return cls(**data)

    def replace(self, **changes: Any) -> LMConfig:
        return dataclasses.replace(self, **changes)
