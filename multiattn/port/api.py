"""`get_weights`, `set_weights`, `convert`: one entry point for every supported module.

A module's framework is found through ``sys.modules`` (a framework that is not imported
cannot have made the module), so nothing is imported eagerly.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .decoders import DECODER_KINDS
from .layout import (
    SETTING_KEYS,
    PortableWeights,
    check_config,
    check_weights,
    expected_shapes,
    settings_of,
)

__all__ = ["TARGETS", "build", "convert", "detect", "get_weights", "set_weights"]

# target name -> (module whose presence in sys.modules means the framework is loaded,
#                 handler module inside multiattn.port). Checked in this order.
_HANDLERS: dict[str, tuple[str, str]] = {
    "tensorflow-doc": ("multiattn.backends.tensorflow", "_keras"),
    "multiattn": ("multiattn.layers", "_keras"),
    "keras": ("keras", "_keras"),
    "torch-doc": ("multiattn.backends.torch", "_torch"),
    "torch": ("torch", "_torch"),
    "multiattn-paddle": ("multiattn.paddle.layers", "_keras"),
    "paddle-doc": ("multiattn.backends.paddle", "_paddle"),
    "paddle": ("paddle", "_paddle"),
    "flax": ("flax.nnx", "_flax"),
}

#: Names accepted by `convert` (``to``): the framework's own layers, or a document adapter.
TARGETS = tuple(_HANDLERS)


def _handler(target: str) -> Any:
    return importlib.import_module(f"{__package__}.{_HANDLERS[target][1]}")


def detect(module: Any) -> str:
    """The target name of ``module``'s framework (see `TARGETS`), found without importing
    any framework. Raises TypeError for an unsupported module."""
    for target, (loaded, _) in _HANDLERS.items():
        if loaded in sys.modules and _handler(target).owns(target, module):
            return target
    raise TypeError(
        "multiattn.port: unsupported module of type "
        f"{type(module).__module__}.{type(module).__qualname__}; supported: multiattn.layers."
        "MultiHeadAttention/TransformerEncoderLayer/TransformerDecoderLayer/"
        "TransformerDecoderOnlyLayer/AdditiveAttention, keras.layers."
        "MultiHeadAttention, torch.nn.MultiheadAttention/TransformerEncoderLayer, paddle.nn."
        "MultiHeadAttention/TransformerEncoderLayer, flax.nnx.MultiHeadAttention and the "
        "document adapters."
    )


def get_weights(module: Any) -> PortableWeights:
    """``module``'s weights in the neutral layout, with the config that rebuilds it.

    Args:
        module: a supported module (see `detect`), built (Keras layers: called once or
            ``build`` called).

    Returns:
        `PortableWeights`: arrays are copies in the parameters' dtype (float32 unless the
        module was cast).
    """
    target = detect(module)
    kind, config, weights = _handler(target).read(target, module)
    return PortableWeights(kind, config, weights)


def set_weights(module: Any, weights: PortableWeights | dict) -> Any:
    """Load neutral weights into ``module`` (in place); returns ``module``.

    Args:
        module: a supported module. An unbuilt multiattn/Keras layer is built from the
            weights' shapes first.
        weights: a `PortableWeights` (its kind must match the module, and so must its
            settings: ``num_key_value_heads``, ``rotary_max_length``, ``rotary_base``) or
            a dict of neutral name -> array (which records no settings: the module's own
            apply, and the key/value kernels must have its number of key/value heads).

    Raises:
        ValueError: a weight is missing or extra, or its shape differs from the module's
            (the message names the weight, the expected and the received shape); the
            weights' settings differ from the module's (the message names the setting).
    """
    target = detect(module)
    handler = _handler(target)
    kind = handler.kind_of(target, module)
    where = type(module).__name__
    if isinstance(weights, PortableWeights):
        if weights.kind != kind:
            raise ValueError(
                f"set_weights: the weights are of kind {weights.kind!r}, the module "
                f"({where}) of kind {kind!r}."
            )
        _check_settings(where, kind, weights.config, handler.settings(target, module))
        arrays = weights.weights
    elif isinstance(weights, dict):
        arrays = weights
    else:
        raise TypeError(
            "set_weights: `weights` must be PortableWeights or a dict of arrays; received "
            f"{type(weights).__name__}."
        )
    config = handler.config_of(target, module, arrays)
    try:
        arrays = check_weights(expected_shapes(kind, config), arrays, where)
    except ValueError as err:
        if kind != "mha" or not ("'key/" in str(err) or "'value/" in str(err)):
            raise
        hkv = config.get("num_key_value_heads", config["num_heads"])
        raise ValueError(
            f"{err} (The module has num_heads={config['num_heads']} and num_key_value_heads={hkv}.)"
        ) from None
    handler.write(target, module, kind, config, arrays)
    return module


def _check_settings(where: str, kind: str, config: dict, module_settings: dict) -> None:
    """The settings of the weights' ``config`` and of the module must be equal."""
    ours = settings_of(kind, config)
    for key in SETTING_KEYS.get(kind, ()):
        if ours.get(key) != module_settings.get(key):
            default = " (= num_heads)" if key == "num_key_value_heads" else " (no RoPE)"
            theirs, mine = ours.get(key), module_settings.get(key)
            raise ValueError(
                f"set_weights: the weights have {key}={theirs}"
                f"{default if theirs is None else ''}, the module ({where}) has "
                f"{key}={mine}{default if mine is None else ''}; build the module with the "
                "weights' settings (convert() does)."
            )


