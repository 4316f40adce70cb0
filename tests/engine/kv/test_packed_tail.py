"""int4-tail: int4 codes for full pages, each sequence's partial last page read from a native copy.

Attention must read exactly what the store holds: dequantized codes for every full page and the
native rows of the page a sequence is still filling (as the step began). The reference runs the
same model over a plain native store filled with the packed store's own `gather()` rows (which
puts the native tail where the codes were), so a wrong mask, slot or page shows up in the logits.
"""
import mlx.core as mx
import numpy as np
import pytest

from capacity.format_names import format_from_identity, parse_identity
from capacity.formats import KVFormat, KVFormatError
from engine.attention.packed_cache import PackedLayerCache
from engine.attention.layers import packed_layer_factory
from engine.kv.identity import layer_report
from engine.kv.packed_store import PackedLayerStore
from engine.checkpoint.format import restore_checkpoint, save_checkpoint
from engine.kv.pages import PagePool
from engine.kv.prefix import PrefixCache, chain_root
from engine.kv.store import KVStore, Slots
from engine.kv.tails import TailMap
from engine.model.loader import LayerGeometry, ModelGeometry
from engine.runner.packed import PackedModelRunner
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk
from tests.engine.kv.tail_helpers import T, gathered_native, llama, tail_store  # noqa: F401 (fixture)

FMT = "int4-tail"


def _store(loaded, pages=24, slots=4, fmt=FMT):
    return tail_store(loaded, fmt, pages, slots)


def test_identity_bytes_and_refusals():
    fmt = KVFormat(FMT, 64, "bfloat16", 64)
    assert fmt.identity == "affine-v3-k4v4-g64x64-f32-h64-s1-n0-tbf16-p64"
    assert parse_identity(fmt.identity)["native_tail"] is True
    assert format_from_identity(fmt.identity, 64, "float32") == fmt   # the dtype is in the name
    # full pages cost int4's bytes exactly; the tail page is priced per running sequence
    assert fmt.bytes_per_token(3, 64) == KVFormat("int4", 64).bytes_per_token(3, 64) == 3 * 80
    assert fmt.tail_bytes_per_request(3, 64) == 3 * 64 * 2 * 64 * 2
    assert KVFormat("int4-tail", 64, "float32").tail_bytes_per_request(1, 16) == 16 * 2 * 64 * 4
    assert not fmt.codes_only and fmt.native_tail and not KVFormat("int4", 64).native_tail
    both = KVFormat("int4-k32-tail", 64, "bfloat16", 16)
    assert both.identity == "affine-v3-k4v4-g32x64-f32-h64-s1-n0-tbf16-p16"
    assert format_from_identity(both.identity, 64, "float32") == both
    assert both.bytes_per_token(1, 64) == 88 and both.tail_bytes_per_request(1, 64) == 16384
    for name in ("native", "int8", "k8v4", "int4", "int4-k32", "int4-sink"):   # unchanged
        assert KVFormat(name, 64).tail_bytes_per_request(3, 64) == 0
    for bad in ("affine-v2-k4v4-g64x64-f32-h64-s1-n0-t", "affine-v2-k4v4-g64x64-f32-h64-s1-tbf16",
                "affine-v2-k4v4-g64x64-f32-h64-s1-n4f32-tbf16",
                "affine-v2-k8v8-g64x64-f32-h64-s1-n0-tf32",
                "affine-v1-k4v4-g64-f32-h64-s1-tf32"):
        with pytest.raises(KVFormatError):
            parse_identity(bad)
    geom = LayerGeometry(0, "full", 2, 64, 64)
    with pytest.raises(KVFormatError, match="tail_slots"):   # no pool sized by concurrency
        PackedLayerStore(geom, KVFormat(FMT, 64), num_pages=2, page_tokens=T)
    with pytest.raises(KVFormatError, match="at least one tail slot"):
        KVStore(ModelGeometry(layers=(geom,), vocab_size=10), 2, T,
                layer_factory=packed_layer_factory(FMT))
    with pytest.raises(KVFormatError, match="pages of 16"):
        PackedLayerStore(geom, KVFormat(FMT, 64), num_pages=2, page_tokens=32,
                         tails=TailMap(2, T))
    with pytest.raises(KVFormatError, match="head_dim"):
        KVFormat(FMT, 80)


