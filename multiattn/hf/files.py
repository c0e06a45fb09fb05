"""Hugging Face model folders on disk: reading, checking and writing (imports no framework).

`read_folder` reads ``config.json`` and the weights (``model.safetensors``, a sharded
``model.safetensors.index.json``, or a ``pytorch_model.bin`` pickle only with
``trust_pickle=True``), picks the `multiattn.hf.families.Family` from
``model_type``, refuses config options it does not implement, and checks every tensor's
name and shape against the config; it returns neutral NumPy weights. `write_folder` writes
``config.json`` and ``model.safetensors`` into a temporary sibling folder and renames it
into place, so an error leaves nothing half written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from ._tensors import FLOAT_DTYPES, Lazy, Tensors, pickle_tensors, safetensors_tensors
from .bert_weights import _inside, _read_json
from .families import Family, family_of, to_hf

__all__ = ["Loaded", "check_state", "read_folder", "read_state", "write_folder"]

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
#: JSON files of a folder that carry over unchanged from `read_folder` to `write_folder`
#: (``save_pretrained``, ``multiattn port``): decoding defaults transformers' ``generate``
#: reads.
SIDE_FILES = ("generation_config.json",)


@dataclass
class Loaded:
    """What `read_folder` found: the family, the raw config, its sizes, the neutral
    weights (a `Lazy` mapping of ``float`` arrays in the checkpoint's dtypes, each read
    from the file when looked up), the task-head tensors left out, the `SIDE_FILES`
    present (file name -> JSON object) and each tensor's dtype (name -> dtype name, from
    the headers; see `checkpoint_dtype`)."""

    family: Family
    config: dict
    sizes: dict
    weights: Mapping
    ignored: list
    side_files: dict
    dtypes: dict = field(default_factory=dict)


def _regular(path: Path, where: str) -> Path:
    """``path`` if it is a regular file: a FIFO, a device or a socket named as a weights
    file would block the read forever or stream without end."""
    if not path.is_file():
        raise ValueError(f"{where}: {path.name} must be a regular file; it is not.")
    return path


def _safetensors(path: Path, where: str) -> Tensors:
    _regular(path, where)
    try:
        return safetensors_tensors(path)
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(
            f"{where}: cannot read {path.name} ({type(err).__name__}: {err}); the file is "
            "truncated, corrupted or not a safetensors file."
        ) from None


def _sharded(folder: Path, where: str) -> Tensors:
    index = _read_json(_inside(folder, INDEX, where), where, dict)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{where}: {INDEX} must hold a non-empty object `weight_map`.")
    state = None
    for shard in sorted(set(map(str, weight_map.values()))):
        part = _safetensors(_inside(folder, shard, where), where)
        for name in part:
            if weight_map.get(name) != shard:
                raise ValueError(
                    f"{where}: tensor {name!r} is in {shard} but {INDEX} places it in "
                    f"{weight_map.get(name)!r}."
                )
        state = part if state is None else state.union(part)
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{where}: {INDEX} lists tensor {missing[0]!r}, found in no shard.")
    return state


def _pickle(path: Path, where: str, trust_pickle: bool) -> Tensors:
    if not trust_pickle:
        raise ValueError(
            f"{where}: the only weights are {PICKLE}, a Python pickle; reading a pickle can "
            "run arbitrary code. Pass trust_pickle=True only for a file you trust, or convert "
            "it to model.safetensors."
        )
    _regular(path, where)
    try:  # even when trusted, only tensors are unpickled, memory-mapped
        return pickle_tensors(path)
    except Exception as err:
        raise ValueError(
            f"{where}: cannot read {PICKLE} ({type(err).__name__}: {err}); it must be an "
            "uncompressed zip of tensors as torch.save writes it."
        ) from None


def read_state(folder: Path, trust_pickle: bool = False) -> Tensors:
    """The tensors of ``folder`` by name (`Tensors`: from the headers; each read on
    lookup), from the first of ``model.safetensors``, ``model.safetensors.index.json``,
    ``pytorch_model.bin`` that exists."""
    where = f"from_pretrained({str(folder)!r})"
    if _inside(folder, SAFETENSORS, where).is_file():
        return _safetensors(_inside(folder, SAFETENSORS, where), where)
    if _inside(folder, INDEX, where).is_file():
        return _sharded(folder, where)
    if _inside(folder, PICKLE, where).is_file():
        return _pickle(_inside(folder, PICKLE, where), where, trust_pickle)
    raise ValueError(
        f"{where}: no weights: the folder holds none of {SAFETENSORS}, {INDEX}, {PICKLE}."
    )


def as_tensors(state: Mapping) -> Tensors:
    """``state`` as `Tensors` (a plain dict of arrays: shapes and dtypes from the arrays)."""
    if isinstance(state, Tensors):
        return state
    info = {k: (tuple(np.shape(v)), str(np.asarray(v).dtype)) for k, v in state.items()}
    return Tensors(info, state.__getitem__)


def _base_state(family: Family, sizes: dict, state: Tensors) -> tuple[Tensors, list]:
    """The base model's tensors (a task-head checkpoint's ``<prefix>.`` removed) and the
    names left out (the task head's tensors). A checkpoint of one of `Family.heads` (a
    masked-LM head: ``sizes["masked_lm"]``) keeps its names, the head's included; what lies
    outside the base model and that head (BERT's next-sentence classifier) is left out."""
    prefix = family.prefix + "."
    if family.head_of(sizes):
        head = {e.hf for e in family.entries(sizes, pooler=True)} | set(family.buffers(sizes))
        ignored = sorted(k for k in state if k not in head and not k.startswith(prefix))
        return state.renamed({k: k for k in state if k not in ignored}), ignored
    if (
        family.prefix
        and not any(k.startswith("embeddings.") for k in state)
        and any(k.startswith(prefix) for k in state)
    ):
        base = state.renamed({k[len(prefix) :]: k for k in state if k.startswith(prefix)})
        return base, sorted(k for k in state if not k.startswith(prefix))
    return state, []


def _completed(family: Family, sizes: dict, state: Tensors) -> Tensors:
    """``state`` under the entries' names: a base-model checkpoint's tensors with
    `Family.base_prefix` added, and the `Family.zeros` tensors it lacks as zeros (in the
    dtype of its tensors, float32 if they mix dtypes)."""
    prefix = family.base_prefix
    if prefix and state.info and not any(k.startswith(prefix) for k in state.info):
        state = state.renamed({prefix + k: k for k in state.info})
    missing = {k: tuple(v) for k, v in family.zeros(sizes).items() if k not in state.info}
    if not missing:
        return state
    found = {d for _, d in state.info.values() if d in FLOAT_DTYPES.values()}
    dtype = found.pop() if len(found) == 1 else "float32"
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    zeros = Tensors({k: (shape, dtype) for k, shape in missing.items()},
                    lambda k: np.zeros(missing[k], target))  # fmt: skip
    return state.union(zeros)


def _check_finite(name: str, value: np.ndarray, where: str) -> None:
    """A weight with a NaN or an infinity makes every output NaN (one in a query
    projection reaches all logits): refused, naming the tensor and the first such entry."""
    bad = ~np.isfinite(value)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{where}: tensor {name!r} holds {int(bad.sum())} non-finite value(s) (NaN or "
            f"infinity), the first {value[first]!r} at index {first}."
        )


def _neutral(entries: list, state: Tensors, where: str) -> Lazy:
    """The neutral weights of ``state``, each read, checked finite and brought to the
    neutral layout when looked up (`multiattn.hf.families.from_hf`, one at a time)."""
    by_name = {e.name: e for e in entries}

    def make(name: str) -> np.ndarray:
        entry = by_name[name]
        value = state[entry.hf]
        _check_finite(entry.hf, value, where)
        return entry.to_neutral(value)

    return Lazy(by_name, make)


#: the config keys that give a family's number of blocks
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers")


def check_state(family: Family, sizes: dict, state: Mapping, where: str) -> tuple[Lazy, list]:
    """Checks names, shapes and dtypes (from the headers: no tensor is read); returns
    ``(neutral weights, ignored head tensors)``. The neutral weights are a `Lazy`
    mapping: each is read when looked up, and a NaN or an infinity in it is refused then.

    Raises:
        ValueError: a tensor is missing, unexpected, of the wrong shape for this config,
            or of a dtype multiattn does not load (a weight must be float16, bfloat16,
            float32 or float64); later, on lookup, a weight holding a NaN or an infinity
            (the tensor is named).
    """
    state, ignored = _base_state(family, sizes, as_tensors(state))
    state = _completed(family, sizes, state)
    layers = sum(v for k, v in sizes.items() if k.startswith("num_") and k.endswith("layers"))
    if layers > len(state):  # each block has tensors: checked before listing them
        keys = [k for k in family.keys if k in _LAYER_KEYS]
        raise ValueError(
            f"{where}: the config gives {layers} blocks (`{'`, `'.join(keys)}`) but the "
            f"weights hold only {len(state)} tensors."
        )
    poolers = [e.hf for e in family.entries(sizes, pooler=True) if e.name.startswith("pooler/")]
    has_pooler = any(name in state for name in poolers)
    entries = family.entries(sizes, pooler=has_pooler)
    buffers = family.buffers(sizes)
    expected = {e.hf: e.shape for e in entries} | buffers
    for name in sorted(expected):
        if name not in state and name not in buffers:
            raise ValueError(f"{where}: the checkpoint has no tensor {name!r}.")
    for name, (shape, dtype) in state.info.items():
        if name not in expected:
            raise ValueError(
                f"{where}: unexpected tensor {name!r} for a {family.model_type} model with "
                "this config."
            )
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(
                f"{where}: tensor {name!r} must have shape {tuple(expected[name])} for this "
                f"config; received {tuple(shape)}."
            )
        if name not in buffers and dtype not in FLOAT_DTYPES.values():
            raise ValueError(
                f"{where}: tensor {name!r} has dtype {dtype}; multiattn loads weights of "
                f"{', '.join(FLOAT_DTYPES.values())} (convert the checkpoint first)."
            )
    if ignored:
        warnings.warn(
            f"{where}: left out {len(ignored)} task-head tensor(s) outside the base model "
            f"({', '.join(ignored[:5])}{', ...' if len(ignored) > 5 else ''}).",
            stacklevel=3,
        )
    return _neutral(entries, state, where), ignored


#: ``(from, to)`` dtype pairs a cast keeps every value of
_LOSSLESS = {("float16", "float32"), ("float16", "float64"), ("bfloat16", "float32"),
             ("bfloat16", "float64"), ("float32", "float64")}  # fmt: skip


def checkpoint_dtype(config: dict, dtypes: dict[str, str], where: str) -> str:
    """The dtype a folder declares: ``config.json``'s ``dtype`` (transformers 5) or
    ``torch_dtype`` (4), else the weights' one dtype (float32 when they mix dtypes);
    ``dtypes`` maps each tensor to its dtype (`Loaded.dtypes`).

    Raises:
        ValueError: the declared dtype is not one of `FLOAT_DTYPES`, or a weight's dtype
            is wider than it (loading in the declared dtype would lose information:
            the tensor is named).
    """
    weights = {name: dtype for name, dtype in dtypes.items() if dtype in FLOAT_DTYPES.values()}
    key = "dtype" if config.get("dtype") is not None else "torch_dtype"
    declared = config.get(key)
    if declared is None:
        found = set(weights.values())
        return found.pop() if len(found) == 1 else "float32"
    if declared not in FLOAT_DTYPES.values():
        raise ValueError(
            f"{where}: config.json's `{key}` must be one of "
            f"{', '.join(FLOAT_DTYPES.values())}; received {declared!r}."
        )
    for name, dtype in weights.items():
        if dtype != declared and (dtype, declared) not in _LOSSLESS:
            raise ValueError(
                f"{where}: tensor {name!r} is {dtype} but config.json's `{key}` is "
                f"{declared}: loading it in {declared} would lose information. Pass "
                f"dtype={dtype!r} to keep it, or dtype={declared!r} to convert it."
            )
    return declared


def read_folder(path: str | Path, trust_pickle: bool = False) -> Loaded:
    """Read and check a Hugging Face model folder (see the module docstring)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: `path` must be a folder path; received {path!r}.")
    folder = Path(path)
    where = f"from_pretrained({str(folder)!r})"
    if not folder.is_dir():
        raise ValueError(f"{where}: `path` must be an existing folder; received {str(path)!r}.")
    config_path = _inside(folder, "config.json", where)
    if not config_path.is_file():
        raise ValueError(f"{where}: the folder has no config.json.")
    config = _read_json(config_path, where, dict)
    family = family_of(config, where)
    sizes = family.check_config(config, where)
    state = read_state(folder, trust_pickle)
    weights, ignored = check_state(family, sizes, state, where)
    dtypes = {name: dtype for name, (_, dtype) in state.info.items()}
    side_files = read_side_files(folder, where)
    sizes = family.read_generation(sizes, side_files, where)
    return Loaded(family, config, sizes, weights, ignored, side_files, dtypes)


def read_side_files(folder: Path, where: str) -> dict[str, dict]:
    """The `SIDE_FILES` of ``folder`` that exist (each a JSON object, else `ValueError`)."""
    out = {}
    for name in SIDE_FILES:
        path = _inside(folder, name, where)
        if path.exists():
            out[name] = _read_json(_regular(path, where), where, dict)
    return out


def write_folder(
    path: str | Path,
    family: Family,
    sizes: dict,
    config: dict,
    weights: dict[str, np.ndarray],
    overwrite: bool = False,
    side_files: dict[str, dict] | None = None,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` (HF names) and the `SIDE_FILES` in
    ``side_files`` (name -> JSON object) atomically.

    The files are written into a temporary folder next to ``path`` (``.NAME.tmp-PID-*``),
    which is then renamed to ``path``. ``path`` must not exist, be an empty folder, or
    (``overwrite=True``) be a folder, which is replaced only once the new one is complete
    (moved aside to ``.NAME.old-PID``, then removed). A symbolic link to a folder is
    followed: the folder it names is replaced. Leftovers of saves whose process died
    (killed mid-write) are removed by the next save to the same path.

    Raises:
        TypeError: ``path`` not a path, ``overwrite`` not a bool.
        ValueError: ``path`` exists and is not empty (without ``overwrite``; also when
            another process saved there meanwhile), is a file, or cannot be written (the
            operating system's reason given).
    """
    from safetensors.numpy import save_file

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_pretrained: `path` must be a folder path; received {path!r}.")
    if not isinstance(overwrite, bool):
        raise TypeError(f"save_pretrained: `overwrite` must be a bool; received {overwrite!r}.")
    target = Path(path)
    target = target.resolve() if target.is_symlink() else target
    if target.exists() and not target.is_dir():
        raise ValueError(f"save_pretrained: `path` is a file; received {str(path)!r}.")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(
            f"save_pretrained: {str(path)!r} is a non-empty folder; pass overwrite=True to "
            "replace it."
        )
    entries = family.entries(sizes, pooler="pooler/kernel" in weights)
    tensors = to_hf(entries, weights)
    config = {**config, "architectures": [family.architecture_of(sizes)]}
    dtypes = {str(t.dtype) for t in tensors.values()}
    config["dtype"] = dtypes.pop() if len(dtypes) == 1 else config.get("dtype", "float32")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-",
                                    dir=target.parent))  # fmt: skip
    except OSError as err:
        raise ValueError(
            f"save_pretrained: cannot write {str(path)!r}: {err.strerror or err}."
        ) from err
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / SAFETENSORS), metadata={"format": "pt"})
        for name, value in (side_files or {}).items():
            if name not in SIDE_FILES:
                raise ValueError(f"save_pretrained: {name!r} is not one of {SIDE_FILES}.")
            (tmp / name).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
        _replace(tmp, target, overwrite, str(path))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the temporary folders (``.NAME.tmp-PID-*``, ``.NAME.old-PID``) that saves
    to ``target`` left when their process died mid-write; returns the removed paths.
    Those of running processes (saving now) are kept."""
    removed = []
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(?:tmp-(\d+)-.+|old-(\d+))$")
    for entry in target.parent.iterdir() if target.parent.is_dir() else ():
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink():
            if not _alive(int(match.group(1) or match.group(2))):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def _replace(tmp: Path, target: Path, overwrite: bool, given: str) -> None:
    """Rename the finished ``tmp`` to ``target``. An old ``target`` is moved aside first
    and removed afterwards only with ``overwrite``; without it the rename refuses a
    folder that another save filled meanwhile (POSIX renames onto empty folders only)."""
    old = None
    if overwrite and target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
    try:
        tmp.rename(target)
    except OSError as err:
        if old is not None:
            old.rename(target)
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise ValueError(
                f"save_pretrained: {given!r} was filled by another save while this one "
                f"wrote; pass overwrite=True to replace it."
            ) from err
        raise ValueError(
            f"save_pretrained: cannot write {given!r}: {err.strerror or err}."
        ) from err
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
