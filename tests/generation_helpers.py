"""Helpers for the generation tests: tiny decoder families (random weights, a real byte-level BPE
tokenizer), and for the coordinator's own logic an in-process stand-in for decoder nodes (a real
DecoderBlock and KV cache per stream, Decode's rules: start truncates, FAILED_PRECONDITION when it
holds fewer) with faults to inject. Tests of the whole swarm start real node processes instead."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import torch

from layerswarm.coordinator import CoordinatorSettings
from layerswarm.coordinator.assembly import family_spec
from layerswarm.coordinator.generation.generator import Generator
from layerswarm.coordinator.membership.clients import ClientPool
from layerswarm.coordinator.membership.records import NodeIdentity, StreamLimits
from layerswarm.coordinator.membership.registry import Registry
from layerswarm.coordinator.membership.watch import SwarmWatch
from layerswarm.coordinator.verification.decode_check import DecodeVerifier
from layerswarm.coordinator.verification.verifier import VerifySettings
from layerswarm.models import policy
from layerswarm.models.checkpoint import Lineage, load_block, read_lm_manifest, save_model
from layerswarm.models.lm.cache import KVCache
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderBlock, DecoderLM
from layerswarm.models.lm.tokenizer import TOKENIZER_FILE
from layerswarm.training.lm.tokenizer import train_bpe
from layerswarm.wire import codec
from layerswarm.wire.discovery import PROTOCOL_VERSION
from layerswarm.wire.v1 import block_pb2 as pb

CORPUS = ["12+34=46", "rev:123=321", "sort:6291=1269", "some plain words here", "the swarm writes text"] * 4
TINY_LM = {"vocab_size": 300, "dim": 32, "depth": 4, "heads": 4, "kv_heads": 2, "max_seq_len": 96}


def make_lm_dir(
    path: Path,
    seed: int = 0,
    root: str | None = None,
    min_blocks: int | None = None,
    block_scale: float = 1.0,
    **overrides: object,
) -> Path:
    """A decoder model directory with random weights; `root`: a sibling of that lineage (same family);
    `min_blocks`: an evaluated minimum depth in its policy (skipping allowed down to it); `block_scale`:
    the blocks' matrices scaled (at 1 a random block barely moves the residual stream, so a shallow draft
    agrees with the whole model nearly always; at 3 about half the time, which exercises rejections)."""
    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    train_bpe(CORPUS, 300).save(str(path / TOKENIZER_FILE))
    cfg = LMConfig(**{**TINY_LM, **overrides})  # type: ignore[arg-type]
    lineage = Lineage(source="scratch") if root is None else Lineage(root=root, parent="mdl-parent", source="model")
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            for weight in block.parameters():
                if weight.dim() == 2:
                    weight.mul_(block_scale)
    save_model(model, path, lineage)
    if min_blocks is not None:
        policy.write_entry(path, policy.MIN_BLOCKS, {"value": min_blocks, "order": "arbitrary"})
    return path


def make_family(root: Path, members: int = 2, min_blocks: int | None = None, **overrides: object) -> list[Path]:
    base = make_lm_dir(root / "m0", seed=0, min_blocks=min_blocks, **overrides)
    lineage_root = read_lm_manifest(base).lineage.root
    siblings = [
        make_lm_dir(root / f"m{i}", seed=i, root=lineage_root, min_blocks=min_blocks, **overrides)
        for i in range(1, members)
    ]
    return [base, *siblings]


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@dataclass
class FakeNode:
    """One decoder node in this process: its block, its streams' caches, and the faults it shows."""

    address: str
    block: DecoderBlock
    dead: bool = False  # every call: UNAVAILABLE
    lie_from: int | None = None  # steps from this cache length on get a wrong answer
    busy: int = 0  # the next this many calls: RESOURCE_EXHAUSTED (at its limits), nothing touched
    calls: int = 0
    caches: dict[str, KVCache] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)

    async def step(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
        await asyncio.sleep(0)
        self.calls += 1
        if self.dead:
            raise _error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if self.busy > 0:
            self.busy -= 1
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED, "node busy")
        cache = self.caches.get(request.stream_id)
        if cache is None:
            if request.start > 0:
                raise _error(grpc.StatusCode.NOT_FOUND, "unknown stream")
            cache = self.caches[request.stream_id] = self.block.new_cache()
        if cache.length < request.start:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION, f"holds {cache.length} tokens, not {request.start}")
        cache.truncate(request.start)
        x = codec.decode(request.activations)
        with torch.inference_mode():
            out = self.block(x.float(), caches=[cache])
        if self.lie_from is not None and cache.length > self.lie_from:
            out = out + 0.5
        wire = codec.torch_dtype(request.activations.dtype)
        return pb.DecodeResponse(stream_id=request.stream_id, activations=codec.encode(out, wire), length=cache.length)

    def forget(self) -> None:
        """Lose every stream (evicted, or restarted)."""
        self.caches.clear()


