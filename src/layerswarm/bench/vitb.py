"""ViT-B/16 shape (random weights, 12 nodes): swarm against monolith, throughput under concurrency, a
block's compute in turn against back to back, and the coordinator's CPU share (one hop against the TCP
floor: hop.py)."""

from __future__ import annotations

import asyncio
import io
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, NodeClient, Policy
from layerswarm.harness.procs import Proc, stop_all
from layerswarm.models.checkpoint import load_model
from layerswarm.models.vit import run_blocks
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from .fixtures import addresses, coordinator_process, cpu_seconds, median_ms, timed

SEQ = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0)


def coordinator(
    model_dir: Path,
    peers: tuple[str, ...],
    wire: str,
    transport: str,
    spot_checks: bool = True,
    topology: str = "star",
    token_file: Path | None = None,
    deferred_checks: bool = True,
) -> Coordinator:
    """An in-process coordinator with the defaults (spot checks included, confirmed while the path goes
    on) unless told otherwise."""
    return Coordinator(
        CoordinatorSettings(
            model_dir=model_dir,
            peers=peers,
            mdns=False,
            wire_dtype=wire,
            transport=transport,
            topology=topology,
            token_file=token_file,
            hop_timeout_s=60,
            request_timeout_s=300,
            health_interval_s=30,
            max_batch=64,
            verify_rate=CoordinatorSettings.model_fields["verify_rate"].default if spot_checks else None,
            verify_deferred=deferred_checks,
        )
    )


async def swarm_vs_monolith(
    model_dir: Path, procs: list[Proc], reps: int, configs: list[tuple[str, str]], device: str = "cpu"
) -> dict[str, Any]:
    """Batch 1, end to end (stem, every block, head), interleaved with the same blocks in one process."""
    torch.set_num_threads(1)  # as each node computes; the 2-thread monolith is reported beside it
    model, _ = load_model(model_dir)
    model = model.to(device)
    images = torch.rand(1, 3, model.cfg.image_size, model.cfg.image_size)

    with torch.inference_mode():
        tokens = model.stem(images.to(device))

    def monolith(threads: int) -> float:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            t = timed(lambda: _sync(model(images.to(device))))
        torch.set_num_threads(1)
        return t

    def blocks_alone() -> float:  # the same blocks on one thread, no stem or head: what the nodes compute
        with torch.inference_mode():
            return timed(lambda: _sync(run_blocks(list(model.blocks), tokens)))

    results: dict[str, Any] = {"blocks": len(model.blocks), "reps": reps, "device": device}
    coords = {cfg: coordinator(model_dir, addresses(procs), *cfg) for cfg in configs}
    # The default configuration once more without spot checks (their share of the latency), and with
    # each check blocking its hop as before deferred checks (what confirming them off the path saves).
    extra = {
        "swarm_fp16_stream_no_spot_checks": coordinator(model_dir, addresses(procs), "fp16", "stream", False),
        "swarm_fp16_stream_blocking_checks": coordinator(
            model_dir, addresses(procs), "fp16", "stream", deferred_checks=False
        ),
    }
    for coord in [*coords.values(), *extra.values()]:
        await coord.start()
    samples: dict[str, list[float]] = {"monolith_1_thread": [], "monolith_2_threads": [], "blocks_1_thread": []}
    samples.update({f"swarm_{w}_{t}": [] for w, t in configs} | {name: [] for name in extra})
    try:
        for rep in range(reps + 2):  # two warm-up rounds: channels, streams, allocator
            # Every configuration once per round, in a rotating order: drift on a shared machine hits all alike.
            round_robin: list[tuple[str, Any]] = [("monolith_1_thread", 1), ("monolith_2_threads", 2)]
            round_robin += [("blocks_1_thread", 1)]
            round_robin += [(f"swarm_{w}_{t}", coords[(w, t)]) for w, t in configs]
            round_robin += list(extra.items())
            shift = rep % len(round_robin)
            for name, what in round_robin[shift:] + round_robin[:shift]:
                if isinstance(what, int):
                    elapsed = blocks_alone() if name == "blocks_1_thread" else monolith(what)
                else:
                    started = time.perf_counter()
                    result = await what.router.classify(images, SEQ)
                    elapsed = time.perf_counter() - started
                    assert result.path.depth == len(model.blocks)
                if rep >= 2:
                    samples[name].append(elapsed)
        results["nodes_compute_ms"] = await nodes_compute_ms(procs)
    finally:
        for coord in [*coords.values(), *extra.values()]:
            await coord.stop()
    base = median_ms(samples["monolith_1_thread"])
    for name, values in samples.items():
        results[f"{name}_ms"] = median_ms(values)
        if name.startswith("swarm_"):
            results["ratio_" + name[len("swarm_") :]] = round(median_ms(values) / base, 4)
    return results


