"""The decoder's block (lm/model.py's DecoderBlock) in numpy, with per-stream KV caches.

    h   = x + Attention(RMSNorm(x), positions)        grouped-query, rotary positions of the TOKENS
    out = h + W_down(silu(W_gate(RMSNorm(h))) * W_up(RMSNorm(h)))

Weights by Hugging Face's Llama names (self_attn.q_proj.weight, mlp.gate_proj.weight, ...), float32.
Callers (the node) check shapes, starts and the context before a call; this module trusts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..lm.config import LMConfig
from .cache import KVCache
from .ops import F32, attention, linear, rms_norm, silu

Weights = dict[str, np.ndarray]


def block_shapes(cfg: LMConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a decoder block's file must hold, by name."""
    d, hs, hidden = cfg.dim, cfg.head_size, cfg.mlp_hidden
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (cfg.heads * hs, d),
        "self_attn.k_proj.weight": (cfg.kv_heads * hs, d),
        "self_attn.v_proj.weight": (cfg.kv_heads * hs, d),
        "self_attn.o_proj.weight": (d, cfg.heads * hs),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (hidden, d),
        "mlp.up_proj.weight": (hidden, d),
        "mlp.down_proj.weight": (d, hidden),
    }
    if cfg.qkv_bias:
        shapes.update(
            {
                "self_attn.q_proj.bias": (cfg.heads * hs,),
                "self_attn.k_proj.bias": (cfg.kv_heads * hs,),
                "self_attn.v_proj.bias": (cfg.kv_heads * hs,),
            }
        )
    return shapes


class DecoderBlock:
    def __init__(self, cfg: LMConfig, w: Weights) -> None:
        self.cfg, self.w = cfg, w
        self.heads, self.kv_heads, self.hs = cfg.heads, cfg.kv_heads, cfg.head_size
        self.eps = cfg.norm_eps
        # lm/model.rotary's frequencies, in float32 as torch computes them
        self.inv_freq = F32(1.0) / (F32(cfg.rope_theta) ** (np.arange(0, self.hs, 2).astype(F32) / F32(self.hs)))

    def new_cache(self) -> KVCache:
        return KVCache(self.kv_heads, self.hs)

    def __call__(self, x: np.ndarray, caches: Sequence[KVCache] | None = None) -> np.ndarray:
        """x (B, T, D) -> (B, T, D). Without caches: the tokens of x are the whole context, from
        position 0 (causal). With one cache per row: row b's tokens follow what its cache holds; their
        keys and values are appended, and each query sees its stream's keys up to its own position."""
        b, t, _ = x.shape
        start = np.array([c.length for c in caches] if caches is not None else [0] * b)
        positions = start[:, None] + np.arange(t)[None, :]  # (B, T)
        cos, sin = self._rotary(positions)
        normed = rms_norm(x, self.w["input_layernorm.weight"], self.eps)
        q = _rotate(self._heads(normed, "q_proj", self.heads), cos, sin)  # (B, H, T, hs)
        k, v = self._keys_values(normed, cos, sin)  # (B, KV, T, hs)
        if caches is None:
            causal = np.tril(np.ones((t, t), dtype=bool))
            out = attention(q, self._grouped(k), self._grouped(v), causal)
        else:
            out = np.concatenate(
                [self._attend_cached(q[row], k[row], v[row], positions[row], cache) for row, cache in enumerate(caches)]
            )
        attn = linear(out.transpose(0, 2, 1, 3).reshape(b, t, -1), self.w["self_attn.o_proj.weight"])
        h = x + attn
        return h + self._mlp(rms_norm(h, self.w["post_attention_layernorm.weight"], self.eps))

    def append_kv(self, x: np.ndarray, caches: Sequence[KVCache]) -> None:
        """Only the keys and values of x (B, T, D) into the caches, no output (CALM's skipped blocks)."""
        start = np.array([c.length for c in caches])
        positions = start[:, None] + np.arange(x.shape[1])[None, :]
        cos, sin = self._rotary(positions)
        k, v = self._keys_values(rms_norm(x, self.w["input_layernorm.weight"], self.eps), cos, sin)
        for row, cache in enumerate(caches):
            cache.append(k[row], v[row])

    def _attend_cached(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, cache: KVCache
    ) -> np.ndarray:
        """One row: append its keys and values, then its queries (H, T, hs) against all it holds."""
        cache.append(k, v)
        keys, values = self._grouped(cache.keys[None])[0], self._grouped(cache.values[None])[0]  # (H, S, hs)
        allowed = None
        if q.shape[1] > 1:  # several queries: each sees the keys up to its own position
            allowed = np.arange(keys.shape[1])[None, :] <= positions[:, None]  # (T, S)
        return attention(q, keys, values, allowed)[None]

    def _heads(self, x: np.ndarray, name: str, heads: int) -> np.ndarray:
        b, t, _ = x.shape
        out = linear(x, self.w[f"self_attn.{name}.weight"], self.w.get(f"self_attn.{name}.bias"))
        return out.reshape(b, t, heads, self.hs).transpose(0, 2, 1, 3)

    def _keys_values(self, normed: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = _rotate(self._heads(normed, "k_proj", self.kv_heads), cos, sin)
        return k, self._heads(normed, "v_proj", self.kv_heads)

    def _grouped(self, kv: np.ndarray) -> np.ndarray:
        """(B, KV, S, hs) -> (B, H, S, hs): each key/value head serves heads / kv_heads query heads."""
        return np.repeat(kv, self.heads // self.kv_heads, axis=1) if self.heads != self.kv_heads else kv

    def _rotary(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (B, 1, T, hs) for token positions (B, T), Llama's half-split layout."""
        freqs = positions[..., None].astype(F32) * self.inv_freq  # (B, T, hs / 2)
        emb = np.concatenate([freqs, freqs], axis=-1)[:, None]
        return np.cos(emb), np.sin(emb)

    def _mlp(self, x: np.ndarray) -> np.ndarray:
        w = self.w
        gate = silu(linear(x, w["mlp.gate_proj.weight"]))
        return linear(gate * linear(x, w["mlp.up_proj.weight"]), w["mlp.down_proj.weight"])


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each (x_i, x_{i + hs/2}) pair of x (B, heads, T, hs) by its token's angle."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
