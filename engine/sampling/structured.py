"""Structured output: a request's JSON schema compiled to a grammar, and its per-request state.

llguidance was picked by measured per-token mask cost and schema compile time, both an order
of magnitude below outlines-core's (docs/api.md#structured-output has the numbers). No MLX: the
ingress compiles each schema once to refuse a bad one with a 400 before any replica sees it; the
mask is applied by engine/sampling/logits_processors.py.
"""
from __future__ import annotations

import json
import threading

from engine.errors import InvalidRequest

# Compact JSON with the usual separators: with flexible whitespace a small model can spend its
# whole max_tokens on newlines and return truncated JSON.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema_text: str) -> str:
    """The llguidance grammar for a JSON schema (JSON text); InvalidRequest says what is wrong."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise InvalidRequest(f"not a JSON schema: {e}") from None
    return checked(grammar)


def tool_call_grammar(start: str, end: str, call_schema: dict) -> str:
    """Output that is exactly one tool call: `start`, a JSON object matching `call_schema`
    ({"name": ..., "arguments": ...}), `end` (the JSON tool-call format, e.g. Hermes/Qwen)."""
    from llguidance import LLMatcher

    lark = (f"start: {json.dumps(start)} call {json.dumps(end)}\n"
            f"call: %json {json.dumps(call_schema)}\n")
    return checked(LLMatcher.grammar_from_lark(lark))


def checked(grammar: str) -> str:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidRequest(f"unsupported grammar: {messages[0]}")
    return grammar


class GrammarConstraint:
    """One request's grammar state: the allowed tokens of its next position, advanced by each
    token it samples (llguidance's LLMatcher)."""

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def error(self) -> str:
        return self.matcher.get_error()


class GrammarConstraints:
    """Makes GrammarConstraints for one model's tokenizer. The llguidance tokenizer is built on
    first use (1-4 s for a 49K vocabulary on the 2-core CPU), off the engine thread."""

    def __init__(self, tokenizer, vocab: int):
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)   # mlx-lm wraps the HF one
        self._vocab = vocab
        self._lock = threading.Lock()
        self._lltok = None

    def make(self, grammar: str) -> GrammarConstraint:
        from llguidance import LLMatcher

        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab)
        matcher = LLMatcher(self._lltok, grammar)
        if matcher.is_error():
            raise InvalidRequest(f"grammar: {matcher.get_error()}")
        return GrammarConstraint(matcher)


_EXECUTOR = None   # llguidance thread pool, made on first use (only structured output needs it)


def fill_masks(constraints: list[GrammarConstraint], mask) -> None:
    """Each constraint's next bitmask into its row of `mask` (numpy int32 [R, words]), computed
    in parallel by llguidance's executor (several times faster than one by one:
    bench/constrained.py, docs/lab/engine-kernel-notes.md)."""
    global _EXECUTOR
    from llguidance import LLExecutor
    from llguidance.numpy import fill_next_token_bitmask_par

    if _EXECUTOR is None:
        _EXECUTOR = LLExecutor()
    fill_next_token_bitmask_par(_EXECUTOR, [(c.matcher, i) for i, c in enumerate(constraints)],
                                mask)
