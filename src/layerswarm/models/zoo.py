"""The shipped weights: a small family trained by this project's own trainer (see zoo/shapes/README.md)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .manifest import Manifest, read_manifest

SHIPPED = "shapes"


def zoo_root() -> Path:
    return Path(str(resources.files("layerswarm.models") / "zoo"))


def family_root(name: str = SHIPPED) -> Path:
    return zoo_root() / name


def shipped_names() -> list[str]:
    """Every zoo:FAMILY/MEMBER name that resolves to a model directory."""
    return [
        f"zoo:{family.name}/{member.name}"
        for family in sorted(zoo_root().iterdir())
        if family.is_dir()
        for member in sorted(family.iterdir())
        if (member / "manifest.json").is_file()
    ]


def resolve(spec: str) -> Path:
    """A --model-dir value: a path, or zoo:FAMILY/MEMBER for a shipped model (zoo:shapes/layershuffle-0)."""
    if not spec.startswith("zoo:"):
        return Path(spec)
    family, _, member = spec[4:].partition("/")
    path = family_root(family) / member if family else zoo_root() / "-"
    if not (path.is_dir() and (not member or (path / "manifest.json").is_file())):
        raise ValueError(f"{spec}: no such shipped model; shipped: {', '.join(shipped_names())}")
    return path


def model_dirs(root: Path) -> list[tuple[Path, Manifest]]:
    """Every model directory directly under `root`, sorted by name."""
    found = [(p, read_manifest(p)) for p in sorted(root.iterdir()) if (p / "manifest.json").is_file()]
    if not found:
        raise FileNotFoundError(f"no model directories under {root}")
    return found


def robust_members(root: Path) -> list[Path]:
    """The shuffle-robust members of a family folder (the ones a swarm can mix and reorder)."""
    return [p for p, m in model_dirs(root) if m.config.shuffle_robust]


def is_shipped(path: Path) -> bool:
    """Whether `path` is (inside) the shipped zoo: the installed package's own files, which commands that
    write measurements (eval, depth) must leave alone; an editable install's zoo is tracked by git."""
    try:
        Path(path).resolve().relative_to(zoo_root().resolve())
    except ValueError:
        return False
    return True
