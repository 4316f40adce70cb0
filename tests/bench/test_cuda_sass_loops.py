"""bench.cuda_sass_loops: the SASS listing parsed into the main loop and its stretches between
barriers (a listing in cuobjdump's format, written here), and its run on a real kernel where
nvcc and cuobjdump are installed (exit 2 and a message where they are not)."""
import json
import shutil

from bench import cuda_sass_loops as sl

LISTING = """
        code for sm_90
                Function : kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x000 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x000 */
        /*0020*/                   LDG.E R2, desc[UR4][R2.64] ;           /* 0x000 */
        /*0030*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;  /* 0x000 */
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x000 */
        /*0050*/                   FFMA R5, R6, R7, R5 ;                  /* 0x000 */
        /*0060*/               @P0 FFMA R8, R6, R7, R8 ;                  /* 0x000 */
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x000 */
        /*0080*/                   LOP3.LUT R9, R9, 0x3f, RZ, 0xc0, !PT ; /* 0x000 */
        /*0090*/              @!P1 BRA 0x20 ;                             /* 0x000 */
        /*00a0*/                   ISETP.GE.AND P2, PT, R0, 0x4, PT ;     /* 0x000 */
        /*00b0*/               @P2 BRA 0x10 ;                             /* 0x000 */
        /*00c0*/                   EXIT ;                                 /* 0x000 */
"""


def test_the_longest_loop_is_split_at_block_barriers():
    ins = sl.instructions(LISTING)
    assert len(ins) == 13 and ins[2] == (0x20, "LDG.E R2, desc[UR4][R2.64]")
    assert sl.opcode("@!P1 BRA 0x20") == "BRA" and sl.opcode("@P0 FFMA R8, R6, R7, R8") == "FFMA"
    # 0x20..0x90 (prefetch, two barriers), not the longer region 0x10..0xb0 laid out around it
    assert sl.main_loop(ins) == (2, 9)
    report = sl.loop_report(ins)
    assert report["instructions"] == 13 and report["loop"]["instructions"] == 8
    parts = report["loop"]["between_barriers"]
    assert [p["instructions"] for p in parts] == [3, 3, 2]
    assert parts[0]["opcodes"] == {"LDG": 1, "LDGSTS": 1, "BAR": 1}
    assert parts[1]["opcodes"] == {"FFMA": 2, "BAR": 1} and parts[2]["from"] == "0x80"


def test_without_a_prefetching_loop_the_longest_loop_is_taken():
    ins = [(a, t.replace("LDGSTS", "STS")) for a, t in sl.instructions(LISTING)]
    assert sl.main_loop(ins) == (1, 11)


def test_a_kernel_without_a_loop_reports_its_size_only():
    ins = sl.instructions(LISTING.split("/*0090*/")[0])
    assert sl.loop_report(ins) == {"instructions": 9}


def test_runs_on_the_page_key_kernel_or_says_what_it_needs(capsys):
    label = "page-key d64 k4 pt16 g4 split=False"
    code = sl.main(["--only", label])
    out = capsys.readouterr()
    if shutil.which("nvcc") is None or sl.find_cuobjdump() is None:
        assert code == 2 and "cuobjdump" in out.err
        return
    assert code == 0
    loop = json.loads(out.out)["variants"][label]["loop"]
    assert loop["opcodes"]["FFMA"] > 0 and len(loop["between_barriers"]) >= 3
