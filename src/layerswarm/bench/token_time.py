"""Where one batch-1 token's time goes (`bench --only token-time`), part by part, in one run.

The swarm of bench/generation.py (zoo:lm/layershuffle-0, a node process per block, fp32 wire), measured
from the bottom up, each rung adding one layer, so a difference between rungs is that layer's cost:

    echo        a bare gRPC stream round trip of one token's activation (grpc_echo.py's `raw`), timed in
                every round, as the generation bench times its floor's
    hop         one Decode step of a lone stream on one node over its DecodeStream: the round trip, the
                node's compute (its reply's compute_ms), and the node's CPU per step (/proc)
    chain       the same steps through every node in turn, from a bare client: no coordinator logic
    stem_head   the coordinator's stem and head for one token, called directly
    coordinator a Coordinator in this process streaming tokens (Generator.tokens, no HTTP): the gap
                between tokens, and the CPU per token of this process and of the nodes
    http        a coordinator process streaming over HTTP (`POST /v1/generate`, server-sent events)
    waves       WAVE streams stepped together through every node in turn from a bare client, their steps
                to a node in one DecodeBatch message (the coordinator's DecodeMux): no coordinator logic;
                in 1, 2 and 4 groups over clients of their own (a pipeline: several nodes at once). The
                client's CPU per token is this process's
    monolith    the whole model in this process, one thread: the floor's compute for a token (its
                `Monolith`), timed in every round; the floor is depth x echo + monolith, as the issue's

Beside the ladder, `relay_floor` (relay_floor.py): the same token through as many bare gRPC processes,
star-wise and chain-wise, the most a decoder relay chain could save on messages here.

Rounds interleave the rungs, so a busy machine slows all of them alike. Nothing is asserted: the parts
are for docs/generation-coordinator.md ("Where a token's time goes").

`bounds`: what a coordinator costing nothing beyond its stem and head could reach with these nodes on
this machine, against issue 40's two speed targets (docs/generation-coordinator.md, "What a coordinator as
lean as a bare client could reach here"):

    lean_batch1_over_floor   (chain + stem_head - relay_floor's saved_ms) / floor: a token through the
                             nodes alone, with the stem and head, less what bare processes save
                             chain-wise (an estimate: a real relay's nodes would check more)
    wave_groups              the schedule of the waves rung with the most tokens/s, which the rest use
    wave_cpu_share           its CPU (nodes and client) over all the machine's cores: under 1, the
                             wave waits on more than its own CPU (other work on the machine included)
    wave_over_chain          the nodes alone: WAVE streams' tokens/s over one stream's (the chain's)
    wave_over_http_1         the nodes alone at WAVE streams over the real swarm's one stream (HTTP)
    wave_at_batch1_target    the nodes alone at WAVE streams over one stream that meets the batch-1
                             target (TARGET_BATCH1_OVER_FLOOR x floor a token): under 8, the two targets
                             cannot both hold here for a coordinator no cheaper than this bare client
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from layerswarm.coordinator.generation.options import GenerationOptions
from layerswarm.coordinator.membership.clients import NodeClient
from layerswarm.coordinator.process import Coordinator
from layerswarm.coordinator.settings import CoordinatorSettings
from layerswarm.harness.procs import Proc, coordinator_cmd, node_address, spawn, stop_all
from layerswarm.harness.swarm import wait_for_swarm
from layerswarm.models.checkpoint import load_stem_head, read_lm_manifest
from layerswarm.models.zoo import family_root
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from .fixtures import cpu_seconds, nodes
from .generation import (
    CONCURRENT,
    MEMBER,
    PROMPT,
    TARGET_BATCH1_OVER_FLOOR,
    TOKENS,
    Monolith,
    echo_round_trip_s,
    stream_gaps_s,
)
from .relay_floor import star_and_chain_ms

STEPS = 100  # per hop round (a stream's context is 128 tokens: one stream a round)
WAVE = CONCURRENT  # streams stepped together in the wave rung, as many as the generation bench's
WAVE_STEPS = 24  # tokens per stream in a wave round
WAVE_GROUPS = (1, 2, 4)  # the schedules of the wave rung: streams in this many groups
MONOLITH_REPS = 3  # monolith timings a round
ECHO_TRIPS = 100  # echo round trips a round


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _cpu(procs: list[Proc]) -> float:
    return sum(cpu_seconds(p.popen.pid) for p in procs)


async def chain_steps(addresses: list[str], procs: list[Proc], dim: int) -> dict[str, float]:
    """STEPS one-token steps of a fresh stream through these nodes in turn (no coordinator logic): the
    median time a token took, the nodes' median compute_ms and their CPU per step."""
    clients = [NodeClient(a, 64 << 20) for a in addresses]
    links = [c.decode_link() for c in clients]
    stream, x = secrets.token_hex(16), torch.randn(1, 1, dim) * 0.1
    per_token, compute = [], []
    before = _cpu(procs)
    try:
        for start in range(STEPS):
            started = time.perf_counter()
            for link in links:
                request = pb.DecodeRequest(stream_id=stream, start=start, activations=codec.encode(x, torch.float32))
                compute.append((await link.step(request, 5.0)).compute_ms)
            per_token.append(time.perf_counter() - started)
    finally:
        for link in links:
            link.close()
        for client in clients:
            await client.close()
    return {
        "per_token_ms": _ms(statistics.median(per_token)),
        "compute_ms": round(statistics.median(compute), 3),
        "node_cpu_ms_per_step": round((_cpu(procs) - before) / (STEPS * len(links)) * 1e3, 3),
    }


