"""The model directory's manifest, without torch: what a lean node (no torch installed) reads and checks.

    DIR/manifest.json            format version, ids, variant, config, recipe, dataset, metrics, file hashes
    DIR/stem.safetensors         patch embedding, class token, position embedding (or token embedding)
    DIR/head.safetensors         final norm and classifier (or a decoder's final norm)
    DIR/block_00.safetensors ... one file per block, so a node can fetch and verify one block alone

Ids are derived, never typed: the model id hashes the config and every file's sha256; the family id
hashes the architecture and the lineage root: the model id of the from-scratch ancestor (a model
trained from scratch is its own root), or the hash of an imported checkpoint. Blocks of one family may
be mixed; a model cannot claim a family whose architecture it does not have, and two bases trained
apart (other data, other seed) are two families even when they start from identical weights.

Loading weights into torch modules, and saving them, is checkpoint.py's (it re-exports all of this);
the numpy engine's loading is node/engines/numpy_engine.py's, through `verified_path` here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeGuard

from typing_extensions import TypeVar

from .config import ViTConfig
from .lm.config import KIND as LM_KIND
from .lm.config import LMConfig

TOKENIZER = "tokenizer.json"  # text models and decoders: the tokenizer, hashed like the weights
TOKENIZED_KINDS = frozenset({"text", LM_KIND})

FORMAT = "layerswarm.model"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ModelDirError(ValueError):
    """A model directory is missing, tampered with, or inconsistent (message says which and how)."""


def block_file(index: int) -> str:
    return f"block_{index:02d}.safetensors"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class ModelConfig(Protocol):
    """What this module needs of a config, whichever family it belongs to."""

    @property
    def kind(self) -> str: ...
    @property
    def depth(self) -> int: ...
    @property
    def variant(self) -> str: ...
    @property
    def shuffle_robust(self) -> bool: ...
    def architecture(self) -> dict[str, Any]: ...
    def to_dict(self) -> dict[str, Any]: ...


C = TypeVar("C", bound=ModelConfig, default=ViTConfig)


def config_from_dict(raw: dict[str, Any]) -> ViTConfig | LMConfig:
    """A manifest's config, by its kind: "lm" is a decoder's, anything else (or none) a classifier's."""
    return LMConfig.from_dict(raw) if raw.get("kind") == LM_KIND else ViTConfig.from_dict(raw)


def derive_family_id(cfg: ModelConfig, lineage_root: str) -> str:
    return "fam-" + hashlib.sha256(_canonical({"arch": cfg.architecture(), "root": lineage_root})).hexdigest()[:16]


def derive_model_id(cfg: ModelConfig, file_hashes: dict[str, str]) -> str:
    return "mdl-" + hashlib.sha256(_canonical({"config": cfg.to_dict(), "files": file_hashes})).hexdigest()[:16]


@dataclass
class Lineage:
    root: str | None = None  # model id of the from-scratch ancestor, or hash of an imported checkpoint
    parent: str | None = None  # model id this one was fine-tuned from
    source: str = "scratch"  # scratch | model | huggingface: a scratch model is its own root


@dataclass
class Manifest(Generic[C]):
    config: C
    lineage: Lineage
    files: dict[str, str]  # file name -> sha256
    model_id: str
    family_id: str
    recipe: dict[str, Any] = field(default_factory=dict)
    dataset: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    # Deployment policy measured on this model (min depth, activation statistics, exit thresholds):
    # outside the hashed ids on purpose, so it can be (re)measured without renaming the model; read and
    # write it with models/policy.py. A coordinator trusts only the policy in its own model dirs.
    policy: dict[str, Any] = field(default_factory=dict)
    # Files beside the weights that hold more policy (adaptive.json), by name -> {"sha256": ...}: kept
    # through every rewrite of the manifest, or the file they list is refused as "written by hand"
    # (models/adaptive_policy.py writes and checks them).
    policy_files: dict[str, Any] = field(default_factory=dict)

    @property
    def variant(self) -> str:
        return self.config.variant

    def block_sha256(self, index: int) -> str:
        return self.files[block_file(index)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model_id": self.model_id,
            "family_id": self.family_id,
            "variant": self.config.variant,
            "lineage": vars(self.lineage),
            "config": self.config.to_dict(),
            "recipe": self.recipe,
            "dataset": self.dataset,
            "metrics": self.metrics,
            "policy": self.policy,
            **({"policy_files": self.policy_files} if self.policy_files else {}),
            "files": {name: {"sha256": sha} for name, sha in sorted(self.files.items())},
        }


def write_manifest(model_dir: str | os.PathLike[str], manifest: Manifest[Any]) -> None:
    out = Path(model_dir)
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    tmp.replace(out / MANIFEST)  # atomic: a reader never sees a half-written manifest


