"""The model directory format: a manifest plus one safetensors file per part.

    DIR/manifest.json            format version, ids, variant, config, recipe, dataset, metrics, file hashes
    DIR/stem.safetensors         patch embedding, class token, position embedding
    DIR/head.safetensors         final norm and classifier
    DIR/block_00.safetensors ... one file per block, so a node can fetch and verify one block alone

Two families of models share this format, told apart by the config's "kind": classifiers (ViTConfig:
"image" or "text") and decoders (lm.config.LMConfig: "lm"). Everything here (ids, lineage, hashes,
loading a part) works on both through ModelConfig and Architecture, the seam between this module and
the two model codes; `read_manifest` / `load_model` are the classifiers' own entry points (they refuse a
decoder by name), `read_any_manifest`, `read_lm_manifest` and `load_lm` the others.

The manifest (reading, checking, ids) is manifest.py's, without torch, re-exported here; this module
loads and saves the torch modules.

Ids are derived, never typed: the model id hashes the config and every file's sha256; the family id
hashes the architecture and the lineage root: the model id of the from-scratch ancestor (a model
trained from scratch is its own root), or the hash of an imported checkpoint. Blocks of one family may
be mixed; a model cannot claim a family whose architecture it does not have, and two bases trained
apart (other data, other seed) are two families even when they start from identical weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, overload

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import ViTConfig
from .lm.config import KIND as LM_KIND
from .lm.config import LMConfig
from .lm.model import DecoderBlock, DecoderLM, LMHead, TokenEmbedding
from .lm.model import new_stem_head as new_lm_stem_head
from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TOKENIZED_KINDS,
    TOKENIZER,
    AnyManifest,
    C,
    Lineage,
    Manifest,
    ModelConfig,
    ModelDirError,
    block_file,
    config_from_dict,
    derive_family_id,
    derive_model_id,
    is_lm,
    read_any_manifest,
    read_lm_manifest,
    read_manifest,
    rehash_model_dir,
    sha256_file,
    verified_file,
    verified_path,
    write_manifest,
)
from .text.model import TextEncoder, TextStem
from .vit import Block, Head, Stem, ViT

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "TOKENIZED_KINDS",
    "TOKENIZER",
    "AnyManifest",
    "C",
    "Lineage",
    "Manifest",
    "ModelConfig",
    "ModelDirError",
    "block_file",
    "config_from_dict",
    "derive_family_id",
    "derive_model_id",
    "is_lm",
    "read_any_manifest",
    "read_lm_manifest",
    "read_manifest",
    "rehash_model_dir",
    "sha256_file",
    "verified_file",
    "verified_path",
    "write_manifest",
]


class SplitModel(Protocol):
    """A model as saved: a stem, blocks and a head, each its own file."""

    @property
    def cfg(self) -> ModelConfig: ...
    @property
    def stem(self) -> nn.Module: ...
    @property
    def head(self) -> nn.Module: ...
    @property
    def blocks(self) -> nn.ModuleList: ...


def save_model(
    model: SplitModel,
    out_dir: str | os.PathLike[str],
    lineage: Lineage,
    recipe: dict[str, Any] | None = None,
    dataset: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> Manifest[Any]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: dict[str, nn.Module] = {"stem.safetensors": model.stem, "head.safetensors": model.head}
    parts.update({block_file(i): block for i, block in enumerate(model.blocks)})
    files: dict[str, str] = {}
    for name, module in parts.items():
        tensors = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        save_file(tensors, str(out / name), metadata={"format": FORMAT})
        files[name] = sha256_file(out / name)
    cfg = model.cfg
    if cfg.kind in TOKENIZED_KINDS:
        if not (out / TOKENIZER).is_file():
            raise ValueError(f"{out}: a {cfg.kind} model needs its {TOKENIZER} written before the weights are saved")
        files[TOKENIZER] = sha256_file(out / TOKENIZER)
    model_id = derive_model_id(cfg, files)
    if lineage.source == "scratch":
        lineage = Lineage(root=model_id, parent=None, source="scratch")
    if lineage.root is None:
        raise ValueError(f"a model from {lineage.source!r} needs the lineage root of its ancestor")
    manifest: Manifest[Any] = Manifest(
        config=cfg,
        lineage=lineage,
        files=files,
        model_id=model_id,
        family_id=derive_family_id(cfg, lineage.root),
        recipe=recipe or {},
        dataset=dataset or {},
        metrics=metrics or {},
    )
    write_manifest(out, manifest)
    return manifest


def verified_tensors(model_dir: str | os.PathLike[str], manifest: Manifest[Any], name: str) -> dict[str, torch.Tensor]:
    """Load one part's tensors after checking its sha256 against the manifest."""
    return load_file(str(verified_path(model_dir, manifest, name)))


