"""Every MLX process on Linux gets OpenBLAS preloaded and its workers told to sleep right after
their share of a GEMM (engine/platform.py OPENBLAS_THREAD_TIMEOUT): by default they spin ~0.1 s,
through the engine thread's own work, on the core the serving processes need."""
from __future__ import annotations

import os
import subprocess
import sys

from engine import platform as plat
from serve_app import launch

def test_children_get_the_preload_and_the_short_spin():
    env = plat.openblas_env({})
    assert env["LD_PRELOAD"] == plat.openblas_path()
    assert env["OPENBLAS_THREAD_TIMEOUT"] == plat.OPENBLAS_THREAD_TIMEOUT == "4"
    # A value the user set wins; an existing preload is kept as it is.
    kept = plat.openblas_env({"OPENBLAS_THREAD_TIMEOUT": "28", "LD_PRELOAD": env["LD_PRELOAD"]})
    assert kept == {"LD_PRELOAD": env["LD_PRELOAD"], "OPENBLAS_THREAD_TIMEOUT": "28"}
    # What a local Ray's workers (the model replicas) start with.
    assert launch._runtime_env(None)["env_vars"]["OPENBLAS_THREAD_TIMEOUT"] == "4"


def test_the_exec_entry_point_passes_both_to_its_command():
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "OPENBLAS_THREAD_TIMEOUT")}
    out = subprocess.run(
        [sys.executable, "-m", "engine.platform", "exec", sys.executable, "-c",
         "import os; print(os.environ['LD_PRELOAD'], os.environ['OPENBLAS_THREAD_TIMEOUT'])"],
        env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [plat.openblas_path(), "4"]
