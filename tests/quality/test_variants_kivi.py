"""The fake-quant int4-kivi variant (quality.variants) and the built engine format compute the same
logits: what the simulation graded is what the engine stores and reads (keys per channel over
each complete page, the partial page native, fresh rows exact)."""
import mlx.core as mx
import pytest

from engine.model.loader import load_model
from engine.sched.seq import Chunk
from quality import runs, variants


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return load_model(tiny_model_dirs["llama"])


def test_simulated_and_built_int4_kivi_agree(llama):
    seq = [(7 * i + 3) % 200 + 1 for i in range(150)]
    cuts = [0, 70, 100, 128, 139, 140, 141]   # mid-page chunks, a page filled mid-chunk, decode
    table = [4, 1, 6]
    sim = variants.make_runner(llama, "int4-kivi", 8)
    built = runs.make_runner(llama, "int4-kivi", 8)
    worst = 0.0
    for s, e in zip(cuts, cuts[1:]):
        chunk = [Chunk(0, seq[s:e], s, table)]
        a, b = sim.forward_all(chunk)[0], built.forward_all(chunk)[0]
        worst = max(worst, mx.abs(a - b).max().item())
    assert worst < 1e-4, worst
    # and both differ from native once full pages are read as codes
    native = runs.make_runner(llama, "native", 8)
    for s, e in zip(cuts, cuts[1:]):
        n = native.forward_all([Chunk(0, seq[s:e], s, table)])[0]
    assert mx.abs(n - b).max().item() > 1e-3
