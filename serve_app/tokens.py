"""Prompt tokenization at the ingress, so bad or oversized inputs never reach a replica.

The tokenizer comes from a replica (its files travel once over the handle), so the ingress
node does not need the model directory: on a Mac fleet the head usually does not have it.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("orchard.ingress")


# transformers' lazy top-level module is not safe to import from two threads at once: the
# loser gets "cannot import name 'AutoTokenizer' from 'transformers'" (reproduced: two threads
# importing it together fail every time). The ingress loads each model's tokenizer in a worker
# thread (several models at start-up, a retry beside a first load), so the first imports go one
# at a time; once loaded, the lock costs nothing that matters next to a tokenizer load.
_IMPORTS = threading.Lock()


def load_tokenizer(files: dict[str, bytes]) -> tuple[Any, Any]:
    """(Hugging Face tokenizer, serve_app.tools.ModelTextFormat) from a replica's files; the
    format (tool-call parser, think markers) is what mlx-lm infers for the same files."""
    with _IMPORTS:
        from transformers import AutoTokenizer
        try:   # it imports transformers too; _text_format copes without it
            import mlx_lm.tokenizer_utils  # noqa: F401
        except ImportError:
            pass

    with tempfile.TemporaryDirectory(prefix="orchard-tok-") as d:
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        return AutoTokenizer.from_pretrained(d), _text_format(Path(d))


def _text_format(folder: Path) -> Any:
    """mlx-lm's reading of the tokenizer files; without it the model still serves plain text
    (requests with tools are then refused as for a template without a tool format)."""
    from serve_app.tools import ModelTextFormat, text_format

    try:
        from mlx_lm.tokenizer_utils import load as load_wrapper

        return text_format(load_wrapper(folder))
    except Exception:  # noqa: BLE001 - tools and reasoning off, logged once per model
        log.warning("mlx-lm could not read the tokenizer's tool/think format", exc_info=True)
        return ModelTextFormat()


def chat_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None
                ) -> tuple[str, list[int]]:
    """The rendered prompt text and its ids. Render then encode: the template already contains
    any BOS/special tokens it needs."""
    kw = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **kw)
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def text_prompt_ids(tokenizer: Any, prompt: str | list) -> list[int]:
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        else:
            return [int(t) for t in prompt]
    return list(tokenizer.encode(prompt))


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    return chat_prompt(tokenizer, messages)[1]
