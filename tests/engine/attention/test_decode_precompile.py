"""The native decode kernel variants compiled at start-up cover every launch a step can make
(engine/attention/cuda/decode_precompile.py). The kernels run on CUDA only; the coverage is host
arithmetic, checked here against the launch choices `paged_decode_attention` makes."""
from __future__ import annotations

import itertools

import mlx.core as mx

from engine.attention.cuda import decode_precompile
from engine.attention.cuda.paged_decode import launch_warps, split_count


def test_the_variants_cover_every_launch_a_step_can_make():
    for group, head_dim, asked in itertools.product((1, 4, 8), (64, 128), (None, 8, 16)):
        variants = set(decode_precompile.launch_variants(group, head_dim, asked))
        for rows, kv_heads in itertools.product((1, 2, 3, 8, 12, 32, 64), (1, 2, 8)):
            for longest in (1, 255, 256, 257, 511, 1024, 4096, 32768):
                splits = split_count(rows, kv_heads, longest)
                for warps_asked in (asked, None):   # compiled traces ask; the eager path not
                    warps = launch_warps(warps_asked, rows * kv_heads * splits, group, head_dim)
                    assert (warps, splits > 1) in variants, (group, head_dim, asked, rows,
                                                             kv_heads, longest)


def test_precompile_launches_each_variant_once(monkeypatch):
    """CUDA cannot run here: the kernel and the launch are recorded (a stand-in), to check
    that each variant is launched with its own warp count and split choice."""
    seen = []

    def fake_launch(kernel, inputs, template, rows, kv_heads, hq, head_dim, splits, dtype,
                    threads):
        seen.append((kernel, splits > 1, threads, dict(template)["OWN"]))
        return mx.zeros((rows, hq, 1, head_dim), dtype)

    monkeypatch.setattr(decode_precompile, "_native_kernel", lambda own, warps: ("k", own, warps))
    monkeypatch.setattr(decode_precompile, "launch_split", fake_launch)
    n = decode_precompile.precompile(4, 128, 64, mx.bfloat16, mx.bfloat16, own=True)
    want = decode_precompile.launch_variants(4, 128, None)
    assert n == len(want) == len(seen)
    assert sorted(seen) == sorted((("k", True, w), split, 32 * w, True) for w, split in want)
