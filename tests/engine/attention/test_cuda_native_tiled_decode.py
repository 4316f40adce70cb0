"""The tiled native decode kernel (engine/attention/cuda/native_tiled_decode.py) on the CPU
emulator (bench/cuda_emulate_native_tiled.py: its CUDA source compiled by g++, one fiber per GPU
thread), its choice in KernelChoices, and the bench spec that selects it. The kernel itself runs
only on a CUDA GPU; `python -m bench.cuda_nvcc_check --only native-tiled` compiles it.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from bench import cuda_emulate_native_tiled as emu
from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.attention.cuda import native_tiled_decode as tiled
from engine.attention.cuda import paged_decode as pd

pytestmark = pytest.mark.gpu


def _check(tmp_path, seed, ends, hq, kvh, d, pt, own, min_keys=None, want_splits=None):
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    if want_splits is not None:
        assert pd.split_count(len(ends), kvh, max(ends), None, min_keys) == want_splits
    got = emu.case(np.random.default_rng(seed), ends, hq, kvh, d, pt, own, None, min_keys,
                   tmp_path)
    assert got["ok"], got


def test_own_key_is_attended_from_the_inputs_and_written_once(tmp_path):
    """OWN: the step's own key's page slot starts poisoned (1e4), so attending to the slot
    instead of kn / vn would be far off the reference; after the run the pages equal the input
    pages with exactly that slot of each row written. Rows: one long enough to split (its own
    key in the last split), one with a single key, one whose own key opens a page."""
    _check(tmp_path, 11, (600, 1, 33), 9, 3, 64, 16, True, want_splits=3)


def test_plain_variant_matches_the_reference_without_splits(tmp_path):
    """No own key, one split (the kernel writes the output itself), head dim 128, GQA 4,
    pages of 64 tokens spanning two 32-key tiles."""
    _check(tmp_path, 3, (97, 64), 8, 2, 128, 64, False, want_splits=1)


def test_many_splits_with_rows_shorter_than_a_split(tmp_path):
    """The Llama-3.1-8B shape (head dim 128, 32 query / 8 KV heads): five splits, so the
    5-key row leaves four splits empty (their partials are skipped by the merge kernel) and
    the 70-key row leaves two; pages of 32."""
    _check(tmp_path, 5, (300, 70, 5), 32, 8, 128, 32, True, min_keys=64, want_splits=5)


@pytest.mark.parametrize("group,d,pt", [(1, 128, 16), (8, 64, 64), (2, 64, 32)])
def test_groups_head_dims_and_page_sizes(tmp_path, group, d, pt):
    _check(tmp_path, group, (130, 3, 65), 2 * group, 2, d, pt, True, min_keys=32)


def test_supports_only_what_the_source_serves():
    assert tiled.supports(128, 4, tiled.mx.bfloat16)
    assert tiled.supports(64, 8, tiled.mx.bfloat16)
    assert not tiled.supports(96, 4, tiled.mx.bfloat16)
    assert not tiled.supports(128, 9, tiled.mx.bfloat16)
    assert not tiled.supports(128, 4, tiled.mx.float16)   # the walk kernel keeps float16


def test_native_decode_choice_defaults_to_tiled_and_rejects_unknown_kernels():
    assert DEFAULT_KERNELS.native_decode == "tiled"
    assert KernelChoices(native_decode="walk").native_decode == "walk"
    with pytest.raises(ValueError, match="native_decode must be one of"):
        KernelChoices(native_decode="bogus")


def test_bench_specs_select_the_native_decode_kernel():
    from bench.kv_decode import decode_kernels
    fmt, kernels = decode_kernels("native:walk", DEFAULT_KERNELS)
    assert fmt == "native" and kernels.native_decode == "walk"
    fmt, kernels = decode_kernels("native:tiled", DEFAULT_KERNELS)
    assert fmt == "native" and kernels.native_decode == "tiled"
    _, kernels = decode_kernels("native:tiled-64", DEFAULT_KERNELS)
    assert kernels.native_decode == "tiled" and kernels.decode_split_min_keys == 64
    fmt, kernels = decode_kernels("native", DEFAULT_KERNELS)
    assert fmt == "native" and kernels is DEFAULT_KERNELS


def test_nvcc_compiles_the_largest_variants():
    """The variants with the most shared memory and registers (group 8, OWN, split) compile
    with nvcc where one is installed; without it the check says so (exit 2)."""
    from bench import cuda_nvcc_check
    code = cuda_nvcc_check.main(["--only", "pt16 g8 split=True own=True"])
    assert code == (2 if shutil.which("nvcc") is None else 0)


def test_precompile_launches_both_split_modes_of_the_tiled_kernel(monkeypatch):
    """KernelChoices.native_decode "tiled": start-up compiles the tiled kernel's variants (one
    split and several) instead of the walk kernel's; CUDA cannot run here, so the launches are
    recorded by a stand-in."""
    from engine.attention.cuda import decode_precompile
    seen = []

    def fake_launch(kernel, inputs, template, rows, kv_heads, hq, head_dim, splits, dtype):
        seen.append((kernel, splits > 1, dict(template)["OWN"], len(inputs)))
        return tiled.mx.zeros((rows, hq, 1, head_dim), dtype)

    monkeypatch.setattr(tiled, "_kernel", lambda own: ("tiled", own))
    monkeypatch.setattr(tiled, "launch_split", fake_launch)
    bf = tiled.mx.bfloat16
    n = decode_precompile.precompile(4, 128, 16, bf, bf, own=True, tiled=True)
    assert n == 2 and sorted(seen) == [(("tiled", True), s, True, 9) for s in (False, True)]
