"""Orchard service configuration: pydantic models loaded from YAML, every knob with a default.

Invalid config fails fast with a `ConfigError` whose message names the offending field
(`models.0.kv_format: unknown KV format 'int3' ...`), before Ray or any model is touched.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, PositiveFloat, ValidationError,
                      ValidationInfo, field_serializer, field_validator, model_validator)

from capacity.caps import CapConfig
from capacity.fleet import FleetConfig
from capacity.formats import normalize_format_name, normalize_overrides
from engine.config import EngineConfig

DEFAULT_MODEL_ID = "orchard-tiny"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "orchard-tiny"


# Ray Serve per-process settings every replica of the app starts with (`replica_env` entries
# win): user code and the request router on the replica's own event loop instead of a thread
# and loop of their own, and gRPC instead of Ray object refs between the ingress and the model
# replicas. Paired bench: -12 ms p50 on the first token (docs/lab/benchmarks-serve.md).
SERVE_FAST_PATH_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                       "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                       "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicaResources(_Strict):
    """Ray resources per replica. `resources={"mac": 0.01}` pins replicas to Mac nodes."""

    num_cpus: float = Field(0.5, ge=0)
    num_gpus: float = Field(0, ge=0)
    memory: int | None = Field(None, ge=0, description="bytes of RAM Ray reserves")
    resources: dict[str, float] = Field(default_factory=dict)
    accelerator_type: str | None = None

    def ray_actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            opts["num_gpus"] = self.num_gpus
        if self.memory:
            opts["memory"] = self.memory
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        return opts


# Where a served replica's defaults differ from the engine library's (EngineConfig), declared once;
# a model's `engine:` knobs win over them.
SERVED_ENGINE_DEFAULTS: dict[str, Any] = {
    # A served replica reuses earlier prompts' KV pages: a chat resends its whole history every
    # turn, and without reuse each turn prefills it all again (on a 2-core CPU box a 4K-token
    # SmolLM2 history is a minute of prefill). Cached pages are evicted least recently used when
    # a request needs the memory, so the cache never refuses work.
    "enable_prefix_caching": True,
}
# 32 = mlx_lm.server's own decode concurrency: the learned cap protects stream speed when nothing
# queues; under a queue requests stretch up to this ceiling (docs/serving.md). A model's own
# `max_num_seqs` key, not an engine knob: routing and Serve's ceiling read it too.
SERVED_MAX_NUM_SEQS = 32

SERVE_OWNED_ENGINE_KNOBS = {"model", "kv_format", "kv_format_overrides", "kv_budget_bytes",
                            "kv_memory_fraction", "max_num_seqs"}
# Engine paths kept for benchmarks: served replicas always run the production path, so the
# capacity actor never learns rates for a mode no production replica runs.
BENCH_ONLY_ENGINE_KNOBS = {"prefill_mode": "served replicas always prefill packed history "
                           "with the direct path; the fused path is reachable from the "
                           "benchmarks only (orchard bench kv)",
                           "compiled_decode": "served replicas compile decode steps wherever "
                           "the CUDA decode kernels run and fall back on their own where a "
                           "model cannot be traced; uncompiled steps are reachable from the "
                           "benchmarks only (--no-compile)",
                           "prefill_attention": "served replicas attend prefill through MLX ops "
                           "on CUDA and mx.fast elsewhere; the other ways are reachable from the "
                           "benchmarks only (python -m bench.device.prefill_shapes)"}


class ModelConfig(_Strict):
    """One served model: `id` is what clients put in `model`; `path` a directory or hub id."""

    id: str = Field(min_length=1)
    path: str = Field(min_length=1)
    kv_format: str | None = Field(None, description="None = the exact-model override or default")
    replicas: int = Field(1, ge=1)
    kv_budget_bytes: int | None = Field(None, gt=0)
    max_num_seqs: int = Field(SERVED_MAX_NUM_SEQS, ge=1, description="concurrency ceiling per "
                              "replica")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Serve's per-replica hard cap; default = 2x max_num_seqs")
    resources: ReplicaResources = Field(default_factory=ReplicaResources)
    max_replicas_per_node: int | None = Field(None, ge=1, description="spread replicas")
    engine: EngineConfig = Field(
        default_factory=dict, validate_default=True, description="the replica's engine: the "
        "YAML's `engine:` knobs over SERVED_ENGINE_DEFAULTS; the serve-owned knobs "
        "(SERVE_OWNED_ENGINE_KNOBS) come from the model's own keys, the kv policy and the memory "
        "plan when the replica starts (engine_config)")
    warmup: bool = Field(True, description="decode a few steps alone and in a batch before "
                         "taking traffic: no first-use cost on the first request, and the "
                         "capacity actor learns this box's batch slowdown from the start")

    @field_validator("kv_format")
    @classmethod
    def _format(cls, v: str | None) -> str | None:
        return v if v is None else normalize_format_name(v)

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_tree(cls, v: Any, info: ValidationInfo) -> Any:
        """The YAML's `engine:` mapping -> EngineConfig, refusing knobs a serving config decides
        elsewhere, bench-only paths and unknown names (each message names the knob)."""
        if not isinstance(v, dict):
            return v         # an EngineConfig already, or a type pydantic reports
        # These are decided by the serving config itself (format policy, budgets, ceiling);
        # letting the passthrough set them would silently override that decision.
        owned = sorted(set(v) & SERVE_OWNED_ENGINE_KNOBS)
        if owned:
            raise ValueError(f"set {', '.join(owned)} on the model (or under kv: and "
                             "memory:), not in its engine: passthrough")
        bench_only = sorted(set(v) & set(BENCH_ONLY_ENGINE_KNOBS))
        if bench_only:
            raise ValueError("; ".join(f"engine.{k} cannot be set in a serving config: "
                                       f"{BENCH_ONLY_ENGINE_KNOBS[k]}" for k in bench_only))
        unknown = sorted(set(v) - set(EngineConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown engine knob(s) {', '.join(unknown)}; see "
                             "engine/config.py for EngineConfig's fields")
        # `model` is required; the replica sets it from the resolved path (engine_config).
        return {**SERVED_ENGINE_DEFAULTS, **v, "model": str(info.data.get("path") or "")}

    @field_serializer("engine")
    def _engine_knobs(self, engine: EngineConfig) -> dict[str, Any]:
        # The knobs as the YAML gives them, so a dumped config validates again.
        return engine.model_dump(exclude_unset=True, exclude=SERVE_OWNED_ENGINE_KNOBS)

    def engine_config(self, kv_format: str) -> EngineConfig:
        """The replica's EngineConfig: this model's engine knobs plus what the rest of the config
        decided: the resolved path, the KV format (kv policy, negotiated), the KV budget (memory
        plan) and the ceiling."""
        return EngineConfig.model_validate({
            **self.engine.model_dump(exclude_unset=True), "model": self.path,
            "kv_format": kv_format, "kv_budget_bytes": self.kv_budget_bytes,
            "max_num_seqs": self.max_num_seqs})

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str) -> str:
        # Deployment names may not contain '#'; keep ids URL- and label-safe.
        if any(c in v for c in "#/ \t\n"):
            raise ValueError(f"model id {v!r} may not contain '#', '/' or whitespace")
        return v


class KVDefaults(_Strict):
    """Global KV format default, and exact-model-id overrides (a model's own kv_format wins)."""

    default: str = "native"
    overrides: dict[str, str] = Field(default_factory=dict)

    @field_validator("default")
    @classmethod
    def _default(cls, v: str) -> str:
        return normalize_format_name(v)

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, v: dict[str, str]) -> dict[str, str]:
        return normalize_overrides(v)


