"""Whole-box memory: the replicas that can land on one node share that node's device memory.

Each engine sizes its KV pool on its own; without this plan two models on one Mac would each
take a fraction of unified memory and together oversubscribe it. At deploy the plan adds, per
node, what every replica that may be placed there needs (weights at their compute dtype, its
KV pool, its step workspace) and refuses a config that cannot fit, with the numbers. A model
without an explicit `kv_budget_bytes` gets its share of what is left, split evenly between the
replicas that may share the node, so the defaults always fit together.

Which replicas share a node: for each model, `max_replicas_per_node` if set, else all its
replicas (a single box, or a fleet where Serve may pack them). The node's memory:
`memory.node_bytes` if set, else the smallest `mac_mem_gb` the Ray cluster's nodes advertise
(cluster.yaml's worker start command), else this machine's device memory, and then no more than
most of what is free on it at deploy (AVAILABLE_FRACTION).

A replica's workspace is the larger of `memory.workspace_bytes_per_replica` (the runtime's
allowance) and its steps' transient priced from the model's geometry
(capacity.pricing.step_workspace_bytes: the gathered K/V copy and FP32 scores of a step of
`max_step_tokens` against the context): a long-context model with many heads needs more than
any flat allowance, and a step allocates it whatever mix of requests runs.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from capacity.pricing import step_workspace_bytes
from serve_app.config import ConfigError, ModelConfig, OrchardConfig

GIB = 1 << 30
# Floating weights are held at the compute dtype (float32 on the CPU backend): 16-bit files
# double in memory there. Integer/quantized tensors stay as stored.
_FLOAT_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


@dataclass(frozen=True)
class ModelNeed:
    model_id: str
    replicas_on_node: int
    weight_bytes: int
    workspace_bytes: int
    kv_bytes: int | None          # explicit per-replica KV budget; None = gets the share


@dataclass(frozen=True)
class MemoryPlan:
    node_bytes: int
    usable_bytes: int
    needs: tuple[ModelNeed, ...]
    kv_share_bytes: int | None    # per replica, for models without an explicit budget

    def kv_budget_for(self, model_id: str) -> int | None:
        need = next(n for n in self.needs if n.model_id == model_id)
        return need.kv_bytes if need.kv_bytes is not None else self.kv_share_bytes

    def table(self) -> str:
        rows = [f"  {n.model_id}: {n.replicas_on_node} replica(s) x (weights "
                f"{n.weight_bytes / GIB:.2f} GiB + workspace {n.workspace_bytes / GIB:.2f} GiB + KV "
                f"{_kv_text(n, self.kv_share_bytes)})" for n in self.needs]
        return "\n".join(rows)


def _kv_text(n: ModelNeed, share: int | None) -> str:
    if n.kv_bytes is not None:
        return f"{n.kv_bytes / GIB:.2f} GiB"
    return "share" if share is None else f"{share / GIB:.2f} GiB share"


def weight_bytes(model_path: str, compute_itemsize: int) -> int:
    """Bytes the weights take in memory, from the safetensors headers (no tensor is read)."""
    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            start, end = t["data_offsets"]
            stored = end - start
            size = _FLOAT_ITEMSIZE.get(t["dtype"])
            total += stored // size * compute_itemsize if size else stored
    return total


# Bytes per value of the integer and packed dtypes a safetensors file may hold (floating ones
# are held at the compute dtype: _FLOAT_ITEMSIZE).
_OTHER_ITEMSIZE = {"U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
                   "U32": 4, "I32": 4, "U64": 8, "I64": 8}


def model_weight_bytes(m: ModelConfig, compute_itemsize: int) -> int:
    """A model's weight bytes whether `path` is a directory or a hub id.

    A hub id is sized from the local hub cache when it is there, else from the safetensors
    headers on the hub (no tensor is downloaded); never as zero, which would hand its weights'
    memory to the KV pools. A path that is neither a directory nor allowed from the hub
    (`engine.allow_hub`) would fail at replica start: it fails here first, naming it."""
    if Path(m.path).expanduser().is_dir():
        return weight_bytes(str(Path(m.path).expanduser()), compute_itemsize)
    if not m.engine.allow_hub:
        raise ConfigError(f"model {m.id!r}: path {m.path!r} is not a local model directory; "
                          "set engine.allow_hub: true to serve it from the Hugging Face hub")
    from huggingface_hub import get_safetensors_metadata, snapshot_download

    try:
        cached = snapshot_download(m.path, local_files_only=True,
                                   allow_patterns=["*.safetensors", "*.json"])
        return weight_bytes(cached, compute_itemsize)
    except Exception:  # noqa: BLE001 - not in the local cache: read the headers on the hub
        pass
    try:
        meta = get_safetensors_metadata(m.path)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, no safetensors: say so
        raise ConfigError(f"model {m.id!r}: cannot size the weights of hub model {m.path!r} "
                          f"for the memory plan ({type(e).__name__}: {e}); download it first "
                          "(huggingface-cli download) or give a local directory") from None
    total = 0
    for dtype, count in meta.parameter_count.items():
        size = compute_itemsize if dtype in _FLOAT_ITEMSIZE else _OTHER_ITEMSIZE.get(dtype)
        if size is None:
            raise ConfigError(f"model {m.id!r}: hub model {m.path!r} stores {dtype} tensors, "
                              "which the memory plan cannot size")
        total += count * size
    return total


def _model_config(m: ModelConfig) -> dict:
    """The model's config.json (a local directory, else the hub cache, else the hub)."""
    path = Path(m.path).expanduser()
    if path.is_dir():
        return json.loads((path / "config.json").read_text())
    from huggingface_hub import hf_hub_download

    try:
        try:
            found = hf_hub_download(m.path, "config.json", local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached: ask the hub
            found = hf_hub_download(m.path, "config.json")
        return json.loads(Path(found).read_text())
    except Exception as e:  # noqa: BLE001 - offline, unknown repo: say so
        raise ConfigError(f"model {m.id!r}: cannot read the geometry of hub model {m.path!r} "
                          f"for the memory plan ({type(e).__name__}: {e}); download it first "
                          "or give a local directory") from None


def model_step_workspace_bytes(m: ModelConfig, itemsize: int) -> int:
    """One replica's step transient from the model's geometry and its engine's step bounds
    (token limit as the engine sets it: max_model_len, else the model's context, else 8192)."""
    raw = _model_config(m)
    c = {**raw, **raw.get("text_config", {})}    # multimodal configs nest the language model
    q_heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or q_heads)
    head_dim = int(c.get("head_dim") or c["hidden_size"] // q_heads)
    token_limit = m.engine.max_model_len or int(c.get("max_position_embeddings") or 8192)
    kv_itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(m.engine.dtype or "", itemsize)
    return step_workspace_bytes(query_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                token_limit=token_limit,
                                max_step_tokens=m.engine.max_step_tokens,
                                max_num_seqs=m.max_num_seqs, kv_itemsize=kv_itemsize)


def compute_itemsize() -> int:
    """4 on the CPU backend (float32 compute), 2 on Metal/CUDA (bfloat16)."""
    import mlx.core as mx

    return 4 if mx.default_device() == mx.cpu else 2


# On this machine, what the plan may use is also bounded by what is free at deploy: a shared
# box (other programs, a previous deployment still draining) has less than its total share,
# and replicas allocate their KV pools up front. Seen: a default pool of 0.75 of a 24 GB box
# beside 8 GB of other work, and the kernel's OOM killer took the replica (Ray gives its
# workers the highest oom_score_adj). A tenth of what is free stays free for others to grow.
AVAILABLE_FRACTION = 0.9


def node_memory_bytes(cfg: OrchardConfig) -> tuple[int, bool]:
    """(the node's memory, whether it is this machine's)."""
    if cfg.memory.node_bytes:
        return cfg.memory.node_bytes, False
    advertised = _cluster_mac_memory_bytes()
    if advertised:
        return advertised, False
    from engine.kv.budget import device_memory_bytes

    return device_memory_bytes(), True


def available_memory_bytes() -> int:
    """Memory free for new allocations now (no bound where it cannot be measured)."""
    from engine.kv.budget import available_memory_bytes as measured, device_memory_bytes

    return measured() or device_memory_bytes()


def _cluster_mac_memory_bytes() -> int | None:
    """The smallest `mac_mem_gb` the connected Ray cluster's live nodes advertise."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        gbs = [n["Resources"]["mac_mem_gb"] for n in ray.nodes()
               if n.get("Alive") and "mac_mem_gb" in n.get("Resources", {})]
    except Exception:  # noqa: BLE001 - no cluster view: fall back to this machine
        return None
    return int(min(gbs) * GIB) if gbs else None


def plan_memory(cfg: OrchardConfig, node_bytes: int | None = None,
                itemsize: int | None = None, available_bytes: int | None = None) -> MemoryPlan:
    """The per-node plan, or ConfigError naming the numbers when the models cannot fit.
    `available_bytes`: what is free now, when the node is this machine (measured if None)."""
    if node_bytes is not None:
        node, local = node_bytes, available_bytes is not None
    else:
        node, local = node_memory_bytes(cfg)
    size = itemsize if itemsize is not None else compute_itemsize()
    usable = int(node * cfg.memory.budget_fraction)
    limit = ""
    if local:
        free = available_bytes if available_bytes is not None else available_memory_bytes()
        if int(free * AVAILABLE_FRACTION) < usable:
            usable = int(free * AVAILABLE_FRACTION)
            limit = f", bounded by {AVAILABLE_FRACTION:g} of the {free / GIB:.2f} GiB free now"
    needs = []
    for m in cfg.models:
        per_node = min(m.replicas, m.max_replicas_per_node or m.replicas)
        weights = model_weight_bytes(m, size)
        workspace = max(cfg.memory.workspace_bytes_per_replica,
                        model_step_workspace_bytes(m, size))
        needs.append(ModelNeed(m.id, per_node, weights, workspace, m.kv_budget_bytes))
    fixed = sum(n.replicas_on_node * (n.weight_bytes + n.workspace_bytes + (n.kv_bytes or 0))
                for n in needs)
    sharing = sum(n.replicas_on_node for n in needs if n.kv_bytes is None)
    left = usable - fixed
    share = left // sharing if sharing else None
    plan = MemoryPlan(node, usable, tuple(needs), share)
    if left < 0 or (share is not None and share < cfg.memory.min_kv_bytes_per_replica):
        short = (f"needs {fixed / GIB:.2f} GiB before any default KV pool" if left < 0 else
                 f"leaves {share / GIB:.3f} GiB of KV per replica without an explicit budget "
                 f"(minimum {cfg.memory.min_kv_bytes_per_replica / GIB:.3f} GiB)")
        raise ConfigError(
            f"models do not fit together on one node: {usable / GIB:.2f} GiB usable "
            f"({cfg.memory.budget_fraction:g} of {node / GIB:.2f} GiB{limit}) and the config "
            f"{short}:\n"
            f"{plan.table()}\nLower replicas or kv_budget_bytes, set max_replicas_per_node to "
            "spread replicas, or raise memory.budget_fraction / memory.node_bytes.")
    return plan


def with_kv_budgets(cfg: OrchardConfig, plan: MemoryPlan) -> list[ModelConfig]:
    """The models' configs for the deployments, each with its planned per-replica KV budget."""
    return [m.model_copy(update={"kv_budget_bytes": plan.kv_budget_for(m.id)})
            for m in cfg.models]
