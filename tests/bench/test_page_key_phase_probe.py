"""bench.device.page_key_phase_probe: each phase cut matches the kernel source exactly once (a
changed kernel breaks the probe loudly) and removes that phase; the CPU run says why no kernel."""
import json

import pytest

from bench.device import page_key_phase_probe as probe
from engine.attention.cuda import page_key_decode_source as src


def test_every_cut_removes_its_phase_once_and_cuts_compose():
    full = src._SOURCE
    for phase in probe.PROBES:
        cut = probe.cut_source((phase,))
        assert len(cut) < len(full), phase
    assert probe.META not in probe.cut_source(("meta",))
    assert probe.SOFTMAX not in probe.cut_source(("softmax",))
    assert "dot[i][h]" not in probe.cut_source(("scores",))
    # all four: the copies, the barriers that stay and the loop
    rest = probe.cut_source(probe.PROBES)
    assert "orch_cp_wait_all();" in rest and "issue(t + 1)" in rest
    with pytest.raises(ValueError, match="unknown phase"):
        probe.cut_source(("nope",))
    with pytest.raises(ValueError, match="exactly once"):
        probe._cut_once(full, "no such text in the kernel")


def test_cpu_run_reports_the_kernel_unavailable(tmp_path):
    out = tmp_path / "p.json"
    assert probe.main(["--rows", "gpu:128:1", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"]["gpu-ctx128-b1"]
    assert "no CUDA device" in row["unavailable"]
    assert set(row["source_chars"]) == set(probe.VARIANTS) | set(probe.WARP_VARIANTS)


def test_the_cut_kernel_is_launched_inside_the_block_only():
    # page_key_decode_attention looks its kernel up through the module's _kernel at call
    # time: inside the block it gets the probe's, after it (an error included) its own again.
    from engine.attention.cuda import page_key_decode as pkd
    own, cut = pkd._kernel, object()
    with probe._launching(cut):
        assert pkd._kernel() is cut
    assert pkd._kernel is own
    with pytest.raises(RuntimeError), probe._launching(cut):
        raise RuntimeError("a failed launch")
    assert pkd._kernel is own


def test_addressing_variants_change_the_copies_only():
    # head-major: each head's rows of a section read as one run (the row index, nothing else);
    # meta-copies: the metadata copies gone, the code copies kept
    hm = probe.cut_source(("head-major",))
    assert probe.ROW_HEAD_MAJOR in hm and probe.ROW_TOKEN_MAJOR not in hm
    assert hm.index("const int ir = tid >> 1") < hm.index(probe.ROW_HEAD_MAJOR)
    nm = probe.cut_source(("meta-copies",))
    assert "km_off" not in nm and "VC_OFF + irow * VW" in nm and "KC_OFF + irow * LW" in nm


def test_warp_kernel_cuts_change_what_they_name_once():
    from engine.attention.cuda import page_key_warp_decode_source as warp
    hm = probe.warp_cut_source(("head-major",))
    assert probe.WARP_ROW_HEAD_MAJOR in hm and probe.WARP_ROW_TOKEN_MAJOR not in hm
    assert hm.index("const int ct = lane >> 1") < hm.index(probe.WARP_ROW_HEAD_MAJOR)
    nm = probe.warp_cut_source(("meta-copies",))
    assert "KO_OFF : KS_OFF" not in nm and "VO_OFF : VS_OFF" not in nm and "c * MPW" not in nm
    assert "src + KC_OFF + crow * LW" in nm
    lo = probe.warp_cut_source(("compute",))
    assert "orch_mma_f16" not in lo and "issue(i + ST - 1);" in lo and "km[D + e] -= S;" in lo
    assert probe.warp_cut_source(()) == warp._SOURCE
    with pytest.raises(ValueError, match="unknown warp-kernel cut"):
        probe.warp_cut_source(("nope",))


def test_head_pages_reads_each_heads_run_and_an_unknown_variant_is_refused(tmp_path, capsys):
    hp = probe.warp_cut_source(("head-pages",))
    assert "crow * LW" not in hp and "crow * NG)" not in hp
    assert hp.count("src + hk * HEADW + ") == 4 and "constexpr int HEADW = PGW / HK;" in hp
    with pytest.raises(SystemExit):
        probe.main(["--variants", "full,nope", "--out", str(tmp_path / "x.json")])
    assert "unknown variants ['nope']" in capsys.readouterr().err


def test_bulk_cut_swaps_the_copy_issue_and_its_wait_for_bulk_copies():
    from bench.device import page_key_bulk_copies as bulk
    text = probe.warp_cut_source(("bulk",))
    assert "orch_cp_async" not in text and "orch_cp_wait" not in text
    assert text.count("orch_bulk(") == 6 and bulk.WAIT in text
    # the mbarriers exist before the first issue, every stage's at once
    assert text.index("unsigned long long wbar[NW][ST]") < text.index("issue(i);")
    both = probe.warp_cut_source(("compute", "bulk"))
    assert "orch_mma_f16" not in both and bulk.WAIT in both
