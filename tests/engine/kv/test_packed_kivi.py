"""int4-kivi: keys per channel over each full page (quantized when the page fills, from its native
tail), values per token as int4, each sequence's partial last page read native.

As for int4-tail (test_packed_tail.py), the reference is a native runner over the packed store's
own `gather()` rows (page-key codes for full pages, the native tail for the partial one), so a
wrong mask, slot, page or metadata layout shows up in the logits.
"""
import mlx.core as mx
import numpy as np
import pytest

from capacity.format_names import format_from_identity, parse_identity, with_page_size
from capacity.formats import KVFormat, KVFormatError
from engine.attention.choices import KernelChoices
from engine.attention.cuda import page_key_decode as cuda_page_key_decode
from engine.attention.packed_cache import PackedLayerCache
from engine.attention.layers import packed_layer_factory
from engine.kv.identity import layer_report
from engine.kv.page_key_store import PageKeyStore
from engine.kv.page_quant import dequantize_pages, PagePacked, quantize_pages
from engine.kv.store import KVStore, Slots
from engine.kv.tails import TailMap
from engine.model.loader import LayerGeometry, ModelGeometry
from engine.runner.packed import PackedModelRunner
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk
from tests.engine.kv.tail_helpers import T, gathered_native, llama, tail_store  # noqa: F401 (fixture)

FMT = "int4-kivi"
FORMATS = [FMT, "k6v4-kivi"]   # 4-bit and 6-bit page keys


def _store(loaded, pages=24, slots=4, fmt=FMT):
    return tail_store(loaded, fmt, pages, slots)


def _geom(layers=2):
    return ModelGeometry(layers=tuple(LayerGeometry(i, "full", 2, 64, 64) for i in range(layers)),
                         vocab_size=10)


def test_identity_bytes_and_refusals():
    fmt = KVFormat(FMT, 64, "bfloat16", page_tokens=16)
    assert fmt.identity == "affine-v3-k4v4-gcx64-f32-h0-s0-n0-tbf16-p16"
    # The page size changes page keys' bytes, so it is in the name (identity v3), and an
    # identity from before (v2, no page size) is refused where state is rebuilt from it.
    assert KVFormat(FMT, 64, "bfloat16", page_tokens=64).identity.endswith("-p64")
    with pytest.raises(KVFormatError, match="page size"):
        KVFormat(FMT, 64, "bfloat16").identity
    with pytest.raises(KVFormatError, match="page size"):
        format_from_identity("affine-v2-k4v4-gcx64-f32-h0-s0-n0-tbf16", 64)
    assert (with_page_size("affine-v2-k4v4-gcx64-f32-h0-s0-n0-tbf16", 16) == fmt.identity
            and parse_identity("affine-v2-k4v4-gcx64-f32-h0-s0-n0-tbf16")["name"] == FMT)
    parsed = parse_identity(fmt.identity)
    assert parsed["native_tail"] is True and parsed["k_group"] == 0
    assert parsed["rotation_block"] == 0 and parsed["seed"] == 0
    assert format_from_identity(fmt.identity, 64, "float32") == fmt
    assert fmt.page_keys and not fmt.rotated and fmt.rotation_block is None and not fmt.codes_only
    # 64-token pages: codes 32 B + per page 64 channels x (scale, offset) x 4 B = 8 B per token,
    # exactly int4's 80 B per token per head; the tail page is priced per running sequence.
    assert fmt.k_row_bytes(64) == 40 and fmt.bytes_per_token(3, 64) == 3 * 80
    assert fmt.bytes_per_page(1, 64) == 64 * 32 + 2 * 64 * 4 + 64 * 40
    assert fmt.bytes_per_page(1, 16) == 16 * 32 + 2 * 64 * 4 + 16 * 40
    assert fmt.tail_bytes_per_request(3, 64) == 3 * 64 * 2 * 64 * 2
    k6 = KVFormat("k6v4-kivi", 64, "bfloat16", 16)   # 6-bit page keys: 48 B codes + 8 B metadata
    assert k6.identity == "affine-v3-k6v4-gcx64-f32-h0-s0-n0-tbf16-p16"
    assert format_from_identity(k6.identity, 64, "float32") == k6
    assert k6.k_row_bytes(64) == 56 and k6.bytes_per_token(1, 64) == 96
    for bad in ("affine-v2-k6v4-g64x64-f32-h64-s1-n0-tbf16",   # 6 bits: page keys only
                "affine-v2-k4v4-gcx64-f32-h0-s0-n0",          # page keys need the tail
                "affine-v2-k4v4-gcx64-f32-h64-s1-n0-tbf16",   # and are unrotated
                "affine-v2-k4v4-g64x64-f32-h0-s0-n0-tbf16",   # token groups are rotated
                "affine-v2-k8v8-gcx64-f32-h0-s0-n0-tbf16",
                "affine-v2-k4v4-gcx64-f32-h0-s0-n4bf16-tbf16",
                "affine-v3-k4v4-gcx64-f32-h0-s0-n0-tbf16",     # v3 names the page size
                "affine-v2-k4v4-gcx64-f32-h0-s0-n0-tbf16-p16", # v2 never does
                "affine-v3-k4v4-g32x64-f32-h64-s1-n0-p16"):    # nor v3 for a token-local one
        with pytest.raises(KVFormatError):
            parse_identity(bad)
    with pytest.raises(KVFormatError, match="must divide head_dim"):   # metadata rows
        fmt.bytes_per_token(1, 128)
    geom = LayerGeometry(0, "full", 2, 64, 64)
    with pytest.raises(KVFormatError, match="must divide head_dim"):
        PageKeyStore(geom, KVFormat(FMT, 64), num_pages=2, page_tokens=128,
                     tails=TailMap(2, 128))
    with pytest.raises(KVFormatError, match="tail_slots"):
        PageKeyStore(geom, KVFormat(FMT, 64), num_pages=2, page_tokens=T)
    with pytest.raises(KVFormatError, match="page keys"):
        PageKeyStore(geom, KVFormat("int4-tail", 64), num_pages=2, page_tokens=T,
                     tails=TailMap(2, T))