async def nodes_compute_ms(procs: list[Proc]) -> float:
    """The sum of the nodes' own compute time per request (each node's recent average, from Info): set
    beside the monolith's blocks it shows how much slower a block computes in a node than in one process."""
    total = 0.0
    for address in addresses(procs):
        client = NodeClient(address, 1024 * 1024)
        try:
            total += (await client.info(10)).load.ewma_latency_ms
        finally:
            await client.close()
    return round(total, 3)


async def idle_vs_busy_compute(model_dir: Path, procs: list[Proc], reps: int) -> dict[str, Any]:
    """A block's compute time in a node (its own timer) when the nodes are called in turn, each idle
    while the others compute (as in a swarm's request), against the first node called back to back."""
    model, _ = load_model(model_dir)
    with torch.inference_mode():
        x = model.stem(torch.rand(1, 3, model.cfg.image_size, model.cfg.image_size))
    activations = codec.encode(x, torch.float16)
    clients = [NodeClient(address, 64 * 1024 * 1024) for address in addresses(procs)]
    samples: dict[str, list[float]] = {"in_turn": [], "back_to_back": []}

    async def compute_ms(client: NodeClient, position: int) -> float:
        request = pb.ForwardRequest(request_id="idle", activations=activations, position=position)
        return (await client.forward(request, timeout=60)).compute_ms

    try:
        for rep in range(reps + 1):  # one warm-up round
            in_turn = [await compute_ms(client, position) for position, client in enumerate(clients)]
            back_to_back = [await compute_ms(clients[0], 0) for _ in clients]
            if rep:
                samples["in_turn"] += in_turn
                samples["back_to_back"] += back_to_back
    finally:
        for client in clients:
            await client.close()
    return {
        "reps": reps,
        "block_in_turn_ms": round(statistics.median(samples["in_turn"]), 3),
        "block_back_to_back_ms": round(statistics.median(samples["back_to_back"]), 3),
    }


