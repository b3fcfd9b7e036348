"""One hop's call: encode, send over the pooled channel, check the reply's form, measure the link.

What a hop means for the path (retry elsewhere, hedge, verify, skip) is the executor's; this module only
turns one Forward call into float32 activations or a HopFailed that says why.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
import torch

from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from ..membership.clients import ClientPool
from ..membership.linkmap import COORDINATOR
from ..membership.records import NodeRecord
from ..membership.registry import Registry
from .text_hops import active_count, hop_mask, text_reply, text_request

if TYPE_CHECKING:
    from .trace import ExecOptions

log = logging.getLogger(__name__)


class HopFailed(Exception):
    """A hop that gave no usable answer: why, and whether the node is to be quarantined (with evidence)."""

    def __init__(self, message: str, quarantine: bool = False, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.quarantine = quarantine
        self.evidence = evidence  # set when verification caught a lie (a conviction)


class HopResult(NamedTuple):
    out: torch.Tensor  # float32, the shape of the request's x
    token_mask: torch.Tensor | None  # a text hop's mask
    wire: torch.dtype  # the activations' wire dtype
    sent: torch.Tensor | None  # what the node decoded, when not codec.as_sent(x, wire) (text, split form)
    wire_bytes: int  # tensor payload of the request (activations, frozen, mask) and the reply
    tokens: int | None  # text: the tokens the node computed


class HopCaller:
    def __init__(self, registry: Registry, pool: ClientPool) -> None:
        self.registry = registry
        self.pool = pool

    def wire_for(self, record: NodeRecord, x: torch.Tensor, opts: ExecOptions) -> torch.dtype:
        """The request's wire dtype, or with --wire-dtype auto the one this link pays for."""
        if opts.wire_choice is None:
            return opts.wire_dtype
        links = self.registry.links
        measured = [links.per_mb(COORDINATOR, record.address), links.per_mb(record.address, COORDINATOR)]
        return opts.wire_choice.choose(measured, x.numel())

    async def forward(
        self, record: NodeRecord, x: torch.Tensor, position: int, opts: ExecOptions, path_length: int
    ) -> HopResult:
        """One Forward call and the reply's form checked (shape, dtype, finite): float32 out, the
        text hop's token mask, the wire dtype used and, for a split text hop, what the node decoded.
        Raises HopFailed."""
        wire = self.wire_for(record, x, opts)
        timeout = min(opts.hop_timeout_s, max(0.001, opts.deadline - time.monotonic()))
        token_mask = None if opts.key_mask is None else hop_mask(opts.key_mask, opts.token_depth, position)
        if token_mask is None:
            activations, frozen, sent = codec.encode(x, wire), None, None
        else:
            activations, frozen, sent = text_request(x, token_mask, wire, opts.frozen_dtype)
        request = pb.ForwardRequest(
            request_id=opts.request_id,
            activations=activations,
            position=position,
            path_length=path_length,
            token_mask=None if token_mask is None else codec.encode(token_mask),
            frozen=frozen,
        )
        record.begin_call()
        started = time.monotonic()
        try:
            reply = await self.pool.get(record.address).forward(request, timeout)
        except grpc.aio.AioRpcError as exc:
            raise HopFailed(f"{exc.code().name}: {exc.details()}") from exc
        except asyncio.TimeoutError as exc:
            raise HopFailed("DEADLINE_EXCEEDED: no answer in time") from exc
        finally:
            record.end_call()
        # Counted once each: every read of a message's bytes field copies it (302 KB at ViT-B fp16).
        sent_bytes = sum(codec.payload_bytes(t) for t in (request.activations, request.frozen))
        reply_bytes = codec.payload_bytes(reply.activations)
        self._observe_links(record, (time.monotonic() - started) * 1e3, reply.compute_ms, sent_bytes, reply_bytes)
        moved = sent_bytes + codec.payload_bytes(request.token_mask) + reply_bytes
        try:
            if token_mask is not None:  # text: the reply holds the active tokens only
                # split: frozen tokens keep the states the node read, so every later hop and the
                # verifier see the same values
                base = x if sent is None else sent
                out = text_reply(base, token_mask, reply.activations, wire)
                return HopResult(out, token_mask, wire, sent, moved, active_count(token_mask))
            out = codec.decode(reply.activations, opts.spec)
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
