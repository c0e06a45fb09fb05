"""Whole model folders in `multiattn port`: ``--from hf`` and ``--to hf``.

A Hugging Face model folder (``config.json`` and its safetensors, sharded, or with
``--trust-pickle`` a ``pytorch_model.bin``) of a family `multiattn.models.from_pretrained`
supports converts, with no framework imported:

* to one neutral safetensors file (``--to safetensors``): the model's tensors under
  multiattn's neutral names (``layer_0/attention/query/kernel`` ...), with the config in
  the metadata (``multiattn.kind = "model"``, ``multiattn.config``), so the file alone
  rebuilds the folder;
* back from such a file to a folder (``--from safetensors --to hf``), tensors bit for bit;
* from folder to folder (``--from hf --to hf``): one ``model.safetensors`` whatever the
  source held (shards, a pickle).

Every tensor is checked against the family's table (name and shape) in both directions;
nothing is written on error.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np

from .checkpoint import (
    DEFAULT_MAX_BYTES,
    META_CONFIG,
    META_KIND,
    Interrupted,
    PortError,
    _check_parent,
    _check_total,
    _signals_interrupt,
    check_specs,
    metadata_object,
    open_tensors,
    write_tensors,
)

__all__ = ["MODEL_KIND", "convert_model"]

MODEL_KIND = "model"
META_SIDE_FILES = "multiattn.side_files"


@cache
def _neutral_shape(entry) -> tuple[int, ...]:
    """The shape `Entry.to_neutral` gives a tensor of ``entry``'s Hugging Face shape (the
    blocks of a model repeat, so few entries are computed)."""
    return tuple(entry.to_neutral(np.empty(entry.shape, np.uint8)).shape)


def _read_file(src: Path, max_bytes: int) -> tuple:
    """A neutral model file: its tensors' names and shapes are checked against the family's
    table, and their total against ``max_bytes``, before any tensor data is read."""
    from ..hf.families import family_of

    with open_tensors(src, "safetensors", max_bytes=max_bytes) as source:
        meta = source.metadata
        if meta.get(META_KIND) != MODEL_KIND:
            raise PortError(
                f"{src}: --to hf needs a model file written by `multiattn port --from hf` "
                f"(metadata {META_KIND} = 'model'); this one holds "
                f"{meta.get(META_KIND, f'no {META_KIND}')!r}."
            )
        try:
            config = metadata_object(meta, META_CONFIG)
            side_files = metadata_object(meta, META_SIDE_FILES) if META_SIDE_FILES in meta else {}
        except PortError as err:
            raise PortError(f"{src}: {err}") from None
        for name, value in side_files.items():
            if not isinstance(value, dict):
                raise PortError(
                    f"{src}: the file's metadata {META_SIDE_FILES!r} must map file names to "
                    f"JSON objects; {name!r} holds {type(value).__name__}."
                )
        where = f"multiattn port {src}"
        try:
            family = family_of(config, where)
            sizes = family.check_config(config, where)
        except (ValueError, TypeError) as err:
            raise PortError(str(err)) from None
        entries = family.entries(sizes, pooler="pooler/kernel" in source.specs)
        expected = {e.name: _neutral_shape(e) for e in entries}
        check_specs(expected, source.specs, f"{src} ({family.model_type} model)")
        _check_total(source.specs, max_bytes, str(src))
        weights = source.load(list(expected))
    return family, config, sizes, weights, side_files, entries


def _read(src: Path, fmt: str, trust_pickle: bool, max_bytes: int) -> tuple:
    """``(family, config, sizes, neutral weights, side files)`` of a folder or a neutral
    model file (the side files, such as ``generation_config.json``, ride in the file's
    metadata)."""
    from ..hf.families import to_hf
    from ..hf.files import check_state, read_folder

    try:
        if fmt == "hf":
            loaded = read_folder(src, trust_pickle=trust_pickle)
            return loaded.family, loaded.config, loaded.sizes, loaded.weights, loaded.side_files
        family, config, sizes, weights, side_files, entries = _read_file(src, max_bytes)
        # dtypes and values (non-finite entries) through the check from_pretrained applies
        weights, _ = check_state(family, sizes, to_hf(entries, weights), f"multiattn port {src}")
    except PortError:
        raise
    except (ValueError, TypeError) as err:
        raise PortError(str(err)) from None
    return family, config, sizes, weights, side_files


def _metadata(config: dict, side_files: dict) -> dict[str, str]:
    return {META_KIND: MODEL_KIND, META_CONFIG: json.dumps(config, sort_keys=True),
            "multiattn.model_type": str(config.get("model_type")),
            META_SIDE_FILES: json.dumps(side_files, sort_keys=True)}  # fmt: skip


def _write_folder(dst: Path, family, sizes, config, weights, force, side_files) -> list[Path]:
    """`multiattn.hf.files.write_folder`, with SIGTERM, SIGINT and SIGHUP during the write
    raising `Interrupted` (the temporary folder is removed); returns the leftovers of
    killed runs removed first."""
    from ..hf.files import remove_leftovers, write_folder

    _check_parent(dst)
    with _signals_interrupt() as state:
        try:
            removed = remove_leftovers(dst)
            write_folder(dst, family, sizes, config, weights, overwrite=force,
                         side_files=side_files)  # fmt: skip
        except Interrupted as err:
            raise Interrupted(err.signum, "folder") from None
        except OSError as err:
            raise PortError(f"{dst}: cannot write ({err.strerror or err}).") from None
        except (ValueError, TypeError) as err:
            raise PortError(str(err)) from None
        state["done"] = True
    return removed


def convert_model(
    src: Path,
    dst: Path,
    src_fmt: str,
    dst_fmt: str,
    trust_pickle: bool,
    force: bool,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict:
    """Convert a model folder or a neutral model file (see the module docstring); returns
    ``{"model_type", "tensors", "weights", "removed"}`` for the report (``removed``: the
    leftovers of killed runs removed before writing). ``max_bytes`` bounds the tensor data
    read from a neutral model file. Raises PortError (nothing written) or `Interrupted`."""
    if (src_fmt, dst_fmt) not in (("hf", "safetensors"), ("safetensors", "hf"), ("hf", "hf")):
        raise PortError(
            f"--from {src_fmt} --to {dst_fmt}: a model folder converts to a neutral model "
            "file (--from hf --to safetensors), back (--from safetensors --to hf) or to a "
            "folder (--from hf --to hf); to run it on a framework, use "
            "multiattn.models.from_pretrained(folder, framework=...)."
        )
    if src_fmt == "hf" and not src.is_dir():
        raise PortError(f"{src}: --from hf takes a model folder.")
    family, config, sizes, weights, side_files = _read(src, src_fmt, trust_pickle, max_bytes)
    if dst_fmt == "hf":
        removed = _write_folder(dst, family, sizes, config, weights, force, side_files)
    else:
        if dst.is_dir():
            raise PortError(f"{dst}: is a directory; give a file name.")
        if dst.exists() and not force:
            raise PortError(f"{dst} exists; pass --force to replace it.")
        try:  # the weights may be checked as they are read (a NaN is refused then)
            removed = write_tensors(dst, "safetensors", weights, _metadata(config, side_files))
        except (ValueError, TypeError) as err:
            raise PortError(str(err)) from None
    return {"model_type": family.model_type, "tensors": len(weights), "weights": weights,
            "removed": removed}  # fmt: skip
