"""Tensor-parallel layouts of multiattn's weights for ``keras.distribution``.

Attention heads are independent until the output projection sums over them, so
`MultiHeadAttention` shards by head: each device of the model axis holds the query, key
and value kernels ``(E, H, D)`` and biases ``(H, D)`` of ``H / n`` heads, and the rows of
the output kernel ``(H, D_v, E_out)`` that belong to those heads; the heads' outputs are
summed across devices by the output projection. The feed-forward network of
`TransformerEncoderLayer` shards its first kernel ``(d_model, dff)`` by column (and the
bias with it) and its second ``(dff, d_model)`` by row (Megatron-LM's split). Layer
normalisation weights and the output biases are replicated.

Keys are regular expressions matched in full against ``variable.path``
(``"transformer_encoder_layer/attention/query/kernel"``); a variable that matches none is
replicated by ``keras.distribution.ModelParallel``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["layout_map", "model_parallel", "sharded_heads_rules"]

_ANY_PARENT = r"(?:.*/)?"


def _check_axis_name(where: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{where}: `{name}` must be a non-empty string; received {value!r}.")
    return value


def sharded_heads_rules(model_axis: str = "model") -> dict[str, tuple[str | None, ...]]:
    """The sharding rules of multiattn's weights, as ``{path regex: axes}``.

    Each value names, per weight dimension, the mesh axis it is split over (None:
    replicated along that dimension). Variables no rule matches are replicated.

    Args:
        model_axis: name of the mesh axis the heads and feed-forward columns are split
            over.

    Returns:
        A dict from regular expression (matched in full against ``variable.path``) to
        an axes tuple, e.g. ``".../query/kernel"`` -> ``(None, model_axis, None)`` for
        the kernel of shape ``(E, H, D)``.
    """
    m = _check_axis_name("sharded_heads_rules", "model_axis", model_axis)
    rules: dict[str, tuple[str | None, ...]] = {}
    # The projections are the sublayers ``query``, ``key``, ``gate``, ``value`` and
    # ``attention_output`` (Keras' names and layout, so Keras' own MultiHeadAttention
    # shards the same way).
    for name in ("query", "key", "gate", "value"):
        rules[f"{_ANY_PARENT}{name}/kernel"] = (None, m, None)  # (E, H, D): by head
        rules[f"{_ANY_PARENT}{name}/bias"] = (m, None)  # (H, D)
    rules[f"{_ANY_PARENT}attention_output/kernel"] = (m, None, None)  # (H, D_v, E_out)
    rules[f"{_ANY_PARENT}ffn_1/kernel"] = (None, m)  # (d_model, dff): by column
    rules[f"{_ANY_PARENT}ffn_1/bias"] = (m,)  # (dff,)
    rules[f"{_ANY_PARENT}ffn_2/kernel"] = (m, None)  # (dff, d_model): by row
    return rules


def _check_mesh(where: str, device_mesh: Any, axes: dict[str, str | None]) -> None:
    from keras.distribution import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"{where}: `device_mesh` must be a keras.distribution.DeviceMesh; received "
            f"{type(device_mesh).__name__}."
        )
    for name, axis in axes.items():
        if axis is not None and axis not in device_mesh.axis_names:
            raise ValueError(
                f"{where}: `{name}` {axis!r} is not an axis of the device mesh; its axes "
                f"are {list(device_mesh.axis_names)}."
            )


def layout_map(device_mesh: Any, *, model_axis: str = "model") -> Any:
    """A ``keras.distribution.LayoutMap`` that shards multiattn's layers over a mesh axis.

    Query/key/value kernels and biases and the output kernel of every
    `multiattn.layers.MultiHeadAttention` (standalone or inside
    `multiattn.layers.TransformerEncoderLayer`) are split by head, the encoder's
    ``ffn_1`` kernel and bias by column and its ``ffn_2`` kernel by row; everything else
    is replicated (see `sharded_heads_rules`). The number of heads and ``dff`` must be
    divisible by the size of the model axis. The map is an ordinary ``LayoutMap``: add
    rules for your own layers to it before building the distribution.

    Args:
        device_mesh: ``keras.distribution.DeviceMesh``, e.g.
            ``DeviceMesh((2, 4), ("batch", "model"), keras.distribution.list_devices())``.
        model_axis: the mesh axis to shard over.

    Returns:
        ``keras.distribution.LayoutMap`` for ``keras.distribution.ModelParallel``.
    """
    where = "layout_map"
    _check_axis_name(where, "model_axis", model_axis)
    _check_mesh(where, device_mesh, {"model_axis": model_axis})
    from keras.distribution import LayoutMap

    layouts = LayoutMap(device_mesh)
    for pattern, axes in sharded_heads_rules(model_axis).items():
        layouts[pattern] = axes
    return layouts


def model_parallel(
    device_mesh: Any, *, model_axis: str = "model", batch_axis: str | None = None
) -> Any:
    """``keras.distribution.ModelParallel`` with the layout of `layout_map`.

    Weights are sharded over ``model_axis``; input batches are split over ``batch_axis``
    (default: the mesh's first axis). Use it as ``with model_parallel(mesh).scope():``
    around building the model, or pass it to ``keras.distribution.set_distribution``.

    Args:
        device_mesh: ``keras.distribution.DeviceMesh``.
        model_axis: the mesh axis weights are sharded over.
        batch_axis: the mesh axis the batch is split over (data parallelism), or None
            for the mesh's first axis.

    Returns:
        ``keras.distribution.ModelParallel``.
    """
    where = "model_parallel"
    _check_axis_name(where, "model_axis", model_axis)
    if batch_axis is not None:
        _check_axis_name(where, "batch_axis", batch_axis)
    _check_mesh(where, device_mesh, {"model_axis": model_axis, "batch_axis": batch_axis})
    from keras.distribution import ModelParallel

    return ModelParallel(
        layout_map=layout_map(device_mesh, model_axis=model_axis), batch_dim_name=batch_axis
    )
