"""The adaptive-compute policy of a model directory: calibrated exit rule, ensemble and repeat choices.

`layerswarm eval --calibrate` writes DIR/adaptive.json and records its sha256 in the manifest under
`policy_files` (beside, not inside, `files`: the policy does not change the weights, so it does not
change the model id). The coordinator reads it at start-up and refuses a file whose hash differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .checkpoint import MANIFEST, ModelDirError, sha256_file

POLICY_FILE = "adaptive.json"
MANIFEST_KEY = "policy_files"


def write_policy(model_dir: str | os.PathLike[str], policy: Mapping[str, object]) -> str:
    """Write the policy file and record its hash in the manifest (both atomically). Returns the sha256."""
    root = Path(model_dir)
    _atomic_write(root / POLICY_FILE, json.dumps(policy, indent=2, sort_keys=True) + "\n")
    sha = sha256_file(root / POLICY_FILE)
    manifest = json.loads((root / MANIFEST).read_text())
    manifest.setdefault(MANIFEST_KEY, {})[POLICY_FILE] = {"sha256": sha}
    _atomic_write(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return sha


def read_policy(model_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The verified policy, or None when the model directory has none. Raises ModelDirError when the
    file and the manifest disagree (missing, tampered or unlisted)."""
    root = Path(model_dir)
    listed = json.loads((root / MANIFEST).read_text()).get(MANIFEST_KEY, {}).get(POLICY_FILE)
    path = root / POLICY_FILE
    if listed is None:
        if path.is_file():
            raise ModelDirError(f"{path}: not listed in the manifest's {MANIFEST_KEY} (written by hand?)")
        return None
    if not path.is_file():
        raise ModelDirError(f"{path}: missing (the manifest lists it)")
    if sha256_file(path) != listed.get("sha256"):
        raise ModelDirError(f"{path}: sha256 does not match the manifest (tampered or stale policy)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: expected a JSON object")
    return data


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
