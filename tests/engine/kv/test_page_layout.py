"""One pool per packed layer (engine.kv.page_layout): sections, records, gathers, page writes."""
import mlx.core as mx
import numpy as np
import pytest

from capacity.formats import KVFormat
from engine.kv.page_layout import (K_SECTIONS, SECTIONS, V_SECTIONS, PageLayout, packed_record,
                                   record)
from engine.kv.quant import quantize


def _layout(name="k8v4", page_tokens=8, heads=2, dim=128):
    fmt = KVFormat(name, dim)
    return PageLayout.for_format(page_tokens, heads, dim, fmt.k_bits, fmt.v_bits, fmt.k_group, 64)


@pytest.mark.parametrize("name", ["int8", "k8v4", "int4", "int4-k32"])
def test_a_page_holds_exactly_the_formats_bytes(name):
    fmt, lay = KVFormat(name, 128), _layout(name)
    assert lay.page_words * 4 == fmt.bytes_per_page(2, 8)
    assert lay.record_words * 4 == fmt.bytes_per_token(2)
    # Sections follow each other in SECTIONS order, each [page_tokens, heads, width] words.
    ends = [lay.offsets[n] + 8 * 2 * lay.width(n) for n in SECTIONS]
    assert [lay.offsets[n] for n in SECTIONS[1:]] == ends[:-1] and ends[-1] == lay.page_words


def test_rows_written_as_records_read_back_and_gather_by_page_table():
    lay = _layout()
    pool = lay.zeros(5)
    k = mx.random.normal((4, 2, 128), key=mx.random.key(0))
    v = mx.random.normal((4, 2, 128), key=mx.random.key(1))
    kp, vp = quantize(k, 8), quantize(v, 4)
    page, offset = np.array([4, 1, 4, 1]), np.array([0, 7, 3, 6])
    lay.write_rows(pool, lay.row_index(page, offset), packed_record(kp, vp))
    want = dict(zip(SECTIONS, (kp.codes, vp.codes, kp.scales, kp.offsets, vp.scales, vp.offsets)))
    for name, got in zip(SECTIONS, lay.read_rows(pool, page, offset)):
        assert got.dtype == want[name].dtype and mx.array_equal(got, want[name]).item(), name
    # History of one sequence on pages [1, 4]: token 7 of page 1 is row 1, token 3 of page 4
    # (position 8 + 3) is row 2.
    for name in SECTIONS:
        g = lay.gather(pool, mx.array([[1, 4]]), name)
        assert g.shape[:3] == (1, 2, 16)
        assert mx.array_equal(g[0, :, 7], want[name][1]).item()
        assert mx.array_equal(g[0, :, 11], want[name][2]).item()
        assert mx.array_equal(lay.section(pool, name)[4, 0], want[name][0]).item()
    # Nothing but the four records' words changed.
    touched = {(int(p), int(c)) for p, c in zip(*np.nonzero(np.array(pool)))}
    cols = np.array(lay.row_columns(offset))
    assert touched <= {(int(p), int(c)) for p, row in zip(page, cols) for c in row}


def test_a_subset_of_sections_and_whole_page_writes():
    lay = _layout("int4")
    pool = lay.zeros(3)
    vp = quantize(mx.random.normal((2, 2, 128), key=mx.random.key(2)), 4)
    page, offset = np.array([2, 0]), np.array([1, 1])
    lay.write_rows(pool, lay.row_index(page, offset, V_SECTIONS), record(list(vp), V_SECTIONS))
    got = lay.read_rows(pool, page, offset, V_SECTIONS)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, vp))
    assert not np.array(lay.section(pool, "k_codes")).any()
    scales = mx.random.uniform(shape=(1, 8, 2, 2), key=mx.random.key(3))
    lay.write_pages(pool, mx.array([1]), K_SECTIONS[1], scales)
    assert mx.array_equal(lay.gather_pages(pool, mx.array([[1]]), "k_scales")[0], scales).item()
    assert not np.array(lay.section(pool, "k_scales")[0]).any()
