"""Byte-level BPE tokenizer for orchard-tiny, trained offline with `tokenizers`.

Digits are always split into single tokens (as in Llama), so a number tokenizes the same wherever
it appears: retrieval prompts built from token pieces equal the tokenization of their text.

    python -m training.tokenizer --help
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS, IM_START, IM_END, PAD = 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_LEN = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """Train the BPE on `texts` (deterministic for a fixed input order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def save_hf_files(tok, out_dir: Path) -> None:
    """Write tokenizer.json plus the config files that transformers/mlx_lm read offline."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|pad|>", "unk_token": None,
        "additional_special_tokens": ["<|endoftext|>", "<|im_start|>"],
        "chat_template": CHAT_TEMPLATE, "model_max_length": MAX_LEN,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    (out_dir / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "additional_special_tokens": ["<|endoftext|>", "<|im_start|>"]}, indent=1))


def load(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description="Train the orchard-tiny BPE on a text file list "
                                 "(normally called by training.corpus).")
    ap.add_argument("--texts", required=True, help="JSON-lines file with {'text': ...} rows")
    ap.add_argument("--out", required=True, help="directory for tokenizer files")
    ap.add_argument("--vocab-size", type=int, default=8192)
    a = ap.parse_args()
    rows = (json.loads(line)["text"] for line in open(a.texts, encoding="utf-8"))
    save_hf_files(train_tokenizer(rows, a.vocab_size), Path(a.out))


if __name__ == "__main__":
    main()
