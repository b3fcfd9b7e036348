"""Importing a Hugging Face ViT (google/vit-base-patch16-224 key layout) gives the reference logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerswarm.training.hf_import import import_hf_vit

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")

TINY_HF = {
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 16,
    "patch_size": 8,
    "num_channels": 3,
    "num_labels": 5,
}


def _tiny_checkpoint(path: Path):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        **TINY_HF, id2label={i: f"class{i}" for i in range(5)}, label2id={f"class{i}": i for i in range(5)}
    )
    model = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():  # random, not HF's near-zero init, so every weight matters
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_import_matches_transformers_logits(tmp_path: Path) -> None:
    reference = _tiny_checkpoint(tmp_path)
    model, lineage = import_hf_vit(tmp_path, variant="layershuffle")
    model.eval()
    images = torch.rand(3, 3, 16, 16)  # in [0, 1]; HF's processor maps to (x - 0.5) / 0.5
    with torch.no_grad():
        ours = model(images)
        theirs = reference(pixel_values=(images - 0.5) / 0.5).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    assert model.cfg.class_names == tuple(f"class{i}" for i in range(5))
    assert lineage.source == "huggingface" and lineage.root.startswith("hf-")


def test_import_with_new_classes_reinitialises_head(tmp_path: Path) -> None:
    _tiny_checkpoint(tmp_path)
    model, _ = import_hf_vit(tmp_path, variant="layershuffle-position", num_classes=3, class_names=("a", "b", "c"))
    assert model.head.classifier.out_features == 3
    assert model.blocks[0].position_adapter is not None


def test_missing_files_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        import_hf_vit(tmp_path)
