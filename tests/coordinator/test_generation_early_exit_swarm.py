"""Per-token early exit through real processes: the shipped exit-aware decoder (zoo:lm/layershuffle-exit-0,
6 blocks), a node process per block and a coordinator (fp32 wire).

Greedy early exit through the swarm gives the monolith's early_exit_generate tokens for the same order and
threshold (the skipped blocks' caches filled by the nodes from `fill`, as the monolith fills them), with
fewer block-hops per token than the depth; threshold 1.0 gives plain decoding's; bad values and asking for
speculation too are refused naming `early_exit`; a node SIGKILLed mid-stream is rebuilt on a replica
from the stream's inputs, pending fills included, and the stream still gives the monolith's tokens."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import pytest

from layerswarm.client import Generation, SwarmClient
from layerswarm.harness.procs import stop_all
from layerswarm.models.checkpoint import load_lm
from layerswarm.models.lm.early_exit import early_exit_generate
from layerswarm.models.lm.generate import generate
from layerswarm.models.lm.tokenizer import load_tokenizer
from layerswarm.models.zoo import family_root

from ..generation_helpers import wait_ready
from .test_generation_swarm import _address, _live_route, counter, start_swarm, url

pytestmark = pytest.mark.slow
MEMBER = family_root("lm") / "layershuffle-exit-0"
DEPTH, TOKENS, THRESHOLD = 6, 24, 0.95  # the member's calibrated threshold (its policy)
TEXTS = ("It is", "When the", "Strings can be", "12+34=", "rev:4821=", "A function definition introduces")


def prompts() -> list[list[int]]:
    tok = load_tokenizer(MEMBER / "tokenizer.json")
    return [[1, *tok.encode(t, add_special_tokens=False).ids] for t in TEXTS]


@pytest.fixture(scope="module")
def swarm() -> Iterator[str]:
    nodes, _, coord = start_swarm(MEMBER, list(range(DEPTH)))
    try:
        wait_ready(url(coord), 60)
        yield url(coord)
    finally:
        stop_all([coord, *nodes])


def _run(base: str, early_exit: object) -> list[Generation]:
    with SwarmClient(base) as client:
        return [client.generate(p, max_tokens=TOKENS, early_exit=early_exit) for p in prompts()]  # type: ignore[arg-type]


def test_greedy_early_exit_through_the_swarm_equals_the_monolith(swarm: str) -> None:
    model, manifest = load_lm(MEMBER)
    eos = manifest.config.eos_id
    exited = _run(swarm, THRESHOLD)
    route = model.route()
    reference = [early_exit_generate(model.stem, route, model.head, [p], TOKENS, THRESHOLD, eos)[0] for p in prompts()]
    assert [list(g.token_ids) for g in exited] == reference
    stats = [g.early_exit for g in exited]
    assert all(s is not None and s["mode"] == str(THRESHOLD) for s in stats), stats
    exits = sum(s["exits"] for s in stats)  # type: ignore[index]
    hops = sum(s["block_hops"] for s in stats)  # type: ignore[index]
    tokens = sum(g.completion_tokens for g in exited)
    assert exits > 0 and hops / tokens < DEPTH - 1, (exits, hops, tokens)  # many tokens left early
    assert all(g.trips == g.completion_tokens + (g.finish_reason == "stop") for g in exited)  # one trip a token
    assert counter(swarm, "layerswarm_gen_early_exits_total") >= exits
    assert counter(swarm, "layerswarm_gen_block_hops_total") >= hops
    calibrated = _run(swarm, "on")  # the member's policy names the same threshold
    assert [list(g.token_ids) for g in calibrated] == reference


def test_threshold_one_and_off_give_plain_decoding(swarm: str) -> None:
    model, manifest = load_lm(MEMBER)
    plain = [generate(model.stem, model.route(), model.head, [p], TOKENS, manifest.config.eos_id)[0] for p in prompts()]
    for ask in ("off", 1.0):
        got = _run(swarm, ask)
        assert [list(g.token_ids) for g in got] == plain, ask
        assert all(g.early_exit is not None and g.early_exit["exits"] == 0 for g in got), ask
    off = _run(swarm, "off")[0]
    assert off.early_exit is not None and off.early_exit["block_hops_per_token"] == pytest.approx(
        DEPTH * off.trips / off.completion_tokens
    )


def test_bad_early_exit_values_are_refused_with_a_reason(swarm: str) -> None:
    for bad in ("fast", 0, -0.5, 1.5, "1.2", [0.9], {"threshold": 0.9}):
        r = httpx.post(f"{swarm}/v1/generate", json={"prompt_ids": [1, 2], "early_exit": bad})
        assert r.status_code == 422 and "early_exit" in r.text, (bad, r.text)
        r = httpx.post(
            f"{swarm}/v1/completions",
            json={"model": "layershuffle-exit-0", "prompt": [1, 2], "max_tokens": 2, "early_exit": bad},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "early_exit", (bad, r.text)
    both = {"early_exit": "on", "speculation": 2}
    r = httpx.post(f"{swarm}/v1/generate", json={"prompt_ids": [1, 2], **both})
    assert r.status_code == 422 and "early_exit" in r.text and "speculation" in r.text, r.text
    r = httpx.post(
        f"{swarm}/v1/completions", json={"model": "layershuffle-exit-0", "max_tokens": 2, "prompt": [1, 2], **both}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "early_exit", r.text
    r = httpx.post(
        f"{swarm}/v1/completions",
        json={"model": "layershuffle-exit-0", "prompt": [1, 2], "max_tokens": 4, "temperature": 0, "early_exit": 0.9},
    )
    assert r.status_code == 200 and r.json()["layerswarm"]["early_exit"]["mode"] == "0.9", r.text


def test_a_node_killed_mid_stream_is_rebuilt_with_its_pending_fills() -> None:
    """Block 2 has a replica: the node serving it is SIGKILLed after a few tokens; the replica's cache is
    rebuilt from the stream's inputs (the exited tokens' fills among them), and the tokens stay the
    monolith's."""
    nodes, _, coord = start_swarm(MEMBER, [*range(DEPTH), 2])
    base, prompt, tokens = url(coord), prompts()[0], 96  # "It is": no end token in 96, a stream long enough
    model, manifest = load_lm(MEMBER)
    reference = early_exit_generate(
        model.stem, model.route(), model.head, [prompt], tokens, THRESHOLD, manifest.config.eos_id
    )[0]
    try:
        wait_ready(base, 60)
        with SwarmClient(base) as client:
            events: list[object] = []
            for event in client.generate_stream(prompt, max_tokens=tokens, early_exit=THRESHOLD):
                events.append(event)
                if len(events) == 2:
                    route = _live_route(base)
                    for proc in [n for n in nodes if _address(n) == route[2]]:
                        proc.signal(signal.SIGKILL)
        final = events[-1]
        assert isinstance(final, Generation) and final.finish_reason == "length"
        assert list(final.token_ids) == reference and len(reference) == tokens
        assert "rebuilt" in [e["kind"] for e in final.trace], final.trace
        assert final.route[2]["state"] == "rebuilt"
        assert final.early_exit is not None and final.early_exit["exits"] > 0
        shown = httpx.get(f"{base}/v1/swarm").json()["streams"]["recent"][0]  # what the page draws
        assert shown["early_exit"] == final.early_exit
    finally:
        stop_all([coord, *nodes])
