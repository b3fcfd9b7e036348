"""The lean node on arm64, proven under emulation: the image built from Debian's arm64 packages and aarch64
wheels, run by a private Docker engine through qemu-user-static (binfmt_misc, F flag), used by an x86
coordinator in a mixed swarm whose other blocks are x86 torch nodes.

What it checks: the image is arm64 and its Python says aarch64; its node serves on the numpy engine with
no torch in the image; block 3 of the shipped family answers Forward within LEAN_TOL of an x86 torch node
for the same block on the same input; a classification through the mixed swarm (the arm64 node at block 3)
gives the probabilities the all-x86 swarm gives; and a decoder block on arm64 serves a prefill and decode
steps within LEAN_TOL of the torch block with its cache. Figures (image sizes, build and start seconds,
max differences) go to runs/docker/arm64.json (LAYERSWARM_ARM64_REPORT to change).

Inputs, made with the network before the test (CI: `ARM64=1 deploy/offline/prepare.sh`): the arm64 base
tarball and .wheelhouse-node-aarch64; and the amd64 ones for the amd64 lean image. Minutes long:
LAYERSWARM_DOCKER=1 scripts/test tests/deploy/test_arm64.py; skipped, with the reason, where emulation, an
engine or the inputs are missing.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch

from layerswarm.harness.procs import Proc, layerswarm_cmd, node_address, node_cmd, spawn, spawn_many, stop_all
from layerswarm.harness.samples import png_bytes
from layerswarm.models.checkpoint import load_block, read_any_manifest
from layerswarm.models.zoo import resolve
from layerswarm.training.data.datasets import load_dataset
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from .. import docker_engine as de
from ..lm_nodes import make_lm_dir
from ..node.test_lean_engine import LEAN_TOL

ROOT = Path(__file__).resolve().parents[2]
REPORT = Path(os.environ.get("LAYERSWARM_ARM64_REPORT", ROOT / "runs" / "docker" / "arm64.json"))
SHIPPED = "zoo:shapes/layershuffle-0"
ARM_BLOCK = 3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.environ.get("LAYERSWARM_DOCKER") != "1", reason="minutes long: set LAYERSWARM_DOCKER=1"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engine() -> Iterator[de.Engine]:
    try:
        reason = de.why_no_arm64()
        if reason:
            raise de.EngineUnavailable(reason)
        de.node_wheelhouse("x86_64")
        de.node_wheelhouse("aarch64")
        de.base_tarball()
        de.base_tarball("arm64")
        engine = de.start()
    except de.EngineUnavailable as exc:
        pytest.skip(f"no arm64 emulation, Docker engine or image inputs: {exc}")
    try:
        de.import_base_image(engine)
        de.import_base_image(engine, arch="arm64")
        yield engine
    finally:
        de.stop(engine)


def build(engine: de.Engine, arch: str) -> dict[str, Any]:
    started = time.monotonic()
    tag = de.node_image(arch)
    wheels = de.node_wheelhouse("aarch64" if arch == "arm64" else "x86_64")
    engine.docker(
        "build",
        f"--platform=linux/{arch}",
        "--file=deploy/Dockerfile.node",
        f"--build-arg=BASE_IMAGE={de.base_image(arch)}",
        f"--build-arg=WHEELHOUSE={wheels.name}",
        f"--tag={tag}",
        str(ROOT),
        timeout=1500,
    )
    image = engine.inspect(tag)[0]
    return {
        "build_seconds": round(time.monotonic() - started, 1),
        "image_mib": round(image["Size"] / 2**20, 1),
        "base_image_mib": round(engine.inspect(de.base_image(arch))[0]["Size"] / 2**20, 1),
        "architecture": image["Architecture"],
        "wheels": len(list(wheels.glob("*.whl"))),
        "wheelhouse_mib": round(sum(f.stat().st_size for f in wheels.glob("*.whl")) / 2**20, 1),
    }


def run_node(engine: de.Engine, name: str, model_dir: str, block: int, mounts: list[str]) -> int:
    """An arm64 node container on the test's own network namespace (host network); its port once ready."""
    port = free_port()
    engine.docker(
        "run", "--detach", f"--name={name}", "--network=host", "--platform=linux/arm64", *mounts,
        de.node_image("arm64"), "node", "--model-dir", model_dir, "--block", str(block),
        "--host", "127.0.0.1", "--port", str(port), "--no-advertise",
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        logs = engine.docker("logs", name, check=False)
        ready = [json.loads(line) for line in logs.splitlines() if line.startswith('{"event": "ready"')]
        if ready:
            assert ready[0]["engine"] == "numpy" and ready[0]["port"] == port, ready[0]
            return port
        if not engine.inspect(name)[0]["State"]["Running"]:
            raise AssertionError(f"{name} exited: {logs[-2000:]}")
        time.sleep(1)
    raise AssertionError(f"{name} not ready in 300 s: {engine.docker('logs', name, check=False)[-2000:]}")


async def forward(port: int, x: torch.Tensor, position: int) -> torch.Tensor:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await pb_grpc.BlockNodeStub(channel).Forward(
            pb.ForwardRequest(activations=codec.encode(x), position=position), timeout=60
        )
    return codec.decode(reply.activations)


def classify(proc: Proc, image: bytes) -> dict[str, Any] | None:
    """The answer, or None while the coordinator refuses for want of blocks (a node not admitted yet:
    the shipped family needs all 8, and the arm64 node answers its first checks slowly)."""
    url = f"http://127.0.0.1:{proc.ready['port']}/v1/classify"
    fields = {"seed": "0", "exit_rule": "none", "top_k": "10"}
    reply = httpx.post(url, files={"file": ("x.png", image, "image/png")}, data=fields, timeout=120)
    if reply.status_code == 503 and reply.json().get("error") == "insufficient_depth":
        return None
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def probabilities(body: dict[str, Any]) -> dict[str, float]:
    return {label["label"]: label["probability"] for label in body["labels"]}


async def compare_forward(arm_port: int, x86_port: int, cfg: Any) -> float:
    """The block itself: the arm64 node against the x86 torch node for the same block and input."""
    torch.manual_seed(0)
    x = torch.randn(4, cfg.num_tokens, cfg.dim)
    arm, ref = await forward(arm_port, x, 2), await forward(x86_port, x, 2)
    return float((arm - ref).abs().max())


def classify_through(shipped: Path, peers: list[str], depth: int) -> dict[str, Any]:
    """A classification at full depth by an x86 coordinator over `peers` (sequential, fp32 on the wire)."""
    image = png_bytes(load_dataset("shapes:10:20", seed=5).test_x[0].numpy())
    cmd = layerswarm_cmd(
        "coordinator", "--model-dir", str(shipped), "--http-port", "0", "--no-mdns",
        *[f"--peer={a}" for a in peers], "--policy", "sequential", "--wire-dtype", "fp32", "--health-interval", "0.5",
    )  # fmt: skip
    coord = spawn("coordinator", cmd, timeout=120)
    try:
        deadline = time.monotonic() + 120
        while True:  # until every node is admitted (the arm64 one answers its health checks slowly)
            body = classify(coord, image)
            if body is not None and body["depth"] == depth:
                return body
            assert time.monotonic() < deadline, f"not every block admitted in 120 s: {body}"
            time.sleep(1)
    finally:
        stop_all([coord])


async def compare_decode(lm_dir: Path, lm_port: int) -> float:
    """A decoder block on arm64: prefill, then decode steps, against the torch block with its cache."""
    block = load_block(lm_dir, 1, read_any_manifest(lm_dir))
    cache, start, worst = block.new_cache(), 0, 0.0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{lm_port}") as channel:
        stub = pb_grpc.BlockNodeStub(channel)
        for tokens in (6, 1, 1, 1):
            step = torch.randn(1, tokens, 32)
            request = pb.DecodeRequest(stream_id="arm", start=start, activations=codec.encode(step))
            got = await stub.Decode(request, timeout=60)
            assert got.length == start + tokens
            with torch.inference_mode():
                want = block(step, caches=[cache])
            worst = max(worst, float((codec.decode(got.activations) - want).abs().max()))
            start += tokens
    return worst


async def test_arm64_lean_node_in_a_mixed_swarm(engine: de.Engine, tmp_path: Path) -> None:
    figures: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, no GPU; arm64 under qemu-user-static",
        "engine": engine.docker("version", "--format", "{{.Server.Version}}").strip(),
        "images": {arch: build(engine, arch) for arch in ("amd64", "arm64")},
    }
    assert figures["images"]["arm64"]["architecture"] == "arm64"
    machine = engine.docker(
        "run", "--rm", "--platform=linux/arm64", "--entrypoint=python3", de.node_image("arm64"), "-c",
        "import platform, importlib.util as u; print(platform.machine(), u.find_spec('torch') is None)",
    ).split()  # fmt: skip
    assert machine == ["aarch64", "True"], machine  # an arm64 interpreter, and no torch in the image

    lm_dir = tmp_path / "lm"
    make_lm_dir(lm_dir, seed=8)
    for path in (tmp_path, lm_dir, *lm_dir.iterdir()):  # the container's user reads them
        path.chmod(0o755 if path.is_dir() else 0o644)
    shipped = resolve(SHIPPED)
    depth = read_any_manifest(shipped).config.depth
    x86 = spawn_many([(f"x86-b{b}", node_cmd(shipped, b, "--no-advertise", "--engine", "torch")) for b in range(depth)])
    try:
        started = time.monotonic()
        arm_port = run_node(engine, "arm-vit", SHIPPED, ARM_BLOCK, [])
        figures["arm64_node_start_seconds"] = round(time.monotonic() - started, 1)
        lm_port = run_node(engine, "arm-lm", "/models/lm", 1, [f"--volume={lm_dir}:/models/lm:ro"])

        cfg = read_any_manifest(shipped).config
        figures["forward_max_abs_diff"] = await compare_forward(arm_port, x86[ARM_BLOCK].ready["port"], cfg)
        assert figures["forward_max_abs_diff"] < LEAN_TOL

        # The swarm: the arm64 node at block 3 and x86 torch nodes for the others, then all x86.
        x86_peers = [node_address(p) for p in x86]
        mixed_peers = [a for b, a in enumerate(x86_peers) if b != ARM_BLOCK] + [f"127.0.0.1:{arm_port}"]
        mixed, ref = classify_through(shipped, mixed_peers, depth), classify_through(shipped, x86_peers, depth)
        assert mixed["depth"] == ref["depth"] == depth
        hop = next(h for h in mixed["trace"]["hops"] if h["block"] == ARM_BLOCK)
        assert hop["node"] == f"127.0.0.1:{arm_port}", hop  # block 3 ran on arm64
        assert mixed["prediction"] == ref["prediction"]
        p_mixed, p_ref = probabilities(mixed), probabilities(ref)
        figures["classification_max_abs_probability_diff"] = max(abs(p_mixed[k] - p_ref[k]) for k in p_ref)
        assert figures["classification_max_abs_probability_diff"] < 1e-4

        figures["decode_max_abs_diff"] = await compare_decode(lm_dir, lm_port)
        assert figures["decode_max_abs_diff"] < LEAN_TOL
    finally:
        for name in ("arm-vit", "arm-lm"):
            engine.docker("rm", "--force", name, check=False)
        stop_all(x86)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(figures, indent=2) + "\n")
