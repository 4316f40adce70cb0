"""`python -m loadtest {run,bench-serve} ...`; `run` is also `loadtest.runner.main(argv)`."""
from __future__ import annotations

import sys

USAGE = """usage: python -m loadtest COMMAND [options]

commands:
  run          one named scenario against one OpenAI-compatible target (Locust, headless)
  bench-serve  the same schedule against several targets (Orchard per KV format, mlx_lm.server)
  chat         multi-turn conversations (growing history, several tenants), targets one after another

`python -m loadtest COMMAND --help` lists each command's options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        from loadtest import runner
        return runner.main(rest)
    if command == "bench-serve":
        from loadtest import bench_serve
        return bench_serve.main(rest)
    if command == "chat":
        from loadtest import multiturn
        return multiturn.main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
