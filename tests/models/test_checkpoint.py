"""The model directory format: round trips, derived ids, and refusal of tampered or mismatched files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layerswarm.models.checkpoint import (
    ModelDirError,
    block_file,
    load_block,
    load_model,
    read_manifest,
)

from ..conftest import make_model_dir


def test_saved_and_reloaded_model_gives_identical_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    from layerswarm.models.checkpoint import Lineage, save_model
    from layerswarm.models.vit import ViT

    from ..conftest import tiny_config

    model = ViT(tiny_config("layershuffle-position")).eval()
    save_model(model, tmp_path / "m", Lineage(source="scratch"))
    loaded, manifest = load_model(tmp_path / "m")
    images = torch.rand(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(model(images, [1, 2, 0]), loaded(images, [1, 2, 0]))
    assert manifest.variant == "layershuffle-position"
    assert set(manifest.files) == {"stem.safetensors", "head.safetensors", *(block_file(i) for i in range(3))}


def test_manifest_records_everything(model_dir: Path) -> None:
    raw = json.loads((model_dir / "manifest.json").read_text())
    for key in (
        "format_version",
        "family_id",
        "model_id",
        "variant",
        "config",
        "recipe",
        "dataset",
        "metrics",
        "files",
        "lineage",
    ):
        assert key in raw
    assert all(len(entry["sha256"]) == 64 for entry in raw["files"].values())


def test_tampered_block_is_refused(model_dir: Path) -> None:
    path = model_dir / block_file(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    load_block(model_dir, 0)  # untouched blocks still load alone
    with pytest.raises(ModelDirError, match="sha256"):
        load_block(model_dir, 1)
    with pytest.raises(ModelDirError, match="tampered"):
        load_model(model_dir)


def test_missing_file_and_bad_index(model_dir: Path) -> None:
    (model_dir / block_file(2)).unlink()
    with pytest.raises(ModelDirError, match="missing"):
        load_block(model_dir, 2)
    with pytest.raises(ModelDirError, match="out of range"):
        load_block(model_dir, 7)
    with pytest.raises(ModelDirError, match=r"no manifest\.json"):
        read_manifest(model_dir / "nowhere")


def test_edited_manifest_cannot_claim_another_family(model_dir: Path) -> None:
    path = model_dir / "manifest.json"
    raw = json.loads(path.read_text())
    raw["family_id"] = "fam-0123456789abcdef"
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelDirError, match="family_id"):
        read_manifest(model_dir)
    raw = json.loads((model_dir / "manifest.json").read_text())
    raw["config"]["dim"] = 64  # a different architecture under the same file hashes
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelDirError):
        read_manifest(model_dir)


def test_family_ids_are_derived_from_architecture_and_lineage(tmp_path: Path, family_dirs: list[Path]) -> None:
    manifests = [read_manifest(d) for d in family_dirs]
    assert len({m.family_id for m in manifests}) == 1  # fine-tuned from one base: one family
    assert len({m.model_id for m in manifests}) == len(manifests)
    stranger = read_manifest(make_model_dir(tmp_path / "s", seed=99))  # same architecture, own lineage
    assert stranger.family_id != manifests[0].family_id
    wider = read_manifest(make_model_dir(tmp_path / "w", seed=1, dim=48, heads=2))
    assert wider.family_id != manifests[0].family_id


def test_bases_trained_apart_are_different_families(tmp_path: Path) -> None:
    """Identical initial weights (same seed) but different training: two lineages, two families."""
    torch.manual_seed(0)
    from layerswarm.models.checkpoint import Lineage, save_model
    from layerswarm.models.vit import ViT

    from ..conftest import tiny_config

    a, b = ViT(tiny_config()), ViT(tiny_config())
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.head.classifier.bias.add_(0.1)  # "trained on other data"
    fam_a = save_model(a, tmp_path / "a", Lineage(source="scratch"))
    fam_b = save_model(b, tmp_path / "b", Lineage(source="scratch"))
    assert fam_a.lineage.root == fam_a.model_id and fam_a.family_id != fam_b.family_id
    raw = json.loads((tmp_path / "a" / "manifest.json").read_text())
    raw["lineage"]["root"] = fam_b.model_id  # a scratch model claiming another's lineage
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ModelDirError, match="own lineage root"):
        read_manifest(tmp_path / "a")
