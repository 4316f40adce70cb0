"""`orchard`: serve, deploy and inspect Orchard on Ray.

  orchard serve [MODEL|CONFIG]  start (or join) Ray, deploy, wait until healthy, print a startup
                            summary and the URL, block. MODEL: smollm2, orchard-tiny, a model
                            folder, a .gguf file or a Hugging Face id in the local cache;
                            CONFIG: a .yaml/.yml file
  orchard deploy CONFIG     deploy onto a running cluster (e.g. inside `ray job submit`), exit
  orchard status            replicas, formats, budgets and caps of the running service
  orchard loadtest ...      headless Locust run against an endpoint (loadtest.runner)
  orchard bench WHAT ...    benchmarks that print JSON (bench/, loadtest/)
  orchard quality ...       KV-format quality gate against native (quality/)
    (their --model takes smollm2, orchard-tiny, a model folder or a .gguf file:
    engine.model.names)
  orchard import-gguf FILE OUT_DIR   import a llama.cpp/Ollama GGUF into a model folder

This file is the parser and the dispatch; the commands are in serve_app/commands.py, starting
or joining Ray and deploying in serve_app/launch.py.
"""
from __future__ import annotations

import argparse
import sys


def _kv_formats() -> list[str]:
    from capacity.formats import FORMAT_BITS

    return list(FORMAT_BITS)


def _parser() -> argparse.ArgumentParser:
    from serve_app.config import CapacitySettings, OrchardConfig

    p = argparse.ArgumentParser(prog="orchard", description="Serve LLMs on Ray Serve with MLX "
                                "engines and capacity-aware routing.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("serve", help="start or join Ray, deploy, block until Ctrl-C",
                       description="Serve one MODEL with default settings, or a YAML CONFIG "
                       "(default: the embedded models/orchard-tiny).")
    s.add_argument("target", nargs="?", metavar="MODEL|CONFIG",
                   help="a .yaml/.yml config (see config.example.yaml), or one model to serve "
                   "with no config: smollm2 (models/smollm2-135m, from `make real-model`), "
                   "orchard-tiny, a model folder, a .gguf file (imported once into a cache "
                   "folder) or a Hugging Face id (org/name) already in the local cache")
    s.add_argument("--model", default=None, metavar="MODEL",
                   help="the same as giving MODEL positionally (kept for older scripts)")
    s.add_argument("--model-id", default=None,
                   help="the id clients use for MODEL (default: the folder/file/repo name)")
    s.add_argument("--kv-format", default=None, metavar="FORMAT",
                   help="KV cache format for MODEL: " + ", ".join(_kv_formats())
                   + " (default: native)")
    s.add_argument("--address", default=None,
                   help="Ray address to join (default: start a local Ray)")
    s.add_argument("--host", default=None, help="HTTP host (overrides the config)")
    s.add_argument("--port", type=int, default=None, help="HTTP port (overrides the config)")
    s.add_argument("--timeout", type=float, default=600, help="seconds to wait for healthy")
    d = sub.add_parser("deploy", help="deploy CONFIG onto a running Ray cluster and exit",
                       description="Deploy onto the cluster at --address (default: auto, i.e. "
                       "RAY_ADDRESS or the local head; inside `ray job submit` the job's).")
    d.add_argument("config", help="YAML config")
    d.add_argument("--address", default="auto")
    d.add_argument("--timeout", type=float, default=600, help="seconds to wait for healthy")
    st = sub.add_parser("status", help="show replicas, formats, budgets and caps")
    st.add_argument("--address", default="auto")
    st.add_argument("--app", default=OrchardConfig.model_fields["app_name"].default,
                    help="Serve application name")
    st.add_argument("--namespace", default=CapacitySettings.model_fields["namespace"].default,
                    help="capacity actor namespace")
    lt = sub.add_parser("loadtest", help="headless Locust run (see `orchard loadtest --help`)",
                        add_help=False)
    lt.add_argument("rest", nargs=argparse.REMAINDER)
    b = sub.add_parser("bench", help="benchmarks printing JSON: " + ", ".join(BENCHES),
                       description="Run one benchmark; arguments after WHAT go to it "
                       "(`orchard bench WHAT --help`). Their --model takes smollm2 "
                       "(models/smollm2-135m, from `make real-model`), orchard-tiny, a model "
                       "folder or a .gguf file.")
    b.add_argument("what", choices=sorted(BENCHES))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    q = sub.add_parser("quality", help="KV-format quality gate (see `orchard quality --help`)",
                       add_help=False)
    q.add_argument("rest", nargs=argparse.REMAINDER)
    g = sub.add_parser(
        "import-gguf", help="import a GGUF file (llama.cpp/Ollama) into a model folder",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write OUT_DIR as a model folder that mlx-lm and Orchard load: config.json, "
        "model.safetensors, tokenizer.json, tokenizer_config.json (the GGUF's chat template, "
        "bos/eos), generation_config.json.",
        epilog="architectures: llama family, gemma3 (others are refused, naming the arch)\n"
        "tensor types: F32 F16 BF16 Q8_0 Q4_0 Q4_1 (exact), K-quants and others through the "
        "gguf package\n"
        "example: orchard import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2 "
        "--dtype float32\nsee docs/models.md")
    g.add_argument("file", help="the .gguf file")
    g.add_argument("out_dir", help="model folder to write (must not exist or be empty)")
    g.add_argument("--dtype", default="float32",
                   choices=["float32", "bfloat16", "float16", "keep"],
                   help="float32/bfloat16/float16 dequantize every weight; keep keeps "
                   "MLX-quantized weights (Q8_0/Q4_0/Q4_1 exactly, other types re-quantized) "
                   "with per-layer bits and group size in config.json (default: float32)")
    g.add_argument("--force", action="store_true", help="replace OUT_DIR if it is not empty")
    return p


