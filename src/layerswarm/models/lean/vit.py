"""The classifier's block (vit.Block) in numpy: images and text, the position-aware variant, token masks.

    x (B, T, D) [+ position adapter] -> x + Attention(LN(x)) -> x + MLP(LN(x))

Weights by vit.Block's state-dict names (norm1.weight, attn.qkv.weight, ...), float32.
"""

from __future__ import annotations

import numpy as np

from ..config import ViTConfig
from ..text.codes import PAD_CODE, active_rows
from .ops import F32, attention, gelu, layer_norm, linear

Weights = dict[str, np.ndarray]


def block_shapes(cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a block's file must hold, by name: what load_state_dict(strict=True) would ask."""
    d, hidden = cfg.dim, int(cfg.dim * cfg.mlp_ratio)
    shapes: dict[str, tuple[int, ...]] = {
        "norm1.weight": (d,),
        "norm1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "norm2.weight": (d,),
        "norm2.bias": (d,),
        "mlp.fc1.weight": (hidden, d),
        "mlp.fc1.bias": (hidden,),
        "mlp.fc2.weight": (d, hidden),
        "mlp.fc2.bias": (d,),
    }
    if cfg.variant == "layershuffle-position":
        p = cfg.position_dim
        shapes.update(
            {
                "position_adapter.embed.weight": (cfg.depth, p),
                "position_adapter.norm.weight": (d + p,),
                "position_adapter.norm.bias": (d + p,),
                "position_adapter.proj.weight": (d, d + p),
                "position_adapter.proj.bias": (d,),
            }
        )
    if cfg.variant == "layershuffle-predict":
        shapes.update({"position_head.weight": (cfg.depth, d), "position_head.bias": (cfg.depth,)})
    return shapes


class ViTBlock:
    """Forward only; `w` holds the block's tensors, checked against block_shapes by the loader."""

    def __init__(self, cfg: ViTConfig, w: Weights) -> None:
        self.cfg, self.w = cfg, w
        self.heads, self.eps, self.depth = cfg.heads, cfg.layer_norm_eps, cfg.depth
        self.positional = cfg.variant == "layershuffle-position"

    def __call__(self, x: np.ndarray, position: int, key_mask: np.ndarray | None = None) -> np.ndarray:
        """x (B, T, D) -> (B, T, D); key_mask (B, T) bool: True for tokens that may be attended to."""
        self._check_position(position)
        x = self._adapted(x, position)
        x = x + self._attend(layer_norm(x, self.w["norm1.weight"], self.w["norm1.bias"], self.eps), key_mask)
        return x + self._mlp(x)

    def forward_tokens(self, x: np.ndarray, position: int, mask: np.ndarray) -> np.ndarray:
        """The new states of the active tokens only, (N_active, D) row-major (vit.Block.forward_active):
        frozen tokens are keys and values, padding is neither."""
        self._check_position(position)
        rows, valid = active_rows(mask)
        if rows.shape[1] == 0:
            return np.zeros((0, x.shape[-1]), dtype=F32)
        x = self._adapted(x, position)
        picked = np.take_along_axis(x, rows[..., None], axis=1)  # (B, A, D)
        normed = layer_norm(x, self.w["norm1.weight"], self.w["norm1.bias"], self.eps)
        h = picked + self._attend(normed, mask > PAD_CODE, rows)
        return (h + self._mlp(h))[valid]

    def _check_position(self, position: int) -> None:
        if not 0 <= position < self.depth:
            raise ValueError(f"position {position} outside [0, {self.depth})")

    def _adapted(self, x: np.ndarray, position: int) -> np.ndarray:
        """LayerShuffle-position: x + GELU(Linear(LN([x, embed(position)])))."""
        if not self.positional:
            return x
        w = self.w
        pos = np.broadcast_to(w["position_adapter.embed.weight"][position], (*x.shape[:2], self.cfg.position_dim))
        h = np.concatenate([x, pos], axis=-1)
        h = layer_norm(h, w["position_adapter.norm.weight"], w["position_adapter.norm.bias"], self.eps)
        return x + gelu(linear(h, w["position_adapter.proj.weight"], w["position_adapter.proj.bias"]))

    def _attend(self, x: np.ndarray, key_mask: np.ndarray | None, rows: np.ndarray | None = None) -> np.ndarray:
        """Self-attention of the normed x (B, T, D); with `rows` (B, A) only those tokens ask (queries)."""
        b, t, d = x.shape
        hd = d // self.heads
        qkv = linear(x, self.w["attn.qkv.weight"], self.w["attn.qkv.bias"])  # (B, T, 3D)
        qkv = qkv.reshape(b, t, 3, self.heads, hd).transpose(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if rows is not None:
            q = np.take_along_axis(q, rows[:, None, :, None], axis=2)  # (B, H, A, hd)
        allowed = None if key_mask is None else key_mask[:, None, None, :]
        out = attention(q, k, v, allowed)  # (B, H, Tq, hd)
        out = out.transpose(0, 2, 1, 3).reshape(b, -1, d)
        return linear(out, self.w["attn.proj.weight"], self.w["attn.proj.bias"])

    def _mlp(self, x: np.ndarray) -> np.ndarray:
        w = self.w
        h = layer_norm(x, w["norm2.weight"], w["norm2.bias"], self.eps)
        h = gelu(linear(h, w["mlp.fc1.weight"], w["mlp.fc1.bias"]))
        return linear(h, w["mlp.fc2.weight"], w["mlp.fc2.bias"])