# The actor's cap defaults (capacity.caps.CapConfig), declared there once.
_CAPS = CapConfig()


class CapacitySettings(_Strict):
    namespace: str = "orchard"
    snapshot_path: str | None = Field(None, description="where the actor persists learned rates; "
                                      "None = ~/.cache/orchard/capacity-rates.json, '' = nowhere")
    heartbeat_interval_s: float = Field(2.0, gt=0)
    max_fault_retries: int = Field(3, ge=1, description="actor faults before power-of-two")
    fallback_cooldown_s: float = Field(10.0, ge=0, description="power-of-two period after faults")
    routing_stats_period_s: float = Field(1.0, gt=0)
    prefix_routing: bool = Field(
        True, description="route a request to the replica caching the longest prefix of its "
        "prompt (its tenant's pages) when that replica has room; false = headroom only")
    prefix_wait_s: float | None = Field(None, ge=0, description="cap on a request's wait for a "
        "full replica caching its prefix (otherwise about the prefill that prefix saves at the "
        "learned rate, 2 s while unlearned: capacity/affine_bound.py; always within "
        "queue_timeout_s and its deadline); null = no cap of its own; 0 = never wait")
    handoff: bool = Field(
        True, description="a replica with prefix caching that drains (redeploy, scale-down) "
        "hands its cached pages to another replica of the same model and format, which imports "
        "them (serve_app/handoff.py); false = a drained replica's conversations are recomputed")
    # 120 s, not 30: on the 2-core CPU box a 4 req/s burst's last first token came at 29-38 s,
    # which the peers served and 30 s refused (docs/serving.md, "Queueing").
    queue_timeout_s: float = Field(
        120.0, ge=0, validation_alias=AliasChoices("queue_timeout_s", "hold_wait_s"),
        description="how long a request may wait in the capacity queue (FIFO per model at the "
        "actor) before 429; bounded by the first-token deadline; 0 = refuse at once. "
        "`hold_wait_s` is the old name")
    # 1024, not 64: on the H200 a burst of 256 SmolLM2 requests in 2 s (a queue the replica
    # drains in seconds) had half refused at once by a bound of 64, where mlx_lm.server served
    # all (docs/lab/benchmarks-serve-gpu.md, run 5). The wait is bounded in time by
    # queue_timeout_s; this count only caps what one ingress holds open.
    max_queued: int = Field(1024, ge=0, description="requests per model one ingress lets wait "
                            "for capacity; beyond that a request is refused (429) at once")
    decode_floor_tps: float | None = Field(
        None, gt=0, description="TPOT objective: per-request decode tok/s a user must still see "
        f"at the concurrency cap (the actor's caps.floor_tps; None = its default, "
        f"{_CAPS.floor_tps:g}), never more than solo / max_slowdown. Applies when the actor is "
        "created")
    max_slowdown: float = Field(
        _CAPS.max_slowdown, ge=1.0, description="where even a lone request decodes below "
        "decode_floor_tps, the cap keeps each stream within this factor of its solo time per "
        "token instead")
    actor_resources: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="Ray resources the capacity actor needs, which pins "
        "where it is created: {head: 0.01} keeps it on the head (cluster.yaml), so losing a "
        "worker never takes the ledger with it; {} = anywhere (one box)")
    ttft_objective_s: float | None = Field(
        _CAPS.ttft_objective_s, gt=0, description="TTFT objective: a request queued for "
        "capacity half this long is admitted above the learned cap (up to max_num_seqs, memory permitting) rather than "
        "miss it; null = never above the cap (queue, then 429)")

    def actor_config(self) -> dict | None:
        """The capacity actor's FleetConfig sections these settings set (None: defaults), in
        their wire form: the actor may be created by another process. Built through the typed
        sections, so a knob CapConfig lacks fails here by name."""
        caps = {}
        if self.decode_floor_tps is not None:
            caps["floor_tps"] = self.decode_floor_tps
        for name in ("max_slowdown", "ttft_objective_s"):
            if name in self.model_fields_set:
                caps[name] = getattr(self, name)
        if not caps:
            return None
        return FleetConfig(caps=CapConfig(**caps)).model_dump(exclude_unset=True)


