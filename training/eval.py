"""Evaluate an exported orchard-tiny with MLX (CPU or Metal): held-out perplexity and retrieval.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python -m training.eval --model models/orchard-tiny --data training/data --cases 100

Held-out text is the stdlib files that training.corpus excluded (path hash % 50 == 0). Retrieval
cases are built by training.corpus.passkey_case / kv_case over held-out filler with a fixed seed
(the same seeds the training machine's eval uses); a case counts when every answer digit is the
greedy (argmax) next token under teacher forcing, which equals greedy decoding of the answer.
Also writes `eval_samples.json` (held-out windows + one pass-key case) for the unit test.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from training.corpus import kv_case, load_data, passkey_case

LENGTHS = (512, 1024, 2048, 4096)


def load_fp32(path: str):
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(path)
    model.set_dtype(mx.float32)  # the CPU backend computes bf16 slowly; fp32 there
    return model, tok


def logits_of(model, ids):
    import mlx.core as mx

    out = model(mx.array(np.asarray(ids, dtype=np.int32))[None])
    return out[0].astype(mx.float32)


def nll(model, ids) -> tuple[float, int]:
    """Summed next-token NLL over ids[1:] and the count."""
    import mlx.core as mx

    lg = logits_of(model, ids[:-1])
    tgt = mx.array(np.asarray(ids[1:], dtype=np.int32))
    lse = mx.logsumexp(lg, axis=-1)
    picked = mx.take_along_axis(lg, tgt[:, None], axis=-1)[:, 0]
    s = mx.sum(lse - picked)
    mx.eval(s)
    return float(s.item()), len(ids) - 1


def heldout_ppl(model, stream: np.ndarray, window: int, max_tokens: int) -> dict:
    tot, cnt, losses = 0.0, 0, []
    for s in range(0, len(stream) - window - 1, window + 1):
        if cnt >= max_tokens:
            break
        v, n = nll(model, stream[s:s + window + 1].tolist())
        tot, cnt = tot + v, cnt + n
        losses.append(v / n)
    m = tot / cnt
    se = float(np.std(losses, ddof=1) / math.sqrt(len(losses))) if len(losses) > 1 else float("nan")
    return {"loss": m, "ppl": math.exp(m), "tokens": cnt, "windows": len(losses), "window": window,
            "loss_se_over_windows": se}


def case(task: str, d: dict, length: int, rng):
    if task == "passkey":
        return passkey_case(d["pieces"], d["heldout"], length, rng)
    return kv_case(d["pieces"], length, rng)


def answered(model, toks, span) -> bool:
    import mlx.core as mx

    a, b = span
    pred = mx.argmax(logits_of(model, toks[:b - 1])[a - 1:b - 1], axis=-1)
    return np.array_equal(np.array(pred), np.asarray(toks[a:b]))


def retrieval(model, d: dict, cases: int, lengths, seed: int = 777) -> dict:
    # Same seeding as training.train.retrieval_acc, so the GPU and MLX numbers share their cases.
    out = {}
    for task in ("passkey", "kv"):
        for L in lengths:
            rng = np.random.default_rng([seed, L, task == "kv"])
            ok = sum(answered(model, *[case(task, d, L, rng)[i] for i in (0, 2)]) for _ in range(cases))
            out[f"{task}_{L}"] = ok / cases
            print(f"{task} {L}: {ok}/{cases}", flush=True)
    return out


def write_samples(d: dict, out: Path, n: int = 4, window: int = 256) -> None:
    st = d["heldout"]
    rng = np.random.default_rng([777, 512, False])
    toks, _, span = passkey_case(d["pieces"], st, 512, rng)
    out.write_text(json.dumps({
        "heldout_windows": [st[i * 5000:i * 5000 + window + 1].tolist() for i in range(n)],
        "passkey_512": {"tokens": [int(t) for t in toks], "answer_span": list(span)},
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/orchard-tiny")
    ap.add_argument("--data", default="training/data")
    ap.add_argument("--cases", type=int, default=100, help="retrieval cases per task and length")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--ppl-tokens", type=int, default=100000)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--samples-out", default=None, help="write eval_samples.json here")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    a = ap.parse_args()
    d = load_data(a.data)
    if a.samples_out:
        write_samples(d, Path(a.samples_out))
    model, _ = load_fp32(a.model)
    t0 = time.time()
    res = {"heldout": heldout_ppl(model, d["heldout"], a.window, a.ppl_tokens) if a.ppl_tokens else None}
    print(json.dumps(res), flush=True)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    res["retrieval"] = retrieval(model, d, a.cases, lengths) if a.cases else None
    res["cases_per_cell"] = a.cases
    res["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
