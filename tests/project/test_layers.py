"""The import direction (docs/ARCHITECTURE.md), checked on the source: a layer imports only layers below it.

wire and models at the bottom; training above models (what makes and measures model directories); node
and coordinator above models, never importing training or each other; harness, cli, chaos and bench on
top (chaos and bench never import the CLI). Inside the coordinator its subsystems keep an order of their
own (INNER_ORDER), and no module of it is part of an import circle. The registry and the planner are pure
logic: no sockets, no event loop, no RPC.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "layerswarm"
BOTTOM = {"wire", ""}  # "": the package root, which holds only __version__
ALLOWED: dict[str, set[str]] = {
    "wire": BOTTOM,
    "models": {"models", *BOTTOM},
    "training": {"training", "models", *BOTTOM},
    "node": {"node", "models", *BOTTOM},  # serves what models/ loads: never training
    "coordinator": {"coordinator", "models", *BOTTOM},
    "harness": {"harness", "node", "training", "models", *BOTTOM},  # faults.py wraps a real node
    "client": {"client", *BOTTOM},
    "chaos": {"chaos", "harness", "node", "coordinator", "client", "training", "models", *BOTTOM},  # clients under load
    "bench": {"bench", "harness", "node", "coordinator", "training", "models", *BOTTOM},
    "cli": {"cli", "chaos", "bench", "harness", "node", "coordinator", "training", "models", *BOTTOM},
}
# Entry points (`python -m ...`) sit at the top whatever their folder: the test-only faulty node parses
# exactly what `layerswarm node` parses, so it uses the CLI's parser.
ENTRY_POINTS = {"harness/faults.py": {"cli"}}
# The coordinator's subsystems, from the bottom: each imports only itself and those before it. The
# settings are read by all and import none; the process (process.py, assembly.py, server.py and the
# public face, __init__.py) builds everything. Routing reaches relay chains and the metrics through
# protocols it states (routing/router.py); HTTP reaches the process through one (http/service.py).
INNER_ORDER = (
    "settings",
    "membership",
    "verification",
    "routing",
    "generation",
    "relay",
    "metrics",
    "http",
    "process",
)
ROOT_RANKS = {"settings.py": "settings", "metrics.py": "metrics"}  # other root modules: "process"
PURE = {
    "coordinator/membership/registry.py",
    "coordinator/membership/records.py",
    "coordinator/membership/claims.py",
    "coordinator/membership/convictions.py",
    "coordinator/membership/linkmap.py",
    "coordinator/routing/planner.py",
    "coordinator/routing/netorder.py",
    "coordinator/routing/topology.py",
    "coordinator/generation/routes.py",
    "coordinator/relay/chain_trace.py",
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


def subsystem_of(module: str) -> str | None:
    """The coordinator subsystem of an absolute module name (None: not the coordinator's)."""
    parts = module.split(".")
    if parts[:2] != ["layerswarm", "coordinator"]:
        return None
    if len(parts) == 2:
        return "process"  # the package itself: its public face
    if len(parts) == 3 and not (COORDINATOR / parts[2]).is_dir():
        return ROOT_RANKS.get(f"{parts[2]}.py", "process")
    return parts[2]


COORDINATOR = PACKAGE / "coordinator"
COORDINATOR_SOURCES = sorted(p for p in SOURCES if layer_of(p) == "coordinator")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("layerswarm", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_every_coordinator_subsystem_is_in_the_order() -> None:
    folders = {p.name for p in COORDINATOR.iterdir() if (p / "__init__.py").exists()}
    assert folders | set(ROOT_RANKS.values()) | {"process"} == set(INNER_ORDER)
    for folder in folders:  # each says what it owns
        doc = ast.get_docstring(ast.parse((COORDINATOR / folder / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"coordinator/{folder}/__init__.py: no docstring saying what it owns"


@pytest.mark.parametrize("path", COORDINATOR_SOURCES, ids=lambda p: str(p.relative_to(COORDINATOR)))
def test_coordinator_subsystems_import_one_way(path: Path) -> None:
    own = subsystem_of(module_name(path))
    assert own is not None
    for module in imported_modules(path):
        target = subsystem_of(module)
        if target is not None:
            assert INNER_ORDER.index(target) <= INNER_ORDER.index(own), (
                f"{path.relative_to(PACKAGE)} ({own}) imports {module} ({target}): upward in {INNER_ORDER}"
            )


def test_no_import_circle_in_the_coordinator() -> None:
    """Module by module (imports inside functions and TYPE_CHECKING blocks included): none hides."""
    names = {module_name(p): p for p in COORDINATOR_SOURCES}
    graph = {name: {m for m in imported_modules(path) if m in names and m != name} for name, path in names.items()}
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"import circle: {' -> '.join((*trail[trail.index(name) :], name))}"
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, (*trail, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


def test_the_public_face_names_what_it_loads() -> None:
    """coordinator/__init__.py: each public name is declared for type checkers (and the checks above)
    where it is loaded from, and resolves."""
    import layerswarm.coordinator as face

    tree = ast.parse((COORDINATOR / "__init__.py").read_text())
    declared = {
        alias.name: "." + (node.module or "")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    }
    assert declared == face._HOME and sorted(face.__all__) == sorted(face._HOME)
    for name in face.__all__:
        assert getattr(face, name) is not None


def test_the_checker_sees_a_violation() -> None:
    """The rule is live: a coordinator module importing the node is found (relative, absolute, nested)."""
    source = "from ..node import server\nimport layerswarm.node.runtime\ndef f():\n    from layerswarm.node import x\n"
    modules = imports_of(source, "layerswarm.coordinator")
    assert modules == {"layerswarm.node", "layerswarm.node.runtime"}
    assert {project_layer(m) for m in modules} == {"node"} and "node" not in ALLOWED["coordinator"]
    # ... and inside the coordinator: routing importing the HTTP layer, relay chains or the process.
    upward = "from ..http import app\nfrom ..relay.chains import RelayRunner\nfrom .. import process\n"
    modules = imports_of(upward, "layerswarm.coordinator.routing")
    order = INNER_ORDER.index
    assert {subsystem_of(m) for m in modules} == {"http", "relay", "process"}
    assert all(order(subsystem_of(m) or "") > order("routing") for m in modules)


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


TEST_FOLDERS = {"wire", "models", "node", "coordinator", "client", "training", "cli", "bench", "harness", "chaos"}
TEST_EXTRA_FOLDERS = {"deploy": "deployment files and images", "project": "the project's shape and its docs"}


def test_tests_live_in_folders_that_mirror_the_layers() -> None:
    """A test module sits in the folder of the layer it tests (tests/<layer>/), or in deploy/ or project/;
    helpers shared across layers (swarm.py, conftest.py, the labs) stay at tests/."""
    tests = Path(__file__).resolve().parents[1]
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert layers >= TEST_FOLDERS, f"test folders without a layer: {sorted(TEST_FOLDERS - layers)}"
    stray = sorted(p.name for p in tests.glob("test_*.py"))
    assert not stray, f"test modules at tests/ (move each into its layer's folder): {stray}"
    for module in tests.rglob("test_*.py"):
        folder = module.relative_to(tests).parts[0]
        assert folder in TEST_FOLDERS | set(TEST_EXTRA_FOLDERS), f"{module}: {folder}/ is no layer's folder"
        assert (tests / folder / "__init__.py").exists(), f"tests/{folder}/ needs an __init__.py"


def test_every_folder_says_what_it_owns() -> None:
    """Each package folder's __init__.py opens with a docstring: a newcomer reads what the folder owns
    before opening its files (generated code and data folders aside)."""
    import ast

    silent = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if {"v1", "zoo"} & set(init.relative_to(PACKAGE).parts):
            continue
        if not ast.get_docstring(ast.parse(init.read_text())):
            silent.append(str(init.relative_to(PACKAGE)))
    assert not silent, f"__init__.py without a docstring saying what the folder owns: {silent}"
