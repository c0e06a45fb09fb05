"""A mixture-of-experts feed-forward network (Mixtral, Qwen2-MoE, Qwen3-MoE): a top-k
router over gated experts stacked along an expert axis, and an optional shared expert."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from .._checks import HALF_DTYPES, check_bool, check_float, check_positive_int, describe
from ..namespaces.keras import get_ops
from ..ops.activations import activation as apply_activation
from ..ops.activations import check_activation
from ._base import (
    block_initializers,
    call_sublayer,
    fresh_initializer,
    project,
    static_width,
    sublayer_initializers,
)
from .feed_forward import FeedForward

__all__ = ["MixtureOfExperts", "MoEConfig"]

_PARTS = ("gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts options of a `multiattn.layers.DecoderBlockConfig` (its
    ``moe`` field): a block with one replaces its feed-forward network by a
    `MixtureOfExperts`. Checked when made (errors name the field and quote the value).

    Fields:
        num_experts: routed experts (``num_local_experts`` / ``num_experts``).
        num_experts_per_tok: experts each token is routed to (top-k), at most
            ``num_experts``.
        expert_dff: hidden width of each routed expert (Mixtral: ``intermediate_size``;
            Qwen2-MoE, Qwen3-MoE: ``moe_intermediate_size``).
        norm_topk_prob: the k chosen routing probabilities are divided by their sum
            (Mixtral: always; Qwen: ``norm_topk_prob``). Default True.
        shared_expert_dff: hidden width of a shared gated expert every token goes
            through (Qwen2-MoE's ``shared_expert_intermediate_size``); None (default): none.
        shared_expert_gate: the shared expert's output is scaled by ``sigmoid(x @ g)``, a
            learned ``(d_model, 1)`` gate (Qwen2-MoE's ``shared_expert_gate``). Default
            True; needs ``shared_expert_dff``.
        dense_layers: indices (in the model) of the blocks that keep the dense
            feed-forward network of width ``DecoderBlockConfig.dff`` instead (Qwen2-MoE's
            ``mlp_only_layers`` and ``decoder_sparse_step``); a tuple of ints >= 0.
            Default ``()``. Read by `DecoderBlockConfig.for_layer`.
    """

    num_experts: int
    num_experts_per_tok: int
    expert_dff: int
    norm_topk_prob: bool = True
    shared_expert_dff: int | None = None
    shared_expert_gate: bool = True
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        where = "MoEConfig"
        for name in ("num_experts", "num_experts_per_tok", "expert_dff"):
            object.__setattr__(self, name, check_positive_int(where, name, getattr(self, name)))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"{where}: `num_experts_per_tok` ({self.num_experts_per_tok}) must be at "
                f"most `num_experts` ({self.num_experts})."
            )
        check_bool(where, "norm_topk_prob", self.norm_topk_prob)
        check_bool(where, "shared_expert_gate", self.shared_expert_gate)
        shared = check_positive_int(where, "shared_expert_dff", self.shared_expert_dff, True)
        object.__setattr__(self, "shared_expert_dff", shared)
        layers = self.dense_layers
        if not isinstance(layers, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in layers
        ):
            raise ValueError(
                f"{where}: `dense_layers` must be a tuple of block indices (ints >= 0); "
                f"received {describe(layers) if not isinstance(layers, (list, tuple)) else layers!r}."
            )
        object.__setattr__(self, "dense_layers", tuple(sorted({int(i) for i in layers})))

    def layer_options(self) -> dict[str, Any]:
        """The `MixtureOfExperts` arguments."""
        return {
            "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "hidden_dim": self.expert_dff, "norm_topk_prob": self.norm_topk_prob,
            "shared_expert_dim": self.shared_expert_dff,
            "shared_expert_gate": self.shared_expert_gate,
        }  # fmt: skip


def moe_config(where: str, value: Any) -> MoEConfig | None:
    """``value`` (a `MoEConfig`, a dict of its fields or None) as a `MoEConfig` or None."""
    if value is None or isinstance(value, MoEConfig):
        return value
    if isinstance(value, dict):
        names = {f.name for f in dataclasses.fields(MoEConfig)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"{where}: `moe` holds keys that are not MoEConfig fields: {unknown}; the "
                f"fields are {sorted(names)}."
            )
        return MoEConfig(**value)
    raise TypeError(
        f"{where}: `moe` must be a MoEConfig, a dict of its fields or None; received "
        f"{describe(value)}."
    )


def top_k_mask(ops: Any, probs: Any, k: int) -> Any:
    """Bool ``(..., E)``: True at the ``k`` largest of ``probs`` ``(..., E)`` in each row.

    An expert's rank is the number of experts with a larger probability, plus those with
    an equal one and a lower index (ties go to the lower index, as ``torch.topk`` on a
    CPU); it is chosen when its rank is below ``k``. Comparisons only (``E * E`` per
    token), so it runs through the namespace contract on every framework and traces with
    static shapes; the mask carries no gradient (the chosen probabilities do)."""
    e = probs.shape[-1]
    index = ops.arange(e, dtype="int32")
    lower = ops.less(ops.expand_dims(index, 0), ops.expand_dims(index, 1))  # [i, j]: j < i
    mine, other = ops.expand_dims(probs, -1), ops.expand_dims(probs, -2)
    ahead = ops.logical_or(ops.less(mine, other), ops.logical_and(ops.equal(mine, other), lower))
    rank = ops.sum(ops.cast(ahead, "int32"), axis=-1)
    return ops.less(rank, k)


