"""Shared fixtures: tiny configs and model directories made in the test (no shipped weights needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from layerswarm.models.config import ViTConfig
    from layerswarm.models.vit import ViT

# torch and the models are imported where used: CI runs the tests that need no torch under Python 3.10 with
# the torch-free node install (.ci/run), and this file is loaded for every test.


@pytest.fixture(autouse=True, scope="session")
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every coordinator the tests start (in process or as a child) keeps its peer memory here, never in
    the user's state folder: a coordinator on a fixed port (the chaos lab's 8080) would leave lab
    addresses there for the user's next coordinator on that port to dial."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERSWARM_STATE_DIR", str(tmp_path_factory.mktemp("layerswarm-state")))
        yield


TINY = {"image_size": 16, "patch_size": 8, "dim": 32, "depth": 3, "heads": 2, "num_classes": 4}


def tiny_config(variant: str = "layershuffle", **overrides: object) -> ViTConfig:
    from layerswarm.models.config import ViTConfig

    return ViTConfig(**{**TINY, "variant": variant, "class_names": ("a", "b", "c", "d"), **overrides})  # type: ignore


def make_model_dir(
    path: Path, variant: str = "layershuffle", seed: int = 0, parent: tuple[ViT, str] | None = None, **overrides: object
) -> Path:
    """A model directory with random weights; with `parent`, a fine-tuned-looking sibling (same family)."""
    import torch

    from layerswarm.models.checkpoint import Lineage, save_model
    from layerswarm.models.vit import ViT

    torch.manual_seed(seed)
    model = ViT(tiny_config(variant, **overrides))
    if parent is None:
        lineage = Lineage(source="scratch")
    else:
        base, root = parent
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        lineage = Lineage(root=root, parent="mdl-parent", source="model")
    save_model(model, path, lineage, dataset={"spec": "shapes:64:32", "data_seed": 0})
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_model_dir(tmp_path / "model")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three members of one family (one random base, small perturbations), shuffle-robust variant."""
    root = tmp_path_factory.mktemp("family")
    base_dir = make_model_dir(root / "base", seed=1)
    from layerswarm.models.checkpoint import load_model

    base, manifest = load_model(base_dir)
    return [make_model_dir(root / f"m{i}", seed=10 + i, parent=(base, manifest.lineage.root)) for i in range(3)]


@pytest.fixture(scope="session")
def api_swarm(family_dirs: list[Path]) -> Iterator[str]:
    """One real swarm (three node processes, one coordinator process, sequential paths, fp32 on the
    wire) shared by the API suites that only send requests: its base URL."""
    from layerswarm.harness.procs import stop_all

    from .swarm import coordinator_process, start_nodes

    nodes = start_nodes([(family_dirs[0], b) for b in range(3)])
    coord = coordinator_process(
        family_dirs[0], nodes, "--health-interval", "0.2", "--policy", "sequential", "--wire-dtype", "fp32"
    )
    try:
        yield f"http://127.0.0.1:{coord.ready['port']}"
    finally:
        stop_all([coord, *nodes])
