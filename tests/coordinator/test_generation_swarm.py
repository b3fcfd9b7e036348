"""Generation through real processes: a coordinator and one decoder node per block (harness/procs.py).

Greedy and seeded sampled generation through the swarm in order equal the monolith's own generate; a
node SIGKILLed mid-stream leaves a stream that finishes, its trace saying which hop was rebuilt on a
replica and which block was skipped (within the family's evaluated minimum depth); a client that
leaves mid-stream gets the nodes' caches freed (read from each node's own metrics); the Python client
streams."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from layerswarm.client import AsyncSwarmClient, Generation, SwarmClient, TokenEvent
from layerswarm.client.generation import GenerateOptions
from layerswarm.coordinator.http.generate import GenerateJson
from layerswarm.harness.procs import Proc, stop_all
from layerswarm.models.checkpoint import load_lm

from ..generation_helpers import make_family, wait_ready
from ..swarm import coordinator_process, start_nodes

pytestmark = pytest.mark.slow
TOKENS = 32
COORDINATOR_FLAGS = ("--health-interval", "0.2", "--hop-timeout", "1", "--wire-dtype", "fp32")


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One decoder whose evaluation allows 3 of its 4 blocks (a block may be skipped mid-stream), with no
    end token (eos_id -1), so that every stream runs its whole max_tokens and the faults always land."""
    return make_family(tmp_path_factory.mktemp("lm-swarm"), members=1, min_blocks=3, eos_id=-1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_swarm(model_dir: Path, blocks: list[int]) -> tuple[list[Proc], list[int], Proc]:
    """A node per entry of `blocks` (each with its metrics on a port of its own) and a coordinator."""
    ports = [free_port() for _ in blocks]
    nodes: list[Proc] = []
    try:
        for block, port in zip(blocks, ports, strict=True):
            nodes += start_nodes([(model_dir, block)], "--metrics-port", str(port))
        coord = coordinator_process(model_dir, nodes, *COORDINATOR_FLAGS)
    except BaseException:
        stop_all(nodes)
        raise
    return nodes, ports, coord


def url(coord: Proc) -> str:
    return f"http://127.0.0.1:{coord.ready['port']}"


def streams_open(port: int) -> float:
    """The node's own count of streams whose caches it holds (its Prometheus metrics)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    match = re.search(r"^layerswarm_node_streams_open (\S+)$", text, re.M)
    assert match, "the node exports no layerswarm_node_streams_open"
    return float(match.group(1))


def counter(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{base}/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def swarm(family: list[Path]) -> Iterator[tuple[str, list[int]]]:
    nodes, ports, coord = start_swarm(family[0], [0, 1, 2, 3])
    try:
        wait_ready(url(coord))
        yield url(coord), ports
    finally:
        stop_all([coord, *nodes])


def test_generation_through_the_swarm_equals_the_monolith(family: list[Path], swarm: tuple[str, list[int]]) -> None:
    base, _ = swarm
    model, _ = load_lm(family[0])
    prompt = [1, 17, 30, 31, 40, 8]
    with SwarmClient(base) as client:
        greedy = client.generate(prompt, max_tokens=TOKENS)
        assert list(greedy.token_ids) == model.generate(prompt, TOKENS)
        sampling: GenerateOptions = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}
        sampled = client.generate(prompt, max_tokens=TOKENS, **sampling)
        assert list(sampled.token_ids) == model.generate(prompt, TOKENS, **sampling)  # type: ignore[arg-type]
        assert sampled.token_ids != greedy.token_ids and sampled.seed == 7
        events = list(client.generate_stream(prompt, max_tokens=TOKENS, **sampling))
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id is not None]
    final = events[-1]
    assert isinstance(final, Generation) and tokens == list(sampled.token_ids) == list(final.token_ids)
    assert final.completion_tokens == len(tokens) and final.prompt_tokens == len(prompt)
    assert [hop["block"] for hop in final.route] == [0, 1, 2, 3] and final.trace == ()


async def test_concurrent_streams_batched_at_the_nodes_each_equal_the_monolith(
    family: list[Path], swarm: tuple[str, list[int]]
) -> None:
    base, _ = swarm
    model, _ = load_lm(family[0])
    prompts = [[1, 5 + i, 9, 30 + i] for i in range(6)]
    async with AsyncSwarmClient(base) as client:
        answers = await asyncio.gather(*(client.generate(p, max_tokens=TOKENS) for p in prompts))
    assert [list(a.token_ids) for a in answers] == [model.generate(p, TOKENS) for p in prompts]


def test_a_node_killed_mid_stream_leaves_a_stream_that_finishes(family: list[Path]) -> None:
    """Block 2 has a replica: its node's death is a rebuild there. Block 1 has none: it is skipped,
    which the family's evaluated minimum depth (3 of 4) allows. Both show in the trace and /metrics."""
    nodes, _, coord = start_swarm(family[0], [0, 1, 2, 3, 2])
    base = url(coord)
    try:
        wait_ready(base)
        with SwarmClient(base) as client:
            events: list[object] = []
            for event in client.generate_stream([1, 17, 30, 31], max_tokens=TOKENS, seed=3, temperature=0.7):
                events.append(event)
                if len(events) == 6:
                    route = _live_route(base)
                    killed = [n for n in nodes if _address(n) in (route[1], route[2])]
                    assert len(killed) == 2
                    for proc in killed:
                        proc.signal(signal.SIGKILL)
        final = events[-1]
        assert isinstance(final, Generation) and final.finish_reason == "length"
        assert final.completion_tokens == TOKENS
        kinds = [e["kind"] for e in final.trace]
        assert "rebuilt" in kinds and "skipped" in kinds, final.trace
        rebuilt = next(e for e in final.trace if e["kind"] == "rebuilt")
        assert rebuilt["block"] == 2 and rebuilt["replayed_tokens"] >= 4 + 6
        assert [hop["state"] for hop in final.route] == ["ok", "skipped", "rebuilt", "ok"]
        assert counter(base, "layerswarm_gen_failovers_total", '{kind="rebuilt"}') >= 1
        assert counter(base, "layerswarm_gen_failovers_total", '{kind="skipped"}') >= 1
    finally:
        stop_all([coord, *nodes])


def _live_route(base: str) -> list[str]:
    live = httpx.get(f"{base}/v1/swarm").json()["streams"]["live"]
    assert len(live) == 1
    return [hop["node"] for hop in live[0]["route"]]


def _address(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['port']}"


def test_a_client_that_leaves_mid_stream_frees_every_cache(swarm: tuple[str, list[int]]) -> None:
    base, ports = swarm
    abandoned = counter(base, "layerswarm_gen_streams_total", '{outcome="abandoned"}')
    with SwarmClient(base) as client:
        stream = client.generate_stream([1, 17, 30], max_tokens=80, temperature=0.5, seed=1)
        for _ in range(3):
            next(stream)
        assert [streams_open(p) for p in ports] == [1, 1, 1, 1]  # each node holds the stream's cache
        stream.close()  # leaves: the connection closes
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(streams_open(p) for p in ports):
        time.sleep(0.1)
    assert [streams_open(p) for p in ports] == [0, 0, 0, 0]
    assert counter(base, "layerswarm_gen_streams_total", '{outcome="abandoned"}') == abandoned + 1


async def test_a_lying_node_is_convicted_and_the_stream_it_touched_rebuilt(family: list[Path]) -> None:
    """Two nodes serve block 2, one of them lies from its fourth step on (noise shaped like its real output,
    after the cache it keeps stays honest). Two concurrent streams spread over both; every hop is checked
    (--verify-rate 1): the liar is caught at its first lie, before a token is drawn from it, so both
    streams still equal the monolith, and the one it touched says so in its trace."""
    model, _ = load_lm(family[0])
    prompt = [1, 17, 30, 31]
    honest = start_nodes([(family[0], b) for b in range(4)])
    liar = start_nodes([(family[0], 2)], faults=("--fault-mode", "noise", "--fault-after", "3"))
    coord = coordinator_process(family[0], [*honest, *liar], *COORDINATOR_FLAGS, "--verify-rate", "1")
    base = url(coord)
    try:
        wait_ready(base)
        async with AsyncSwarmClient(base) as client:
            answers = await asyncio.gather(*(client.generate(prompt, max_tokens=TOKENS) for _ in range(2)))
        expected = model.generate(prompt, TOKENS)
        assert [list(a.token_ids) for a in answers] == [expected, expected]
        liar_address = _address(liar[0])
        touched = [a for a in answers if any(e.get("node") == liar_address for e in a.trace)]
        assert len(touched) == 1, [a.route for a in answers]
        kinds = [e["kind"] for e in touched[0].trace]
        assert kinds == ["convicted", "rebuilt"], touched[0].trace
        assert touched[0].trace[0]["tainted_tokens"] == 0
        nodes = {n["address"]: n for n in httpx.get(f"{base}/v1/nodes").json()["nodes"]}
        assert nodes[liar_address]["state"] == "quarantined" and nodes[liar_address]["evidence"]
        assert counter(base, "layerswarm_verify_convictions_total") == 1
    finally:
        stop_all([coord, *honest, *liar])


def test_the_clients_options_are_the_apis() -> None:
    assert set(GenerateOptions.__annotations__) == set(GenerateJson.model_fields) - {"prompt", "prompt_ids", "stream"}