def rehash_model_dir(model_dir: str | os.PathLike[str]) -> Manifest[Any]:
    """Re-derive file hashes and ids after a directory's files changed (keeps lineage, recipe, metrics).
    Anyone can do this to an edited copy: a self-consistent manifest proves nothing about its origin,
    which is why strict coordinators admit only ids and hashes their own manifests list."""
    path = Path(model_dir)
    raw = json.loads((path / MANIFEST).read_text())
    cfg = config_from_dict(raw["config"])
    files = {name: sha256_file(path / name) for name in raw["files"]}
    model_id = derive_model_id(cfg, files)
    lineage = Lineage(**raw["lineage"])
    if lineage.source == "scratch":
        lineage = Lineage(root=model_id, parent=None, source="scratch")
    assert lineage.root is not None
    manifest: Manifest[Any] = Manifest(
        cfg,
        lineage,
        files,
        model_id,
        derive_family_id(cfg, lineage.root),
        raw.get("recipe", {}),
        raw.get("dataset", {}),
        raw.get("metrics", {}),
        raw.get("policy", {}),
        raw.get("policy_files", {}),
    )
    write_manifest(path, manifest)
    return manifest


AnyManifest = Manifest[ViTConfig] | Manifest[LMConfig]


def is_lm(manifest: AnyManifest) -> TypeGuard[Manifest[LMConfig]]:
    return isinstance(manifest.config, LMConfig)


def read_manifest(model_dir: str | os.PathLike[str]) -> Manifest[ViTConfig]:
    """A classifier's manifest, checked (read_any_manifest); a decoder's is refused by name, so a command
    that serves classifiers says so instead of failing on a field a decoder lacks."""
    manifest = read_any_manifest(model_dir)
    if is_lm(manifest):
        raise ModelDirError(f"{model_dir}: a language model (config kind {LM_KIND!r}); this takes classifier models")
    return manifest  # type: ignore[return-value]


def read_lm_manifest(model_dir: str | os.PathLike[str]) -> Manifest[LMConfig]:
    """A decoder's manifest, checked; a classifier's is refused by name."""
    manifest = read_any_manifest(model_dir)
    if not is_lm(manifest):
        raise ModelDirError(f"{model_dir}: a classifier (config kind {manifest.config.kind!r}), not a language model")
    return manifest


def read_any_manifest(model_dir: str | os.PathLike[str]) -> AnyManifest:
    """Parse and check a manifest's own consistency (ids re-derived); file hashes are checked on load."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise ModelDirError(f"{model_dir}: no {MANIFEST} (is this a layerswarm model directory?)")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
            raise ModelDirError(
                f"{path}: format {raw.get('format')!r} v{raw.get('format_version')!r}, "
                f"expected {FORMAT!r} v{FORMAT_VERSION}"
            )
        cfg = config_from_dict(raw["config"])
        manifest: Manifest[Any] = Manifest(
            config=cfg,
            lineage=Lineage(**raw["lineage"]),
            files={name: entry["sha256"] for name, entry in raw["files"].items()},
            model_id=raw["model_id"],
            family_id=raw["family_id"],
            recipe=raw.get("recipe", {}),
            dataset=raw.get("dataset", {}),
            metrics=raw.get("metrics", {}),
            policy=raw.get("policy", {}),
            policy_files=raw.get("policy_files", {}),
        )
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        if isinstance(exc, ModelDirError):
            raise
        raise ModelDirError(f"{path}: malformed manifest ({exc})") from exc
    expected_files = {"stem.safetensors", "head.safetensors"} | {block_file(i) for i in range(cfg.depth)}
    if cfg.kind in TOKENIZED_KINDS:
        expected_files.add(TOKENIZER)
    if set(manifest.files) != expected_files:
        raise ModelDirError(f"{path}: lists files {sorted(manifest.files)}, expected {sorted(expected_files)}")
    if manifest.model_id != derive_model_id(cfg, manifest.files):
        raise ModelDirError(f"{path}: model_id does not match its config and file hashes (edited manifest?)")
    if manifest.lineage.source == "scratch" and manifest.lineage.root != manifest.model_id:
        raise ModelDirError(f"{path}: a model trained from scratch must be its own lineage root")
    if manifest.lineage.root is None or manifest.family_id != derive_family_id(cfg, manifest.lineage.root):
        raise ModelDirError(f"{path}: family_id does not derive from its architecture and lineage")
    return manifest


def verified_path(model_dir: str | os.PathLike[str], manifest: Manifest[Any], name: str) -> Path:
    """The path of one part (a block's safetensors, a tokenizer) after checking its sha256 against the
    manifest: what every loader, torch's or numpy's, reads only after this."""
    path = Path(model_dir) / name
    if name not in manifest.files:
        raise ModelDirError(f"{model_dir}: the manifest lists no file {name!r}")
    if not path.is_file():
        raise ModelDirError(f"{path}: missing (the manifest lists it)")
    actual = sha256_file(path)
    if actual != manifest.files[name]:
        raise ModelDirError(
            f"{path}: sha256 {actual[:16]}... does not match the manifest's {manifest.files[name][:16]}... "
            "(tampered or corrupted weights)"
        )
    return path


def verified_file(model_dir: str | os.PathLike[str], manifest: Manifest[Any], name: str) -> Path:
    """The path of a non-tensor part (a text model's tokenizer) after checking its sha256."""
    path = Path(model_dir) / name
    if name not in manifest.files or not path.is_file():
        raise ModelDirError(f"{model_dir}: missing {name} (or the manifest does not list it)")
    if sha256_file(path) != manifest.files[name]:
        raise ModelDirError(f"{path}: sha256 does not match the manifest (tampered or corrupted)")
    return path
