"""Output tokens counted from the text a client received, with the model's own tokenizer.

A server's `usage.completion_tokens` is its own claim, and servers count differently (a stop
token, a token that decodes to nothing, a count of steps rather than of text). A user comparing
servers counts what came back: the streamed text, re-tokenized with the model's tokenizer, the
same function for every server. That count is what tokens/s is computed from when a tokenizer is
given; the server's figure is kept next to it (`usage_tokens`) to show where they differ.
"""
from __future__ import annotations

import os

from loadtest.records import RequestRecord


def tokenizer_path(spec: str) -> str:
    """`spec` is a tokenizer.json or a model folder holding one."""
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"no tokenizer at {spec!r}: give a tokenizer.json or a model folder "
                         "that has one")
    return path


class TextCounter:
    """Counts tokens of a text as the model's tokenizer splits it (no special tokens added)."""

    def __init__(self, spec: str):
        from tokenizers import Tokenizer  # Hugging Face's Rust tokenizer, no torch needed

        self.path = tokenizer_path(spec)
        self._tok = Tokenizer.from_file(self.path)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def recount(self, records: list[RequestRecord]) -> dict:
        """Set each served record's output_tokens from its text; return the totals both ways."""
        usage = text = 0
        for r in records:
            if r.outcome != "ok":
                continue
            usage += r.usage_tokens or 0
            r.output_tokens = self.count(r.text)
            r.tokens_from = "text"
            text += r.output_tokens
        return {"from": "text", "tokenizer": self.path, "text_total": text,
                "usage_total": usage}
