"""Self-speculative decoding through real processes: a coordinator and one decoder node per block.

200 prompts generated greedily with plain decoding and with speculation (fixed k and adaptive, every other
prompt) through the same swarm give identical token sequences (and the monolith's); the speculative streams make fewer
trips than tokens and their counts show in the answer and /metrics; bad values are a 422 naming the
parameter; a node SIGKILLed mid-stream leaves a speculative stream that finishes (rebuilt on a replica,
or skipped within the evaluated minimum depth), as plain streams do."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from layerswarm.client import AsyncSwarmClient, Generation, SwarmClient
from layerswarm.harness.procs import stop_all
from layerswarm.models.checkpoint import load_lm
from layerswarm.models.lm.generate import generate

from ..generation_helpers import make_lm_dir, wait_ready
from .test_generation_swarm import _address, _live_route, counter, start_swarm, url

pytestmark = pytest.mark.slow
PROMPTS, TOKENS, AT_ONCE = 200, 12, 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Blocks scaled so that the one-block draft agrees with the model about half the time (both the kept
    and the rejected branch run often); no end token; an evaluated minimum depth of 3 of 4 blocks."""
    return make_lm_dir(tmp_path_factory.mktemp("spec-swarm") / "m0", block_scale=3.0, eos_id=-1, min_blocks=3)


@pytest.fixture(scope="module")
def swarm_and_ports(model_dir: Path) -> Iterator[tuple[str, list[int]]]:
    """The coordinator's URL and each node's metrics port."""
    nodes, ports, coord = start_swarm(model_dir, [0, 1, 2, 3])
    try:
        wait_ready(url(coord))
        yield url(coord), ports
    finally:
        stop_all([coord, *nodes])


@pytest.fixture(scope="module")
def swarm(swarm_and_ports: tuple[str, list[int]]) -> str:
    return swarm_and_ports[0]


def prompts() -> list[list[int]]:
    return [[1, 3 + i % 290, 7 + (i * 13) % 280, 40 + (i * 7) % 250][: 2 + i % 3] for i in range(PROMPTS)]


async def _all(base: str, speculation: list[object]) -> list[Generation]:
    """Every prompt, the i-th with speculation[i % len(speculation)], AT_ONCE streams at a time."""
    gate = asyncio.Semaphore(AT_ONCE)
    async with AsyncSwarmClient(base) as client:

        async def one(i: int, prompt: list[int]) -> Generation:
            async with gate:
                ask = speculation[i % len(speculation)]
                return await client.generate(prompt, max_tokens=TOKENS, speculation=ask)  # type: ignore[arg-type]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts())))


async def test_greedy_speculation_through_the_swarm_equals_plain_decoding(
    model_dir: Path, swarm_and_ports: tuple[str, list[int]]
) -> None:
    swarm, ports = swarm_and_ports
    plain = await _all(swarm, ["off"])
    before = [_verifies(p) for p in ports]
    speculative = await _all(swarm, [{"k": 3}, "auto"])
    model, _ = load_lm(model_dir)
    reference = generate(model.stem, model.route(), model.head, prompts(), TOKENS)
    assert [list(g.token_ids) for g in plain] == reference
    assert [list(g.token_ids) for g in speculative] == reference
    assert {g.speculation["mode"] for g in speculative} == {"3", "auto"}  # type: ignore[index]
    drafted = sum(g.speculation["drafted"] for g in speculative)  # type: ignore[index]
    accepted = sum(g.speculation["accepted"] for g in speculative)  # type: ignore[index]
    assert 0.2 < accepted / drafted < 0.9  # rejections and acceptances, many of each
    assert sum(g.trips for g in speculative) < 0.8 * PROMPTS * TOKENS
    assert all(g.trips == TOKENS for g in plain)
    after = [_verifies(p) for p in ports]  # every node got multi-token verify steps (and cut back the rejected)
    assert all(a - b >= PROMPTS for a, b in zip(after, before, strict=True)), (before, after)
    assert counter(swarm, "layerswarm_gen_drafted_tokens_total") >= drafted
    assert counter(swarm, "layerswarm_gen_accepted_tokens_total") >= accepted


def _verifies(metrics_port: int) -> float:
    return counter(f"http://127.0.0.1:{metrics_port}", "layerswarm_node_decode_steps_total", '{kind="verify"}')


def test_seeded_sampling_through_the_swarm_gives_the_same_text_at_any_k(swarm: str) -> None:
    body = {"prompt_ids": [1, 17, 30], "max_tokens": 24, "temperature": 0.9, "top_k": 40, "seed": 5}
    texts = [
        httpx.post(f"{swarm}/v1/generate", json={**body, "speculation": ask}, timeout=60).json()["token_ids"]
        for ask in (1, 4, "auto")
    ]
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) == 24


def test_bad_speculation_values_are_refused_with_a_reason(swarm: str) -> None:
    for bad in ("fast", -1, 99, {"k": 2, "depth": 1}, 1.5):
        r = httpx.post(f"{swarm}/v1/generate", json={"prompt_ids": [1, 2], "speculation": bad})
        assert r.status_code == 422 and "speculation" in r.text, (bad, r.text)
        r = httpx.post(
            f"{swarm}/v1/completions", json={"model": "m0", "prompt": [1, 2], "max_tokens": 2, "speculation": bad}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculation", (bad, r.text)
    r = httpx.post(
        f"{swarm}/v1/completions",
        json={"model": "m0", "prompt": [1, 2], "max_tokens": 4, "temperature": 0, "speculation": {"k": 2}},
    )
    assert r.status_code == 200 and r.json()["layerswarm"]["speculation"]["mode"] == "2", r.text


def test_a_node_killed_mid_speculative_stream_leaves_a_stream_that_finishes(model_dir: Path) -> None:
    """Block 2 has a replica (a rebuild there), block 1 has none (skipped, within 3 of 4 blocks)."""
    nodes, _, coord = start_swarm(model_dir, [0, 1, 2, 3, 2])
    base, tokens = url(coord), 48
    try:
        wait_ready(base)
        with SwarmClient(base) as client:
            events: list[object] = []
            for event in client.generate_stream([1, 17, 30, 31], max_tokens=tokens, speculation="auto"):
                events.append(event)
                if len(events) == 1:  # at once: a speculative stream of 48 tokens is over in a few dozen ms
                    route = _live_route(base)
                    for proc in [n for n in nodes if _address(n) in (route[1], route[2])]:
                        proc.signal(signal.SIGKILL)
        final = events[-1]
        assert isinstance(final, Generation) and final.finish_reason == "length"
        assert final.completion_tokens == tokens and final.speculation is not None
        assert final.speculation["drafted"] > 0
        kinds = [e["kind"] for e in final.trace]
        assert "rebuilt" in kinds and "skipped" in kinds, final.trace
        assert [hop["state"] for hop in final.route] == ["ok", "skipped", "rebuilt", "ok"]
        shown = httpx.get(f"{base}/v1/swarm").json()["streams"]["recent"][0]  # what the page draws
        assert shown["speculation"] == final.speculation and shown["trips"] == final.trips < tokens
    finally:
        stop_all([coord, *nodes])
