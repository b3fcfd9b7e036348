"""A long prompt's prefill in pipelined chunks (runner.py `_pipelined`), over in-process stand-ins for
decoder nodes (real blocks and caches, Decode's rules): the tokens equal the monolith's, each node gets
its chunks in order (no rebuild), several nodes compute at once, and a node that dies, or lies, in the
middle of the prefill is rebuilt as in a one-pass prefill. (The same through real node processes:
tests/bench/test_bench_prefill.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from layerswarm.coordinator.generation.options import GenerationOptions
from layerswarm.models.checkpoint import load_lm
from layerswarm.wire.v1 import block_pb2 as pb

from ..generation_helpers import FakeNode, FakeSwarm, fake_swarm, finish, generate_all, make_family

TOKENS = 8
PROMPT = [1, *range(20, 43)]  # 24 tokens: 6 chunks of 4, or 5 of 5 with a short last one


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_family(tmp_path_factory.mktemp("lm-chunks"), members=1)


def in_order(model_dir: Path, copies: int = 1) -> list[tuple[Path, int]]:
    return [(model_dir, b) for _ in range(copies) for b in range(4)]


def monolith(model_dir: Path) -> list[int]:
    model, _ = load_lm(model_dir)
    return model.generate(PROMPT, TOKENS)


class Watch:
    """Calls in flight over every node at once, and each node's prefill starts in arrival order."""

    def __init__(self, swarm: FakeSwarm) -> None:
        self.now = 0
        self.most = 0
        self.starts: dict[str, list[int]] = {}
        for node in swarm.nodes.values():
            node.step = self._watched(node, node.step)  # type: ignore[method-assign]

    def _watched(self, node: FakeNode, step: object) -> object:
        async def watched(request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
            self.now += 1
            self.most = max(self.most, self.now)
            self.starts.setdefault(node.address, []).append(request.start)
            try:
                await asyncio.sleep(0.002)  # a node's compute, so that others may overlap it
                return await step(request, timeout)  # type: ignore[operator, no-any-return]
            finally:
                self.now -= 1

        return watched


@pytest.mark.parametrize("chunk", [4, 5])
async def test_chunks_in_order_through_nodes_at_once_give_the_monoliths_tokens(family: list[Path], chunk: int) -> None:
    swarm = fake_swarm(in_order(family[0]), family[0], prefill_chunk_tokens=chunk)
    watch = Watch(swarm)
    tokens, s = await generate_all(swarm.generator, PROMPT, max_tokens=TOKENS)
    assert tokens == monolith(family[0]) and s.trace == []  # no node ever refused a chunk out of order
    prefill = list(range(0, len(PROMPT), chunk))
    for starts in watch.starts.values():
        assert starts[: len(prefill)] == prefill  # its chunks in order, then one step a token
        assert starts[len(prefill) :] == list(range(len(PROMPT), len(PROMPT) + TOKENS - 1))
    assert watch.most >= 2  # a later chunk entered a node while an earlier one was at the next
    assert s.exits.block_hops == 4 * TOKENS  # the prefill counts as one pass, as without chunks


async def test_one_pass_when_chunking_is_off(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0]), family[0], prefill_chunk_tokens=0)
    watch = Watch(swarm)
    tokens, _ = await generate_all(swarm.generator, PROMPT, max_tokens=TOKENS)
    assert tokens == monolith(family[0]) and watch.most == 1
    assert all(starts[0] == 0 and starts[1] == len(PROMPT) for starts in watch.starts.values())


async def test_a_node_that_dies_mid_prefill_is_rebuilt_from_every_chunk_it_was_sent(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0], copies=2), family[0], prefill_chunk_tokens=4)
    g = swarm.generator
    s = await g.open(PROMPT, _options())
    victim = swarm.nodes[s.route[2].node.address]  # type: ignore[union-attr]
    step = victim.step

    async def dies_after_two_chunks(request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
        if victim.calls == 2:
            victim.dead = True
        return await step(request, timeout)

    victim.step = dies_after_two_chunks  # type: ignore[method-assign]
    tokens = await finish(swarm.generator, s)
    assert tokens == monolith(family[0])
    rebuilt = [e for e in s.trace if e["kind"] == "rebuilt"]
    assert len(rebuilt) == 1 and rebuilt[0]["position"] == 2 and rebuilt[0]["to"] != victim.address
    assert rebuilt[0]["replayed_tokens"] == 12  # its two chunks replayed with the third
    assert swarm.held() == 0


async def test_a_liar_mid_prefill_is_convicted_and_the_stream_rebuilt(family: list[Path]) -> None:
    swarm = fake_swarm(in_order(family[0], copies=2), family[0], prefill_chunk_tokens=4, verify_rate=1.0)
    g = swarm.generator
    s = await g.open(PROMPT, _options())
    liar = swarm.nodes[s.route[1].node.address]  # type: ignore[union-attr]
    liar.lie_from = 9  # honest for two chunks, false from the third on
    tokens = await finish(swarm.generator, s)
    assert tokens == monolith(family[0])  # caught before a token was drawn from its output
    kinds = [(e["kind"], e.get("node")) for e in s.trace]
    assert kinds[:2] == [("convicted", liar.address), ("rebuilt", liar.address)], s.trace
    assert s.trace[0]["from_row"] == 8  # the first token it falsified (its third chunk)
    assert swarm.registry.nodes[liar.address].convicted


def _options() -> GenerationOptions:
    return GenerationOptions(max_tokens=TOKENS)
