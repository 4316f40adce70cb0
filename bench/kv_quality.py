"""`bench.kv`'s quality section: teacher-forced NLL and KL of each packed format against native.

The full gate with intervals and verdicts is `quality/`; this is the bench's quick side table,
prefilled through the same paged runner the bench times.
"""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.kv_runners import PAGE_TOKENS, make_runner
from engine.sched.seq import Chunk


def heldout_docs(root: str, n: int, tokens: int, tokenizer) -> list[list[int]]:
    """Up to n stdlib files that orchard-tiny's training held out (training.corpus's rule)."""
    import hashlib
    docs = []
    for path in sorted(Path(root).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50:
            continue
        ids = tokenizer.encode(f"# file: {rel}\n{path.read_text(errors='replace')}")
        if len(ids) >= tokens:
            docs.append(ids[:tokens])
        if len(docs) == n:
            break
    return docs


def quality_section(loaded, docs, formats, chunk) -> dict:
    """Teacher-forced NLL and KL(native || packed) per token, prefilled in `chunk`-token steps
    so that all but the current chunk is read from packed pages (what decode sees)."""
    def logprobs(fmt, ids):
        runner = make_runner(loaded, fmt, -(-len(ids) // PAGE_TOKENS))
        table = list(range(runner.kvstore.num_pages))
        out = []
        for s in range(0, len(ids) - 1, chunk):
            part = ids[s:min(s + chunk, len(ids) - 1)]
            logits = runner.forward_all([Chunk(0, part, s, table)])[0]
            out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            mx.eval(out[-1])
        return mx.concatenate(out)

    per = {f: {"nll": [], "kl": [], "agree": []} for f in formats}
    native_nll = []
    for ids in docs:
        target = mx.array(ids[1:])[:, None]
        ref = logprobs("native", ids)
        native_nll.append(-mx.take_along_axis(ref, target, axis=-1)[:, 0])
        for f in formats:
            lp = logprobs(f, ids)
            per[f]["nll"].append(-mx.take_along_axis(lp, target, axis=-1)[:, 0])
            per[f]["kl"].append((mx.exp(ref) * (ref - lp)).sum(axis=-1))
            per[f]["agree"].append(mx.argmax(lp, -1) == mx.argmax(ref, -1))
    base = mx.concatenate(native_nll)
    n = base.size
    out = {"tokens": n, "docs": len(docs), "chunk": chunk,
           "native": {"nll": round(base.mean().item(), 5),
                      "ppl": round(float(np.exp(base.mean().item())), 4)}}
    for f in formats:
        nll, kl = mx.concatenate(per[f]["nll"]), mx.concatenate(per[f]["kl"])
        delta = np.array(nll - base)
        # 95% interval of the mean NLL change over 64-token blocks (tokens are not independent).
        blocks = delta[: len(delta) // 64 * 64].reshape(-1, 64).mean(axis=1)
        half = 1.96 * blocks.std(ddof=1) / np.sqrt(len(blocks))
        out[f] = {"nll": round(nll.mean().item(), 5),
                  "ppl_change_pct": _pct(delta.mean()),
                  "ppl_change_pct_ci95": [_pct(delta.mean() - half), _pct(delta.mean() + half)],
                  "kl_mean": float(f"{kl.mean().item():.3e}"),
                  "kl_p99": float(f"{np.percentile(np.array(kl), 99):.3e}"),
                  "top1_agree": round(mx.concatenate(per[f]["agree"]).mean().item(), 5)}
    return out


def _pct(log_ratio) -> float:
    return round(float(100 * (np.exp(log_ratio) - 1)), 4)