async def concurrent_throughput(
    model_dir: Path,
    procs: list[Proc],
    concurrent: int,
    rounds: int,
    topology: str = "star",
    token_file: Path | None = None,
    deferred_checks: bool = True,
    device: str = "cpu",
    spot_checks: bool = True,
) -> dict[str, Any]:
    """Images per second: `concurrent` batch-1 requests at once through the swarm (fp16 streams, the
    default; nodes micro-batch what queues up) against the monolith on both cores at batch
    `concurrent`, interleaved round by round. Relay chains (`topology`, nodes with the swarm token in
    `token_file`) move 13 activations a request instead of star's 24, and none through the coordinator
    but its two legs. `deferred_checks` False: each spot check blocks its hop (as before they were
    confirmed while the path goes on); `spot_checks` False: none at all. `device`: where the monolith runs (the
    nodes' own flag says theirs)."""
    model, _ = load_model(model_dir)
    model = model.to(device)
    images = torch.rand(concurrent, 3, model.cfg.image_size, model.cfg.image_size)
    on_device = images.to(device)
    coord = coordinator(
        model_dir,
        addresses(procs),
        "fp16",
        "stream",
        spot_checks=spot_checks,
        topology=topology,
        token_file=token_file,
        deferred_checks=deferred_checks,
    )
    await coord.start()
    swarm_s: list[float] = []
    monolith_s: list[float] = []
    cpu: dict[str, list[float]] = {"nodes": [], "coordinator": [], "cores_busy": [], "reexecuted": []}
    try:
        for rep in range(rounds + 1):  # one warm-up round (every node's probation is in it)
            torch.set_num_threads(2)
            with torch.inference_mode():
                monolith = timed(lambda: _sync(model(on_device)))
            torch.set_num_threads(1)  # the coordinator's stem and head, as in the latency runs
            nodes_cpu, own_cpu = sum(cpu_seconds(p.pid) for p in procs), time.process_time()
            reexecuted = _reexecuted(coord)
            started = time.perf_counter()
            results = await asyncio.gather(*(coord.router.classify(images[i : i + 1], SEQ) for i in range(concurrent)))
            swarm = time.perf_counter() - started
            nodes_cpu = sum(cpu_seconds(p.pid) for p in procs) - nodes_cpu
            own_cpu = time.process_time() - own_cpu  # this process is the coordinator
            assert all(r.path.depth == len(model.blocks) and r.path.topology == topology for r in results)
            if rep:
                monolith_s.append(monolith)
                swarm_s.append(swarm)
                cpu["nodes"].append(nodes_cpu)
                cpu["coordinator"].append(own_cpu)
                cpu["cores_busy"].append((nodes_cpu + own_cpu) / swarm)
                cpu["reexecuted"].append(_reexecuted(coord) - reexecuted)
    finally:
        await coord.stop()
    swarm_rate = concurrent / (median_ms(swarm_s) / 1e3)
    monolith_rate = concurrent / (median_ms(monolith_s) / 1e3)
    return {
        "topology": topology,
        "monolith_device": device,
        "deferred_checks": deferred_checks,
        "spot_checks": spot_checks,
        "concurrent": concurrent,
        "rounds": rounds,
        "swarm_images_per_s": round(swarm_rate, 3),
        "monolith_2_threads_images_per_s": round(monolith_rate, 3),
        "ratio": round(swarm_rate / monolith_rate, 4),
        # CPU seconds per round of `concurrent` images (median), and cores busy during the swarm's rounds
        "swarm_nodes_cpu_s": round(statistics.median(cpu["nodes"]), 3),
        "swarm_coordinator_cpu_s": round(statistics.median(cpu["coordinator"]), 3),
        "swarm_cores_busy": round(statistics.median(cpu["cores_busy"]), 3),
        "hops_reexecuted_per_round": statistics.median(cpu["reexecuted"]),  # spot checks, by the coordinator
    }


def _reexecuted(coord: Coordinator) -> int:
    return coord.verifier.counters.reexecuted if coord.verifier is not None else 0


def coordinator_cpu_share(model_dir: Path, procs: list[Proc], requests: int, image_size: int) -> dict[str, Any]:
    """CPU seconds of the coordinator process per request, against all nodes' CPU (HTTP end to end)."""
    coord = coordinator_process(
        model_dir, procs, "--policy", "sequential", "--hop-timeout", "60", "--request-timeout", "300"
    )
    try:
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (image_size, image_size, 3), dtype=np.uint8)).save(
            buf, format="PNG"
        )
        image = buf.getvalue()
        with httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=300) as client:
            # Warm-up past each new node's probation (its first hops are always re-executed by the
            # coordinator): what is measured is the steady state, spot checks at the default rate included.
            for _ in range(3):
                client.post("/v1/classify", files={"file": ("x.png", image, "image/png")})
            before = cpu_seconds(coord.pid), [cpu_seconds(p.pid) for p in procs]
            latencies = []
            for _ in range(requests):
                started = time.perf_counter()
                assert client.post("/v1/classify", files={"file": ("x.png", image, "image/png")}).status_code == 200
                latencies.append(time.perf_counter() - started)
            after = cpu_seconds(coord.pid), [cpu_seconds(p.pid) for p in procs]
    finally:
        stop_all([coord])
    coord_cpu = (after[0] - before[0]) / requests
    nodes_cpu = (sum(after[1]) - sum(before[1])) / requests
    return {
        "requests": requests,
        "coordinator_cpu_ms_per_request": round(coord_cpu * 1e3, 3),
        "nodes_cpu_ms_per_request": round(nodes_cpu * 1e3, 3),
        "coordinator_share": round(coord_cpu / nodes_cpu, 4) if nodes_cpu else None,
        "latency_p50_ms": median_ms(latencies),
    }


def _sync(out: torch.Tensor) -> torch.Tensor:
    if out.is_cuda:
        torch.cuda.synchronize()
    return out
