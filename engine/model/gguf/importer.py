"""GGUF file -> a standard model folder that mlx-lm and Orchard's engine load.

Writes config.json, model.safetensors (sharded above 4 GiB), tokenizer.json,
tokenizer_config.json, special_tokens_map.json and generation_config.json. `dtype`:
- float32 / bfloat16 / float16: every weight dequantized and cast;
- keep: Q8_0/Q4_0/Q4_1 stay MLX-quantized bit for bit (affine, group 32); other quantized types
  (K-quants, IQ...) are re-quantized to MLX affine at the nearest bit width (group 32), which is
  close but not exact; float tensors keep their stored dtype. config.json's `quantization`
  names each quantized layer's bits and group size.
The folder is written next to OUT_DIR and renamed into place at the end, so an interrupted
import never leaves a half-written model behind.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import mlx.core as mx

import engine.model.gguf.arch as archs
from engine.model.gguf.reader import GGUFFile, GGUFImportError, Tensor
from engine.model.gguf.tokenizer import write_tokenizer

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16, "keep": None}
SHARD_BYTES = 4 << 30
REQUANT_GROUP = 32
# Bits for re-quantizing types MLX cannot hold as they are ("keep" only).
REQUANT_BITS = {"Q2_K": 3, "Q3_K": 4, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q8_K": 8, "Q5_0": 5,
                "Q5_1": 5, "IQ4_NL": 4, "IQ4_XS": 4}


def _stderr(msg: str) -> None:
    print(f"[gguf] {msg}", file=sys.stderr, flush=True)


def _requantize(t: Tensor) -> Tensor:
    bits = REQUANT_BITS.get(t.source_type, 4 if t.source_type.startswith(("IQ", "TQ")) else 8)
    w, s, b = mx.quantize(t.value.astype(mx.float32), group_size=REQUANT_GROUP, bits=bits)
    return Tensor(weight=w, scales=s.astype(mx.float16), biases=b.astype(mx.float16), bits=bits,
                  group_size=REQUANT_GROUP, source_type=t.source_type)


def _write_weights(weights: dict[str, mx.array], out: Path) -> None:
    total = sum(v.nbytes for v in weights.values())
    if total <= SHARD_BYTES:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    shards, cur, size = [], {}, 0
    for k, v in weights.items():
        if cur and size + v.nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + v.nbytes
    shards.append(cur)
    index = {"metadata": {"total_size": total}, "weight_map": {}}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        index["weight_map"].update({k: name for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def import_gguf(src: str | Path, out_dir: str | Path, dtype: str = "float32",
                progress: Callable[[str], None] | None = _stderr, overwrite: bool = False) -> Path:
    """Import the GGUF file `src` into the model folder `out_dir`; return out_dir."""
    say = progress or (lambda _msg: None)
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise GGUFImportError(f"{out} exists and is not empty (remove it or pass overwrite)")
    t0 = time.monotonic()
    g = GGUFFile(src)
    names = list(g.tensor_types)
    shapes = g.tensor_shapes
    if "token_embd.weight" not in shapes:
        raise GGUFImportError(f"{g.path}: no token_embd.weight tensor")
    vocab_size = shapes["token_embd.weight"][0]
    p = archs.plan(g, vocab_size, names)
    types = Counter(g.tensor_types.values())
    say(f"{g.path.name}: {g.arch}, {p.config['num_hidden_layers']} layers, hidden "
        f"{p.config['hidden_size']}, vocab {vocab_size}; {len(names)} tensors ("
        + ", ".join(f"{n} {k}" for k, n in types.most_common()) + f") -> {dtype}")

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        info = write_tokenizer(g, tmp, p.config["max_position_embeddings"])
        weights: dict[str, mx.array] = {}
        quant: dict[str, dict] = {}
        target = DTYPES[dtype]
        last = time.monotonic()
        for i, (name, t) in enumerate(g.tensors()):
            if name in p.skip:
                if name == "rope_freqs.weight":
                    p.set_rope_freqs(t.dequantized())
                continue
            hf = p.hf_name(name, g.arch)
            if name in p.transforms:
                t = p.transforms[name](t)
            if (target is None and not t.quantized and t.source_type not in archs.FLOAT_TYPES
                    and t.value.ndim == 2 and t.value.shape[-1] % REQUANT_GROUP == 0):
                t = _requantize(t)
            if target is None and t.quantized:
                base = hf.removesuffix(".weight")
                added = {hf: t.weight, base + ".scales": t.scales, base + ".biases": t.biases}
                quant[base] = {"group_size": t.group_size, "bits": t.bits}
            else:
                added = {hf: t.value if target is None else t.dequantized().astype(target)}
            mx.eval(*added.values())
            weights.update(added)
            if time.monotonic() - last > 2.0 or i + 1 == len(names):
                say(f"  tensors {i + 1}/{len(names)} ({time.monotonic() - t0:.1f} s)")
                last = time.monotonic()
        config = {**p.config, "eos_token_id": info["eos_ids"][0] if len(info["eos_ids"]) == 1
                  else info["eos_ids"]}
        if info["bos"] is not None:
            config["bos_token_id"] = info["bos"]
        if quant:
            common = Counter((q["group_size"], q["bits"]) for q in quant.values()).most_common(1)
            group, bits = common[0][0]
            config["quantization"] = {"group_size": group, "bits": bits, "mode": "affine",
                                      **quant}
        config["torch_dtype"] = dtype if target is not None else "float16"
        say(f"  writing weights ({sum(v.nbytes for v in weights.values()) / 2**20:.0f} MiB)")
        _write_weights(weights, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        gen = {"eos_token_id": info["eos_ids"]}
        if info["bos"] is not None:
            gen["bos_token_id"] = info["bos"]
        if info["padding"] is not None:
            gen["pad_token_id"] = info["padding"]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1))
        (tmp / "gguf_source.json").write_text(json.dumps({
            "file": g.path.name, "architecture": g.arch, "name": g.get("general.name"),
            "tensor_types": dict(types), "dtype": dtype}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"imported {g.path.name} -> {out} in {time.monotonic() - t0:.1f} s")
    return out
