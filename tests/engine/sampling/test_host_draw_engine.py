"""CPU engines draw sampled tokens on the host (KernelChoices.cpu_sampling; engine/sampling/
sampler.py `_draw_host`): the real Engine on the tiny llama takes that draw for temperature > 0
rows, keeps seeded requests reproducible alone and batched with it, and leaves it when the
choice is off (the MLX draw GPUs take)."""
import asyncio

import pytest

from engine.attention.choices import KernelChoices
from engine.config import EngineConfig
from engine.loop import Engine
from engine.sampling import sampler
from tests.engine_helpers import PAGE_BYTES_LLAMA, collect, req, run, tokens


@pytest.fixture
def host_draws(monkeypatch):
    """Rows drawn by `_draw_host`, recorded (the draw itself runs unchanged)."""
    seen = []
    real = sampler._draw_host

    def recording(masked, rows):
        seen.append(len(rows))
        return real(masked, rows)

    monkeypatch.setattr(sampler, "_draw_host", recording)
    return seen


def _engine(model, kernels):
    return Engine(EngineConfig(model=model, kv_budget_bytes=64 * PAGE_BYTES_LLAMA, page_tokens=16,
                               max_step_tokens=48), kernels=kernels)


@pytest.mark.parametrize("on", [True, False], ids=["host_draw", "mlx_draw"])
def test_cpu_engine_draws_on_the_host_and_seeds_stay_reproducible(tiny_llama, host_draws, on):
    eng = _engine(tiny_llama, KernelChoices(cpu_sampling=on))
    try:
        sampled = dict(temperature=1.0, seed=77, max_tokens=12, ignore_eos=True)
        alone = tokens(run(collect(eng, req("a", n_prompt=14, pseed=3, **sampled))))

        async def batched():
            return await asyncio.gather(
                # ignore_eos: an unseeded row may draw EOS early (CI on 3166e9b: fewer than 9
                # tokens, so fewer draws than the count below).
                collect(eng, req("other", n_prompt=25, pseed=4, temperature=0.7, max_tokens=9,
                                 ignore_eos=True)),
                collect(eng, req("b", n_prompt=14, pseed=3, **sampled)))
        other, b = run(batched())
        assert tokens(b) == alone and len(alone) == 12 and len(tokens(other)) == 9
        greedy_only = len(host_draws)
        run(collect(eng, req("g", n_prompt=10, pseed=5, temperature=0, max_tokens=6)))
        assert len(host_draws) == greedy_only       # greedy rows never draw
    finally:
        eng.shutdown()
    # Every sampled token went through the host draw when on, none when off.
    assert (sum(host_draws) >= 12 + 12 + 9) if on else host_draws == []
