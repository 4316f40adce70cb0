"""The ingress loads tokenizers in worker threads, several at once when a config serves several
models: each load succeeds (transformers' first import is not thread-safe: serve_app/tokens.py).
A fresh interpreter, because only a process's first imports race."""
import subprocess
import sys
import textwrap
from pathlib import Path


def test_concurrent_first_tokenizer_loads_all_succeed(tiny_llama):
    files = {p.name: str(p) for p in Path(tiny_llama).iterdir()
             if p.name.startswith(("tokenizer", "special_tokens", "config"))}
    script = textwrap.dedent(f"""
        import os
        import threading
        from serve_app.tokens import load_tokenizer
        files = {{k: open(v, "rb").read() for k, v in {files!r}.items()}}
        errors, done = [], []
        def load():
            try:
                done.append(load_tokenizer(files)[0].encode("hello"))
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("errors", errors, "loaded", len(done), flush=True)
        ok = not errors and len(done) == 4 and all(d == done[0] for d in done)
        # Exit without interpreter teardown: what is checked is the loads; a native library's
        # thread still alive at teardown may abort the process ("terminate called without an
        # active exception", seen once in CI after every load had succeeded).
        os._exit(0 if ok else 1)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
