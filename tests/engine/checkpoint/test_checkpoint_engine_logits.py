"""Checkpoints through the Engine reproduce the next-token logits bit for bit, per KV format.

A request runs (prefill in chunks, then decode, pipelined), its checkpoint is saved when it
finishes, and a new request whose prompt is what the checkpoint covers plus the next token
restores it: in the same engine and in a fresh Engine of the same configuration; a longer run of
the same request, alone, is the reference for the tokens after the checkpoint. The
restored request computes that next token as a one-token chunk at the same position, over the same
KV rows (copied verbatim into other physical pages), alone in its step, exactly as the original
computed it in its decode step; so its logits, read through `Engine(logits_tap=...)`, must equal
the original's float for float, and so must the logits of the tokens after it.
"""
import numpy as np
import pytest

from engine.config import EngineConfig
from engine import Engine
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from tests.engine_helpers import PAGE_BYTES_LLAMA, prompt, run, tokens, wait_idle

FORMATS = ("native", "int8", "k8v4", "int4", "int4-tail")
N = 12        # tokens the reference request generates
SAVE_AT = 4   # tokens the checkpointed request generates before it finishes and is saved
MORE = 3      # tokens the restored request generates (each one's logits compared)


class Tap:
    """Collects (request_id, token_index) -> logits from the engine thread."""

    def __init__(self):
        self.logits: dict[tuple[str, int], np.ndarray] = {}

    def __call__(self, request_id, index, logits):
        assert (request_id, index) not in self.logits, "a token's logits were reported twice"
        self.logits[(request_id, index)] = logits


def greq(rid, ids, max_tokens, restore=None, checkpoint_to=None):
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True), restore_from=restore,
                             checkpoint_to=checkpoint_to)


async def _collect(eng, r):
    return [d async for d in eng.generate(r)]


def _engine(model_dir, fmt, tap):
    cfg = EngineConfig(model=model_dir, kv_budget_bytes=32 * PAGE_BYTES_LLAMA, page_tokens=16,
                       max_step_tokens=16, kv_format=fmt, checkpoint_key="k1")
    return Engine(cfg, logits_tap=tap)


def _assert_same_logits(tap_a, rid_a, first_a, tap_b, rid_b, count):
    for j in range(count):
        want = tap_a.logits[(rid_a, first_a + j)]
        got = tap_b.logits[(rid_b, j)]
        assert want.dtype == got.dtype == np.float32 and want.shape == got.shape
        assert np.array_equal(got, want), (
            f"token {j} after the checkpoint: max |diff| {np.abs(got - want).max()}")


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_restored_request_reproduces_next_token_logits_bit_for_bit(tiny_model_dirs, tmp_path,
                                                                  arch, fmt):
    model_dir = tiny_model_dirs[arch]
    tap = Tap()
    eng = _engine(model_dir, fmt, tap)
    fresh_tap = Tap()
    fresh = None
    try:
        ids = prompt(21, seed=7)   # 16 + 5 tokens: two prefill chunks, the second reads pages
        # Saved at the request's finish, between steps: what the checkpoint covers cannot depend
        # on how far the engine ran ahead of this reader (a save asked for mid-stream raced the
        # request's end on a slow box).
        saved = run(_collect(eng, greq("saved", ids, SAVE_AT, checkpoint_to=str(tmp_path / "ck"))))
        manifest = saved[-1].checkpoint
        assert manifest and "error" not in manifest, manifest
        out = run(_collect(eng, greq("orig", ids, N)))
        full = ids + tokens(out)
        assert tokens(saved) == tokens(out)[:SAVE_AT]
        n = manifest["num_tokens"]
        assert len(ids) < n and n + 1 + MORE <= len(full)
        # Every generated token's logits were reported once, and greedy picked their argmax.
        assert [int(tap.logits[("orig", i)].argmax()) for i in range(N)] == tokens(out)
        # The original computed full[n] at position n in output step k: its logits predict
        # full[n + 1], as do the restored request's first logits.
        k = n + 1 - len(ids)
        restored_ids = full[:n + 1]

        back = run(_collect(eng, greq("restored", restored_ids, MORE,
                                      restore=str(tmp_path / "ck"))))
        assert back[-1].usage.cached_tokens == n
        assert tokens(back) == full[n + 1:n + 1 + MORE]
        _assert_same_logits(tap, "orig", k, tap, "restored", MORE)
        wait_idle(eng)

        fresh = _engine(model_dir, fmt, fresh_tap)
        back = run(_collect(fresh, greq("restored", restored_ids, MORE,
                                        restore=str(tmp_path / "ck"))))
        assert back[-1].usage.cached_tokens == n
        _assert_same_logits(tap, "orig", k, fresh_tap, "restored", MORE)
        wait_idle(fresh)
    finally:
        eng.shutdown()
        if fresh is not None:
            fresh.shutdown()
