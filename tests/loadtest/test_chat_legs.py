"""The chat command's run order (loadtest/chat_legs.py, no server needed): by default one target
after another, each served target started for its own leg and stopped before the next starts,
every leg playing the identical plan; `--simultaneous` keeps the old one-leg run; and the
summary built from legs reports each target's metrics and the first-over-second ratios."""
from __future__ import annotations

import pytest

from loadtest import chat_legs, chat_plan, chat_summary, multiturn

Entry = chat_legs.Entry


class Box:
    """Fake servers and a fake Locust: a log of who was up when each leg ran."""

    def __init__(self, fail_on: str | None = None, alone: bool = True):
        self.up: set[str] = set()
        self.log: list[tuple] = []
        self.fail_on, self.alone = fail_on, alone

    def start(self, e: Entry):
        assert not (self.alone and self.up), f"{e.label} started while {self.up} still up"
        self.up.add(e.label)
        self.log.append(("start", e.label))

        def stop():
            self.up.discard(e.label)
            self.log.append(("stop", e.label))
        return {"label": e.label, "url": f"http://{e.label}", "model": e.model}, stop

    def run_leg(self, targets: list[dict]) -> dict:
        labels = [t["label"] for t in targets]
        self.log.append(("run", tuple(labels), frozenset(self.up)))
        if self.fail_on in labels:
            raise RuntimeError("locust died")
        return {"labels": labels}


def served(*labels):
    return [Entry(lab, "m", config=f"{lab}.yaml") for lab in labels]


def test_sequential_runs_each_target_alone_on_a_fresh_server_in_order():
    box = Box()
    out = chat_legs.run_legs(served("prefix", "capacity"), chat_legs.SEQUENTIAL, box.start,
                             box.run_leg)
    assert [r["labels"] for r in out] == [["prefix"], ["capacity"]]
    assert box.log == [("start", "prefix"), ("run", ("prefix",), frozenset({"prefix"})),
                       ("stop", "prefix"),
                       ("start", "capacity"), ("run", ("capacity",), frozenset({"capacity"})),
                       ("stop", "capacity")]


def test_simultaneous_starts_every_server_before_its_one_leg():
    box = Box(alone=False)
    out = chat_legs.run_legs(served("prefix", "capacity"), chat_legs.SIMULTANEOUS, box.start,
                             box.run_leg)
    assert [r["labels"] for r in out] == [["prefix", "capacity"]]
    assert box.log[2] == ("run", ("prefix", "capacity"), frozenset({"prefix", "capacity"}))
    assert box.up == set() and box.log[-2:] == [("stop", "capacity"), ("stop", "prefix")]


def test_a_failing_leg_still_stops_its_server_and_runs_no_later_leg():
    box = Box(fail_on="prefix")
    with pytest.raises(RuntimeError, match="locust died"):
        chat_legs.run_legs(served("prefix", "capacity"), chat_legs.SEQUENTIAL, box.start,
                           box.run_leg)
    assert box.up == set() and ("start", "capacity") not in box.log


def test_every_server_is_stopped_even_when_one_stop_fails():
    stopped = []

    def start(e: Entry):
        def stop():
            stopped.append(e.label)
            if e.label == "b":
                raise OSError("b would not die")
        return {"label": e.label, "url": "u", "model": "m"}, stop

    with pytest.raises(OSError, match="b would not die"):
        chat_legs.run_legs(served("a", "b", "c"), chat_legs.SIMULTANEOUS, start,
                           lambda ts: {"labels": [t["label"] for t in ts]})
    assert stopped == ["c", "b", "a"]


def test_running_targets_are_not_started_and_keep_their_order():
    box = Box()
    todo = [Entry("ext", "m", url="http://ext:1/"), *served("mine")]
    chat_legs.run_legs(todo, chat_legs.SEQUENTIAL, box.start, box.run_leg)
    assert [x[:2] for x in box.log] == [("run", ("ext",)), ("start", "mine"),
                                        ("run", ("mine",)), ("stop", "mine")]


@pytest.mark.parametrize("todo, mode, match", [
    (served("a", "a"), chat_legs.SEQUENTIAL, "unique"),
    (served("a"), "interleaved", "mode"),
])
def test_bad_legs_are_refused(todo, mode, match):
    with pytest.raises(ValueError, match=match):
        chat_legs.legs(todo, mode)