@pytest.mark.parametrize("bits", [4, 6])
def test_page_quantization_error_is_half_a_step_per_channel(bits):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, T, 64)).astype(np.float32)
    x[..., 5] *= 20   # an outlier channel widens only its own grid
    codes, scales, offsets = quantize_pages(mx.array(x), bits)
    words = 64 * bits // 32
    got = np.array(dequantize_pages(PagePacked(codes.reshape(3, 2 * T, words)[None],
                                               scales[None], offsets[None]), bits)[0])
    step = (x.max(axis=-2) - x.min(axis=-2)) / (2 ** bits - 1)
    err = np.abs(got.reshape(x.shape) - x)
    assert (err <= step[..., None, :] / 2 + 1e-5).all()
    assert err[..., 5].max() > 5 * err[..., :5].max()


def _write(store, flat, k, v):
    """One step's write to every layer: one Slots, as the runner shares it (the tail and fill
    plans are computed once per step from it)."""
    slots = Slots.from_flat(np.asarray(flat), T)
    for i in store.layers:
        store.write(i, slots, k, v)


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_on_fill_happens_exactly_when_a_page_fills(name):
    store = KVStore(_geom(), num_pages=4, page_tokens=T,
                    layer_factory=packed_layer_factory(name, tail_slots=3))
    fmt = KVFormat(name, 64, page_tokens=T)   # float32 store
    bits = fmt.k_bits
    assert store.bytes_per_token == 2 * fmt.bytes_per_token(2, T)
    assert store.tail_bytes_per_sequence == 2 * fmt.tail_bytes_per_request(2, T)
    assert store.nbytes == 4 * store.page_bytes + 3 * store.tail_bytes_per_sequence
    assert layer_report(store)[0]["storage"] == fmt.identity
    # The CUDA page-key kernel where KernelChoices allows it (the default) and it serves the
    # geometry; never the token-local packed kernels.
    assert PackedLayerCache.kernel_decode_fits(store.layers[0]) == \
        cuda_page_key_decode.supports(bits, fmt.v_bits, 64, 1, T)
    assert not PackedLayerCache.kernel_decode_fits(store.layers[0],
                                                   KernelChoices(page_key_kernel=False))
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((2 * T, 2, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((2 * T, 2, 64)).astype(np.float32))
    layer, tails = store.layers[0], store.layers[0].tails
    codes0 = np.array(layer.k.codes[0])
    # A page written row by row: no key codes until its last row, the rows are read native.
    for n in range(T - 1):
        _write(store, [n], k[n:n + 1], v[n:n + 1])
        mx.eval(store.arrays())
        assert (np.array(layer.k.codes[0]) == codes0).all(), n
        assert tails.slot_of == {0: 0}
        gk, _ = store.gather(0, [[0]])
        assert mx.array_equal(gk[0, :, :n + 1], k[:n + 1].swapaxes(0, 1)).item()
    _write(store, [T - 1], k[T - 1:T], v[T - 1:T])   # the last row: quantized from the tail
    mx.eval(store.arrays())
    assert tails.slot_of == {}
    want = k[:T].swapaxes(0, 1)
    codes, scales, offsets = quantize_pages(want, bits)   # [H, T, W], [H, D]
    assert mx.array_equal(layer.k.codes[0], codes.swapaxes(0, 1)).item()
    gk, gv = store.gather(0, [[0]])
    step = np.array(scales)[:, None, :]
    assert (np.abs(np.array(gk[0] - want)) <= step / 2 + 1e-5).all()
    assert 1e-3 < mx.abs(gk[0] - want).max().item()
    assert mx.abs(gv[0] - v[:T].swapaxes(0, 1)).max().item() < 0.5
    # A prefill write that fills one page whole and starts the next: only the first is coded.
    _write(store, np.r_[np.arange(2 * T, 3 * T), np.arange(3 * T, 3 * T + 4)],
           mx.concatenate([k[T:], k[:4]]), mx.concatenate([v[T:], v[:4]]))
    assert tails.slot_of == {3: 0}
    gk, _ = store.gather(0, [[2, 3]])
    err = mx.abs(gk[0, :, :T] - k[T:].swapaxes(0, 1)).max().item()
    assert 1e-4 < err < 0.5
    assert mx.array_equal(gk[0, :, T:T + 4], k[:4].swapaxes(0, 1)).item()
    # A page filled inside one write that also holds its earlier rows' tail (rows 4.. of page 3).
    rest = mx.array(rng.standard_normal((T - 4, 2, 64)).astype(np.float32))
    _write(store, np.arange(3 * T + 4, 4 * T), rest, rest)
    whole = mx.concatenate([k[:4], rest]).swapaxes(0, 1)
    gk, _ = store.gather(0, [[3]])
    _, scales, _ = quantize_pages(whole, bits)
    assert (np.abs(np.array(gk[0] - whole)) <= np.array(scales)[:, None, :] / 2 + 1e-5).all()
    assert tails.used == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_decode_across_page_boundaries_equals_the_reference(llama, fmt):
    """Greedy decode token by token over two page boundaries: each step's logits equal the
    reference over the store's rows, and the tokens are the model's own greedy choice."""
    table = [5, 1, 3]
    runner = PackedModelRunner(llama, _store(llama, fmt=fmt))
    seq = list(range(9, 9 + T - 3))
    logits = runner.forward([Chunk(0, seq, 0, table)])
    for n in range(len(seq), 2 * T + 3):
        seq.append(int(mx.argmax(logits[0]).item()))
        mx.eval(runner.kvstore.arrays())
        ref = ModelRunner(llama, gathered_native(llama, runner.kvstore, table))
        logits = runner.forward([Chunk(0, [seq[n]], n, table)])
        want = ref.forward([Chunk(0, [seq[n]], n, table)])
        assert mx.abs(logits - want).max().item() < 2e-4, n
    assert runner.kvstore.layers[0].tails.slot_of.keys() == {3}
