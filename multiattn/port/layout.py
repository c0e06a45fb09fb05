"""The framework-neutral weight layout: names, shapes and the config behind them.

Weights are a flat ``dict`` of NumPy arrays whose names and shapes follow
``keras.layers.MultiHeadAttention`` (heads contiguous, a kernel maps ``(in, ...) -> out``):

``mha`` (multi-head attention)
    ``query/kernel (E_q, H, D)``, ``query/bias (H, D)``, ``key/kernel (E_k, H_kv, D)``,
    ``key/bias (H_kv, D)``, ``value/kernel (E_v, H_kv, Dv)``, ``value/bias (H_kv, Dv)``,
    ``output/kernel (H, Dv, E_out)``, ``output/bias (E_out,)``; the biases are absent when
    ``use_bias`` is False; ``H_kv`` is ``num_key_value_heads`` (default ``H``).

``encoder`` (Transformer encoder layer)
    ``attention/<the mha names>`` (with ``D = Dv = d_model / H``, biases present),
    ``ffn_1/kernel (E, F)``, ``ffn_1/bias (F,)``, ``ffn_2/kernel (F, E)``, ``ffn_2/bias (E,)``,
    ``norm_1/gamma (E,)``, ``norm_1/beta (E,)``, ``norm_2/gamma (E,)``, ``norm_2/beta (E,)``;
    ``norm_1`` is the normalisation around attention and ``norm_2`` the one around the
    feed-forward network, both for post- and pre-LayerNorm.

``additive`` (additive attention, document 002)
    ``query/kernel (E_q, U)``, ``key/kernel (E_k, U)``, ``score/kernel (U,)``.

``decoder`` and ``decoder_only`` (`multiattn.layers.TransformerDecoderLayer` and
``TransformerDecoderOnlyLayer``; only multiattn's layers and their Paddle twins hold them)
    see `multiattn.port.decoders`.

The config (`CONFIG_KEYS`) holds what is needed to rebuild the module: the shape keys fix
every weight's shape, the optional behaviour keys (``dropout``, ``norm_first``, ``epsilon``,
``activation``) default to the target framework's own default when absent.

The settings (`SETTING_KEYS`, ``mha`` only) change what the weights compute, so no target may
drop them: ``num_key_value_heads`` (grouped-query attention: the key and value kernels and
biases have ``H_kv`` heads, ``H_kv`` dividing ``H``; query head ``h`` uses key/value head
``h // (H / H_kv)``), ``rotary_max_length`` and ``rotary_base`` (rotary position embedding
of the projected queries and keys, as `multiattn.layers.MultiHeadAttention` applies it). A
config holds them only when they are not the default: ``num_key_value_heads`` when it
differs from ``num_heads``, the two rotary keys together when RoPE is on. A target that
cannot represent a setting refuses it (`refuse_settings`), naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._checks import is_floating
from .decoders import DECODER_KINDS, DEFAULTS, check_decoder_config, decoder_shapes

__all__ = [
    "BEHAVIOUR_KEYS",
    "CONFIG_KEYS",
    "KINDS",
    "OPTIONAL_KEYS",
    "SETTING_KEYS",
    "PortableWeights",
    "check_config",
    "check_weights",
    "expected_shapes",
    "refuse_settings",
    "settings_of",
    "structure",
]

KINDS = ("mha", "encoder", "additive", *DECODER_KINDS)

#: Required config keys of each kind (all positive ints, ``use_bias`` a bool).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "mha": (
        "num_heads",
        "key_dim",
        "value_dim",
        "query_width",
        "key_width",
        "value_width",
        "output_width",
        "use_bias",
    ),
    "encoder": ("d_model", "num_heads", "dff"),
    "additive": ("units", "query_width", "key_width"),
    **dict.fromkeys(DECODER_KINDS, ("d_model", "num_heads", "dff")),
}

#: Optional behaviour keys of each kind and their types.
OPTIONAL_KEYS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "mha": {
        "dropout": (int, float),
        "num_key_value_heads": (int, np.integer),
        "rotary_max_length": (int, np.integer),
        "rotary_base": (int, float, np.integer, np.floating),
    },
    "encoder": {
        "dropout": (int, float),
        "norm_first": bool,
        "epsilon": (int, float),
        "activation": str,
    },
    "additive": {"dropout": (int, float)},
    # checked by `multiattn.port.decoders.check_decoder_config`: the types are its rules
    **{kind: dict.fromkeys(DEFAULTS[kind], object) for kind in DECODER_KINDS},
}

#: Optional keys that record behaviour only: a target that is not given one uses its own
#: default (see the module docstring).
BEHAVIOUR_KEYS = ("dropout", "norm_first", "epsilon", "activation")

#: Settings no target may drop: a target that cannot represent one refuses the weights.
SETTING_KEYS: dict[str, tuple[str, ...]] = {
    "mha": ("num_key_value_heads", "rotary_max_length", "rotary_base"),
    "encoder": (),
    "additive": (),
    **{kind: tuple(k for k in DEFAULTS[kind] if k not in (*BEHAVIOUR_KEYS, "context_width"))
       for kind in DECODER_KINDS},
}  # fmt: skip

#: The wavelength base `multiattn.layers.MultiHeadAttention` uses when none is given.
DEFAULT_ROTARY_BASE = 10000.0

ACTIVATIONS = ("relu", "gelu")


def _check_kind(kind: Any) -> str:
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {', '.join(KINDS)}; received {kind!r}.")
    return kind


def check_config(kind: str, config: dict) -> dict:
    """``config`` checked for ``kind``: required keys present and positive, no unknown keys.

    Returns a new dict with plain Python values. Raises ValueError naming the key.
    """
    _check_kind(kind)
    if not isinstance(config, dict):
        raise TypeError(f"`config` must be a dict; received {type(config).__name__}.")
    if kind in DECODER_KINDS:
        return check_decoder_config(kind, config)
    required, optional = CONFIG_KEYS[kind], OPTIONAL_KEYS[kind]
    unknown = sorted(set(config) - set(required) - set(optional))
    if unknown:
        raise ValueError(
            f"{kind} config: unknown key(s) {unknown}; allowed {list(required)} "
            f"and {list(optional)}."
        )
    out: dict[str, Any] = {}
    for key in required:
        if key not in config:
            raise ValueError(f"{kind} config: missing key {key!r}; received {config!r}.")
        value = config[key]
        if key == "use_bias":
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{kind} config: `use_bias` must be a bool; received {value!r}.")
            out[key] = bool(value)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{kind} config: `{key}` must be a positive int; received {value!r}.")
        out[key] = int(value)
    for key, types in optional.items():
        if key not in config or config[key] is None:
            continue
        value = config[key]
        if (types is not bool and isinstance(value, bool)) or not isinstance(value, types):
            raise ValueError(f"{kind} config: `{key}` has the wrong type; received {value!r}.")
        if key == "activation" and value not in ACTIVATIONS:
            raise ValueError(
                f"{kind} config: `activation` must be one of {ACTIVATIONS}; received {value!r}."
            )
        if key in ("dropout", "epsilon", "rotary_base"):
            value = float(value)
            if key == "dropout" and not 0.0 <= value < 1.0:
                raise ValueError(f"{kind} config: `dropout` must be in [0, 1); received {value!r}.")
            if key != "dropout" and not (value > 0 and np.isfinite(value)):
                raise ValueError(
                    f"{kind} config: `{key}` must be a positive finite number; received {value!r}."
                )
        elif key in ("num_key_value_heads", "rotary_max_length"):
            if value < 1:
                raise ValueError(
                    f"{kind} config: `{key}` must be a positive int; received {value!r}."
                )
            value = int(value)
        out[key] = value
    if kind == "encoder" and out["d_model"] % out["num_heads"]:
        raise ValueError(
            f"encoder config: `d_model` ({out['d_model']}) must be divisible by `num_heads` "
            f"({out['num_heads']})."
        )
    if kind == "mha":
        _check_settings(out)
    return out


def _check_settings(out: dict) -> None:
    """Check the ``mha`` settings of a config in place and bring them to the canonical form
    (present only when not the default)."""
    h, hkv = out["num_heads"], out.get("num_key_value_heads")
    if hkv is not None:
        if h % hkv:
            raise ValueError(
                f"mha config: `num_key_value_heads` ({hkv}) must divide `num_heads` ({h})."
            )
        if hkv == h:
            del out["num_key_value_heads"]
    if "rotary_max_length" not in out:
        if "rotary_base" in out:
            raise ValueError(
                f"mha config: `rotary_base` ({out['rotary_base']!r}) is given without "
                "`rotary_max_length`; rotary position embedding needs both."
            )
        return
    out.setdefault("rotary_base", DEFAULT_ROTARY_BASE)
    if out["key_dim"] % 2:
        raise ValueError(
            "mha config: rotary position embedding (`rotary_max_length`="
            f"{out['rotary_max_length']}) needs an even `key_dim`; received {out['key_dim']}."
        )


def structure(kind: str, config: dict) -> dict:
    """``config`` without its behaviour keys: the shape keys and the settings."""
    return {k: v for k, v in config.items() if k not in BEHAVIOUR_KEYS}


def settings_of(kind: str, config: dict) -> dict:
    """The settings (`SETTING_KEYS`) that ``config`` holds (none: an empty dict)."""
    return {k: config[k] for k in SETTING_KEYS.get(kind, ()) if k in config}


def refuse_settings(
    where: str,
    what: str,
    kind: str,
    config: dict,
    *,
    grouped: bool = False,
    rotary: bool = False,
    files: bool = False,
) -> None:
    """Raise ValueError naming the first setting of ``config`` that ``what`` (a module or a
    file layout) cannot represent: grouped key/value heads unless ``grouped``, rotary
    position embedding unless ``rotary``. The advice names the targets that can (the file
    formats when ``files``)."""
    if kind != "mha":
        return
    if not grouped and "num_key_value_heads" in config:
        advice = "the safetensors or keras format" if files else "'multiattn' or 'flax'"
        raise ValueError(
            f"{where}: {what} has no grouped key/value heads; received num_key_value_heads="
            f"{config['num_key_value_heads']} (num_heads={config['num_heads']}). Convert to "
            f"{advice} instead."
        )
    if not rotary and "rotary_max_length" in config:
        advice = "the safetensors or keras format" if files else "'multiattn'"
        raise ValueError(
            f"{where}: {what} has no rotary position embedding; received rotary_max_length="
            f"{config['rotary_max_length']} (rotary_base={config['rotary_base']!r}). Convert "
            f"to {advice} instead."
        )


def _mha_shapes(c: dict, prefix: str = "") -> dict[str, tuple[int, ...]]:
    h, d, dv = c["num_heads"], c["key_dim"], c["value_dim"]
    hkv = c.get("num_key_value_heads", h)
    shapes = {
        "query/kernel": (c["query_width"], h, d),
        "query/bias": (h, d),
        "key/kernel": (c["key_width"], hkv, d),
        "key/bias": (hkv, d),
        "value/kernel": (c["value_width"], hkv, dv),
        "value/bias": (hkv, dv),
        "output/kernel": (h, dv, c["output_width"]),
        "output/bias": (c["output_width"],),
    }
    if not c["use_bias"]:
        shapes = {k: v for k, v in shapes.items() if not k.endswith("/bias")}
    return {prefix + k: v for k, v in shapes.items()}


def encoder_attention_config(config: dict) -> dict:
    """The ``mha`` config of an encoder's attention sublayer."""
    e, h = config["d_model"], config["num_heads"]
    return {
        "num_heads": h,
        "key_dim": e // h,
        "value_dim": e // h,
        "query_width": e,
        "key_width": e,
        "value_width": e,
        "output_width": e,
        "use_bias": True,
    }


