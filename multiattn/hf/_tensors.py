"""A checkpoint's tensors, read one at a time (imports no framework).

`Tensors` is the mapping `multiattn.hf.files` hands on: names, shapes and dtypes come
from the files' headers (safetensors) or the pickle's zip records (``pytorch_model.bin``,
opened memory-mapped), so a folder is checked against its config before any tensor's data
is read; a value is read only when it is looked up, and not kept. `Lazy` is the same
idea for weights derived from others (a layout change, a dtype cast, a split), so that
loading walks a model's variables with one tensor in memory at a time.

bfloat16 arrays are `ml_dtypes.bfloat16` (the NumPy dtype jax and safetensors use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FLOAT_DTYPES", "Lazy", "Tensors", "pickle_tensors", "safetensors_tensors"]

#: the floating dtypes a weight may have (safetensors' header name -> NumPy name);
#: others (float8, for one) are refused, naming the tensor
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
#: header names of the integer and boolean dtypes a buffer may have
OTHER_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32",
                "I64": "int64"}  # fmt: skip


class Lazy(Mapping):
    """A read-only mapping whose values ``make(key)`` computes on each lookup (none is
    kept): ``keys`` are known up front, values cost memory only while a caller holds
    them."""

    def __init__(self, keys: Iterable[str], make: Callable[[str], Any]):
        self._keys = tuple(keys)
        self._known = frozenset(self._keys)
        self._make = make

    def __getitem__(self, key: str) -> Any:
        if key not in self._known:
            raise KeyError(key)
        return self._make(key)

    def __contains__(self, key: object) -> bool:
        return key in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class Tensors(Lazy):
    """A checkpoint's tensors by name. ``info[name]`` is ``(shape, dtype)`` from the
    header (``dtype`` a `FLOAT_DTYPES` / `OTHER_DTYPES` value, or the header's own name
    for a dtype multiattn does not read, such as ``F8_E4M3``); looking a name up reads
    that one tensor."""

    def __init__(self, info: dict[str, tuple[tuple, str]], read: Callable[[str], np.ndarray]):
        super().__init__(info, read)
        self.info = info

    def renamed(self, names: dict[str, str]) -> Tensors:
        """The tensors ``names`` maps (new name -> name here), under their new names."""
        info = {new: self.info[old] for new, old in names.items()}
        return Tensors(info, lambda new: self[names[new]])

    def union(self, other: Tensors) -> Tensors:
        """These tensors and ``other``'s (the names are disjoint)."""
        return Tensors({**self.info, **other.info},
                       lambda k: self[k] if k in self.info else other[k])  # fmt: skip


def safetensors_tensors(path: Path) -> Tensors:
    """The tensors of one safetensors file, from its header; each lookup opens the file
    (memory-mapped) and copies out one tensor.

    Raises:
        Exception: safetensors' own error for an unreadable header (the caller names the
            file).
    """
    from safetensors import safe_open

    info = {}
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            part = f.get_slice(name)
            kind = part.get_dtype()
            info[name] = (tuple(part.get_shape()), FLOAT_DTYPES.get(kind) or
                          OTHER_DTYPES.get(kind, kind))  # fmt: skip

    def read(name: str) -> np.ndarray:
        with safe_open(str(path), framework="numpy") as f:
            return f.get_tensor(name)

    return Tensors(info, read)


def pickle_tensors(path: Path) -> Tensors:
    """The tensors of a ``pytorch_model.bin`` (a zip written by ``torch.save``), opened
    memory-mapped with torch's weights-only loader: names, shapes and dtypes are known
    before any tensor's data is read, and the data of a record is never inflated (a
    compressed record, which ``torch.save`` never writes, is an error).

    Raises:
        Exception: torch's error for a file it cannot map (the caller names the file),
            `TypeError` when the file holds no dict of tensors.
    """
    import zipfile

    import torch

    with zipfile.ZipFile(path) as archive:  # not a zip: BadZipFile, named by the caller
        packed = [i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED]
    if packed:  # a mapped record must hold the tensor's bytes as they are
        raise ValueError(f"its record {packed[0]!r} is compressed")
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise TypeError(f"it must hold a dict of named tensors; received {type(state).__name__}")
    info = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}

    def read(name: str) -> np.ndarray:
        value = state[name].detach()
        if value.dtype == torch.bfloat16:  # NumPy has no bfloat16: the bits, as ml_dtypes'
            import ml_dtypes

            return value.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
        return value.numpy().copy()

    return Tensors(info, read)
