"""A fixed-capacity FIFO of floats backed by array('d'): 8 bytes a sample, so 10,000 identities with
full windows stay in tens of megabytes instead of hundreds (a deque of floats costs ~32 B a sample)."""
from __future__ import annotations

import math
from array import array


class Ring:
    __slots__ = ("capacity", "_data", "_head", "_sorted")

    def __init__(self, capacity: int, values=()):
        if capacity < 1:
            raise ValueError("ring capacity must be >= 1")
        self.capacity = capacity
        self._data = array("d")
        self._head = 0          # index of the oldest value once the ring is full
        self._sorted = None     # cached sorted copy; medians are read far more often than written
        for v in values:
            self.append(v)

    def append(self, value: float) -> None:
        if len(self._data) < self.capacity:
            self._data.append(value)
        else:
            self._data[self._head] = value
            self._head = (self._head + 1) % self.capacity
        self._sorted = None

    def __len__(self) -> int:
        return len(self._data)

    def values(self) -> list[float]:
        """Oldest first."""
        return list(self._data[self._head:]) + list(self._data[:self._head])

    def median(self) -> float | None:
        if not self._data:
            return None
        if self._sorted is None:
            self._sorted = sorted(self._data)
        s, n = self._sorted, len(self._sorted)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0
