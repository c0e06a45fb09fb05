"""Weight files: reading, mapping to and from the neutral layout, atomic writing.

Formats (``FORMATS``):

``safetensors``
    The neutral layout (`multiattn.port.layout`) in a safetensors file; the metadata
    holds ``multiattn.kind`` and ``multiattn.config`` (JSON), so the file rebuilds its
    module alone. The default output.
``torch-safetensors``
    A safetensors file with ``torch.nn`` ``state_dict`` names.
``torch``
    A ``torch.save``'d ``state_dict`` (``.pt``/``.pth``/``.bin``), read with
    ``torch.load(weights_only=True)``: tensors only, no code runs. A file that needs full
    unpickling is refused.
``paddle``
    A ``paddle.save``'d ``state_dict`` (``.pdparams``). It is a pickle, which can run code
    when read: refused unless ``trust_pickle=True``. Needs paddle.
``keras``
    A ``.weights.h5`` file of `multiattn.layers.MultiHeadAttention` or
    ``TransformerEncoderLayer`` (read and written with h5py; no TensorFlow).
``keras-mha``
    A ``.weights.h5`` file of ``keras.layers.MultiHeadAttention``.

Every file is written to a temporary file in the destination's directory and moved into
place with ``os.replace``: an interrupted run leaves the old file or none, never half a
file.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .layout import (
    CONFIG_KEYS,
    PortableWeights,
    check_config,
    check_weights,
    encoder_attention_config,
    expected_shapes,
)
from .names import (
    infer_config,
    neutral_to_paddle,
    neutral_to_torch,
    paddle_to_neutral,
    torch_packed,
    torch_to_neutral,
)

__all__ = [
    "FORMATS",
    "PortError",
    "load_portable",
    "read_tensors",
    "save_portable",
    "write_tensors",
]

FORMATS = ("safetensors", "torch-safetensors", "torch", "paddle", "keras", "keras-mha")
PICKLE_FORMATS = ("paddle",)
# format -> the name layout of its tensors
LAYOUT = {
    "safetensors": "neutral",
    "torch-safetensors": "torch",
    "torch": "torch",
    "paddle": "paddle",
    "keras": "keras",
    "keras-mha": "keras-mha",
}
META_KIND, META_CONFIG = "multiattn.kind", "multiattn.config"


class PortError(ValueError):
    """A checkpoint cannot be converted (missing, extra or mis-shaped tensors, an unsafe
    or unreadable file). Nothing is written."""


# --- reading ----------------------------------------------------------------------------


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="numpy") as fh:
        meta = fh.metadata() or {}
        for key in fh.keys():
            tensors[key] = fh.get_tensor(key)
    return tensors, meta


def _read_torch(path: Path, trust_pickle: bool) -> tuple[dict, dict]:
    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError for anything but tensors
        if not trust_pickle:
            first = str(err).splitlines()[0] if str(err) else ""
            raise PortError(
                f"{path}: not a plain state_dict of tensors ({type(err).__name__}: {first}). "
                "Reading a full pickle can run arbitrary code; pass --trust-pickle "
                "(trust_pickle=True) only for files you trust."
            ) from err
        obj = torch.load(str(path), map_location="cpu", weights_only=False)
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise PortError(f"{path}: expected a state_dict (a dict of tensors); got {type(obj)}.")
    return {k: v.detach().cpu().numpy() for k, v in obj.items()}, {}


def _read_paddle(path: Path, trust_pickle: bool) -> tuple[dict, dict]:
    if not trust_pickle:
        raise PortError(
            f"{path}: .pdparams files are Python pickles, and reading a pickle can run "
            "arbitrary code. Pass --trust-pickle (trust_pickle=True) only for files you trust."
        )
    import paddle

    obj = paddle.load(str(path), return_numpy=True)
    if not isinstance(obj, dict):
        raise PortError(f"{path}: expected a state_dict; got {type(obj).__name__}.")
    return {k: np.asarray(v) for k, v in obj.items()}, {}


def _read_h5(path: Path) -> tuple[dict, dict]:
    import h5py

    tensors: dict[str, np.ndarray] = {}
    with h5py.File(str(path), "r") as fh:

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                tensors[name] = np.array(obj)

        fh.visititems(visit)
    return tensors, {}


def read_tensors(
    path: str | os.PathLike, fmt: str, trust_pickle: bool = False
) -> tuple[dict, dict]:
    """The tensors (name -> NumPy array, names as stored) and metadata of a weight file."""
    path = Path(path)
    if fmt not in FORMATS:
        raise PortError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}.")
    if not path.is_file():
        raise PortError(f"{path}: no such file.")
    if fmt in ("safetensors", "torch-safetensors"):
        return _read_safetensors(path)
    if fmt == "torch":
        return _read_torch(path, trust_pickle)
    if fmt == "paddle":
        return _read_paddle(path, trust_pickle)
    return _read_h5(path)


# --- writing ----------------------------------------------------------------------------


@contextlib.contextmanager
def _atomic(path: Path):
    """Yields a temporary path next to ``path``; moved onto ``path`` only on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates 0600; give the file the mode a plain open() would (or the old one's)
        if path.exists():
            mode = path.stat().st_mode & 0o777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_h5(path: Path, tensors: dict) -> None:
    import h5py

    with h5py.File(str(path), "w") as fh:
        for name, arr in tensors.items():
            group, _, _ = name.rpartition("/")
            grp = fh.require_group(group)
            grp.attrs.setdefault("name", group.split("/")[-2] if "/" in group else "layer")
            grp.create_dataset(name.rpartition("/")[2], data=arr)


def write_tensors(path: str | os.PathLike, fmt: str, tensors: dict, metadata: dict) -> None:
    """Write ``tensors`` atomically in format ``fmt`` (metadata only for safetensors)."""
    path = Path(path)
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    with _atomic(path) as tmp:
        if fmt in ("safetensors", "torch-safetensors"):
            from safetensors.numpy import save_file

            save_file(arrays, str(tmp), metadata=metadata or None)
        elif fmt == "torch":
            import torch

            torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, str(tmp))
        elif fmt == "paddle":
            import paddle

            paddle.save({k: paddle.to_tensor(v) for k, v in arrays.items()}, str(tmp))
        elif fmt in ("keras", "keras-mha"):
            _write_h5(tmp, arrays)
        else:
            raise PortError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}.")