class MemorySettings(_Strict):
    """One device-memory budget per node, shared by every replica placed there
    (serve_app/memory_plan.py): weights + KV pools + workspace must fit together."""

    node_bytes: int | None = Field(None, gt=0, description="device memory of one node; None = "
                                   "the smallest mac_mem_gb the Ray nodes advertise, else this "
                                   "machine's")
    budget_fraction: float = Field(0.75, gt=0, le=0.95, description="share of a node's memory "
                                   "the replicas on it may use together (the OS and other "
                                   "processes keep the rest)")
    workspace_bytes_per_replica: int = Field(512 << 20, ge=0, description="floor of the "
                                             "per-replica allowance for the runtime and step "
                                             "activations; the plan reserves the larger of this "
                                             "and the step workspace priced from the model's "
                                             "geometry (capacity/pricing.py)")
    min_kv_bytes_per_replica: int = Field(64 << 20, ge=0, description="a default KV share "
                                          "below this refuses the config")


class HTTPSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    first_token_deadline_header: str = "x-orchard-first-token-deadline-ms"
    default_max_tokens: int = Field(1024, ge=1, description="max_tokens of a request that "
                                    "omits it (never more than the context or KV budget "
                                    "left after its prompt): each request reserves prompt + "
                                    "max_tokens, so the whole context would cut concurrency")
    cors_origins: list[str] = Field(default_factory=list, description="browser origins allowed "
                                    "to call the API (CORS); empty = no CORS headers, '*' = any")
    direct_ingress: bool = Field(True, description="when `orchard serve` starts Ray itself, "
                                 "the ingress replica serves HTTP on `port` directly (Serve's "
                                 "direct ingress) instead of behind Serve's proxy")


