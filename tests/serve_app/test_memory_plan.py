"""Whole-box memory: replicas that may share a node fit together (weights + KV + workspace), or
the config is refused at deploy with the numbers; default KV budgets are each model's share."""
import pytest

from serve_app.config import ConfigError, parse_config
from capacity.pricing import step_workspace_bytes
from serve_app.memory_plan import (GIB, model_step_workspace_bytes, plan_memory, weight_bytes,
                                   with_kv_budgets)


def config(tiny_llama, *models, **memory):
    return parse_config({"memory": {"workspace_bytes_per_replica": 0, **memory},
                         "models": [{"id": mid, "path": tiny_llama, **kw} for mid, kw in models]})


def fixed(tiny_llama) -> int:
    """Weights + step workspace of one tiny-llama replica (float32, default engine knobs)."""
    m = config(tiny_llama, ("a", {})).models[0]
    return weight_bytes(tiny_llama, 4) + model_step_workspace_bytes(m, 4)


def test_weights_are_counted_at_the_compute_dtype(tiny_llama):
    f32, bf16 = weight_bytes(tiny_llama, 4), weight_bytes(tiny_llama, 2)
    assert f32 > 0 and f32 == 2 * bf16     # the tiny llama's tensors are all floating point


def test_default_kv_budgets_are_shares_that_fit_together(tiny_llama):
    cfg = config(tiny_llama, ("a", {"replicas": 2}), ("b", {}), node_bytes=4 * GIB,
                 budget_fraction=0.5)
    plan = plan_memory(cfg, itemsize=4)
    weights = fixed(tiny_llama)
    assert plan.kv_share_bytes == (2 * GIB - 3 * weights) // 3
    budgets = {m.id: m.kv_budget_bytes for m in with_kv_budgets(cfg, plan)}
    assert budgets == {"a": plan.kv_share_bytes, "b": plan.kv_share_bytes}
    # Together: weights + KV of every replica within the usable share of the node.
    assert 3 * (weights + plan.kv_share_bytes) <= plan.usable_bytes


def test_an_explicit_budget_is_kept_and_the_rest_share_what_is_left(tiny_llama):
    cfg = config(tiny_llama, ("a", {"kv_budget_bytes": GIB}), ("b", {}), node_bytes=4 * GIB,
                 budget_fraction=0.5)
    plan = plan_memory(cfg, itemsize=4)
    assert plan.kv_budget_for("a") == GIB
    assert plan.kv_budget_for("b") == GIB - 2 * fixed(tiny_llama)


def test_models_that_cannot_fit_together_are_refused_with_the_numbers(tiny_llama):
    cfg = config(tiny_llama, ("a", {"kv_budget_bytes": 3 * GIB}),
                 ("b", {"kv_budget_bytes": 2 * GIB}), node_bytes=8 * GIB, budget_fraction=0.5)
    with pytest.raises(ConfigError) as e:
        plan_memory(cfg, itemsize=4)
    msg = str(e.value)
    assert "do not fit together on one node: 4.00 GiB usable (0.5 of 8.00 GiB)" in msg
    assert "a: 1 replica(s)" in msg and "KV 3.00 GiB" in msg and "b: 1 replica(s)" in msg


def test_a_default_share_below_the_minimum_is_refused(tiny_llama):
    # 8 x (weights + 0.16 GiB of step workspace) of 2 GiB usable: 85 MiB of KV each
    cfg = config(tiny_llama, ("a", {"replicas": 8}), node_bytes=4 * GIB, budget_fraction=0.5,
                 min_kv_bytes_per_replica=128 << 20)
    with pytest.raises(ConfigError, match=r"KV per replica without an explicit budget"):
        plan_memory(cfg, itemsize=4)


def test_on_this_machine_the_plan_uses_no_more_than_most_of_what_is_free(tiny_llama):
    """A shared box: 8 GiB total but 2 GiB free now. The default pool must fit in what is
    free (a tenth of it left for others), not in a share of the total."""
    cfg = config(tiny_llama, ("a", {}), budget_fraction=0.75)
    plan = plan_memory(cfg, node_bytes=8 * GIB, available_bytes=2 * GIB, itemsize=4)
    assert plan.usable_bytes == int(2 * GIB * 0.9)
    assert plan.kv_share_bytes == plan.usable_bytes - fixed(tiny_llama)
    roomy = plan_memory(cfg, node_bytes=8 * GIB, available_bytes=7 * GIB, itemsize=4)
    assert roomy.usable_bytes == 6 * GIB                   # the configured share still rules
    with pytest.raises(ConfigError, match=r"bounded by 0.9 of the 0.01 GiB free now"):
        plan_memory(cfg, node_bytes=8 * GIB, available_bytes=10 << 20, itemsize=4)


def test_the_measured_default_is_this_machine_bounded_by_what_is_free(tiny_llama):
    from serve_app.memory_plan import available_memory_bytes

    plan = plan_memory(config(tiny_llama, ("a", {})), itemsize=4)
    assert plan.usable_bytes <= available_memory_bytes() * 1.05   # measured twice: drift


def test_spread_replicas_count_once_per_node(tiny_llama):
    packed = plan_memory(config(tiny_llama, ("a", {"replicas": 4}), node_bytes=4 * GIB),
                         itemsize=4)
    spread = plan_memory(config(tiny_llama, ("a", {"replicas": 4, "max_replicas_per_node": 1}),
                                node_bytes=4 * GIB), itemsize=4)
    assert spread.needs[0].replicas_on_node == 1 and packed.needs[0].replicas_on_node == 4
    assert spread.kv_share_bytes > 3 * packed.kv_share_bytes


