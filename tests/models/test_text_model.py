"""The text family's model and data: tokenizer in the model dir (hashed), masked padding, per-token
compute, generated and user data, and the train -> family -> eval commands on text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layerswarm.cli import main
from layerswarm.models.adaptive_policy import read_policy
from layerswarm.models.checkpoint import ModelDirError, load_model, read_manifest
from layerswarm.models.config import VARIANTS, ViTConfig
from layerswarm.models.text.model import TextEncoder, key_mask_of
from layerswarm.models.text.tokenizer import (
    CLS_ID,
    PAD_ID,
    TextInputError,
    encode_batch,
    encode_one,
    train_tokenizer,
)
from layerswarm.models.vit import Block
from layerswarm.models.zoo import family_root
from layerswarm.training.objective import evaluate_loss
from layerswarm.training.text.data import (
    KEY_WORDS,
    ORDERED_PAIRS,
    TextCorpus,
    encode_corpus,
    load_corpus,
    make_words,
    model_tokenizer,
)
from layerswarm.training.train import Trainer, TrainRecipe

TEXT_CFG = ViTConfig(kind="text", vocab_size=50, max_tokens=16, num_classes=3, dim=32, heads=2, depth=3)


def test_image_configs_hash_as_before() -> None:
    """Text fields stay out of an image config's dict, so every shipped image model keeps its id."""
    assert "kind" not in ViTConfig().to_dict() and "max_tokens" not in ViTConfig().to_dict()
    for member in sorted(family_root("shapes").iterdir()):
        if (member / "manifest.json").is_file():
            assert read_manifest(member).config.kind == "image"
    assert TEXT_CFG.to_dict()["kind"] == "text" and TEXT_CFG.architecture()["max_tokens"] == 16
    assert TEXT_CFG.num_tokens == 16


def test_padding_never_changes_a_result() -> None:
    torch.manual_seed(0)
    model = TextEncoder(TEXT_CFG).eval()
    ids = torch.tensor([[CLS_ID, 7, 8, 9]])
    padded = torch.cat([ids, torch.full((1, 6), PAD_ID)], dim=1)
    with torch.no_grad():
        short, long = model(ids), model(padded)
        unmasked = model.head(model.blocks[0](model.stem(padded)))  # what forgetting the mask does
    torch.testing.assert_close(short, long, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(unmasked, model.head(model.blocks[0](model.stem(padded), 0, key_mask_of(padded))))


def test_block_without_mask_is_the_image_path_bit_for_bit() -> None:
    torch.manual_seed(0)
    block = Block(ViTConfig()).eval()
    x = torch.randn(2, 17, 64)
    with torch.no_grad():
        plain = block(x, 0)
        masked = block(x, 0, torch.ones(2, 17, dtype=torch.bool))
    assert torch.equal(plain, block(x, 0))
    torch.testing.assert_close(plain, masked, rtol=1e-5, atol=1e-5)


def test_active_tokens_only_match_the_full_block() -> None:
    """forward_active (queries for active tokens only; frozen ones still keys/values) == full block rows."""
    torch.manual_seed(0)
    block = Block(TEXT_CFG).eval()
    x = torch.randn(2, 10, 32)
    key_mask = torch.ones(2, 10, dtype=torch.bool)
    key_mask[1, 7:] = False
    rows = torch.tensor([[0, 3, 4], [0, 1, 6]])
    with torch.no_grad():
        full = block(x, 1, key_mask)
        part = block.forward_active(x, 1, key_mask, rows)
    torch.testing.assert_close(part, full.gather(1, rows[..., None].expand(-1, -1, 32)), rtol=1e-5, atol=1e-5)


def test_tokenizer_specials_and_limits() -> None:
    tok = train_tokenizer(["red cat", "blue dog", "Red Dog"])
    ids = encode_one(tok, "RED dog", max_tokens=8)
    assert ids[0] == CLS_ID and len(ids) == 3 and ids[1] == tok.token_to_id("red")
    assert encode_one(tok, "zebra", 8)[1] == tok.token_to_id("[UNK]")
    with pytest.raises(TextInputError, match="empty"):
        encode_one(tok, "   ", 8)
    with pytest.raises(TextInputError, match="at most 2"):
        encode_one(tok, "red red red", 3)
    batch = encode_batch(tok, ["red", "red blue dog"], 8)
    assert batch.shape == (2, 4) and batch[0, 2:].eq(PAD_ID).all()


def test_words_label_depends_on_word_order() -> None:
    corpus = make_words(300, 10, seed=3)
    again = make_words(300, 10, seed=3)
    assert corpus.train_texts == again.train_texts and len(corpus.class_names) == len(ORDERED_PAIRS) == 12
    for text, label in zip(corpus.train_texts, corpus.train_y.tolist(), strict=True):
        keys = [w for w in text.split() if w in KEY_WORDS]
        first, second = ORDERED_PAIRS[label]
        assert keys == [KEY_WORDS[first], KEY_WORDS[second]]  # swapping them would be another class


def test_csv_and_jsonl_loaders(tmp_path: Path) -> None:
    rows = [("good film", "pos"), ("bad, sad film", "neg")] * 5
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("text,label\n" + "".join(f'"{t}",{y}\n' for t, y in rows))
    jsonl_path = tmp_path / "d.jsonl"
    jsonl_path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    for spec in (f"csv:{csv_path}", f"jsonl:{jsonl_path}"):
        corpus = load_corpus(spec)
        assert corpus.class_names == ("neg", "pos") and len(corpus.train_texts) == 8 and len(corpus.test_texts) == 2
        assert "bad, sad film" in corpus.train_texts + corpus.test_texts


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("a.csv", "words,label\nx,1\n", "needs columns text and label"),
        ("a.jsonl", '{"text": "x", "label": 1}\nnot json\n', "line 2 is not JSON"),
        ("a.jsonl", '{"text": "x"}\n', "needs an object with keys text and label"),
        ("a.csv", "text,label\n,1\n", "row 1 has an empty"),
        ("a.csv", "text,label\na,1\nb,1\nc,1\nd,1\ne,1\n", "at least 2 distinct labels"),
        ("a.csv", "text,label\na,1\n", "needs at least 5"),
    ],
)
def test_bad_user_data_gets_a_clear_error(tmp_path: Path, name: str, content: str, problem: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=problem):
        load_corpus(f"{name.split('.')[1]}:{path}")


