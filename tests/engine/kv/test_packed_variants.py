"""int4 variants: int4-sink (the first rows of every page also kept native, attention sinks)
and int4-k32 (keys quantized in groups of 32 channels).

Attention must read exactly what the store holds: dequantized codes everywhere except, for
int4-sink, each page's first `sink_rows` positions, which come from their native copy. The reference here runs
the same model over a plain native store filled with the packed store's own `gather()` rows, so
any wrong mask, offset or page in the sink path shows up as a logit difference.
"""
import mlx.core as mx
import numpy as np
import pytest

from capacity.format_names import format_from_identity, parse_identity
from capacity.formats import KVFormat, KVFormatError
from engine.checkpoint.format import restore_checkpoint, save_checkpoint
from engine.kv.store import KVStore, Slots
from engine.model.loader import LayerGeometry, ModelGeometry, load_model
from engine.runner.packed import PackedModelRunner
from engine.attention.layers import packed_layer_factory
from engine.kv.identity import layer_report
from engine.kv.packed_store import PackedLayerStore
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk

T = 16   # page tokens: several pages per sequence, each with its own sink rows


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return load_model(tiny_model_dirs["llama"])


VARIANTS = ("int4-sink", "int4-k32")


def _sink_store(loaded, pages=24, fmt="int4-sink"):
    return KVStore(loaded.geometry, pages, T, loaded.dtype,
                   layer_factory=packed_layer_factory(fmt))


def test_bytes_identity_and_refusals():
    fmt = KVFormat("int4-sink", 64, "bfloat16")
    # int4 codes + FP32 metadata (40 + 40 bytes per head) plus 4 native bf16 K and V rows a page.
    assert fmt.bytes_per_page(kv_heads=3, page_tokens=64) == 3 * (64 * 80 + 2 * 4 * 64 * 2)
    assert fmt.bytes_per_token(3, 64) == 3 * 96
    assert fmt.bytes_per_token(1, 64) / KVFormat("native", 64, "bfloat16").bytes_per_token(1) \
        == 0.375
    with pytest.raises(KVFormatError, match="page size"):   # sink rows are per page
        fmt.identity
    fmt = fmt.paged(T)
    assert fmt.identity == f"affine-v3-k4v4-g64x64-f32-h64-s1-n4bf16-p{T}"
    assert parse_identity(fmt.identity)["sink_rows"] == 4
    assert format_from_identity(fmt.identity, 64, "float32") == fmt   # the dtype is in the name
    assert KVFormat("int4", 64).identity != KVFormat("int4-sink", 64, page_tokens=T).identity
    k32 = KVFormat("int4-k32", 64, "bfloat16")
    # keys: 32 code bytes + 2 groups x 8 bytes of FP32 scale/offset; values as int4.
    assert (k32.k_row_bytes(), k32.v_row_bytes(), k32.bytes_per_token(1)) == (48, 40, 88)
    assert k32.identity == "affine-v2-k4v4-g32x64-f32-h64-s1-n0"
    assert format_from_identity(k32.identity, 64) == KVFormat("int4-k32", 64)
    assert not k32.codes_only and not fmt.codes_only and KVFormat("int4", 64).codes_only
    for bad in ("affine-v2-k4v4-g64x64-f32-h64-s1-n0bf16", "affine-v2-k4v4-g64x64-f32-h64-s1-n4",
                "affine-v2-k4v4-g64x64-f32-h64-s1-n8bf16", "affine-v1-k4v4-g64-f32-h64-s1-n4bf16",
                "affine-v2-k4v4-g64x64-f32-h64-s1-n0", "affine-v2-k8v8-g32x64-f32-h64-s1-n0",
                "affine-v2-k4v4-g16x64-f32-h64-s1-n0"):
        with pytest.raises(KVFormatError):
            parse_identity(bad)
    with pytest.raises(KVFormatError):
        fmt.bytes_per_page(1, page_tokens=2)
    geom = LayerGeometry(0, "full", 2, 64, 64)
    with pytest.raises(KVFormatError):
        PackedLayerStore(geom, KVFormat("int4-sink", 64), num_pages=2, page_tokens=2)