def test_an_entry_is_a_url_or_a_config():
    with pytest.raises(ValueError, match="exactly one"):
        Entry("x", "m")
    with pytest.raises(ValueError, match="exactly one"):
        Entry("x", "m", url="u", config="c")


def test_cli_defaults_to_sequential_with_a_flag_for_the_old_mode():
    base = ["--out", "o", "--serve", "prefix=p.yaml", "--serve", "capacity=c.yaml",
            "--model", "smollm2", "--target", "label=ext,url=http://h:1/,model=m"]
    args = multiturn.parse_args(base)
    assert args.mode == chat_legs.SEQUENTIAL
    assert multiturn.parse_args(base + ["--simultaneous"]).mode == chat_legs.SIMULTANEOUS
    todo = multiturn.entries(args)
    assert [(e.label, e.url, e.config) for e in todo] == [
        ("ext", "http://h:1", None), ("prefix", None, "p.yaml"), ("capacity", None, "c.yaml")]
    with pytest.raises(SystemExit, match="--model"):
        multiturn.entries(multiturn.parse_args(["--out", "o", "--serve", "a=a.yaml"]))


def _row(target, conv, turn, replica, ttft_s, history, cached, sent):
    return {"target": target, "conversation": conv, "turn": turn, "replica": replica,
            "status": 200, "error": None, "chunk_times": [ttft_s, ttft_s + 1.0],
            "history_tokens": history, "cached_tokens": cached, "prompt_tokens": (history or 0) + 10,
            "output_tokens": 4, "sent": sent, "done": ttft_s + 1.0}


def _leg(label, rows, load=(1.0, 2.0)):
    return {"labels": [label], "locust_exit_code": 0, "wall_s": 10.0, "started_utc": "T",
            "loadavg_1m_before": load[0], "loadavg_1m_after": load[1], "records": rows,
            "router_events": {label: {"holds": 2.0}}, "replica_load": {label: {"samples": 3}}}


def test_summary_of_sequential_legs_keeps_their_order_and_gives_ratios():
    prefix = [_row("prefix", 0, 1, "r1", 1.0, None, 0, 0.0),
              _row("prefix", 0, 2, "r1", 0.2, 100, 90, 5.0)]
    capacity = [_row("capacity", 0, 1, "r1", 1.0, None, 0, 0.0),
                _row("capacity", 0, 2, "r2", 0.8, 100, 0, 5.0)]
    s = chat_summary.build({"seed": 0}, chat_legs.SEQUENTIAL,
                           [_leg("prefix", prefix, (1.0, 2.0)),
                            _leg("capacity", capacity, (3.0, 4.0))], 2, "abc")
    assert s["mode"] == "sequential" and s["order"] == [["prefix"], ["capacity"]]
    assert s["host"]["loadavg_1m_before"] == 1.0 and s["host"]["loadavg_1m_after"] == 4.0
    assert [leg["loadavg_1m_before"] for leg in s["legs"]] == [1.0, 3.0]
    assert list(s["targets"]) == ["prefix", "capacity"] and s["wall_s"] == 20.0
    t = s["targets"]
    assert t["prefix"]["cached_share_of_history"] == 0.9
    assert t["capacity"]["later_turns"]["switched"] == 1
    assert t["capacity"]["router_events"] == {"holds": 2.0}
    r = s["ratios_first_over_second"]
    assert r["ttft_p50_turns2plus_ms"] == pytest.approx(0.25)
    assert r["cached_share_of_history"] is None       # capacity cached nothing: no ratio


def test_every_leg_plays_the_same_plan():
    # The plan is built once from the seed and written once; every leg reads that file.
    p = chat_plan.ChatParams(conversations=12, system_words=(400, 700), think_s=5.0)
    a, b = chat_plan.build(p), chat_plan.build(p)
    assert chat_plan.to_json(p, a) == chat_plan.to_json(p, b)
    assert [(c.start_s, c.tenant, c.users) for c in a] == [(c.start_s, c.tenant, c.users)
                                                           for c in b]
