"""Train orchard-tiny with PyTorch (a Qwen3-equivalent decoder whose parameter names and layouts map
1:1 onto mlx-lm's `qwen3` model), then export an MLX model directory.

    python -m training.train --data training/data --out /tmp/run --compile   # the shipped run

Rows of 4096+1 tokens mix stdlib code (~73% of tokens), chat Q/A (~0.5%) and synthetic pass-key / key-value cases of
256-4096 tokens (~26%; see training.corpus). Seeds are fixed; with --steps the schedule is step-based and
the run is reproducible up to GPU nondeterminism; with --time-budget the schedule follows wall time.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="training/data")
    ap.add_argument("--out", default="out/train")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--steps", type=int, default=0, help="step-based schedule (reproducible)")
    ap.add_argument("--time-budget", type=float, default=160.0, help="seconds, if --steps is 0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.1, help="residual dropout (stdlib is small: many epochs)")
    ap.add_argument("--p-retrieval", type=float, default=0.4, help="share of rows that open with a retrieval case")
    ap.add_argument("--eval-cases", type=int, default=200)
    ap.add_argument("--ckpt-at", type=float, default=2.0,
                    help="also export a checkpoint at this progress (>= 1: none)")
    return ap


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    parser().parse_args()  # --help works where torch is absent (the CPU machines)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from training.corpus import kv_case, load_data, passkey_case  # noqa: E402
from training.export import CONFIG, export_dir  # noqa: E402
from training.tokenizer import EOS  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


def rope_tables(head_dim: int, theta: float, n: int, device):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    # mlx nn.RoPE(traditional=False): rotate the two halves of the head dimension.
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    c, s = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, L, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.nh // self.nkv  # head h reads KV head h // rep, as in mlx-lm
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, f = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.drop = nn.Dropout(c.get("dropout", 0.0))  # residual dropout, training only

    def forward(self, x, cos, sin):
        x = x + self.drop(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Qwen3(nn.Module):
    """Parameter names equal mlx-lm qwen3's (`model.layers.0.self_attn.q_proj.weight`, ...)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        cos, sin = rope_tables(c["head_dim"], c["rope_theta"], c["max_position_embeddings"], "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        std = 0.02
        for n, p in self.named_parameters():
            if p.dim() == 2:
                s = std / math.sqrt(2 * c["num_hidden_layers"]) if n.endswith(("o_proj.weight", "down_proj.weight")) else std
                nn.init.normal_(p, 0.0, s)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, self.cos, self.sin)
        x = self.model.norm(x)
        return F.linear(x, self.model.embed_tokens.weight)  # tied lm head


# ---------------------------------------------------------------- data

class Rows(torch.utils.data.IterableDataset):
    """Endless training rows (tokens, loss weights); each worker has its own fixed seed."""

    def __init__(self, data_dir: str, seq: int, seed: int, p_retrieval: float, p_chat: float = 0.12):
        self.data_dir, self.seq, self.seed = data_dir, seq, seed
        self.p_retrieval, self.p_chat = p_retrieval, p_chat

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        rng = np.random.default_rng([self.seed, wid])
        d = load_data(self.data_dir)
        train, chats, P = d["train"], d["chat"], d["pieces"]
        n = self.seq + 1
        while True:
            toks, w = [], []
            if rng.random() < self.p_retrieval:  # a long case starting the row
                t, ww, _ = self._case(rng, P, train, int(rng.integers(256, n + 1)))
                toks += t
                w += ww
            while len(toks) < n:
                room = n - len(toks)
                r = rng.random()
                if r < self.p_chat:
                    c = chats[int(rng.integers(0, len(chats)))].tolist()
                    toks += c
                    w += [1] * len(c)
                elif r < self.p_chat + 0.1 and room >= 256:
                    t, ww, _ = self._case(rng, P, train, int(rng.integers(256, room + 1)))
                    toks += t + [EOS]
                    w += ww + [1]
                else:
                    k = min(room, int(rng.integers(256, n + 1)))
                    s = int(rng.integers(0, len(train) - k))
                    toks += train[s:s + k].tolist()
                    w += [1] * k
            t = torch.tensor(toks[:n], dtype=torch.long)
            ww = torch.tensor(w[:n], dtype=torch.float32)
            yield t, ww

    @staticmethod
    def _case(rng, P, train, length):
        if rng.random() < 0.5:
            return passkey_case(P, train, length, rng)
        return kv_case(P, length, rng)