class FakeLink:
    def __init__(self, node: FakeNode) -> None:
        self.node = node

    async def step(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
        return await self.node.step(request, timeout)

    def close(self) -> None:
        pass


class FakeClient:
    def __init__(self, node: FakeNode) -> None:
        self.node = node

    def decode_link(self) -> FakeLink:
        return FakeLink(self.node)

    async def release(self, stream_ids: list[str], timeout: float) -> int:
        if self.node.dead:
            raise _error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        held = [s for s in stream_ids if self.node.caches.pop(s, None) is not None]
        self.node.released.extend(held)
        return len(held)


class FakePool:
    def __init__(self, nodes: dict[str, FakeNode]) -> None:
        self.nodes = nodes

    def get(self, address: str) -> FakeClient:
        return FakeClient(self.nodes[address])


@dataclass
class FakeSwarm:
    generator: Generator
    registry: Registry
    nodes: dict[str, FakeNode]

    def node_at(self, block: int, model_dir: Path | None = None) -> FakeNode:
        model_id = read_lm_manifest(model_dir).model_id if model_dir is not None else None
        for address, record in self.registry.nodes.items():
            ident = record.identity
            assert ident is not None
            if ident.block == block and (model_id is None or ident.model_id == model_id):
                return self.nodes[address]
        raise KeyError(block)

    def held(self) -> int:
        """Streams held by the nodes that are up (a dead node's memory went with it)."""
        return sum(len(n.caches) for n in self.nodes.values() if not n.dead)


def fake_swarm(layout: list[tuple[Path, int]], model_dir: Path, **settings: Any) -> FakeSwarm:
    """A Generator over in-process nodes (one per (model dir, block)), admitted as the registry admits
    real ones, with the coordinator's own checks when `verify_rate` is given."""
    values: dict[str, Any] = {"wire_dtype": "fp32", "verify_rate": None, "mdns": False, "http_port": 0, **settings}
    family = [d for d in dict.fromkeys(d for d, _ in layout) if d != model_dir]
    s = CoordinatorSettings(model_dir=model_dir, family_dirs=tuple(family), **values)
    manifest = read_lm_manifest(model_dir)
    registry = Registry(family_spec(s, manifest))
    nodes: dict[str, FakeNode] = {}
    for i, (member, block) in enumerate(layout):
        m = read_lm_manifest(member)
        address = f"127.0.0.{i + 1}:{7000 + i}"
        nodes[address] = FakeNode(address, load_block(member, block, m))
        registry.add_candidate(address, "static")
        ident = NodeIdentity(
            family_id=m.family_id,
            model_id=m.model_id,
            block=block,
            variant=m.variant,
            weights_sha256=m.block_sha256(block),
            boot_id=f"boot-{i}",
            protocol_version=PROTOCOL_VERSION,
            depth=m.config.depth,
            tokens=m.config.max_seq_len,
            dim=m.config.dim,
            shuffle_robust=m.config.shuffle_robust,
            stream_limits=StreamLimits(64, m.config.max_seq_len, 1 << 30, 60.0),
        )
        registry.admit(address, ident)
    watch = SwarmWatch(s, registry, ClientPool())
    watch._first_round.set()  # no discovery here: the registry is filled above
    verifier = None
    if s.verify_rate is not None:
        verify = VerifySettings(rate=s.verify_rate, probation_hops=s.verify_probation)
        verifier = DecodeVerifier([model_dir, *family], verify, seed=0)
    generator = Generator(s, manifest, registry, FakePool(nodes), watch, verifier, codec.dtype_by_name(s.wire_dtype))  # type: ignore[arg-type]
    return FakeSwarm(generator, registry, nodes)


def wait_ready(base: str, timeout: float = 30.0) -> None:
    """Until the coordinator at `base` says it can open a stream (/readyz)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/readyz").status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"the coordinator at {base} did not become ready in {timeout:.0f} s")


async def generate_all(generator: Generator, prompt: list[int], **options: Any) -> tuple[list[int], Any]:
    """Every token of one stream (the stream closed at the end, as the HTTP layer closes it)."""
    from layerswarm.coordinator.generation.options import GenerationOptions

    s = await generator.open(prompt, GenerationOptions(**options))
    return await finish(generator, s), s


async def finish(generator: Generator, s: Any) -> list[int]:
    """Every token of an opened stream, then the stream closed and its releases awaited."""
    tokens: list[int] = []
    try:
        logits = await generator.prefill(s)
        async for delta in generator.tokens(s, logits):
            if delta.token is not None:
                tokens.append(delta.token)
    finally:
        generator.close(s)
    await generator.releases_done()
    return tokens
