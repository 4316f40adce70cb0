"""Which int4 KV variant helps a model most: a quick fake-quantization experiment.

    python -m quality.variants --model models/smollm2-135m --out OUT/variants.json

Every variant runs through the paged runner over one native store whose attention replaces the
stored history by its quantize-then-dequantize image before attending (the fresh rows of the
step stay exact, as in the packed stores). That is the same arithmetic as storing codes, for any
layout (token groups of any size, per-channel key groups over a page, native sink and recent
tokens), so candidates can be ranked before one is built into the engine. Rows of a page are
only key-quantized per channel once the page is complete (KIVI): until then they stay native.

`tail` keeps a sequence's incomplete last page native (page-granular, as int4-tail stores it).
With `--chunk` a multiple of the page size (the default 128 over 64-token pages) every chunk
starts on a page boundary, so there is no incomplete page of history and a tail variant equals
its base exactly (so does int4-kivi's native partial page): measure tails with a chunk that is
not a multiple of the page (e.g. 16), closer to decode, where the tail holds 0-63 recent tokens.

With `--parts probes,retrieval` (after or instead of `nll`) the variants are also graded on the
gate's text-suite probes and retrieval (quality.gate.run_probes_text / run_retrieval_text, the
same cases, margin rule and intervals, with this module's runners), so a variant's effect on the
measures that decide the gate is known before it is built:

    python -m quality.variants --parts probes,retrieval --probes 60 --retrieval-cases 40 \
        --variants native,int4-kivi,int4-tail --out OUT/variants-tasks.json

Variants name: bits (kKvV), key grouping (`gN` per token, `c` per channel over a page), value
group, rotation of keys, and native sink / recent token counts. Reported per variant: NLL delta
(%), KL(native || variant) and top-1 agreement over teacher-forced held-out windows (engine.
quality_runs' scoring), and bytes per token per KV head at a given context.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from engine.attention.layers import register_cache
from engine.attention.paged import PagedLayerCache
from engine.kv.store import KVStore, NativeLayerStore
from engine.kv.quant import affine_codes
from engine.kv.rotation import rotate, rotation_matrix


@dataclass(frozen=True)
class Variant:
    name: str
    k_bits: int = 4
    v_bits: int = 4
    k_group: int = 64          # channels per group (per token); 0 = per channel over a page
    v_group: int = 64
    rotate: bool = True
    sinks: int = 0             # first tokens kept native
    recent: int = 0            # most recent history tokens kept native
    tail: bool = False         # a sequence's incomplete last page kept native (page-granular)
    k_span: int = 0            # k_group 0: tokens per key scale (0 = the whole page)

    def row_bytes(self, head_dim: int, page: int, context: int, native_bytes: int = 2) -> float:
        """Average bytes per token per KV head (K + V) at `context` tokens of history."""
        def part(bits, group):
            meta = 8 * (head_dim / (self.k_span or page) if group == 0 else head_dim / group)
            return head_dim * bits / 8 + meta
        packed = part(self.k_bits, self.k_group) + part(self.v_bits, self.v_group)
        extra = min(self.sinks + self.recent, context) * 2 * head_dim * native_bytes
        if self.k_group == 0 or self.tail:   # the incomplete page stays native: half a page on average
            extra += min(page / 2, context) * 2 * head_dim * native_bytes
        return packed + extra / context


VARIANTS = {v.name: v for v in [
    Variant("int8", 8, 8),
    Variant("k8v4", 8, 4),
    Variant("int4", 4, 4),
    Variant("int4-norot", rotate=False),
    Variant("int4-kg32", k_group=32),
    Variant("int4-g32", k_group=32, v_group=32),
    Variant("int4-kg16", k_group=16),
    Variant("int4-s4", sinks=4),
    Variant("int4-r64", recent=64),
    Variant("int4-s4r64", sinks=4, recent=64),
    Variant("int4-s64", sinks=64),
    Variant("int4-kivi", k_group=0, rotate=False),
    Variant("int4-kivi-rot", k_group=0, rotate=True),
    Variant("int4-kivi-v32", k_group=0, v_group=32, rotate=False),   # + values in 32s (88 B)
    Variant("int4-kivi-s4", k_group=0, rotate=False, sinks=4),      # + first 4 tokens native
    # Diagnostics (over 0.40x bf16): which side of int4-kivi costs retrieval, keys or values.
    Variant("kivi-k8v4", 8, 4, k_group=0, rotate=False),
    Variant("kivi-k4v8", 4, 8, k_group=0, rotate=False),
    # Within 0.40x: finer key scales (per channel over 32 tokens) or 6-bit keys (sim only).
    Variant("kivi-h32", k_group=0, rotate=False, k_span=32),
    Variant("kivi-k6v4", 6, 4, k_group=0, rotate=False),
    Variant("kivi-h32-v32", k_group=0, v_group=32, rotate=False, k_span=32),
    Variant("int4-kg32-s4r64", k_group=32, sinks=4, recent=64),
    Variant("int4-tail", tail=True),
    Variant("int4-kg32-tail", k_group=32, tail=True),
    Variant("int4-s4-tail", sinks=4, tail=True),
    Variant("k6v4", 6, 4),
    Variant("k5v4", 5, 4),
]}


def fake_quant(x: mx.array, bits: int, group: int) -> mx.array:
    """Affine min/max round trip over groups of `group` along the last axis (engine.kv.quant's)."""
    lead, d = x.shape[:-1], x.shape[-1]
    g = x.astype(mx.float32).reshape(*lead, d // group, group)
    q, scale, lo = affine_codes(g, bits, axis=-1)
    return (q.astype(mx.float32) * scale + lo).reshape(x.shape)


class VariantCache(PagedLayerCache):
    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        self.step.attended += 1
        var: Variant = self.store.variant
        k, v = self.store.gather(self.view.pages)       # [B, H, P*T, D], this step's rows too
        b, h, n, d = k.shape
        t = self.step.page_tokens
        pos = self.view.base[:, None] + np.arange(n)[None, :]
        start = self.step.starts[:, None]
        quantized = (pos < start) & (pos >= var.sinks) & (pos < start - var.recent)
        if var.k_group == 0 or var.tail:   # only complete pages are packed
            quantized &= (pos // t + 1) * t <= start
        kr = rotate(k) if var.rotate else k.astype(mx.float32)
        if var.k_group == 0:
            span = var.k_span or t
            pages = kr.reshape(b, h, n // span, span, d).swapaxes(-1, -2)
            kq = fake_quant(pages, var.k_bits, span).swapaxes(-1, -2).reshape(b, h, n, d)
        else:
            kq = fake_quant(kr, var.k_bits, var.k_group)
        if var.rotate:
            kq = kq @ rotation_matrix(d).T
        vq = fake_quant(v, var.v_bits, var.v_group)
        sel = mx.array(quantized)[:, None, :, None]
        k = mx.where(sel, kq.astype(k.dtype), k)
        v = mx.where(sel, vq.astype(v.dtype), v)
        return mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask=self.step.page_mask(self.view), sinks=sinks)


class VariantStore(NativeLayerStore):
    def __init__(self, geometry, num_pages, page_tokens, dtype, variant: Variant):
        super().__init__(geometry, num_pages, page_tokens, dtype)
        self.variant = variant


register_cache(VariantStore, VariantCache)


def variant_runner(loaded, num_pages: int, full_layer_store=None):
    """A PackedModelRunner whose full-attention layers keep their KV in
    `full_layer_store(geometry, pages, tokens, dtype)` (other layers native); with no factory,
    every layer native (the reference). Variant caches read pages through the SDPA hook, so
    every paged layer must reach it."""
    from engine.runner.packed import PackedModelRunner
    from quality.runs import PAGE_TOKENS
    if full_layer_store is None:
        return PackedModelRunner(loaded, KVStore(loaded.geometry, num_pages, PAGE_TOKENS,
                                                 loaded.dtype))

    def factory(g, pages, tokens, dtype):
        if g.kind != "full":
            return NativeLayerStore(g, pages, tokens, dtype)
        return full_layer_store(g, pages, tokens, dtype)

    runner = PackedModelRunner(loaded, KVStore(loaded.geometry, num_pages, PAGE_TOKENS,
                                               loaded.dtype, layer_factory=factory))
    if not runner.direct:
        raise RuntimeError("variant caches need the SDPA hook on every paged layer")
    return runner


def make_runner(loaded, name: str, num_pages: int):
    if name == "native":
        return variant_runner(loaded, num_pages)
    var = VARIANTS[name]
    return variant_runner(loaded, num_pages,
                          lambda g, pages, tokens, dtype: VariantStore(g, pages, tokens, dtype, var))


def main(argv=None) -> int:
    from engine.model.loader import load_model
    from quality import runs as quality_runs
    from quality.verdicts import summarize_nll
    from quality.data import text_windows
    from quality import gate
    ap = argparse.ArgumentParser(prog="python -m quality.variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--windows", type=int, default=8, help="windows per corpus (code, chat)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--parts", default="nll", help="nll, probes, retrieval (comma-separated)")
    ap.add_argument("--probes", type=int, default=60, help="judged probes kept (gate's rule)")
    ap.add_argument("--retrieval-cases", type=int, default=40, help="retrieval sequences per length")
    ap.add_argument("--lengths", default="512", help="retrieval lengths")
    ap.add_argument("--retrieval-chunk", type=int, default=512, help="graded tasks' prefill chunk")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if set(parts) - {"nll", "probes", "retrieval"}:
        ap.error(f"--parts: unknown {sorted(set(parts) - {'nll', 'probes', 'retrieval'})}")
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS and n != "native"]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    loaded = load_model(a.model)
    g = next(x for x in loaded.geometry.layers if x.kind == "full")
    t0 = time.time()
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    rows = {n: {"variant": asdict(VARIANTS[n]) if n in VARIANTS else None} for n in names}
    for n in names:
        if n in VARIANTS:
            b = VARIANTS[n].row_bytes(g.head_dim, 64, 1024)
            rows[n].update(bytes_per_token_head_at_1k=b, bf16_ratio_at_1k=b / (2 * g.head_dim * 2))
    seconds, tasks = {}, {}
    if "nll" in parts:
        wins = text_windows(loaded.tokenizer, a.windows, a.window)
        scores = quality_runs.teacher_forced(loaded, wins, names, a.chunk, a.batch, log=log,
                                             make=make_runner)
        seconds["nll"] = round(time.time() - t0, 1)
        for n in names:
            s = summarize_nll(scores[n])
            rows[n].update(s)
            print(f"{n:18s} nll {s['nll_delta_pct']['estimate']:+.3f}% "
                  f"[{s['nll_delta_pct']['ci95'][0]:+.3f},{s['nll_delta_pct']['ci95'][1]:+.3f}] "
                  f"kl {s['kl']['estimate']:.2e} top1 {s['top1_agreement']['estimate']:.4f} "
                  f"x{rows[n].get('bf16_ratio_at_1k', 1.0):.3f}", flush=True)
    # The gate's own graded parts, over these runners (same cases, margin rule and intervals).
    ga = argparse.Namespace(formats=names, probes=a.probes, retrieval_cases=a.retrieval_cases,
                            lengths=[int(x) for x in a.lengths.split(",") if x],
                            retrieval_chunk=a.retrieval_chunk, batch=a.batch)
    for part in ("probes", "retrieval"):
        if part not in parts:
            continue
        t = time.time()
        fn = gate.run_probes_text if part == "probes" else gate.run_retrieval_text
        tasks[part] = fn(loaded, None, ga, make=make_runner)
        seconds[part] = round(time.time() - t, 1)
        for n in names:
            cell = (tasks[part]["by_format"][n] if part == "probes"
                    else tasks[part][n]["by_length"][str(ga.lengths[0])])
            d = cell["delta_points"]
            print(f"{n:18s} {part} {cell['accuracy'] * 100:.1f} % of {cell['cases']} "
                  f"({d['estimate']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}])", flush=True)
    result = {"command": "python -m quality.variants " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": a.model, "dtype": loaded.dtype_name, "windows": a.windows * 2 if "nll" in parts else 0,
              "window": a.window, "chunk": a.chunk, "parts": parts, "seconds": seconds,
              "variants": rows, **tasks}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    from engine.platform import ensure_openblas_preloaded
    ensure_openblas_preloaded()
    raise SystemExit(main())
