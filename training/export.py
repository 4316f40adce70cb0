"""Export a trained PyTorch orchard-tiny to an MLX model directory (mlx-lm `qwen3`).

Parameter names already equal mlx-lm's, and torch Linear weights are [out, in] like MLX's, so the
export is a dtype cast. Weights are stored as bfloat16 (the model directory stays under 25 MB).

    python -m training.export --weights run/model --data training/data --out models/orchard-tiny
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

# The shipped geometry: GQA 6 query / 2 KV heads of dim 64, so packed KV formats (g64) apply.
CONFIG = dict(
    model_type="qwen3", hidden_size=384, num_hidden_layers=6, intermediate_size=896,
    num_attention_heads=6, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
    vocab_size=8192, max_position_embeddings=4096, rope_theta=100000.0,
    tie_word_embeddings=True, attention_bias=False,
)
EXTRA_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "torch_dtype": "bfloat16",
                "eos_token_id": [2, 0], "bos_token_id": None, "pad_token_id": 3}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_shards(sd: dict, out: Path, max_bytes: int = 14 << 20) -> None:
    """Weights in shards of <= 14 MiB (mlx_lm.load reads every model*.safetensors)."""
    from safetensors.torch import save_file

    shards, cur, size = [], {}, 0
    for k in sorted(sd):
        n = sd[k].numel() * sd[k].element_size()
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = sd[k], size + n
    shards.append(cur)
    for i, sh in enumerate(shards):
        save_file(sh, str(out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"), metadata={"format": "mlx"})


def write_config(config: dict, out: Path) -> None:
    (out / "config.json").write_text(json.dumps({**config, **EXTRA_CONFIG}, indent=1))


def copy_tokenizer(data_dir: Path, out: Path) -> None:
    for f in TOKENIZER_FILES:
        shutil.copy(Path(data_dir) / "tokenizer" / f, out / f)


def export_dir(model, config: dict, out: Path, data_dir, ref_ids: np.ndarray | None = None,
               with_tokenizer: bool = False) -> None:
    """Write config.json + model.safetensors (bf16) of a torch model; optionally reference logits.

    The reference logits are computed in float32 from the bf16-rounded weights, i.e. from exactly
    the weights MLX will load, so the two should agree to float32 rounding.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()
          if k.startswith("model.")}
    save_shards(sd, out)
    write_config(config, out)
    if with_tokenizer:
        copy_tokenizer(Path(data_dir), out)
    if ref_ids is not None:
        import copy

        m = copy.deepcopy(model).float()
        with torch.no_grad():
            for k, p in m.state_dict().items():
                p.copy_(p.to(torch.bfloat16).float())
            dev = next(m.parameters()).device
            x = torch.tensor(ref_ids, device=dev)[None]
            logits = m(x)[0].float().cpu()
        save_file({"ids": torch.tensor(ref_ids, dtype=torch.int64), "logits_tail": logits[-32:].contiguous(),
                   "argmax": logits.argmax(-1).to(torch.int64), "logsumexp": torch.logsumexp(logits, -1)},
                  str(out.parent / "ref_logits.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description="Assemble an MLX model dir from exported weights "
                                 "(config from training.train.CONFIG, tokenizer from the corpus dir).")
    ap.add_argument("--weights", required=True, help="the model/ dir written by training.train (shards + config)")
    ap.add_argument("--data", default="training/data", help="corpus dir holding tokenizer/")
    ap.add_argument("--out", default="models/orchard-tiny")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(a.weights).glob("model*.safetensors")):
        shutil.copy(f, out / f.name)
    write_config(CONFIG, out)
    copy_tokenizer(Path(a.data), out)


if __name__ == "__main__":
    main()