class OrchardConfig(_Strict):
    app_name: str = "orchard"
    route_prefix: str = "/"
    models: list[ModelConfig] = Field(min_length=1)
    kv: KVDefaults = Field(default_factory=KVDefaults)
    api_keys: list[str] = Field(default_factory=list,
                                description="bearer keys; empty = no auth (env ORCHARD_API_KEYS)")
    capacity: CapacitySettings = Field(default_factory=CapacitySettings)
    http: HTTPSettings = Field(default_factory=HTTPSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    ingress_resources: ReplicaResources = Field(
        default_factory=lambda: ReplicaResources(num_cpus=0),
        description="the ingress replica; e.g. {resources: {head: 0.01}} keeps it off the Macs")
    drain_timeout_s: float = Field(30.0, ge=0)
    replica_env: dict[str, str] = Field(
        default_factory=dict, description="environment variables for every replica of this "
        "application (ingress and models), over SERVE_FAST_PATH_ENV and the job's; e.g. "
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD: '1' restores Serve's default")

    @model_validator(mode="after")
    def _unique_ids(self):
        seen = set()
        for i, m in enumerate(self.models):
            if m.id in seen:
                raise ValueError(f"models.{i}.id: duplicate model id {m.id!r}")
            seen.add(m.id)
        unknown = set(self.kv.overrides) - seen
        if unknown:
            raise ValueError(f"kv.overrides: no model with id {sorted(unknown)[0]!r}")
        return self

    def replica_env_vars(self) -> dict[str, str]:
        return {**SERVE_FAST_PATH_ENV, **self.replica_env}

    def kv_format_for(self, model: ModelConfig) -> str:
        return model.kv_format or self.kv.overrides.get(model.id) or self.kv.default

    def all_api_keys(self) -> list[str]:
        env = [k for k in os.environ.get("ORCHARD_API_KEYS", "").split(",") if k.strip()]
        return [*self.api_keys, *(k.strip() for k in env)]

    def model(self, model_id: str) -> ModelConfig | None:
        return next((m for m in self.models if m.id == model_id), None)


def _format_validation_error(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: {loc}: {msg}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "config", base_dir: Path | None = None) -> OrchardConfig:
    """Validate a config mapping; relative model paths that exist under base_dir become absolute."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        cfg = OrchardConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None
    if base_dir is not None:
        for m in cfg.models:
            p = Path(m.path).expanduser()
            if not p.is_absolute() and (base_dir / p).exists():
                m.path = str((base_dir / p).resolve())
            elif p.exists():
                m.path = str(p.resolve())
    _import_gguf_paths(cfg, source)
    return cfg


def _import_gguf_paths(cfg: OrchardConfig, source: str) -> None:
    """A model `path:` naming a .gguf file becomes its imported folder (engine.model.gguf.cache:
    imported once per file content, with progress on stderr)."""
    for i, m in enumerate(cfg.models):
        if not m.path.lower().endswith(".gguf"):
            continue
        from engine.model.gguf import GGUFImportError
        from engine.model.gguf.cache import imported_model_dir

        if not Path(m.path).expanduser().is_file():
            raise ConfigError(f"{source}: models.{i}.path: no such GGUF file {m.path!r}")
        try:
            m.path = str(imported_model_dir(m.path))
        except GGUFImportError as e:
            raise ConfigError(f"{source}: models.{i}.path: {e}") from None


def load_config(path: str | os.PathLike) -> OrchardConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return parse_config(data, source=str(path), base_dir=path.resolve().parent)


def default_config() -> OrchardConfig:
    """The embedded default: serve models/orchard-tiny, or say clearly that it is missing."""
    if not DEFAULT_MODEL_DIR.is_dir():
        raise ConfigError(
            f"default model missing: {DEFAULT_MODEL_DIR} does not exist; pass a config file "
            f"(see config.example.yaml) or restore models/orchard-tiny")
    return parse_config({"models": [{"id": DEFAULT_MODEL_ID, "path": str(DEFAULT_MODEL_DIR)}]},
                        source="default config")