# --- name layouts -----------------------------------------------------------------------

_MHA_ORDER = ("query", "key", "value", "output")


def _h5_table(layout: str, kind: str, use_bias: bool) -> dict[str, str]:
    """neutral name -> h5 dataset path, for the two Keras layouts."""
    if layout == "keras-mha":
        if kind != "mha":
            raise PortError(f"keras-mha files hold keras.layers.MultiHeadAttention, not {kind}.")
        table = {}
        for n in _MHA_ORDER:
            table[f"{n}/kernel"] = f"{n}_dense/vars/0"
            if use_bias:
                table[f"{n}/bias"] = f"{n}_dense/vars/1"
        return table

    def mha(prefix: str, bias: bool) -> dict[str, str]:
        names = [f"{n}/kernel" for n in _MHA_ORDER] + (
            [f"{n}/bias" for n in _MHA_ORDER] if bias else []
        )
        return {f"{prefix}{n}": f"{prefix}vars/{i}" for i, n in enumerate(names)}

    if kind == "mha":
        return mha("", use_bias)
    if kind != "encoder":
        raise PortError(f"keras files of kind {kind!r} are not supported.")
    table = mha("attention/", True)
    for n in ("ffn_1", "ffn_2"):
        table.update({f"{n}/kernel": f"{n}/vars/0", f"{n}/bias": f"{n}/vars/1"})
    for n in ("norm_1", "norm_2"):
        table.update({f"{n}/gamma": f"{n}/vars/0", f"{n}/beta": f"{n}/vars/1"})
    return table


def _h5_kind_and_bias(layout: str, tensors: dict, kind: str | None) -> tuple[str, bool]:
    if kind is None:
        kind = "encoder" if any(k.startswith("attention/") for k in tensors) else "mha"
    if layout == "keras-mha":
        return kind, "query_dense/vars/1" in tensors
    return kind, kind == "encoder" or "vars/4" in tensors


def to_neutral(
    layout: str, kind: str | None, tensors: dict, config: dict | None, num_heads: int | None
) -> tuple[str, dict, dict, dict[str, str]]:
    """``tensors`` of ``layout`` as (kind, config, neutral weights, neutral -> source name).

    Raises PortError for missing, extra or mis-shaped tensors."""
    try:
        if layout in ("keras", "keras-mha"):
            kind, bias = _h5_kind_and_bias(layout, tensors, kind)
            table = _h5_table(layout, kind, bias)
            inverse = {v: k for k, v in table.items()}
            missing = sorted(v for v in table.values() if v not in tensors)
            extra = sorted(k for k in tensors if k not in inverse)
            if missing or extra:
                raise PortError(
                    f"{layout} {kind} file: "
                    + "; ".join(
                        p
                        for p in (
                            f"missing {missing}" if missing else "",
                            f"unexpected {extra}" if extra else "",
                        )
                        if p
                    )
                    + "."
                )
            neutral = {inverse[k]: v for k, v in tensors.items()}
            layout_names = table
            layout = "neutral"
        else:
            neutral, layout_names = tensors, None
        if kind is None:
            raise PortError("the module kind is unknown: pass --module (mha or encoder).")
        if config is None:
            config = infer_config(layout, kind, neutral, num_heads)
        config = check_config(kind, config)
        shape_config = {k: config[k] for k in CONFIG_KEYS[kind]}
        if layout == "neutral":
            weights = check_weights(expected_shapes(kind, shape_config), neutral, f"{kind} file")
            names = layout_names or {k: k for k in weights}
        elif layout == "torch":
            weights = torch_to_neutral(kind, neutral, shape_config)
            names = framework_names("torch", kind, shape_config)
        else:
            weights = paddle_to_neutral(kind, neutral, shape_config)
            names = framework_names("paddle", kind, shape_config)
    except PortError:
        raise
    except ValueError as err:
        raise PortError(str(err)) from err
    return kind, config, weights, names


