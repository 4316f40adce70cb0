"""How every bench hands over its result: JSON on stdout, and the same text in --out if given."""
from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None, quiet: bool = False) -> None:
    """The result as JSON on stdout (unless `quiet`: a partial result saved on the way) and in
    `out` if given."""
    text = json.dumps(result, indent=1)
    if not quiet:
        print(text)
    if out:
        Path(out).write_text(text + "\n")


def run_bench(parse_args, run, argv=None) -> int:
    """A bench's `main`: MLX runs with OpenBLAS preloaded on the CPU (the process re-execs
    itself before MLX is imported where it was not), then the result is emitted."""
    args = parse_args(argv)
    from engine.platform import ensure_openblas_preloaded

    ensure_openblas_preloaded()
    emit(run(args), args.out)
    return 0
