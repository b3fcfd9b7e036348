"""The import direction (docs/ARCHITECTURE.md), checked on the source: a layer imports only layers below it.

wire and models at the bottom; training above models (what makes and measures model directories); node
and coordinator above models, never importing training or each other; harness, cli, chaos and bench on
top (chaos and bench never import the CLI). The registry and the planner are pure logic: no sockets, no
event loop, no RPC.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "layerswarm"
BOTTOM = {"wire", ""}  # "": the package root, which holds only __version__
ALLOWED: dict[str, set[str]] = {
    "wire": BOTTOM,
    "models": {"models", *BOTTOM},
    "training": {"training", "models", *BOTTOM},
    "node": {"node", "models", *BOTTOM},  # serves what models/ loads: never training
    "coordinator": {"coordinator", "models", *BOTTOM},
    "harness": {"harness", "node", "training", "models", *BOTTOM},  # faults.py wraps a real node
    "client": {"client", *BOTTOM},
    "chaos": {"chaos", "harness", "node", "coordinator", "training", "models", *BOTTOM},
    "bench": {"bench", "harness", "node", "coordinator", "training", "models", *BOTTOM},
    "cli": {"cli", "chaos", "bench", "harness", "node", "coordinator", "training", "models", *BOTTOM},
}
# Entry points (`python -m ...`) sit at the top whatever their folder: the test-only faulty node parses
# exactly what `layerswarm node` parses, so it uses the CLI's parser.
ENTRY_POINTS = {"harness/faults.py": {"cli"}}
PURE = {
    "coordinator/registry.py",
    "coordinator/node_records.py",
    "coordinator/claims.py",
    "coordinator/planner.py",
    "coordinator/convictions.py",
    "coordinator/chain_trace.py",
}
IO_MODULES = {"asyncio", "socket", "subprocess", "grpc", "httpx", "zeroconf", "fastapi", "uvicorn", "torch"}


def layer_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def imported_modules(path: Path) -> set[str]:
    return imports_of(path.read_text(), ".".join(("layerswarm", *path.relative_to(PACKAGE).parts[:-1])))


def imports_of(source: str, package: str) -> set[str]:
    """Absolute names of every module `source` imports (relative imports resolved), at any depth of it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join([*base, node.module] if node.module else base))
            else:
                names.add(node.module or "")
    return names


def project_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "layerswarm":
        return None
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else ""


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "v1" not in p.parts)


def test_every_layer_is_known() -> None:
    assert {layer_of(p) for p in SOURCES} <= {*ALLOWED, ""}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_one_way(path: Path) -> None:
    layer = layer_of(path)
    if layer == "":
        return  # layerswarm/__init__ and __main__ (the entry point: it imports the CLI)
    for module in imported_modules(path):
        target = project_layer(module)
        if target is not None:
            allowed = ALLOWED[layer] | ENTRY_POINTS.get(str(path.relative_to(PACKAGE)), set())
            assert target in allowed, f"{path.relative_to(PACKAGE)} ({layer}) imports {module} ({target})"


@pytest.mark.parametrize("name", sorted(PURE))
def test_registry_and_planner_are_pure_logic(name: str) -> None:
    io = {m for m in imported_modules(PACKAGE / name) if m.split(".")[0] in IO_MODULES}
    assert not io, f"{name} imports {io}"


def test_the_checker_sees_a_violation() -> None:
    """The rule is live: a coordinator module importing the node is found (relative, absolute, nested)."""
    source = "from ..node import server\nimport layerswarm.node.runtime\ndef f():\n    from layerswarm.node import x\n"
    modules = imports_of(source, "layerswarm.coordinator")
    assert modules == {"layerswarm.node", "layerswarm.node.runtime"}
    assert {project_layer(m) for m in modules} == {"node"} and "node" not in ALLOWED["coordinator"]


def test_servers_and_models_never_load_training() -> None:
    """What a node or coordinator process imports, all of it, loads nothing of training/: the rule above
    holds through every transitive import, not only each file's own (a fresh interpreter, so nothing
    another test imported counts)."""
    assert "training" not in ALLOWED["models"] | ALLOWED["node"] | ALLOWED["coordinator"]
    script = (
        "import importlib, pkgutil, sys\n"
        "import layerswarm.models, layerswarm.node, layerswarm.coordinator\n"
        "for package in (layerswarm.models, layerswarm.node, layerswarm.coordinator):\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('layerswarm.training')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