# ---------------------------------------------------------------- eval on the training machine

@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, seq: int, n_rows: int, device) -> float:
    tot, cnt = 0.0, 0
    for i in range(n_rows):
        s = i * (seq + 1)
        if s + seq + 1 > len(stream):
            break
        x = torch.tensor(stream[s:s + seq + 1].astype(np.int64), device=device)[None]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])
        tot += F.cross_entropy(logits.float()[0], x[0, 1:], reduction="sum").item()
        cnt += seq
    return tot / max(cnt, 1)


@torch.no_grad()
def retrieval_acc(model, d, lengths, n_cases, device, seed=777) -> dict:
    out = {}
    for task in ("passkey", "kv"):
        for L in lengths:
            rng = np.random.default_rng([seed, L, task == "kv"])
            ok = 0
            for _ in range(n_cases):
                if task == "passkey":
                    t, _, (a, b) = passkey_case(d["pieces"], d["heldout"], L, rng)
                else:
                    t, _, (a, b) = kv_case(d["pieces"], L, rng)
                x = torch.tensor(t[:b], device=device)[None]
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    pred = model(x[:, :-1])[0, a - 1:b - 1].argmax(-1)
                ok += int(torch.equal(pred, x[0, a:b]))
            out[f"{task}_{L}"] = ok / n_cases
    return out


# ---------------------------------------------------------------- main

def main() -> None:
    a = parser().parse_args()

    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = Qwen3({**CONFIG, "dropout": a.dropout}).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params} device {dev}", flush=True)
    fwd = model
    if a.compile:  # probe one real-shaped step; fall back to eager if compilation fails here
        try:
            cm = torch.compile(model)
            probe = torch.zeros(a.batch, a.seq, dtype=torch.long, device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                cm(probe).float().mean().backward()
            model.zero_grad(set_to_none=True)
            fwd = cm
            print("compiled", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"compile failed, eager: {e!r}"[:500], flush=True)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    loader = torch.utils.data.DataLoader(Rows(a.data, a.seq, a.seed, a.p_retrieval), batch_size=a.batch,
                                         num_workers=a.workers, pin_memory=True, prefetch_factor=4)

    def lr_at(progress: float, step: int) -> float:
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        p = min(1.0, progress)
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))

    log = open(out / "train_log.jsonl", "w")
    t0, step, tokens, ckpt_done = time.time(), 0, 0, False
    ema = None
    it = iter(loader)
    while True:
        el = time.time() - t0
        progress = step / a.steps if a.steps else el / a.time_budget
        if progress >= 1.0:
            break
        if not ckpt_done and progress >= a.ckpt_at:
            export_dir(model, CONFIG, out / "ckpt", a.data)
            ckpt_done = True
        lr = lr_at(progress, step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, w = next(it)
        x, w = x.to(dev, non_blocking=True), w.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = fwd(x[:, :-1])
        loss_tok = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        ww = w[:, 1:].reshape(-1)
        loss = (loss_tok * ww).sum() / ww.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        if step % 25 == 0 or step == 1:
            lv = loss.item()
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            rec = {"step": step, "loss": round(lv, 4), "lr": lr, "gn": round(gn.item(), 3),
                   "tokens": tokens, "elapsed": round(time.time() - t0, 1),
                   "tok_per_s": round(tokens / (time.time() - t0))}
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
    train_s = time.time() - t0
    model.eval()
    d = load_data(a.data)
    summary = {"params": n_params, "steps": step, "tokens_seen": tokens, "train_seconds": round(train_s, 1),
               "batch": a.batch, "seq": a.seq, "lr": a.lr, "seed": a.seed, "steps_arg": a.steps,
               "time_budget": a.time_budget, "dropout": a.dropout, "p_retrieval": a.p_retrieval}
    export_dir(model, CONFIG, out / "model", a.data, ref_ids=d["heldout"][:512].astype(np.int64))
    summary["heldout_loss_gpu"] = heldout_loss(model, d["heldout"], a.seq, 16, dev)
    summary["retrieval_gpu"] = retrieval_acc(model, d, [512, 1024, 2048, 4096], a.eval_cases, dev)
    summary["eval_seconds"] = round(time.time() - t0 - train_s, 1)
    print(json.dumps(summary), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
