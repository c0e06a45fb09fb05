"""An example user target for ``multiattn conformance --target``.

It checks a hand-written NumPy masked softmax (yours would wrap your own framework code)
against the shared fixtures:

    PYTHONPATH=docs/examples multiattn conformance --target my_softmax_target:MySoftmax \
        --cases 'masked_softmax_*'
"""

from __future__ import annotations

import numpy as np


class MySoftmax:
    name = "my-numpy-softmax"

    def supports(self, case):
        if case.op != "masked_softmax":
            return "only masked_softmax is implemented here"
        return True

    def run(self, case):
        x = case.inputs["x"]
        keep = np.ones(x.shape, dtype=bool)
        if "valid_lens" in case.inputs:
            lens = case.inputs["valid_lens"]
            lens = lens[:, None] if lens.ndim == 1 else lens
            keep &= np.arange(x.shape[-1]) < lens[..., None]
        if "mask" in case.inputs:
            keep &= case.inputs["mask"]
        z = np.where(keep, x, -np.inf)
        z = z - np.where(keep.any(-1, keepdims=True), z.max(-1, keepdims=True), 0.0)
        e = np.where(keep, np.exp(z), 0.0)
        total = e.sum(-1, keepdims=True)
        return {"output": np.divide(e, total, out=np.zeros_like(e), where=total > 0)}
