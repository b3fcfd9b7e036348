"""One Decode call: encode the new tokens' states, send them over the stream's link to the node, check the
reply's form, and say what a failure means for the stream.

What a failed hop means for the stream (rebuild here or elsewhere, skip, give up) is the runner's; this
module only turns one call into float32 states or a DecodeFailed whose kind says what was lost:

    LOST       FAILED_PRECONDITION, NOT_FOUND: the node is up but its cache for us is gone (evicted,
               restarted, idle timeout): rebuild, on the same node first
    DOWN       UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED: the node did not answer: rebuild elsewhere
    FULL       RESOURCE_EXHAUSTED: the node is at its limits: elsewhere (not held against it)
    REFUSED    any other status (PERMISSION_DENIED, INVALID_ARGUMENT, ...): elsewhere
    MALFORMED  a reply of the wrong shape, dtype or length, or out of range: the node is quarantined
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import Enum

import grpc
import torch

from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from ..membership.clients import ClientPool
from ..membership.decode_links import StepLink
from ..membership.records import Evidence, NodeRecord
from ..verification.ranges import hard_range_problem

PREFILL_TOKENS_PER_TIMEOUT = 256  # a call of more tokens gets one more hop timeout per this many


class Failure(str, Enum):
    LOST = "lost"
    DOWN = "down"
    FULL = "full"
    REFUSED = "refused"
    MALFORMED = "malformed"
    LIE = "lie"  # set by the runner: a check of the reply failed


_KINDS = {
    grpc.StatusCode.FAILED_PRECONDITION: Failure.LOST,
    grpc.StatusCode.NOT_FOUND: Failure.LOST,
    grpc.StatusCode.UNAVAILABLE: Failure.DOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED: Failure.DOWN,
    grpc.StatusCode.CANCELLED: Failure.DOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Failure.FULL,
}


class DecodeFailed(Exception):
    def __init__(self, kind: Failure, message: str, evidence: Evidence | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.evidence = evidence


@dataclass(frozen=True)
class DecodeReply:
    out: torch.Tensor  # (1, T, D) float32: the new tokens' states leaving the block
    length: int  # tokens the node's cache holds for the stream now
    latency_ms: float
    compute_ms: float
    batched: int  # streams whose steps ran in the same block call at the node


class DecodeCaller:
    def __init__(self, pool: ClientPool, wire: torch.dtype, dim: int, hop_timeout_s: float) -> None:
        self.pool = pool
        self.wire = wire
        self.dim = dim
        self.hop_timeout_s = hop_timeout_s

    def timeout(self, tokens: int) -> float:
        """A hop timeout per call, and one more per PREFILL_TOKENS_PER_TIMEOUT tokens (a long prefill)."""
        return self.hop_timeout_s * (1 + tokens // PREFILL_TOKENS_PER_TIMEOUT)

    async def call(
        self,
        record: NodeRecord,
        link: StepLink,
        stream_id: str,
        request_id: str,
        start: int,
        x: torch.Tensor,
        fill: torch.Tensor | None = None,
    ) -> DecodeReply:
        """x (1, T, D) float32, the states of tokens start + F .. start + F + T - 1 entering the block (as
        the node will decode them); fill (1, F, D): earlier tokens' states that left the route before this
        block (early exit), cached first with no output. Raises DecodeFailed."""
        tokens = x.shape[1]
        filled = 0 if fill is None else fill.shape[1]
        request = pb.DecodeRequest(
            stream_id=stream_id, start=start, activations=codec.encode(x, self.wire), request_id=request_id
        )
        if fill is not None and filled:
            request.fill.CopyFrom(codec.encode(fill, self.wire))
        record.begin_call()
        started = time.monotonic()
        try:
            reply = await link.step(request, self.timeout(filled + tokens))
        except grpc.aio.AioRpcError as exc:
            kind = _KINDS.get(exc.code(), Failure.REFUSED)
            raise DecodeFailed(kind, f"{exc.code().name}: {exc.details()}") from exc
        except asyncio.TimeoutError as exc:
            raise DecodeFailed(Failure.DOWN, "DEADLINE_EXCEEDED: no answer in time") from exc
        finally:
            record.end_call()
        latency_ms = (time.monotonic() - started) * 1e3
        out = self._states(reply, tokens)
        if reply.length != start + filled + tokens:
            message = f"the node says its cache holds {reply.length} tokens, not {start + filled + tokens}"
            raise DecodeFailed(Failure.MALFORMED, message)
        return DecodeReply(out, reply.length, latency_ms, reply.compute_ms, reply.batched)

    def _states(self, reply: pb.DecodeResponse, tokens: int) -> torch.Tensor:
        try:
            out = codec.decode(reply.activations, codec.TensorSpec((1, tokens, self.dim), max_batch=1))
            if codec.torch_dtype(reply.activations.dtype) != self.wire:
                raise codec.TensorError(f"reply dtype {out.dtype}, asked for {self.wire}")
        except codec.TensorError as exc:
            raise DecodeFailed(Failure.MALFORMED, f"malformed activations: {exc}") from exc
        hard = hard_range_problem(out, 0, self.wire)
        if hard is not None:
            raise DecodeFailed(Failure.MALFORMED, f"reply out of range: {hard['discrepancy']}", hard)
        return out.to(torch.float32)
