"""The decoder's block API for the swarm: prefill, decode and verify through per-row KV caches give what a
full forward gives; rows of different lengths batch; rotary positions are the tokens' own."""

from __future__ import annotations

import pytest
import torch

from layerswarm.models.lm.cache import KVCache
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.early_exit import ExitStats, early_exit_generate
from layerswarm.models.lm.generate import Sampling, generate, next_token_probs
from layerswarm.models.lm.model import DecoderLM
from layerswarm.models.lm.speculative import SpeculationStats, speculative_generate

TOL = 1e-5  # fp32: measured max abs differences are ~2e-7 (cached vs full) and ~5e-7 (batched vs alone)


def tiny(variant: str = "layershuffle", **kw: object) -> DecoderLM:
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=97, dim=32, depth=4, heads=4, kv_heads=2, max_seq_len=64, variant=variant, **kw)  # type: ignore[arg-type]
    return DecoderLM(cfg).eval()


def run(
    model: DecoderLM, tokens: torch.Tensor, caches: list[list[KVCache]], new_tokens: torch.Tensor | None = None
) -> torch.Tensor:
    x = model.stem(tokens)
    for block, cache in zip(model.route(), caches, strict=True):
        x = block(x, caches=cache, new_tokens=new_tokens)
    return model.head(x)


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward() -> None:
    model = tiny()
    tokens = torch.randint(3, 97, (3, 24))
    full = model(tokens)
    caches = model.new_caches(3)
    steps = [run(model, tokens[:, :10], caches)]  # prefill 10 tokens
    steps += [run(model, tokens[:, t : t + 1], caches) for t in range(10, 24)]  # then one at a time
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    assert diff < TOL, diff
    assert all(c.length == 24 for row in caches for c in row)


@torch.no_grad()
def test_verify_after_truncate_equals_full_forward() -> None:
    """Speculative rollback: 5 drafted tokens appended, 3 rejected (truncate), then k + 1 = 4 new tokens verified
    in one call: the logits are the full forward's over the accepted sequence."""
    model = tiny()
    tokens = torch.randint(3, 97, (1, 20))
    wrong = torch.randint(3, 97, (1, 5))
    caches = model.new_caches(1)
    run(model, tokens[:, :8], caches)
    run(model, torch.cat([tokens[:, 8:10], wrong[:, 2:]], dim=1), caches)  # 2 right drafts, 3 wrong
    for row in caches:
        row[0].truncate(10)
    verified = run(model, tokens[:, 10:14], caches)
    diff = (verified - model(tokens[:, :14])[:, 10:14]).abs().max().item()
    assert diff < TOL, diff


@torch.no_grad()
def test_rows_of_different_lengths_batch_like_single_streams() -> None:
    """One call steps three streams whose caches hold 5, 9 and 2 tokens (padded and masked), as a node
    batching concurrent decode steps would; each row equals that stream stepped alone."""
    model = tiny()
    lengths = [5, 9, 2]
    seqs = [torch.randint(3, 97, (n + 3,)) for n in lengths]
    alone = []
    for seq in seqs:
        caches = model.new_caches(1)
        run(model, seq[None, : len(seq) - 3], caches)
        alone.append(run(model, seq[None, len(seq) - 3 :], caches)[0])  # a 3-token verify step
    caches = model.new_caches(3)
    prompts = torch.zeros(3, max(lengths), dtype=torch.long)
    for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        prompts[row, :n] = seq[:n]
    run(model, prompts, caches, new_tokens=torch.tensor(lengths))  # a batched prefill of ragged prompts
    assert [c.length for c in caches[0]] == lengths
    batched = run(model, torch.stack([s[-3:] for s in seqs]), caches)
    diff = max((batched[row] - alone[row]).abs().max().item() for row in range(3))
    assert diff < TOL, diff


@torch.no_grad()
def test_rotary_positions_are_relative_so_a_block_ignores_where_a_stream_starts() -> None:
    block = tiny().blocks[0]
    x = torch.randn(2, 7, 32)
    shifted = block(x, start=torch.tensor([13, 30]))
    assert (block(x) - shifted).abs().max().item() < TOL
    # ... but not the tokens' order: reversing the tokens changes the last one's output
    assert (block(x.flip(1))[:, 0] - block(x)[:, -1]).abs().max().item() > 1e-3


