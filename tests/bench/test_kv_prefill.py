"""bench.kv's prefill section: each requested CUDA prefill path is its own variant."""
import json

import pytest

from bench import kv as bench_kv


def test_prefill_paths_become_named_variants(tmp_path):
    """--prefill-paths adds FORMAT-PATH rows beside direct and fused (on the CPU neither path
    routes, so the rows time the direct path; the names and ratios are what is checked)."""
    out = tmp_path / "kv.json"
    bench_kv.main(["--sections", "prefill", "--prefill", "64", "--chunk", "32",
                   "--prefill-formats", "int4", "--prefill-paths", "tiles,dequant",
                   "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    row = result["prefill"]["64"]
    assert set(row) == {"native", "int4-direct", "int4-fused", "int4-tiles", "int4-dequant"}
    assert all(v["ttft_s"] > 0 and v["ratio_to_native"] > 0 for v in row.values())
    assert result["env"]["prefill_path"] == "dequant"


def test_unknown_prefill_path_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_kv.main(["--sections", "prefill", "--prefill-paths", "tiles,magic",
                       "--out", str(tmp_path / "kv.json")])
    assert "magic" in capsys.readouterr().err
    assert not (tmp_path / "kv.json").exists()


def test_every_registered_format_builds_prefills_and_decodes(tmp_path):
    """bench.kv builds every format capacity.formats registers (native-tail and page-key
    formats need tail slots), and neither path of any of them fails."""
    from capacity.formats import FORMAT_BITS

    packed = [n for n, bits in FORMAT_BITS.items() if bits]
    out = tmp_path / "kv.json"
    bench_kv.main(["--sections", "capacity,prefill,decode", "--prefill", "48", "--chunk", "24",
                   "--prefill-formats", ",".join(packed), "--decode", "40", "--batches", "2",
                   "--decode-formats", ",".join(packed), "--steps", "2", "--repeats", "1",
                   "--out", str(out)])
    result = json.loads(out.read_text())
    row = result["prefill"]["48"]
    assert set(row) == {"native"} | {f"{n}-{m}" for n in packed for m in ("direct", "fused")}
    assert all("error" not in v and v["ttft_s"] > 0 for v in row.values()), row
    decode = result["decode"]["ctx40-b2"]
    assert set(packed) <= set(decode)
    assert all("error" not in decode[n] and decode[n]["tok_s"] > 0 for n in packed), decode


def test_page_key_prefill_kernel_spec_is_its_own_variant(tmp_path):
    """--prefill-formats k6v4-kivi:kernel times page-key prefill with
    KernelChoices.page_key_prefill on (on the CPU the kernel does not route, so the row times
    the direct path; the name is what is checked); an unknown kernel is refused."""
    out = tmp_path / "kv.json"
    bench_kv.main(["--sections", "prefill", "--prefill", "48", "--chunk", "24",
                   "--prefill-formats", "k6v4-kivi,k6v4-kivi:kernel", "--repeats", "1",
                   "--out", str(out)])
    row = json.loads(out.read_text())["prefill"]["48"]
    assert {"k6v4-kivi-direct", "k6v4-kivi:kernel-direct"} <= set(row)
    assert all("error" not in v and v["ttft_s"] > 0 for v in row.values()), row
    assert bench_kv.prefill_spec("k6v4-kivi:kernel", bench_kv.DEFAULT_KERNELS,
                                 "direct")[2].page_key_prefill
    with pytest.raises(ValueError, match="magic"):
        bench_kv.prefill_spec("int4:magic", bench_kv.DEFAULT_KERNELS, "direct")
