"""The coordinator: discovers the family's nodes, routes requests through them, serves HTTP.

Folders by subsystem, imports going one way (tests/project/test_layers.py), from the bottom:

- settings.py: CoordinatorSettings, the one settings object (defaults stated once);
- membership/: who is in the swarm (discovery, health, the registry and its records, channels);
- verification/: whether a reply is honest (range filters, spot re-execution, replicas);
- routing/: one request's way through the swarm (the request, plan, executor, router);
- relay/: hops that nodes forward to each other as chains;
- metrics.py: the process's Prometheus metrics;
- http/: everything reached over HTTP (native API, KServe v2, the swarm page, the front door);
- process.py, assembly.py, server.py, memory.py: the process that builds, starts and stops it all (memory.py:
  its heap kept to its working size).

What other layers use is named here (`from layerswarm.coordinator import Coordinator`). Each name
loads its module on first use: `layerswarm coordinator --help` reads only the settings, not torch
or the HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names as _HOME below, for type checkers and readers
    from .http.api_keys import read_api_keys
    from .http.app import create_app
    from .membership.clients import NodeClient
    from .membership.peer_memory import default_state_file
    from .process import Coordinator
    from .routing.planner import Policy
    from .routing.request import ClassifyOptions, InvalidRequest
    from .routing.router import Classification, Router
    from .routing.trace import DepthError, Hop, PathResult
    from .server import run, serve
    from .settings import CHOICES, CoordinatorSettings

_HOME = {  # public name -> the module that defines it
    "CHOICES": ".settings",
    "Classification": ".routing.router",
    "ClassifyOptions": ".routing.request",
    "Coordinator": ".process",
    "CoordinatorSettings": ".settings",
    "DepthError": ".routing.trace",
    "Hop": ".routing.trace",
    "InvalidRequest": ".routing.request",
    "NodeClient": ".membership.clients",
    "PathResult": ".routing.trace",
    "Policy": ".routing.planner",
    "Router": ".routing.router",
    "create_app": ".http.app",
    "default_state_file": ".membership.peer_memory",
    "read_api_keys": ".http.api_keys",
    "run": ".server",
    "serve": ".server",
}
__all__ = [
    "CHOICES",
    "Classification",
    "ClassifyOptions",
    "Coordinator",
    "CoordinatorSettings",
    "DepthError",
    "Hop",
    "InvalidRequest",
    "NodeClient",
    "PathResult",
    "Policy",
    "Router",
    "create_app",
    "default_state_file",
    "read_api_keys",
    "run",
    "serve",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # loaded once
    return value
