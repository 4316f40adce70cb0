"""Wire models between replicas and the capacity actor (pydantic), plus capability negotiation.

Rules: unknown fields are ignored (a newer replica can talk to an older actor); reports carry a
(incarnation, seq) pair so stale or out-of-order heartbeats are discarded; a slot's actual
execution identity is authoritative when the slot is resident, else the model's declaration is.
A replica enables a packed KV format only after the actor advertised CAP_EXECUTION_IDENTITY, since
an actor that ignores identities would mix packed and native histories.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from capacity.errors import ProtocolError
from capacity.identity import parse_execution
from capacity.pricing import CostModel, Workspace

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1
CAP_EXECUTION_IDENTITY = "execution_identity"
CAP_COST_MODEL = "cost_model"
CAP_RAW_TOKEN_BUDGET = "raw_token_budget"
CAP_REQUEST_TELEMETRY = "request_telemetry"
ACTOR_CAPABILITIES = frozenset({CAP_EXECUTION_IDENTITY, CAP_COST_MODEL, CAP_RAW_TOKEN_BUDGET,
                                CAP_REQUEST_TELEMETRY})
SLOT_STATES = ("running", "idle", "loading", "idle_shutdown", "draining", "crashed", "unknown")
RESIDENT_STATES = ("running", "idle")
MAX_ACTIVE_LISTED = 1024   # a slot lists at most this many active requests (else active_complete=False)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class WorkspaceWire(_Wire):
    fixed: int = Field(0, ge=0)
    per_token: int = Field(0, ge=0)
    per_request: int = Field(0, ge=0)


class CostModelWire(_Wire):
    budget_bytes: int = Field(ge=0)
    bytes_per_token: int = Field(ge=0)
    page_tokens: int = Field(ge=1)
    fixed_bytes_per_request: int = Field(0, ge=0)
    workspace: WorkspaceWire = WorkspaceWire()
    concurrency_ceiling: int = Field(16, ge=1)
    token_limit: int = Field(2**31 - 1, ge=1)

    def to_cost_model(self) -> CostModel:
        return CostModel(**{**self.model_dump(), "workspace": Workspace(**self.workspace.model_dump())})

    @classmethod
    def from_cost_model(cls, cm: CostModel) -> "CostModelWire":
        return cls(**cm.to_dict())


class ActiveRequest(_Wire):
    request_id: str = Field(min_length=1, max_length=256)
    raw_tokens: int = Field(ge=1)


class SlotReport(_Wire):
    model_id: str = Field(min_length=1, max_length=256)
    state: str = "unknown"
    declared_execution: str | None = None     # the model's configured policy (future loads)
    execution_identity: str | None = None     # what the loaded engine actually runs
    num_running: int = Field(0, ge=0)
    num_waiting: int = Field(0, ge=0)
    raw_budget_used: int = Field(0, ge=0)     # sum of (prompt + max_tokens) of admitted requests
    raw_budget_max: int | None = Field(None, ge=0)   # None: derive from cost_model
    max_concurrency: int = Field(1, ge=0)
    kv_bytes_per_token: int = Field(0, ge=0)
    used_bytes: int = Field(0, ge=0)          # sum of CostModel.charge_bytes of admitted requests
    cost_model: CostModelWire | None = None
    observed_decode_tps: float | None = None
    observed_prefill_tps: float | None = None
    # [batch size, seconds per pure decode step] as the engine measured them (warm-up included):
    # the actor fits the batch slowdown on these rather than on end-to-end request samples.
    decode_step_profile: list[tuple[int, float]] = Field(default_factory=list, max_length=64)
    # Tokens/s of each decode step the replica's warm-up took alone, in this execution identity,
    # before it took traffic (engine/warmup.py): solo samples, counted once per incarnation.
    warmup_solo_tps: list[float] = Field(default_factory=list, max_length=64)
    active: list[ActiveRequest] = Field(default_factory=list, max_length=MAX_ACTIVE_LISTED)
    active_complete: bool = True              # False when `active` was truncated
    # Anomaly inputs (optional): model size for the bandwidth expectation.
    active_params: int | None = Field(None, ge=1)
    bytes_per_param: float | None = Field(None, gt=0)

    @field_validator("state")
    @classmethod
    def _known_state(cls, v: str) -> str:
        return v if v in SLOT_STATES else "unknown"

    def resolved_execution(self) -> str:
        """Actual identity when resident (a native slot that omits it is native); else declared."""
        if self.state in RESIDENT_STATES:
            return parse_execution(self.execution_identity)
        return parse_execution(self.declared_execution)


class HeartbeatReport(_Wire):
    protocol_version: int = PROTOCOL_VERSION
    replica_id: str = Field(min_length=1, max_length=256)
    node_id: str = Field("", max_length=256)  # box; solo samples need the whole box quiet
    chip_class: str | None = None
    incarnation: int = Field(0, ge=0)         # replica start stamp; a larger one is a restart
    seq: int = Field(ge=0)                    # monotonic within an incarnation
    capabilities: list[str] = Field(default_factory=list)
    memory_bandwidth_gbps: float | None = Field(None, gt=0)
    slots: list[SlotReport] = Field(default_factory=list)


class RequestTelemetry(_Wire):
    """Sent with release, after retirement."""
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0)       # of prompt_tokens, found in the prefix cache
    batch_size: int = Field(1, ge=1)          # batch at admission, this request included
    max_batch_size: int | None = Field(None, ge=1)
    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, gt=0)
    execution_identity: str | None = None
    finish_reason: str | None = None


class ActorInfo(_Wire):
    protocol_version: int = PROTOCOL_VERSION
    min_protocol_version: int = MIN_PROTOCOL_VERSION
    capabilities: list[str] = Field(default_factory=lambda: sorted(ACTOR_CAPABILITIES))


def check_version(report: HeartbeatReport) -> None:
    if report.protocol_version < MIN_PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {report.protocol_version} is older than "
                            f"{MIN_PROTOCOL_VERSION}; upgrade the replica")


@dataclass(frozen=True)
class Negotiation:
    kv_format: str            # what the replica may run
    reason: str               # why, for logs and the replica's status


class ActorUnreachable(ProtocolError):
    """No answer from the capacity actor yet: the replica retries rather than guess."""


def negotiate_kv_format(requested: str, actor: ActorInfo | None) -> Negotiation:
    """Replica side: a packed format runs only once the actor confirms per-identity histories.

    Never falls back to native: a replica configured for a packed format that cannot be
    confirmed refuses (ActorUnreachable: try again; ProtocolError: the actor is too old), so it
    cannot serve a different format than its config says for its whole life.
    """
    if requested == "native":
        return Negotiation("native", "native requested")
    if actor is None:
        raise ActorUnreachable(f"KV format {requested!r} not confirmed: capacity actor "
                               "unreachable; cannot confirm it keeps per-format histories")
    if actor.protocol_version < MIN_PROTOCOL_VERSION:
        why = f"actor protocol {actor.protocol_version} < {MIN_PROTOCOL_VERSION}"
    elif CAP_EXECUTION_IDENTITY not in actor.capabilities:
        why = f"actor does not advertise {CAP_EXECUTION_IDENTITY!r}; it would mix packed and native rates"
    else:
        return Negotiation(requested, f"actor advertises {CAP_EXECUTION_IDENTITY!r}")
    raise ProtocolError(f"refusing KV format {requested!r}: {why}")