def test_engine_memory_knobs_belong_to_the_serving_config():
    with pytest.raises(ConfigError, match=r"kv_memory_fraction on the model \(or under kv: and "
                                          r"memory:\)"):
        parse_config({"models": [{"id": "m", "path": "/x",
                                  "engine": {"kv_memory_fraction": 0.3}}]})


def _hub_config(path, **engine):
    return parse_config({"memory": {"workspace_bytes_per_replica": 0, "node_bytes": 4 * GIB},
                         "models": [{"id": "m", "path": path, "engine": engine}]})


def test_a_hub_id_in_the_local_hub_cache_is_planned_with_its_weight_bytes(tiny_llama, tmp_path,
                                                                         monkeypatch):
    """The hub cache's real layout (refs/main naming a snapshot folder), laid out by hand: the
    tests never touch the network."""
    import shutil

    import huggingface_hub.constants as hub

    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_llama, snap)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    plan = plan_memory(_hub_config("org/tiny", allow_hub=True), itemsize=4)
    assert plan.needs[0].weight_bytes == weight_bytes(tiny_llama, 4) > 0
    assert plan.kv_share_bytes == plan.usable_bytes - fixed(tiny_llama)


def test_a_hub_id_that_cannot_be_sized_or_loaded_is_refused_naming_it(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    with pytest.raises(ConfigError, match=r"model 'm': path 'org/absent' is not a local model "
                                          r"directory; set engine.allow_hub"):
        plan_memory(_hub_config("org/absent"), itemsize=4)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)   # no network in tests: the hub is away
    with pytest.raises(ConfigError, match=r"cannot size the weights of hub model 'org/absent'"):
        plan_memory(_hub_config("org/absent", allow_hub=True), itemsize=4)


def test_the_step_workspace_is_priced_from_the_geometry_not_a_flat_allowance(tiny_llama,
                                                                            tmp_path):
    """The tiny llama's weights with a long-context, many-head geometry (8B-like: 32 query / 8
    KV heads of 128, 32K context): its steps' transient (scores of a 512-token chunk against
    32K keys, 32 rows' gathered K/V) is far above the flat 512 MiB allowance, and a node that
    the flat allowance would have let it share is refused, naming the workspace."""
    import json
    import shutil

    big = tmp_path / "big"
    shutil.copytree(tiny_llama, big)
    geo = json.loads((big / "config.json").read_text())
    geo.update(num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               max_position_embeddings=32768)
    (big / "config.json").write_text(json.dumps(geo))
    memory = {"node_bytes": 16 * GIB, "budget_fraction": 0.75}
    cfg = parse_config({"memory": memory, "models": [{"id": "m", "path": str(big)}]})
    priced = step_workspace_bytes(query_heads=32, kv_heads=8, head_dim=128, token_limit=32768,
                                  max_step_tokens=512, max_num_seqs=32, kv_itemsize=2)
    # 512 x 32768 x 33 x 4 (scores + mask) + 32 x 32768 x 2 x 8 x 128 x 2 (gathered K/V)
    assert priced == 2_214_592_512 + 4_294_967_296
    plan = plan_memory(cfg, itemsize=2)
    assert plan.needs[0].workspace_bytes == priced
    assert plan.kv_share_bytes == 12 * GIB - weight_bytes(str(big), 2) - priced
    # A smaller chunk and context price less; the allowance stays the floor.
    small = plan_memory(parse_config({"memory": memory, "models": [
        {"id": "m", "path": str(big), "engine": {"max_step_tokens": 64, "max_model_len": 1024}}]}),
        itemsize=2)
    assert small.needs[0].workspace_bytes == 512 << 20
    with pytest.raises(ConfigError, match=r"workspace 6\.06 GiB"):
        plan_memory(parse_config({"memory": {"node_bytes": 8 * GIB, "budget_fraction": 0.75},
                                  "models": [{"id": "m", "path": str(big), "replicas": 2}]}),
                    itemsize=2)


def test_the_priced_step_workspace_bounds_a_measured_step():
    """A real step: orchard-tiny on this backend, seven short requests decoding while a long
    prompt prefills in 512-token chunks beside them; the most any step allocated beyond what
    was resident before it (MLX's peak, which the engine resets per step and reports when it
    releases the step) stays within the price the memory plan reserves for it."""
    import asyncio
    import random
    from pathlib import Path

    from engine import Engine
    from engine.config import EngineConfig
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams
    from serve_app.memory_plan import compute_itemsize

    tiny = str(Path(__file__).resolve().parents[2] / "models" / "orchard-tiny")
    releases = []
    eng = Engine(EngineConfig(model=tiny, kv_budget_bytes=256 << 20, max_num_seqs=8,
                              max_step_tokens=512, enable_prefix_caching=False),
                 trace=lambda kind, **kw: releases.append(kw) if kind == "release" else None)

    async def one(rid: int, n: int, max_tokens: int) -> None:
        rng = random.Random(rid)
        r = GenerationRequest(str(rid), [rng.randrange(4, 8000) for _ in range(n)],
                              SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                             ignore_eos=True))
        async for _ in eng.generate(r):
            pass

    async def load() -> None:
        await asyncio.gather(*[one(i, 40, 200) for i in range(7)], one(99, 3500, 8))
    try:
        asyncio.run(load())
    finally:
        eng.shutdown()
    measured = max(e["peak"] - e["active_before"] for e in releases)
    m = parse_config({"models": [{"id": "t", "path": tiny, "max_num_seqs": 8,
                                  "engine": {"max_step_tokens": 512}}]}).models[0]
    priced = model_step_workspace_bytes(m, compute_itemsize())
    assert 0 < measured <= priced, (measured, priced)
