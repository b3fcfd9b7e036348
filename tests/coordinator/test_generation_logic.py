"""The coordinator's generation logic over in-process stand-ins for decoder nodes (real blocks and caches,
Decode's rules, injected faults): tokens equal the monolith's, a node that dies or loses its cache is
rebuilt elsewhere, a block with no node left is skipped only within the evaluated minimum depth, a
sibling's block stands in only for shuffle-robust families, a liar is convicted and the stream rewound to
the first token it falsified, and every node's cache is released however the stream ends.
(The same through real node processes: test_generation_swarm.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerswarm.coordinator.generation.options import GenerationOptions, InvalidGeneration
from layerswarm.coordinator.generation.runner import StreamFailed
from layerswarm.coordinator.routing.trace import DepthError
from layerswarm.models.checkpoint import load_lm

from ..generation_helpers import FakeSwarm, fake_swarm, generate_all, make_family, make_lm_dir

TOKENS = 32


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_family(tmp_path_factory.mktemp("lm"), members=2)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A family whose evaluation says 3 of its 4 blocks are enough (a block may be skipped)."""
    return make_family(tmp_path_factory.mktemp("lm-eval"), members=1, min_blocks=3)


def monolith(model_dir: Path, prompt: list[int], **sampling: object) -> list[int]:
    model, _ = load_lm(model_dir)
    return model.generate(prompt, TOKENS, **sampling)  # type: ignore[arg-type]


def prompt_of(swarm: FakeSwarm, text: str = "12+34=") -> list[int]:
    return swarm.generator.encode(text)


def in_order(model_dir: Path, copies: int = 1) -> list[tuple[Path, int]]:
    return [(model_dir, b) for _ in range(copies) for b in range(4)]


async def test_greedy_and_seeded_sampling_equal_the_monolith(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0]), family[0])
    prompt = prompt_of(swarm)
    greedy, _ = await generate_all(swarm.generator, prompt, max_tokens=TOKENS)
    assert greedy == monolith(family[0], prompt)
    for seed in (1, 2):
        sampled, s = await generate_all(
            swarm.generator, prompt, max_tokens=TOKENS, temperature=0.9, top_k=50, top_p=0.95, seed=seed
        )
        assert sampled == monolith(family[0], prompt, temperature=0.9, top_k=50, top_p=0.95, seed=seed)
        assert s.options.seed == seed and s.trace == []
    assert swarm.held() == 0  # every node's cache released


async def dead_after(
    swarm: FakeSwarm, prompt: list[int], position: int, after: int, how: str
) -> tuple[list[int], object]:
    """Generate, and after `after` tokens make the node serving `position` fail (`how`: dead or forget)."""
    g = swarm.generator
    s = await g.open(prompt, GenerationOptions(max_tokens=TOKENS))
    tokens: list[int] = []
    try:
        logits = await g.prefill(s)
        async for delta in g.tokens(s, logits):
            if delta.token is not None:
                tokens.append(delta.token)
            if len(tokens) == after:
                node = s.route[position].node
                assert node is not None
                victim = swarm.nodes[node.address]
                if how == "dead":
                    victim.dead = True
                else:
                    victim.forget()
    finally:
        g.close(s)
        await g.releases_done()
    return tokens, s


async def test_a_node_that_dies_mid_stream_is_rebuilt_on_another(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0], copies=2), family[0])
    prompt = prompt_of(swarm)
    tokens, s = await dead_after(swarm, prompt, position=2, after=5, how="dead")
    assert tokens == monolith(family[0], prompt)  # the same weights took over: the same text
    rebuilt = [e for e in s.trace if e["kind"] == "rebuilt"]  # type: ignore[attr-defined]
    assert len(rebuilt) == 1 and rebuilt[0]["position"] == 2 and rebuilt[0]["to"] != rebuilt[0]["node"]
    assert rebuilt[0]["replayed_tokens"] == len(prompt) + 5  # every input that position was sent, the new token too


async def test_a_lost_cache_is_rebuilt_on_the_same_node(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0]), family[0])
    prompt = prompt_of(swarm)
    tokens, s = await dead_after(swarm, prompt, position=1, after=3, how="forget")
    assert tokens == monolith(family[0], prompt)
    kinds = [e["kind"] for e in s.trace]  # type: ignore[attr-defined]
    assert "rebuilt" in kinds and "skipped" not in kinds
    assert all(e["to"] == e["node"] for e in s.trace if e["kind"] == "rebuilt")  # type: ignore[attr-defined]


