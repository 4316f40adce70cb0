"""Random submit/cancel/deadline traffic through the real Engine (tiny llama, small budget): every
stream ends exactly once, refunds follow retirement, and the engine returns to zero when idle."""
import asyncio
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.errors import DeadlineUnmeetable, RequestTooLarge
from tests.engine_helpers import make_engine, req, wait_idle
from tests.engine.test_lifecycle import Trace

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 120), st.integers(1, 24), st.booleans(),
              st.sampled_from([None, 0.0, 0.05, 5.0])),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("sleep"), st.sampled_from([0.0, 0.002, 0.01])),
)


@pytest.fixture(scope="module")
def traced(tiny_llama):
    trace = Trace()
    eng = make_engine(tiny_llama, pages=12, max_num_seqs=4, max_step_tokens=32, trace=trace)
    yield eng, trace
    eng.shutdown()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(op, min_size=5, max_size=20))
def test_random_traffic_leaves_nothing_behind(traced, ops):
    eng, trace = traced
    before = eng.stats()

    async def consume(r):
        finals = 0
        n = 0
        try:
            async for d in eng.generate(r):
                n += len(d.token_ids)
                finals += d.finish_reason is not None
        except (RequestTooLarge, DeadlineUnmeetable):
            return "refused"
        assert finals == 1 and n <= r.params.max_tokens
        return "done"

    async def scenario():
        tasks, ids = [], []
        for i, o in enumerate(ops):
            if o[0] == "submit":
                _, n_prompt, max_tokens, sampled, dl = o
                rid = f"{time.monotonic_ns()}-{i}"
                r = req(rid, n_prompt=n_prompt, pseed=i, max_tokens=max_tokens,
                        temperature=0.8 if sampled else 0.0, seed=i,
                        deadline=None if dl is None else time.monotonic() + dl)
                ids.append(rid)
                tasks.append(asyncio.ensure_future(consume(r)))
            elif o[0] == "cancel":
                if ids:
                    eng.cancel(ids[o[1] % len(ids)])
            else:
                await asyncio.sleep(o[1])
        return await asyncio.gather(*tasks)

    asyncio.run(scenario())
    after = wait_idle(eng)
    assert after.kv_pages_used == 0 and after.kv_bytes_reserved == 0
    # Every admitted request was refunded exactly once, each after its last step retired.
    assert trace.assert_refunds_follow_retirement() == after.requests["admitted"]
    assert after.steps_total >= before.steps_total
