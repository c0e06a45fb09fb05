"""The frameworks' own attention layers as (informative) conformance targets.

Each target runs a framework's layer on the cases it can express: scaled dot-product
attention cases through the framework's SDPA function (grouped-query cases with its own
grouped heads), multi-head attention cases through its MHA layer with the fixture's
weights loaded into the layer's parameters (layout translation only). Masks go through
`multiattn.port.masks`, from the case's canonical keep mask to the layer's own convention.
Outputs only (and the attention weights where the layer returns them); no gradients.
Departures on fully masked rows, and where NaN or an infinity in masked keys and values
reaches the output, are expected and recorded in `multiattn.conformance.departures`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from multiattn.port import masks as M

from .autodiff import to_numpy
from .fixtures import Case

HALF = ("float16", "bfloat16")


def case_keep(case: Case) -> np.ndarray:
    """The case's canonical keep mask ``(batch, 1 or heads, queries, keys)``, built with
    `multiattn.port.masks` from its lengths, mask and (bottom-right) causal flag."""
    q = case.inputs["query"]
    b, tq = q.shape[0], q.shape[-2]
    if case.op == "sdpa":
        tk = case.inputs["key"].shape[-2]
    else:
        tk = tq if case.params.get("self") else case.inputs["value"].shape[1]
    parts = [np.ones((b, 1, tq, tk), dtype=bool)]
    if "valid_lens" in case.inputs:
        parts.append(M.from_valid_lens(case.inputs["valid_lens"], tk))
    if "mask" in case.inputs:
        mask = case.inputs["mask"]  # (B, T, S) or, per head, (B, H, T, S); True = attend
        parts.append(M.from_keras_mask(mask) if mask.ndim == 3 else M.as_keep(mask))
    if case.params.get("causal"):
        parts.append(M.causal_keep(tq, tk))
    return M.combine(*parts)


def contiguous_weights(case: Case) -> dict[str, np.ndarray]:
    """The case's flat projection weights with heads in contiguous order (an interleaved
    split is a permutation of the projections' output columns; W_o is merged
    contiguously either way)."""
    w = dict(case.weights)
    if case.params["head_layout"] == "interleaved":
        h = case.params["num_heads"]
        for n in "qkv":
            width = w[f"W_{n}"].shape[1]
            d = width // h
            perm = np.array([j * h + i for i in range(h) for j in range(d)])
            w[f"W_{n}"] = w[f"W_{n}"][:, perm]
            if f"b_{n}" in w:
                w[f"b_{n}"] = w[f"b_{n}"][perm]
    return w


def mha_inputs(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = case.inputs["query"]
    if case.params.get("self"):
        return q, q, q
    return q, case.inputs["key"], case.inputs["value"]


def packed_mha_fits(case: Case) -> bool | str:
    """torch / Paddle MHA: every head width equal and ``heads * width`` equal to the
    query and output widths."""
    p = case.params
    q = mha_inputs(case)[0]
    e = p["num_heads"] * p["key_dim"]
    if p["value_dim"] != p["key_dim"] or q.shape[-1] != e or p["output_dim"] != e:
        return (
            "the layer needs value_dim == key_dim and heads * key_dim equal to the query and "
            "output widths"
        )
    return True


class _Native:
    name = "native"
    informative = True  # departures on fully masked rows are recorded, not failures
    ops: tuple[str, ...] = ("sdpa", "mha")
    # float16 / bfloat16 only where the layer runs fast enough to keep the suite short
    dtypes: tuple[str, ...] = ("float64", "float32")

    def supports(self, case: Case) -> bool | str:
        if case.op not in self.ops:
            return f"{self.name} runs only {' and '.join(self.ops)} cases"
        if case.dtype not in self.dtypes:
            return f"{self.name} is not run in {case.dtype} (keeps the suite short)"
        if case.op == "mha":
            p = case.params
            if (p.get("num_key_value_heads") or p["num_heads"]) != p["num_heads"]:
                return f"{self.name}: the layer has no grouped-query attention"
            if p.get("rotary_max_length"):
                return f"{self.name}: the layer has no rotary position embedding"
        return self.fits(case)

    def fits(self, case: Case) -> bool | str:
        return True

    def unchecked(self, case: Case) -> tuple[str, ...]:
        """Expected arrays the layer does not return."""
        return ("weights",)


# --- PyTorch ----------------------------------------------------------------------------


class TorchNativeTarget(_Native):
    """``F.scaled_dot_product_attention`` (sdpa cases; grouped heads with
    ``enable_gqa=True``) and ``nn.MultiheadAttention`` with ``need_weights=True,
    average_attn_weights=False`` (mha cases)."""

    name = "native-torch"
    dtypes = ("float64", "float32", "float16", "bfloat16")

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def fits(self, case: Case) -> bool | str:
        return packed_mha_fits(case) if case.op == "mha" else True

    def unchecked(self, case: Case) -> tuple[str, ...]:
        return ("weights",) if case.op == "sdpa" else ()

    def _t(self, x: np.ndarray, dtype: str) -> Any:
        return self.torch.tensor(np.asarray(x, np.float64)).to(getattr(self.torch, dtype))

    def run(self, case: Case) -> dict[str, np.ndarray]:
        torch, dtype = self.torch, case.dtype
        keep = case_keep(case)
        with torch.no_grad():
            if case.op == "sdpa":
                q, k, v = (self._t(case.inputs[n], dtype) for n in ("query", "key", "value"))
                mask = M.to_sdpa_mask(keep)  # (B, 1 or H, T, S), True = take part
                out = torch.nn.functional.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=torch.tensor(mask if q.ndim == 4 else mask[:, 0]),
                    scale=case.params.get("scale"),
                    enable_gqa=q.ndim == 4 and q.shape[1] != k.shape[1],
                )
                return {"output": to_numpy(out)}
            p, w = case.params, contiguous_weights(case)
            q, k, v = mha_inputs(case)
            h, e = p["num_heads"], p["num_heads"] * p["key_dim"]
            bias = "b_q" in w
            layer = torch.nn.MultiheadAttention(
                e, h, bias=bias, kdim=k.shape[-1], vdim=v.shape[-1], batch_first=True
            ).to(getattr(torch, dtype))
            if layer._qkv_same_embed_dim:
                layer.in_proj_weight.copy_(
                    self._t(np.concatenate([w["W_q"], w["W_k"], w["W_v"]], 1).T, dtype)
                )
            else:
                layer.q_proj_weight.copy_(self._t(w["W_q"].T, dtype))
                layer.k_proj_weight.copy_(self._t(w["W_k"].T, dtype))
                layer.v_proj_weight.copy_(self._t(w["W_v"].T, dtype))
            layer.out_proj.weight.copy_(self._t(w["W_o"].T, dtype))
            if bias:
                layer.in_proj_bias.copy_(
                    self._t(np.concatenate([w["b_q"], w["b_k"], w["b_v"]]), dtype)
                )
                layer.out_proj.bias.copy_(self._t(w["b_o"], dtype))
            b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
            mask = M.to_torch_attn_mask(keep, h, (b, h, tq, tk))  # True = not allowed
            out, weights = layer(
                self._t(q, dtype),
                self._t(k, dtype),
                self._t(v, dtype),
                attn_mask=torch.tensor(mask),
                need_weights=True,
                average_attn_weights=False,
            )
        return {"output": to_numpy(out), "weights": to_numpy(weights)}


# --- JAX and Flax -----------------------------------------------------------------------


class JaxNativeTarget(_Native):
    """``jax.nn.dot_product_attention`` (sdpa cases; it takes fewer key/value heads
    than query heads as grouped-query attention) and ``flax.nnx.MultiHeadAttention`` (mha
    cases)."""

    name = "native-jax"

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp

    def fits(self, case: Case) -> bool | str:
        if case.op == "sdpa":
            if case.inputs["value"].shape[-1] != case.inputs["query"].shape[-1]:
                return "jax.nn.dot_product_attention needs the value width to equal the key width"
            return True
        p = case.params
        _, k, v = mha_inputs(case)
        if p["value_dim"] != p["key_dim"] or k.shape[-1] != v.shape[-1]:
            return "flax.nnx.MultiHeadAttention needs value_dim == key_dim and one key/value width"
        return True

    def _a(self, x: np.ndarray, dtype: str) -> Any:
        return self.jnp.asarray(np.asarray(x, np.float64)).astype(dtype)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        dtype = case.dtype
        keep = case_keep(case)
        if case.op == "sdpa":
            # jax lays out (batch, seq, heads, dim): rank 3 gets one head, rank 4 moves its
            # heads (axis 1) there
            rank = case.inputs["query"].ndim
            q, k, v = (self._a(case.inputs[n], dtype) for n in ("query", "key", "value"))
            q, k, v = (
                t[:, :, None, :] if rank == 3 else t.transpose(0, 2, 1, 3) for t in (q, k, v)
            )
            scale = case.params.get("scale")
            attend = self.jax.jit(
                lambda q, k, v, m: self.jax.nn.dot_product_attention(q, k, v, mask=m, scale=scale)
            )  # one compilation per case instead of one per operation
            out = to_numpy(attend(q, k, v, M.to_jax_mask(keep)))
            return {"output": out[:, :, 0, :] if rank == 3 else out.transpose(0, 2, 1, 3)}
        from flax import nnx

        p, w = case.params, contiguous_weights(case)
        q, k, v = mha_inputs(case)
        h, d = p["num_heads"], p["key_dim"]
        layer = nnx.MultiHeadAttention(
            num_heads=h,
            in_features=q.shape[-1],
            qkv_features=h * d,
            out_features=p["output_dim"],
            in_kv_features=k.shape[-1],
            use_bias="b_q" in w,
            dtype=dtype,
            param_dtype=dtype,
            decode=False,
            rngs=nnx.Rngs(0),
        )
        for n, module in (("q", layer.query), ("k", layer.key), ("v", layer.value)):
            module.kernel[...] = self._a(w[f"W_{n}"].reshape(-1, h, d), dtype)
            if f"b_{n}" in w:
                module.bias[...] = self._a(w[f"b_{n}"].reshape(h, d), dtype)
        layer.out.kernel[...] = self._a(w["W_o"].reshape(h, d, -1), dtype)
        if "b_o" in w:
            layer.out.bias[...] = self._a(w["b_o"], dtype)
        b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
        attend = nnx.jit(lambda m, q, k, v, mask: m(q, k, v, mask=mask, deterministic=True))
        out = attend(
            layer,
            self._a(q, dtype),
            self._a(k, dtype),
            self._a(v, dtype),
            M.to_jax_mask(keep, (b, h, tq, tk)),
        )
        return {"output": to_numpy(out)}


# --- Keras ------------------------------------------------------------------------------


class KerasNativeTarget(_Native):
    """``keras.layers.MultiHeadAttention`` on the running Keras backend (mha cases): the
    output of the default call (fused path) and the scores of a call with
    ``return_attention_scores=True`` (explicit path)."""

    ops = ("mha",)

    def __init__(self) -> None:
        import keras

        self.keras = keras
        self.name = f"native-keras-{keras.backend.backend()}"
        if keras.backend.backend() == "jax":  # compiles every call: float32 only, to stay short
            self.dtypes = ("float32",)

    def unchecked(self, case: Case) -> tuple[str, ...]:
        return ()

    def run(self, case: Case) -> dict[str, np.ndarray]:
        keras, dtype = self.keras, case.dtype
        p, w = case.params, contiguous_weights(case)
        q, k, v = mha_inputs(case)
        h, d, dv = p["num_heads"], p["key_dim"], p["value_dim"]
        layer = keras.layers.MultiHeadAttention(
            h, d, value_dim=dv, output_shape=p["output_dim"], use_bias="b_q" in w, dtype=dtype
        )

        def t(x):
            src = np.asarray(x, np.float64 if dtype == "float64" else np.float32)
            return keras.ops.convert_to_tensor(src, dtype=dtype)

        query, key, value = t(q), t(k), t(v)
        layer(query, value, key)  # builds the sublayers
        values = {
            "query/kernel": w["W_q"].reshape(-1, h, d),
            "key/kernel": w["W_k"].reshape(-1, h, d),
            "value/kernel": w["W_v"].reshape(-1, h, dv),
            "attention_output/kernel": w["W_o"].reshape(h, dv, -1),
        }
        if "b_q" in w:
            values.update(
                {
                    "query/bias": w["b_q"].reshape(h, d),
                    "key/bias": w["b_k"].reshape(h, d),
                    "value/bias": w["b_v"].reshape(h, dv),
                    "attention_output/bias": w["b_o"],
                }
            )
        for var in layer.weights:
            suffix = next(s for s in values if var.path.endswith(s))
            var.assign(t(values[suffix]))
        b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
        mask = M.to_keras_mask(case_keep(case), (b, h, tq, tk))  # (B, T, S), True = attend
        if keras.backend.backend() == "jax":  # one compilation per call, not per operation
            import jax

            variables = [v.value for v in layer.trainable_variables]
            fixed = [v.value for v in layer.non_trainable_variables]

            def call(variables, query, value, key, mask, scores):
                out, _ = layer.stateless_call(
                    variables,
                    fixed,
                    query,
                    value,
                    key,
                    attention_mask=mask,
                    return_attention_scores=scores,
                )
                return out

            call = jax.jit(call, static_argnums=5)
            out = call(variables, query, value, key, mask, False)
            _, scores = call(variables, query, value, key, mask, True)
        else:
            out = layer(query, value, key, attention_mask=mask)
            _, scores = layer(query, value, key, attention_mask=mask, return_attention_scores=True)
        return {"output": to_numpy(out), "weights": to_numpy(scores)}
