"""One memory limit put on a server's model process, enforced by the kernel where it can be.

`orchard bench memory` holds two servers to the same number of bytes. The limit applies to the
process that holds the model and its KV cache: `mlx_lm.server`'s only process, and Orchard's
model replica (a Ray worker; the ingress, controller and capacity actor are the fleet's fixed
cost and are reported apart).

Two ways to hold a process to it, chosen by `make_limit`:
- `cgroup` (Linux, cgroup v1 memory controller, root): the process moves into a fresh cgroup
  whose `memory.limit_in_bytes` is the limit less what the process already holds (those pages
  stay charged to the old cgroup), and going over gets it OOM-killed by the kernel, exactly
  what a user would see.
- `rss` (anywhere, e.g. macOS, or cgroup v2 where existing pages do not move with a process):
  a watchdog samples the resident set every 20 ms and SIGKILLs the process the first time it
  is over the limit. It can miss a spike shorter than a sample; the result says which way ran.
"""
from __future__ import annotations

import abc
import os
import signal
import threading
from dataclasses import dataclass

import psutil

CGROUP_V1_MEMORY = "/sys/fs/cgroup/memory"
RSS_SAMPLE_S = 0.02


@dataclass
class LimitReport:
    mode: str
    limit_bytes: int
    peak_bytes: int = 0
    killed: bool = False          # the kernel's OOM killer or the watchdog ended the process
    detail: str = ""


class MemoryLimit(abc.ABC):
    """Base: `adopt(pid)` puts the process under the limit; `report()` says what happened."""

    mode = "none"

    def __init__(self, limit_bytes: int, label: str):
        if limit_bytes <= 0:
            raise ValueError(f"memory limit must be positive, got {limit_bytes}")
        self.limit_bytes, self.label = limit_bytes, label
        self.pid: int | None = None

    @abc.abstractmethod
    def adopt(self, pid: int) -> None: ...

    @abc.abstractmethod
    def report(self) -> LimitReport: ...

    def close(self) -> None:
        pass


def _own_v1_memory_cgroup() -> str | None:
    """This process's cgroup v1 memory directory, if the controller is mounted and writable."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = os.path.join(CGROUP_V1_MEMORY, path.lstrip("/"))
            if os.path.isfile(os.path.join(d, "memory.limit_in_bytes")) and os.access(d, os.W_OK):
                return d
    return None


class CgroupV1Limit(MemoryLimit):
    mode = "cgroup"

    def __init__(self, limit_bytes: int, label: str, parent: str):
        super().__init__(limit_bytes, label)
        self.parent = parent
        self.path = os.path.join(parent, f"orchard-bench-{label}-{os.getpid()}")
        os.makedirs(self.path, exist_ok=True)
        self.resident_at_adoption = 0

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def adopt(self, pid: int) -> None:
        """Pages a process already holds stay charged where they were (recent kernels no longer
        move charges with a process), so the cgroup gets the limit less what the process holds
        now: from here on, resident-at-adoption + charged-since stays within the limit."""
        self.pid = pid
        rss = psutil.Process(pid).memory_info().rss
        if rss >= self.limit_bytes:
            raise RuntimeError(f"{self.label}: already {rss / 2**20:.0f} MiB resident, over the "
                               f"{self.limit_bytes / 2**20:.0f} MiB limit before any request")
        self.resident_at_adoption = rss
        self._write("memory.limit_in_bytes", str(self.limit_bytes - rss))
        self._write("cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0   # kernels before 4.13 do not count kills: report() also checks the process

    def report(self) -> LimitReport:
        kills = self.oom_kills()
        return LimitReport(self.mode, self.limit_bytes,
                           peak_bytes=self.resident_at_adoption + int(
                               self._read("memory.max_usage_in_bytes")),
                           killed=kills > 0 or (self.pid is not None and not _alive(self.pid)),
                           detail=f"cgroup v1, oom_kill {kills}")

    def close(self) -> None:
        """Move what is left back to the parent and remove the cgroup."""
        try:
            for pid in self._read("cgroup.procs").split():
                with open(os.path.join(self.parent, "cgroup.procs"), "w") as f:
                    f.write(pid)
            os.rmdir(self.path)
        except OSError:
            pass


class RssWatchdog(MemoryLimit):
    mode = "rss"

    def __init__(self, limit_bytes: int, label: str):
        super().__init__(limit_bytes, label)
        self._peak, self._killed = 0, False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def adopt(self, pid: int) -> None:
        self.pid = pid
        proc = psutil.Process(pid)
        rss = proc.memory_info().rss
        if rss > self.limit_bytes:
            raise RuntimeError(f"{self.label}: already {rss / 2**20:.0f} MiB resident, over the "
                               f"{self.limit_bytes / 2**20:.0f} MiB limit before any request")
        self._thread = threading.Thread(target=self._watch, args=(proc,), daemon=True)
        self._thread.start()

    def _watch(self, proc: psutil.Process) -> None:
        while not self._stop.is_set():
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                return
            self._peak = max(self._peak, rss)
            if rss > self.limit_bytes:
                self._killed = True
                os.kill(proc.pid, signal.SIGKILL)
                return
            self._stop.wait(RSS_SAMPLE_S)

    def report(self) -> LimitReport:
        return LimitReport(self.mode, self.limit_bytes, peak_bytes=self._peak,
                           killed=self._killed or (self.pid is not None and not _alive(self.pid)),
                           detail=f"resident set sampled every {RSS_SAMPLE_S * 1000:.0f} ms")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def make_limit(limit_bytes: int, label: str, mode: str = "auto") -> MemoryLimit:
    """`cgroup` where a writable cgroup v1 memory controller exists (else an error if asked for
    explicitly), otherwise the RSS watchdog."""
    if mode not in ("auto", "cgroup", "rss"):
        raise ValueError(f"memory limit mode must be auto, cgroup or rss, not {mode!r}")
    if mode in ("auto", "cgroup"):
        parent = _own_v1_memory_cgroup()
        if parent is not None:
            return CgroupV1Limit(limit_bytes, label, parent)
        if mode == "cgroup":
            raise RuntimeError("no writable cgroup v1 memory controller here (needs Linux and "
                               "root); use --enforce rss")
    return RssWatchdog(limit_bytes, label)


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (an Orchard server's whole Ray)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


__all__ = ["MemoryLimit", "LimitReport", "make_limit", "process_tree_rss"]
