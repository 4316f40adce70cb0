"""4-bit page keys that keep a few channels wider: a fake-quantization experiment (issue 32 item 5).

    python -m quality.key4_variants --variants int4-kivi,kivi-w4x8,kivi-w8x8 --out OUT/k4.json

Extends quality.variants' simulation (the same paged runner, stored history replaced by its
quantize-then-dequantize image before attention, fresh rows of the step exact) with layouts the
built formats cannot express:

- keys per channel over each full page (int4-kivi's page keys, unrotated), except the `wide`
  channels of each (page, KV head) with the largest range over the page, which get `wide_bits`
  (16 = kept native). Choosing them per page costs one index byte per channel per page; the
  experiment charges it in the bytes below;
- values per token at any bit width (4, 5, 6) and group, so that the share of the KL the 4-bit
  values carry can be separated from the keys';
- `pre_rope`: page keys quantized before RoPE (KVQuant's pre-RoPE per-channel keys): the stored
  post-RoPE rows are rotated back to position 0, quantized per channel over the page, and
  rotated forward again. RoPE's fast pairs turn through a full circle within a page, so their
  post-RoPE range over a page is twice their magnitude whatever the token; before RoPE it is
  what the tokens differ by (bench/kv_key_ranges.py measures the post-RoPE ranges). The model's
  RoPE must be the plain one (rotate-half, no scaling: SmolLM2's), `rope_base` its theta.

Every variant keeps a sequence's partial last page native (the page-key formats' tail): measure
with a chunk that is not a multiple of the page (e.g. 16) to see the tail act, or the gate's
128 to compare with the gate's NLL verdict. Bytes per token per KV head are full pages' (the
tail pool comes on top as the replica's fixed arena, as for k6v4-kivi).
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
from engine.kv.store import NativeLayerStore
from quality.variants import fake_quant, variant_runner


@dataclass(frozen=True)
class KeyVariant:
    name: str
    k_bits: int = 4
    wide: int = 0              # channels per (page, KV head) kept at wide_bits, by largest range
    wide_bits: int = 8         # 16 = native
    k_span: int = 0            # tokens per key scale (0 = the whole page)
    v_bits: int = 4
    v_group: int = 64
    select: str = "range"      # wide channels chosen per page by range (index bytes charged)
    pre_rope: bool = False     # quantize keys before RoPE (rotated back by position first)
    hot_heads: int = 0         # (layer, KV head) pairs with the largest int4 score error (HOT_FROM)
    hot_bits: int = 8          # their key bits
    key_page: int = 0          # tokens per key page (scales over it; its partial page native);
    #                            0 = the runner's page. A multiple of the runner's page.

    def row_bytes(self, head_dim: int = 64, page: int = 64) -> float:
        """Bytes per token per KV head of a full page (K + V), FP32 metadata as the formats'."""
        page = self.key_page or page
        span = self.k_span or page
        if self.k_bits >= 16:      # diagnostic: native keys, no metadata
            keys = head_dim * 2
        else:
            keys = head_dim * self.k_bits / 8 + 8 * head_dim / span
            keys += self.wide * (self.wide_bits - self.k_bits) / 8
            if self.wide and self.select == "range":
                keys += self.wide / page        # one channel index byte per wide channel per page
            if self.hot_heads:                  # SmolLM2: 30 layers x 3 KV heads = 90
                keys += self.hot_heads / 90 * head_dim * (self.hot_bits - self.k_bits) / 8
        values = (head_dim * 2 if self.v_bits >= 16 else
                  head_dim * self.v_bits / 8 + 8 * head_dim / self.v_group)
        return keys + values


