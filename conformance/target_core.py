"""The core (`multiattn.ops` and `multiattn.layers`) on the running Keras backend."""

from __future__ import annotations

from typing import Any

import numpy as np

from multiattn.namespaces.keras import get_ops

from .autodiff import value_and_grad
from .cases import core_ops
from .fixtures import Case

CORE_OPS = core_ops()  # every op with a core function (cases.OPERATIONS)


def _masks(case: Case) -> dict:
    return {k: case.inputs[k] for k in ("valid_lens", "mask") if k in case.inputs}


class _NumpyZeros:
    """A Keras initializer that makes NumPy zeros: converting them compiles nothing."""

    def __call__(self, shape: tuple, dtype: Any = None) -> np.ndarray:
        import keras

        return np.zeros(shape, keras.backend.standardize_dtype(dtype))

    def get_config(self) -> dict:
        return {}

    @classmethod
    def from_config(cls, config: dict) -> _NumpyZeros:
        return cls(**config)


class _FixtureWeightLayers:
    """`multiattn.layers` whose attention layers and blocks start with NumPy zeros as
    kernels and biases. Every layer case calls them with the fixture's weights, so their
    own are never used; a Keras initializer on jax compiles a program per weight shape
    (0.2 to 0.45 s for a random one on a slow CPU), which was a quarter of the keras-jax
    target's time on the attention-layer cases."""

    INITIALIZED = ("MultiHeadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer")

    def __getattr__(self, name: str) -> Any:
        from multiattn import layers

        cls = getattr(layers, name)
        if name not in self.INITIALIZED:
            return cls

        def make(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("kernel_initializer", _NumpyZeros())
            kwargs.setdefault("bias_initializer", _NumpyZeros())
            return cls(*args, **kwargs)

        return make


class CoreTarget:
    """Runs every core case through multiattn under the active Keras backend."""

    def __init__(self) -> None:
        import keras

        self.keras = keras
        self.backend = keras.backend.backend()
        self.name = f"keras-{self.backend}"

    def supports(self, case: Case) -> bool | str:
        if case.op not in CORE_OPS:
            return "not a core op"
        if self.backend == "numpy" and case.dtype == "float64":
            return "Keras' numpy backend computes float64 arithmetic in float32"
        return True

    # -- helpers --------------------------------------------------------------------------

    @staticmethod
    def layers() -> Any:
        """The layers the layer cases build: `multiattn.layers` (Keras), whose kernels
        and biases start as NumPy zeros (`_FixtureWeightLayers`)."""
        return _FixtureWeightLayers()

    def tensor(self, array: np.ndarray, dtype: str) -> Any:
        if array.dtype.kind != "f":
            return array
        source = array if dtype == "float64" else array.astype(np.float32)
        return self.keras.ops.convert_to_tensor(source, dtype=dtype)

    def _heads(self, w: Any, h: int, layout: str) -> Any:
        ops = get_ops(w)
        e, width = w.shape
        if layout == "contiguous":
            return ops.reshape(w, (e, h, width // h))
        return ops.transpose(ops.reshape(w, (e, width // h, h)), (0, 2, 1))

    def _bias(self, b: Any, h: int, layout: str) -> Any:
        ops = get_ops(b)
        if layout == "contiguous":
            return ops.reshape(b, (h, -1))
        return ops.transpose(ops.reshape(b, (-1, h)), (1, 0))

    def _mha_values(self, ws: dict, params: dict, layout: str) -> dict:
        h = params["num_heads"]
        hkv = params.get("num_key_value_heads") or h
        out = {
            "query/kernel": self._heads(ws["W_q"], h, layout),
            "key/kernel": self._heads(ws["W_k"], hkv, layout),
            "value/kernel": self._heads(ws["W_v"], hkv, layout),
            "attention_output/kernel": get_ops(ws["W_o"]).reshape(
                ws["W_o"], (h, -1, ws["W_o"].shape[-1])
            ),
        }
        if "b_q" in ws:
            out.update(
                {
                    "query/bias": self._bias(ws["b_q"], h, layout),
                    "key/bias": self._bias(ws["b_k"], hkv, layout),
                    "value/bias": self._bias(ws["b_v"], hkv, layout),
                    "attention_output/bias": ws["b_o"],
                }
            )
        return out

    @staticmethod
    def _mha_options(p: dict) -> dict:
        """The grouped-query and rotary arguments of `MultiHeadAttention` in ``p``."""
        return {
            "num_key_value_heads": p.get("num_key_value_heads"),
            "rotary_max_length": p.get("rotary_max_length"),
            "rotary_base": p.get("rotary_base", 10000.0),
        }

    def _decoder_layer(self, case: Case) -> Any:
        layers = self.layers()

        p = case.params
        layer = layers.TransformerDecoderLayer(
            p["d_model"],
            p["num_heads"],
            p["dff"],
            norm_first=p["norm_first"],
            epsilon=p["epsilon"],
            activation=p["activation"],
            num_key_value_heads=p.get("num_key_value_heads"),
            rotary_max_length=p.get("rotary_max_length"),
            dtype=case.dtype,
        )
        layer.build(case.inputs["x"].shape, case.inputs["context"].shape)
        return layer

    def _decoder_values(self, layer: Any, ws: dict, p: dict) -> list:
        by_suffix = {}
        for role in ("self", "cross"):
            flat = {n: ws[f"{role}_{n}"] for n in ("W_q", "W_k", "W_v", "W_o")}
            flat.update({n: ws[f"{role}_{n}"] for n in ("b_q", "b_k", "b_v", "b_o")})
            by_suffix.update(
                {
                    f"{role}_attention/{k}": t
                    for k, t in self._mha_values(flat, p, "contiguous").items()
                }
            )
        by_suffix.update(
            {
                "ffn_1/kernel": ws["ffn_w1"],
                "ffn_1/bias": ws["ffn_b1"],
                "ffn_2/kernel": ws["ffn_w2"],
                "ffn_2/bias": ws["ffn_b2"],
            }
        )
        for i in (1, 2, 3):
            by_suffix[f"norm_{i}/gamma"] = ws[f"norm{i}_gamma"]
            by_suffix[f"norm_{i}/beta"] = ws[f"norm{i}_beta"]
        return self._ordered(layer, by_suffix)

    def _state(self, layer: Any, values: list) -> Any:
        """A scope in which ``layer``'s trainable variables read ``values`` (differentiable)."""
        mapping = list(zip(layer.trainable_variables, values))
        mapping += [(v, v.value) for v in layer.non_trainable_variables]
        return self.keras.StatelessScope(state_mapping=mapping)

    @staticmethod
    def _ordered(layer: Any, by_suffix: dict) -> list:
        values = []
        for v in layer.trainable_variables:
            key = next(k for k in by_suffix if v.path.endswith(k))
            values.append(by_suffix[key])
        return values

    # -- the ops --------------------------------------------------------------------------

    def _forward(self, case: Case) -> Any:
        """A function of the float arrays returning the outputs of ``case.op``: the method
        ``_forward_<op>``, one per op with a core function in `cases.OPERATIONS`."""
        forward = getattr(self, f"_forward_{case.op}", None)
        if forward is None:
            raise ValueError(f"unsupported op {case.op!r}")
        return forward(case)

    def _forward_masked_softmax(self, case: Case) -> Any:
        from multiattn import ops

        masks = _masks(case)
        return lambda a: {"output": ops.masked_softmax(a["input/x"], **masks)}

    def _forward_dot_scores(self, case: Case) -> Any:
        from multiattn import ops

        return lambda a: {"output": ops.dot_scores(a["input/query"], a["input/key"])}

    def _forward_scaled_dot_scores(self, case: Case) -> Any:
        from multiattn import ops

        p = case.params
        return lambda a: {
            "output": ops.scaled_dot_scores(a["input/query"], a["input/key"], p.get("scale"))
        }

    def _forward_additive_scores(self, case: Case) -> Any:
        from multiattn import ops

        return lambda a: {
            "output": ops.additive_scores(
                a["input/query"],
                a["input/key"],
                a["weight/w_q"],
                a["weight/w_k"],
                a["weight/w_v"],
            )
        }

    def _forward_general_scores(self, case: Case) -> Any:
        from multiattn import ops

        return lambda a: {
            "output": ops.general_scores(a["input/query"], a["input/key"], a["weight/w"])
        }

    def _forward_sdpa(self, case: Case) -> Any:
        from multiattn import ops

        p = case.params
        masks = _masks(case)

        def sdpa(a):
            args = (a["input/query"], a["input/key"], a["input/value"])
            kw = dict(causal=p.get("causal", False), scale=p.get("scale"), **masks)
            blocks = p.get("block_size")
            fused = ops.scaled_dot_product_attention(*args, block_size=blocks, **kw)
            _, weights = ops.scaled_dot_product_attention(*args, return_weights=True, **kw)
            return {"output": fused, "weights": weights}

        return sdpa

    def _forward_positional(self, case: Case) -> Any:
        layers = self.layers()

        p = case.params
        dtype = case.dtype
        layer = layers.PositionalEncoding(p["max_length"], layout=p["layout"], dtype=dtype)
        return lambda a: {"output": layer(a["input/x"])}

    def _forward_mha(self, case: Case) -> Any:
        layers = self.layers()

        p = case.params
        dtype = case.dtype
        masks = _masks(case)
        q = case.inputs["query"]
        v = q if p.get("self") else case.inputs["value"]
        k = v if p.get("self") else case.inputs.get("key", v)
        layer = layers.MultiHeadAttention(
            p["num_heads"],
            p["key_dim"],
            value_dim=p["value_dim"],
            output_dim=p["output_dim"],
            use_bias="b_q" in case.weights,
            dtype=dtype,
            **self._mha_options(p),
        )
        layer.build(q.shape, v.shape, k.shape)

        def mha(a):
            ws = {name[7:]: t for name, t in a.items() if name.startswith("weight/")}
            values = self._ordered(layer, self._mha_values(ws, p, p["head_layout"]))
            nt = [x.value for x in layer.non_trainable_variables]
            query = a["input/query"]
            value = query if p.get("self") else a["input/value"]
            key = value if p.get("self") else a.get("input/key", value)
            kw = dict(causal=p.get("causal", False), **masks)
            fused, _ = layer.stateless_call(values, nt, query, value, key, **kw)
            (_, weights), _ = layer.stateless_call(
                values, nt, query, value, key, return_weights=True, **kw
            )
            return {"output": fused, "weights": weights}

        return mha

    def _forward_encoder(self, case: Case) -> Any:
        layers = self.layers()

        p = case.params
        dtype = case.dtype
        masks = _masks(case)
        x = case.inputs["x"]
        layer = layers.TransformerEncoderLayer(
            p["d_model"],
            p["num_heads"],
            p["dff"],
            norm_first=p["norm_first"],
            epsilon=p["epsilon"],
            activation=p["activation"],
            dtype=dtype,
        )
        layer.build(x.shape)

        def encoder(a):
            ws = {name[7:]: t for name, t in a.items() if name.startswith("weight/")}
            by_suffix = {
                f"attention/{k}": t for k, t in self._mha_values(ws, p, "contiguous").items()
            }
            by_suffix.update(
                {
                    "ffn_1/kernel": ws["ffn_w1"],
                    "ffn_1/bias": ws["ffn_b1"],
                    "ffn_2/kernel": ws["ffn_w2"],
                    "ffn_2/bias": ws["ffn_b2"],
                    "norm_1/gamma": ws["norm1_gamma"],
                    "norm_1/beta": ws["norm1_beta"],
                    "norm_2/gamma": ws["norm2_gamma"],
                    "norm_2/beta": ws["norm2_beta"],
                }
            )
            nt = [x.value for x in layer.non_trainable_variables]
            out, _ = layer.stateless_call(
                self._ordered(layer, by_suffix), nt, a["input/x"], **masks
            )
            return {"output": out}

        return encoder

    def _forward_rms_norm(self, case: Case) -> Any:
        from multiattn import ops

        p = case.params
        return lambda a: {
            "output": ops.rms_norm(a["input/x"], a.get("weight/scale"), epsilon=p["epsilon"])
        }

    def _forward_rope(self, case: Case) -> Any:
        from multiattn import ops

        p = case.params
        return lambda a: {
            "output": ops.rotary_embedding(a["input/x"], offset=p["offset"], base=p["base"])
        }

    def _forward_mha_decode(self, case: Case) -> Any:
        layers = self.layers()

        p = case.params
        dtype = case.dtype
        q = case.inputs["query"]
        layer = layers.MultiHeadAttention(
            p["num_heads"],
            p["key_dim"],
            value_dim=p["value_dim"],
            output_dim=p["output_dim"],
            dtype=dtype,
            **self._mha_options(p),
        )
        layer.build(q.shape, q.shape)

        def mha_decode(a):
            ws = {name[7:]: t for name, t in a.items() if name.startswith("weight/")}
            values = self._ordered(layer, self._mha_values(ws, p, "contiguous"))
            query = a["input/query"]
            outs = []
            with self._state(layer, values):
                cache = layer.init_cache(q.shape[0], p["max_length"], dtype)
                for t in range(q.shape[1]):  # one token at a time through the cache
                    out, cache = layer(query[:, t : t + 1], cache=cache, cache_index=t)
                    outs.append(out)
            return {"output": get_ops(*outs).concatenate(outs, axis=1)}

        return mha_decode

    def _forward_decoder(self, case: Case) -> Any:
        p = case.params
        dtype = case.dtype
        layer = self._decoder_layer(case)
        lens = case.inputs["context_valid_lens"]
        steps = case.inputs["x"].shape[1]

        def decoder(a):
            ws = {name[7:]: t for name, t in a.items() if name.startswith("weight/")}
            values = self._decoder_values(layer, ws, p)
            x, context = a["input/x"], a["input/context"]
            with self._state(layer, values):
                if case.op == "decoder":
                    return {"output": layer(x, context, context_valid_lens=lens)}
                # the context projected once, then token by token through the cache
                kv = layer.precompute_context(context)
                cache = layer.init_cache(x.shape[0], p["max_length"], dtype)
                outs = []
                for t in range(steps):
                    out, cache = layer(
                        x[:, t : t + 1],
                        context_key_value=kv,
                        context_valid_lens=lens,
                        cache=cache,
                        cache_index=t,
                    )
                    outs.append(out)
            return {"output": get_ops(*outs).concatenate(outs, axis=1)}

        return decoder

    _forward_decoder_decode = _forward_decoder

    framework_name = ""

    @property
    def framework(self) -> str:
        """The autodiff to use (``"none"``: outputs only)."""
        return self.framework_name or (self.backend if self.backend != "numpy" else "none")

    def run(self, case: Case) -> dict[str, np.ndarray]:
        forward = self._forward(case)
        args = {
            f"input/{k}": self.tensor(v, case.dtype)
            for k, v in case.inputs.items()
            if v.dtype.kind == "f"
        }
        args.update({f"weight/{k}": self.tensor(v, case.dtype) for k, v in case.weights.items()})
        acc = "float64" if case.dtype == "float64" else "float32"
        ops = get_ops(*args.values())
        cot = ops.convert_to_tensor(case.cotangent, dtype=acc)

        def fn(a):
            outputs = forward(a)
            loss = ops.sum(ops.cast(outputs["output"], acc) * cot)
            return loss, outputs

        outputs, grads = value_and_grad(self.framework, fn, args)
        result = dict(outputs)
        result.update({f"grad/{k}": g for k, g in grads.items()})
        return result
