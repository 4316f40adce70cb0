"""bench.cuda_nvrtc_check: one page-key variant through NVRTC where libnvrtc and the CUDA
headers are installed; a clear exit 2 where they are not."""
from bench import cuda_nvrtc_check as nc


def test_compiles_a_variant_or_says_what_it_needs(capsys):
    code = nc.main(["--only", "page-key d64 k4 pt16 g4 split=False"])
    out = capsys.readouterr()
    if nc.find_nvrtc() is None or nc.toolkit_include() is None:
        assert code == 2 and "libnvrtc" in out.err
        return
    assert code == 0 and out.out.startswith("ok   page-key d64 k4 pt16 g4 split=False")


def test_nvrtc_sees_no_host_header():
    """The prelude's <cstdint> (NVRTC has none) is swapped for the two types the kernels use."""
    _, source = next(iter(nc.variants()))
    assert nc.CSTDINT in source
    assert nc.CSTDINT not in source.replace(nc.CSTDINT, nc.FIXED_WIDTH)
