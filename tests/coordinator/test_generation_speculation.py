"""Self-speculative decoding in the coordinator (generation/speculate.py) over in-process stand-ins for
decoder nodes: greedy output equals plain decoding's token for token (with drafts rejected about half the
time, so both branches run), sampled output has plain sampling's distribution (a chi-square test on the
first two tokens against the model's exact probabilities) and the same text for a seed whatever k is,
a node that dies mid-stream is rebuilt as in plain decoding, and bad values are refused.
(Through real node processes: test_generation_speculation_swarm.py.)"""

from __future__ import annotations

import asyncio
import threading
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import torch

from layerswarm.coordinator.generation.options import (
    GenerationOptions,
    InvalidGeneration,
    Speculation,
    parse_speculation,
)
from layerswarm.coordinator.generation.runner import StreamFailed
from layerswarm.models.checkpoint import load_lm
from layerswarm.models.lm.draft import DraftStream
from layerswarm.models.lm.generate import Sampling, next_token_probs

from ..generation_helpers import fake_swarm, generate_all, make_lm_dir

TOKENS = 24
FIXED, AUTO = Speculation(k=3), Speculation(adaptive=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Blocks scaled so that a one-block draft agrees with the model about half the time; no eos."""
    return make_lm_dir(tmp_path_factory.mktemp("spec") / "m0", block_scale=3.0, eos_id=-1)


def prompts(n: int) -> list[list[int]]:
    return [[1, 3 + i % 290, 7 + (i * 13) % 280, 40 + (i * 7) % 250][: 2 + i % 3] for i in range(n)]


async def test_greedy_speculation_equals_plain_decoding(model_dir: Path, one_torch_thread: None) -> None:
    swarm = fake_swarm([(model_dir, b) for b in range(4)], model_dir)
    model, _ = load_lm(model_dir)
    asks = [Speculation(k=1), FIXED, AUTO]
    drafted = accepted = trips = tokens = 0
    for i, prompt in enumerate(prompts(24)):
        got, s = await generate_all(swarm.generator, prompt, max_tokens=TOKENS, speculation=asks[i % 3])
        assert got == model.generate(prompt, TOKENS), (prompt, asks[i % 3])
        view = s.view()["speculation"]
        assert view["mode"] == asks[i % 3].describe() and view["draft_depth"] == 1
        drafted, accepted, trips, tokens = (
            drafted + view["drafted"],
            accepted + view["accepted"],
            trips + s.trips,
            tokens + len(got),
        )
    assert 0.2 < accepted / drafted < 0.9, (accepted, drafted)  # both branches ran, many times
    assert trips < 0.8 * tokens  # fewer trips than plain decoding's one per token
    assert swarm.held() == 0


async def test_seeded_sampling_gives_the_same_text_at_any_k(model_dir: Path, one_torch_thread: None) -> None:
    swarm = fake_swarm([(model_dir, b) for b in range(4)], model_dir)
    sampling = {"temperature": 0.9, "top_k": 50, "max_tokens": TOKENS}
    texts = [
        (await generate_all(swarm.generator, [1, 17, 30], seed=seed, speculation=ask, **sampling))[0]
        for seed in (4, 5)
        for ask in (Speculation(k=1), Speculation(k=5), AUTO)
    ]
    assert texts[0] == texts[1] == texts[2] and texts[3] == texts[4] == texts[5]
    assert texts[0] != texts[3] and len(texts[0]) == TOKENS


async def test_sampled_speculation_has_plain_samplings_distribution(model_dir: Path, one_torch_thread: None) -> None:
    """The first two tokens of STREAMS seeded streams (the first judged against the draft's own draw, the
    second a drafted token kept or resampled from the residual) against the model's exact joint
    probabilities, top_k 3 (9 cells): chi-square under 26.1 (p = 0.001 at 8 degrees of freedom). The
    draft's own joint distribution is far from the model's (the test can see a rule that keeps drafts)."""
    streams = 900
    swarm = fake_swarm([(model_dir, b) for b in range(4)], model_dir)
    prompt, sampling = [1, 17, 30], Sampling(temperature=1.5, top_k=3)
    target, drafted = _joint(model_dir, prompt, sampling, depth=4), _joint(model_dir, prompt, sampling, depth=1)
    counts: dict[tuple[int, int], int] = {}
    for seed in range(streams):
        got, _ = await generate_all(
            swarm.generator, prompt, max_tokens=2, temperature=1.5, top_k=3, seed=seed, speculation=FIXED
        )
        counts[(got[0], got[1])] = counts.get((got[0], got[1]), 0) + 1
    assert set(counts) <= set(target)
    assert _chi2(counts, target, streams) < 26.1
    far = {cell: round(p * streams) for cell, p in drafted.items()}
    assert _chi2(far, target, streams) > 100


def _joint(model_dir: Path, prompt: list[int], sampling: Sampling, depth: int) -> dict[tuple[int, int], float]:
    """Exact probabilities of the first two tokens with the model's first `depth` blocks."""
    model, _ = load_lm(model_dir)

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            x = model.stem(torch.tensor([ids]))
            for block in model.route()[:depth]:
                x = block(x)
            return next_token_probs(model.head(x[:, -1]), sampling)[0]

    first = probs(prompt)
    return {
        (a, b): float(first[a] * probs([*prompt, a])[b])
        for a, b in product(range(first.shape[0]), repeat=2)
        if first[a] > 0 and probs([*prompt, a])[b] > 0
    }


def _chi2(counts: dict[tuple[int, int], int], target: dict[tuple[int, int], float], n: int) -> float:
    return sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in target.items())


