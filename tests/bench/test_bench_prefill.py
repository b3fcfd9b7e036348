"""The prefill bench measures the same work both ways: the swarm's first-token logits are the monolith's."""

from __future__ import annotations

from layerswarm.bench.prefill import SHAPE, run


def test_the_swarm_and_the_monolith_prefill_the_same_prompt_to_the_same_logits() -> None:
    small = {**SHAPE, "dim": 64, "depth": 3, "heads": 4, "kv_heads": 2, "max_seq_len": 128}
    report = run(tokens=48, reps=2, shape=small)
    assert report["prompt_tokens"] == 48 and len(report["swarm_ms_all"]) == 2
    assert report["logits_max_abs_diff"] < 5e-2  # the wire's rounding, not another model's output
    assert report["swarm_ms"] > 0 and report["monolith_ms"] > 0 and report["swarm_over_monolith"] > 0
