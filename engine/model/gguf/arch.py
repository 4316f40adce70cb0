"""GGUF architectures -> mlx-lm model configs and parameter names.

llama family (`llama`): llama.cpp's converter permutes the rows of attn_q/attn_k so that its
rope (adjacent pairs) matches Hugging Face's (rotate halves); we undo it, since mlx-lm's llama
rotates halves. Llama 3.x stores its rope scaling as a `rope_freqs` tensor; we recover the
`llama3` rope_scaling parameters from it and refuse when they do not reproduce it.

gemma3: llama.cpp stores every Gemma RMSNorm weight plus one (Gemma computes x * (1 + w));
we subtract it again. Rope is rotate-halves already (no permutation).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from engine.model.gguf.reader import GGUFFile, GGUFImportError, Tensor

SUPPORTED = ("llama", "gemma3")
FLOAT_TYPES = ("F32", "F16", "BF16")

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")

_COMMON = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAMES = {
    "llama": {**_COMMON, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "gemma3": {**_COMMON, "attn_norm": "input_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


@dataclass
class ArchPlan:
    """What an architecture needs: the mlx-lm config and how each GGUF tensor maps."""

    config: dict
    transforms: dict[str, Callable[[Tensor], Tensor]] = field(default_factory=dict)
    skip: set[str] = field(default_factory=set)

    def set_rope_freqs(self, freqs: mx.array) -> None:
        """Llama 3.x: the rope_freqs tensor stands for llama3 rope_scaling."""
        c = self.config
        c["rope_scaling"] = _llama3_scaling(freqs, c["head_dim"], c["rope_theta"],
                                            c["max_position_embeddings"])

    def hf_name(self, gguf_name: str, arch: str) -> str:
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        m = _LAYER.match(gguf_name)
        if m and m.group(2) in _LAYER_NAMES[arch]:
            return f"model.layers.{m.group(1)}.{_LAYER_NAMES[arch][m.group(2)]}.{m.group(3)}"
        raise GGUFImportError(f"{arch}: tensor {gguf_name!r} has no known mlx-lm counterpart; "
                              "this GGUF variant is not supported")


def _unpermute(n_head: int) -> Callable[[Tensor], Tensor]:
    """Inverse of llama.cpp's permute(w, n_head): rows (head, pair, 2) -> (head, 2, pair)."""
    def undo(x: mx.array) -> mx.array:
        rows = x.shape[0]
        y = x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:])
        return mx.swapaxes(y, 1, 2).reshape(x.shape)
    return lambda t: t.map_rows(undo)


def _minus_one(t: Tensor) -> Tensor:
    return Tensor(value=t.dequantized().astype(mx.float32) - 1.0, source_type=t.source_type)


def _require(g: GGUFFile, key: str):
    v = g.arch_get(key)
    if v is None:
        raise GGUFImportError(f"{g.path}: metadata {g.arch}.{key} missing")
    return v


