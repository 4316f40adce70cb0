"""Per-token cost of constrained decoding (JSON schema) at batch 16: candidate libraries side by
side on the served model's tokenizer, printed as JSON.

For each library: grammar compile time for one schema, then 16 rows walk the tokens of one valid
instance; every step computes the allowed-token bitmask of all 16 rows (timed: `mask_ms_per_step`
and per row-token), then advances each row by its token. The bitmask (int32 words, bit i = token
i allowed, the layout both libraries write) is applied to float32 logits [16, vocab] in MLX by
`engine.sampling.logits_processors.apply_bitmask` (timed apart, host unpacking included: both libraries
ship MLX appliers only as Metal kernels, which the Linux CPU backend cannot run).

    python -m engine.platform exec python -m bench.constrained --model smollm2 \
        --out OUT/x.json

xgrammar is not measured: its wheel depends on torch (pip resolves torch plus the CUDA runtime
wheels, several GB, for a CPU box) and applies masks through torch tensors.
"""
from __future__ import annotations

import argparse
import json
import time

from bench.output import emit
from engine.model.names import MODEL_HELP, model_arg

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "colour", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "colour": "green",
            "tags": ["mathematician", "writer", "analyst"],
            "address": {"city": "London", "zip": "W1J 7NT"}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=model_arg, default="smollm2", help=MODEL_HELP)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    return p.parse_args(argv)


def _walk(batch: int, tokens: list[int], fill, advance, repeats: int) -> dict:
    """Best-of-repeats mask time per step for `batch` rows walking `tokens`."""
    best = None
    for _ in range(repeats):
        states = fill.reset(batch)
        spent = 0.0
        for t in tokens:
            start = time.perf_counter()
            fill(states)
            spent += time.perf_counter() - start
            advance(states, t)
        best = spent if best is None else min(best, spent)
    per_step = best / len(tokens) * 1e3
    return {"mask_ms_per_step": round(per_step, 4),
            "mask_us_per_row_token": round(per_step / batch * 1e3, 2)}


def bench_llguidance(hf_tok, vocab: int, tokens: list[int], batch: int, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    first = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    mask = allocate_token_bitmask(batch, vocab)
    executor = llguidance.LLExecutor()
    out = {"version": llguidance.__version__, "tokenizer_s": round(tokenizer_s, 3),
           "compile_s": round(compile_s, 4)}

    class Serial:
        def reset(self, n):
            return [llguidance.LLMatcher(lltok, grammar) for _ in range(n)]

        def __call__(self, ms):
            for i, m in enumerate(ms):
                v = mask[i]
                m.unsafe_compute_mask_ptr(v.ctypes.data, v.size * v.itemsize)

    class Parallel(Serial):
        def __call__(self, ms):
            fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], mask)

    def advance(ms, t):
        for m in ms:
            assert m.consume_token(t), m.get_error()

    out["serial"] = _walk(batch, tokens, Serial(), advance, repeats)
    out["parallel"] = _walk(batch, tokens, Parallel(), advance, repeats)
    assert first.consume_tokens(tokens) and np.any(mask)
    return out


def _token_bytes(hf_tok) -> dict[bytes, list[int]]:
    """id -> bytes for a byte-level BPE vocabulary (GPT-2's byte-to-unicode table inverted)."""
    # GPT-2's table: printable bytes map to themselves, the others to chr(256 + n) in order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    extra = [b for b in range(256) if b not in printable]
    decoder = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(extra)}
    special = set(hf_tok.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for piece, i in hf_tok.get_vocab().items():
        if i in special:
            continue
        out.setdefault(bytes(decoder[c] for c in piece), []).append(i)
    return out


def bench_outlines(hf_tok, vocab: int, tokens: list[int], batch: int, repeats: int) -> dict:
    import numpy as np
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    vocabulary = Vocabulary(hf_tok.eos_token_id, _token_bytes(hf_tok))
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    compile_s = time.perf_counter() - start
    mask = np.full((batch, (vocab + 31) // 32), -1, dtype=np.int32)
    out = {"version": getattr(outlines_core, "__version__", "0.2.14"),
           "tokenizer_s": round(tokenizer_s, 3), "compile_s": round(compile_s, 4)}

    class Serial:
        def reset(self, n):
            return [Guide(index) for _ in range(n)]

        def __call__(self, guides):
            for i, g in enumerate(guides):
                v = mask[i]
                g.write_mask_into(v.ctypes.data, v.size, 4)

    def advance(guides, t):
        for g in guides:
            g.advance(t)

    out["serial"] = _walk(batch, tokens, Serial(), advance, repeats)
    return out


def bench_apply(vocab: int, batch: int, repeats: int) -> dict:
    import mlx.core as mx
    import numpy as np

    from engine.sampling.logits_processors import apply_bitmask

    logits = mx.random.normal((batch, vocab))
    mask = np.random.default_rng(0).integers(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32),
                                            dtype=np.int32)
    mx.eval(logits)
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(20):
            mx.eval(apply_bitmask(logits, mask))
        spent = (time.perf_counter() - start) / 20
        best = spent if best is None else min(best, spent)
    return {"apply_ms_per_step": round(best * 1e3, 4)}


def run(args) -> dict:
    from transformers import AutoTokenizer

    from engine.model.names import resolve_model

    path = resolve_model(args.model)
    hf_tok = AutoTokenizer.from_pretrained(path)
    vocab = len(hf_tok)
    text = json.dumps(INSTANCE, separators=(",", ":"))
    tokens = hf_tok.encode(text, add_special_tokens=False)
    return {"model": args.model, "vocab": vocab, "batch": args.batch, "repeats": args.repeats,
            "schema": SCHEMA, "instance_tokens": len(tokens),
            "llguidance": bench_llguidance(hf_tok, vocab, tokens, args.batch, args.repeats),
            "outlines_core": bench_outlines(hf_tok, vocab, tokens, args.batch, args.repeats),
            "mlx_apply": bench_apply(vocab, args.batch, args.repeats)}


def main(argv=None) -> int:
    args = parse_args(argv)
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
