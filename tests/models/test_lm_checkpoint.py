"""A decoder's model directory: the classifiers' format (ids, lineage, sha256), its own config kind, blocks
that load one by one as nodes load them, and classifier directories that still load as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layerswarm.models.checkpoint import (
    Lineage,
    ModelDirError,
    block_file,
    load_block,
    load_lm,
    load_stem_head,
    read_any_manifest,
    read_lm_manifest,
    read_manifest,
    save_model,
)
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderLM
from layerswarm.models.lm.tokenizer import TOKENIZER_FILE
from layerswarm.models.zoo import family_root
from layerswarm.training.lm.tokenizer import train_bpe


def save_tiny(path: Path, tie: bool = True, seed: int = 0, lineage: Lineage | None = None) -> DecoderLM:
    torch.manual_seed(seed)
    tok = train_bpe(["12+34=46", "rev:123=321", "some plain words here"], 300)
    cfg = LMConfig(vocab_size=300, dim=32, depth=3, heads=4, kv_heads=2, max_seq_len=32, tie_embeddings=tie)
    model = DecoderLM(cfg).eval()
    path.mkdir(parents=True)
    tok.save(str(path / TOKENIZER_FILE))
    save_model(model, path, lineage or Lineage(source="scratch"))
    return model


def test_round_trip_and_blocks_loaded_one_by_one_give_the_monolith(tmp_path: Path) -> None:
    model = save_tiny(tmp_path / "m")
    loaded, manifest = load_lm(tmp_path / "m")
    tokens = torch.randint(0, 300, (2, 9))
    manifest = read_lm_manifest(tmp_path / "m")
    stem, head = load_stem_head(tmp_path / "m", manifest)
    x = stem(tokens)
    for i in (2, 0, 1):  # any order, as a swarm of three nodes would route it
        x = load_block(tmp_path / "m", i, manifest)(x)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
        assert torch.allclose(head(x), model(tokens, [2, 0, 1]), atol=1e-6)
    raw = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert raw["config"]["kind"] == "lm" and raw["variant"] == "layershuffle"
    assert set(raw["files"]) == {
        "stem.safetensors",
        "head.safetensors",
        TOKENIZER_FILE,
        *(block_file(i) for i in range(3)),
    }


def test_a_tied_head_holds_no_matrix_of_its_own(tmp_path: Path) -> None:
    save_tiny(tmp_path / "tied", tie=True)
    save_tiny(tmp_path / "untied", tie=False)
    assert set(load_file(str(tmp_path / "tied" / "head.safetensors"))) == {"norm.weight"}
    assert set(load_file(str(tmp_path / "untied" / "head.safetensors"))) == {"norm.weight", "lm_head.weight"}


def test_tampered_block_or_tokenizer_is_refused(tmp_path: Path) -> None:
    save_tiny(tmp_path / "m")
    manifest = read_lm_manifest(tmp_path / "m")
    path = tmp_path / "m" / block_file(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelDirError, match="sha256"):
        load_block(tmp_path / "m", 1, manifest)
    (tmp_path / "m" / TOKENIZER_FILE).write_text("{}")
    from layerswarm.training.lm.commands import model_tokenizer

    with pytest.raises(ModelDirError, match="sha256"):
        model_tokenizer(tmp_path / "m", manifest)


def test_each_family_reader_refuses_the_other_by_name(tmp_path: Path) -> None:
    save_tiny(tmp_path / "lm")
    with pytest.raises(ModelDirError, match="language model"):
        read_manifest(tmp_path / "lm")
    with pytest.raises(ModelDirError, match="not a language model"):
        read_lm_manifest(family_root() / "baseline")
    assert read_any_manifest(tmp_path / "lm").config.kind == "lm"


def test_siblings_share_a_family_and_another_base_does_not(tmp_path: Path) -> None:
    save_tiny(tmp_path / "base")
    base = read_lm_manifest(tmp_path / "base")
    save_tiny(tmp_path / "child", seed=1, lineage=Lineage(root=base.lineage.root, parent=base.model_id, source="model"))
    save_tiny(tmp_path / "other", seed=2)
    child, other = read_lm_manifest(tmp_path / "child"), read_lm_manifest(tmp_path / "other")
    assert child.family_id == base.family_id != other.family_id
    assert child.model_id != base.model_id


def test_shipped_classifier_manifests_keep_their_ids() -> None:
    """read_manifest re-derives every id from the config and file hashes: a classifier config that now
    serialised differently (say, with the decoder's fields) would fail this."""
    for member in ("baseline", "layershuffle-0"):
        manifest = read_manifest(family_root() / member)
        raw = json.loads((family_root() / member / "manifest.json").read_text())
        assert manifest.model_id == raw["model_id"] and "kind" not in raw["config"]
