"""Builders shared by the scheduler tests: a real page pool and ledger on a small budget."""
from engine.kv.budget import ByteLedger, build_cost_model
from engine.kv.pages import PagePool
from engine.sampling.params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.seq import Seq

BPT = 100          # bytes per token (any positive number works for bookkeeping)
PAGE = 4           # tokens per page


def make_scheduler(pages=32, max_num_seqs=4, max_step_tokens=16, max_waiting=64, eos=(0,)):
    cm = build_cost_model(budget_bytes=pages * PAGE * BPT, bytes_per_token=BPT, page_tokens=PAGE,
                          fixed_bytes_per_request=0, max_num_seqs=max_num_seqs, token_limit=10_000)
    pool = PagePool(cm.budget_bytes // (PAGE * BPT), PAGE)
    return Scheduler(pool, ByteLedger(cm), max_num_seqs=max_num_seqs,
                     max_step_tokens=max_step_tokens, max_waiting=max_waiting, eos_ids=set(eos))


def seq(rid, prompt_len=5, max_tokens=4, deadline=None, **params):
    return Seq(rid, list(range(1, prompt_len + 1)),
               SamplingParams(max_tokens=max_tokens, **params), deadline=deadline, arrival=0.0)


def run_step(sch, now=0.0, token=7):
    """Schedule, 'run' and retire one step, as the loop does (token for every sampling chunk)."""
    step = sch.schedule(now)
    if step is None:
        return None, []
    new = sch.complete(step, [token if c.samples else None for c in step.chunks], now)
    sch.reclaim(step.step_id)
    return step, new
