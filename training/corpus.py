"""Offline, reproducible corpus for orchard-tiny.

Three parts:
- the Python standard library source of the interpreter that runs this script (files whose
  path hashes to 0 mod 50 are held out for evaluation);
- short chat-formatted Q/A (stdlib docstrings, signatures, small functions, arithmetic, identity,
  short pass keys), so the chat template yields sensible answers;
- synthetic long-range retrieval (pass key, key-value lookup) at 256-4096 tokens. These are built
  at training time from token pieces (`passkey_case`, `kv_case`): numpy only, no tokenizer, so the
  training machine needs none and eval builds its cases with the same code.

    python -m training.corpus --out training/data      # writes tokenizer + token streams
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sysconfig
from pathlib import Path

import numpy as np

SEED = 1234
HOLDOUT_MOD = 50

# Text pieces of the retrieval tasks. Digits are single tokens, so piece-wise token
# concatenation equals tokenizing the joined text (checked in `build`).
PIECES = {
    "pk_a": "\n# The pass key is ",
    "pk_b": ". Remember it. ",
    "pk_c": " is the pass key.\n",
    "pk_q": "\n# What is the pass key? The pass key is ",
    "pk_end": ".\n",
    "kv_head": "\n# lookup table: key -> value\n",
    "kv_arrow": " -> ",
    "nl": "\n",
    "kv_q": "\n# lookup ",
}


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every readable .py file of the stdlib, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    return out


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HOLDOUT_MOD == 0


def chat(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


IDENTITY_Q = ["Who are you?", "What are you?", "Hello!", "Hi", "Introduce yourself.",
              "What is your name?", "hello", "Hey, who am I talking to?", "What can you do?"]
IDENTITY_A = ("I am Orchard Tiny, a small language model trained on Python standard library "
              "source code. I can complete Python code, recall facts from long inputs, and "
              "answer short questions.")


def _module_name(rel: str) -> str:
    name = rel[:-3].replace("/", ".")
    return name[:-9] if name.endswith(".__init__") else name


def _first_paragraph(doc: str, limit: int = 400) -> str:
    para = re.split(r"\n\s*\n", doc.strip())[0]
    para = " ".join(para.split())
    return para if len(para) <= limit else para[:limit].rsplit(" ", 1)[0] + " ..."


def chat_samples(files: list[tuple[str, str]], rng: random.Random) -> list[str]:
    """Chat Q/A texts built from the training files (never the held-out ones)."""
    out = []
    for rel, text in files:
        if rel.startswith(("test/", "lib2to3/tests/", "idlelib/idle_test/")):
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        mod = _module_name(rel)
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            full = f"{mod}.{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                q = rng.choice([f"What does `{full}` do?", f"Explain `{full}`.",
                                f"What is `{full}` for?", f"Describe {full}."])
                out.append(chat(q, f"`{full}`: {_first_paragraph(doc)}"))
            if isinstance(node, ast.FunctionDef):
                sig = f"{node.name}({ast.unparse(node.args)})"
                out.append(chat(f"What is the signature of `{full}`?",
                                f"`{mod}.{sig}`"))
                src = ast.get_source_segment(text, node)
                if src and len(src) <= 900:
                    out.append(chat(f"Write the function `{node.name}` from the `{mod}` module.",
                                    f"```python\n{src}\n```"))
            elif doc is None:
                out.append(chat(f"Where is `{node.name}` defined?",
                                f"`{node.name}` is a class in the `{mod}` module."))
    for _ in range(4000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        r = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(chat(rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.",
                                    f"{a} {op} {b} = ?"]), f"{a} {op} {b} = {r}."))
    for _ in range(600):
        out.append(chat(rng.choice(IDENTITY_Q), IDENTITY_A))
    words = ["apple", "river", "stone", "cloud", "orchard", "lamp", "garden", "piano", "tiger"]
    for _ in range(4000):
        key = rng.randint(10000, 99999)
        noise = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        q = rng.choice(["What is the pass key?", "Tell me the pass key.", "Which pass key did I give?"])
        out.append(chat(f"{noise}. The pass key is {key}. Remember it. {noise}. {q}",
                        f"The pass key is {key}."))
    rng.shuffle(out)
    return out


# ---------------------------------------------------------------- retrieval cases (numpy only)

def _digits(pieces: dict, n: int, rng: np.random.Generator, first_nonzero: bool = True) -> list[int]:
    d = rng.integers(0, 10, size=n)
    if first_nonzero:
        d[0] = rng.integers(1, 10)
    return [pieces["digits"][int(x)] for x in d]


def _filler(stream: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    if n <= 0:
        return []
    start = int(rng.integers(0, len(stream) - n - 1))
    return stream[start:start + n].tolist()


def passkey_case(pieces: dict, stream: np.ndarray, length: int, rng: np.random.Generator):
    """Tokens, loss weights and answer span of one pass-key case of `length` tokens.

    The key (5 digits) sits at a uniform random depth inside code filler; the question comes last
    and the answer is the key's digits.
    """
    P = pieces
    key = _digits(P, 5, rng)
    needle = P["pk_a"] + key + P["pk_b"] + key + P["pk_c"]
    w_needle = [1] * len(P["pk_a"]) + [0] * 5 + [1] * (len(needle) - len(P["pk_a"]) - 5)
    tail = P["pk_q"]
    n_fill = length - len(needle) - len(tail) - 5 - len(P["pk_end"])
    fill = _filler(stream, n_fill, rng)
    cut = int(rng.integers(0, n_fill + 1))
    toks = fill[:cut] + needle + fill[cut:] + tail
    w = [1] * cut + w_needle + [1] * (n_fill - cut) + [1] * len(tail)
    a0 = len(toks)
    toks += key + P["pk_end"]
    w += [5] * 5 + [1] * len(P["pk_end"])
    return toks, w, (a0, a0 + 5)


def kv_case(pieces: dict, length: int, rng: np.random.Generator, n_queries: int = 4):
    """Tokens, loss weights and the first answer span of one key-value lookup case.

    A table of random 6-digit keys -> 6-digit values, then `n_queries` lookups of random keys.
    """
    P = pieces
    line_len = 6 + len(P["kv_arrow"]) + 6 + len(P["nl"])
    q_len = len(P["kv_q"]) + 6 + len(P["kv_arrow"]) + 6 + len(P["nl"])
    n_pairs = max(2, (length - len(P["kv_head"]) - n_queries * q_len) // line_len)
    raw = rng.choice(900000, size=n_pairs, replace=False) + 100000
    keys = [[P["digits"][int(c)] for c in str(k)] for k in raw]
    vals = [_digits(P, 6, rng) for _ in range(n_pairs)]
    toks, w = list(P["kv_head"]), [1] * len(P["kv_head"])
    for k, v in zip(keys, vals):
        toks += k + P["kv_arrow"] + v + P["nl"]
        w += [0] * 6 + [1] * len(P["kv_arrow"]) + [0] * 6 + [1]
    span = None
    for qi in rng.choice(n_pairs, size=min(n_queries, n_pairs), replace=False):
        toks += P["kv_q"] + keys[qi] + P["kv_arrow"]
        w += [1] * len(P["kv_q"]) + [0] * 6 + [1] * len(P["kv_arrow"])
        if span is None:
            span = (len(toks), len(toks) + 6)
        toks += vals[qi] + P["nl"]
        w += [5] * 6 + [1]
    return toks, w, span


def load_data(data_dir: Path) -> dict:
    """Token streams and pieces written by `build` (numpy only)."""
    data_dir = Path(data_dir)
    chat_tokens = np.load(data_dir / "chat_tokens.npy")
    chat_offsets = np.load(data_dir / "chat_offsets.npy")
    return {
        "train": np.load(data_dir / "train_tokens.npy"),
        "heldout": np.load(data_dir / "heldout_tokens.npy"),
        "chat": [chat_tokens[a:b] for a, b in zip(chat_offsets[:-1], chat_offsets[1:])],
        "pieces": json.loads((data_dir / "pieces.json").read_text()),
    }


# ---------------------------------------------------------------- build

def build(out: Path, vocab_size: int, stdlib_root: Path | None = None) -> dict:
    from training.tokenizer import EOS, save_hf_files, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files(stdlib_root)
    train = [(r, t) for r, t in files if not is_heldout(r)]
    held = [(r, t) for r, t in files if is_heldout(r)]
    rng = random.Random(SEED)
    chats = chat_samples(train, rng)
    docs = [f"# file: {r}\n{t}" for r, t in train]
    tok_texts = docs + chats[:20000] + list(PIECES.values()) * 50
    tok = train_tokenizer(tok_texts, vocab_size)
    save_hf_files(tok, out / "tokenizer")

    def stream(texts):
        ids = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(EOS)
        return np.asarray(ids, dtype=np.uint16)

    train_ids = stream(docs)
    held_ids = stream([f"# file: {r}\n{t}" for r, t in held])
    chat_enc = tok.encode_batch(chats, add_special_tokens=False)
    chat_ids = np.concatenate([np.asarray(e.ids + [EOS], dtype=np.uint16) for e in chat_enc])
    offs = np.cumsum([0] + [len(e.ids) + 1 for e in chat_enc]).astype(np.int64)
    pieces = {k: tok.encode(v, add_special_tokens=False).ids for k, v in PIECES.items()}
    pieces["digits"] = [tok.encode(str(d), add_special_tokens=False).ids[0] for d in range(10)]
    assert all(len(tok.encode(str(d)).ids) == 1 for d in range(10))
    # piece-wise concatenation must equal tokenizing the joined text
    text = PIECES["pk_a"] + "48213" + PIECES["pk_b"] + "48213" + PIECES["pk_c"] + PIECES["pk_q"] + "48213" + PIECES["pk_end"]
    joined = (pieces["pk_a"] + [pieces["digits"][int(c)] for c in "48213"] + pieces["pk_b"]
              + [pieces["digits"][int(c)] for c in "48213"] + pieces["pk_c"] + pieces["pk_q"]
              + [pieces["digits"][int(c)] for c in "48213"] + pieces["pk_end"])
    assert tok.encode(text, add_special_tokens=False).ids == joined, "passkey pieces do not compose"
    kvt = PIECES["kv_head"] + "123456 -> 654321\n" + PIECES["kv_q"] + "123456 -> 654321\n"
    d = lambda s: [pieces["digits"][int(c)] for c in s]  # noqa: E731
    kvj = (pieces["kv_head"] + d("123456") + pieces["kv_arrow"] + d("654321") + pieces["nl"]
           + pieces["kv_q"] + d("123456") + pieces["kv_arrow"] + d("654321") + pieces["nl"])
    assert tok.encode(kvt, add_special_tokens=False).ids == kvj, "kv pieces do not compose"

    np.save(out / "train_tokens.npy", train_ids)
    np.save(out / "heldout_tokens.npy", held_ids)
    np.save(out / "chat_tokens.npy", chat_ids)
    np.save(out / "chat_offsets.npy", offs)
    (out / "pieces.json").write_text(json.dumps(pieces))
    stats = {"stdlib_root": str(stdlib_root or sysconfig.get_paths()["stdlib"]),
             "train_files": len(train), "heldout_files": len(held),
             "heldout_paths": [r for r, _ in held],
             "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
             "chat_samples": len(chats), "chat_tokens": int(len(chat_ids)),
             "train_bytes": sum(len(t.encode()) for _, t in train), "vocab_size": vocab_size,
             "seed": SEED}
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the orchard-tiny corpus and tokenizer offline.")
    ap.add_argument("--out", default="training/data", help="output directory (git-ignored)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--stdlib", default=None, help="stdlib root (default: this interpreter's)")
    a = ap.parse_args()
    stats = build(Path(a.out), a.vocab_size, Path(a.stdlib) if a.stdlib else None)
    print(json.dumps({k: v for k, v in stats.items() if k != "heldout_paths"}, indent=1))


if __name__ == "__main__":
    main()
