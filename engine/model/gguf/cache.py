"""Import a .gguf once into a cache folder keyed by the file's content hash.

Serving configs may name a .gguf file as a model `path:`; the first use imports it (with
progress on stderr) into `$ORCHARD_GGUF_CACHE` (default: `$XDG_CACHE_HOME/orchard/gguf`, else
`~/.cache/orchard/gguf`), later uses find the folder and skip the work. A lock file keeps two
processes from importing the same file at once.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from engine.model.gguf.importer import import_gguf

CACHE_ENV = "ORCHARD_GGUF_CACHE"


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "orchard" / "gguf"


def file_key(path: Path) -> str:
    """Short content hash of the file (engine.model.loader's digest: full up to 256 MiB, else size
    plus head and tail)."""
    from engine.model.loader import _file_digest

    return hashlib.sha256(_file_digest(path).encode()).hexdigest()[:16]


def imported_model_dir(gguf_path: str | Path, dtype: str = "float32") -> Path:
    """The model folder imported from `gguf_path`, importing it first if the cache lacks it."""
    src = Path(gguf_path).expanduser().resolve()
    out = cache_root() / f"{src.stem}-{file_key(src)}-{dtype}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():   # another process may have finished it
            import_gguf(src, out, dtype=dtype, overwrite=True)
    return out
