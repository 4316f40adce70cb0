"""One long prompt at a time: the time a server takes to answer a fresh N-token prompt with one
output token (its prefill, as a user of a long document or chat history waits for it).

    python -m loadtest.lone_prefill --url URL --model ID --tokenizer tokenizer.json \
        [--tokens 1200] [--repeats 3]

Each prompt is new text (never sent before, so no prefix or prompt cache helps), cut to exactly
--tokens tokens with the model's tokenizer; the first request is a warm-up and is not counted.
Prints one JSON line per request and a last line with the median. HTTP only.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request

WORDS = ("apple orchard river mountain silver quiet engine window garden music paper stone "
         "light winter summer market bridge forest").split()


def fresh_prompt(tokenizer, tokens: int, rng: random.Random) -> str:
    text = f"{time.time_ns()} " + " ".join(rng.choice(WORDS) for _ in range(tokens * 2))
    return tokenizer.decode(tokenizer.encode(text).ids[:tokens])


def one(url: str, model: str, prompt: str, timeout: float) -> tuple[float, int | None]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", body,
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        reply = json.load(r)
    return time.perf_counter() - t0, reply.get("usage", {}).get("prompt_tokens")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.lone_prefill",
                                description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="server base URL (OpenAI-compatible)")
    p.add_argument("--model", required=True, help="model id the server answers to")
    p.add_argument("--tokenizer", required=True, help="the model's tokenizer.json")
    p.add_argument("--tokens", type=int, default=1200, help="prompt length (default 1200)")
    p.add_argument("--repeats", type=int, default=3, help="counted requests (default 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        p.error("--tokens and --repeats must be at least 1")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(args.tokenizer)
    rng = random.Random(time.time_ns())
    times = []
    for i in range(args.repeats + 1):
        seconds, prompt_tokens = one(args.url, args.model,
                                     fresh_prompt(tokenizer, args.tokens, rng), args.timeout)
        if i:
            times.append(seconds)
        print(json.dumps({"request": i, "warm_up": i == 0, "seconds": round(seconds, 3),
                          "prompt_tokens": prompt_tokens}), flush=True)
    print(json.dumps({"median_s": round(statistics.median(times), 3),
                      "seconds": [round(x, 3) for x in times]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
