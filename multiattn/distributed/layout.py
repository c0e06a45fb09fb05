"""Tensor-parallel layouts of multiattn's weights for ``keras.distribution``.

Attention heads are independent until the output projection sums over them, so
`MultiHeadAttention` shards by head: each device of the model axis holds the query, key
and value kernels ``(E, H, D)`` and biases ``(H, D)`` of ``H / n`` heads, and the rows of
the output kernel ``(H, D_v, E_out)`` that belong to those heads; the heads' outputs are
summed across devices by the output projection. The feed-forward networks shard their
first kernels (``ffn_1`` of `TransformerEncoderLayer`, ``up`` and ``gate`` of
`multiattn.layers.FeedForward`) ``(d_model, dff)`` by column (and the biases with them)
and their second (``ffn_2``, ``down``) ``(dff, d_model)`` by row (Megatron-LM's split).
Token embeddings ``(vocab, width)`` and the language-model head ``(width, vocab)`` are
split over the vocabulary. Normalisation weights, position embeddings, the output biases
and everything else are replicated.

One table, `RULES`, holds these layouts, by sublayer name (the blocks' names, whatever the
model family): `layout_map` makes a ``keras.distribution.LayoutMap`` of its first choices,
and `model_parallel` a ``keras.distribution.ModelParallel`` that, for each variable made
under its scope, takes the first choice whose sharded dimensions divide by the mesh axis
(`variable_layout`): grouped key/value heads ``H_kv`` that do not divide are replicated,
a vocabulary that does not divide is split over the width instead, and a dimension that
must be split and does not divide (the query heads, ``dff``) is refused naming the
variable and the mesh.

Keys are regular expressions matched in full against ``variable.path``
(``"transformer_encoder_layer/attention/query/kernel"``); a variable that matches none is
replicated by ``keras.distribution.ModelParallel``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["RULES", "layout_map", "model_parallel", "sharded_heads_rules", "variable_layout"]

_ANY_PARENT = r"(?:.*/)?"
#: the mesh axis placeholder in `RULES`
M = "model"
#: a choice of `RULES`: replicated (allowed where a dimension does not divide)
REPLICATED = "replicated"
#: attention sublayers, not a feed-forward network's ``gate`` (``ffn/gate``)
_ATTENTION = _ANY_PARENT + r"(?<!ffn/)"

#: ``{name: (path regex, choices)}``: the layouts of multiattn's weights. Each choice names,
#: per weight dimension, whether it is split over the model axis (``M``) or not (None);
#: the first choice whose split dimensions divide by the axis's size is taken
#: (`variable_layout`), `REPLICATED` where replication is allowed. Names are those of
#: the sublayers, so every family built from the blocks is covered.
RULES: dict[str, tuple[str, tuple]] = {
    # (E, H, D) and (H, D): by head (query, and the attention's own gate)
    "query and gate kernels": (_ATTENTION + r"(?:query|gate)/kernel", ((None, M, None),)),
    "query and gate biases": (_ATTENTION + r"(?:query|gate)/bias", ((M, None),)),
    # (E, H_kv, D), (H_kv, D): by key/value head, replicated where H_kv does not divide
    "key and value kernels": (_ATTENTION + r"(?:key|value)/kernel", ((None, M, None), REPLICATED)),
    "key and value biases": (_ATTENTION + r"(?:key|value)/bias", ((M, None), REPLICATED)),
    # (H, D_v, E_out): the rows of the heads; its bias (E_out,) replicated
    "attention output kernels": (_ANY_PARENT + r"attention_output/kernel", ((M, None, None),)),
    # (d_model, dff) and (dff,): by column
    "feed-forward first kernels": (
        _ANY_PARENT + r"(?:ffn_1|ffn/up|ffn/gate)/kernel",
        ((None, M),),
    ),
    "feed-forward first biases": (_ANY_PARENT + r"(?:ffn_1|ffn/up|ffn/gate)/bias", ((M,),)),
    # (dff, d_model): by row; its bias (d_model,) replicated
    "feed-forward second kernels": (_ANY_PARENT + r"(?:ffn_2|ffn/down)/kernel", ((M, None),)),
    # (vocab, width): by token, else by width (CausalLM's word, BERT's word/embeddings,
    # T5's shared)
    "token embeddings": (
        _ANY_PARENT + r"(?:word|word/embeddings|shared)",
        ((M, None), (None, M), REPLICATED),
    ),
    # (width, vocab): by token, else by width
    "language-model heads": (
        _ANY_PARENT + r"lm_head(?:/kernel)?",
        ((None, M), (M, None), REPLICATED),
    ),
}


def _check_axis_name(where: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{where}: `{name}` must be a non-empty string; received {value!r}.")
    return value


def _axes(choice: tuple, model_axis: str) -> tuple[str | None, ...]:
    return tuple(model_axis if a == M else None for a in choice)


def sharded_heads_rules(model_axis: str = "model") -> dict[str, tuple[str | None, ...]]:
    """The first choices of `RULES`, as ``{path regex: axes}``.

    Each value names, per weight dimension, the mesh axis it is split over (None:
    replicated along that dimension). Variables no rule matches are replicated.

    Args:
        model_axis: name of the mesh axis the heads, feed-forward columns and
            vocabulary are split over.

    Returns:
        A dict from regular expression (matched in full against ``variable.path``) to
        an axes tuple, e.g. ``".../query/kernel"`` -> ``(None, model_axis, None)`` for
        the kernel of shape ``(E, H, D)``.
    """
    m = _check_axis_name("sharded_heads_rules", "model_axis", model_axis)
    return {pattern: _axes(choices[0], m) for pattern, choices in RULES.values()}


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


def _describe_mesh(device_mesh: Any) -> str:
    return f"mesh shape {tuple(device_mesh.shape)}, axes {tuple(device_mesh.axis_names)}"


def variable_layout(
    path: str, shape: tuple, device_mesh: Any, model_axis: str = "model"
) -> tuple[str | None, ...] | None:
    """The axes `RULES` give the weight ``path`` of ``shape`` on ``device_mesh``.

    The first choice of the rule matching ``path`` whose split dimensions divide by the
    size of ``model_axis``; None where no rule matches or the rule allows replication
    and no split divides (grouped key/value heads, a vocabulary and width that do not
    divide).

    Raises:
        ValueError: the rule's weight must be split (query heads, ``dff``) and its
            dimension does not divide: the message names the variable, its shape, the
            dimension and the mesh; or the weight's rank is not the rule's.
    """
    size = dict(zip(device_mesh.axis_names, device_mesh.shape))[model_axis]
    for name, (pattern, choices) in RULES.items():
        if not re.fullmatch(pattern, path):
            continue
        shape = tuple(shape)
        failed = None
        for choice in choices:
            if choice == REPLICATED:
                return None
            if len(choice) != len(shape):
                raise ValueError(
                    f"model_parallel: variable {path!r} of shape {shape} matches the rule "
                    f"for {name} ({pattern!r}), whose weights have {len(choice)} "
                    f"dimensions; rename the sublayer or add a rule of its own."
                )
            split = [i for i, a in enumerate(choice) if a == M]
            bad = [i for i in split if shape[i] % size]
            if not bad:
                return _axes(choice, model_axis)
            failed = failed or bad[0]
        raise ValueError(
            f"model_parallel: variable {path!r} of shape {shape} ({name}) is split along "
            f"dimension {failed}, of size {shape[failed]}, over mesh axis {model_axis!r} "
            f"of size {size} ({_describe_mesh(device_mesh)}), and {shape[failed]} does not "
            f"divide by {size}; use a model axis whose size divides it."
        )
    return None


def layout_map(device_mesh: Any, *, model_axis: str = "model") -> Any:
    """A ``keras.distribution.LayoutMap`` that shards multiattn's layers over a mesh axis.

    Query/key/value kernels and biases and the output kernel of every
    `multiattn.layers.MultiHeadAttention` (standalone or inside a block) are split by
    head, the feed-forward networks' first kernels and biases (``ffn_1``, ``ffn/up``,
    ``ffn/gate``) by column and their second kernels (``ffn_2``, ``ffn/down``) by row,
    token embeddings (``word``, ``word/embeddings``, ``shared``) and language-model
    heads (``lm_head``) over the vocabulary; everything else is replicated (the first
    choices of `RULES`, see `sharded_heads_rules`). With a plain
    ``keras.distribution.ModelParallel`` every split dimension must divide by the size
    of the model axis; `model_parallel` also takes the other choices of `RULES` (grouped
    key/value heads replicated, the vocabulary split by width) and names the variable
    that does not divide. The map is an ordinary ``LayoutMap``: add rules for your own
    layers to it before building the distribution.

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
    """``keras.distribution.ModelParallel`` with the layouts of `RULES`.

    Weights are sharded over ``model_axis`` (each variable made under the distribution's
    scope takes `variable_layout`: the first choice of its rule that divides); input
    batches are split over ``batch_axis`` (default: the mesh's first axis); KV caches
    made under it (`multiattn.layers.MultiHeadAttention.init_cache`, ``generate``) are
    split by key/value head like the key and value kernels (`cache_layout`). Use it as
    ``with model_parallel(mesh).scope():`` around building the model, pass it to
    ``keras.distribution.set_distribution``, or to
    ``multiattn.hf.pretrained.from_pretrained(path, distribution=...)``.

    Args:
        device_mesh: ``keras.distribution.DeviceMesh``.
        model_axis: the mesh axis weights are sharded over.
        batch_axis: the mesh axis the batch is split over (data parallelism), or None
            for the mesh's first axis.

    Returns:
        a ``keras.distribution.ModelParallel`` (its ``layout_map`` is `layout_map`'s).

    Raises:
        ValueError: (when a model is built under it) a weight that must be split does
            not divide (`variable_layout`).
    """
    where = "model_parallel"
    _check_axis_name(where, "model_axis", model_axis)
    if batch_axis is not None:
        _check_axis_name(where, "batch_axis", batch_axis)
    _check_mesh(where, device_mesh, {"model_axis": model_axis, "batch_axis": batch_axis})
    from keras.distribution import ModelParallel, TensorLayout

    class ShardedModelParallel(ModelParallel):
        """``ModelParallel`` whose variables take `variable_layout` (`RULES`' choices by
        the variable's shape) unless they already have a layout."""

        def get_variable_layout(self, variable):
            if getattr(variable, "_layout", None) is not None:
                return variable._layout
            axes = variable_layout(variable.path, variable.shape, self.device_mesh, model_axis)
            return TensorLayout(axes or (None,) * len(variable.shape), self.device_mesh)

        def cache_layout(self, shape: tuple) -> Any:
            """The layout of a KV cache ``(batch, H_kv, slots, D)``: batch over the batch
            axis and heads over the model axis, each where it divides."""
            axes = [None] * len(shape)
            sizes = dict(zip(self.device_mesh.axis_names, self.device_mesh.shape))
            if shape[0] % sizes[self.batch_dim_name] == 0:
                axes[0] = self.batch_dim_name
            if shape[1] % sizes[model_axis] == 0:
                axes[1] = model_axis
            return TensorLayout(axes, self.device_mesh)

    distribution = ShardedModelParallel(
        layout_map=layout_map(device_mesh, model_axis=model_axis), batch_dim_name=batch_axis
    )
    distribution.model_axis = model_axis
    return distribution


def place_cache(tensor: Any) -> Any:
    """``tensor`` (a KV cache ``(batch, H_kv, slots, D)``) placed by the active
    `model_parallel` distribution (`cache_layout`): split by batch and head where they
    divide. Unchanged without one, on another backend, or under another distribution."""
    import keras

    if keras.backend.backend() != "jax":
        return tensor
    from keras.distribution import distribute_tensor, distribution

    active = distribution()
    if active is None or not hasattr(active, "cache_layout"):
        return tensor
    return distribute_tensor(tensor, active.cache_layout(tuple(tensor.shape)))
