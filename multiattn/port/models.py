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
import os
import tempfile
from pathlib import Path

import numpy as np

from .checkpoint import PortError

__all__ = ["MODEL_KIND", "convert_model"]

MODEL_KIND = "model"


def _read(src: Path, fmt: str, trust_pickle: bool) -> tuple:
    """``(family, config, sizes, neutral weights, side files)`` of a folder or a neutral
    model file (the side files, such as ``generation_config.json``, ride in the file's
    metadata)."""
    from ..hf.families import family_of, to_hf
    from ..hf.files import check_state, read_folder

    if fmt == "hf":
        try:
            loaded = read_folder(src, trust_pickle=trust_pickle)
        except (ValueError, TypeError) as err:
            raise PortError(str(err)) from err
        return loaded.family, loaded.config, loaded.sizes, loaded.weights, loaded.side_files
    from safetensors import safe_open

    try:
        with safe_open(str(src), framework="numpy") as f:
            meta = f.metadata() or {}
            weights = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error types
        raise PortError(f"{src}: not a readable safetensors file ({err}).") from err
    if meta.get("multiattn.kind") != MODEL_KIND:
        raise PortError(
            f"{src}: --to hf needs a model file written by `multiattn port --from hf` "
            f"(metadata multiattn.kind = 'model'); this one holds "
            f"{meta.get('multiattn.kind', 'no multiattn.kind')!r}."
        )
    config = json.loads(meta["multiattn.config"])
    side_files = json.loads(meta.get("multiattn.side_files", "{}"))
    where = f"multiattn port {src}"
    try:
        family = family_of(config, where)
        sizes = family.check_config(config, where)
        entries = family.entries(sizes, pooler="pooler/kernel" in weights)
        extra = sorted(set(weights) - {e.name for e in entries})
        if extra:
            raise PortError(f"{src}: tensors not in a {family.model_type} model: {extra}.")
        check_state(family, sizes, to_hf(entries, weights), where)
    except (ValueError, KeyError) as err:
        raise PortError(str(err)) from err
    return family, config, sizes, weights, side_files


def _write_file(dst: Path, config: dict, weights: dict[str, np.ndarray], side_files: dict) -> None:
    from safetensors.numpy import save_file

    meta = {"multiattn.kind": MODEL_KIND, "multiattn.config": json.dumps(config, sort_keys=True),
            "multiattn.model_type": str(config.get("model_type")),
            "multiattn.side_files": json.dumps(side_files, sort_keys=True)}  # fmt: skip
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, tmp, metadata=meta)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def convert_model(
    src: Path, dst: Path, src_fmt: str, dst_fmt: str, trust_pickle: bool, force: bool
) -> dict:
    """Convert a model folder or a neutral model file (see the module docstring); returns
    ``{"model_type", "tensors", "weights"}`` for the report."""
    from ..hf.files import write_folder

    if (src_fmt, dst_fmt) not in (("hf", "safetensors"), ("safetensors", "hf"), ("hf", "hf")):
        raise PortError(
            f"--from {src_fmt} --to {dst_fmt}: a model folder converts to a neutral model "
            "file (--from hf --to safetensors), back (--from safetensors --to hf) or to a "
            "folder (--from hf --to hf); to run it on a framework, use "
            "multiattn.models.from_pretrained(folder, framework=...)."
        )
    if src_fmt == "hf" and not src.is_dir():
        raise PortError(f"{src}: --from hf takes a model folder.")
    family, config, sizes, weights, side_files = _read(src, src_fmt, trust_pickle)
    if dst_fmt == "hf":
        try:
            write_folder(dst, family, sizes, config, weights, overwrite=force,
                         side_files=side_files)  # fmt: skip
        except ValueError as err:
            raise PortError(str(err)) from err
    else:
        if dst.is_dir():
            raise PortError(f"{dst}: is a directory; give a file name.")
        if dst.exists() and not force:
            raise PortError(f"{dst} exists; pass --force to replace it.")
        _write_file(dst, config, weights, side_files)
    return {"model_type": family.model_type, "tensors": len(weights), "weights": weights}
