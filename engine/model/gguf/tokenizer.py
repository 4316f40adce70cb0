"""GGUF vocabularies -> Hugging Face tokenizer files, built with the `tokenizers` library.

Two GGUF tokenizer models import:
- `gpt2`: byte-level BPE (tokens + merges); the pre-tokenizer follows `tokenizer.ggml.pre`
  (e.g. `smollm` splits every digit, `llama-bpe` uses Llama 3's split regex).
- `llama`: SentencePiece-style BPE (tokens + scores, `<0xNN>` byte tokens as fallback); merges
  are recovered from the scores the way Hugging Face's converter does (a merge of two pieces
  ranks by the score of the piece it makes).
Special tokens come from `token_type`: control tokens are special added tokens, user-defined
ones plain added tokens. EOS ids also take the end-of-turn tokens llama.cpp recognises by text.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from engine.model.gguf.reader import GGUFFile, GGUFImportError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp treats these as end-of-generation when they exist (llama-vocab.cpp, by text).
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
             "<|eom_id|>")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GGUF pre-tokenizer names (llama.cpp's convert_hf_to_gguf) -> how we split before byte-level.
_PRE_GPT2 = {"default", "gpt2", "gpt-2", "starcoder", "refact", "olmo", "jais", "codeshell",
             "phi-2", "mpt", "stablelm2", "poro-chat", "bloom"}
_PRE_DIGITS = {"smollm"}
_PRE_LLAMA3 = {"llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3", "dbrx", "pixtral",
               "exaone", "bert-bpe"}
_PRE_QWEN2 = {"qwen2", "qwen2.5", "qwen-2.5", "deepseek-r1-qwen", "megrez"}


def _warn(msg: str) -> None:
    print(f"[gguf] warning: {msg}", file=sys.stderr, flush=True)


def _byte_level_pre(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre in _PRE_DIGITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for names, regex in ((_PRE_LLAMA3, _LLAMA3_SPLIT), (_PRE_QWEN2, _QWEN2_SPLIT)):
        if pre in names:
            return pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _PRE_GPT2:
        _warn(f"pre-tokenizer {pre!r} is not known to the importer; using GPT-2's split "
              "(tokenization of some text may differ from llama.cpp)")
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: (a, b) for every piece a+b, ordered by
    the merged piece's score (higher first), ties by id."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, pid in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], pid, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_tokenizer(g: GGUFFile):
    """Return (tokenizers.Tokenizer, info dict with bos/eos/unk/pad ids and flags)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = g.get("tokenizer.ggml.model")
    tokens = g.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFImportError(f"{g.path}: no tokenizer.ggml.tokens (no embedded vocabulary)")
    tokens = [str(t) for t in tokens]
    types = [int(t) for t in g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]
    info = {k: g.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown",
                                                                "padding", "eot", "eom")}
    if kind == "gpt2":
        merges = []
        for m in g.get("tokenizer.ggml.merges") or []:
            pos = m.find(" ", 1)
            if pos < 0:
                raise GGUFImportError(f"{g.path}: malformed merge {m!r}")
            merges.append((m[:pos], m[pos + 1:]))
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = _byte_level_pre(str(g.get("tokenizer.ggml.pre", "default")))
        tok.decoder = decoders.ByteLevel()
        post = [processors.ByteLevel(trim_offsets=False)]
        add_prefix = False
    elif kind == "llama":
        scores = [float(s) for s in g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        vocab = {t: i for i, t in enumerate(tokens)}
        unk_id = info["unknown"] if info["unknown"] is not None else (
            types.index(UNKNOWN) if UNKNOWN in types else None)
        if not any(t == BYTE for t in types):
            _warn("SentencePiece vocabulary without byte tokens: characters outside it "
                  "become the unknown token")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types),
                                   unk_token=tokens[unk_id] if unk_id is not None else None,
                                   byte_fallback=True, fuse_unk=True))
        add_prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
        norms = [normalizers.Prepend("▁")] if add_prefix else []
        tok.normalizer = normalizers.Sequence([*norms, normalizers.Replace(" ", "▁")])
        decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            decs.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(decs)
        post = []
        info["unknown"] = unk_id
    else:
        raise GGUFImportError(f"{g.path}: tokenizer model {kind!r} is not supported "
                              "(supported: gpt2 byte-level BPE, llama SentencePiece BPE)")

    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == USER_DEFINED])
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = info["bos"], info["eos"]
    single, pair, specials = "$A:0", "$A:0 $B:1", []
    if add_bos and bos is not None:
        single, pair = f"{tokens[bos]}:0 {single}", f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1"
        specials.append((tokens[bos], bos))
    if add_eos and eos is not None:
        single, pair = f"{single} {tokens[eos]}:0", f"{pair} {tokens[eos]}:1"
        specials.append((tokens[eos], eos))
    if specials:
        post.append(processors.TemplateProcessing(single=single, pair=pair,
                                                  special_tokens=specials))
    if post:
        tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)
    eos_ids = [i for i in (eos, info["eot"], info["eom"]) if i is not None]
    eos_ids += [i for i, t in enumerate(tokens) if t in EOT_TEXTS and types[i] == CONTROL]
    info.update(add_bos=add_bos, add_eos=add_eos, kind=kind, add_prefix=add_prefix,
                eos_ids=list(dict.fromkeys(eos_ids)), tokens=tokens)
    return tok, info


def write_tokenizer(g: GGUFFile, out_dir: Path, max_length: int) -> dict:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json; return the info."""
    tok, info = build_tokenizer(g)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens = info.pop("tokens")

    def text(i):
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {"bos_token": text(info["bos"]), "eos_token": text(info["eos"]),
               "unk_token": text(info["unknown"]),
               "pad_token": text(info["padding"]) or text(info["eos"])}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
           "add_bos_token": info["add_bos"], "add_eos_token": info["add_eos"],
           "clean_up_tokenization_spaces": False, "model_max_length": max_length}
    template = g.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = str(template)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({k: v for k, v in special.items() if v is not None}, indent=1))
    return info
