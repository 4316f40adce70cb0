"""Prompt tokenization at the ingress, so bad or oversized inputs never reach a replica.

The tokenizer comes from a replica (its files travel once over the handle), so the ingress
node does not need the model directory: on a Mac fleet the head usually does not have it.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any


def load_tokenizer(files: dict[str, bytes]) -> Any:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="orchard-tok-") as d:
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        return AutoTokenizer.from_pretrained(d)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    # Render then encode: the template already contains any BOS/special tokens it needs.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_prompt_ids(tokenizer: Any, prompt: str | list) -> list[int]:
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        else:
            return [int(t) for t in prompt]
    return list(tokenizer.encode(prompt))
