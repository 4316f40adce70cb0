"""GGUF import: tiny GGUF files built offline (tests.fixtures.gguf_models) import into folders
that generate exactly what the same weights written directly as safetensors generate, through
mlx-lm and through Orchard's engine; tokenizers round-trip; unsupported input is refused by
name; the CLI and serving-config paths work. The `real` test runs SmolLM2-135M-Instruct."""
from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.model.gguf import GGUFImportError, import_gguf
from tests.engine_helpers import collect, make_engine, run, tokens
from tests.fixtures.gguf_models import build_gguf_pair

PROMPT = [5, 9, 17, 33, 40, 41, 42, 60, 7, 12]
CASES = [("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"), ("llama", "F16"),
         ("llama", "Q4_K"), ("gemma3", "Q8_0"), ("gemma3", "Q4_1"), ("gemma3", "Q6_K")]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(arch, qtype) -> built pair, made on first use."""
    made = {}

    def get(arch, qtype):
        if (arch, qtype) not in made:
            made[arch, qtype] = build_gguf_pair(
                arch, qtype, tmp_path_factory.mktemp(f"{arch}-{qtype}"))
        return made[arch, qtype]
    return get


@pytest.fixture(scope="module")
def imported(pairs, tmp_path_factory):
    made = {}

    def get(arch, qtype, dtype="float32"):
        key = (arch, qtype, dtype)
        if key not in made:
            out = tmp_path_factory.mktemp("imported") / f"{arch}-{qtype}-{dtype}"
            made[key] = import_gguf(pairs(arch, qtype)["gguf"], out, dtype=dtype, progress=None)
        return made[key]
    return get


def _mlx_lm(folder):
    from mlx_lm import load

    return load(str(folder))


def _logits(model, prompt=PROMPT):
    return np.array(model(mx.array([prompt]))[0].astype(mx.float32))


def _greedy(model, n=12, prompt=PROMPT):
    from mlx_lm.generate import generate_step

    out = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        out.append(int(tok))
    return out


@pytest.mark.parametrize("arch,qtype", CASES)
def test_imported_float32_generates_what_the_same_weights_do(pairs, imported, arch, qtype):
    ref_model, _ = _mlx_lm(pairs(arch, qtype)["ref"])
    imp_model, _ = _mlx_lm(imported(arch, qtype))
    ref, got = _logits(ref_model), _logits(imp_model)
    assert np.abs(ref - got).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert _greedy(imp_model) == _greedy(ref_model)
    config = json.loads((imported(arch, qtype) / "config.json").read_text())
    assert config["model_type"] == {"llama": "llama", "gemma3": "gemma3_text"}[arch]
    assert "quantization" not in config


def test_without_the_unpermute_llama_would_differ(pairs, tmp_path):
    """The q/k row permutation matters on these weights (so the test above can catch it)."""
    from engine.model.gguf import arch as archs

    pair = pairs("llama", "Q8_0")
    original = archs._unpermute
    archs._unpermute = lambda n_head: (lambda t: t)
    try:
        out = import_gguf(pair["gguf"], tmp_path / "wrong", progress=None)
    finally:
        archs._unpermute = original
    ref, _ = _mlx_lm(pair["ref"])
    wrong, _ = _mlx_lm(out)
    assert np.abs(_logits(ref) - _logits(wrong)).max() > 1e-2


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("llama", "Q4_0"),
                                        ("gemma3", "Q4_1")])
def test_keep_holds_mlx_quantized_weights_exactly(pairs, imported, arch, qtype):
    folder = imported(arch, qtype, "keep")
    config = json.loads((folder / "config.json").read_text())
    bits = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}[qtype]
    q = config["quantization"]
    assert (q["bits"], q["group_size"]) == (bits, 32)
    assert q["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": bits}
    import mlx.nn as nn

    model, _ = _mlx_lm(folder)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    # Scales are stored in float16 as in the GGUF; compute in float32 as Orchard's loader does.
    model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    ref_model, _ = _mlx_lm(pairs(arch, qtype)["ref"])
    ref, got = _logits(ref_model), _logits(model)
    assert np.abs(ref - got).max() <= 1e-3 * max(1.0, np.abs(ref).max())
    assert _greedy(model) == _greedy(ref_model)


def test_keep_requantizes_k_quants(imported):
    folder = imported("llama", "Q4_K", "keep")
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 4}
    model, _ = _mlx_lm(folder)
    out = _greedy(model, n=4)
    assert len(out) == 4 and np.isfinite(_logits(model)).all()


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("gemma3", "Q8_0"),
                                        ("llama", "Q4_K")])
def test_engine_generates_what_mlx_lm_does_on_the_import(imported, arch, qtype):
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    folder = imported(arch, qtype)
    model, _ = _mlx_lm(folder)
    want = _greedy(model, n=12)
    eng = make_engine(str(folder))
    try:
        got = tokens(run(collect(eng, GenerationRequest(
            "g", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))))
    finally:
        eng.shutdown()
    assert got == want


def test_byte_level_bpe_matches_the_original_tokenizer(pairs, imported):
    from tokenizers import Tokenizer

    pair = pairs("llama", "Q8_0")
    original = Tokenizer.from_file(str(pair["gguf"].parent / "tok" / "tokenizer.json"))
    ours = Tokenizer.from_file(str(imported("llama", "Q8_0") / "tokenizer.json"))
    texts = ["The quick brown fox", "<|im_start|>user\nhi there<|im_end|>\n",
             "def add(a, b):\n    return a + b", "héllo wörld ☃ 🍎 12345", "\x00\x01 \t\n\r",
             "<|endoftext|><|endoftext|>x"]
    for text in texts:
        assert ours.encode(text).ids == original.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    ids = ours.encode("<|im_start|>a<|im_end|>").ids
    assert ids[0] == pair["tokens"].index("<|im_start|>")
    assert ours.decode(ids, skip_special_tokens=True) == "a"


def test_sentencepiece_vocab_with_byte_fallback(pairs, imported):
    from tokenizers import Tokenizer

    pair = pairs("gemma3", "Q8_0")
    toks = pair["tokens"]
    reference = Tokenizer.from_file(str(pair["gguf"].parent / "spm_reference.json"))
    ours = Tokenizer.from_file(str(imported("gemma3", "Q8_0") / "tokenizer.json"))
    for text in ("The quick brown fox jumps over the lazy dog.", "def add(a, b):",
                 "Orchard serves language models", "passkey retrieval 12 13"):
        enc = ours.encode(text)
        assert enc.tokens[0] == "<bos>"                       # add_bos_token from the GGUF
        assert enc.tokens[1:] == reference.encode(text).tokens, text
        assert len(enc.ids) < len(text)                       # pieces merged, not characters
        assert ours.decode(enc.ids, skip_special_tokens=True) == text
    # Characters outside the vocabulary fall back to their UTF-8 bytes, and decode back.
    for text in ("héllo ☃", "Zebra 🍎!", "a\tb\nc"):
        ids = ours.encode(text).ids
        assert any(toks[i].startswith("<0x") for i in ids)
        assert ours.decode(ids, skip_special_tokens=True) == text
    ids = ours.encode("<start_of_turn>user\nhello<end_of_turn>").ids
    assert ids[:2] == [toks.index("<bos>"), toks.index("<start_of_turn>")]
    assert toks.index("<end_of_turn>") in ids
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhello"


def test_tokenizer_files_carry_template_and_eos(pairs, imported):
    from mlx_lm.tokenizer_utils import load as load_tok  # noqa: F401 (import check)

    for arch, eos_texts in (("llama", {"<|endoftext|>", "<|im_end|>"}),
                            ("gemma3", {"<eos>", "<end_of_turn>"})):
        pair, folder = pairs(arch, "Q8_0"), imported(arch, "Q8_0")
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        assert "<start_of_turn>" in cfg["chat_template"] or "<|im_start|>" in cfg["chat_template"]
        gen = json.loads((folder / "generation_config.json").read_text())
        assert {pair["tokens"][i] for i in gen["eos_token_id"]} == eos_texts
        _, tok = _mlx_lm(folder)
        assert {pair["tokens"][i] for i in tok.eos_token_ids} == eos_texts
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                       add_generation_prompt=True, tokenize=False)
        assert "hi" in text and text.rstrip().endswith(("assistant", "model"))


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen2")
    w.add_embedding_length(64)
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFImportError, match="architecture 'qwen2' is not supported"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_cli_import_and_refusals(pairs, tmp_path, capsys):
    from serve_app.cli import main

    src = str(pairs("llama", "Q4_1")["gguf"])
    out = tmp_path / "m"
    assert main(["import-gguf", src, str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert mx.load(str(out / "model.safetensors"))["model.norm.weight"].dtype == mx.bfloat16
    assert "imported model.gguf" in capsys.readouterr().err
    assert main(["import-gguf", src, str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["import-gguf", src, str(out), "--force"]) == 0
    assert main(["import-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "x")]) == 2


def test_serving_config_imports_a_gguf_once(pairs, tmp_path, monkeypatch, capfd):
    from serve_app.config import ConfigError, parse_config

    monkeypatch.setenv("ORCHARD_GGUF_CACHE", str(tmp_path / "cache"))
    src = pairs("gemma3", "Q4_1")["gguf"]
    cfg = parse_config({"models": [{"id": "g", "path": str(src)}]})
    folder = Path(cfg.models[0].path)
    assert folder.parent == tmp_path / "cache" and (folder / "config.json").is_file()
    assert "imported model.gguf" in capfd.readouterr().err
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again = parse_config({"models": [{"id": "g", "path": str(src)}]})
    assert again.models[0].path == str(folder)
    assert "imported" not in capfd.readouterr().err
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ConfigError, match="models.0.path: no such GGUF file"):
        parse_config({"models": [{"id": "g", "path": str(tmp_path / "missing.gguf")}]})


@pytest.mark.slow
@pytest.mark.real
def test_real_smollm2_engine_equals_mlx_lm_and_knows_paris():
    """SmolLM2-135M-Instruct (models/smollm2-135m, fetched and imported if missing)."""
    from mlx_lm import generate

    from engine.model.gguf.real_model import ensure_real_model
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    folder = ensure_real_model()
    model, tok = _mlx_lm(folder)
    questions = ["What is the capital of France?", "Name three colors.",
                 "Write a Python function that adds two numbers."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True) for q in questions]
    want = [generate(model, tok, p, max_tokens=24) for p in prompts]
    assert "Paris" in want[0]
    eng = make_engine(str(folder), pages=256)
    try:
        # The engine's last delta carries the EOS token; mlx-lm's text stops before it.
        got = [tok.decode([t for t in tokens(run(collect(eng, GenerationRequest(
            f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=24)))))
            if t not in tok.eos_token_ids]) for i, p in enumerate(prompts)]
    finally:
        eng.shutdown()
    assert got == want
