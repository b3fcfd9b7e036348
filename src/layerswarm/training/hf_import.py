"""Import a local Hugging Face ViT checkpoint (the key layout of google/vit-base-patch16-224).

Reads DIR/config.json, DIR/model.safetensors (never a pickle) and, when present,
DIR/preprocessor_config.json (the image mean and std HF's processor normalises with; they go into the
config, so the stem normalises as HF did). Query, key and value are fused into
one qkv projection. A different class count re-initialises the classifier (for fine-tuning).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from layerswarm.models.checkpoint import Lineage, sha256_file
from layerswarm.models.config import ViTConfig
from layerswarm.models.vit import ViT

log = logging.getLogger(__name__)


def hf_normalisation(path: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The image mean and std of HF's processor for this checkpoint (preprocessor_config.json; without
    one, ViTImageProcessor's defaults, 0.5 and 0.5). Pixels are scaled to [0, 1] first (1/255), as ours are."""
    path = path / "preprocessor_config.json"
    if not path.is_file():
        return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    raw = json.loads(path.read_text())
    rescale = float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else 1.0
    if abs(rescale - 1 / 255) > 1e-9:
        raise ValueError(f"{path}: rescale_factor {rescale} is not 1/255; only [0, 1] pixel scaling is supported")
    if not raw.get("do_normalize", True):
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    mean = tuple(float(v) for v in raw.get("image_mean", (0.5, 0.5, 0.5)))
    std = tuple(float(v) for v in raw.get("image_std", (0.5, 0.5, 0.5)))
    return mean, std


def hf_config(
    raw: dict[str, Any],
    variant: str,
    num_classes: int | None,
    class_names: tuple[str, ...] | None,
    normalisation: tuple[tuple[float, ...], tuple[float, ...]] = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
) -> ViTConfig:
    if raw.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"only GELU ViTs are supported, this one uses {raw['hidden_act']!r}")
    hidden, inter = int(raw["hidden_size"]), int(raw["intermediate_size"])
    labels = raw.get("id2label") or {}
    names = class_names or tuple(str(labels[k]) for k in sorted(labels, key=int))
    return ViTConfig(
        image_size=int(raw.get("image_size", 224)),
        patch_size=int(raw.get("patch_size", 16)),
        in_channels=int(raw.get("num_channels", 3)),
        dim=hidden,
        depth=int(raw["num_hidden_layers"]),
        heads=int(raw["num_attention_heads"]),
        mlp_ratio=inter / hidden,
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        num_classes=num_classes or len(names) or 1000,
        variant=variant,
        class_names=tuple(names),
        image_mean=normalisation[0],
        image_std=normalisation[1],
        dropout=0.0,
    )


def convert_state_dict(hf: dict[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """HF ViTForImageClassification (or ViTModel) keys -> layerswarm ViT keys."""
    prefix = "vit." if any(k.startswith("vit.") for k in hf) else ""

    def get(key: str) -> torch.Tensor:
        try:
            return hf[prefix + key]
        except KeyError:
            raise ValueError(f"checkpoint lacks {prefix + key!r}: not a ViT in the google/vit-* layout") from None

    out = {
        "stem.cls_token": get("embeddings.cls_token"),
        "stem.pos_embed": get("embeddings.position_embeddings"),
        "stem.patch_embed.weight": get("embeddings.patch_embeddings.projection.weight"),
        "stem.patch_embed.bias": get("embeddings.patch_embeddings.projection.bias"),
        "head.norm.weight": get("layernorm.weight"),
        "head.norm.bias": get("layernorm.bias"),
    }
    for i in range(cfg.depth):
        src, dst = f"encoder.layer.{i}.", f"blocks.{i}."
        att = src + "attention.attention."
        for part in ("weight", "bias"):
            out[dst + f"attn.qkv.{part}"] = torch.cat([get(att + f"{n}.{part}") for n in ("query", "key", "value")])
            out[dst + f"attn.proj.{part}"] = get(src + f"attention.output.dense.{part}")
            out[dst + f"mlp.fc1.{part}"] = get(src + f"intermediate.dense.{part}")
            out[dst + f"mlp.fc2.{part}"] = get(src + f"output.dense.{part}")
            out[dst + f"norm1.{part}"] = get(src + f"layernorm_before.{part}")
            out[dst + f"norm2.{part}"] = get(src + f"layernorm_after.{part}")
    if "classifier.weight" in hf and hf["classifier.weight"].shape[0] == cfg.num_classes:
        out["head.classifier.weight"], out["head.classifier.bias"] = hf["classifier.weight"], hf["classifier.bias"]
    return out


def import_hf_vit(
    path: Path,
    variant: str = "layershuffle",
    num_classes: int | None = None,
    class_names: tuple[str, ...] | None = None,
) -> tuple[ViT, Lineage]:
    config_path, weights_path = path / "config.json", path / "model.safetensors"
    for p in (config_path, weights_path):
        if not p.is_file():
            raise ValueError(f"--init hf:{path}: missing {p.name} (expected a Hugging Face ViT directory)")
    raw = json.loads(config_path.read_text())
    cfg = hf_config(raw, variant, num_classes, class_names, hf_normalisation(path))
    model = ViT(cfg)
    converted = convert_state_dict(load_file(str(weights_path)), cfg)
    missing, unexpected = model.load_state_dict(converted, strict=False)
    allowed_missing = {"head.classifier.weight", "head.classifier.bias"}
    if variant == "layershuffle-position":
        allowed_missing |= {k for k in model.state_dict() if ".position_adapter." in k}
    if variant == "layershuffle-predict":
        allowed_missing |= {k for k in model.state_dict() if ".position_head." in k}
    if unexpected or set(missing) - allowed_missing:
        raise ValueError(
            f"HF checkpoint does not fit: missing {sorted(set(missing) - allowed_missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    if "head.classifier.weight" in missing:
        log.info("classifier re-initialised for %d classes", cfg.num_classes)
    root = "hf-" + sha256_file(weights_path)[:24]
    return model, Lineage(root=root, parent=None, source="huggingface")
