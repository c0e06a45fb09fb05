"""``paddle.nn.MultiHeadAttention`` as an (informative) conformance target; its own module
so that paddle is imported before anything that could load TensorFlow."""

from __future__ import annotations

import numpy as np
import paddle  # first: importing paddle after TensorFlow crashes the interpreter

from multiattn.port import masks as M

from .autodiff import to_numpy
from .fixtures import Case
from .target_native import HALF, _Native, case_keep, contiguous_weights, mha_inputs, packed_mha_fits


class PaddleNativeTarget(_Native):
    """``paddle.nn.MultiHeadAttention(need_weights=True)`` on the mha cases, with a boolean
    ``attn_mask`` (True = keep)."""

    name = "native-paddle"
    ops = ("mha",)

    def fits(self, case: Case) -> bool | str:
        if case.dtype in HALF and paddle.device.get_device() == "cpu":
            return f"Paddle's CPU matmul has no {case.dtype} kernel"
        return packed_mha_fits(case)

    def unchecked(self, case: Case) -> tuple[str, ...]:
        return ()

    def run(self, case: Case) -> dict[str, np.ndarray]:
        dtype = case.dtype
        p, w = case.params, contiguous_weights(case)
        q, k, v = mha_inputs(case)
        h, e = p["num_heads"], p["num_heads"] * p["key_dim"]
        bias = "b_q" in w
        layer = paddle.nn.MultiHeadAttention(
            e,
            h,
            kdim=k.shape[-1],
            vdim=v.shape[-1],
            need_weights=True,
            bias_attr=None if bias else False,
        )
        layer.to(dtype=dtype)

        def t(x):
            return paddle.to_tensor(np.asarray(x, np.float64)).astype(dtype)

        for name, proj in (
            ("q", layer.q_proj),
            ("k", layer.k_proj),
            ("v", layer.v_proj),
            ("o", layer.out_proj),
        ):
            proj.weight.set_value(t(w[f"W_{name}"]))  # paddle's Linear weight is (in, out)
            if bias:
                proj.bias.set_value(t(w[f"b_{name}"]))
        b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
        mask = paddle.to_tensor(M.to_paddle_mask(case_keep(case), (b, h, tq, tk)))
        with paddle.no_grad():
            out, weights = layer(t(q), t(k), t(v), attn_mask=mask)
        return {"output": to_numpy(out), "weights": to_numpy(weights)}
