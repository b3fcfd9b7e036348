"""Text hops: the token mask a hop carries, the reply that holds only the tokens it computed, and
what a hop cost in tokens and bytes (models/text/tokens.py defines the mask codes)."""

from __future__ import annotations

import torch

from layerswarm.models.text.tokens import ACTIVE_CODE, active_count, hop_mask, scatter_active
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

__all__ = ["hop_mask", "text_hop_cost", "text_reply"]


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
    x: torch.Tensor, key_mask: torch.Tensor, token_depth: torch.Tensor | None, hops_run: int, itemsize: int = 4
) -> tuple[int, int]:
    """(tokens computed, tensor payload bytes) of one text hop: the request carries every position of
    x and the mask, the reply only the active tokens."""
    mask = hop_mask(key_mask, token_depth, hops_run)
    tokens = int((mask == ACTIVE_CODE).sum())
    request = x.numel() * itemsize + mask.numel() * 4
    return tokens, request + tokens * x.shape[-1] * itemsize
