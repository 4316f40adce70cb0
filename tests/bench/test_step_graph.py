"""bench.step_graph: the host-time split runs on any backend; the dot parser reads MLX's CUDA
graph dumps as the H200 wrote them (docs/lab/benchmarks-gpu/session12)."""
import json

import pytest

from bench import step_graph

# Nodes of a CUDA graph dot file as MLX 0.32.4 wrote it on the H200 (cudaGraphDebugDotPrint); the
# last one's name (a cuBLAS kernel, not mangled) as the kernels part recorded it there.
DOT = '''digraph dot {
subgraph cluster_6391 {
label="graph_6391" graph[style="dashed"];
"graph_6391_node_0"[style="bold" shape="octagon" label="0
_ZN3mlx4core2cu11gemv_singleI13__nv_bfloat16Li8ELi4EEEvPKT_S6_PS4_ii
"];

"graph_6391_node_1"[style="bold" shape="octagon" label="1
_ZN3mlx4core2cu9binary_vvINS1_3AddE13__nv_bfloat16S4_jLi8EEEvPKT0_S7_PT1_T2_
"];

"graph_6391_node_2"[style="bold" shape="octagon" label="2
_ZN3mlx4core2cu11gemv_singleI13__nv_bfloat16Li8ELi4EEEvPKT_S6_PS4_ii
"];

"graph_6391_node_3"[style="bold" shape="octagon" label="3
nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN
"];
}
}
'''


def test_dot_nodes_are_counted_by_kernel():
    names = step_graph.node_names(DOT)
    assert sum(names.values()) == 4
    gemv = [n for n in names if "gemv_single" in n]
    assert len(gemv) == 1 and names[gemv[0]] == 2
    assert names["nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN"] == 1   # no index line in the name


def test_graphs_since_counts_only_new_files(tmp_path):
    (tmp_path / "g_1.dot").write_text(DOT)
    seen: set = set()
    assert step_graph.graphs_since(tmp_path, seen)[0] == 1
    (tmp_path / "g_2.dot").write_text(DOT)
    count, names = step_graph.graphs_since(tmp_path, seen)
    assert count == 1 and sum(names.values()) == 4


@pytest.mark.parametrize("fmt", ["native", "int4"])
def test_time_split_on_the_cpu(tmp_path, fmt):
    out = tmp_path / "g.json"
    step_graph.main(["--steps", str(step_graph.WARM_STEPS + 2), "--prompt", "16",
                     "--kv-format", fmt, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["kv_format"] == fmt
    for side in ("engine", "engine_scatter_writes", "mlx_lm"):
        t = result["time_ms"][side]
        assert t["step"] >= t["build"] > 0 and t["issue"] >= 0
    assert "CUDA only" in result["kernels"]


def test_bad_arguments_are_refused_naming_them(capsys):
    with pytest.raises(SystemExit):
        step_graph.parse_args(["--parts", "time,flame"])
    assert "flame" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_graph.parse_args(["--short", "40", "--long", "8"])
    with pytest.raises(SystemExit):
        step_graph.parse_args(["--kv-format", "int3"])
    assert "int3" in capsys.readouterr().err
