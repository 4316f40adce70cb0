"""In what order `python -m loadtest chat` plays its plan against its targets.

- sequential (the default): one leg per target, in the order given. A target that the command
  serves itself (`--serve LABEL=CONFIG`) is started for its leg and stopped when the leg ends,
  before the next leg's server starts, so each server is fresh and alone on the box, and no
  target's TTFT includes another target's prefills. Every leg plays the identical plan (one
  plan file: the same conversations, turn texts, tenants, start offsets and think times, from
  one seed), timed from the leg's own start.
- simultaneous (the old mode): one leg with every target; every conversation is sent to all of
  them at once, so they share the box's load (and its contention) within one Locust run.

The legs are computed here and run through callables, so the order (who is up when) is
testable without servers (tests/loadtest/test_chat_legs.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

SEQUENTIAL, SIMULTANEOUS = "sequential", "simultaneous"
MODES = (SEQUENTIAL, SIMULTANEOUS)


@dataclass(frozen=True)
class Entry:
    """A target: a running server (`url`) or a config to serve for its leg (`config`)."""
    label: str
    model: str
    url: str | None = None
    config: str | None = None

    def __post_init__(self):
        if (self.url is None) == (self.config is None):
            raise ValueError(f"target {self.label!r}: give exactly one of url and config")


def legs(entries: list[Entry], mode: str) -> list[tuple[Entry, ...]]:
    """The targets of each Locust run, in the order they run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"target labels must be unique, got {labels}")
    if not entries:
        return []
    if mode == SIMULTANEOUS:
        return [tuple(entries)]
    return [(e,) for e in entries]


# start(entry) -> (target dict {"label", "url", "model"}, stop()); run_leg(targets) -> result
Start = Callable[[Entry], tuple[dict, Callable[[], None]]]
RunLeg = Callable[[list[dict]], dict]


def run_legs(entries: list[Entry], mode: str, start: Start, run_leg: RunLeg) -> list[dict]:
    """Run each leg with its served targets started just before it and stopped just after it
    (also when starting or the leg fails), so no two legs' servers are ever up together."""
    results = []
    for leg in legs(entries, mode):
        stops: list[Callable[[], None]] = []
        try:
            targets = []
            for e in leg:
                if e.config is None:
                    targets.append({"label": e.label, "url": e.url.rstrip("/"),
                                    "model": e.model})
                else:
                    target, stop = start(e)
                    stops.append(stop)
                    targets.append(target)
            results.append(run_leg(targets))
        finally:
            stop_all(stops)
    return results


def stop_all(stops: list[Callable[[], None]]) -> None:
    """Call every stop (last started first) even if one raises; then raise the first error."""
    error = None
    for stop in reversed(stops):
        try:
            stop()
        except BaseException as e:  # noqa: BLE001 - the other servers must still be stopped
            error = error or e
    if error is not None:
        raise error
