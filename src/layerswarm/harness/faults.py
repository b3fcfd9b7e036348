"""Test-only fault injection: a real node (real runtime, servicer, gRPC server) that is slow or lies.

Production code never imports this module; the node has no fault flags. The failure-injection and
attack suites start a faulty node with

    python -m layerswarm.harness.faults <any `layerswarm node` arguments> \\
        [--fault-mode MODE] [--fault-delay-ms N] [--fault-block K] [--fault-after N] [--fault-rate P]

It prints the same ready line as `layerswarm node` and advertises like one. In-process (tests):
`FaultyNode(NodeSettings(...), FaultSpec(mode=..., delay_ms=...))`, then `await node.start()`.

Modes (MODE):
  none              honest; only --fault-delay-ms applies (a slow node: each reply held N ms, counted
                    as in flight, so RESOURCE_EXHAUSTED still works)
  Malformed replies (the coordinator's codec checks reject them):
  nan               every value NaN
  shape             one token short
  dtype             a reply dtype nobody asked for
  Rogue replies: finite, well-formed, wrong (what only verification can catch):
  zeros             all zeros
  noise             Gaussian noise with the real output's mean and std (passes a magnitude filter)
  other-block       the output of block K (--fault-block, default: the next index) of the same model
  overflow          finite values of +-65000 (near the fp16 limit: the next hop would overflow)
  push              a subtle, targeted liar: the class token moved toward class 0 (the head's own
                    direction for it), every token's mean and std kept (passes range filters)
  A broken device (the honest servicer's own output check must catch it):
  runtime-overflow  the block computes values 1e6 times too large; the node answers INTERNAL
A decoder block's Decode replies lie the same way (every mode but other-block and push); its caches stay
honest.
--fault-after N: answer honestly for the first N requests, then misbehave (a node that passes a
probation period and turns later).
--fault-rate P: past those, lie on a share P of the replies only (a rare liar; drawn from a fixed seed,
so a run repeats).

Forged weights: `forge_model_dir(src, dst, scale)` copies a member's model directory, perturbs every
block's weights and re-hashes the manifest (new model id, same family id: a self-consistent forgery).
Run the ordinary `layerswarm node` on it; strict coordinators refuse it, others must catch it by
verification.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from layerswarm.models.checkpoint import (
    MANIFEST,
    block_file,
    load_block,
    load_stem_head,
    read_manifest,
    rehash_model_dir,
)
from layerswarm.node.engines import BlockEngine
from layerswarm.node.runtime import BlockRuntime
from layerswarm.node.server import Node, run
from layerswarm.node.service import BlockService
from layerswarm.node.settings import NodeSettings
from layerswarm.node.streams import Caller
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

MALFORMED_MODES = ("nan", "shape", "dtype")
ROGUE_MODES = ("zeros", "noise", "other-block", "overflow", "push")
MODES = ("none", *MALFORMED_MODES, *ROGUE_MODES, "runtime-overflow")
OVERFLOW_VALUE = 65000.0  # finite in fp16 (limit 65504); any residual block adds to it and overflows
RATE_SEED = 45  # a rare liar's draws: fixed, so that a run repeats
PUSH = 1.5  # push mode: the class token moved this many of its own std toward the target class


def pushed(out: torch.Tensor, toward: torch.Tensor, strength: float = PUSH) -> torch.Tensor:
    """(B, T, D) -> the same with the class token moved along `toward` (D,), its mean and std kept."""
    cls = out[:, 0]
    mean, std = cls.mean(-1, keepdim=True), cls.std(-1, keepdim=True)
    moved = cls + strength * std * toward / toward.std()
    moved = (moved - moved.mean(-1, keepdim=True)) / moved.std(-1, keepdim=True) * std + mean
    return torch.cat([moved[:, None], out[:, 1:]], dim=1)


@dataclass(frozen=True)
class FaultSpec:
    mode: str = "none"
    delay_ms: float = 0.0
    other_block: int | None = None  # for other-block; None: the next block index
    after: int = 0  # honest for this many requests first
    rate: float = 1.0  # then lie on this share of replies (a rare liar below 1)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--fault-mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"--fault-rate {self.rate}: a share of replies in (0, 1]")


class LieSchedule:
    """Which replies a liar lies on: none of the first `after`, then a share `rate` (every one at 1),
    drawn from a fixed seed so that a run repeats."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.answered = 0
        self.draws = random.Random(RATE_SEED)

    def lies_next(self) -> bool:
        self.answered += 1
        if self.answered <= self.spec.after:
            return False
        return self.spec.rate >= 1.0 or self.draws.random() < self.spec.rate