def test_cli_names_a_missing_text_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--data", "csv:/no/such.csv", "--out", "x"])
    assert "--data" in capsys.readouterr().err


def test_cli_train_family_eval_on_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path = tmp_path / "mine.csv"
    lines = [f"{'red' if i % 2 else 'blue'} thing number {i % 7},{'r' if i % 2 else 'b'}" for i in range(200)]
    csv_path.write_text("text,label\n" + "\n".join(lines) + "\n")
    common = ["--data", f"csv:{csv_path}", "--epochs", "8", "--lr", "1e-2", "--depth", "2", "--dim", "16"]
    common += ["--heads", "2"]
    common += ["--warmup-steps", "2", "--batch-size", "32", "--max-tokens", "8"]
    base, member = tmp_path / "base", tmp_path / "member"
    assert main(["train", *common, "--variant", "baseline", "--out", str(base)]) == 0
    assert main(["train", *common, "--variant", "layershuffle", "--init", str(base), "--out", str(member)]) == 0
    m_base, m_member = read_manifest(base), read_manifest(member)
    assert m_base.config.kind == "text" and "tokenizer.json" in m_base.files
    assert m_member.family_id == m_base.family_id and m_member.lineage.parent == m_base.model_id
    assert m_member.metrics["test_sequential"] > 0.9  # colour word decides the label
    report = tmp_path / "r.json"
    assert main(["eval", str(member), str(base), str(base), "--json", str(report)]) == 0
    assert "| member | layershuffle |" in capsys.readouterr().out
    assert json.loads(report.read_text())["models"]["member"]["sequential"] > 0.9
    # calibration on text: exit rules and floors into the member's own adaptive.json, as for images
    assert main(["eval", str(member), "--calibrate-only", "--json", str(report)]) == 0
    calibrated = json.loads(report.read_text())["calibration"]["member"]
    assert calibrated["exits"]["full_accuracy"]["held_out"] > 0.9  # the padding masked, as the swarm does
    policy = read_policy(member)
    assert policy is not None and policy["model_id"] == m_member.model_id
    assert 1 <= policy["anytime_min_blocks"] <= 2 and policy["exit_min_blocks"] == 1
    (base / "tokenizer.json").write_text((base / "tokenizer.json").read_text().replace("red", "der"))
    with pytest.raises(ModelDirError, match=r"tokenizer\.json"):
        model_tokenizer(base)
    model, _ = load_model(member)
    assert isinstance(model, TextEncoder)