VARIANTS = {v.name: v for v in [
    KeyVariant("int4-kivi"),                                   # the built format, simulated
    KeyVariant("k6v4-kivi", k_bits=6),                         # the built 6-bit-key format
    KeyVariant("kivi-k8v4", k_bits=8),                         # 8-bit keys: what values alone cost
    KeyVariant("kivi-k16v4", k_bits=16),                       # native keys: values' KL alone
    KeyVariant("kivi-k4v16", v_bits=16),                       # native values: keys' KL alone
    KeyVariant("kivi-w2x8", wide=2),
    KeyVariant("kivi-w4x8", wide=4),
    KeyVariant("kivi-w8x8", wide=8),
    KeyVariant("kivi-w4x16", wide=4, wide_bits=16),
    KeyVariant("kivi-w8x16", wide=8, wide_bits=16),
    KeyVariant("kivi-w16x8", wide=16),
    KeyVariant("kivi-h32-w4x8", wide=4, k_span=32),
    KeyVariant("kivi-w4x8-v5", wide=4, v_bits=5),
    KeyVariant("kivi-w8x8-v5", wide=8, v_bits=5),
    KeyVariant("kivi-w4x8-v32", wide=4, v_group=32),
    KeyVariant("kivi-w8x8-v6", wide=8, v_bits=6),
    KeyVariant("kivi-v5", v_bits=5),
    KeyVariant("kivi-k6v5", k_bits=6, v_bits=5),
    KeyVariant("kivi-k6v6", k_bits=6, v_bits=6),
    # 6-bit keys with 5-bit values inside 0.40x: key scales over 128 / 256 tokens (1 / 0.5 B a
    # token instead of 2 at 64-token pages, 0.391x / 0.383x), or 5-bit keys (0.375x).
    KeyVariant("kivi-k6v5-p128", k_bits=6, v_bits=5, key_page=128),
    KeyVariant("kivi-k6v5-p256", k_bits=6, v_bits=5, key_page=256),
    KeyVariant("kivi-k5v5", k_bits=5, v_bits=5),
    KeyVariant("prerope-k4v4", pre_rope=True),
    KeyVariant("prerope-w4x8", pre_rope=True, wide=4),
    KeyVariant("prerope-w8x8", pre_rope=True, wide=8),
    KeyVariant("prerope-k4v5", pre_rope=True, v_bits=5),
    KeyVariant("prerope-w4x8-v5", pre_rope=True, wide=4, v_bits=5),
    KeyVariant("prerope-k4v16", pre_rope=True, v_bits=16),
    KeyVariant("prerope-h32", pre_rope=True, k_span=32),
    KeyVariant("kivi-hot9", hot_heads=9),
    KeyVariant("prerope-hot9-w4x8", pre_rope=True, hot_heads=9, wide=4),
    KeyVariant("prerope-hot9-w8x8", pre_rope=True, hot_heads=9, wide=8),
    KeyVariant("prerope-hot9-w8x8-v5", pre_rope=True, hot_heads=9, wide=8, v_bits=5),
    KeyVariant("prerope-w16x8", pre_rope=True, wide=16),
    KeyVariant("prerope-hot9-w16x8", pre_rope=True, hot_heads=9, wide=16),
    KeyVariant("prerope-hot9-w16x8-v5", pre_rope=True, hot_heads=9, wide=16, v_bits=5),
    KeyVariant("kivi-w16x8-v5", wide=16, v_bits=5),
    KeyVariant("kivi-hot9-w16x8-v5", hot_heads=9, wide=16, v_bits=5),
    KeyVariant("prerope-hot18-w16x8-v5", pre_rope=True, hot_heads=18, wide=16, v_bits=5),
    KeyVariant("kivi-k16v5", k_bits=16, v_bits=5),   # diagnostics: what 5- and 6-bit values
    KeyVariant("kivi-k16v6", k_bits=16, v_bits=6),   # cost with native keys (the values' floor)
]}
# Calibration for hot_heads: bench/kv_key_ranges.py's per-head RMS score error of int4 page keys
# on SmolLM2 (one chat and one code window of the gate's held-out text).
HOT_FROM = "docs/lab/quality-formats/smollm2-key-ranges-cpu.json"


def hot_heads(n: int) -> dict[int, list[int]]:
    """The n (layer, KV head) pairs with the largest int4 score error, by layer."""
    with open(HOT_FROM) as f:
        layers = json.load(f)["layers"]
    ranked = sorted(((h["score_rms_int4_post_rope"], int(layer), i)
                     for layer, heads in layers.items() for i, h in enumerate(heads)), reverse=True)
    out: dict[int, list[int]] = {}
    for _, layer, head in ranked[:n]:
        out.setdefault(layer, []).append(head)
    return out