class FaultyRuntime(BlockRuntime):
    """The real runtime; in runtime-overflow mode its outputs are scaled past fp16 (a broken device)."""

    def __init__(self, *args: object, spec: FaultSpec, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fault = spec

    def _compute(self, x: np.ndarray, position: int) -> tuple[np.ndarray, float]:
        out, ms = super()._compute(x, position)
        if self.fault.mode == "runtime-overflow" and self.served >= self.fault.after:
            out = out * 1e6
        return out, ms


class FaultyService(BlockService):
    """The real servicer, then the lie: tampering happens after the node's own output check, as a
    modified node would do it."""

    def __init__(
        self,
        *args: object,
        spec: FaultSpec,
        other: torch.nn.Module | None,
        toward: torch.Tensor | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fault = spec
        self.other = other
        self.toward = toward  # push mode: the head's direction for the target class
        self.schedule = LieSchedule(spec)

    async def _handle(self, request: pb.ForwardRequest) -> pb.ForwardResponse:
        reply = await super()._handle(request)
        if self.fault.delay_ms > 0:
            self.runtime.in_flight += 1  # still busy: later requests see the node as loaded
            try:
                await asyncio.sleep(self.fault.delay_ms / 1e3)
            finally:
                self.runtime.in_flight -= 1
        if self.fault.mode in ("none", "runtime-overflow") or not self.schedule.lies_next():
            return reply
        return self._lie(request, reply)

    def _lie(self, request: pb.ForwardRequest, reply: pb.ForwardResponse) -> pb.ForwardResponse:
        if self.fault.mode == "push":  # the class token moved toward class 0
            assert self.toward is not None
            real = codec.decode(reply.activations)
            return _with(reply, codec.encode(pushed(real.float(), self.toward), real.dtype))
        if self.fault.mode != "other-block":
            return _with(reply, tampered(reply.activations, self.fault.mode))
        # other-block: a genuine block's output, just not the one this node claims to run
        assert self.other is not None
        x = codec.decode(request.activations).float()
        with torch.inference_mode():
            fake = self.other(x, request.position)
        return _with(reply, codec.encode(fake, codec.decode(reply.activations).dtype))


def tampered(activations: pb.Tensor, mode: str) -> pb.Tensor:
    """A reply's activations as a malformed or rogue node sends them (every mode but other-block and push)."""
    out = codec.decode(activations)
    dtype = out.dtype
    if mode == "nan":
        return codec.encode(torch.full_like(out, float("nan")), dtype)
    if mode == "shape":
        return codec.encode(out[:, :-1], dtype)
    if mode == "dtype":
        return codec.encode(out, torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)
    real = out.float()
    if mode == "zeros":
        fake = torch.zeros_like(real)
    elif mode == "noise":
        fake = torch.randn_like(real) * real.std() + real.mean()
    else:  # overflow
        fake = torch.where(real >= 0, OVERFLOW_VALUE, -OVERFLOW_VALUE)
    return codec.encode(fake, dtype)


Decode = Callable[[pb.DecodeRequest, Caller], Coroutine[Any, Any, pb.DecodeResponse]]


def lying_decode(decode: Decode, spec: FaultSpec) -> Decode:
    """A decoder node's Decode (unary and streamed alike) that tampers with its replies after
    `spec.after` honest ones, as a modified node would: the cache it keeps stays honest."""
    answered = 0

    async def lying(request: pb.DecodeRequest, caller: Caller) -> pb.DecodeResponse:
        nonlocal answered
        reply = await decode(request, caller)
        answered += 1
        honest = spec.mode in ("none", "runtime-overflow", "push")  # push: a classifier's lie
        if honest or answered <= spec.after or not reply.HasField("activations"):
            return reply
        return pb.DecodeResponse(
            stream_id=reply.stream_id,
            activations=tampered(reply.activations, spec.mode),
            compute_ms=reply.compute_ms,
            length=reply.length,
            batched=reply.batched,
        )

    return lying


def _with(reply: pb.ForwardResponse, activations: pb.Tensor) -> pb.ForwardResponse:
    return pb.ForwardResponse(request_id=reply.request_id, activations=activations, compute_ms=reply.compute_ms)


class FaultyNode(Node):
    """A node built from the real parts, with a lying runtime and servicer."""

    def __init__(self, settings: NodeSettings, spec: FaultSpec) -> None:
        self.fault = spec
        super().__init__(settings)
        if self.decode is not None:  # a decoder block: its generation steps lie too
            if spec.mode == "other-block":
                raise ValueError("--fault-mode other-block: not for decoder blocks (use noise, zeros, ...)")
            self.decode.decode = lying_decode(self.decode.decode, spec)  # type: ignore[method-assign,assignment]

    def make_runtime(self, engine: BlockEngine) -> BlockRuntime:
        s = self.settings
        return FaultyRuntime(
            engine,
            s.block,
            self.manifest,
            micro_batch=s.micro_batch,
            max_batch=s.max_batch,
            spec=self.fault,
        )

    def make_service(self) -> BlockService:
        other = None
        if self.fault.mode == "other-block":
            depth = self.manifest.config.depth
            index = self.fault.other_block if self.fault.other_block is not None else (self.settings.block + 1) % depth
            other = load_block(self.settings.model_dir, index, self.manifest)
        toward = None
        if self.fault.mode == "push":  # the model's own head says which way class 0 lies
            head = load_stem_head(self.settings.model_dir)[1]  # a classifier's (push is a classifier's lie)
            toward = head.classifier.weight[0].detach()
        return FaultyService(
            self.runtime,
            self.settings,
            self.metrics,
            self.boot_id,
            self.relayer,
            decode=self.decode,  # a decoder block's generation service (None for a classifier's): it lies too
            spec=self.fault,
            other=other,
            toward=toward,
        )


def forge_model_dir(src: Path, dst: Path, scale: float = 0.5, seed: int = 0) -> Path:
    """An edited copy of a model directory that passes every local check: each block's weights get
    Gaussian noise of `scale` times their own std, files and manifest are re-hashed (a new model id in
    the same family: the lineage root is copied). Stem and head are untouched."""
    shutil.copytree(src, dst)
    manifest = read_manifest(dst)
    generator = torch.Generator().manual_seed(seed)
    for i in range(manifest.config.depth):
        path = dst / block_file(i)
        tensors = load_file(str(path))
        edited = {}
        for name, t in tensors.items():
            std = float(t.float().std()) if t.numel() > 1 else 0.0
            edited[name] = t + torch.randn(t.shape, generator=generator, dtype=t.dtype) * (std * scale)
        save_file(edited, str(path), metadata={"format": "layerswarm.model"})
    rehash_model_dir(dst)
    assert (dst / MANIFEST).is_file()
    return dst


# The CLI sits above the harness: only this module's `python -m` entry point (main, its --help) may use it, and
# importing it at the top would load the CLI into every library user of FaultyNode (bench.rogue, the tests).


def _fault_parser() -> argparse.ArgumentParser:
    from layerswarm.cli.base import HelpFormatter  # noqa: PLC0415 - the entry point only (see above)

    p = argparse.ArgumentParser(
        prog="python -m layerswarm.harness.faults",
        add_help=False,  # --help shows these and then every `layerswarm node` flag (main)
        usage="%(prog)s <layerswarm node arguments> [--fault-mode MODE] [--fault-delay-ms N] [--fault-block K] "
        "[--fault-after N]",
        description="Test only: the real node, slow or lying (the module docstring describes each mode).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--fault-mode", default="none", choices=MODES, help="how the node misbehaves")
    p.add_argument(
        "--fault-delay-ms",
        type=float,
        default=0.0,
        metavar="N",
        help="milliseconds to hold each reply (counted as in flight), in any mode",
    )
    p.add_argument(
        "--fault-block",
        type=int,
        default=None,
        metavar="K",
        help="other-block: the block whose output to send (none: the next)",
    )
    p.add_argument(
        "--fault-after", type=int, default=0, metavar="N", help="answer honestly for this many requests first"
    )
    p.add_argument(
        "--fault-rate", type=float, default=1.0, metavar="P", help="then lie on this share of replies only (0 < P <= 1)"
    )
    return p


def _print_help() -> NoReturn:
    """--help: the fault flags, then the `layerswarm node` flags this wrapper passes on."""
    from layerswarm.cli import build_parser  # noqa: PLC0415 - the entry point only (see _fault_parser)

    print(_fault_parser().format_help())
    print("Every `layerswarm node` argument is accepted and passed on:\n", flush=True)
    build_parser("node").parse_args(["node", "--help"])  # prints the node's help and exits
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """`layerswarm node` with a fault: the node's own argument parser and settings, our node class.
    The CLI is imported here (the top of the stack): this entry point is a test tool, not a library."""
    from layerswarm.cli import node_settings_from_argv  # noqa: PLC0415 - the entry point only (see _fault_parser)

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        _print_help()
    fault_args, node_argv = _fault_parser().parse_known_args(argv)
    try:
        spec = FaultSpec(
            fault_args.fault_mode, fault_args.fault_delay_ms, fault_args.fault_block, fault_args.fault_after,
            fault_args.fault_rate,
        )  # fmt: skip
    except ValueError as exc:
        _fault_parser().error(str(exc))
    settings = node_settings_from_argv(node_argv)

    class _Node(FaultyNode):
        def __init__(self, settings: NodeSettings) -> None:
            super().__init__(settings, spec)

    return run(settings, _Node)


if __name__ == "__main__":
    sys.exit(main())
