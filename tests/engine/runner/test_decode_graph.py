"""A decode step's graph holds no bookkeeping nodes the engine can do without (issue 33 item 1;
docs/lab/decode-graph-8b.md).

What they pin, by counting graph nodes (never timing):
- linear layers and a tied LM head multiply by a transposed view of their weight made at load
  (engine/model/linear.py): no Transpose node reads a weight, and the logits are mlx-lm's own,
  bit for bit;
- a compiled decode step reads its rows' starts, ends, write slots and page tables as views of
  the one table it uploads (engine/runner/compiled_decode.py): no arithmetic, gather or copy
  before the model;
- bench/decode_graph.py's counts: the engine's batch-1 step issues fewer nodes than mlx-lm's,
  per layer and outside.
"""
from __future__ import annotations

import re
import tempfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from bench.synthetic import ARCHS
from engine.attention.choices import KernelChoices
from engine.kv.store import KVStore
from engine.model.linear import PretransposedLinear, held_views, pretranspose
from engine.model.loader import load_model
from engine.runner.compiled_decode import DeviceDecodeStep
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk


def _dot(outputs, names: dict) -> tuple[list[tuple[str, list[str]]], str]:
    """(label, input names) of every node of the graph MLX would evaluate for `outputs`."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs, **names)
        dot = f.read()
    inputs: dict[str, list[str]] = {}
    for src, node in re.findall(r'^"([^"]+)" -> (\d+)$', dot, re.M):
        inputs.setdefault(node, []).append(src)
    return [(label, inputs.get(node, []))
            for node, label in re.findall(r'\{ (\d+) \[label ="([^"]*)"', dot)], dot


def _weight_transposes(lm, logits) -> int:
    names = {f"w.{k}": v for k, v in tree_flatten(lm.model.parameters())}
    nodes, _ = _dot([logits], names)
    return sum(1 for label, ins in nodes
               if label == "Transpose" and any(i.startswith("w.") for i in ins))


@pytest.mark.parametrize("fuse", [False, True])
def test_no_transpose_node_reads_a_weight_in_a_decode_step(tiny_llama, fuse):
    lm = load_model(tiny_llama, fuse=fuse)
    for kernels in (KernelChoices(compiled_decode=False), KernelChoices(compiled_decode=True)):
        runner = ModelRunner(lm, KVStore(lm.geometry, 8, 8, lm.dtype), kernels=kernels)
        runner.forward([Chunk(0, [1, 2, 3, 4, 5], 0, [0])])
        logits = runner.forward([Chunk(0, [6], 5, [0])])
        assert _weight_transposes(lm, logits) == 0
    # The count sees them where they are: the same model as mlx loads it has one per linear.
    from mlx_lm.utils import load
    plain, _ = load(tiny_llama)
    linears = sum(1 for _, m in plain.named_modules() if type(m) is nn.Linear)
    names = {f"w.{k}": v for k, v in tree_flatten(plain.parameters())}
    nodes, _ = _dot([plain(mx.array([[1, 2]]))], names)
    assert sum(1 for label, ins in nodes if label == "Transpose"
               and any(i.startswith("w.") for i in ins)) >= linears > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_pretransposed_models_give_mlx_lm_logits_bit_for_bit(tiny_model_dirs, arch):
    from mlx_lm.utils import load
    lm = load_model(tiny_model_dirs[arch])
    plain, _ = load(tiny_model_dirs[arch])
    plain.set_dtype(lm.dtype, lambda d: mx.issubdtype(d, mx.floating))
    assert any(type(m) is PretransposedLinear for _, m in lm.model.named_modules())
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert mx.array_equal(lm.model(x), plain(x)).item()


def test_a_replaced_weight_is_used_not_the_view_made_for_the_old_one():
    layer = nn.Linear(8, 4, bias=True)
    x = mx.random.normal((2, 8))
    assert pretranspose(layer) == 1
    assert mx.array_equal(layer(x), mx.addmm(layer.bias, x, layer.weight.T)).item()
    layer.update({"weight": mx.ones((4, 8))})
    assert mx.array_equal(layer(x), mx.addmm(layer.bias, x, mx.ones((8, 4)))).item()
    assert not held_views(layer)   # the old weight and its view are let go


def test_the_held_view_shares_the_weights_buffer():
    w = mx.random.normal((1024, 1024))
    layer = nn.Linear(1024, 1024, bias=False)
    layer.weight = w
    mx.eval(layer.parameters())
    before = mx.get_active_memory()
    pretranspose(layer)
    assert mx.get_active_memory() - before < w.nbytes // 4


def test_a_compiled_step_derives_nothing_from_its_table():
    """Starts, ends, write slots and page rows are views of the uploaded table: any arithmetic
    (ends = starts + 1), gather (the slot's page) or copy (contiguous pages) is a node here."""
    rows, width, t = 3, 4, 8
    starts = np.array([5, 17, 30], dtype=np.int32)
    pages = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    flat = np.concatenate([starts, starts + 1, pages[np.arange(rows), starts // t], starts % t,
                           pages.reshape(-1)]).astype(np.int32)
    table = mx.array(flat)
    step = DeviceDecodeStep(table, rows, t, False, KernelChoices())
    parts = [step.offset, step.ends, step.slots.page, step.slots.offset, step.view(None).pages]
    nodes, _ = _dot(parts, {"table": table})
    assert {label for label, _ in nodes} <= {"Slice", "Reshape"}, nodes
    got = [np.array(a) for a in parts]
    for g, want in zip(got, (starts, starts + 1, pages[np.arange(rows), starts // t],
                             starts % t, pages)):
        np.testing.assert_array_equal(g, want)


def test_bench_counts_the_engine_step_below_mlx_lms(tiny_llama):
    """bench/decode_graph.py on the tiny llama, GPU choices with stand-ins: per layer the engine
    issues 4 matmuls (mlx-lm 7) and one attention node (mlx-lm a cache slice update for K and V
    and SDPA); outside the layers it derives nothing from its table."""
    from bench.decode_graph import engine_side, mlx_lm_side

    eng = engine_side(tiny_llama, "engine", 20, 8, with_issued=True)
    ref = mlx_lm_side(tiny_llama, 20, with_issued=False)
    layer, setup = eng["traced"]["per_layer"], eng["traced"]["setup"]
    prims = layer["by_primitive"]
    assert eng["compiled"] and eng["kernel_decode"] and eng["traced"]["layers_identical"]
    assert prims["Matmul"]["n"] == 4 and prims["CustomKernel:native_tiled_decode_own"]["n"] == 1
    assert "Transpose" not in setup["by_primitive"]
    assert layer["non_view"] < ref["traced"]["per_layer"]["non_view"]
    # Outside the layers only the embedding lookup computes anything.
    assert {k for k in setup["by_primitive"]} - {"Gather"} <= {
        "Slice", "Reshape", "Squeeze", "ExpandDims", "Broadcast", "Transpose"}
    assert setup["non_view"] == 1
    assert eng["issued"]["non_view"] < eng["traced"]["total_non_view"]