def _common_config(g: GGUFFile, vocab_size: int) -> dict:
    hidden = int(_require(g, "embedding_length"))
    heads = int(_require(g, "attention.head_count"))
    kv_heads = g.arch_get("attention.head_count_kv", heads)
    ffn = _require(g, "feed_forward_length")
    for name, v in (("attention.head_count_kv", kv_heads), ("feed_forward_length", ffn)):
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise GGUFImportError(f"{g.path}: per-layer {g.arch}.{name} is not supported")
    kv_heads = int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads)
    ffn = int(ffn[0] if isinstance(ffn, list) else ffn)
    head_dim = int(g.arch_get("attention.key_length", hidden // heads))
    return dict(hidden_size=hidden, num_hidden_layers=int(_require(g, "block_count")),
                intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, vocab_size=vocab_size,
                rms_norm_eps=float(_require(g, "attention.layer_norm_rms_epsilon")),
                max_position_embeddings=int(g.arch_get("context_length", 4096)))


def _llama3_scaling(freqs: mx.array, head_dim: int, theta: float, context: int) -> dict:
    """Recover llama3 rope_scaling from llama.cpp's rope_freqs (per-pair divisors)."""
    f = freqs.astype(mx.float32).tolist()
    factor = max(f)
    for orig in (8192, context):
        cand = dict(rope_type="llama3", factor=factor, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=orig)
        want = []
        for i in range(0, head_dim, 2):
            freq = 1.0 / theta ** (i / head_dim)
            wavelen = 2 * math.pi / freq
            if wavelen < orig / 4.0:
                want.append(1.0)
            elif wavelen > orig / 1.0:
                want.append(factor)
            else:
                smooth = (orig / wavelen - 1.0) / (4.0 - 1.0)
                want.append(1.0 / ((1 - smooth) / factor + smooth))
        if len(want) == len(f) and all(abs(a - b) <= 1e-3 * b for a, b in zip(want, f)):
            return cand
    raise GGUFImportError("rope_freqs does not match llama3 rope scaling (low 1, high 4); "
                          "this rope variant is not supported")


def plan(g: GGUFFile, vocab_size: int, tensor_names: list[str]) -> ArchPlan:
    arch = g.arch
    if arch not in SUPPORTED:
        raise GGUFImportError(
            f"{g.path}: architecture {arch!r} is not supported by the GGUF importer "
            f"(supported: {', '.join(SUPPORTED)})")
    if any("_exps" in n or "ffn_gate_inp" in n for n in tensor_names):
        raise GGUFImportError(f"{g.path}: {arch} with experts (MoE) is not supported")
    cfg = _common_config(g, vocab_size)
    theta = float(g.arch_get("rope.freq_base", 10000.0))
    scaling = None
    s_type, s_factor = g.arch_get("rope.scaling.type"), g.arch_get("rope.scaling.factor")
    if s_type in ("linear",) and s_factor:
        scaling = {"rope_type": "linear", "factor": float(s_factor)}
    elif s_type not in (None, "none"):
        raise GGUFImportError(f"{g.path}: rope scaling {s_type!r} is not supported")
    p = ArchPlan(config={})
    if arch == "llama":
        rope_dims = int(g.arch_get("rope.dimension_count", cfg["head_dim"]))
        if rope_dims != cfg["head_dim"]:
            raise GGUFImportError(f"{g.path}: partial rotary ({rope_dims} of "
                                  f"{cfg['head_dim']} dims) is not supported")
        if "rope_freqs.weight" in tensor_names:   # rope_scaling set from it during import
            p.skip.add("rope_freqs.weight")
        cfg.update(model_type="llama", rope_theta=theta,
                   tie_word_embeddings="output.weight" not in tensor_names,
                   attention_bias=any(n.endswith("attn_q.bias") for n in tensor_names),
                   mlp_bias=any(n.endswith("ffn_up.bias") for n in tensor_names))
        for n in tensor_names:
            m = _LAYER.match(n)
            if m and m.group(2) == "attn_q":
                p.transforms[n] = _unpermute(cfg["num_attention_heads"])
            elif m and m.group(2) == "attn_k":
                p.transforms[n] = _unpermute(cfg["num_key_value_heads"])
    else:  # gemma3
        pattern = g.arch_get("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):   # per-layer "is sliding" flags
            first_full = pattern.index(False) + 1 if False in pattern else len(pattern) + 1
            if any(bool(v) != ((i + 1) % first_full != 0) for i, v in enumerate(pattern)):
                raise GGUFImportError(f"{g.path}: irregular sliding-window layer pattern")
            pattern = first_full
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        # llama.cpp: 27B scales queries by hidden/heads, every other size by head_dim.
        qpas = hidden // heads if g.get("general.size_label") == "27B" else cfg["head_dim"]
        cfg.update(model_type="gemma3_text", rope_theta=theta,
                   rope_local_base_freq=float(g.arch_get("rope.freq_base_swa", 10000.0)),
                   query_pre_attn_scalar=qpas,
                   sliding_window=int(g.arch_get("attention.sliding_window", 512)),
                   sliding_window_pattern=int(pattern))
        if "output.weight" in tensor_names:
            raise GGUFImportError(f"{g.path}: gemma3 with an untied output head is not "
                                  "supported")
        for n in tensor_names:
            if n.endswith("norm.weight"):
                p.transforms[n] = _minus_one
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    p.config = cfg
    return p