async def test_a_busy_node_is_asked_again_before_the_position_moves(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0], copies=2), family[0])
    prompt = prompt_of(swarm)
    g = swarm.generator
    s = await g.open(prompt, GenerationOptions(max_tokens=TOKENS))
    first, second = (swarm.nodes[s.route[p].node.address] for p in (1, 2))  # type: ignore[union-attr]
    first.busy, second.busy = 2, 1000  # a busy moment; a node that stays at its limits
    tokens: list[int] = []
    logits = await g.prefill(s)
    async for delta in g.tokens(s, logits):
        if delta.token is not None:
            tokens.append(delta.token)
    g.close(s)
    assert tokens == monolith(family[0], prompt)
    events = [(e["kind"], e["position"]) for e in s.trace]
    assert events == [("hop_failed", 2), ("rebuilt", 2)]  # position 1 waited out its busy moment
    assert s.route[1].node.address == first.address  # type: ignore[union-attr]


async def test_a_block_with_no_node_left_is_skipped_only_within_the_evaluated_depth(
    family: list[Path], evaluated: list[Path]
) -> None:
    swarm = fake_swarm(in_order(evaluated[0]), evaluated[0])
    tokens, s = await dead_after(swarm, prompt_of(swarm), position=1, after=4, how="dead")
    assert len(tokens) == TOKENS or s.finish_reason == "stop"  # type: ignore[attr-defined]
    assert [e["kind"] for e in s.trace].count("skipped") == 1  # type: ignore[attr-defined]
    assert s.route[1].skipped and s.view()["skipped"] == 1  # type: ignore[attr-defined]
    # A family never evaluated keeps every block: the stream fails instead of going on shallower.
    strict = fake_swarm(in_order(family[0]), family[0])
    with pytest.raises(StreamFailed, match="minimum depth of 4"):
        await dead_after(strict, prompt_of(strict), position=1, after=4, how="dead")
    assert strict.held() == 0  # a failed stream is released too


async def test_a_sibling_block_stands_in_only_for_shuffle_robust_families(tmp_path: Path) -> None:
    robust = make_family(tmp_path / "robust", members=2)
    swarm = fake_swarm([*in_order(robust[0]), (robust[1], 2)], robust[0])
    _, s = await dead_after(swarm, prompt_of(swarm), position=2, after=3, how="dead")
    sibling = swarm.node_at(2, robust[1])
    assert s.route[2].node is not None and s.route[2].node.address == sibling.address  # type: ignore[attr-defined]
    assert s.route[2].model_id != s.route[1].model_id  # type: ignore[attr-defined]

    base = make_lm_dir(tmp_path / "b0", variant="baseline")
    from layerswarm.models.checkpoint import read_lm_manifest

    other = make_lm_dir(tmp_path / "b1", seed=1, root=read_lm_manifest(base).lineage.root, variant="baseline")
    conventional = fake_swarm([*in_order(base), (other, 2)], base)
    with pytest.raises(StreamFailed):  # never evaluated either: no skip; and no sibling for a baseline
        await dead_after(conventional, prompt_of(conventional), position=2, after=3, how="dead")


async def test_a_liar_is_convicted_and_the_stream_rebuilt_from_the_first_token_it_falsified(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0], copies=2), family[0], verify_rate=1.0)
    prompt = prompt_of(swarm)
    g = swarm.generator
    s = await g.open(prompt, GenerationOptions(max_tokens=TOKENS))
    liar_address = s.route[2].node.address  # type: ignore[union-attr]
    swarm.nodes[liar_address].lie_from = len(prompt) + 4  # honest through its prefill and first steps
    tokens: list[int] = []
    freed_while_live = False
    logits = await g.prefill(s)
    async for delta in g.tokens(s, logits):
        if delta.token is not None:
            tokens.append(delta.token)
        if any(e["kind"] == "convicted" for e in s.trace) and not freed_while_live:
            await g.releases_done()  # the stream never returns to the liar: its cache there goes at once
            assert swarm.nodes[liar_address].released == [s.id] and s.id in g.live
            freed_while_live = True
    g.close(s)
    await g.releases_done()
    assert freed_while_live and swarm.nodes[liar_address].released == [s.id]  # freed once, not again at the end
    assert swarm.held() == 0
    assert tokens == monolith(family[0], prompt)  # caught at its first lie, before a token was drawn from it
    convicted = [e for e in s.trace if e["kind"] == "convicted"]
    assert len(convicted) == 1 and convicted[0]["node"] == liar_address
    assert convicted[0]["tainted_tokens"] == 0 and convicted[0]["from_row"] == len(prompt) + 4
    assert swarm.registry.nodes[liar_address].state.value == "quarantined"
    assert swarm.registry.nodes[liar_address].evidence