def from_neutral(layout: str, kind: str, config: dict, weights: dict) -> tuple[dict, dict]:
    """Neutral weights as (tensors of ``layout``, neutral -> target name)."""
    shape_config = {k: config[k] for k in CONFIG_KEYS[kind]}
    try:
        if layout == "neutral":
            return dict(weights), {k: k for k in weights}
        if layout in ("keras", "keras-mha"):
            table = _h5_table(layout, kind, kind == "encoder" or config.get("use_bias", True))
            return {table[k]: v for k, v in weights.items()}, table
        convert = neutral_to_torch if layout == "torch" else neutral_to_paddle
        return convert(kind, weights, shape_config), framework_names(layout, kind, shape_config)
    except ValueError as err:
        raise PortError(str(err)) from err


def framework_names(layout: str, kind: str, config: dict) -> dict[str, str]:
    """neutral name -> where it lives in the torch or paddle layout (for reports)."""
    if kind == "encoder":
        inner = framework_names(layout, "mha", encoder_attention_config(config))
        out = {f"attention/{k}": f"self_attn.{v}" for k, v in inner.items()}
        t = {"ffn_1": "linear1", "ffn_2": "linear2", "norm_1": "norm1", "norm_2": "norm2"}
        for n, p in t.items():
            a, b = ("kernel", "bias") if n.startswith("ffn") else ("gamma", "beta")
            out[f"{n}/{a}"] = f"{p}.weight" + (".T" if layout == "torch" and a == "kernel" else "")
            out[f"{n}/{b}"] = f"{p}.bias"
        return out
    e, names = config["query_width"], {}
    for i, n in enumerate(("query", "key", "value")):
        if layout == "paddle":
            names[f"{n}/kernel"] = f"{n[0]}_proj.weight"
            names[f"{n}/bias"] = f"{n[0]}_proj.bias"
        else:
            rows = f"[{i * e}:{(i + 1) * e}]"
            packed = torch_packed(config)
            names[f"{n}/kernel"] = f"in_proj_weight{rows}.T" if packed else f"{n[0]}_proj_weight.T"
            names[f"{n}/bias"] = f"in_proj_bias{rows}"
    names["output/kernel"] = "out_proj.weight" + (".T" if layout == "torch" else "")
    names["output/bias"] = "out_proj.bias"
    if not config["use_bias"]:
        names = {k: v for k, v in names.items() if not k.endswith("/bias")}
    return names


# --- whole conversions ------------------------------------------------------------------


@dataclass
class Conversion:
    """The result of `convert_file`: the neutral weights and the per-tensor mapping."""

    kind: str
    config: dict
    weights: dict
    source_names: dict[str, str]
    target_names: dict[str, str]
    target_tensors: dict


def convert_tensors(
    tensors: dict,
    metadata: dict,
    src_fmt: str,
    dst_fmt: str,
    kind: str | None = None,
    num_heads: int | None = None,
    extra_config: dict | None = None,
) -> Conversion:
    """Map the tensors of a ``src_fmt`` file to ``dst_fmt`` names (no file written)."""
    config = None
    if META_KIND in metadata:
        if kind is not None and kind != metadata[META_KIND]:
            raise PortError(
                f"--module {kind} contradicts the file's metadata kind {metadata[META_KIND]!r}."
            )
        kind = metadata[META_KIND]
        config = json.loads(metadata.get(META_CONFIG, "null"))
    if config is None and num_heads is None and LAYOUT[src_fmt] in ("torch", "paddle"):
        raise PortError(f"--num-heads is required to read a {src_fmt} file.")
    kind, config, weights, src_names = to_neutral(LAYOUT[src_fmt], kind, tensors, config, num_heads)
    if extra_config and kind != "encoder":
        raise PortError("--norm-first, --epsilon and --activation apply to encoder files only.")
    if extra_config:
        config = check_config(kind, {**config, **extra_config})
    out, dst_names = from_neutral(LAYOUT[dst_fmt], kind, config, weights)
    return Conversion(kind, config, weights, src_names, dst_names, out)


def metadata_for(kind: str, config: dict) -> dict[str, str]:
    return {META_KIND: kind, META_CONFIG: json.dumps(config, sort_keys=True)}


def save_portable(weights: PortableWeights, path: str | os.PathLike) -> None:
    """Write `PortableWeights` as a safetensors file (neutral names, config in metadata),
    atomically."""
    write_tensors(path, "safetensors", weights.weights, metadata_for(weights.kind, weights.config))


def load_portable(path: str | os.PathLike) -> PortableWeights:
    """Read a file written by `save_portable` (or ``multiattn port ... --to safetensors``).

    Raises PortError when the metadata is missing or the tensors do not match it."""
    tensors, meta = read_tensors(path, "safetensors")
    if META_KIND not in meta:
        raise PortError(f"{path}: no {META_KIND!r} metadata; not a multiattn.port file.")
    conv = convert_tensors(tensors, meta, "safetensors", "safetensors")
    return PortableWeights(conv.kind, conv.config, conv.weights)
