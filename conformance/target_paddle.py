"""Paddle targets: the core's functions on Paddle tensors, and the document-000 adapter."""

from __future__ import annotations

import math
from typing import Any

import multiattn.backends.paddle as mp  # first: paddle must load before anything imports TF
import numpy as np

from .autodiff import to_numpy
from .cases import core_ops
from .fixtures import Case
from .target_core import CoreTarget

PADDLE_CORE_OPS = core_ops("ops.")  # the core functions
PADDLE_LAYER_OPS = core_ops("layers.")  # the layers (multiattn.paddle.layers)


def _tensor(array: np.ndarray, dtype: str) -> Any:
    import paddle

    if array.dtype.kind != "f":
        return paddle.to_tensor(array)
    return paddle.to_tensor(array.astype(np.float64)).astype(dtype)


class PaddleCoreTarget(CoreTarget):
    """`multiattn.ops` functions run on Paddle tensors through the Paddle ops namespace."""

    framework_name = "paddle"

    def __init__(self) -> None:
        super().__init__()
        self.name = "paddle"

    def supports(self, case: Case) -> bool | str:
        if case.op not in PADDLE_CORE_OPS:
            return "a layer case (the target `paddle-layers` runs the layers)"
        return True

    def tensor(self, array: np.ndarray, dtype: str) -> Any:
        return _tensor(array, dtype)


class _InferenceLayers:
    """`multiattn.paddle.layers` whose layers are made in eval mode: a Paddle layer starts
    in training mode (dropout on), the Keras targets call with ``training=None``."""

    def __getattr__(self, name: str) -> Any:
        from multiattn.paddle import layers

        cls = getattr(layers, name)

        def make(*args: Any, **kwargs: Any) -> Any:
            layer = cls(*args, **kwargs)
            layer.eval()
            return layer

        return make


class PaddleLayerTarget(PaddleCoreTarget):
    """The layer cases run by the Paddle twins of the layers (`multiattn.paddle.layers`),
    with Paddle parameters and Paddle autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "paddle-layers"

    def supports(self, case: Case) -> bool | str:
        import paddle

        if case.op not in PADDLE_LAYER_OPS:
            return "not a layer case (the target `paddle` runs the core functions)"
        if case.dtype in ("float16", "bfloat16") and paddle.device.get_device() == "cpu":
            return f"Paddle's CPU kernels have no {case.dtype} addition (the layers' biases)"
        return True

    @staticmethod
    def layers() -> Any:
        return _InferenceLayers()

    def _state(self, layer: Any, values: list) -> Any:
        return layer.stateless_scope(values)


class PaddleDocumentTarget:
    """The PaddlePaddle document's `DotProductAttention` and `MultiHeadAttention`."""

    name = "adapter-paddle"

    def supports(self, case: Case) -> bool | str:
        return (
            True
            if case.op in ("doc_paddle_dot", "doc_paddle_mha")
            else "not a PaddlePaddle-document case"
        )

    def run(self, case: Case) -> dict[str, np.ndarray]:
        import paddle

        p = case.params
        if case.op == "doc_paddle_dot":
            layer = mp.DotProductAttention(
                p["query_size"], p["query_vec_size"], p["hidden_vec_size"]
            )
        else:
            layer = mp.MultiHeadAttention(
                p["query_size"],
                p["query_vec_size"],
                p["hidden_vec_size"],
                p["output_vec_size"],
                p["head_num"],
            )
        layer.to(dtype=case.dtype)
        for name, param in layer.named_parameters():  # "W_q.weight" <- W_q, "W_q.bias" <- b_q
            sub, kind = name.split(".")
            key = sub if kind == "weight" else "b_" + sub[2:]
            param.set_value(_tensor(case.weights[key], case.dtype))
        inputs = {}
        for key in ("queries", "keys", "values"):
            t = _tensor(case.inputs[key], case.dtype)
            t.stop_gradient = False
            inputs[key] = t
        out = layer(inputs["queries"], inputs["keys"], inputs["values"], case.inputs["valid_lens"])
        acc = "float64" if case.dtype == "float64" else "float32"
        loss = (out.astype(acc) * paddle.to_tensor(case.cotangent).astype(acc)).sum()
        loss.backward()
        result = {"output": to_numpy(out)}
        result.update({f"grad/input/{k}": to_numpy(t.grad) for k, t in inputs.items()})
        for name, param in layer.named_parameters():
            sub, kind = name.split(".")
            key = sub if kind == "weight" else "b_" + sub[2:]
            result[f"grad/weight/{key}"] = to_numpy(param.grad)
        return result


def document_scale(hidden: int) -> float:
    return 1.0 / math.sqrt(hidden)