# Subcommands that hand their arguments to a module's main(argv); imported only when used.
BENCHES = {
    "engine": "bench.engine",              # paged engine vs mlx-lm, OpenBLAS on/off
    "kv": "bench.kv",                      # KV formats: bytes, capacity, prefill/decode ratios
    "attention": "bench.attention",        # packed-history attention variants vs native
    "sampling": "bench.sampling",          # the batched sampler's cost per step
    "constrained": "bench.constrained",    # structured output: llguidance vs outlines-core
    "capacity": "bench.capacity",          # capacity actor round trips, memory per identity
    "serve": "loadtest.bench_serve",       # Orchard vs mlx_lm.server, rate sweeps
    "serve-path": "bench.serve_path",      # TTFT overhead of the HTTP/Serve path
    "decode-host": "bench.decode_host",    # host milliseconds per decode step, engine vs mlx-lm
    "decode-kernels": "bench.decode_kernels",  # CUDA decode attention kernels timed alone
    "memory": "loadtest.bench_memory",     # Orchard vs mlx_lm.server and llama.cpp, one memory limit
}


def _delegate(module: str, argv: list[str]) -> int:
    import importlib

    return importlib.import_module(module).main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "loadtest":
        # Locust must be imported before anything that imports requests/urllib3/ray.
        return _delegate("loadtest.runner", argv[1:])
    from engine.platform import ensure_openblas_preloaded

    # MLX in this process (and its Ray workers) needs OpenBLAS preloaded on Linux CPUs.
    ensure_openblas_preloaded()
    if argv and argv[0] == "quality":
        # Every argument, --help included, belongs to the gate's own parser.
        return _delegate("quality.gate", argv[1:])
    args = _parser().parse_args(argv)
    from serve_app.commands import cmd_deploy, cmd_import_gguf, cmd_serve, cmd_status
    from serve_app.config import ConfigError

    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "deploy":
            return cmd_deploy(args)
        if args.command == "bench":
            return _delegate(BENCHES[args.what], args.rest)
        if args.command == "import-gguf":
            return cmd_import_gguf(args)
        return cmd_status(args)
    except ConfigError as e:
        print(f"orchard: config error:\n{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
