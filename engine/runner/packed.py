"""The runner for packed KV formats: the plain runner, refusing up front what it cannot run."""
from __future__ import annotations

from capacity.formats import KVFormatError
from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.runner.paged import ModelRunner


class PackedModelRunner(ModelRunner):
    """ModelRunner that refuses up front a model whose attention bypasses the hook.

    Packed stores already pick their cache class; this only turns a mid-forward error into a
    load-time one.
    """

    # Packed rows cost more per padded token on the CPU (dequantized reads), and more per call.
    cpu_merge_pad_tokens = 32

    def __init__(self, loaded, kvstore, merge_pad_tokens: int | None = None,
                 kernels: KernelChoices = DEFAULT_KERNELS,
                 prefill_width_bucket: int | None = None):
        super().__init__(loaded, kvstore, merge_pad_tokens, kernels, prefill_width_bucket)
        if not self.direct and any(s.packed for s in kvstore.layers.values()):
            raise KVFormatError("packed KV needs every paged layer to attend through the SDPA "
                                "hook; this model's attention does not")