def rope_rotate(x: mx.array, positions: mx.array, base: float, inverse: bool = False) -> mx.array:
    """Rotate-half RoPE (mlx-lm's non-traditional nn.RoPE, no scaling) of x [B, H, N, D] at
    positions [B, N]; `inverse` turns it back."""
    d = x.shape[-1]
    inv = base ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)                  # [D/2]
    ang = positions.astype(mx.float32)[:, None, :, None] * inv                  # [B, 1, N, D/2]
    cos, sin = mx.cos(ang), mx.sin(ang)
    if inverse:
        sin = -sin
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def page_key_image(k: mx.array, var: KeyVariant, page: int) -> mx.array:
    """Fake-quantized keys [B, H, N, D] (N whole pages): per channel over each page (or span),
    the `wide` widest-range channels of each page at wide_bits."""
    b, h, n, d = k.shape
    span = var.k_span or page
    kf = k.astype(mx.float32)
    spans = kf.reshape(b, h, n // span, span, d).swapaxes(-1, -2)      # [B, H, S, D, span]
    narrow = fake_quant(spans, var.k_bits, span) if var.k_bits < 16 else spans
    if var.wide:
        wide = fake_quant(spans, var.wide_bits, span) if var.wide_bits < 16 else spans
        pages = kf.reshape(b, h, n // page, page, d)
        rng = pages.max(axis=3) - pages.min(axis=3)                      # [B, H, P, D]
        top = mx.argsort(-rng, axis=-1)[..., :var.wide]
        keep = mx.zeros(rng.shape, dtype=mx.bool_)
        keep = mx.put_along_axis(keep, top, mx.array(True), axis=-1)      # [B, H, P, D]
        keep = mx.repeat(keep, page // span, axis=2)[..., None]            # [B, H, S, D, 1]
        narrow = mx.where(keep, wide, narrow)
    return narrow.swapaxes(-1, -2).reshape(b, h, n, d)


class KeyVariantCache(PagedLayerCache):
    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        self.step.attended += 1
        var: KeyVariant = self.store.variant
        k, v = self.store.gather(self.view.pages)       # [B, H, P*T, D], this step's rows too
        n = k.shape[2]
        t = var.key_page or self.step.page_tokens
        if var.key_page and (var.key_page % self.step.page_tokens or var.pre_rope or var.hot_heads
                             or var.wide):
            raise ValueError(f"{var.name}: key_page must be a multiple of the runner's page "
                             "and is simulated for plain page keys only")
        if var.key_page and np.any(np.asarray(self.view.base) % t):
            raise ValueError(f"{var.name}: gathered keys must start on a key page")
        pos = self.view.base[:, None] + np.arange(n)[None, :]
        start = self.step.starts[:, None]
        quantized = (pos < start) & ((pos // t + 1) * t <= start)   # complete key pages of history
        if n % t:   # gathered pages end mid key page: pad (those keys stay native anyway)
            k = mx.concatenate([k, mx.zeros((*k.shape[:2], t - n % t, k.shape[3]), k.dtype)], 2)
        if var.pre_rope:
            p = mx.array(pos.astype(np.int32))
            kpre = rope_rotate(k.astype(mx.float32), p, self.store.rope_base, True)
            kq = rope_rotate(page_key_image(kpre, var, t), p, self.store.rope_base)
        else:
            kpre, kq = k, page_key_image(k, var, t)
        if self.store.hot:   # these heads' keys at hot_bits (per channel over the page, as the rest)
            hot = page_key_image(kpre, KeyVariant("hot", k_bits=var.hot_bits, k_span=var.k_span), t)
            if var.pre_rope:
                hot = rope_rotate(hot, p, self.store.rope_base)
            is_hot = mx.array(np.isin(np.arange(k.shape[1]), self.store.hot))[None, :, None, None]
            kq = mx.where(is_hot, hot, kq)
        vq = fake_quant(v, var.v_bits, var.v_group) if var.v_bits < 16 else v
        k, kq = k[:, :, :n], kq[:, :, :n]
        sel = mx.array(quantized)[:, None, :, None]
        k = mx.where(sel, kq.astype(k.dtype), k)
        v = mx.where(sel, vq.astype(v.dtype), v)
        return mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask=self.step.page_mask(self.view), sinks=sinks)


class KeyVariantStore(NativeLayerStore):
    def __init__(self, geometry, num_pages, page_tokens, dtype, variant: KeyVariant,
                 rope_base: float = 10000.0, hot: list[int] | None = None):
        super().__init__(geometry, num_pages, page_tokens, dtype)
        self.variant, self.rope_base, self.hot = variant, rope_base, hot or []


register_cache(KeyVariantStore, KeyVariantCache)


def make_runner(loaded, name: str, num_pages: int):
    if name == "native":
        return variant_runner(loaded, num_pages)
    var = VARIANTS[name]
    rope = loaded.model.layers[0].self_attn.rope
    if var.pre_rope and (type(rope).__name__ != "RoPE" or rope.traditional or rope.scale != 1.0):
        raise RuntimeError(f"{name}: pre-RoPE keys are simulated for plain rotate-half RoPE only")
    base = float(getattr(rope, "base", 10000.0))
    hot = hot_heads(var.hot_heads) if var.hot_heads else {}
    layer = iter(range(10**6))   # full-attention layers are built in order
    return variant_runner(loaded, num_pages, lambda g, pages, tokens, dtype: KeyVariantStore(
        g, pages, tokens, dtype, var, base, hot.get(next(layer))))


def main(argv=None) -> int:
    from engine.model.loader import load_model
    from quality import gate
    from quality import runs as quality_runs
    from quality.data import text_windows
    from quality.verdicts import summarize_nll
    ap = argparse.ArgumentParser(prog="python -m quality.key4_variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--windows", type=int, default=4, help="windows per corpus (code, chat)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--parts", default="nll", help="nll, retrieval (comma-separated)")
    ap.add_argument("--retrieval-cases", type=int, default=40)
    ap.add_argument("--lengths", default="512")
    ap.add_argument("--retrieval-chunk", type=int, default=512)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS and n != "native"]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    loaded = load_model(a.model)
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    rows = {}
    for n in names:
        var = VARIANTS.get(n)
        b = var.row_bytes() if var else 256.0
        rows[n] = {"variant": asdict(var) if var else None, "bytes_per_token_head": b,
                   "bf16_ratio": b / 256.0}
    seconds, tasks = {}, {}
    t0 = time.time()
    if "nll" in parts:
        wins = text_windows(loaded.tokenizer, a.windows, a.window)
        scores = quality_runs.teacher_forced(loaded, wins, names, a.chunk, a.batch, log=log,
                                             make=make_runner)
        seconds["nll"] = round(time.time() - t0, 1)
        for n in names:
            s = summarize_nll(scores[n])
            rows[n].update(s)
            print(f"{n:16s} x{rows[n]['bf16_ratio']:.3f} nll {s['nll_delta_pct']['estimate']:+.3f}% "
                  f"[{s['nll_delta_pct']['ci95'][0]:+.3f},{s['nll_delta_pct']['ci95'][1]:+.3f}] "
                  f"kl {s['kl']['estimate']:.2e} [{s['kl']['ci95'][0]:.2e},{s['kl']['ci95'][1]:.2e}]"
                  f" top1 {s['top1_agreement']['estimate']:.4f}", flush=True)
    if "retrieval" in parts:
        t = time.time()
        ga = argparse.Namespace(formats=names, retrieval_cases=a.retrieval_cases,
                                lengths=[int(x) for x in a.lengths.split(",") if x],
                                retrieval_chunk=a.retrieval_chunk, batch=a.batch, probes=0)
        tasks["retrieval"] = gate.run_retrieval_text(loaded, None, ga, make=make_runner)
        seconds["retrieval"] = round(time.time() - t, 1)
        for n in names:
            cell = tasks["retrieval"][n]["by_length"][str(ga.lengths[0])]
            d = cell["delta_points"]
            print(f"{n:16s} retrieval {cell['accuracy'] * 100:.1f} % of {cell['cases']} "
                  f"({d['estimate']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}])", flush=True)
    result = {"command": "python -m quality.key4_variants " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "model": a.model, "dtype": loaded.dtype_name, "windows": a.windows * 2,
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
