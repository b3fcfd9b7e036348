"""Text hops: the token mask a hop carries, the reply that holds only the tokens it computed, and
what a hop cost in tokens and bytes (models/text/tokens.py defines the mask codes)."""

from __future__ import annotations

import torch

from layerswarm.models.text.tokens import (
    ACTIVE_CODE,
    FROZEN_CODE,
    active_count,
    hop_mask,
    join_states,
    scatter_active,
    split_states,
)
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from .wire_choice import wire_bytes

__all__ = ["hop_mask", "text_hop_cost", "text_reply", "text_request"]


def uses_split(mask: torch.Tensor, wire: torch.dtype, frozen_dtype: torch.dtype | None) -> bool:
    """Frozen tokens travel apart when a compact dtype is asked for and the hop has both kinds."""
    if frozen_dtype is None or frozen_dtype == wire:
        return False
    return bool((mask == FROZEN_CODE).any()) and active_count(mask) > 0


def text_request(
    x: torch.Tensor, mask: torch.Tensor, wire: torch.dtype, frozen_dtype: torch.dtype | None
) -> tuple[pb.Tensor, pb.Tensor | None, torch.Tensor | None]:
    """A text hop's tensors: (activations, frozen, what the node decodes). The full form sends every
    position of x in `wire` (frozen None; the node's input is codec.as_sent(x, wire), so None); the
    split form sends the active rows in `wire` and the frozen rows in `frozen_dtype`, and returns
    the (B, T, D) float32 input the node rebuilds from them, for verification."""
    if not uses_split(mask, wire, frozen_dtype):
        return codec.encode(x, wire), None, None
    assert frozen_dtype is not None
    active, frozen = split_states(x, mask)
    (active_msg, active_sent), (frozen_msg, frozen_sent) = (
        codec.encode_sent(active, wire),
        codec.encode_sent(frozen, frozen_dtype),
    )
    return active_msg, frozen_msg, join_states(mask, active_sent, frozen_sent)


def text_reply(x: torch.Tensor, mask: torch.Tensor, reply: pb.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """x with the active tokens replaced by the reply's (N_active, D) states; a reply of any other
    shape or dtype raises TensorError (the node is quarantined as for a malformed image reply)."""
    n_active = active_count(mask)
    spec = codec.TensorSpec((n_active, x.shape[-1]))
    updates = codec.decode(reply, spec)
    if codec.torch_dtype(reply.dtype) != wire_dtype:  # int8 decodes to float32: compare the wire's own
        raise codec.TensorError(f"reply dtype {updates.dtype}, asked for {wire_dtype}")
    return scatter_active(x, mask, updates.to(torch.float32))


def text_hop_cost(
    x: torch.Tensor,
    key_mask: torch.Tensor,
    token_depth: torch.Tensor | None,
    hops_run: int,
    wire: torch.dtype,
    frozen_dtype: torch.dtype | None = None,
) -> tuple[int, int]:
    """(tokens computed, tensor payload bytes) of one text hop as `text_request` encodes it: the
    request carries every position of x (or, split, the active rows in `wire` and the frozen ones in
    `frozen_dtype`) and the float32 mask; the reply only the active tokens, in `wire`."""
    mask = hop_mask(key_mask, token_depth, hops_run)
    dim = x.shape[-1]
    tokens = int((mask == ACTIVE_CODE).sum())
    if uses_split(mask, wire, frozen_dtype):
        assert frozen_dtype is not None
        frozen = int((mask == FROZEN_CODE).sum())
        request = wire_bytes(tokens * dim, dim, wire) + wire_bytes(frozen * dim, dim, frozen_dtype)
    else:
        request = wire_bytes(x.numel(), dim, wire)
    return tokens, request + mask.numel() * 4 + wire_bytes(tokens * dim, dim, wire)
