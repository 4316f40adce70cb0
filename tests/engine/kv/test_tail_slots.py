"""The native tail map's slot hand-over (engine/kv/tails.py, TailMap.plan): a slot a page filled
by a write gives back goes to a new page of the same write only when no other slot is free, and
the plan says when it did (`reused`): the CUDA page-key write kernel writes tails in place, which
is safe only when no row of a launch writes a slot another row's fill or attention reads."""
import numpy as np
import pytest

from capacity.formats import KVFormatError
from engine.kv.tails import TailMap

T = 16


def test_a_given_back_slot_waits_for_a_later_write_while_another_is_free():
    tails = TailMap(3, T)
    tails.plan(np.array([4, 5]), np.array([T - 2, 3]))         # pages 4 and 5 take slots 0, 1
    held = dict(tails.slot_of)
    plan = tails.plan(np.array([4, 6]), np.array([T - 1, 0]))  # 4 fills as page 6 starts
    assert not plan.reused and not tails.reused
    assert tails.slot_of[6] not in held.values() and 4 not in tails.slot_of
    plan = tails.plan(np.array([7]), np.array([0]))            # a later write: 4's slot again
    assert tails.slot_of[7] == held[4] and not plan.reused


def test_with_no_other_slot_free_the_given_back_one_is_taken_and_said():
    tails = TailMap(2, T)
    tails.plan(np.array([4, 5]), np.array([T - 2, 3]))
    slot = tails.slot_of[4]
    before, write = tails.decode_slots(np.array([4, 6]), np.array([T - 1, 0]))
    assert tails.reused and write[1] == slot == before[0]
    with pytest.raises(KVFormatError, match="exhausted"):   # more partial pages than slots
        tails.plan(np.array([5, 6, 7]), np.array([4, 1, 0]))


def test_a_write_that_fills_nothing_reports_no_reuse():
    tails = TailMap(1, T)
    tails.plan(np.array([2]), np.array([0]))
    tails.reused = True
    tails.plan(np.array([2]), np.array([1]))
    assert not tails.reused


def _plans(small_write: int, monkeypatch, seed: int) -> list:
    """A random run of writes (decode rows and prompt chunks, pages filling, new pages, pages
    released) through a TailMap whose Python-ids path takes writes of up to `small_write` rows:
    every plan's rows, slots and `reused`, and the map after each."""
    from engine.kv import tails as tails_module
    monkeypatch.setattr(tails_module, "SMALL_WRITE", small_write)
    rng = np.random.default_rng(seed)
    tails, ends, next_page, out = TailMap(6, T), {}, [100], []
    pages_of = {}

    def page_at(seq, pos):
        book = pages_of.setdefault(seq, [])
        while len(book) <= pos // T:
            book.append(next_page[0])
            next_page[0] += 1
        return book[pos // T]

    for _ in range(120):
        if rng.random() < 0.1 and len(ends) > 1:      # a sequence ends: its pages go back
            seq = int(rng.choice(list(ends)))
            tails.release(pages_of.pop(seq))
            del ends[seq]
            continue
        seqs = sorted(set(int(s) for s in rng.choice(5, size=rng.integers(1, 4))))
        page, offset = [], []
        for seq in seqs:
            start = ends.get(seq, 0)
            n = 1 if seq in ends and rng.random() < 0.7 else int(rng.integers(1, 40))
            for pos in range(start, start + n):
                page.append(page_at(seq, pos))
                offset.append(pos % T)
            ends[seq] = start + n
        plan = tails.plan(np.array(page), np.array(offset))
        out.append((None if plan.rows is None else plan.rows.tolist(),
                    None if plan.slots is None else plan.slots.tolist(), plan.reused,
                    dict(tails.slot_of), dict(tails.before), list(tails._free)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_python_ids_path_plans_as_the_numpy_path(monkeypatch, seed):
    """`plan` takes small writes (decode steps) on Python ids and large ones on numpy arrays;
    both must give every write the same rows, slots, hand-overs and map."""
    numpy_path = _plans(0, monkeypatch, seed)
    python_path = _plans(10_000, monkeypatch, seed)
    assert python_path == numpy_path
    sizes = [len(p[0]) for p in numpy_path if p[0] is not None]
    assert max(sizes) > 1 and min(sizes) == 1     # prompt chunks and decode rows both planned
    filled = sum(len(set(a[3]) - set(b[3])) for a, b in zip(numpy_path, numpy_path[1:]))
    assert filled > 5                             # pages filled and gave their slots back
