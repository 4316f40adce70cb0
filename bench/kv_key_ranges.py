"""Which key channels carry 4-bit page-key error on a model (issue 32 item 5).

    python -m bench.kv_key_ranges --model models/smollm2-135m --out OUT/key-ranges.json

Prefills a few held-out text windows (the gate's, quality.data.text_windows) through the paged
runner with a native store whose attention records, per full-attention layer and KV head, over
every complete 64-token page of stored keys (post-RoPE, as stored):
- each channel's range over the page (what int4-kivi's per-channel page scale covers: its 4-bit
  step is range / 15), averaged over pages;
- each channel's mean |query| over the query heads of its group (what multiplies the key error
  in a score);
- the score error each channel contributes under int4 page keys: mean |q_c| * mean |k_c - k4_c|,
  and its share of the head's total (the top 4 / top 8 channels' share);
- how stable the widest channels are: the share of pages whose 4 widest channels are all among
  the head's 8 widest on average (high = a static per-head list would do);
- the RMS error of attention scores q.k / sqrt(d) under int4 page keys quantized after RoPE (as
  int4-kivi stores them) and before RoPE (rotated back to position 0 first: KVQuant's pre-RoPE
  keys, quality.key4_variants' `pre_rope`), and the mean per-channel range before RoPE.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from engine.attention.layers import register_cache
from engine.attention.paged import PagedLayerCache
from engine.kv.store import KVStore, NativeLayerStore
from quality.key4_variants import rope_rotate
from quality.variants import fake_quant


class RecordingStore(NativeLayerStore):
    def __init__(self, geometry, num_pages, page_tokens, dtype, layer: int, sink: dict,
                 rope_base: float):
        super().__init__(geometry, num_pages, page_tokens, dtype)
        self.layer, self.sink, self.rope_base = layer, sink, rope_base


class RecordingCache(PagedLayerCache):
    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        self.step.attended += 1
        k, v = self.store.gather(self.view.pages)            # [B, H, P*T, D]
        t = self.step.page_tokens
        ends = self.step.starts + np.asarray(self.step.lengths)   # rows stored after this step
        full = int(ends.min()) // t                          # pages complete in every row
        if full:
            b, h, _, d = k.shape
            kp = k[:, :, :full * t].astype(mx.float32).reshape(b, h, full, t, d)
            rng = kp.max(axis=3) - kp.min(axis=3)                          # [B, H, P, D]
            k4 = fake_quant(kp.swapaxes(-1, -2), 4, t).swapaxes(-1, -2)
            err = mx.abs(k4 - kp).mean(axis=3)                             # [B, H, P, D]
            hq = queries.shape[1]
            q = mx.abs(queries.astype(mx.float32)).reshape(b, h, hq // h, -1, d).mean(axis=(2, 3))
            # Pre-RoPE: rows rotated back to position 0, quantized per channel over the page,
            # rotated forward again.
            pos = mx.array((self.view.base[:, None] + np.arange(full * t)[None, :]).astype(np.int32))
            kflat = kp.reshape(b, h, full * t, d)
            pre = rope_rotate(kflat, pos, self.store.rope_base, inverse=True)
            prep = pre.reshape(b, h, full, t, d)
            pre_rng = prep.max(axis=3) - prep.min(axis=3)
            k4pre = rope_rotate(fake_quant(prep.swapaxes(-1, -2), 4, t).swapaxes(-1, -2)
                                .reshape(b, h, full * t, d), pos, self.store.rope_base)
            qg = queries.astype(mx.float32).reshape(b, h, hq // h * queries.shape[2], d)
            rms = lambda dk: mx.sqrt(mx.mean(mx.square(qg @ dk.swapaxes(-1, -2)),   # noqa: E731
                                             axis=(0, 2, 3)) / d)
            post_err = rms(k4.reshape(b, h, full * t, d) - kflat)
            pre_err = rms(k4pre - kflat)
            mx.eval(rng, err, q, pre_rng, post_err, pre_err)
            rec = self.store.sink.setdefault(self.store.layer, {"rng": [], "err": [], "q": []})
            rec["pre_rng"] = np.array(pre_rng).transpose(1, 0, 2, 3).reshape(h, -1, d)
            rec["score_rms_post"], rec["score_rms_pre"] = np.array(post_err), np.array(pre_err)
            rec["rng"].append(np.array(rng).transpose(1, 0, 2, 3).reshape(h, -1, d))
            rec["err"].append(np.array(err).transpose(1, 0, 2, 3).reshape(h, -1, d))
            rec["q"].append(np.array(q))                                    # [B, H, D]
        return mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask=self.step.page_mask(self.view), sinks=sinks)


register_cache(RecordingStore, RecordingCache)


def measure(loaded, wins, chunk: int, sink: dict) -> None:
    from engine.runner.packed import PackedModelRunner
    from engine.sched.seq import Chunk
    from quality.runs import PAGE_TOKENS, _tables
    counter = iter(range(10**6))
    base = float(loaded.model.layers[0].self_attn.rope.base)

    def factory(g, pages, tokens, dtype):
        if g.kind != "full":
            return NativeLayerStore(g, pages, tokens, dtype)
        return RecordingStore(g, pages, tokens, dtype, next(counter), sink, base)

    group = np.stack(wins).astype(np.int32)
    n, length = group.shape
    num_pages, tables = _tables(n, length)
    runner = PackedModelRunner(loaded, KVStore(loaded.geometry, num_pages, PAGE_TOKENS,
                                               loaded.dtype, layer_factory=factory))
    for s in range(0, length, chunk):
        e = min(s + chunk, length)
        mx.eval(runner.forward_all([Chunk(i, group[i, s:e].tolist(), s, tables[i])
                                    for i in range(n)]))


def summarize(sink: dict, top: int = 8) -> dict:
    layers = {}
    for layer in sorted(sink):
        rec = sink[layer]
        # The last chunk's record sees every page of the window: use it for ranges and errors;
        # queries: mean over every chunk's.
        rng, err = rec["rng"][-1], rec["err"][-1]                 # [H, pages, D]
        q = np.concatenate(rec["q"]).mean(axis=0)                  # [H, D]
        heads = []
        for hh in range(rng.shape[0]):
            r, e = rng[hh].mean(axis=0), err[hh].mean(axis=0)
            contrib = q[hh] * e
            order = np.argsort(-contrib)
            share = contrib[order] / contrib.sum()
            wide_order = np.argsort(-r)
            static8 = set(wide_order[:8].tolist())
            per_page_top4 = np.argsort(-rng[hh], axis=-1)[:, :4]
            stable = float(np.mean([set(p.tolist()) <= static8 for p in per_page_top4]))
            heads.append({
                "range_max_over_median": float(r.max() / np.median(r)),
                "widest_channels": wide_order[:top].tolist(),
                "widest_ranges": [round(float(x), 3) for x in r[wide_order[:top]]],
                "median_range": round(float(np.median(r)), 3),
                "error_channels": order[:top].tolist(),
                "error_share_top4": round(float(share[:4].sum()), 3),
                "error_share_top8": round(float(share[:8].sum()), 3),
                "error_share_top16": round(float(share[:16].sum()), 3),
                "widest8_error_share": round(float(contrib[wide_order[:8]].sum() / contrib.sum()), 3),
                "page_top4_within_static8": round(stable, 3),
                "score_error": float(contrib.sum()),
                "median_range_pre_rope": round(float(np.median(rec["pre_rng"][hh].mean(axis=0))), 3),
                "mean_range_post_over_pre": round(float(r.mean() / rec["pre_rng"][hh].mean()), 3),
                "score_rms_int4_post_rope": round(float(rec["score_rms_post"][hh]), 4),
                "score_rms_int4_pre_rope": round(float(rec["score_rms_pre"][hh]), 4),
            })
        layers[layer] = heads
    return layers


def main(argv=None) -> int:
    from engine.model.loader import load_model
    from quality.data import text_windows
    ap = argparse.ArgumentParser(prog="python -m bench.kv_key_ranges", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--windows", type=int, default=2, help="windows per corpus (code, chat)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    loaded = load_model(a.model)
    wins = text_windows(loaded.tokenizer, a.windows, a.window)
    sink: dict = {}
    measure(loaded, wins, a.chunk, sink)
    layers = summarize(sink)
    for layer, heads in layers.items():
        print(f"layer {layer:2d} " + " | ".join(
            f"h{i} max/med {hd['range_max_over_median']:5.1f} err top4 {hd['error_share_top4']:.2f} "
            f"top8 {hd['error_share_top8']:.2f} wide8 {hd['widest8_error_share']:.2f} "
            f"stable {hd['page_top4_within_static8']:.2f} rng post/pre "
            f"{hd['mean_range_post_over_pre']:.2f} score rms post {hd['score_rms_int4_post_rope']:.3f}"
            f" pre {hd['score_rms_int4_pre_rope']:.3f}"
            for i, hd in enumerate(heads)), flush=True)
    result = {"command": "python -m bench.kv_key_ranges " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "model": a.model, "dtype": loaded.dtype_name, "windows": len(wins),
              "window": a.window, "seconds": round(time.time() - t0, 1),
              "layers": {str(k): v for k, v in layers.items()}}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    from engine.platform import ensure_openblas_preloaded
    ensure_openblas_preloaded()
    raise SystemExit(main())
