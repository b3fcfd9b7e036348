"""Text hops: the token mask a hop carries, the request's full or split form, and the reply that
holds only the tokens it computed (models/text/tokens.py defines the mask codes)."""

from __future__ import annotations

import torch

from layerswarm.models.text.tokens import (
    FROZEN_CODE,
    active_count,
    hop_mask,
    join_states,
    scatter_active,
    split_states,
)
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

__all__ = ["active_count", "hop_mask", "text_reply", "text_request"]


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