def test_blocks_refuse_what_a_node_must_refuse() -> None:
    model = tiny()
    block = model.blocks[0]
    caches = [KVCache(2, 8)]
    with torch.no_grad():
        block(torch.randn(1, 4, 32), caches=caches)
        with pytest.raises(ValueError, match="differs from the caches"):
            block(torch.randn(1, 1, 32), start=torch.tensor([0]), caches=caches)
        with pytest.raises(ValueError, match="context is 64"):
            block(torch.randn(1, 61, 32), caches=caches)
        with pytest.raises(ValueError, match="one per row"):
            block(torch.randn(2, 1, 32), caches=caches)
        with pytest.raises(ValueError, match="token ids"):
            model(torch.tensor([[97]]))


def test_cache_grows_truncates_and_counts_bytes() -> None:
    cache = KVCache(2, 8)
    assert cache.nbytes == 0 and cache.keys.shape == (2, 0, 8)
    for _ in range(5):
        cache.append(torch.ones(2, 4, 8), torch.ones(2, 4, 8))
    assert cache.length == 20 and cache.capacity == 32 and cache.nbytes == 2 * 2 * 32 * 8 * 4
    cache.truncate(3)
    assert cache.keys.shape == (2, 3, 8)
    cache.append(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    assert cache.length == 4 and float(cache.keys[:, 3].abs().sum()) == 0.0
    with pytest.raises(ValueError):
        cache.truncate(5)
    with pytest.raises(ValueError):
        cache.append(torch.ones(3, 1, 8), torch.ones(3, 1, 8))


@torch.no_grad()
def test_batched_generation_equals_one_prompt_at_a_time_and_seeds_repeat() -> None:
    model = tiny()
    prompts = [[1, 5, 9], [1, 7, 8, 9, 10, 11], [1]]
    batched = generate(model.stem, model.route(), model.head, prompts, 12)
    assert batched == [model.generate(p, 12) for p in prompts]
    sampled = [model.generate(prompts[1], 12, temperature=1.0, top_p=0.9, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert model.generate(prompts[1], 12, temperature=0.7, top_k=1, seed=3) == batched[1]


def test_top_p_keeps_the_smallest_set_of_likely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = next_token_probs(logits, Sampling(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


@torch.no_grad()
def test_speculative_greedy_is_exactly_plain_greedy_over_200_prompts() -> None:
    model = tiny()
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 12, (200,), generator=gen).tolist()
    prompts = [[1, *torch.randint(3, 97, (n,), generator=gen).tolist()] for n in lengths]
    plain = generate(model.stem, model.route(), model.head, prompts, 8, model.cfg.eos_id)
    stats = SpeculationStats()
    for i, prompt in enumerate(prompts):
        depth, k = 1 + i % 3, 1 + i % 5
        out = speculative_generate(model.stem, model.route(), model.head, prompt, 8, depth, k, model.cfg.eos_id, stats)
        assert out == plain[i], i
    assert stats.drafted > 0 and stats.trips > 0


@torch.no_grad()
def test_early_exit_never_confident_is_plain_greedy_and_always_confident_saves_hops() -> None:
    model = tiny()
    prompts = [[1, 4, 5], [1, 9]]
    plain = generate(model.stem, model.route(), model.head, prompts, 8, model.cfg.eos_id)
    never = ExitStats()
    assert (
        early_exit_generate(model.stem, model.route(), model.head, prompts, 8, 1.01, model.cfg.eos_id, stats=never)
        == plain
    )
    assert never.hops_saved == 0.0
    always = ExitStats()
    out = early_exit_generate(
        model.stem, model.route(), model.head, prompts, 8, 0.0, model.cfg.eos_id, min_blocks=1, stats=always
    )
    assert [len(o) for o in out] == [len(o) for o in plain] or always.tokens > 0
    # every generated token after the first exits after 1 of 4 blocks
    assert always.hops == sum(4 + (n - 1) * 1 for n in [always.tokens // 2] * 2)
