"""Bridges between torch tensors and the numpy delta codec: bit views, checksums, in-place apply.

A tensor's bits are viewed, without copying, as a flat unsigned numpy array (bf16 → uint16);
the codec works on those views. A CUDA tensor is changed on its device: the few old values at
the changed positions come to the host, the new ones go back and are scattered there.
``SafetensorsFile`` exposes the tensors of a ``.safetensors`` file on disk as writable
memory-mapped tensors, so the same in-place apply updates a file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, MutableMapping
from pathlib import Path

import numpy as np
import torch

from astraflow.errors import ValidationError
from astraflow.weights import delta as codec
from astraflow.weights.manifest import tensor_checksum

__all__ = [
    "SafetensorsFile",
    "apply_delta",
    "bits",
    "checksum",
    "dtype_name",
    "scatter_delta",
    "torch_dtype",
]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``'bfloat16'``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """``'bfloat16'`` → ``torch.bfloat16``; ``ValidationError`` for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValidationError(f"unknown tensor dtype {name!r}", field="dtype")
    return dtype


def _int_kind(t: torch.Tensor) -> torch.dtype:
    """The integer dtype of ``t``'s bits; ``ValidationError`` unless it can be changed in place."""
    if not t.is_contiguous():
        raise ValidationError("weights must be contiguous tensors to be updated in place")
    try:
        return _INT_VIEW[t.element_size()]
    except KeyError:
        raise ValidationError(f"unsupported element size {t.element_size()} ({t.dtype})") from None


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(_int_kind(t))


def bits(t: torch.Tensor) -> codec.UIntArray:
    """The flat unsigned-integer numpy view of a CPU tensor's bits (shares its memory).

    One torch call (the integer view; numpy does the rest): every torch call lets go of the
    GIL, and a pull's worker threads waited up to a switch interval to get it back after each.
    """
    if t.device.type != "cpu":
        raise ValidationError(f"bits() needs a CPU tensor, got one on {t.device}")
    kind = _int_kind(t)
    view = (t.detach() if t.requires_grad else t).view(kind).numpy().reshape(-1)
    return view.view(codec.uint_dtype(t.element_size()))


def checksum(t: torch.Tensor) -> str:
    """xxh3-64 of the tensor's bytes (copied to the host first when it lives elsewhere)."""
    host = t.detach() if t.device.type == "cpu" else t.detach().to("cpu")
    return tensor_checksum(bits(host.contiguous()).data)


def apply_delta(t: torch.Tensor, delta: codec.TensorDelta) -> None:
    """Apply ``delta`` to ``t`` in place (CPU via a numpy view; other devices by scatter)."""
    if delta.kind == "same":
        return
    if t.device.type == "cpu":
        codec.apply(bits(t), delta)
    else:
        scatter_delta(t, delta)


def scatter_delta(t: torch.Tensor, delta: codec.TensorDelta) -> None:
    """Apply ``delta`` with torch gather/scatter on ``t``'s device (how device tensors change)."""
    if delta.kind == "same":
        return
    flat = _int_view(t)
    if flat.numel() != delta.numel:
        raise ValidationError(f"delta for {delta.numel} elements, tensor has {flat.numel()}")
    assert delta.values is not None
    # numpy dtype matching the torch integer view (_INT_VIEW): uint8 for bytes, else signed
    signed = "u1" if delta.itemsize == 1 else codec.uint_dtype(delta.itemsize).str.replace("u", "i")
    if delta.kind == "sparse":
        assert delta.pos is not None
        index = torch.from_numpy(delta.pos).to(t.device)
        old = flat.index_select(0, index).cpu().numpy().view(delta.values.dtype)
        new = torch.from_numpy((old + delta.values).view(signed))
        flat.index_copy_(0, index, new.to(t.device))
        return
    host = flat.cpu().numpy().view(delta.values.dtype)
    codec.apply(host, delta)
    flat.copy_(torch.from_numpy(host.view(signed)).to(t.device))


class SafetensorsFile(MutableMapping[str, torch.Tensor]):
    """The tensors of a safetensors file as writable memory-mapped CPU tensors.

    Writing into a tensor writes the file; :meth:`flush` (or ``close``) makes it durable.
    Keys cannot be added or removed: the file layout is fixed.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r+")
        start = 8 + header_len
        self._tensors: dict[str, torch.Tensor] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValidationError(f"{self.path}: tensor {name!r} has dtype {info['dtype']}")
            lo, hi = info["data_offsets"]
            raw = torch.from_numpy(self._map[start + lo : start + hi])
            self._tensors[name] = raw.view(dtype).reshape(info["shape"])

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._tensors[name].copy_(value)

    def __delitem__(self, name: str) -> None:
        raise ValidationError("tensors cannot be removed from a safetensors file in place")

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def flush(self) -> None:
        """Write the changes to disk."""
        self._map.flush()

    def close(self) -> None:
        """Flush and drop the mapping."""
        self.flush()
        self._tensors.clear()
