"""Checkpoints through the Engine: save a running request's KV, restore it into a new request
that continues with the same tokens; bad checkpoints are refused before anything is allocated."""
import json

import pytest

from engine.checkpoint.format import CheckpointError
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from tests.engine_helpers import make_engine, prompt, run, tokens, wait_idle

# The original request may generate this many tokens: far more than the reader needs before it
# asks for the save, so the request is still running then however the reader lags the engine
# thread; it is cancelled once saved.
N = 200


def greq(rid, ids, max_tokens, restore=None):
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True), restore_from=restore)


MORE = 4   # tokens streamed after those the checkpoint covers, before the cancel


def generate_and_save(eng, ids, path, after=4):
    """Stream a request; after `after` deltas save its checkpoint (between two steps); cancel it
    once MORE tokens past what the checkpoint covers have streamed; return the deltas and the
    manifest."""
    async def go():
        out, manifest = [], None
        async for d in eng.generate(greq("orig", ids, N)):
            out.append(d)
            if len(out) == after:
                manifest = eng.save_checkpoint("orig", path)
            streamed = len(ids) + len(tokens(out))
            if manifest is not None and streamed >= manifest["num_tokens"] + 1 + MORE:
                eng.cancel("orig")
        return out, manifest
    return run(go())


@pytest.fixture(scope="module", params=["native", "int8", "int4"])
def eng(request, tiny_llama):
    e = make_engine(tiny_llama, pages=32, max_step_tokens=16, kv_format=request.param,
                    checkpoint_key="k1")
    yield e
    e.shutdown()


def test_restore_continues_with_the_same_tokens(eng, tmp_path):
    ids = prompt(21, seed=3)
    out, manifest = generate_and_save(eng, ids, tmp_path / "ck")
    full = ids + tokens(out)
    n = manifest["num_tokens"]
    assert len(ids) < n < len(full) and manifest["hmac"]
    # The new request's prompt is what the checkpoint covers plus the next token.
    restored = run(_collect(eng, greq("restored", full[:n + 1], MORE,
                                      restore=str(tmp_path / "ck"))))
    assert tokens(restored) == full[n + 1:n + 1 + MORE]
    assert restored[-1].usage.cached_tokens == n
    s = wait_idle(eng)
    assert s.kv_bytes_reserved == 0


async def _collect(eng, r):
    return [d async for d in eng.generate(r)]


def test_bad_checkpoints_are_refused_before_allocating(eng, tiny_llama, tmp_path):
    ids = prompt(21, seed=4)
    out, manifest = generate_and_save(eng, ids, tmp_path / "ck")
    full = ids + tokens(out)
    n = manifest["num_tokens"]
    ok = full[:n + 1]
    before = eng.stats()
    for bad_ids, match in ((ok[:n], "whole prompt"), ([7] + ok[1:], "different token ids")):
        with pytest.raises(CheckpointError, match=match):
            run(_collect(eng, greq("bad", bad_ids, 2, restore=str(tmp_path / "ck"))))
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    m["num_tokens"] -= 1
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="signature"):
        run(_collect(eng, greq("tampered", ok, 2, restore=str(tmp_path / "ck"))))
    with pytest.raises(CheckpointError, match="not running"):
        eng.save_checkpoint("nobody", tmp_path / "x")
    s = wait_idle(eng)
    assert s.requests["refused_checkpoint"] == 3
    assert s.steps_total == before.steps_total          # nothing ran, nothing allocated


def test_other_format_refuses_the_checkpoint(tiny_llama, tmp_path):
    a = make_engine(tiny_llama, pages=16, max_step_tokens=16, kv_format="int8")
    b = make_engine(tiny_llama, pages=16, max_step_tokens=16, kv_format="int4")
    try:
        ids = prompt(21, seed=5)
        out, manifest = generate_and_save(a, ids, tmp_path / "ck")
        full = ids + tokens(out)
        with pytest.raises(CheckpointError, match="storage"):
            run(_collect(b, greq("x", full[:manifest["num_tokens"] + 1], 2,
                                 restore=str(tmp_path / "ck"))))
        assert b.stats().kv_pages_used == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_finished_request_saves_and_a_new_request_continues_it(eng, tmp_path):
    ids = prompt(21, seed=6)
    longer = tokens(run(_collect(eng, greq("long", ids, 16))))
    r = GenerationRequest("short", ids, SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True),
                          checkpoint_to=str(tmp_path / "fin"))
    out = run(_collect(eng, r))
    assert out[-1].finish_reason == "length" and tokens(out) == longer[:8]
    manifest = out[-1].checkpoint
    assert manifest["num_tokens"] == 21 + 8 - 1     # the last sampled token has no KV yet
    cont = run(_collect(eng, greq("cont", ids + longer[:8], 8, restore=str(tmp_path / "fin"))))
    assert tokens(cont) == longer[8:16] and cont[-1].usage.cached_tokens == 28
    wait_idle(eng)