@keras.saving.register_keras_serializable(package="multiattn")
class MixtureOfExperts(keras.layers.Layer):
    """Mixture-of-experts feed-forward network: each token goes through the
    ``num_experts_per_tok`` experts its router chooses, weighted by the router.

    For a token ``x`` (width ``d``)::

        p = softmax(x @ router)                     # (E,), in float32 (float64 inputs: float64)
        chosen = the k largest p                    # ties: the lower expert index
        w_i = p_i if i in chosen else 0             # norm_topk_prob: w /= sum(w)
        y = sum_i w_i * down_i(act(gate_i(x)) * up_i(x))
        y += sigmoid(x @ g) * shared(x)             # shared expert (shared_expert_dim)

    with ``router`` ``(d, E)``, expert kernels ``gate_i``, ``up_i`` ``(d, f)`` and
    ``down_i`` ``(f, d)`` and ``shared`` a gated `FeedForward` (Qwen2-MoE).

    **Grouped, dense computation.** The experts' kernels are stacked on a leading expert
    axis and every expert is computed for every token by three ``einsum`` contractions
    over the stack (no Python loop over experts or tokens; static shapes, so it traces
    under ``jax.jit``, ``tf.function`` and the KV-cache decoding loops unchanged); the
    routing weights, zero outside the chosen experts, are applied to each expert's hidden
    activations before the down projection, and the experts not chosen are zeroed with a
    ``where`` (so an overflow in an unchosen expert cannot reach the output). The cost is
    ``E / k`` times the arithmetic of the chosen experts (Mixtral 8 experts top-2: 4x;
    Qwen2-MoE 60 top-4: 15x; Qwen3-MoE 128 top-8: 16x) and ``3 * tokens * E * f``
    values of activations, while every expert's weights are read once per call, as any
    implementation must for a batch of tokens that reaches all experts. The alternative,
    gathering the chosen experts' kernels per token, reads and holds ``tokens * k * 3 *
    d * f`` values: less arithmetic, but for a prompt far more memory than the weights.
    The dense form was chosen for its static shapes and its one path for prompts and
    decoding steps.

    Which parts run in float32: the router's logits are computed in the compute dtype (as
    transformers does), then the softmax, the top-k choice and the normalisation in
    float32 (float64 for float64 inputs; transformers keeps float32 there too: the
    difference is float32 rounding of the weights); the weights are cast to the compute
    dtype before they scale the experts (as Qwen2-MoE/Qwen3-MoE; Mixtral multiplies in
    float32: the same for float32 models, one rounding apart in half precision).
    Activations and the shared gate's sigmoid are computed in float32 for half-precision
    inputs.

    Weights: ``router`` (``keras.layers.EinsumDense``, kernel ``(d, E)``, no bias),
    ``gate_kernel`` and ``up_kernel`` ``(E, d, f)``, ``down_kernel`` ``(E, f, d)``;
    with a shared expert ``shared_expert`` (`FeedForward`: ``gate``, ``up``, ``down``)
    and ``shared_expert_gate`` (``EinsumDense``, kernel ``(d, 1)``). No biases.

    Args:
        num_experts: routed experts ``E``, a positive int.
        num_experts_per_tok: ``k``, a positive int at most ``num_experts``.
        hidden_dim: hidden width ``f`` of each routed expert, a positive int.
        activation: the experts' gate activation, one of `multiattn.ops.ACTIVATIONS`
            (default ``"silu"``: SwiGLU experts).
        norm_topk_prob: divide the chosen probabilities by their sum (default True).
        shared_expert_dim: hidden width of the shared expert; None (default): none.
        shared_expert_gate: a sigmoid gate on the shared expert (default True; only
            with ``shared_expert_dim``).
        kernel_initializer: Keras initializer of the router and the expert kernels (each
            weight gets its own copy; the stacked kernels are drawn as one 3-D weight).
            Default ``glorot_uniform``.
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``, ...).

    Call arguments:
        x: ``(..., d)`` floating tensor with a static last axis and static rank, usually
            ``(batch, seq, d)``. There is no mask: each token is routed on its own (a
            padded position's output carries no meaning and affects no other token).

    Returns:
        ``(..., d)`` in the layer's compute dtype.

    Raises:
        TypeError: a flag not a bool, ``activation`` not a string, ``x`` not floating.
        ValueError: a size not a positive int, ``num_experts_per_tok > num_experts``, an
            unknown ``activation``, ``x`` with a width other than the built one.
    """

    _WHERE = "MixtureOfExperts"

    def __init__(
        self,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_dim: int,
        activation: str = "silu",
        norm_topk_prob: bool = True,
        shared_expert_dim: int | None = None,
        shared_expert_gate: bool = True,
        kernel_initializer: Any = "glorot_uniform",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = self._WHERE
        self.num_experts = check_positive_int(where, "num_experts", num_experts)
        self.num_experts_per_tok = check_positive_int(
            where, "num_experts_per_tok", num_experts_per_tok
        )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"{where}: `num_experts_per_tok` ({num_experts_per_tok}) must be at most "
                f"`num_experts` ({num_experts})."
            )
        self.hidden_dim = check_positive_int(where, "hidden_dim", hidden_dim)
        self.activation = check_activation(where, activation)
        self.norm_topk_prob = check_bool(where, "norm_topk_prob", norm_topk_prob)
        self.shared_expert_gate = check_bool(where, "shared_expert_gate", shared_expert_gate)
        self.shared_expert_dim = check_positive_int(
            where, "shared_expert_dim", shared_expert_dim, allow_none=True
        )
        self.kernel_initializer, self.bias_initializer = block_initializers(
            where, kernel_initializer, "zeros"
        )
        self.router = self._dense("router", self.num_experts)
        self.shared_expert = None
        self.shared_expert_gate_dense = None
        if self.shared_expert_dim is not None:
            self.shared_expert = FeedForward(
                self.shared_expert_dim, activation=self.activation, gated=True,
                use_bias=False, name="shared_expert", dtype=self.dtype_policy,
                **sublayer_initializers(self),
            )  # fmt: skip
            if self.shared_expert_gate:
                self.shared_expert_gate_dense = self._dense("shared_expert_gate", 1)

    def _dense(self, name: str, units: int) -> keras.layers.EinsumDense:
        return keras.layers.EinsumDense(
            "...d,de->...e", (units,), name=name, dtype=self.dtype_policy,
            kernel_initializer=fresh_initializer(self.kernel_initializer),
        )  # fmt: skip

    def build(self, input_shape):
        shape = tuple(input_shape)
        width = static_width(self._WHERE, "x", shape, max(len(shape), 1))
        self._width = width
        self.router.build(shape)
        e, f = self.num_experts, self.hidden_dim
        for part, kernel_shape in (("gate", (e, width, f)), ("up", (e, width, f)),
                                   ("down", (e, f, width))):  # fmt: skip
            weight = self.add_weight(
                shape=kernel_shape,
                initializer=fresh_initializer(self.kernel_initializer),
                name=f"{part}_kernel",
            )
            setattr(self, f"{part}_kernel", weight)
        if self.shared_expert is not None:
            self.shared_expert.build(shape)
        if self.shared_expert_gate_dense is not None:
            self.shared_expert_gate_dense.build(shape)

    def call(self, x):
        where = self._WHERE
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{where}: `x` must be a tensor; received {describe(x)}.")
        ops = get_ops(x)
        check_float(where, "x", x, ops)
        if x.shape[-1] is not None and x.shape[-1] != self._width:
            raise ValueError(
                f"{where}: `x` must have width {self._width} (the width the layer was built "
                f"with); received shape {tuple(x.shape)}."
            )
        dtype = self.compute_dtype
        route = "float64" if dtype == "float64" else "float32"
        logits = project(ops, x, self.router, dtype)  # (..., E) in the compute dtype
        probs = ops.softmax(ops.cast(logits, route), axis=-1)
        chosen = top_k_mask(ops, probs, self.num_experts_per_tok)
        weights = ops.where(chosen, probs, ops.zeros_like(probs))
        if self.norm_topk_prob:
            weights = weights / ops.sum(weights, axis=-1, keepdims=True)
        weights = ops.cast(weights, dtype)
        lead = "abcghijk"[: len(x.shape) - 1]
        gate, up, down = (ops.cast(k, dtype) for k in
                          (self.gate_kernel, self.up_kernel, self.down_kernel))  # fmt: skip
        gate = ops.einsum(f"{lead}d,edf->{lead}ef", x, gate)
        up = ops.einsum(f"{lead}d,edf->{lead}ef", x, up)
        hidden = apply_activation(gate, self.activation) * up  # (..., E, f)
        hidden = ops.where(
            ops.expand_dims(chosen, -1),
            hidden * ops.expand_dims(weights, -1),
            ops.zeros_like(hidden),
        )
        y = ops.einsum(f"{lead}ef,efd->{lead}d", hidden, down)
        if self.shared_expert is not None:
            shared = call_sublayer(self.shared_expert, x)
            if self.shared_expert_gate_dense is not None:
                g = project(ops, x, self.shared_expert_gate_dense, dtype)  # (..., 1)
                g = ops.cast(g, "float32") if dtype in HALF_DTYPES else g
                shared = shared * ops.cast(1.0 / (1.0 + ops.exp(-g)), dtype)
            y = y + shared
        return y

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "hidden_dim": self.hidden_dim,
            "activation": self.activation,
            "norm_topk_prob": self.norm_topk_prob,
            "shared_expert_dim": self.shared_expert_dim,
            "shared_expert_gate": self.shared_expert_gate,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        }
