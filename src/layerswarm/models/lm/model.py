"""A Llama-layout causal decoder in three parts that can run on different machines.

    tokens (B, T) -> TokenEmbedding -> (B, T, D) -> DecoderBlock x depth (any order) -> LMHead -> (B, T, V)

Each block: RMSNorm pre-norm, grouped-query attention with rotary positions, a SwiGLU gated MLP:

    h   = x + Attention(RMSNorm(x), positions)
    out = h + W_down(silu(W_gate(RMSNorm(h))) * W_up(RMSNorm(h)))

Rotary positions are the TOKENS' positions (start + t), never the block's: a block computes the same
thing wherever it sits in the route, so block order is free. The parameter names are Hugging Face's
Llama names (q_proj, ..., gate_proj), so an imported checkpoint maps one to one (hf_import.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .config import LMConfig
from .generate import Sampling, generate

INIT_STD = 0.02  # nanoGPT / GPT-2: every weight N(0, 0.02), residual projections scaled by 1/sqrt(2 x depth)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # In float32 whatever x is (as Llama does), then back: half-precision squares overflow.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(positions: Tensor, head_size: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin (B, 1, T, head_size) for token positions (B, T), in Llama's half-split layout."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_size, 2, dtype=torch.int64, device=positions.device).float() / head_size)
    )
    freqs = positions[..., None].float() * inv_freq  # (B, T, head_size / 2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, head_size)
    return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (x_i, x_{i + hs/2}) pair of x (B, heads, T, hs) by its token's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def check_rows(name: str, value: Tensor, rows: int) -> Tensor:
    if value.dim() != 1 or value.shape[0] != rows:
        raise ValueError(f"{name} must be ({rows},), one per row; got {tuple(value.shape)}")
    return value.to(torch.long)


class Attention(nn.Module):
    """Grouped-query attention: `heads` query heads share `kv_heads` key/value heads."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_size = cfg.heads, cfg.kv_heads, cfg.head_size
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * cfg.head_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_size, cfg.dim, bias=False)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated keys and values (B, kv_heads, T, hs) of x (B, T, D), normed already."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_size).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_size).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x: Tensor, positions: Tensor, caches: Sequence[KVCache] | None, new_tokens: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_size).transpose(1, 2)  # (B, H, T, hs)
        cos, sin = rotary(positions, self.head_size, self.rope_theta)
        q = apply_rotary(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)  # (B, KV, T, hs)
        if caches is None:  # the tokens of x are the whole context: plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
        else:
            out = _attend_cached(q, k, v, positions, caches, new_tokens)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_size))


def _attend_cached(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, caches: Sequence[KVCache], new_tokens: Tensor
) -> Tensor:
    """Append each row's real new keys/values to its cache, then attend row by row: row b's query t sits
    at position positions[b, t] and sees the keys at positions 0 .. positions[b, t] of its own stream.

    Row by row rather than one padded (B, KV, S, hs) batch: padding copied every row's whole cache into a
    zeroed tensor at every step before a masked attention over it. 16 streams' decode step, 768 wide, one
    thread: 29.3 ms padded, 19.2 ms row by row (`layerswarm bench --only decode-node`,
    docs/results/decode-node.json). The projections and the MLP still run on all rows at once."""
    outs = []
    for row, cache in enumerate(caches):
        n = int(new_tokens[row])
        cache.append(k[row, :, :n], v[row, :, :n])
        keys, values = cache.keys[None], cache.values[None]  # (1, KV, S, hs): S = what the stream holds
        mask = None  # one query (a decode step) sees every key its stream holds
        if q.shape[2] > 1:  # several: each sees the keys up to its own position (padded queries: all held)
            slots = torch.arange(keys.shape[2], device=q.device)
            mask = (slots[None, :] <= positions[row, :, None])[None, None]  # (1, 1, T, S)
        outs.append(F.scaled_dot_product_attention(q[row : row + 1], keys, values, attn_mask=mask, enable_gqa=True))
    return torch.cat(outs)