def test_store_bytes_and_native_sink_rows():
    geom = ModelGeometry(layers=(LayerGeometry(0, "full", 2, 64, 64),), vocab_size=10)
    store = KVStore(geom, num_pages=4, page_tokens=T, layer_factory=packed_layer_factory("int4-sink"))
    assert store.bytes_per_token == KVFormat("int4-sink", 64).bytes_per_token(2, T)
    assert layer_report(store)[0]["storage"] == f"affine-v3-k4v4-g64x64-f32-h64-s1-n4f32-p{T}"
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((2 * T, 2, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((2 * T, 2, 64)).astype(np.float32))
    store.write(0, np.r_[np.arange(T, 2 * T), np.arange(3 * T, 4 * T)], k, v)   # pages 1 and 3
    gk, gv = store.gather(0, [[1, 3]])
    want_k, want_v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    for p in (0, 1):   # the first 4 rows of each page are exact, the rest are int4
        rows = slice(p * T, p * T + 4)
        assert mx.array_equal(gk[0, :, rows], want_k[:, rows]).item()
        assert mx.array_equal(gv[0, :, rows], want_v[:, rows]).item()
        rest = slice(p * T + 4, (p + 1) * T)
        err = mx.abs(gk[0, :, rest] - want_k[:, rest]).max().item()
        assert 1e-4 < err < 0.5


def _gathered_native(loaded, packed: KVStore, table):
    """A native store holding exactly what `packed` gives attention for these pages."""
    native = KVStore(loaded.geometry, packed.num_pages, T, loaded.dtype)
    flat = np.asarray([p * T + o for p in table for o in range(T)])
    for i, store in packed.layers.items():
        k, v = store.gather(mx.array([table], dtype=mx.int32))
        if getattr(store, "packed", False):
            native.write(i, flat, k[0].swapaxes(0, 1), v[0].swapaxes(0, 1))
    return native


@pytest.mark.parametrize("fmt", VARIANTS)
@pytest.mark.parametrize("cut", [3, 20, 37])
def test_attention_reads_what_the_store_holds(llama, cut, fmt):
    """Prefill `cut` tokens, then one more chunk: the variant's logits equal a native runner's
    over the packed store's own rows (before the first page's 4 rows are written, on one page,
    and across pages), and so for a decode step (quantized_matmul / code GEMM on the CPU)."""
    seq = list(range(5, 5 + 48))
    table = [2, 7, 4, 9]
    runner = PackedModelRunner(llama, _sink_store(llama, fmt=fmt))
    runner.forward([Chunk(0, seq[:cut], 0, table)])
    mx.eval(runner.kvstore.arrays())
    ref_store = _gathered_native(llama, runner.kvstore, table)
    ref = ModelRunner(llama, ref_store)
    got = runner.forward_all([Chunk(0, seq[cut:cut + 9], cut, table)])[0]
    want = ref.forward_all([Chunk(0, seq[cut:cut + 9], cut, table)])[0]
    assert mx.abs(got - want).max().item() < 2e-4
    # A decode step too (one query, qmm path on the CPU).
    got = runner.forward([Chunk(0, [seq[cut + 9]], cut + 9, table)])
    mx.eval(runner.kvstore.arrays())
    ref_store = _gathered_native(llama, runner.kvstore, table)
    want = ModelRunner(llama, ref_store).forward([Chunk(0, [seq[cut + 9]], cut + 9, table)])
    assert mx.abs(got - want).max().item() < 2e-4


@pytest.mark.parametrize("fmt", VARIANTS)
def test_ragged_batch_equals_each_sequence_alone(llama, fmt):
    seqs = [list(range(3, 40)), list(range(50, 60)), list(range(7, 30))]
    cuts = [21, 2, 17]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    batch = PackedModelRunner(llama, _sink_store(llama, fmt=fmt))
    batch.forward([Chunk(i, s[:c], 0, tables[i]) for i, (s, c) in enumerate(zip(seqs, cuts))])
    got = batch.forward([Chunk(i, s[c:], c, tables[i]) for i, (s, c) in enumerate(zip(seqs, cuts))])
    for i, (s, c) in enumerate(zip(seqs, cuts)):
        alone = PackedModelRunner(llama, _sink_store(llama, fmt=fmt))
        alone.forward([Chunk(0, s[:c], 0, tables[i])])
        want = alone.forward([Chunk(0, s[c:], c, tables[i])])
        assert mx.abs(got[i] - want[0]).max().item() < 1e-4


def test_variants_change_the_answer_from_plain_int4(llama):
    """Each variant's own path is really taken: its logits differ from int4's after a page."""
    seq = list(range(5, 45))
    out = {}
    for fmt in ("int4", *VARIANTS):
        store = KVStore(llama.geometry, 8, T, llama.dtype, layer_factory=packed_layer_factory(fmt))
        r = PackedModelRunner(llama, store)
        r.forward([Chunk(0, seq[:32], 0, [0, 1, 2])])
        out[fmt] = r.forward([Chunk(0, seq[32:], 32, [0, 1, 2])])
    for fmt in VARIANTS:
        assert mx.abs(out["int4"] - out[fmt]).max().item() > 1e-4


@pytest.mark.parametrize("fmt", VARIANTS)
def test_checkpoint_round_trip_is_exact(llama, tmp_path, fmt):
    seq = list(range(5, 42))
    table = [3, 5, 1]
    src = PackedModelRunner(llama, _sink_store(llama, fmt=fmt))
    src.forward([Chunk(0, seq[:-1], 0, table)])
    mx.eval(src.kvstore.arrays())
    save_checkpoint(tmp_path, src.kvstore, table, seq[:-1], model_fingerprint="fp")
    dst = PackedModelRunner(llama, _sink_store(llama, fmt=fmt))
    new_table, n = restore_checkpoint(tmp_path, dst.kvstore, seq, model_fingerprint="fp",
                                      allocate=lambda k: [7, 8, 9][:k])
    assert n == len(seq) - 1
    slots_src = Slots.from_flat(np.array([table[i // T] * T + i % T for i in range(n)]), T)
    slots_dst = Slots.from_flat(np.array([new_table[i // T] * T + i % T for i in range(n)]), T)
    for i, store in src.kvstore.layers.items():
        pairs = [(store.read_packed(slots_src), dst.kvstore.layers[i].read_packed(slots_dst))]
        if fmt == "int4-sink":
            a, b = store.read_sinks(slots_src), dst.kvstore.layers[i].read_sinks(slots_dst)
            assert a[0].shape[0] == 12   # positions 0-3, 16-19, 32-35
            pairs.append((a, b))
        for a, b in pairs:
            assert all(mx.array_equal(x, y).item() for x, y in zip(_flat(a), _flat(b)))
    want = src.forward([Chunk(0, seq[-1:], n, table)])
    got = dst.forward([Chunk(0, seq[-1:], n, new_table)])
    assert mx.array_equal(got, want).item()


def _flat(rows):
    return [a for part in rows for a in (part if isinstance(part, tuple) else (part,))]
