"""What the quality gate runs: paged runners per KV format, teacher-forced scoring, greedy probes.

Every format, native included, runs through the same paged runner (engine.attention.packed_cache's
PackedModelRunner over a KVStore), prefilling in chunks so that each chunk after the first reads
its history from stored pages (packed for packed formats) while attending its own fresh K/V in
full precision, exactly as serving's chunked prefill does. Generation then decodes one token per
step over fully stored history.

"int4-norot" is int4 without the K rotation. The shipped packed store always rotates keys and
its attention always rotates queries, so the variant is an adapter here (no edit to those files):
its store quantizes keys unrotated, and its attention hands the shared direct path q R^T and
k_new R^T. Because R is orthogonal, the path's own rotation of q then yields q again against the
unrotated stored keys, and fresh scores stay q k^T (float32, error ~1e-7 relative). Its format
identity string is int4's; it never persists anything, so that never matters.

Runners are built exactly as serving builds them, so off the CPU decode goes through the
direct path's tiled FP32 unpack, as the engine does there (`KernelChoices.gpu_qmm`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from capacity.formats import KVFormat
from engine.kv.store import KVStore, NativeLayerStore
from engine.attention.packed import PackedAttention, bind, direct_attention
from engine.runner.packed import PackedModelRunner
from engine.attention.layers import counters_of, packed_layer_factory
from engine.kv.packed_store import PackedLayerStore
from engine.kv.quant import dequantize, quantize
from engine.kv.rotation import rotation_matrix
from engine.sched.seq import Chunk

FORMATS = ("native", "int8", "k8v4", "int4", "int4-norot", "int4-sink", "int4-tail",
           "int4-k32-tail", "int4-kivi", "k6v4-kivi")
PAGE_TOKENS = 64
REF = "__reference__"
# graded_spans' per-span margin of the reference run: min over the span's positions of the forced
# token's log-prob minus the best other token's (negative where the reference gets it wrong).
REF_MARGIN = "__reference_margin__"
# teacher_forced_exact's higher-precision native run (the bfloat16 gate's float32 reference).
EXACT = "__exact_reference__"


# ------------------------------------------------------------------ attention adapters

def decode_path() -> str:
    return ("quantized_matmul over packed rows (production)" if mx.default_device() == mx.cpu
            else "tiled FP32 unpack (production off the CPU: KernelChoices.gpu_qmm)")


class _UnrotatedAttention(PackedAttention):
    def __call__(self, q, hist, k_new, v_new, *, scale, new_mask="causal", hist_mask=None,
                 sinks=None):
        self.counters.direct += 1
        if hist is None or hist.length == 0:   # no stored keys: plain SDPA, nothing rotated
            return direct_attention(q, hist, k_new, v_new, fmt=self.fmt, scale=scale,
                                    new_mask=new_mask, hist_mask=hist_mask, sinks=sinks)
        r_t = rotation_matrix(q.shape[-1]).T
        out = direct_attention(q.astype(mx.float32) @ r_t, hist, k_new.astype(mx.float32) @ r_t,
                               v_new, fmt=self.fmt, scale=scale, new_mask=new_mask,
                               hist_mask=hist_mask, sinks=sinks)
        return out.astype(q.dtype)


class _UnrotatedStore(PackedLayerStore):
    def write(self, slots, k, v):
        self.write_packed(slots, quantize(k, self.fmt.k_bits), quantize(v, self.fmt.v_bits))

    def gather(self, pages):
        hist = self.gather_packed(pages)
        return dequantize(hist.k, self.fmt.k_bits), dequantize(hist.v, self.fmt.v_bits)


def _unrotated_int4_factory(geometry, num_pages, page_tokens, dtype):
    fmt = KVFormat("int4", geometry.head_dim, str(dtype).removeprefix("mlx.core."))
    if geometry.kind != "full":
        return NativeLayerStore(geometry, num_pages, page_tokens, dtype)
    store = _UnrotatedStore(geometry, fmt, num_pages, page_tokens)
    bind(store, _UnrotatedAttention(fmt))
    return store


def make_runner(loaded, fmt: str, num_pages: int) -> PackedModelRunner:
    # Every other format: exactly what serving builds.
    # A native-tail format needs a tail slot per sequence; a gate runner holds at most one
    # sequence per page table, so one slot per page can never run out (memory is no concern here).
    factory = (_unrotated_int4_factory if fmt == "int4-norot"
               else packed_layer_factory(fmt, tail_slots=num_pages))
    store = KVStore(loaded.geometry, num_pages, PAGE_TOKENS, loaded.dtype, layer_factory=factory)
    return PackedModelRunner(loaded, store)


def _tables(n_seqs: int, max_tokens: int) -> tuple[int, list[list[int]]]:
    pps = -(-max_tokens // PAGE_TOKENS)
    return n_seqs * pps, [list(range(i * pps, (i + 1) * pps)) for i in range(n_seqs)]


# ------------------------------------------------------------------ teacher-forced scoring

@dataclass
class WindowScores:
    """Per-window sums (one entry per window) for one format against native."""

    nll_native: np.ndarray
    nll_format: np.ndarray
    kl: np.ndarray
    agree: np.ndarray
    tokens: np.ndarray


def _chunk_metrics(ref: mx.array, out: mx.array, targets: mx.array, valid: mx.array):
    """Per-row sums over valid positions: native NLL, format NLL, KL(native || format), top-1."""
    lp_r = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    lp_f = out - mx.logsumexp(out, axis=-1, keepdims=True)
    t = targets[..., None]
    nll_r = -mx.take_along_axis(lp_r, t, axis=-1)[..., 0]
    nll_f = -mx.take_along_axis(lp_f, t, axis=-1)[..., 0]
    kl = mx.sum(mx.exp(lp_r) * (lp_r - lp_f), axis=-1)
    agree = (mx.argmax(lp_r, axis=-1) == mx.argmax(lp_f, axis=-1)).astype(mx.float32)
    v = valid.astype(mx.float32)
    return [mx.sum(a * v, axis=-1) for a in (nll_r, nll_f, kl, agree)]


def teacher_forced(loaded, wins: list[np.ndarray], formats, chunk: int, batch: int,
                   log=print, reference: str = "native",
                   make=None) -> dict[str, WindowScores]:
    """Score every window under each format against `reference`, chunk by chunk.
    (teacher_forced_exact: the same, plus every run against a higher-precision native run.)

    The reference runs in a store of its own, so listing `reference` among `formats` compares two
    independent runs (the control: any nondeterminism or store leak in the harness shows there).
    `make(loaded, name, num_pages)` builds each runner (default: make_runner).

    Positions of the first chunk read no stored history (every format equals native there), so
    only targets predicted from positions >= `chunk` are scored.
    """
    return _scores(loaded, wins, formats, chunk, batch, log, reference, make, None)[0]


def teacher_forced_exact(loaded, exact, wins: list[np.ndarray], formats, chunk: int, batch: int,
                         log=print, make=None):
    """teacher_forced against native, and every run (native's included, under the key "native")
    against `exact`: the same weights loaded in a wider compute dtype (float32 for a bfloat16
    gate), run natively through its own paged store. Returns (scores against native, scores
    against exact); the second's `nll_native` is the exact run's NLL. quality.verdicts' noise
    floor is native's row of the second."""
    return _scores(loaded, wins, formats, chunk, batch, log, "native", make, exact)


def _scores(loaded, wins, formats, chunk, batch, log, reference, make, exact):
    make = make or make_runner
    length = len(wins[0])
    if chunk >= length - 1:
        raise ValueError(f"chunk {chunk} leaves nothing to score in windows of {length}")
    sums = {f: np.zeros((4, len(wins))) for f in formats}
    # Against the exact run: native (the reference run) and every other format.
    vs_exact = ["native", *[f for f in formats if f != "native"]] if exact is not None else []
    exact_sums = {f: np.zeros((4, len(wins))) for f in vs_exact}
    counts = np.zeros(len(wins))
    t0 = time.time()
    for b0 in range(0, len(wins), batch):
        group = np.stack(wins[b0:b0 + batch]).astype(np.int32)
        n = len(group)
        num_pages, tables = _tables(n, length)
        runners = {REF: make(loaded, reference, num_pages),
                   **{f: make(loaded, f, num_pages) for f in formats}}
        if exact is not None:
            runners[EXACT] = make_runner(exact, "native", num_pages)
        for s in range(0, length, chunk):
            e = min(s + chunk, length)
            chunks = [Chunk(i, group[i, s:e].tolist(), s, tables[i]) for i in range(n)]
            logits = {f: mx.stack(r.forward_all(chunks)) for f, r in runners.items()}
            if s == 0:
                mx.eval(list(logits.values()))   # writes the first chunk's K/V; nothing scored
                continue
            pos = np.arange(s, e)
            tgt = np.zeros((n, e - s), np.int32)
            ok = pos + 1 < length
            tgt[:, ok] = group[:, pos[ok] + 1]
            valid = mx.array(np.broadcast_to(ok, (n, e - s)))
            got = {f: _chunk_metrics(logits[REF], logits[f], mx.array(tgt), valid)
                   for f in formats}
            ex = {f: _chunk_metrics(logits[EXACT], logits[REF if f == "native" else f],
                                    mx.array(tgt), valid) for f in vs_exact}
            mx.eval(got, ex)
            for f in formats:
                sums[f][:, b0:b0 + n] += np.stack([np.array(a) for a in got[f]])
            for f in vs_exact:
                exact_sums[f][:, b0:b0 + n] += np.stack([np.array(a) for a in ex[f]])
            counts[b0:b0 + n] += ok.sum()
        del runners
        done = min(b0 + batch, len(wins))
        log(f"  nll: {done}/{len(wins)} windows, {int(counts.sum())} tokens scored per format, "
            f"{time.time() - t0:.0f}s")
    return ({f: WindowScores(*sums[f], counts.copy()) for f in formats},
            {f: WindowScores(*exact_sums[f], counts.copy()) for f in vs_exact})


# ------------------------------------------------------------------ greedy generation

def generate(loaded, fmt: str, cases, chunk: int, batch: int, log=None) -> np.ndarray:
    """1/0 per case: greedy decoding from the prompt produces exactly the case's answer tokens.

    The prompt is prefilled in `chunk`-token chunks, then the answer decoded one token per step
    (so every answer token after the first reads the whole prompt from stored pages). Decoding
    stops at the first wrong token.
    """
    ok = np.zeros(len(cases), np.int8)
    for b0 in range(0, len(cases), batch):
        group = cases[b0:b0 + batch]
        num_pages, tables = _tables(len(group), max(len(c.prompt) + len(c.answer) for c in group))
        runner = make_runner(loaded, fmt, num_pages)
        pos = [0] * len(group)
        gen: list[list[int]] = [[] for _ in group]
        alive = set(range(len(group)))
        while alive:
            rows = sorted(alive)
            chunks = []
            for i in rows:
                c = group[i]
                ids = (c.prompt[pos[i]:pos[i] + chunk] if pos[i] < len(c.prompt)
                       else [gen[i][-1]])
                chunks.append(Chunk(i, ids, pos[i], tables[i]))
            nxt = np.array(mx.argmax(runner.forward(chunks), axis=-1))
            for j, i in enumerate(rows):
                pos[i] += len(chunks[j].token_ids)
                if pos[i] < len(group[i].prompt):
                    continue
                gen[i].append(int(nxt[j]))
                ans = group[i].answer
                if gen[i][-1] != ans[len(gen[i]) - 1]:
                    alive.discard(i)
                elif len(gen[i]) == len(ans):
                    ok[b0 + i] = 1
                    alive.discard(i)
        if fmt != "native" and not counters_of(runner.kvstore).get("direct"):
            raise RuntimeError(f"{fmt}: the packed attention path never ran")
        if log:
            log(f"    {fmt}: {min(b0 + batch, len(cases))}/{len(cases)} cases")
    return ok


# ------------------------------------------------------------------ graded spans (text suite)

def _cuts(seq, chunk: int) -> list[tuple[int, int]]:
    """Prefill chunks of one sequence: every `chunk` tokens, and a cut just before each graded
    span's first predicting position, so its context is read from stored pages as in decode."""
    n = len(seq.tokens)
    cuts = set(range(0, n, chunk)) | {a - 1 for a, _ in seq.spans if a > 0}
    bounds = sorted(cuts) + [n]
    return [(s, e) for s, e in zip(bounds, bounds[1:]) if e > s]


def forced_margin(logits: mx.array, targets: mx.array) -> mx.array:
    """Per position: log p(target) - max over other tokens of log p (= the logit gap, since both
    share one normalizer). Positive exactly where the target is the unique argmax."""
    vocab = mx.arange(logits.shape[-1])
    x = logits.astype(mx.float32)
    forced = mx.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    other = mx.max(mx.where(vocab == targets[..., None], -mx.inf, x), axis=-1)
    return forced - other


def graded_spans(loaded, seqs, formats, chunk: int, batch: int, log=None,
                 reference: str = "native", make=None) -> dict[str, np.ndarray]:
    """1/0 per graded span (in sequence order) for `reference` (key "__reference__", its own
    store) and each format: argmax at every position of the span equals the forced token
    (quality.tasks: the same as greedy decoding reproducing it). Key "__reference_margin__":
    the reference's margin per span (forced_margin, minimum over the span's positions), which
    selects the cases a format is judged on (quality.verdicts.PROBE_MIN_MARGIN)."""
    make = make or make_runner
    names = [REF, *formats]
    ok = {f: [] for f in names}
    margins: list[float] = []
    t0 = time.time()
    for b0 in range(0, len(seqs), batch):
        group = seqs[b0:b0 + batch]
        num_pages, tables = _tables(len(group), max(len(s.tokens) for s in group))
        runners = {REF: make(loaded, reference, num_pages),
                   **{f: make(loaded, f, num_pages) for f in formats}}
        plans = [_cuts(s, chunk) for s in group]
        right = {f: [np.zeros(len(s.tokens), bool) for s in group] for f in names}
        gap = [np.full(len(s.tokens), -np.inf, np.float32) for s in group]
        for k in range(max(len(p) for p in plans)):
            rows = [i for i, p in enumerate(plans) if k < len(p)]
            chunks = [Chunk(i, group[i].tokens[plans[i][k][0]:plans[i][k][1]], plans[i][k][0],
                               tables[i]) for i in rows]
            for f, r in runners.items():
                logits = r.forward_all(chunks)
                preds = [mx.argmax(x, axis=-1) for x in logits]
                if f == REF:   # the forced token's margin, read where a span predicts
                    tgts = []
                    for i in rows:
                        s, e = plans[i][k]
                        t = group[i].tokens[s + 1:e + 1]
                        tgts.append(mx.array(t + [0] * (e - s - len(t)), dtype=mx.int32))
                    gaps = [forced_margin(x, t) for x, t in zip(logits, tgts)]
                    mx.eval(preds, gaps)
                    for i, g in zip(rows, gaps):
                        s, e = plans[i][k]
                        n_t = min(e, len(group[i].tokens) - 1) - s
                        gap[i][s:s + n_t] = np.array(g)[:n_t]
                else:
                    mx.eval(preds)
                for i, p in zip(rows, preds):
                    s, e = plans[i][k]
                    toks = np.asarray(group[i].tokens)
                    hit = np.array(p)[:max(0, min(e, len(toks) - 1) - s)] == toks[s + 1:e + 1]
                    right[f][i][s:s + len(hit)] = hit
        for f in names:
            for i, s in enumerate(group):
                ok[f] += [int(right[f][i][a - 1:b - 1].all()) for a, b in s.spans]
        for i, s in enumerate(group):
            margins += [float(gap[i][a - 1:b - 1].min()) for a, b in s.spans]
        del runners
        if log:
            log(f"  graded: {min(b0 + batch, len(seqs))}/{len(seqs)} sequences, "
                f"{time.time() - t0:.0f}s")
    return {**{f: np.asarray(v, np.int8) for f, v in ok.items()},
            REF_MARGIN: np.asarray(margins, np.float32)}
