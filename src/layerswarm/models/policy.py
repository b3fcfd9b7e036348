"""A model directory's deployment policy: facts measured on the model that a coordinator uses as defaults.

Stored in manifest.json under "policy", one JSON object per key, each owned by the code that measures it:

    "policy": {
      "min_blocks": {"value": 8, "margin": 0.01, "order": "arbitrary", ...},       # layerswarm eval
      "activation_stats": {"positions": [{"max_abs": .., "rms_min": .., "rms_max": ..}, ...], ...},
      "exit_thresholds": {...}                                                     # adaptive compute
    }

The policy is not part of the hashed model id (checkpoint.derive_model_id hashes config and files only),
so re-measuring never renames a model, and nothing here is trusted from a peer: a coordinator reads the
policy of its own model directories only. Add a key by calling write_entry from the code that measures
it; read it with entry(). Keep this module to IO: what a key means lives with its writer and reader.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .checkpoint import AnyManifest, read_any_manifest, write_manifest

MIN_BLOCKS = "min_blocks"
ACTIVATION_STATS = "activation_stats"


def entry(manifest: AnyManifest, key: str) -> dict[str, Any] | None:
    value = manifest.policy.get(key)
    return value if isinstance(value, dict) else None


def write_entry(model_dir: str | os.PathLike[str], key: str, value: Mapping[str, object]) -> AnyManifest:
    """Set one policy key in a model directory's manifest (atomically; ids unchanged), either family's."""
    manifest = read_any_manifest(model_dir)
    manifest.policy[key] = value
    write_manifest(model_dir, manifest)
    return manifest


def min_blocks(manifest: AnyManifest) -> int | None:
    """The evaluated minimum useful depth, or None when the model was never evaluated."""
    found = entry(manifest, MIN_BLOCKS)
    value = None if found is None else found.get("value")
    return value if isinstance(value, int) and 1 <= value <= manifest.config.depth else None
