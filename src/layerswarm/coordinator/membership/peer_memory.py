"""The coordinator's memory of its last known peers, so a restart can look there first.

A small JSON file, written atomically (temp file + rename) when the set of proven peers changes.
On start its addresses become hints like any other: nothing in it is trusted, every address must
prove itself over its own connection, and a damaged, foreign or oversized file is ignored with a
warning (a restart must never fail because of it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
VERSION = 1
MAX_PEERS = 256
MAX_BYTES = 64 * 1024
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}$")


def default_state_dir() -> Path:
    explicit = os.environ.get("LAYERSWARM_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "layerswarm"


def default_state_file(http_port: int) -> Path | None:
    """One file per coordinator HTTP port; none for an ephemeral port (0): test and benchmark
    coordinators must not share (and learn) each other's peers."""
    return default_state_dir() / f"coordinator-{http_port}.json" if http_port else None


def load_peers(path: Path, family_id: str) -> list[str]:
    """The remembered peer addresses, or [] (with a warning) when the file is unusable."""
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError("not a version-1 peer state file")
        if data.get("family_id") != family_id:
            raise ValueError(f"written for family {data.get('family_id')!r}, not {family_id!r}")
        peers = data.get("peers")
        if not isinstance(peers, list) or not all(isinstance(p, str) and _ADDRESS.match(p) for p in peers):
            raise ValueError("peers must be a list of HOST:PORT strings")
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        log.warning("ignoring peer state file %s: %s", path, exc)
        return []
    return list(dict.fromkeys(peers))[:MAX_PEERS]


def save_peers(path: Path, family_id: str, peers: list[str]) -> None:
    """Write atomically: a crash mid-write leaves the old file, never a torn one."""
    body = json.dumps({"version": VERSION, "family_id": family_id, "peers": sorted(peers)[:MAX_PEERS]}, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