async def test_a_node_that_dies_mid_stream_is_rebuilt_and_the_text_is_unchanged(model_dir: Path) -> None:
    swarm = fake_swarm([(model_dir, b) for _ in range(2) for b in range(4)], model_dir)
    model, _ = load_lm(model_dir)
    g, prompt = swarm.generator, [1, 17, 30, 31]
    s = await g.open(prompt, GenerationOptions(max_tokens=TOKENS, speculation=FIXED))
    tokens: list[int] = []
    try:
        logits = await g.prefill(s)
        async for delta in g.tokens(s, logits):
            tokens.append(delta.token)  # type: ignore[arg-type]
            if len(tokens) == 5:
                swarm.nodes[s.route[2].node.address].dead = True  # type: ignore[union-attr]
    finally:
        g.close(s)
        await g.releases_done()
    assert tokens == model.generate(prompt, TOKENS)
    assert [e["kind"] for e in s.trace] == ["hop_failed", "rebuilt"] and s.trace[1]["position"] == 2
    assert s.speculation.drafted > 0


def test_bad_speculation_values_are_refused_naming_the_parameter() -> None:
    assert parse_speculation("auto") == AUTO and parse_speculation({"k": 3}) == FIXED
    assert parse_speculation(0) == parse_speculation("off") == parse_speculation(None) == Speculation()
    for bad in (-1, 17, "fast", 2.5, True, {"k": 3, "depth": 2}, {"depth": 2}, [3]):
        with pytest.raises(InvalidGeneration) as caught:
            parse_speculation(bad)
        assert caught.value.param == "speculation"


async def test_a_model_of_one_block_cannot_speculate(tmp_path: Path) -> None:
    one = make_lm_dir(tmp_path / "one", depth=1)
    swarm = fake_swarm([(one, 0)], one)
    with pytest.raises(InvalidGeneration, match="2 blocks"):
        await swarm.generator.open([1, 2], GenerationOptions(speculation=FIXED))
    tokens, _ = await generate_all(swarm.generator, [1, 2], max_tokens=4)  # plain decoding still works
    assert len(tokens) <= 4


async def test_the_draft_is_loaded_by_the_first_stream_that_asks_and_verified(tmp_path: Path) -> None:
    """No copy of the draft's blocks until a stream asks for speculation; a block file that changed since
    start (its sha256 no longer the manifest's) fails that stream clearly, and plain streams go on."""
    model_dir = make_lm_dir(tmp_path / "m", eos_id=-1)
    swarm = fake_swarm([(model_dir, b) for b in range(4)], model_dir)
    speculator = swarm.generator.speculator
    assert speculator is not None and speculator._drafter is None
    (model_dir / "block_00.safetensors").write_bytes(b"not the weights")
    with pytest.raises(StreamFailed, match="draft could not be loaded"):
        await generate_all(swarm.generator, [1, 2, 3], max_tokens=4, speculation=FIXED)
    tokens, _ = await generate_all(swarm.generator, [1, 2, 3], max_tokens=4)
    assert len(tokens) == 4 and speculator._drafter is None


async def test_a_lone_streams_drafts_run_on_the_event_loop_and_concurrent_streams_on_the_thread(
    model_dir: Path, one_torch_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone stream's round drafts on the event loop (no thread hand-off: two wake-ups a call), once its
    drafts are known to be short; with two streams live, every draft goes to the stem-and-head thread (a
    draft on the loop would hold up the other stream's I/O). The tokens are plain decoding's either way."""
    threads: list[int] = []
    propose = DraftStream.propose

    def recorded(self: DraftStream, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(DraftStream, "propose", recorded)
    swarm = fake_swarm([(model_dir, b) for b in range(4)], model_dir)
    model, _ = load_lm(model_dir)
    loop_thread = threading.get_ident()
    got, _ = await generate_all(swarm.generator, [1, 17, 30], max_tokens=TOKENS, speculation=FIXED)
    assert got == model.generate([1, 17, 30], TOKENS)
    assert len(threads) > 3 and threads[0] != loop_thread  # the first draft measures, on the thread
    assert all(t == loop_thread for t in threads[1:]), threads
    threads.clear()
    pair = await asyncio.gather(
        *(generate_all(swarm.generator, p, max_tokens=TOKENS, speculation=FIXED) for p in ([1, 17, 30], [1, 5]))
    )
    assert [tokens for tokens, _ in pair] == [model.generate(p, TOKENS) for p in ([1, 17, 30], [1, 5])]
    assert threads and loop_thread not in threads[:4]  # both streams live: the thread