def _load_into(module: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise ModelDirError(f"{where}: weights do not fit the config ({exc})") from exc


class Architecture(Protocol):
    """How one family builds its parts from its config: the seam the loaders below go through."""

    def new_block(self, cfg: Any) -> nn.Module: ...
    def new_stem_head(self, cfg: Any) -> tuple[nn.Module, nn.Module]: ...


class _Classifier:
    def new_block(self, cfg: ViTConfig) -> nn.Module:
        return Block(cfg)

    def new_stem_head(self, cfg: ViTConfig) -> tuple[nn.Module, nn.Module]:
        return new_stem(cfg), Head(cfg)


class _Decoder:
    def new_block(self, cfg: LMConfig) -> nn.Module:
        return DecoderBlock(cfg)

    def new_stem_head(self, cfg: LMConfig) -> tuple[nn.Module, nn.Module]:
        return new_lm_stem_head(cfg)  # a tied head reads the stem's embedding: they are made together


ARCHITECTURES: dict[str, Architecture] = {"image": _Classifier(), "text": _Classifier(), LM_KIND: _Decoder()}


@overload
def load_block(model_dir: str | os.PathLike[str], index: int, manifest: Manifest[LMConfig]) -> DecoderBlock: ...
@overload
def load_block(model_dir: str | os.PathLike[str], index: int, manifest: Manifest[ViTConfig] | None = None) -> Block: ...
def load_block(model_dir: str | os.PathLike[str], index: int, manifest: AnyManifest | None = None) -> nn.Module:
    """One block, sha256-verified: a classifier's (manifest None or a classifier's) or a decoder's."""
    manifest = manifest or read_manifest(model_dir)
    depth = manifest.config.depth
    if not 0 <= index < depth:
        raise ModelDirError(f"block index {index} out of range: {model_dir} has blocks 0..{depth - 1}")
    block = ARCHITECTURES[manifest.config.kind].new_block(manifest.config)
    _load_into(block, verified_tensors(model_dir, manifest, block_file(index)), f"{model_dir}/{block_file(index)}")
    return block.eval()


def new_stem(cfg: ViTConfig) -> nn.Module:
    """The stem for the config's kind: patch embedding for images, token embedding for text."""
    if cfg.is_text:
        return TextStem(cfg)
    return Stem(cfg)


def new_model(cfg: ViTConfig) -> ViT:
    if cfg.is_text:
        return TextEncoder(cfg)
    return ViT(cfg)


@overload
def load_stem_head(
    model_dir: str | os.PathLike[str], manifest: Manifest[LMConfig]
) -> tuple[TokenEmbedding, LMHead]: ...
@overload
def load_stem_head(
    model_dir: str | os.PathLike[str], manifest: Manifest[ViTConfig] | None = None
) -> tuple[Stem, Head]: ...
def load_stem_head(
    model_dir: str | os.PathLike[str], manifest: AnyManifest | None = None
) -> tuple[nn.Module, nn.Module]:
    """Stem (a TextStem for text models, the token embedding for decoders) and head, verified."""
    manifest = manifest or read_manifest(model_dir)
    stem, head = ARCHITECTURES[manifest.config.kind].new_stem_head(manifest.config)
    _load_into(stem, verified_tensors(model_dir, manifest, "stem.safetensors"), f"{model_dir}/stem")
    _load_into(head, verified_tensors(model_dir, manifest, "head.safetensors"), f"{model_dir}/head")
    return stem.eval(), head.eval()


def load_model(model_dir: str | os.PathLike[str]) -> tuple[ViT, Manifest[ViTConfig]]:
    manifest = read_manifest(model_dir)
    model = new_model(manifest.config)
    stem, head = load_stem_head(model_dir, manifest)
    model.stem.load_state_dict(stem.state_dict())
    model.head.load_state_dict(head.state_dict())
    for i in range(manifest.config.depth):
        model.blocks[i].load_state_dict(load_block(model_dir, i, manifest).state_dict())
    return model.eval(), manifest


def load_lm(model_dir: str | os.PathLike[str]) -> tuple[DecoderLM, Manifest[LMConfig]]:
    """A decoder's whole model, every part verified: the monolith (for training and evaluation)."""
    manifest = read_lm_manifest(model_dir)
    model = DecoderLM(manifest.config)
    stem, head = load_stem_head(model_dir, manifest)
    model.stem.load_state_dict(stem.state_dict())
    model.head.load_state_dict(head.state_dict())
    for i in range(manifest.config.depth):
        model.blocks[i].load_state_dict(load_block(model_dir, i, manifest).state_dict())
    return model.eval(), manifest
