"""Fused q/k/v and gate/up projections (engine/model/fuse.py) compute what the model computed."""
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from bench.synthetic import build_tiny_model
from engine.model.fuse import fuse_projections


def _load(path):
    from mlx_lm.utils import load
    model, _ = load(str(path))
    model.set_dtype(mx.float32)
    return model


def _size(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "gpt_oss"])
def test_fused_model_gives_the_same_logits(tmp_path, arch):
    path = build_tiny_model(arch, tmp_path / arch)
    ids = mx.array([[5, 17, 33, 2, 9, 41, 7, 12]])
    plain = _load(path)
    fused = _load(path)
    before = _size(fused)
    assert fuse_projections(fused) > 0
    assert _size(fused) == before   # parameters live once, in the fused layers
    names = {k for k, _ in tree_flatten(fused.parameters())}
    assert not any(".q_proj." in k for k in names) and any(".qkv_proj." in k for k in names)
    a, b = plain(ids), fused(ids)
    assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()


def test_quantized_projections_fuse(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m")
    plain, fused = _load(path), _load(path)
    for m in (plain, fused):
        nn.quantize(m, group_size=32, bits=4)
    assert fuse_projections(fused) == 2 * len(fused.model.layers)
    assert isinstance(fused.model.layers[0].self_attn.qkv_proj, nn.QuantizedLinear)
    ids = mx.array([[3, 4, 5, 6]])
    assert mx.allclose(plain(ids), fused(ids), rtol=1e-5, atol=1e-5).item()


def test_a_part_called_on_another_input_computes_its_own_rows():
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    wk = attn.k_proj.weight
    bk = attn.k_proj.bias
    assert fuse_projections(attn) == 1
    x, other = mx.random.normal((2, 8)), mx.random.normal((2, 8))
    attn.q_proj(x)
    # A model that projects keys from another tensor still gets k_proj(other).
    assert mx.allclose(attn.k_proj(other), other @ wk.T + bk, atol=1e-5).item()
    assert mx.allclose(attn.v_proj(x), attn.qkv_proj(x)[:, 12:], atol=1e-6).item()


def test_mismatched_parts_stay_as_they_were():
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=True)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(6, 4)
    assert fuse_projections(mlp) == 0 and fuse_projections(attn) == 0
    assert isinstance(mlp.gate_proj, nn.Linear) and "gate_up_proj" not in mlp
    assert isinstance(attn.v_proj, nn.Linear) and "qkv_proj" not in attn


def test_engine_fuses_by_default_and_can_be_told_not_to(tmp_path):
    """The config reaches the load: an Engine's model is fused unless told not to, and both
    generate the same greedy tokens."""
    from engine.config import EngineConfig
    from engine import Engine
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams
    from tests.engine_helpers import collect, run, tokens

    path = str(build_tiny_model("llama", tmp_path / "m"))
    assert EngineConfig(model=path).fuse_projections is True
    outs = {}
    for fuse in (True, False):
        eng = Engine(EngineConfig(model=path, fuse_projections=fuse, max_num_seqs=2))
        try:
            attn = eng.loaded.model.model.layers[0].self_attn
            assert ("qkv_proj" in attn) == fuse
            req = GenerationRequest("r", [5, 17, 33, 2, 9], SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True))
            outs[fuse] = tokens(run(collect(eng, req)))
        finally:
            eng.shutdown()
    assert len(outs[True]) == 12 and outs[True] == outs[False]
