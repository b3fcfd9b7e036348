"""The prefill bench measures the same work both ways: the swarm's first-token logits are the monolith's."""

from __future__ import annotations

import pytest

from layerswarm.bench.prefill import SHAPE, main, run


def test_the_swarm_and_the_monolith_prefill_the_same_prompt_to_the_same_logits() -> None:
    small = {**SHAPE, "dim": 64, "depth": 3, "heads": 4, "kv_heads": 2, "max_seq_len": 128}
    report = run(tokens=48, reps=2, shape=small, chunks=(16, 24))  # pipelined: 3 (then 2) chunks, 3 nodes
    assert report["prompt_tokens"] == 48 and report["prefill_chunk"] == 16 and set(report["by_chunk"]) == {16, 24}
    ways = ("monolith", "one_pass", "chunk_16", "chunk_24")
    assert [len(report[f"{way}_ms_all"]) for way in ways] == [2, 2, 2, 2]
    assert report["logits_max_abs_diff"] < 5e-2  # both ways: the wire's rounding, not another model's output
    assert report["swarm_ms"] > 0 and report["monolith_ms"] > 0 and report["swarm_over_monolith"] > 0
    assert report["one_pass_ms"] > 0 and report["one_pass_over_monolith"] > 0


def test_a_prompt_longer_than_the_context_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    bad = (
        (["--tokens", "5000"], "--tokens"),
        (["--tokens", "1"], "--tokens"),
        (["--reps", "0"], "--reps"),
        (["--chunk", "0"], "--chunk"),
    )
    for argv, flag in bad:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and flag in capsys.readouterr().err