def build(target: str, kind: str, config: dict, **options: Any) -> Any:
    """A new ``target`` module of ``kind`` shaped by ``config`` (weights initialised by the
    framework). ``options`` are target-specific (see `convert`)."""
    if target not in _HANDLERS:
        raise ValueError(f"`to` must be one of {', '.join(TARGETS)}; received {target!r}.")
    if kind in DECODER_KINDS and target not in ("multiattn", "multiattn-paddle"):
        raise ValueError(
            f"convert(to={target!r}): only multiattn's layers hold a {kind} block (the "
            f"targets 'multiattn' and 'multiattn-paddle'); received kind {kind!r}."
        )
    loaded = _HANDLERS[target][0]
    if target.endswith("-doc") and loaded not in sys.modules:
        importlib.import_module(loaded)  # the adapter selects its Keras backend on import
    return _handler(target).build(target, kind, check_config(kind, config), dict(options))


def convert(module: Any, to: str, **options: Any) -> Any:
    """An equivalent module in framework ``to``, built first, then given ``module``'s weights.

    Args:
        module: any supported module (see `detect`).
        to: ``"multiattn"`` (`multiattn.layers`), ``"keras"`` (``keras.layers``),
            ``"torch"`` (``torch.nn``), ``"paddle"`` (``paddle.nn``), ``"flax"``
            (``flax.nnx``), or a document adapter: ``"torch-doc"``, ``"tensorflow-doc"``,
            ``"paddle-doc"``. Keras targets use the process's Keras backend.
        **options: ``dtype`` (default float32); torch: ``batch_first`` (default True);
            paddle-doc: ``query_size`` (the fixed sequence length, required); flax:
            ``rngs`` (default ``nnx.Rngs(0)``).

    Returns:
        The new module. Behaviour keys the source does not record (dropout rate,
        LayerNorm epsilon, ...) take the target's defaults; dropout is inactive in
        inference mode either way (torch and paddle modules: call ``.eval()``).

    Raises:
        ValueError: the target cannot hold this module (e.g. ``torch.nn.MultiheadAttention``
            needs ``key_dim * num_heads`` equal to the query width); the message says why.
    """
    source = get_weights(module)
    target = build(to, source.kind, source.config, **options)
    set_weights(target, source)
    return target
