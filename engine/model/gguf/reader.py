"""Read a GGUF file: its metadata and its tensors, as MLX arrays.

Types MLX reads natively (F32, F16, BF16, Q8_0, Q4_0, Q4_1) come through `mx.load`, which returns
the three quantized ones as MLX affine-quantized triples (packed weight, scales, biases; groups
of 32). Any other type (K-quants, IQ, ...) is dequantized to float32 with the `gguf` package's
reader and dequantizer. Metadata always comes from the `gguf` package's reader (memory-mapped,
so a multi-GB file costs no copy to inspect).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import numpy as np

MX_NATIVE = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}
GGUF_GROUP = 32   # the block size of every type mx.load hands back quantized


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported (unsupported architecture, tensor or tokenizer)."""


@dataclass
class Tensor:
    """One weight: a float array, or an MLX affine-quantized triple with its bits and group."""

    value: mx.array | None = None
    weight: mx.array | None = None
    scales: mx.array | None = None
    biases: mx.array | None = None
    bits: int = 0
    group_size: int = 0
    source_type: str = "F32"

    @property
    def quantized(self) -> bool:
        return self.weight is not None

    def dequantized(self) -> mx.array:
        if not self.quantized:
            return self.value
        # In float32: dequantizing with the stored float16 scales would round the result to
        # float16 too (the output takes the scales' dtype).
        return mx.dequantize(self.weight, self.scales.astype(mx.float32),
                             self.biases.astype(mx.float32), group_size=self.group_size,
                             bits=self.bits)

    def map_rows(self, fn) -> "Tensor":
        """Apply a row (axis 0) transform to every part: rows are quantized independently."""
        if not self.quantized:
            return Tensor(value=fn(self.value), source_type=self.source_type)
        return Tensor(weight=fn(self.weight), scales=fn(self.scales), biases=fn(self.biases),
                      bits=self.bits, group_size=self.group_size, source_type=self.source_type)


class GGUFFile:
    """Metadata and tensor listing of one GGUF file; `tensors()` yields (name, Tensor)."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFImportError(f"{self.path}: no such file")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:
            raise GGUFImportError(f"{self.path}: not a readable GGUF file: {exc}") from exc
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:  # a value type this reader version cannot decode; not needed
                continue
        self.tensor_types = {t.name: t.tensor_type.name for t in self._reader.tensors}
        # numpy order (rows first): GGUF lists dimensions fastest-first.
        self.tensor_shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist()))
                              for t in self._reader.tensors}

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    @property
    def mx_native(self) -> bool:
        return all(t in MX_NATIVE for t in self.tensor_types.values())

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor by its GGUF name, in file order."""
        if self.mx_native:
            yield from self._mx_tensors()
        else:
            yield from self._gguf_tensors()

    def _mx_tensors(self) -> Iterator[tuple[str, Tensor]]:
        arrays = mx.load(str(self.path))
        for name, qtype in self.tensor_types.items():
            if qtype in ("F32", "F16", "BF16"):
                yield name, Tensor(value=arrays.pop(name), source_type=qtype)
                continue
            base = name.removesuffix(".weight")
            w, s, b = arrays.pop(name, None), arrays.pop(base + ".scales", None), \
                arrays.pop(base + ".biases", None)
            if w is None or s is None or b is None:
                raise GGUFImportError(f"{self.path}: tensor {name} ({qtype}) missing from "
                                      "MLX's GGUF reader output")
            bits = w.shape[-1] * 32 // (s.shape[-1] * GGUF_GROUP)
            yield name, Tensor(weight=w, scales=s, biases=b, bits=bits, group_size=GGUF_GROUP,
                               source_type=qtype)

    def _gguf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        from gguf.quants import dequantize

        for t in self._reader.tensors:
            qtype = t.tensor_type.name
            if qtype in ("F32", "F16"):
                data = np.asarray(t.data)
            else:
                try:
                    data = dequantize(t.data, t.tensor_type)
                except NotImplementedError:
                    raise GGUFImportError(
                        f"{self.path}: tensor {t.name} has type {qtype}, which the gguf "
                        "package cannot dequantize") from None
            arr = mx.array(np.ascontiguousarray(data).reshape(self.tensor_shapes[t.name]))
            yield t.name, Tensor(value=arr, source_type=qtype)
