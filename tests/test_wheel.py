"""The wheel `pip wheel .` builds carries the tooling (bench/, quality/) but not tests/, and its
`orchard bench engine --help` / `orchard quality --help` work from the wheel's own files: no
product or tooling module may need the source tree (issue 16: benches used to import tests/)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the files git knows (tracked, or new and not ignored): a build inside
    # the checkout would leave build/lib behind, whose stale modules the next wheel would carry.
    src = out / "src"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    # --no-build-isolation: setuptools from this venv, so the build needs no network.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, cwd=out)
    (wheel,) = out.glob("orchard-*.whl")
    root = out / "site"
    zipfile.ZipFile(wheel).extractall(root)
    return root


def test_wheel_carries_tooling_not_tests(unpacked_wheel):
    tops = {p.name for p in unpacked_wheel.iterdir() if p.is_dir() and not p.name.endswith("-info")}
    assert {"engine", "capacity", "serve_app", "loadtest", "bench", "quality", "training"} <= tops
    assert "tests" not in tops
    assert (unpacked_wheel / "bench" / "synthetic.py").is_file()


@pytest.mark.parametrize("argv", [["bench", "engine", "--help"], ["bench", "kv", "--help"],
                                  ["quality", "--help"]])
def test_cli_help_from_the_wheel(unpacked_wheel, tmp_path, argv):
    # Run outside the checkout with only the wheel's files ahead of site-packages, so nothing can
    # come from the source tree (the editable install's finder comes after sys.path).
    env = {**os.environ, "PYTHONPATH": str(unpacked_wheel)}
    code = ("import sys, serve_app.cli as c; assert c.__file__.startswith(sys.argv[1]), c.__file__;"
            "sys.exit(c.main(sys.argv[2:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(unpacked_wheel), *argv], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