def expected_shapes(kind: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Every neutral weight name of a ``kind`` module with ``config``, with its shape."""
    c = check_config(kind, config)
    if kind in DECODER_KINDS:
        return decoder_shapes(kind, c)
    if kind == "mha":
        return _mha_shapes(c)
    if kind == "additive":
        u = c["units"]
        return {
            "query/kernel": (c["query_width"], u),
            "key/kernel": (c["key_width"], u),
            "score/kernel": (u,),
        }
    e, f = c["d_model"], c["dff"]
    return {
        **_mha_shapes(encoder_attention_config(c), "attention/"),
        "ffn_1/kernel": (e, f),
        "ffn_1/bias": (f,),
        "ffn_2/kernel": (f, e),
        "ffn_2/bias": (e,),
        "norm_1/gamma": (e,),
        "norm_1/beta": (e,),
        "norm_2/gamma": (e,),
        "norm_2/beta": (e,),
    }


def _fmt(shape: tuple) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def check_weights(
    expected: dict[str, tuple[int, ...]], weights: dict, where: str = "weights"
) -> dict[str, np.ndarray]:
    """``weights`` checked against ``expected`` (name -> shape): nothing missing, nothing
    extra, every shape equal. Returns the weights as NumPy arrays (no copy when possible).

    Raises ValueError listing the missing and extra names, or naming the weight with the
    expected and the received shape.
    """
    if not isinstance(weights, dict):
        raise TypeError(f"{where}: weights must be a dict of arrays; received {type(weights)!r}.")
    missing = [k for k in expected if k not in weights]
    extra = sorted(k for k in weights if k not in expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unexpected {extra}")
        raise ValueError(f"{where}: {'; '.join(parts)}.")
    out = {}
    for name, shape in expected.items():
        arr = np.asarray(weights[name])
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(
                f"{where}: weight {name!r} must have shape {_fmt(shape)}; received "
                f"{_fmt(arr.shape)}."
            )
        if not is_floating(arr.dtype):
            raise ValueError(
                f"{where}: weight {name!r} must be floating point; received dtype {arr.dtype}."
            )
        out[name] = arr
    return out


@dataclasses.dataclass
class PortableWeights:
    """A module's weights in the neutral layout, with the config that rebuilds it.

    Attributes:
        kind: one of `KINDS`: ``"mha"``, ``"encoder"``, ``"additive"``, ``"decoder"`` or
            ``"decoder_only"``.
        config: the shape keys of `CONFIG_KEYS` and any optional behaviour keys.
        weights: neutral name -> NumPy array (see the module docstring for the shapes);
            arrays keep the source's dtype (float32 for most modules).
    """

    kind: str
    config: dict
    weights: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        self.config = check_config(self.kind, self.config)
        self.weights = check_weights(
            expected_shapes(self.kind, self.config), self.weights, f"{self.kind} weights"
        )