async def test_a_liar_caught_late_is_traced_back_to_its_first_lie(family: list[Path]) -> None:
    """Checks only after probation and by chance: a liar found later is traced back (its replies are the
    next hop's stored inputs) to the first token it falsified, and every state from there is recomputed."""
    swarm = fake_swarm(in_order(family[0], copies=2), family[0], verify_rate=0.0, verify_probation=1)
    prompt = prompt_of(swarm)
    g = swarm.generator
    s = await g.open(prompt, GenerationOptions(max_tokens=TOKENS))
    liar = s.route[1].node.address  # type: ignore[union-attr]
    first_lie = len(prompt) + 2
    swarm.nodes[liar].lie_from = first_lie
    tokens: list[int] = []
    logits = await g.prefill(s)
    async for delta in g.tokens(s, logits):
        if delta.token is not None:
            tokens.append(delta.token)
        if len(tokens) == 8:  # from now on every hop is checked
            assert g.verifier is not None
            g.verifier.settings = type(g.verifier.settings)(rate=1.0, probation_hops=1)
    g.close(s)
    convicted = [e for e in s.trace if e["kind"] == "convicted"]
    assert len(convicted) == 1 and convicted[0]["from_row"] == first_lie  # the first token whose state it falsified
    assert convicted[0]["tainted_tokens"] > 0  # tokens drawn from its states before it was caught
    assert len(tokens) == TOKENS or s.finish_reason == "stop"


async def test_refused_before_any_node_is_asked(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0]), family[0])
    g = swarm.generator
    with pytest.raises(InvalidGeneration, match="context"):
        await g.open(list(range(3, 99)), GenerationOptions())
    with pytest.raises(InvalidGeneration) as info:
        await g.open([1, 5], GenerationOptions(max_tokens=95))
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    with pytest.raises(InvalidGeneration, match="vocabulary"):
        await g.open([1, 300], GenerationOptions())
    with pytest.raises(InvalidGeneration, match="over this server's limit"):
        limited = fake_swarm(in_order(family[0]), family[0], max_new_tokens=8).generator
        await limited.open([1, 5], GenerationOptions(max_tokens=9))
    assert all(n.calls == 0 for n in swarm.nodes.values())
    thin = fake_swarm([(family[0], b) for b in range(3)], family[0])
    with pytest.raises(DepthError, match="no node for blocks \\[3\\]"):
        await thin.generator.open([1, 5], GenerationOptions())


async def test_an_abandoned_stream_frees_every_cache(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0], copies=2), family[0])
    g = swarm.generator
    s = await g.open(prompt_of(swarm), GenerationOptions(max_tokens=TOKENS))
    logits = await g.prefill(s)
    async for _ in g.tokens(s, logits):
        if len(s.generated) == 3:
            break
    assert swarm.held() == 4 and s.id in g.live
    g.close(s)  # what the HTTP layer does when its client goes away
    await g.releases_done()
    assert swarm.held() == 0 and s.id not in g.live
    assert sum(len(n.released) for n in swarm.nodes.values()) == 4
    assert g.views()[1][0]["finish_reason"] is None


def test_the_seed_decides_the_tokens(family: list[Path]) -> None:
    """The reference itself: different seeds give different samples (else the seeded test proves nothing)."""
    model, _ = load_lm(family[0])
    a = model.generate([1, 5, 6], TOKENS, temperature=1.5, seed=1)
    b = model.generate([1, 5, 6], TOKENS, temperature=1.5, seed=2)
    assert a != b and torch.is_tensor(torch.tensor(a))
