"""One hop's call: encode, send over the pooled channel, check the reply's form, measure the link.

What a hop means for the path (retry elsewhere, hedge, verify, skip) is the executor's; this module only
turns one Forward call into float32 activations or a HopFailed that says why. A text hop carries a
token mask and may send frozen tokens apart (models/text/tokens.py defines the mask codes), and its
reply holds only the tokens it computed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import NamedTuple

import grpc
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

from ..membership.clients import ClientPool
from ..membership.linkmap import COORDINATOR
from ..membership.records import Evidence, NodeRecord
from ..membership.registry import Registry
from .request import Request
from .wire_choice import WireFormat

log = logging.getLogger(__name__)


class HopFailed(Exception):
    """A hop that gave no usable answer: why, and whether the node is to be quarantined (with evidence)."""

    def __init__(
        self, message: str, quarantine: bool = False, evidence: Evidence | None = None, blame: bool = True
    ) -> None:
        super().__init__(message)
        self.quarantine = quarantine
        self.evidence = evidence  # set when verification caught a lie (a conviction)
        # False: the reply is not used, but nothing says this node is at fault (contested weights: the
        # registry keeps every replica out already), so it is neither quarantined nor counted as failed
        self.blame = blame


class HopResult(NamedTuple):
    out: torch.Tensor  # float32, the shape of the request's x
    token_mask: torch.Tensor | None  # a text hop's mask
    wire: torch.dtype  # the activations' wire dtype
    sent: torch.Tensor | None  # what the node decoded, when not codec.as_sent(x, wire) (text, split form)
    wire_bytes: int  # tensor payload of the request (activations, frozen, mask) and the reply
    tokens: int | None  # text: the tokens the node computed


class HopCaller:
    def __init__(self, registry: Registry, pool: ClientPool, wire: WireFormat, hop_timeout_s: float) -> None:
        self.registry = registry
        self.pool = pool
        self.wire = wire
        self.hop_timeout_s = hop_timeout_s

    def wire_for(self, record: NodeRecord, x: torch.Tensor) -> torch.dtype:
        """The wire dtype, or with --wire-dtype auto the one this link pays for."""
        if self.wire.choice is None:
            return self.wire.dtype
        links = self.registry.links
        measured = [links.per_mb(COORDINATOR, record.address), links.per_mb(record.address, COORDINATOR)]
        return self.wire.choice.choose(measured, x.numel())

    async def forward(
        self, record: NodeRecord, x: torch.Tensor, position: int, request: Request, route_id: str, path_length: int
    ) -> HopResult:
        """One Forward call and the reply's form checked (shape, dtype, finite): float32 out, the
        text hop's token mask, the wire dtype used and, for a split text hop, what the node decoded.
        `route_id`: the request id the node sees (an ensemble's routes are told apart). Raises HopFailed."""
        wire = self.wire_for(record, x)
        timeout = min(self.hop_timeout_s, max(0.001, request.deadline - time.monotonic()))
        key_mask, depth = request.key_mask, request.options.token_depth
        token_mask = None if key_mask is None else hop_mask(key_mask, depth, position)
        if token_mask is None:
            activations, frozen, sent = codec.encode(x, wire), None, None
        else:
            activations, frozen, sent = text_request(x, token_mask, wire, self.wire.frozen_dtype)
        request_pb = pb.ForwardRequest(
            request_id=route_id,
            activations=activations,
            position=position,
            path_length=path_length,
            token_mask=None if token_mask is None else codec.encode(token_mask),
            frozen=frozen,
        )
        record.begin_call()
        started = time.monotonic()
        try:
            reply = await self.pool.get(record.address).forward(request_pb, timeout)
        except grpc.aio.AioRpcError as exc:
            raise HopFailed(f"{exc.code().name}: {exc.details()}") from exc
        except asyncio.TimeoutError as exc:
            raise HopFailed("DEADLINE_EXCEEDED: no answer in time") from exc
        finally:
            record.end_call()
        # Counted once each: every read of a message's bytes field copies it (302 KB at ViT-B fp16).
        sent_bytes = sum(codec.payload_bytes(t) for t in (request_pb.activations, request_pb.frozen))
        reply_bytes = codec.payload_bytes(reply.activations)
        self._observe_links(record, (time.monotonic() - started) * 1e3, reply.compute_ms, sent_bytes, reply_bytes)
        moved = sent_bytes + codec.payload_bytes(request_pb.token_mask) + reply_bytes
        try:
            if token_mask is not None:  # text: the reply holds the active tokens only
                # split: frozen tokens keep the states the node read, so every later hop and the
                # verifier see the same values
                base = x if sent is None else sent
                out = text_reply(base, token_mask, reply.activations, wire)
                return HopResult(out, token_mask, wire, sent, moved, active_count(token_mask))
            out = codec.decode(reply.activations, self.wire.spec)
            if out.shape != x.shape:
                raise codec.TensorError(f"reply shape {tuple(out.shape)} differs from request {tuple(x.shape)}")
            if codec.torch_dtype(reply.activations.dtype) != wire:
                raise codec.TensorError(f"reply dtype {out.dtype}, asked for {wire}")
        except codec.TensorError as exc:
            log.warning("quarantining %s: malformed activations (%s)", record.address, exc)
            raise HopFailed(f"malformed activations: {exc}", quarantine=True) from exc
        return HopResult(out.to(torch.float32), None, wire, None, moved, None)

    def _observe_links(
        self, record: NodeRecord, round_trip_ms: float, compute_ms: float, sent: int, received: int
    ) -> None:
        """A star hop measures the coordinator <-> node link: its round trip less the node's compute,
        half each way (passive: real traffic only). A compute time that cannot be true (not finite,
        negative, longer than the round trip it happened in) is the node's lie or bug and measures
        nothing: one NaN would stay in the link's average for good, and a longer one makes the link
        look free, which --policy network would route towards."""
        if not (math.isfinite(compute_ms) and 0.0 <= compute_ms <= round_trip_ms):
            log.debug(
                "%s reported compute_ms %r over a round trip of %.3f ms: link not measured",
                record.address,
                compute_ms,
                round_trip_ms,
            )
            return
        one_way = (round_trip_ms - compute_ms) / 2
        self.registry.links.observe(COORDINATOR, record.address, sent, one_way)
        self.registry.links.observe(record.address, COORDINATOR, received, one_way)


# --- text hops ---------------------------------------------------------------------------------------


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
