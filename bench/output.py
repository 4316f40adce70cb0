"""How every bench hands over its result: JSON on stdout, and the same text in --out if given."""
from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