class SwiGLU(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """One decoder block: the unit a node serves. Prefill, decode and speculative verify are one call."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def new_cache(self) -> KVCache:
        """An empty cache for one stream at this block."""
        return KVCache(self.self_attn.kv_heads, self.self_attn.head_size)

    def forward(
        self,
        x: Tensor,
        start: Tensor | None = None,
        caches: Sequence[KVCache] | None = None,
        new_tokens: Tensor | None = None,
    ) -> Tensor:
        """x (B, T, D): T new tokens per row -> (B, T, D).

        start (B,): tokens each row already has (its cache length before this call); row b's tokens sit at
            positions start[b] .. start[b] + T - 1. None: the caches' lengths, or 0 without caches.
        caches: one KVCache per row, which gets the new tokens' keys and values appended (rows may hold
            different lengths: padded and masked), or None to attend within x only (training, full forward).
        new_tokens (B,): how many of the T tokens are real in each row (right padding); None: all T.
            Only real tokens reach a cache; the outputs at padded places are meaningless.
        """
        start, new_tokens = self._rows(x, start, caches, new_tokens)
        positions = start[:, None] + torch.arange(x.shape[1], device=x.device)  # (B, T)
        h = x + self.self_attn(self.input_layernorm(x), positions, caches, new_tokens)
        return h + self.mlp(self.post_attention_layernorm(h))

    def append_kv(self, x: Tensor, caches: Sequence[KVCache], new_tokens: Tensor | None = None) -> None:
        """Only the keys and values of x (B, T, D) into the caches, no output: what an early exit (CALM)
        leaves in the blocks it skips, computed from the state the token exited with."""
        start, new_tokens = self._rows(x, None, caches, new_tokens)
        positions = start[:, None] + torch.arange(x.shape[1], device=x.device)
        cos, sin = rotary(positions, self.self_attn.head_size, self.self_attn.rope_theta)
        k, v = self.self_attn.keys_values(self.input_layernorm(x), cos, sin)
        for row, cache in enumerate(caches):
            n = int(new_tokens[row])
            cache.append(k[row, :, :n], v[row, :, :n])

    def _rows(
        self, x: Tensor, start: Tensor | None, caches: Sequence[KVCache] | None, new_tokens: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """start and new_tokens per row, checked: what a node must refuse rather than compute."""
        if x.dim() != 3:
            raise ValueError(f"activations must be (B, T, D), got {tuple(x.shape)}")
        b, t, _ = x.shape
        if caches is not None and len(caches) != b:
            raise ValueError(f"{len(caches)} caches for {b} rows: one per row")
        held = torch.tensor([c.length for c in caches], device=x.device) if caches is not None else None
        if start is None:
            start = held if held is not None else torch.zeros(b, dtype=torch.long, device=x.device)
        start = check_rows("start", start, b)
        if held is not None and not torch.equal(start, held):
            raise ValueError(f"start {start.tolist()} differs from the caches' lengths {held.tolist()}")
        counts = torch.full((b,), t, device=x.device) if new_tokens is None else check_rows("new_tokens", new_tokens, b)
        if bool(((counts < 1) | (counts > t)).any()) or bool((start < 0).any()):
            raise ValueError(f"every row needs 1..{t} new tokens and a start of at least 0")
        if int((start + counts).max()) > self.max_seq_len:
            raise ValueError(
                f"a row would reach {int((start + counts).max())} tokens; the context is {self.max_seq_len}"
            )
        return start, counts


class TokenEmbedding(nn.Module):
    """The stem: token ids (B, T) -> (B, T, D). Positions are applied inside attention, not here."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return self.embed_tokens(tokens)


class LMHead(nn.Module):
    """Final RMSNorm and the projection to vocabulary logits. With tied embeddings the projection is the
    stem's embedding matrix, which this module reads but does not own (its file holds only the norm)."""

    def __init__(self, cfg: LMConfig, tied_to: TokenEmbedding | None = None) -> None:
        super().__init__()
        if cfg.tie_embeddings and tied_to is None:
            raise ValueError("a config with tie_embeddings needs the stem the head is tied to")
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # A list, so the stem is not registered as a submodule (its weights stay in the stem's file).
        self._tied: list[TokenEmbedding] = [tied_to] if tied_to is not None and cfg.tie_embeddings else []

    def weight(self) -> Tensor:
        return self._tied[0].embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.norm(x), self.weight())  # (B, T, V)


def new_stem_head(cfg: LMConfig) -> tuple[TokenEmbedding, LMHead]:
    stem = TokenEmbedding(cfg)
    return stem, LMHead(cfg, stem if cfg.tie_embeddings else None)


class DecoderLM(nn.Module):
    """Stem, blocks and head in one process: the reference every distributed run is compared with."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.stem, self.head = new_stem_head(cfg)
        self.blocks = nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg.depth)])
        self.apply(_init_weights)
        for name, param in self.named_parameters():  # GPT-2: residual writes scaled down with depth
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, std=INIT_STD / math.sqrt(2 * cfg.depth))

    def default_order(self) -> list[int]:
        return list(range(len(self.blocks)))

    def route(self, order: Sequence[int] | None = None) -> list[DecoderBlock]:
        """The blocks in the order given (block indices; None: in order)."""
        return [self.blocks[i] for i in (self.default_order() if order is None else order)]  # type: ignore[misc]

    def forward(self, tokens: Tensor, order: Sequence[int] | None = None) -> Tensor:
        """tokens (B, T) -> next-token logits (B, T, V), every token attending to those before it."""
        x = self.stem(tokens)
        for block in self.route(order):
            x = block(x)
        return self.head(x)

    def new_caches(self, rows: int) -> list[list[KVCache]]:
        """Empty caches, [block index][row]."""
        return [[block.new_cache() for _ in range(rows)] for block in self.route()]

    @torch.no_grad()
    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        order: Sequence[int] | None = None,
    ) -> list[int]:
        """The reference generation: greedy at temperature 0, else sampled (top-k, top-p; same seed, same
        tokens). Stops at eos (not returned) or after max_new_tokens."""
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return generate(
            self.stem, self.route(order), self.head, [list(prompt)], max_new_tokens, self.cfg.eos_id, sampling
        )[0]


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=INIT_STD)
