"""Model hyperparameters: one dataclass, saved beside the weights in every model directory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

KINDS = ("image", "text")
# Fields only a text model has: left out of an image config's dict, so image model ids stay unchanged.
TEXT_FIELDS = ("kind", "vocab_size", "max_tokens")
# How images become tokens: one strided conv; a few 3x3 stride-2 convs (vit.ConvEmbed); or one 3x3 conv at
# full resolution before the strided one (vit.ShallowConvEmbed).
STEMS = ("patch", "conv", "shallow")
VARIANTS = ("baseline", "layershuffle", "layershuffle-position", "layershuffle-predict", "layerdrop")
# Variants whose blocks were trained to work at any position (the coordinator may shuffle them).
SHUFFLE_ROBUST_VARIANTS = frozenset({"layershuffle", "layershuffle-position", "layershuffle-predict"})


def is_shuffle_robust(variant: str) -> bool:
    """Whether this variant's blocks were trained to work at any position (the swarm may reorder them)."""
    return variant in SHUFFLE_ROBUST_VARIANTS


MIN_PATCHES_A_SIDE = 7  # a from-scratch ViT needs tokens to attend across: 32 x 32 with 8-pixel patches has 16
# A conv stem's tokens already see their neighbourhood (3x3 convs), so fewer, cheaper ones do: measured on the
# relations task (docs/own-data.md), 4 x 4 tokens learned faster per step and per second than 8 x 8.
CONV_MIN_PATCHES_A_SIDE = 4


def patch_size_for(image_size: int, stem: str = "patch") -> int:
    """The patch side a from-scratch model of this image size gets: the largest of 16, 8, 4, 2 that divides
    it and leaves at least MIN_PATCHES_A_SIDE patches a side (32 -> 4, 16 -> 2, 64 -> 8, 224 -> 16), or
    CONV_MIN_PATCHES_A_SIDE for a conv or shallow stem (32 -> 8, 16 -> 4, 64 -> 16, 224 -> 16)."""
    least = MIN_PATCHES_A_SIDE if stem == "patch" else CONV_MIN_PATCHES_A_SIDE
    for patch in (16, 8, 4, 2):
        if image_size % patch == 0 and image_size // patch >= least:
            return patch
    return 1


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 32
    patch_size: int = 8
    in_channels: int = 3
    num_classes: int = 10
    dim: int = 64
    depth: int = 6
    heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6
    variant: str = "layershuffle"
    position_dim: int = 32  # layershuffle-position: size of the per-block position embedding
    layerdrop: float = 0.2  # layerdrop: probability of dropping a block during training
    # A std of 0.02 (ViT-B's) made tiny models learn very slowly here; 1.0 trains fast.
    pos_embed_init_std: float = 1.0
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    class_names: tuple[str, ...] = field(default_factory=tuple)
    # "patch" is the default so configs written before the conv stem existed load as what they are.
    stem: str = "patch"
    kind: str = "image"  # image | text: what the stem takes (blocks and head are the same code)
    vocab_size: int = 0  # text: tokenizer vocabulary (DIR/tokenizer.json)
    max_tokens: int = 0  # text: longest token sequence, [CLS] included

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.kind not in KINDS:
            raise ValueError(f"unknown model kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind == "text" and (self.vocab_size < 4 or self.max_tokens < 2):
            raise ValueError("a text model needs vocab_size >= 4 and max_tokens >= 2")
        if self.kind == "image" and self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.stem not in STEMS:
            raise ValueError(f"unknown stem {self.stem!r}; choose one of {', '.join(STEMS)}")
        if self.stem == "conv" and self.patch_size & (self.patch_size - 1):
            raise ValueError(f"a conv stem needs a power-of-two patch size, got {self.patch_size}")
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not a multiple of heads {self.heads}")
        if self.depth < 1:
            raise ValueError("depth must be at least 1")
        if not 0.0 <= self.layerdrop < 1.0:
            raise ValueError("layerdrop must be in [0, 1)")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """T: patches + class token for images; the longest sequence for text (shorter ones are allowed)."""
        return self.max_tokens if self.kind == "text" else self.num_patches + 1

    @property
    def is_text(self) -> bool:
        return self.kind == "text"

    @property
    def shuffle_robust(self) -> bool:
        return is_shuffle_robust(self.variant)

    def architecture(self) -> dict[str, Any]:
        """The fields that decide tensor shapes: blocks can only be mixed when these agree."""
        keys = ("image_size", "patch_size", "in_channels", "num_classes", "dim", "depth", "heads", "mlp_ratio")
        arch = {k: getattr(self, k) for k in keys}
        arch["block_kind"] = "position" if self.variant == "layershuffle-position" else "plain"
        if self.variant == "layershuffle-position":
            arch["position_dim"] = self.position_dim
        if self.is_text:
            arch.update(kind=self.kind, vocab_size=self.vocab_size, max_tokens=self.max_tokens)
        return arch

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not self.is_text:  # image manifests written before text existed hash exactly as before
            for key in TEXT_FIELDS:
                data.pop(key)
        if self.stem == "patch":  # ... and so do those written before the conv stem
            data.pop("stem")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ViTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        values = dict(data)
        for key in ("image_mean", "image_std", "class_names"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)

    def replace(self, **changes: Any) -> ViTConfig:
        return dataclasses.replace(self, **changes)