async def wave_tokens_per_s(
    addresses: list[str], procs: list[Proc], dim: int, streams: int, groups: int = 1
) -> dict[str, float]:
    """`streams` streams, WAVE_STEPS one-token steps each after a first untimed one (which opens the
    channels, the calls and the streams), stepped together through these nodes in turn from a bare
    client: every node's steps of a turn go as one DecodeBatch (the coordinator's mux). With `groups` > 1
    the streams are split into that many groups, each over clients (channels, muxes) of its own, so that
    the groups' messages go apart and several nodes may compute at once (a pipeline). The streams'
    tokens per second, the nodes' CPU per token and this process's (the client's)."""
    clients = [[NodeClient(a, 64 << 20) for a in addresses] for _ in range(groups)]
    links = [[c.decode_link() for c in clients[i % groups]] for i in range(streams)]
    ids = [secrets.token_hex(16) for _ in range(streams)]
    x = codec.encode(torch.randn(1, 1, dim) * 0.1, torch.float32)

    async def one(i: int, starts: range) -> None:
        for start in starts:
            for link in links[i]:
                await link.step(pb.DecodeRequest(stream_id=ids[i], start=start, activations=x), 10.0)

    async def together(starts: range) -> None:
        tasks = [asyncio.ensure_future(one(i, starts)) for i in range(streams)]
        try:
            await asyncio.gather(*tasks)
        finally:  # one failed: the others stop before their clients close under them
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        await together(range(1))
        before, own, started = _cpu(procs), time.process_time(), time.perf_counter()
        await together(range(1, WAVE_STEPS + 1))
        wall, cpu, client = time.perf_counter() - started, _cpu(procs) - before, time.process_time() - own
    finally:  # the calls end: the nodes free the streams opened over them
        for c in itertools.chain.from_iterable(clients):
            await c.close()
    tokens = streams * WAVE_STEPS
    return {
        "tokens_per_s": round(tokens / wall, 1),
        "nodes_cpu_ms_per_token": round(cpu / tokens * 1e3, 3),
        "client_cpu_ms_per_token": round(client / tokens * 1e3, 3),
    }


def stem_head_ms(member: Path, reps: int) -> float:
    """The coordinator's stem and head for one token, called directly (one thread)."""
    manifest = read_lm_manifest(member)
    stem, head = load_stem_head(member, manifest)
    x, token = torch.randn(1, manifest.config.dim), torch.tensor([[5]])
    samples = []
    with torch.inference_mode():
        for _ in range(reps):
            started = time.perf_counter()
            stem(token)
            head(x)
            samples.append(time.perf_counter() - started)
    return _ms(statistics.median(samples))


async def coordinator_tokens(coord: Coordinator, procs: list[Proc], streams: int) -> dict[str, float]:
    """`streams` greedy streams one after another through an in-process coordinator (no HTTP)."""
    g = coord.generator
    prompt = g.encode(PROMPT)
    gaps: list[float] = []
    nodes_cpu = own_cpu = 0.0
    tokens = 0
    for _ in range(streams):
        s = await g.open(prompt, GenerationOptions(max_tokens=TOKENS, temperature=0))
        try:
            logits = await g.prefill(s)
            stamps = []
            before, own = _cpu(procs), time.process_time()
            async for _delta in g.tokens(s, logits):
                stamps.append(time.perf_counter())
            nodes_cpu += _cpu(procs) - before
            own_cpu += time.process_time() - own
            tokens += len(stamps)
            gaps += [b - a for a, b in itertools.pairwise(stamps)]
        finally:
            g.close(s)
    await g.releases_done()
    return {
        "per_token_ms": _ms(statistics.median(gaps)),
        "coordinator_cpu_ms_per_token": round(own_cpu / tokens * 1e3, 3),
        "nodes_cpu_ms_per_token": round(nodes_cpu / tokens * 1e3, 3),
    }


