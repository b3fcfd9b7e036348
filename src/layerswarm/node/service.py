"""The BlockNode gRPC servicer: validate, compute off the loop, answer with a precise status code."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import numpy as np

from layerswarm import __version__
from layerswarm.models.config import ViTConfig
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.text.codes import join_states, mask_problem, split_problem
from layerswarm.wire import arrays
from layerswarm.wire.discovery import PROTOCOL_VERSION
from layerswarm.wire.relay_stream import serve_relay_stream
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from .callers import caller_of, new_connection
from .checks import RequestError, check_input_range, decoded, output_problem, reply_dtype_of
from .decode import NOT_A_DECODER, DecodeService
from .decode_calls import serve_batches, serve_stream
from .metrics import NodeMetrics
from .relay import MAX_DEADLINE_S, Relayer, RelayRefused
from .runtime import BlockRuntime
from .settings import NodeSettings

log = logging.getLogger(__name__)


class BlockService(pb_grpc.BlockNodeServicer):
    def __init__(
        self,
        runtime: BlockRuntime,
        settings: NodeSettings,
        metrics: NodeMetrics,
        boot_id: str,
        relayer: Relayer | None = None,
        decode: DecodeService | None = None,
    ) -> None:
        self.runtime = runtime
        self.relayer = relayer or Relayer(SecuritySettings(), settings.max_message_bytes)
        self.settings = settings
        self.metrics = metrics
        self.boot_id = boot_id
        self.decode = decode  # decoder blocks: generation's streams (None: a classifier's block)
        self.closing = asyncio.Event()  # set when the node drains: its relay streams end (Node.stop)
        cfg = runtime.manifest.config
        self.max_tokens = block_tokens(cfg)
        # Text and decoders: any T up to the family's maximum (checked in _validate); images: exactly their T.
        fixed = cfg.num_tokens if isinstance(cfg, ViTConfig) and not cfg.is_text else None
        self.spec = arrays.TensorSpec(
            shape=(None, fixed, cfg.dim),
            max_batch=settings.max_batch,
            max_bytes=settings.max_message_bytes,
        )

    async def Forward(self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext) -> pb.ForwardResponse:
        self.metrics.requests.labels("Forward").inc()
        try:
            return await self._handle(request)
        except RequestError as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            await context.abort(exc.code, str(exc))
            raise  # unreachable: abort raises

    async def ForwardStream(
        self, request_iterator: AsyncIterator[pb.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ForwardResponse]:
        async for request in request_iterator:
            self.metrics.requests.labels("ForwardStream").inc()
            try:
                yield await self._handle(request)
            except RequestError as exc:
                self.metrics.errors.labels(exc.code.name).inc()
                await context.abort(exc.code, str(exc))

    async def Relay(self, request: pb.RelayRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RelayEvent]:
        """This hop, then on along the coordinator's chain (node/relay.py)."""
        self.metrics.requests.labels("Relay").inc()
        try:
            async for event in self.relayer.relay(request, self._handle):
                yield event
        except (RequestError, RelayRefused) as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            await context.abort(exc.code, str(exc))

    async def RelayStream(
        self, request_iterator: AsyncIterator[pb.RelayRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RelayEvent]:
        """Relay for many chains on one long-lived stream from the previous node (wire/relay_stream.py)."""
        events = serve_relay_stream(
            request_iterator,
            context,
            lambda request: self.relayer.relay(request, self._handle),
            refusals=(RequestError, RelayRefused),
            max_deadline_s=MAX_DEADLINE_S,
            on_request=self.metrics.requests.labels("RelayStream").inc,
            closing=self.closing,
        )
        async for event in events:
            if event.refused:
                self.metrics.errors.labels(event.refused).inc()
            yield event

    async def Collect(self, request: pb.CollectRequest, context: grpc.aio.ServicerContext) -> pb.ForwardResponse:
        """The result a chain left here for the coordinator."""
        self.metrics.requests.labels("Collect").inc()
        reply = await self.relayer.collect(request, context.time_remaining())
        if reply is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no relay result for request {request.request_id!r}")
        assert reply is not None
        return reply

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        rt, cfg = self.runtime, self.runtime.manifest.config
        return pb.NodeInfo(
            family_id=rt.manifest.family_id,
            model_id=rt.manifest.model_id,
            block_index=rt.index,
            variant=cfg.variant,
            weights_sha256=rt.manifest.block_sha256(rt.index),
            device=str(rt.device),
            compute_dtype=pb.DTYPE_FLOAT32,  # every engine computes in float32
            software_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            boot_id=self.boot_id,
            depth=cfg.depth,
            tokens=self.max_tokens,
            dim=cfg.dim,
            max_batch=self.settings.max_batch,
            shuffle_robust=cfg.shuffle_robust,
            load=pb.Load(
                in_flight=rt.in_flight,
                max_in_flight=self.settings.max_in_flight,
                ewma_latency_ms=rt.ewma_ms,
                served=rt.served,
            ),
            links=self.relayer.peers.link_stats() if self.relayer.peers else [],
            trace_key=self.relayer.signer.public,
            stream_limits=self.decode.limits_message() if self.decode is not None else None,
        )

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> pb.DecodeResponse:
        """One step of one generation stream (node/decode.py)."""
        self.metrics.requests.labels("Decode").inc()
        try:
            return await self._decoder().decode(request, caller_of(context))
        except RequestError as exc:
            code, message = exc.code, str(exc)
        except Exception as exc:  # a bug: INTERNAL with its name, never the UNKNOWN grpc would send
            log.exception("decode step failed")
            code, message = grpc.StatusCode.INTERNAL, f"decode step failed: {type(exc).__name__}: {exc}"
        self.metrics.errors.labels(code.name).inc()
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

    async def DecodeStream(
        self, request_iterator: AsyncIterator[pb.DecodeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeResponse]:
        """Many streams' steps over one call, replies in order; a failed step is a reply (`refused`)."""
        if self.decode is None:
            self.metrics.errors.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, NOT_A_DECODER)
            return
        async for reply in serve_stream(self.decode, request_iterator, caller_of(context, new_connection())):
            yield reply

    async def DecodeBatchStream(
        self, request_iterator: AsyncIterator[pb.DecodeBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeBatchReply]:
        """DecodeStream with many steps per message (node/decode_calls.py): one reply message per message."""
        code, message = grpc.StatusCode.INVALID_ARGUMENT, NOT_A_DECODER
        if self.decode is not None:
            try:
                async for reply in serve_batches(self.decode, request_iterator, caller_of(context, new_connection())):
                    yield reply
                return
            except RequestError as exc:
                code, message = exc.code, str(exc)
        self.metrics.errors.labels(code.name).inc()
        await context.abort(code, message)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        self.metrics.requests.labels("Release").inc()
        try:
            return self._decoder().release(request, caller_of(context))
        except RequestError as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            await context.abort(exc.code, str(exc))
            raise  # unreachable: abort raises

    def _decoder(self) -> DecodeService:
        if self.decode is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, NOT_A_DECODER)
        return self.decode

    async def _handle(self, request: pb.ForwardRequest) -> pb.ForwardResponse:
        x, reply_dtype, token_mask = self._validate(request)
        if self.runtime.in_flight >= self.settings.max_in_flight:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"node busy: {self.runtime.in_flight} requests in flight (limit {self.settings.max_in_flight})",
            )
        self.metrics.in_flight.inc()
        try:
            out, ms = await self.runtime.forward(x, request.position, token_mask)
        except (RuntimeError, MemoryError) as exc:  # a device error, out of memory: the client must see why
            log.exception("block compute failed")
            raise RequestError(grpc.StatusCode.INTERNAL, f"block compute failed: {exc}") from exc
        finally:
            self.metrics.in_flight.dec()
        self.metrics.latency.observe(ms / 1e3)
        self._check_output(out, reply_dtype)
        return pb.ForwardResponse(
            request_id=request.request_id, activations=arrays.encode(out, reply_dtype), compute_ms=ms
        )

    def _check_output(self, out: np.ndarray, reply_dtype: int) -> None:
        """Never send what the next hop cannot use: non-finite values, or values the cast to the reply
        dtype would turn into Inf. The input was in range (checked first): this node is at fault."""
        problem = output_problem(out, reply_dtype)
        if problem is not None:
            self.metrics.refused_outputs.inc()
            log.warning("refusing to send block output: %s", problem)
            raise RequestError(grpc.StatusCode.INTERNAL, f"block output {problem}: not sent")

    def _validate(self, request: pb.ForwardRequest) -> tuple[np.ndarray, int, np.ndarray | None]:
        cfg = self.runtime.manifest.config
        depth = cfg.depth
        if not request.HasField("activations"):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request has no activations")
        if not 0 <= request.position < depth:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"position {request.position} outside [0, {depth}) for this model"
            )
        text = isinstance(cfg, ViTConfig) and cfg.is_text
        if (request.HasField("token_mask") or request.HasField("frozen")) and not text:
            kind = "a decoder block" if isinstance(cfg, LMConfig) else "an image block"
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"token_mask and frozen are for text families; this is {kind}"
            )
        reply_dtype = reply_dtype_of(request.reply_dtype, request.activations.dtype)
        token_mask = self._token_mask(request) if text else None
        if request.HasField("frozen"):
            x = self._joined(request, token_mask)
        else:
            x = decoded(request.activations, self.spec, "activations")
            if self.spec.shape[1] is None and x.shape[1] > self.max_tokens:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{x.shape[1]} tokens; this family takes {self.max_tokens}"
                )
        if token_mask is not None:
            problem = mask_problem(token_mask, x)
            if problem is not None:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        check_input_range(x, reply_dtype)
        return x, reply_dtype, token_mask

    def _token_mask(self, request: pb.ForwardRequest) -> np.ndarray | None:
        """Text: the (B, T) token mask (models/text/tokens.py) if sent, T within the family's maximum."""
        if not request.HasField("token_mask"):
            return None
        spec = arrays.TensorSpec((None, None), max_batch=self.settings.max_batch)
        mask = decoded(request.token_mask, spec, "token_mask").astype(np.float32, copy=False)
        if mask.shape[1] > self.max_tokens:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{mask.shape[1]} tokens; this family takes {self.max_tokens}"
            )
        return mask

    def _joined(self, request: pb.ForwardRequest, mask: np.ndarray | None) -> np.ndarray:
        """The split form (text): active and frozen rows, placed by the mask, as one (B, T, D) input."""
        if mask is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "frozen needs a token_mask to place its rows")
        rows = arrays.TensorSpec(
            (None, self.runtime.manifest.config.dim),
            max_batch=mask.size,
            max_bytes=self.settings.max_message_bytes,
        )
        active = decoded(request.activations, rows, "activations")
        frozen = decoded(request.frozen, rows, "frozen")
        problem = split_problem(mask, active, frozen)
        if problem is not None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        return join_states(mask, active, frozen)


def block_tokens(cfg: ViTConfig | LMConfig) -> int:
    """T a block expects (images) or takes at most (text: its longest sequence; decoders: the context)."""
    return cfg.max_seq_len if isinstance(cfg, LMConfig) else cfg.num_tokens
