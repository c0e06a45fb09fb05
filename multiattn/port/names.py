"""Framework parameter names <-> the neutral layout, on NumPy arrays only.

Each framework stores the same weights under its own names and layouts:

* ``torch``: ``torch.nn.MultiheadAttention`` / ``TransformerEncoderLayer`` ``state_dict``
  names; ``nn.Linear`` weights are ``(out, in)``; q, k and v are packed in
  ``in_proj_weight (3E, E)`` when the key and value widths equal ``E``, else separate
  ``q_proj_weight (E, E)``, ``k_proj_weight (E, kdim)``, ``v_proj_weight (E, vdim)``.
* ``paddle``: ``paddle.nn.MultiHeadAttention`` / ``TransformerEncoderLayer`` names;
  ``paddle.nn.Linear`` weights are ``(in, out)``.

Heads are contiguous in both (feature ``h * D + d`` belongs to head ``h``), as in the
neutral layout, so every mapping is a transpose and a reshape: exact, bit for bit.
These functions import no framework; the checkpoint CLI uses them directly.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .layout import (
    check_config,
    check_weights,
    encoder_attention_config,
    expected_shapes,
    refuse_settings,
)

__all__ = [
    "framework_shapes",
    "infer_config",
    "neutral_to_paddle",
    "neutral_to_torch",
    "paddle_to_neutral",
    "torch_to_neutral",
]

_QKV = ("query", "key", "value")
_TORCH_SEPARATE = {"query": "q_proj_weight", "key": "k_proj_weight", "value": "v_proj_weight"}
_PADDLE = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "out_proj"}
_ENCODER_TORCH = {
    "ffn_1": "linear1",
    "ffn_2": "linear2",
    "norm_1": "norm1",
    "norm_2": "norm2",
}


def _c(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr)


def torch_packed(config: dict) -> bool:
    """Whether ``torch.nn.MultiheadAttention`` packs q, k, v (key and value widths = E)."""
    e = config["query_width"]
    return config["key_width"] == e and config["value_width"] == e


def check_torch_mha(config: dict) -> None:
    """``torch.nn.MultiheadAttention`` needs ``D = Dv = E / H`` and ``E_out = E_q``; it has
    no grouped key/value heads and no rotary position embedding (nor has paddle's)."""
    what = "torch/paddle MultiHeadAttention"
    refuse_settings("torch/paddle layout", what, "mha", config, files=True)
    h, e = config["num_heads"], config["query_width"]
    if config["key_dim"] * h != e or config["value_dim"] != config["key_dim"]:
        raise ValueError(
            "torch/paddle MultiHeadAttention needs key_dim = value_dim = query width / "
            f"num_heads; received key_dim={config['key_dim']}, value_dim="
            f"{config['value_dim']}, query width {e}, num_heads {h}."
        )
    if config["output_width"] != e:
        raise ValueError(
            "torch/paddle MultiHeadAttention needs the output width to equal the query "
            f"width; received output width {config['output_width']} and query width {e}."
        )


def _torch_mha_from(flat: dict, c: dict, p: str = "") -> dict[str, np.ndarray]:
    h, d, e = c["num_heads"], c["key_dim"], c["query_width"]
    out = {}
    if torch_packed(c):
        w = flat[p + "in_proj_weight"]
        rows = {"query": w[:e], "key": w[e : 2 * e], "value": w[2 * e :]}
    else:
        rows = {n: flat[p + _TORCH_SEPARATE[n]] for n in _QKV}
    for n in _QKV:
        out[f"{n}/kernel"] = _c(rows[n].T.reshape(-1, h, d))
    out["output/kernel"] = _c(flat[p + "out_proj.weight"].T.reshape(h, d, e))
    if c["use_bias"]:
        b = flat[p + "in_proj_bias"]
        for i, n in enumerate(_QKV):
            out[f"{n}/bias"] = _c(b[i * e : (i + 1) * e].reshape(h, d))
        out["output/bias"] = _c(flat[p + "out_proj.bias"])
    return out


def _torch_mha_to(w: dict, c: dict, p: str = "") -> dict[str, np.ndarray]:
    check_torch_mha(c)
    e = c["query_width"]
    rows = {n: w[f"{n}/kernel"].reshape(w[f"{n}/kernel"].shape[0], e).T for n in _QKV}
    out = {}
    if torch_packed(c):
        out[p + "in_proj_weight"] = _c(np.concatenate([rows[n] for n in _QKV], axis=0))
    else:
        out.update({p + _TORCH_SEPARATE[n]: _c(rows[n]) for n in _QKV})
    if c["use_bias"]:
        out[p + "in_proj_bias"] = _c(np.concatenate([w[f"{n}/bias"].reshape(e) for n in _QKV]))
    out[p + "out_proj.weight"] = _c(w["output/kernel"].reshape(e, e).T)
    if c["use_bias"]:
        out[p + "out_proj.bias"] = _c(w["output/bias"])
    return out


def _torch_expected(kind: str, c: dict) -> dict[str, tuple[int, ...]]:
    """torch ``state_dict`` names and shapes of a module with the neutral config ``c``."""
    if kind == "mha":
        check_torch_mha(c)
        e = c["query_width"]
        shapes: dict[str, tuple[int, ...]] = {}
        if torch_packed(c):
            shapes["in_proj_weight"] = (3 * e, e)
        else:
            shapes.update(
                q_proj_weight=(e, e), k_proj_weight=(e, c["key_width"]),
                v_proj_weight=(e, c["value_width"]),
            )  # fmt: skip
        if c["use_bias"]:
            shapes["in_proj_bias"] = (3 * e,)
        shapes["out_proj.weight"] = (e, e)
        if c["use_bias"]:
            shapes["out_proj.bias"] = (e,)
        return shapes
    if kind != "encoder":
        raise ValueError(f"torch layout: no torch.nn module for kind {kind!r}.")
    e, f = c["d_model"], c["dff"]
    attn = _torch_expected("mha", encoder_attention_config(c))
    return {
        **{f"self_attn.{k}": v for k, v in attn.items()},
        "linear1.weight": (f, e),
        "linear1.bias": (f,),
        "linear2.weight": (e, f),
        "linear2.bias": (e,),
        "norm1.weight": (e,),
        "norm1.bias": (e,),
        "norm2.weight": (e,),
        "norm2.bias": (e,),
    }


def framework_shapes(layout: str, kind: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The ``torch`` or ``paddle`` ``state_dict`` names and shapes of a ``kind`` module with
    the neutral ``config`` (ValueError when the layout cannot hold it)."""
    if layout not in _STATE_DICTS:
        raise ValueError(f"`layout` must be torch or paddle; received {layout!r}.")
    return _STATE_DICTS[layout][0](kind, check_config(kind, config))


def _paddle_expected(kind: str, c: dict) -> dict[str, tuple[int, ...]]:
    if kind == "mha":
        check_torch_mha(c)
        e = c["query_width"]
        widths = {"query": e, "key": c["key_width"], "value": c["value_width"], "output": e}
        shapes: dict[str, tuple[int, ...]] = {}
        for n, p in _PADDLE.items():
            shapes[f"{p}.weight"] = (widths[n], e)
            if c["use_bias"]:
                shapes[f"{p}.bias"] = (e,)
        return shapes
    if kind != "encoder":
        raise ValueError(f"paddle layout: no paddle.nn module for kind {kind!r}.")
    e, f = c["d_model"], c["dff"]
    attn = _paddle_expected("mha", encoder_attention_config(c))
    return {
        **{f"self_attn.{k}": v for k, v in attn.items()},
        "linear1.weight": (e, f),
        "linear1.bias": (f,),
        "linear2.weight": (f, e),
        "linear2.bias": (e,),
        "norm1.weight": (e,),
        "norm1.bias": (e,),
        "norm2.weight": (e,),
        "norm2.bias": (e,),
    }


def _paddle_mha_from(flat: dict, c: dict, p: str = "") -> dict[str, np.ndarray]:
    h, d, e = c["num_heads"], c["key_dim"], c["query_width"]
    out = {}
    for n in _QKV:
        out[f"{n}/kernel"] = _c(flat[f"{p}{_PADDLE[n]}.weight"].reshape(-1, h, d))
        if c["use_bias"]:
            out[f"{n}/bias"] = _c(flat[f"{p}{_PADDLE[n]}.bias"].reshape(h, d))
    out["output/kernel"] = _c(flat[f"{p}out_proj.weight"].reshape(h, d, e))
    if c["use_bias"]:
        out["output/bias"] = flat[f"{p}out_proj.bias"]
    return out


def _paddle_mha_to(w: dict, c: dict, p: str = "") -> dict[str, np.ndarray]:
    check_torch_mha(c)
    e = c["query_width"]
    out = {}
    for n in (*_QKV, "output"):
        kernel = w[f"{n}/kernel"]
        rows = e if n == "output" else kernel.shape[0]
        out[f"{p}{_PADDLE[n]}.weight"] = _c(kernel.reshape(rows, e))
        if c["use_bias"]:
            out[f"{p}{_PADDLE[n]}.bias"] = _c(w[f"{n}/bias"].reshape(e))
    return out


def _encoder_from(flat: dict, c: dict, mha_from: Any, *, transposed: bool) -> dict:
    """A torch or Paddle ``TransformerEncoderLayer`` state_dict (both name their sublayers
    alike) as neutral encoder weights; ``transposed``: linear weights stored ``(out, in)``
    (torch) rather than ``(in, out)`` (Paddle)."""
    attn = mha_from(flat, encoder_attention_config(c), "self_attn.")
    out = {f"attention/{k}": v for k, v in attn.items()}
    for n in ("ffn_1", "ffn_2"):
        t = _ENCODER_TORCH[n]
        weight = flat[f"{t}.weight"]
        out[f"{n}/kernel"] = _c(weight.T) if transposed else weight
        out[f"{n}/bias"] = flat[f"{t}.bias"]
    for n in ("norm_1", "norm_2"):
        t = _ENCODER_TORCH[n]
        out[f"{n}/gamma"] = flat[f"{t}.weight"]
        out[f"{n}/beta"] = flat[f"{t}.bias"]
    return out


def _encoder_to(w: dict, c: dict, mha_to: Any, *, transposed: bool) -> dict:
    """Neutral encoder weights as a torch or Paddle state_dict (see `_encoder_from`)."""
    attn = {k.removeprefix("attention/"): v for k, v in w.items() if k.startswith("attention/")}
    out = mha_to(attn, encoder_attention_config(c), "self_attn.")
    for n in ("ffn_1", "ffn_2"):
        t = _ENCODER_TORCH[n]
        kernel = w[f"{n}/kernel"]
        out[f"{t}.weight"] = _c(kernel.T) if transposed else kernel
        out[f"{t}.bias"] = w[f"{n}/bias"]
    for n in ("norm_1", "norm_2"):
        t = _ENCODER_TORCH[n]
        out[f"{t}.weight"] = w[f"{n}/gamma"]
        out[f"{t}.bias"] = w[f"{n}/beta"]
    return out


#: layout -> (expected state_dict shapes, MHA reader, MHA writer, linear weights stored
#: (out, in)): the torch and Paddle layouts differ only in these.
_STATE_DICTS = {
    "torch": (_torch_expected, _torch_mha_from, _torch_mha_to, True),
    "paddle": (_paddle_expected, _paddle_mha_from, _paddle_mha_to, False),
}


def state_dict_to_neutral(layout: str, kind: str, flat: dict, config: dict) -> dict:
    """A torch or Paddle ``state_dict`` (NumPy arrays) as neutral weights. Checks every
    name and shape first (ValueError naming the tensor)."""
    expected, mha_from, _, transposed = _STATE_DICTS[layout]
    c = check_config(kind, config)
    flat = check_weights(expected(kind, c), flat, f"{layout} {kind} state_dict")
    if kind == "mha":
        return mha_from(flat, c)
    return _encoder_from(flat, c, mha_from, transposed=transposed)


def neutral_to_state_dict(layout: str, kind: str, weights: dict, config: dict) -> dict:
    """Neutral weights as a torch or Paddle ``state_dict`` (NumPy arrays)."""
    _, _, mha_to, transposed = _STATE_DICTS[layout]
    c = check_config(kind, config)
    w = check_weights(expected_shapes(kind, c), weights, f"neutral {kind} weights")
    if kind == "mha":
        return mha_to(w, c)
    if kind != "encoder":
        raise ValueError(f"{layout} layout: no {layout}.nn module for kind {kind!r}.")
    return _encoder_to(w, c, mha_to, transposed=transposed)


torch_to_neutral = functools.partial(state_dict_to_neutral, "torch")
neutral_to_torch = functools.partial(neutral_to_state_dict, "torch")
paddle_to_neutral = functools.partial(state_dict_to_neutral, "paddle")
neutral_to_paddle = functools.partial(neutral_to_state_dict, "paddle")


def _shape(
    flat: dict, name: str, where: str, rank: int, stored: dict[str, str] | None = None
) -> tuple[int, ...]:
    """The shape of anchor tensor ``name`` (anything with a ``shape``: arrays, or the shape
    records of a file not read yet), which must have ``rank`` axes. ``stored`` maps the name
    to the one in the file, for messages."""
    label = (
        repr(name) if not stored or name not in stored else f"{name!r} (stored as {stored[name]!r})"
    )
    if name not in flat:
        raise ValueError(
            f"{where}: missing tensor {label} (needed to read the module's sizes; names that "
            "carry a parent module's prefix need --prefix)."
        )
    shape = tuple(int(d) for d in np.shape(flat[name]))
    if len(shape) != rank or not all(d >= 1 for d in shape):
        raise ValueError(
            f"{where}: tensor {label} must have {rank} non-empty axes; received shape {shape}."
        )
    return shape


def infer_config(
    layout: str,
    kind: str,
    flat: dict,
    num_heads: int | None = None,
    stored: dict[str, str] | None = None,
) -> dict:
    """The shape config of ``flat`` (names of ``layout``: ``neutral``, ``torch`` or
    ``paddle``). The torch and paddle layouts do not show the number of heads: pass
    ``num_heads``. Only a few anchor tensors are looked at (their shapes only: ``flat`` may
    map names to anything with a ``shape``); check the rest with `check_weights` against
    the config. A neutral ``mha`` whose key kernel has fewer heads than the query kernel
    gets ``num_key_value_heads``. ``stored`` (neutral name -> name in the file) is used in
    messages."""
    where = f"{layout} {kind} weights"
    if layout == "neutral":
        if kind == "mha":
            e_q, h, d = _shape(flat, "query/kernel", where, 3, stored)
            e_k, hkv, _ = _shape(flat, "key/kernel", where, 3, stored)
            e_v, _, dv = _shape(flat, "value/kernel", where, 3, stored)
            config = {
                "num_heads": h,
                "key_dim": d,
                "value_dim": dv,
                "query_width": e_q,
                "key_width": e_k,
                "value_width": e_v,
                "output_width": _shape(flat, "output/kernel", where, 3, stored)[-1],
                "use_bias": "query/bias" in flat,
            }
            if hkv != h:
                config["num_key_value_heads"] = hkv
            return config
        if kind == "encoder":
            e, h, _ = _shape(flat, "attention/query/kernel", where, 3, stored)
            f = _shape(flat, "ffn_1/kernel", where, 2, stored)[1]
            return {"d_model": e, "num_heads": h, "dff": f}
        if kind != "additive":
            raise ValueError(f"neutral layout: no module for kind {kind!r}.")
        q, u = _shape(flat, "query/kernel", where, 2, stored)
        k = _shape(flat, "key/kernel", where, 2, stored)[0]
        return {"units": u, "query_width": q, "key_width": k}
    if layout not in ("torch", "paddle"):
        raise ValueError(f"`layout` must be neutral, torch or paddle; received {layout!r}.")
    if num_heads is None:
        raise ValueError(f"{where}: the number of heads is not stored in this layout; pass it.")
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"{where}: `num_heads` must be a positive int; received {num_heads!r}.")
    num_heads = int(num_heads)
    if kind == "encoder":
        e = _shape(flat, "norm1.weight", where, 1)[0]
        f = _shape(flat, "linear1.bias", where, 1)[0]
        return {"d_model": e, "num_heads": num_heads, "dff": f}
    if kind != "mha":
        raise ValueError(f"{layout} layout: no module for kind {kind!r}.")
    if layout == "torch":
        e = _shape(flat, "out_proj.weight", where, 2)[0]
        if "in_proj_weight" in flat:
            kdim = vdim = e
        else:
            kdim = _shape(flat, "k_proj_weight", where, 2)[1]
            vdim = _shape(flat, "v_proj_weight", where, 2)[1]
        bias = "in_proj_bias" in flat
    else:
        e = _shape(flat, "q_proj.weight", where, 2)[1]
        kdim = _shape(flat, "k_proj.weight", where, 2)[0]
        vdim = _shape(flat, "v_proj.weight", where, 2)[0]
        bias = "q_proj.bias" in flat
    if e % num_heads:
        raise ValueError(f"{where}: width {e} is not divisible by num_heads={num_heads}.")
    return {
        "num_heads": num_heads,
        "key_dim": e // num_heads,
        "value_dim": e // num_heads,
        "query_width": e,
        "key_width": kdim,
        "value_width": vdim,
        "output_width": e,
        "use_bias": bias,
    }
