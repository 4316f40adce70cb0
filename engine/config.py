"""EngineConfig: every engine knob, defaulted and validated with messages that name the knob."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from capacity.formats import normalize_format_name, normalize_overrides
from engine.kv.pages import DEFAULT_PAGE_TOKENS, is_power_of_two


class EngineConfig(BaseModel):
    """Configuration of one engine replica. Unknown keys are refused (typos fail loudly)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="local model directory, or a hub id when allow_hub is set")
    kv_format: str = Field("native", description="KV storage format: a name in "
                           "capacity.formats.FORMAT_SPECS (native, int8, k8v4, int4, int4-k32, "
                           "int4-sink, int4-tail, int4-k32-tail, int4-kivi, k6v4-kivi)")
    kv_format_overrides: dict[str, str] = Field(
        default_factory=dict, description="exact `model` value -> KV format; wins over kv_format "
        "(the weights' quantization never selects KV precision)")
    prefill_mode: Literal["direct", "fused"] = Field(
        "direct", description="packed-history prefill path: direct (production) or fused "
        "(opt-in: dequantized FP32 scratch, paid for with a per-step workspace permit)")
    enable_prefix_caching: bool = Field(False, description="reuse full KV pages of earlier "
                                        "prompts (same model, storage format and tenant)")
    checkpoint_key: str | None = Field(None, description="HMAC-SHA256 key: checkpoints are "
                                       "signed when saved and must verify when restored")
    dtype: str | None = Field(None, description="compute dtype; None = float32 on CPU, bf16 else")
    page_tokens: int = Field(DEFAULT_PAGE_TOKENS, description="token slots per KV page (2^n)")
    kv_budget_bytes: int | None = Field(None, description="KV bytes this replica may use")
    kv_memory_fraction: float = Field(0.5, description="budget as a fraction of device memory "
                                      "when kv_budget_bytes is unset")
    max_num_seqs: int = Field(16, description="most requests running (prefill or decode) at once")
    max_step_tokens: int = Field(512, description="most tokens one forward step processes")
    merge_pad_tokens: int | None = Field(
        None, ge=0, description="padding (tokens) one model call of a mixed prefill/decode step "
        "may carry before the step opens another call (engine/runner/paged.py); None = where it "
        "pays: small on the CPU, where a padded token costs real time, large on Metal/CUDA, where "
        "an extra uncompiled call costs more than hundreds of padded tokens")
    prefill_width_bucket: int | None = Field(
        None, ge=1, description="opt-in: pad every multi-token model call (prefill chunks, "
        "mixed calls) to a width that is a multiple of this many tokens, and let its keys span "
        "whole pages, so calls of any prompt length share a few (queries, keys) shapes; for "
        "backends that pay a per-shape cost (plan or kernel build) on each new shape. Padded "
        "positions cost compute and are never written or attended. Decode steps are unchanged. "
        "None = each call's exact width and key range")
    max_model_len: int | None = Field(None, description="most raw tokens (prompt + max_tokens) "
                                      "per request; None = the model's position limit")
    max_waiting: int = Field(1024, description="waiting-queue bound; beyond it -> overloaded")
    allow_hub: bool = Field(False, description="allow downloading `model` from the hub")
    fuse_projections: bool = Field(True, description="one matmul for q/k/v and one for gate/up "
                                   "(engine/model/fuse.py): fewer kernel launches per step")
    compiled_decode: bool | None = Field(
        None, description="decode steps through one compiled graph per shape "
        "(engine/runner/compiled_decode.py); None = where the CUDA decode kernel runs")
    prefill_attention: Literal["auto", "fast", "ops"] = Field(
        "auto", description="how multi-token calls attend (KernelChoices.prefill_attention): "
        "'fast' = mx.fast SDPA (cuDNN on CUDA: one plan build per new shape), 'ops' = MLX "
        "matmuls and softmax (no per-shape build; long calls still take 'fast'), 'auto' = "
        "'ops' on CUDA, 'fast' elsewhere")
    tenant: str = Field("default", description="label carried in stats and telemetry")
    rate_ewma_alpha: float = Field(0.2, description="smoothing of measured prefill/decode rates "
                                   "used for first-token deadline forecasts")

    @field_validator("kv_format")
    @classmethod
    def _format_known(cls, v: str) -> str:
        return normalize_format_name(v)  # KVFormatError is a ValueError: pydantic names the field

    @field_validator("kv_format_overrides")
    @classmethod
    def _overrides_known(cls, v: dict[str, str]) -> dict[str, str]:
        return normalize_overrides(v)

    @field_validator("dtype")
    @classmethod
    def _dtype_known(cls, v: str | None) -> str | None:
        if v is not None and v not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {v!r}")
        return v

    @field_validator("page_tokens")
    @classmethod
    def _page_pow2(cls, v: int) -> int:
        if not (is_power_of_two(v) and v <= 4096):
            raise ValueError(f"page_tokens must be a power of two <= 4096, got {v}")
        return v

    @field_validator("kv_budget_bytes")
    @classmethod
    def _budget_positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"kv_budget_bytes must be positive, got {v}")
        return v

    @field_validator("kv_memory_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 < v <= 0.95:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.95], got {v}")
        return v

    @field_validator("max_num_seqs", "max_step_tokens", "max_waiting")
    @classmethod
    def _positive(cls, v: int, info) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("max_model_len")
    @classmethod
    def _len_positive(cls, v: int | None) -> int | None:
        if v is not None and v < 2:
            raise ValueError(f"max_model_len must be >= 2, got {v}")
        return v

    @field_validator("rate_ewma_alpha")
    @classmethod
    def _alpha(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"rate_ewma_alpha must be in (0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _decode_fits_a_step(self):
        # Every running request decodes one token per step, so a step must hold them all.
        if self.max_step_tokens < self.max_num_seqs:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}) so every running request can decode each step")
        return self
