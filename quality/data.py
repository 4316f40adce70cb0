"""Inputs of the KV-format quality gate: held-out text, retrieval cases and graded probes.

Held-out text is orchard-tiny's held-out split (training.corpus: stdlib files whose path hashes
to 0 mod 50). It is read from the corpus build (`training/data`) when present; otherwise it is
rebuilt from this interpreter's stdlib with the shipped tokenizer (same files, same
`# file: <path>\\n` header and EOS separator), so the gate also runs where no corpus was built.
The stream's sha256 is recorded with the results: a different stdlib gives a different stream.

Retrieval cases come from training.corpus.passkey_case / kv_case (the model card's generators)
with their own fixed seeds. Probes are exact-answer generation tasks from four families; the gate
keeps those native answers correctly (see `quality.runs.select_probes`).
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.corpus import PIECES, is_heldout, kv_case, passkey_case, stdlib_files

EOS = 0
RETRIEVAL_SEED = 4242
PROBE_SEED = 31337


@dataclass
class HeldOut:
    stream: np.ndarray
    pieces: dict
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.stream.astype(np.uint16).tobytes()).hexdigest()[:16]


def load_heldout(tokenizer, data_dir: str | Path | None) -> HeldOut:
    """Held-out token stream and retrieval pieces (corpus build if present, else rebuilt)."""
    d = Path(data_dir) if data_dir else None
    if d and (d / "heldout_tokens.npy").is_file() and (d / "pieces.json").is_file():
        import json
        return HeldOut(np.load(d / "heldout_tokens.npy").astype(np.int64),
                       json.loads((d / "pieces.json").read_text()), f"{d}/heldout_tokens.npy")
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    ids: list[int] = []
    files = [(r, t) for r, t in stdlib_files() if is_heldout(r)]
    for rel, text in files:
        ids.extend(enc(f"# file: {rel}\n{text}"))
        ids.append(EOS)
    pieces = {k: enc(v) for k, v in PIECES.items()}
    pieces["digits"] = [enc(str(i))[0] for i in range(10)]
    # Named by version, not path: results are recorded in docs/ and must not carry machine paths.
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return HeldOut(np.asarray(ids, np.int64), pieces,
                   f"rebuilt from the Python {version} stdlib ({len(files)} held-out files)")


def windows(stream: np.ndarray, count: int, length: int) -> list[np.ndarray]:
    """`count` non-overlapping windows of `length` tokens spread evenly over the stream, so the
    score covers many held-out files rather than the first few."""
    span = len(stream) - length
    if count < 1 or span < 0:
        raise ValueError(f"cannot cut {count} windows of {length} from {len(stream)} tokens")
    if count * length > len(stream):
        raise ValueError(f"{count} windows of {length} exceed the {len(stream)} held-out tokens")
    stride = span // max(count - 1, 1) if count > 1 else 0
    stride = max(stride, length)
    return [stream[i * stride:i * stride + length] for i in range(count)]


@dataclass(frozen=True)
class Case:
    """A prompt and the exact tokens greedy decoding must produce."""

    family: str
    length: int          # nominal length (retrieval cells) or prompt length
    prompt: list[int]
    answer: list[int]


def retrieval_cases(held: HeldOut, task: str, length: int, n: int) -> list[Case]:
    rng = np.random.default_rng([RETRIEVAL_SEED, length, task == "kv"])
    out = []
    for _ in range(n):
        if task == "passkey":
            toks, _, (a, b) = passkey_case(held.pieces, held.stream, length, rng)
        else:
            toks, _, (a, b) = kv_case(held.pieces, length, rng)
        out.append(Case(task, length, [int(t) for t in toks[:a]], [int(t) for t in toks[a:b]]))
    return out


def _chat(tokenizer, user: str, answer: str) -> tuple[list[int], list[int]]:
    prompt = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return (tokenizer.encode(prompt, add_special_tokens=False),
            tokenizer.encode(answer, add_special_tokens=False))


WORDS = ["apple", "river", "stone", "cloud", "orchard", "lamp", "garden", "piano", "tiger"]


def probe_candidates(held: HeldOut, tokenizer, per_family: int) -> dict[str, list[Case]]:
    """Candidate probes per family, in a fixed order (seeded):

    - chat_passkey: the chat pass-key pattern (noise words, key, noise, question) -> "The pass
      key is NNNNN." (as trained; noise of 5-60 words on each side);
    - kv_late_query: a key-value table of 300-1500 tokens; the answer of its 2nd-4th lookup
      (the card's retrieval cells only grade the first);
    - passkey_code: the card's pass-key task at a random length of 300-3000 tokens;
    - chat_echo: "What is a op b?" (3-digit operands) -> the answer restates "a op b =" (copying
      from the question; the sum itself the model gets wrong, so it is not graded).
    The answers exclude anything after the graded span. Arbitrary code copying and arithmetic
    were tried and dropped: native orchard-tiny solves neither.
    """
    rng = np.random.default_rng(PROBE_SEED)
    P, st = held.pieces, held.stream
    out: dict[str, list[Case]] = {k: [] for k in ("chat_passkey", "kv_late_query",
                                                  "passkey_code", "chat_echo")}
    for _ in range(per_family):
        key = int(rng.integers(10000, 100000))

        def noise() -> str:
            n_words = int(rng.integers(5, 61))
            return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n_words))

        q = ["What is the pass key?", "Tell me the pass key.", "Which pass key did I give?"][
            int(rng.integers(0, 3))]
        p, a = _chat(tokenizer, f"{noise()}. The pass key is {key}. Remember it. {noise()}. {q}",
                     f"The pass key is {key}.<|im_end|>")
        out["chat_passkey"].append(Case("chat_passkey", len(p), p, a))

        length = int(rng.integers(300, 1501))
        toks, _, _ = kv_case(P, length, rng)
        arrow, nl = P["kv_arrow"], P["nl"]
        q_starts = _find_all(toks, P["kv_q"])
        qi = int(rng.integers(1, len(q_starts)))
        s = q_starts[qi] + len(P["kv_q"]) + 6 + len(arrow)
        out["kv_late_query"].append(Case("kv_late_query", s, toks[:s], toks[s:s + 6] + nl))

        length = int(rng.integers(300, 3001))
        toks, _, (a, b) = passkey_case(P, st, length, rng)
        out["passkey_code"].append(Case("passkey_code", a, [int(t) for t in toks[:a]],
                                        [int(t) for t in toks[a:b]]))

        x, y = (int(v) for v in rng.integers(100, 1000, 2))
        op = "+-*"[int(rng.integers(0, 3))]
        p, _ = _chat(tokenizer, f"What is {x} {op} {y}?", "")
        out["chat_echo"].append(Case("chat_echo", len(p), p,
                                     tokenizer.encode(f"{x} {op} {y} =", add_special_tokens=False)))
    return out


def _find_all(seq: list[int], sub: list[int]) -> list[int]:
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub]


# ------------------------------------------------------------------ text a real chat model knows

def chat_stream(tokenizer) -> np.ndarray:
    """Chat-formatted prose: each topic of the Python reference shipped in the stdlib
    (`pydoc_data.topics`, the text `help()` prints) as one conversation, "Explain <topic>" ->
    the topic's text, in the ChatML template SmolLM2 was tuned on. English technical prose in
    the model's chat domain, present on every machine with this interpreter, never trained on
    by orchard-tiny (stdlib .py files are its corpus, pydoc_data.topics is data not prose code)."""
    from pydoc_data.topics import topics
    ids: list[int] = []
    for name in sorted(topics):
        ids.extend(tokenizer.encode(
            f"<|im_start|>user\nExplain the Python topic '{name}'.<|im_end|>\n"
            f"<|im_start|>assistant\n{topics[name].strip()}<|im_end|>\n",
            add_special_tokens=False))
    return np.asarray(ids, np.int64)


def code_stream(tokenizer) -> np.ndarray:
    """orchard-tiny's held-out stdlib files (same selection as load_heldout), this tokenizer."""
    ids: list[int] = []
    for rel, text in stdlib_files():
        if is_heldout(rel):
            ids.extend(tokenizer.encode(f"# file: {rel}\n{text}", add_special_tokens=False))
            ids.append(EOS)
    return np.asarray(ids, np.int64)


def text_windows(tokenizer, per_corpus: int, length: int) -> list[np.ndarray]:
    """`per_corpus` windows of chat prose, then as many of held-out code (even spread)."""
    return (windows(chat_stream(tokenizer), per_corpus, length)
            + windows(code_stream(tokenizer), per_corpus, length))