async def _rounds(member: Path, procs: list[Proc], http_base: str, rounds: int, dim: int) -> dict[str, Any]:
    addresses = [node_address(p) for p in procs]
    settings = CoordinatorSettings(model_dir=member, peers=tuple(addresses), mdns=False, wire_dtype="fp32")
    coord = Coordinator(settings)
    await coord.start()
    hop, chain, inproc, http, echoes, monolith_s = [], [], [], [], [], []
    waves: dict[int, list[dict[str, float]]] = {g: [] for g in WAVE_GROUPS}
    try:
        monolith = Monolith(member, coord.generator.encode(PROMPT))
        while not coord.generator.depth_ready()[0]:
            await asyncio.sleep(0.05)
        with httpx.Client(base_url=http_base, timeout=60.0) as client:
            for _ in range(rounds):
                hop.append(await chain_steps(addresses[:1], procs[:1], dim))
                chain.append(await chain_steps(addresses, procs, dim))
                inproc.append(await coordinator_tokens(coord, procs, 1))
                http += await asyncio.to_thread(stream_gaps_s, client)
                for groups, seen in waves.items():
                    seen.append(await wave_tokens_per_s(addresses, procs, dim, WAVE, groups))
                echoes.append(await echo_round_trip_s(dim, ECHO_TRIPS))
                monolith_s += monolith.per_token_s(MONOLITH_REPS)
    finally:
        await coord.stop()
    return {
        "hop": _medians(hop),
        "chain": _medians(chain),
        "coordinator": _medians(inproc),
        "http_per_token_ms": _ms(statistics.median(http)),
        "waves": {str(g): {"streams": WAVE, "groups": g, **_medians(seen)} for g, seen in waves.items()},
        "echo_ms": _ms(statistics.median(echoes)),  # of the rounds' medians
        "monolith_ms": _ms(statistics.median(monolith_s)),
    }


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]}


def run(quick: bool) -> dict[str, Any]:
    member = family_root("lm") / MEMBER
    config = read_lm_manifest(member).config
    depth, dim = config.depth, config.dim
    rounds = 3 if quick else 10
    before = os.getloadavg()
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a coordinator process runs (--threads 1)
    try:
        with nodes([(member, b) for b in range(depth)]) as procs:
            coordinator = spawn("bench-coordinator", coordinator_cmd(member, procs, "--wire-dtype", "fp32"), 120)
            try:
                base = f"http://127.0.0.1:{coordinator.ready['port']}"
                with httpx.Client(base_url=base, timeout=60.0) as client:
                    wait_for_swarm(client, depth, 120)
                parts = asyncio.run(_rounds(member, procs, base, rounds, dim))
            finally:
                stop_all([coordinator])
        payload = pb.ForwardRequest(activations=codec.encode(torch.zeros(1, 1, dim))).SerializeToString()
        relay = asyncio.run(star_and_chain_ms(depth, payload, 100 if quick else 500))
        stem_head = stem_head_ms(member, 200)
    finally:
        torch.set_num_threads(torch_threads)
    return {
        "model": f"zoo:lm/{MEMBER}",
        "depth": depth,
        "dim": dim,
        "rounds": rounds,
        "stem_head_ms": stem_head,
        **parts,
        "split": split(depth, parts["echo_ms"], stem_head, parts),
        "relay_floor": relay,
        "bounds": bounds(depth, stem_head, relay["saved_ms"], parts),
        "load_average": [round(before[0], 2), round(os.getloadavg()[0], 2)],
    }


def bounds(depth: int, stem_head: float, saved: float, parts: dict[str, Any]) -> dict[str, Any]:
    """What a coordinator costing nothing beyond its stem and head could reach here (see the docstring)."""
    floor = depth * parts["echo_ms"] + parts["monolith_ms"]
    chain_ms = parts["chain"]["per_token_ms"]
    best = max(parts["waves"].values(), key=lambda w: w["tokens_per_s"])  # the best schedule of this run
    lean = chain_ms + stem_head - saved
    tps = best["tokens_per_s"]
    return {
        "floor_ms": round(floor, 3),
        "lean_batch1_ms": round(lean, 3),
        "lean_batch1_over_floor": round(lean / floor, 3),
        "wave_groups": best["groups"],
        "wave_cpu_share": round(
            tps * (best["nodes_cpu_ms_per_token"] + best["client_cpu_ms_per_token"]) / 1e3 / (os.cpu_count() or 1), 3
        ),
        "wave_over_chain": round(tps * chain_ms / 1e3, 2),
        "wave_over_http_1": round(tps * parts["http_per_token_ms"] / 1e3, 2),
        "wave_at_batch1_target": round(tps * TARGET_BATCH1_OVER_FLOOR * floor / 1e3, 2),
    }


def split(depth: int, echo: float, stem_head: float, parts: dict[str, Any]) -> dict[str, float]:
    """One token's time by part (ms): the differences between rungs."""
    hop, chain, coord = parts["hop"], parts["chain"], parts["coordinator"]
    node_overhead = hop["per_token_ms"] - hop["compute_ms"] - echo
    return {
        "grpc_round_trips": round(depth * echo, 3),
        "block_compute": round(depth * hop["compute_ms"], 3),
        "node_overhead": round(depth * node_overhead, 3),
        "chain_rest": round(chain["per_token_ms"] - depth * hop["per_token_ms"], 3),
        "coordinator_and_stem_head": round(coord["per_token_ms"] - chain["per_token_ms"], 3),
        "http_sse": round(parts["http_per_token_ms"] - coord["per_token_ms"], 3),
        "stem_head_alone": stem_head,
    }