def test_store_bytes_match_the_format_and_pages_go_native_until_full():
    geom = ModelGeometry(layers=(LayerGeometry(0, "full", 2, 64, 64),
                                 LayerGeometry(1, "full", 2, 64, 64)), vocab_size=10)
    store = KVStore(geom, num_pages=4, page_tokens=T,
                    layer_factory=packed_layer_factory(FMT, tail_slots=3))
    fmt = KVFormat(FMT, 64)   # float32 store
    assert store.bytes_per_token == 2 * fmt.bytes_per_token(2, T)
    assert store.tail_bytes_per_sequence == 2 * fmt.tail_bytes_per_request(2, T)
    assert store.nbytes == 4 * store.page_bytes + 3 * store.tail_bytes_per_sequence
    assert layer_report(store)[0]["storage"] == f"affine-v3-k4v4-g64x64-f32-h64-s1-n0-tf32-p{T}"
    # never the CUDA kernels: they read the v1 layout only
    assert not store.layers[0].fmt.codes_only
    assert not PackedLayerCache.kernel_decode_fits(store.layers[0])
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((T + 5, 2, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((T + 5, 2, 64)).astype(np.float32))
    tails = store.layers[0].tails
    for layer in (0, 1):   # page 2 fills, page 0 keeps 5 rows: only page 0 takes a slot
        store.write(layer, np.r_[np.arange(2 * T, 3 * T), np.arange(0, 5)], k, v)
    assert tails.slot_of == {0: 0}
    gk, gv = store.gather(0, [[2, 0]])
    want_k, want_v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    assert mx.array_equal(gk[0, :, T:T + 5], want_k[:, T:]).item()   # the tail: native, exact
    assert mx.array_equal(gv[0, :, T:T + 5], want_v[:, T:]).item()
    err = mx.abs(gk[0, :, :T] - want_k[:, :T]).max().item()
    assert 1e-4 < err < 0.5                                          # the full page: int4
    # The tail page fills: its slot is given back and it reads as codes, like any full page.
    more = mx.array(rng.standard_normal((T - 5, 2, 64)).astype(np.float32))
    for layer in (0, 1):
        store.write(layer, np.arange(5, T), more, more)
    assert tails.slot_of == {}
    gk, _ = store.gather(0, [[0]])
    assert 1e-4 < mx.abs(gk[0, :, :5] - want_k[:, T:]).max().item() < 0.5
    # A freed partial page gives its slot back; an exhausted pool refuses loudly.
    for layer in (0, 1):
        store.write(layer, np.arange(3 * T, 3 * T + 2), k[:2], v[:2])
    assert tails.used == 1
    store.release_pages([3])
    assert tails.used == 0
    with pytest.raises(KVFormatError, match="exhausted"):
        store.write(0, np.array([0, T, 2 * T, 3 * T]), k[:4], v[:4])


@pytest.mark.parametrize("fmt", [FMT, "int4-k32-tail", "int4-kivi", "k6v4-kivi"])
@pytest.mark.parametrize("cut", [3, 16, 20, 37])
def test_attention_equals_dequantize_then_attend(llama, cut, fmt):
    """Prefill `cut` tokens, then a chunk that crosses a page boundary, then a decode step: the
    logits equal a native runner's over the packed store's own rows (codes for full pages, the
    native tail for the partial one; int4-kivi / k6v4-kivi: page keys quantized on fill)."""
    seq = list(range(5, 5 + 48))
    table = [2, 7, 4, 9]
    runner = PackedModelRunner(llama, _store(llama, fmt=fmt))
    runner.forward([Chunk(0, seq[:cut], 0, table)])
    mx.eval(runner.kvstore.arrays())
    ref = ModelRunner(llama, gathered_native(llama, runner.kvstore, table))
    got = runner.forward_all([Chunk(0, seq[cut:cut + 9], cut, table)])[0]
    want = ref.forward_all([Chunk(0, seq[cut:cut + 9], cut, table)])[0]
    assert mx.abs(got - want).max().item() < 2e-4
    mx.eval(runner.kvstore.arrays())
    ref = ModelRunner(llama, gathered_native(llama, runner.kvstore, table))
    n = cut + 9
    got = runner.forward([Chunk(0, [seq[n]], n, table)])
    want = ref.forward([Chunk(0, [seq[n]], n, table)])
    assert mx.abs(got - want).max().item() < 2e-4


def test_decode_across_a_page_boundary_equals_the_reference(llama):
    """Decode token by token over a page boundary: the page that fills is read native in the
    step that fills it (it was the tail when the step began) and as codes afterwards."""
    seq = list(range(9, 9 + 24))
    table = [5, 1]
    runner = PackedModelRunner(llama, _store(llama))
    runner.forward([Chunk(0, seq[:T - 2], 0, table)])
    for n in range(T - 2, T + 3):
        mx.eval(runner.kvstore.arrays())
        ref = ModelRunner(llama, gathered_native(llama, runner.kvstore, table))
        got = runner.forward([Chunk(0, [seq[n]], n, table)])
        want = ref.forward([Chunk(0, [seq[n]], n, table)])
        assert mx.abs(got - want).max().item() < 2e-4, n


@pytest.mark.parametrize("fmt", [FMT, "int4-kivi"])
def test_ragged_batch_equals_each_sequence_alone(llama, fmt):
    seqs = [list(range(3, 40)), list(range(50, 60)), list(range(7, 30)), list(range(1, 40))]
    cuts = [21, 2, 16, 33]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    batch = PackedModelRunner(llama, _store(llama, fmt=fmt))
    batch.forward([Chunk(i, s[:c], 0, tables[i]) for i, (s, c) in enumerate(zip(seqs, cuts))])
    got = batch.forward([Chunk(i, s[c:], c, tables[i]) for i, (s, c) in enumerate(zip(seqs, cuts))])
    for i, (s, c) in enumerate(zip(seqs, cuts)):
        alone = PackedModelRunner(llama, _store(llama, slots=1, fmt=fmt))
        alone.forward([Chunk(0, s[:c], 0, tables[i])])
        want = alone.forward([Chunk(0, s[c:], c, tables[i])])
        assert mx.abs(got[i] - want[0]).max().item() < 1e-4


def test_the_native_tail_changes_the_answer_from_plain_int4(llama):
    seq = list(range(5, 45))
    out = {}
    for fmt, kw in (("int4", {}), (FMT, {"tail_slots": 1})):
        store = KVStore(llama.geometry, 8, T, llama.dtype, layer_factory=packed_layer_factory(fmt, **kw))
        r = PackedModelRunner(llama, store)
        r.forward([Chunk(0, seq[:28], 0, [0, 1, 2])])
        out[fmt] = r.forward([Chunk(0, seq[28:], 28, [0, 1, 2])])
    assert mx.abs(out["int4"] - out[FMT]).max().item() > 1e-4


@pytest.mark.parametrize("fmt", [FMT, "int4-kivi", "k6v4-kivi"])
@pytest.mark.parametrize("n_tokens", [37, 32])
def test_checkpoint_round_trip_is_exact(llama, tmp_path, n_tokens, fmt):
    """Save mid-page or on a page boundary, restore into other pages: the rows are verbatim,
    the partial page comes back native, and decoding on past the restored tail's page boundary
    gives the source's logits at every step (page keys: the page fills from the restored tail)."""
    seq = list(range(5, 5 + n_tokens + 1))
    table = [3, 5, 1]
    src = PackedModelRunner(llama, _store(llama, fmt=fmt))
    src.forward([Chunk(0, seq[:-1], 0, table)])
    mx.eval(src.kvstore.arrays())
    manifest = save_checkpoint(tmp_path, src.kvstore, table, seq[:-1], model_fingerprint="fp")
    assert ("layer0.ktail" in manifest["tensors"]) == bool(n_tokens % T)
    dst = PackedModelRunner(llama, _store(llama, fmt=fmt))
    new_table, n = restore_checkpoint(tmp_path, dst.kvstore, seq, model_fingerprint="fp",
                                      allocate=lambda k: [7, 8, 9][:k])
    assert n == n_tokens
    slots_src = Slots.from_flat(np.array([table[i // T] * T + i % T for i in range(n)]), T)
    slots_dst = Slots.from_flat(np.array([new_table[i // T] * T + i % T for i in range(n)]), T)
    for i, store in src.kvstore.layers.items():
        other = dst.kvstore.layers[i]
        a, b = store.read_packed(slots_src), other.read_packed(slots_dst)
        assert all(mx.array_equal(x, y).item() for p, q in zip(a, b) for x, y in zip(p, q))
        if store.fmt.page_keys:   # a partial page's key rows carry no codes (zeros), only its tail
            assert not np.array(a[0].codes[n // T * T:]).any()
        a, b = store.read_tail(slots_src), other.read_tail(slots_dst)
        assert a[0].shape[0] == n % T
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))
    if len(new_table) * T == n:   # the next token starts a page
        new_table = new_table + [10]
    table, new_table = table + [11], new_table + [12]
    for j, tok in enumerate(seq[-1:] + list(range(60, 60 + T))):
        want = src.forward([Chunk(0, [tok], n + j, table)])
        got = dst.forward([Chunk(0, [tok], n + j, new_table)])
        assert mx.array_equal(got, want).item(), j


@pytest.mark.parametrize("fmt", [FMT, "int4-kivi"])
def test_prefix_reuse_shares_full_pages_only(llama, fmt):
    """A second request reusing the first one's full pages (codes; int4-kivi: page-key codes
    written on fill) computes what a request prefilled alone computes; the first request's
    partial page never enters the cache."""
    prompt = list(range(4, 4 + 2 * T + 5))
    store = _store(llama, pages=16, fmt=fmt)
    pool = PagePool(16, T, on_free=store.release_pages)   # as the engine wires it
    cache = PrefixCache(pool)
    root = chain_root("s", "fp", "t", T)
    runner = PackedModelRunner(llama, store)
    first = pool.allocate(3)
    runner.forward([Chunk(0, prompt, 0, first)])
    mx.eval(store.arrays())
    assert cache.insert(root, prompt, first) == 2   # two full pages; the tail page is not cached
    pool.free(first)
    assert store.layers[0].tails.used == 0
    hit = cache.lookup(root, prompt)
    assert hit == first[:2]
    table = hit + pool.allocate(1)
    got = runner.forward([Chunk(0, prompt[2 * T:], 2 * T, table)])
    alone = PackedModelRunner(llama, _store(llama, fmt=fmt))
    alone.forward([Chunk(0, prompt[:2 * T], 0, [0, 1, 2])])
    want = alone.forward([Chunk(0, prompt[2 * T:], 2 * T, [0, 1, 2])])
    assert mx.abs(got - want).max().item() < 1e-5
