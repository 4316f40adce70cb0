"""Where and how the capacity actor persists learned rate histories: one JSON file, atomically.

Pure file I/O (no Ray): the actor reads it in __init__ after a restart and rewrites it every
PERSIST_INTERVAL_S; an unreadable file means starting with empty histories, never a crash.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile

log = logging.getLogger("orchard.capacity")

SNAPSHOT_ENV = "ORCHARD_CAPACITY_SNAPSHOT"   # overrides the snapshot path; "" disables persistence
DEFAULT_SNAPSHOT_PATH = os.path.join(os.path.expanduser("~"), ".cache", "orchard", "capacity-rates.json")


def default_snapshot_path() -> str:
    return os.environ.get(SNAPSHOT_ENV, DEFAULT_SNAPSHOT_PATH)


def read_snapshot(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        log.warning("capacity snapshot %s unreadable; starting with empty histories", path)
        return None


def write_snapshot(path: str, state: dict) -> None:
    """Atomic: write a temp file in the same directory, then rename over the old snapshot."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".capacity-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
