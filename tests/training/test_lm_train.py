"""`layerswarm train`, `family` and `eval` on language models, end to end on a tiny decoder: the model
directory, the recipe in its manifest, siblings of one family, the report and the policy it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layerswarm.cli import main
from layerswarm.models.checkpoint import read_lm_manifest
from layerswarm.models.lm.model import DecoderLM
from layerswarm.training.lm.data import TokenRows
from layerswarm.training.lm.objective import batch_order, next_token_loss

TINY = ["--dim", "32", "--depth", "3", "--heads", "2", "--vocab-size", "300", "--context", "48", "--text-len", "32"]
TINY += ["--val-every", "20"]


def test_routes_per_variant() -> None:
    gen = torch.Generator().manual_seed(0)
    assert batch_order(6, "baseline", 0.2, gen) == list(range(6))
    orders = {tuple(batch_order(6, "layershuffle", 0.2, gen)) for _ in range(20)}
    assert len(orders) > 10 and all(sorted(o) == list(range(6)) for o in orders)
    dropped = [batch_order(6, "layerdrop", 0.5, gen) for _ in range(20)]
    assert any(len(o) < 6 for o in dropped) and all(o == sorted(o) for o in dropped)
    assert batch_order(6, "layershuffle", 0.2, gen, shuffle_chance=0.0) == list(range(6))


def test_exit_loss_adds_the_shallow_depths() -> None:
    from layerswarm.models.lm.config import LMConfig

    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=50, dim=16, depth=3, heads=2, kv_heads=1, max_seq_len=16)).eval()
    ids = torch.randint(3, 50, (4, 10))
    rows = TokenRows("text", ids, torch.ones_like(ids, dtype=torch.bool))
    plain = next_token_loss(model, rows, [0, 1, 2])
    with_exits = next_token_loss(model, rows, [0, 1, 2], exit_loss=0.5)
    assert with_exits > plain  # each shallow head's loss, half weighted, on top
    assert torch.isclose(next_token_loss(model, rows, [0, 1, 2], exit_dropout=0.9), plain)  # eval: no dropout


@pytest.mark.slow
def test_train_family_and_eval_a_tiny_decoder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = "lm:tasks:200:16+pydoc"
    base = tmp_path / "base"
    args = ["train", "--data", data, "--variant", "baseline", "--out", str(base), "--time-budget", "4", *TINY]
    assert main([*args, "--threads", "1"]) == 0
    event = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    manifest = read_lm_manifest(base)
    assert event["model_id"] == manifest.model_id and manifest.config.depth == 3
    assert manifest.recipe["variant"] == "baseline" and manifest.recipe["history"]
    assert manifest.dataset["spec"] == data and "test_sequential_em" in manifest.metrics
    fam = ["family", "--base", str(base), "--members", "2", "--out", str(tmp_path / "fam"), "--prefix", "layershuffle"]
    assert main([*fam, "--time-budget", "3"]) == 0
    members = [tmp_path / "fam" / f"layershuffle-{i}" for i in range(2)]
    family = {read_lm_manifest(m).family_id for m in members}
    assert family == {manifest.family_id}
    assert all(read_lm_manifest(m).lineage.parent == manifest.model_id for m in members)
    report_path = tmp_path / "report.json"
    eval_args = ["eval", *map(str, members), str(base), "--json", str(report_path), "--orders", "10", "--merges", "20"]
    assert main(eval_args) == 0
    report = json.loads(report_path.read_text())
    group = next(iter(report["groups"].values()))
    assert group["members"] == ["layershuffle-0", "layershuffle-1"] and {"ppl/tasks", "ppl/text", "em"} <= set(
        group["merged"]
    )
    assert set(report["models"]["base"]["pruned"]) == {"1", "2"}
    assert all(d["draft"]["table"]["1/2"]["identical"] == 1.0 for d in report["drafting"].values())
    policy = read_lm_manifest(members[0]).policy
    assert {"draft", "early_exit", "min_blocks"} <= set(policy)
    assert read_lm_manifest(members[0]).model_id == read_lm_manifest(members[0]).model_id  # policy: ids unchanged


def test_classifier_flags_are_refused_for_a_language_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--data", "lm:tasks:10:2", "--out", str(tmp_path / "m"), "--mixup", "0.2"]) == 2
    assert "--mixup is for classifiers" in capsys.readouterr().err
    assert (
        main(["train", "--data", "lm:tasks:10:2", "--out", str(tmp_path / "m"), "--variant", "layershuffle-predict"])
        == 2
    )
    assert not (tmp_path / "m").exists()
