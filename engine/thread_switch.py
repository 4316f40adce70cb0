"""An on/off flag per thread, set for the length of a `with` block.

The CPU step hooks (engine/model/cpu_swiglu.py, engine/model/cpu_linear.py) replace a model
module's call for everyone who calls it, but must act only inside the runner's own CPU steps on
its own thread: mlx-lm, other engines' threads and compiled traces keep the original call.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager


class ThreadSwitch:
    """`switch.on` is what the innermost `with switch.set(...)` on this thread said (else off)."""

    def __init__(self):
        self._local = threading.local()

    @property
    def on(self) -> bool:
        return getattr(self._local, "on", False)

    @contextmanager
    def set(self, on: bool = True):
        before = self.on
        self._local.on = on
        try:
            yield
        finally:
            self._local.on = before