def test_text_depth_command_writes_tables_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from layerswarm.models.text.depth import DEPTH_POLICY

    out = tmp_path / "m"
    common = ["--data", "words:300:60", "--epochs", "1", "--depth", "2", "--dim", "16", "--heads", "2"]
    assert main(["train", *common, "--warmup-steps", "2", "--max-tokens", "20", "--out", str(out)]) == 0
    report = tmp_path / "depth.json"
    assert (
        main(["depth", str(out), "--sentences", "20", "--mlm-steps", "3", "--orders", "1", "--json", str(report)]) == 0
    )
    policy = read_manifest(out).policy[DEPTH_POLICY]
    assert policy["bins"] == 2 and len(policy["mi"]) == read_manifest(out).config.vocab_size
    assert all(1 <= d <= 2 for d in policy["mi"] + policy["reconstruction"])
    rows = json.loads(report.read_text())["m"]["results"]
    assert rows["full"]["mean_depth_per_token"] == 2.0 and rows["full"]["compute_reduction"] == 1.0
    assert (
        rows["mi"]["sequential"]["tokens_computed_per_sentence"]
        <= rows["full"]["sequential"]["tokens_computed_per_sentence"]
    )
    assert set(rows) == {"full", "mi", "reconstruction", f"fixed-{max(1, round(rows['mi']['mean_depth_per_token']))}"}
    tuned = tmp_path / "tuned"
    tune = ["train", "--data", "words:300:60", "--init", str(out), "--epochs", "1", "--out", str(tuned)]
    assert main([*tune, "--token-depth", "reconstruction", "--warmup-steps", "2"]) == 0
    assert read_manifest(tuned).recipe["token_depth"] == "reconstruction"
    assert read_manifest(tuned).policy[DEPTH_POLICY] == policy  # served with the tables it trained with
    swarm_report = tmp_path / "swarm.json"
    assert main(["depth", str(tuned), "--existing", "--orders", "1", "--swarm", "4", "--json", str(swarm_report)]) == 0
    swarm = json.loads(swarm_report.read_text())["swarm"]  # through real node processes, one per block
    for order in ("sequential", "shuffle"):
        split, whole = swarm[f"{order}/reconstruction+frozen-int8"], swarm[f"{order}/reconstruction"]
        assert (
            split["tokens_per_request"] == whole["tokens_per_request"] <= swarm[f"{order}/full"]["tokens_per_request"]
        )
        assert split["wire_bytes_per_request"] <= whole["wire_bytes_per_request"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_trains_on_text(variant: str, tmp_path: Path) -> None:
    texts = [f"{'red' if i % 2 else 'blue'} thing number {i % 7}" for i in range(320)]
    labels = torch.tensor([i % 2 for i in range(320)])
    corpus = TextCorpus("t", "t", texts[:256], labels[:256], texts[256:], labels[256:], ("b", "r"))
    tok = train_tokenizer(corpus.train_texts)
    data = encode_corpus(corpus, tok, 8)
    cfg = ViTConfig(kind="text", vocab_size=tok.get_vocab_size(), max_tokens=8, num_classes=2, dim=16, heads=2)
    torch.manual_seed(0)
    model = TextEncoder(cfg.replace(depth=2, variant=variant))
    before, _ = evaluate_loss(model, data.test_x, data.test_y)
    recipe = TrainRecipe(variant=variant, epochs=12, lr=1e-2, warmup_steps=2, batch_size=32, augment=False)
    trainer = Trainer(model, data, recipe, torch.device("cpu"), tmp_path / "state")
    trainer.fit()
    after, _ = evaluate_loss(trainer.model, data.test_x, data.test_y)
    if variant in ("layershuffle-position", "layershuffle-predict"):  # run through; slower to leave the plateau
        assert torch.isfinite(torch.tensor(after)) and trainer.history[-1]["train_loss"] > 0
    else:
        assert after < 0.5 * before, f"{variant}: loss {before:.3f} -> {after:.3f}"
