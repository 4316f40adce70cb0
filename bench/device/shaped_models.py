"""Random-weight model folders in the geometry of the models users serve, for the served
benchmark on the accelerator machine (real weights of 1B-8B models cannot travel there).

    python -m bench.device.shaped_models --tokenizer-from DIR --out ROOT smollm2-135m llama-3.1-8b

Each NAME is a geometry in bench/device/shapes/NAME.json (Llama-3.2-1B and Llama-3.1-8B with
SmolLM2's 49,152-token vocabulary, so the tokenizer that travels decodes every id). The folder gets
that config, the tokenizer files of --tokenizer-from and weights drawn by MLX under a fixed seed
in bfloat16 (bench.engine.build_shaped). Prints {name: folder} as JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SHAPES = Path(__file__).with_name("shapes")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def shape_names() -> list[str]:
    return sorted(p.stem for p in SHAPES.glob("*.json"))


def source_folder(name: str, tokenizer_from: Path, root: Path) -> Path:
    """A folder holding the geometry's config.json and the tokenizer files, as build_shaped
    reads a model folder."""
    src = root / "src" / name
    src.mkdir(parents=True, exist_ok=True)
    shutil.copy(SHAPES / f"{name}.json", src / "config.json")
    for f in TOKENIZER_FILES:
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, src / f)
    if not (src / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json in {tokenizer_from}")
    return src


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device.shaped_models",
                                description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="+", help=f"geometries: {', '.join(shape_names())}")
    p.add_argument("--tokenizer-from", type=Path, required=True,
                   help="a model folder whose tokenizer files the shaped models get")
    p.add_argument("--out", type=Path, required=True, help="folder to write the models under")
    args = p.parse_args(argv)
    unknown = sorted(set(args.names) - set(shape_names()))
    if unknown:
        p.error(f"unknown geometry {', '.join(unknown)}; known: {', '.join(shape_names())}")
    from bench.engine import build_shaped

    made = {}
    for name in args.names:
        print(f"[shaped_models] {name}", file=sys.stderr, flush=True)
        made[name] = build_shaped(str(source_folder(name, args.tokenizer_from, args.out)),
                                  args.out, "bfloat16")
    print(json.dumps(made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
