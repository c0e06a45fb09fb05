"""The PyTorch (d2l) and TensorFlow document adapters as conformance targets."""

from __future__ import annotations

from typing import Any

import numpy as np

from .autodiff import to_numpy
from .fixtures import Case

D2L_OPS = ("doc_d2l_masked_softmax", "doc_d2l_additive", "doc_d2l_dot")
TF_OPS = ("doc_tf_sdpa", "doc_tf_mha", "doc_tf_encoder")


class TorchDocumentTarget:
    """`multiattn.backends.torch`: the d2l-style PyTorch document."""

    name = "adapter-torch"

    def __init__(self) -> None:
        import multiattn.backends.torch as adapter
        import torch

        self.torch, self.adapter = torch, adapter

    def supports(self, case: Case) -> bool | str:
        return True if case.op in D2L_OPS else "not a PyTorch-document case"

    def _t(self, array: np.ndarray, dtype: str, grad: bool = False) -> Any:
        t = self.torch.tensor(
            array, dtype=getattr(self.torch, dtype) if array.dtype.kind == "f" else None
        )
        return t.requires_grad_(True) if grad else t

    def run(self, case: Case) -> dict[str, np.ndarray]:
        torch, dtype = self.torch, case.dtype
        lens = self._t(case.inputs["valid_lens"], dtype)
        inputs = {
            k: self._t(v, dtype, grad=True) for k, v in case.inputs.items() if k != "valid_lens"
        }
        params: dict[str, Any] = {}
        module = None
        if case.op == "doc_d2l_masked_softmax":
            out = self.adapter.masked_softmax(inputs["x"], lens)
        else:
            q, k, v = inputs["queries"], inputs["keys"], inputs["values"]
            if case.op == "doc_d2l_additive":
                w = case.weights
                module = self.adapter.AdditiveAttention(
                    k.shape[-1], q.shape[-1], w["w_v"].shape[0], 0.0
                )
                module.to(getattr(torch, dtype))
                with torch.no_grad():  # nn.Linear weights are (out, in)
                    module.W_q.weight.copy_(torch.tensor(w["W_q"].T))
                    module.W_k.weight.copy_(torch.tensor(w["W_k"].T))
                    module.w_v.weight.copy_(torch.tensor(w["w_v"][None, :]))
                params = {
                    "W_q": module.W_q.weight,
                    "W_k": module.W_k.weight,
                    "w_v": module.w_v.weight,
                }
            else:
                module = self.adapter.DotProductAttention(0.0)
            module.eval()
            out = module(q, k, v, lens)
        acc = torch.float64 if dtype == "float64" else torch.float32
        loss = (out.to(acc) * torch.tensor(case.cotangent, dtype=acc)).sum()
        loss.backward()
        result = {"output": to_numpy(out)}
        if module is not None:
            result["weights"] = to_numpy(module.attention_weights)
        result.update({f"grad/input/{k}": to_numpy(t.grad) for k, t in inputs.items()})
        if params:
            result["grad/weight/W_q"] = to_numpy(params["W_q"].grad).T
            result["grad/weight/W_k"] = to_numpy(params["W_k"].grad).T
            result["grad/weight/w_v"] = to_numpy(params["w_v"].grad)[0]
        return result


class TensorFlowDocumentTarget:
    """`multiattn.backends.tensorflow`: the TensorFlow document."""

    name = "adapter-tensorflow"

    def __init__(self) -> None:
        import multiattn.backends.tensorflow as adapter
        import tensorflow as tf

        self.tf, self.adapter = tf, adapter

    def supports(self, case: Case) -> bool | str:
        return True if case.op in TF_OPS else "not a TensorFlow-document case"

    def run(self, case: Case) -> dict[str, np.ndarray]:
        tf, dtype, p = self.tf, case.dtype, case.params
        inputs = {k: tf.constant(v, dtype=dtype) for k, v in case.inputs.items() if k != "mask"}
        mask = tf.constant(case.inputs["mask"], dtype=dtype)
        layer, prefix = None, ""
        if case.op == "doc_tf_mha":
            layer = self.adapter.MultiHeadAttention(p["d_model"], p["num_heads"], dtype=dtype)
            layer(inputs["v"], inputs["k"], inputs["q"], mask)
        elif case.op == "doc_tf_encoder":
            layer = self.adapter.EncoderLayer(p["d_model"], p["num_heads"], p["dff"], dtype=dtype)
            layer(inputs["x"], False, mask)
            prefix = "mha_"
        names = {}
        if layer is not None:
            table = {
                f"{prefix}{n}/{kind}": f"{prefix}{n}_{kind}"
                for n in ("wq", "wk", "wv", "dense")
                for kind in ("kernel", "bias")
            }
            if case.op == "doc_tf_encoder":
                dense = [v for v in layer.ffn.trainable_variables]
                table.update(
                    {
                        dense[0].path: "ffn_w1",
                        dense[1].path: "ffn_b1",
                        dense[2].path: "ffn_w2",
                        dense[3].path: "ffn_b2",
                    }
                )
                table.update(
                    {
                        "layernorm1/gamma": "ln1_gamma",
                        "layernorm1/beta": "ln1_beta",
                        "layernorm2/gamma": "ln2_gamma",
                        "layernorm2/beta": "ln2_beta",
                    }
                )
            for var in layer.trainable_variables:
                key = next(
                    v
                    for k, v in table.items()
                    if var.path.endswith(k.replace("mha_", "mha/")) or var.path == k
                )
                var.assign(case.weights[key])
                names[key] = var
        with tf.GradientTape() as tape:
            for t in inputs.values():
                tape.watch(t)
            if case.op == "doc_tf_sdpa":
                out, weights = self.adapter.scaled_dot_product_attention(
                    inputs["q"], inputs["k"], inputs["v"], mask
                )
            elif case.op == "doc_tf_mha":
                out, weights = layer(inputs["v"], inputs["k"], inputs["q"], mask)
            else:
                out, weights = layer(inputs["x"], False, mask), None
            acc = tf.float64 if dtype == "float64" else tf.float32
            loss = tf.reduce_sum(tf.cast(out, acc) * tf.constant(case.cotangent, dtype=acc))
        sources = {
            **{f"grad/input/{k}": t for k, t in inputs.items()},
            **{f"grad/weight/{k}": v for k, v in names.items()},
        }
        grads = tape.gradient(loss, list(sources.values()))
        result = {"output": to_numpy(out)}
        if weights is not None:
            result["weights"] = to_numpy(weights)
        result.update({k: to_numpy(g) for k, g in zip(sources, grads)})
        return result
