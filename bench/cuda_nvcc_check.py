"""Compile the CUDA kernels' sources with a local nvcc, without a GPU (a developer's check).

    python -m bench.cuda_nvcc_check [--arch sm_90]

Device time is scarce and a kernel that does not compile costs a whole run there, so this
wraps each kernel's source the way `mx.fast.cuda_kernel` does on the device (MLX 0.32's
build_kernel: pointer parameters typed by dtype, template arguments as constexprs, the body in
namespace mlx::core::cu) and compiles every shipped variant to a cubin, printing ptxas'
register and shared-memory use. MLX's own default header is replaced by the two CUDA headers
our kernels need; NVRTC on the device may still differ in details. Exit 2 without nvcc.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half",
              "uint32": "uint32_t", "int32": "int32_t"}
# MLX's default header is mlx/backend/cuda/device/utils.cuh (not shipped here), cooperative
# groups and an `inf` macro; the last two are mimicked, so a kernel naming `inf` or clashing
# with cooperative groups fails here too.
PRELUDE = ("#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
           "#include <cuda/std/limits>\n#include <cooperative_groups.h>\n"
           "#define inf cuda::std::numeric_limits<float>::infinity()\n")


def wheel_files(pattern: str) -> list[Path]:
    """Files of NVIDIA's PyPI wheels on sys.path matching `pattern` under their `nvidia/`
    folder (e.g. "*/bin/cuobjdump", "*/lib/libnvrtc.so*"): CUDA tools without a toolkit."""
    return sorted(f for p in sys.path if (Path(p) / "nvidia").is_dir()
                  for f in (Path(p) / "nvidia").glob(pattern))


def template_constants(template: list[tuple[str, object]], types: dict) -> list[str]:
    """A kernel's template arguments as the constants MLX's cuda_kernel declares in its body
    (bool and int constexprs, dtypes as `using` aliases spelled through `types`)."""
    consts = []
    for k, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {k} = {str(v).lower()};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {k} = {v};")
        else:
            consts.append(f"  using {k} = {types[v]};")
    return consts


def wrap(name: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
         source: str, header: str, template: list[tuple[str, object]]) -> str:
    params = [f"    const {CUDA_TYPES[t]}* {n}" for n, t in inputs]
    params += [f"    {CUDA_TYPES[t]}* {n}" for n, t in outputs]
    consts = template_constants(template, CUDA_TYPES)
    return (PRELUDE + header + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
            "__global__ void " + name + "(\n"
            + ",\n".join(params) + ") {\n" + "\n".join(consts) + "\n" + source
            + "\n}\n}  // namespace mlx::core::cu\n")


def decode_variants():
    """The packed decode kernels: v1 (cuda/packed_decode.py) and the tiled v2
    (cuda/packed_decode_v2_source.py), every format, head dim, GQA group and split mode."""
    from engine.attention.cuda import packed_decode as v1
    from engine.attention.cuda import packed_decode_v2_source as v2
    from engine.attention.cuda.paged_decode import HEADER
    packed = [("pool", "uint32"), ("pages", "int32"), ("ends", "int32"), ("dims", "int32"),
              ("scale", "float32")]
    fresh = [("q", "bfloat16"), ("kf", "bfloat16"), ("vf", "bfloat16")]
    outputs = [("out", "bfloat16"), ("part", "float32"), ("ml", "float32")]
    for d in (64, 128):
        for g in (1, 3, 4, 7, 8):
            for kb in (4, 8):
                for split in (False, True):
                    template = [("D", d), ("G", g), ("PT", 16), ("HK", 4), ("KB", kb),
                                ("TQ", "bfloat16"), ("TK", "bfloat16"), ("SPLIT", split),
                                ("TO", "bfloat16")]
                    tag = f"d{d} g{g} k{kb}v{kb} split={split}"
                    for own in (False, True):   # the variant that stores the own rows
                        yield f"decode-v2 {tag} own={own}", wrap(
                            "orchard_packed_decode_v2" + ("_own" if own else ""),
                            fresh + packed + [("signs", "float32")], outputs, v2._SOURCE,
                            v2._HEADER, template + [("OWN", own)])
                    if g in (3, 4):
                        yield f"decode-v1 {tag}", wrap(
                            "orchard_packed_decode",
                            [fresh[0], ("qr", "float32"), *fresh[1:], *packed], outputs,
                            v1._SOURCE, HEADER, template)


def native_variants():
    """The native decode kernel (cuda/paged_decode.py), plain and OWN (it writes the step's own
    keys into the pages), both head dims, GQA groups, split modes."""
    from engine.attention.cuda import paged_decode as pd
    base = [("q", "bfloat16"), ("kp", "bfloat16"), ("vp", "bfloat16"), ("pages", "int32"),
            ("ends", "int32"), ("dims", "int32"), ("scale", "float32")]
    outputs = [("out", "bfloat16"), ("part", "float32"), ("ml", "float32")]
    for d in pd.HEAD_DIMS:
        for g in (1, 3, 8):
            for split in (False, True):
                for own in (False, True):
                    template = [("D", d), ("G", g), ("PT", 64), ("TQ", "bfloat16"),
                                ("TK", "bfloat16"), ("OWN", own), ("SPLIT", split),
                                ("TO", "bfloat16")]
                    extra = [("kn", "bfloat16"), ("vn", "bfloat16")] if own else []
                    yield f"native d{d} g{g} split={split} own={own}", wrap(
                        "orchard_paged_decode" + ("_own" if own else ""), base + extra,
                        outputs, pd._native_source(own), pd.HEADER, template)


def native_tiled_variants():
    """The tiled native decode kernel (cuda/native_tiled_decode_source.py), plain and OWN, both
    head dims, page sizes, GQA groups 1..8, split modes (the labels start "native-tiled")."""
    from engine.attention.cuda import native_tiled_decode_source as src
    base = [(n, "int32" if n in ("pages", "ends", "dims") else
             "float32" if n == "scale" else "bfloat16") for n in src.INPUTS]
    outputs = [("out", "bfloat16"), ("part", "float32"), ("ml", "float32")]
    for d in (64, 128):
        for pt in (16, 32, 64):
            for g in (1, 4, 8):
                for split in (False, True):
                    for own in (False, True):
                        template = [("D", d), ("G", g), ("PT", pt), ("TQ", "bfloat16"),
                                    ("TK", "bfloat16"), ("OWN", own), ("SPLIT", split),
                                    ("TO", "bfloat16")]
                        extra = [(n, "bfloat16") for n in src.OWN_INPUTS] if own else []
                        yield (f"native-tiled d{d} pt{pt} g{g} split={split} own={own}",
                               wrap(src.name(own), base + extra, outputs, src.source(own),
                                    src._HEADER, template))


def write_variants():
    """The packed write kernel (cuda/packed_write.py): rows to pool records, or (in place)
    straight into the pool, every bits pair."""
    from engine.attention.cuda import packed_write as pw
    from engine.attention.cuda.paged_decode import HEADER
    base = [("k", "bfloat16"), ("v", "bfloat16"), ("signs", "float32"), ("dims", "int32")]
    for d in pw.HEAD_DIMS:
        for kb, vb in ((8, 8), (4, 4), (8, 4)):
            template = [("D", d), ("KB", kb), ("VB", vb), ("TI", "bfloat16")]
            yield f"write d{d} k{kb}v{vb}", wrap(
                "orchard_packed_write", base, [("rec", "uint32")], pw.source(False),
                HEADER + pw.QUANTIZE, template)
            yield f"write in place d{d} k{kb}v{vb}", wrap(
                "orchard_packed_write_in_place",
                base + [("pool", "uint32"), ("slot", "int32"), ("tmpl", "int32")],
                [("done", "uint32")], pw.source(True), HEADER + pw.QUANTIZE, template)


def dequant_variants():
    """The history-dequant kernel (cuda/packed_dequant.py): every bits pair, both head dims."""
    from engine.attention.cuda import packed_dequant as pq
    from engine.attention.cuda.paged_decode import HEADER
    from engine.attention.cuda.tile_helpers import kernel_layout
    types = {"TO": "bfloat16"}
    for d in pq.HEAD_DIMS:
        for kb, vb in ((8, 8), (4, 4), (8, 4)):
            yield f"dequant d{d} k{kb}v{vb}", wrap(
                "orchard_packed_dequant", [(n, types.get(t, t)) for n, t in pq.INPUTS],
                [(n, types.get(t, t)) for n, t in pq.OUTPUTS], pq._SOURCE, HEADER,
                [*pq.template(kernel_layout(16, 4, d, kb, vb), kb, vb), ("TO", "bfloat16")])


# The page-key decode kernels' inputs and outputs as the engine launches them (bf16 activations).
PAGE_KEY_TYPES = {"q": "bfloat16", "kf": "bfloat16", "vf": "bfloat16", "pool": "uint32",
                  "kt": "bfloat16", "vt": "bfloat16", "pages": "int32", "ends": "int32",
                  "tslot": "int32", "dims": "int32", "scale": "float32", "tw": "int32"}
PAGE_KEY_OUTPUTS = [("out", "bfloat16"), ("part", "float32"), ("ml", "float32")]


def page_key_variants():
    """The page-key decode kernel (cuda/page_key_decode_source.py): both key widths, head dims,
    page sizes, GQA groups, split modes; its tensor-core score pass (MMA) at pages of 16."""
    from engine.attention.cuda import page_key_decode_source as src
    types, outputs = PAGE_KEY_TYPES, PAGE_KEY_OUTPUTS
    for d in (64, 128):
        for kb in (4, 6):
            for pt in (16, 32, 64):
                for g in (1, 4, 7, 8):
                    for split in (False, True):
                        for own in ((False, True) if g in (1, 4, 8) else (False,)):
                            for mma, wkc in (((False, False), (True, False), (False, True))
                                             if pt == 16 else ((False, False),)):
                                template = [("D", d), ("G", g), ("PT", pt), ("HK", 2),
                                            ("KB", kb), ("TQ", "bfloat16"), ("TK", "bfloat16"),
                                            ("TT", "bfloat16"), ("OWN", own), ("MMA", mma),
                                            ("WKC", wkc), ("SPLIT", split), ("TO", "bfloat16")]
                                yield (f"page-key d{d} k{kb} pt{pt} g{g} split={split}"
                                       f"{' own' * own}{' mma' * mma}{' wide' * wkc}",
                                       wrap("orchard_page_key_decode",
                                            [(n, types[n]) for n in src.INPUTS], outputs,
                                            src._SOURCE, src.header(), template))


def page_key_warp_variants():
    """The warp-page decode kernel (cuda/page_key_warp_decode_source.py): both key widths, head
    dims, GQA groups, split modes, OWN at pages of 16; block shapes (warps x stages) besides the
    default at split OWN launches; pages of 32 and 64 (quarters sharing a page's key
    metadata buffers) at GQA 1 and 8 with every shape."""
    from engine.attention.cuda import page_key_decode_source as src
    from engine.attention.cuda import page_key_warp_decode_source as warp
    types, outputs = PAGE_KEY_TYPES, PAGE_KEY_OUTPUTS
    for pt in (16, 32, 64):
        for d in (64, 128):
            for kb in (4, 6):
                for g in (1, 4, 7, 8) if pt == 16 else (1, 8):
                    for split in (False, True):
                        for own in (False, True):
                            if pt != 16 and split != own:
                                continue
                            more = split and own and g in (4, 8)
                            for nwb, st in ((4, 2),) + (((2, 3), (2, 4), (1, 4)) if more else ()):
                                template = [("D", d), ("G", g), ("PT", pt), ("HK", 2),
                                            ("KB", kb), ("TQ", "bfloat16"), ("TK", "bfloat16"),
                                            ("TT", "bfloat16"), ("OWN", own), ("NWB", nwb),
                                            ("ST", st), ("SPLIT", split), ("TO", "bfloat16")]
                                yield (f"page-key-warp pt{pt} d{d} k{kb} g{g} split={split}"
                                       f"{' own' * own} {nwb}x{st}",
                                       wrap("orchard_page_key_warp_decode",
                                            [(n, types[n]) for n in src.INPUTS], outputs,
                                            warp._SOURCE, src.header(), template))


def page_key_dequant_variants():
    """The page-key prefill dequant kernel (cuda/page_key_dequant.py): both key widths and
    head dims, pages of 16 and 64."""
    from engine.attention.cuda import page_key_dequant as pq
    from engine.attention.cuda.paged_decode import HEADER
    types = {"kf": "bfloat16", "vf": "bfloat16", "pool": "uint32", "kt": "bfloat16",
             "vt": "bfloat16", "pages": "int32", "bounds": "int32", "tslot": "int32",
             "dims": "int32"}
    for d in pq.HEAD_DIMS:
        for kb in pq.KEY_BITS:
            for pt in (16, 64):
                yield f"page-key-dequant d{d} k{kb} pt{pt}", wrap(
                    "orchard_page_key_dequant", [(n, types[n]) for n in pq.INPUTS],
                    [(n, "bfloat16") for n in pq.OUTPUTS], pq._SOURCE, HEADER,
                    [*pq.template(d, pt, 2, kb), ("TO", "bfloat16"), ("TT", "bfloat16")])


def page_key_write_variants():
    """The page-key decode write (cuda/page_key_write.py): both key widths and head dims, every
    page size (the labels start "page-key-write")."""
    from engine.attention.cuda import page_key_write as pw
    from engine.attention.cuda.paged_decode import HEADER
    types = {"k": "bfloat16", "v": "bfloat16", "pool": "uint32", "kt": "bfloat16",
             "vt": "bfloat16", "page": "int32", "off": "int32", "tb": "int32", "tw": "int32",
             "dims": "int32"}
    for d in (64, 128):
        for kb in (4, 6):
            for pt in pw.PAGE_TOKENS:
                for in_place in (True, False):
                    yield (f"page-key-write d{d} k{kb} pt{pt}{' in-place' * in_place}", wrap(
                        "orchard_page_key_write", [(n, types[n]) for n in pw.INPUTS],
                        [(n, "bfloat16") for n in pw.OUTPUTS], pw._SOURCE, HEADER + pw.helpers(),
                        pw.template(d, pt, 4, kb, "bfloat16", "bfloat16", in_place)))


def variants():
    """(label, wrapped source) for every kernel variant the engine launches."""
    yield from native_variants()
    yield from native_tiled_variants()
    yield from decode_variants()
    yield from page_key_variants()
    yield from page_key_warp_variants()
    yield from page_key_dequant_variants()
    yield from page_key_write_variants()
    yield from write_variants()
    yield from dequant_variants()
    from engine.attention.cuda import packed_prefill as pf
    from engine.attention.cuda import packed_prefill_source as pf_source
    inputs = [("q", "bfloat16"), ("kf", "bfloat16"), ("vf", "bfloat16"), ("pool", "uint32"),
              ("pages", "int32"), ("bounds", "int32"), ("dims", "int32")]
    outputs = [("out", "bfloat16"), ("part", "float32"), ("ml", "float32")]
    for d in pf.HEAD_DIMS:
        for g, qw in ((1, 4), (3, 2), (4, 2), (4, 1), (8, 1)):
            for kb, vb in ((8, 8), (4, 4), (8, 4)):
                for split in (False, True):
                    label = f"prefill d{d} g{g} qw{qw} k{kb}v{vb} split={split}"
                    yield label, wrap("orchard_packed_prefill", inputs, outputs, pf_source._SOURCE,
                                      pf_source._HEADER, [("D", d), ("G", g), ("QW", qw), ("KB", kb), ("VB", vb),
                                                   ("PT", 16), ("HK", max(1, 4 // g)), ("SPLIT", split),
                                                   ("TO", "bfloat16")])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--only", default="", help="compile only labels containing this text")
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("no nvcc on PATH: nothing to compile", file=sys.stderr)
        return 2
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, src) in enumerate(variants()):
            if args.only not in label:
                continue
            path = Path(tmp) / f"k{i}.cu"
            path.write_text(src)
            run = subprocess.run([nvcc, f"-arch={args.arch}", "-std=c++17", "-cubin",
                                  "-Xptxas", "-v", "-o", str(path.with_suffix(".cubin")),
                                  str(path)], capture_output=True, text=True)
            usage = [ln.split("info    : ")[-1] for ln in run.stderr.splitlines()
                     if "registers" in ln or "spill" in ln]
            print(f"{'ok  ' if run.returncode == 0 else 'FAIL'} {label}: {' | '.join(usage)}")
            if run.returncode:
                failed += 1
                print(run.stderr[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
