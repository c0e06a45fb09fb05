"""A float64 NumPy oracle of `multiattn.layers.MixtureOfExperts`, written from the
routing formulas with plain loops (token by token, expert by expert), independently of
the layer's stacked, dense computation."""

from __future__ import annotations

import math

import numpy as np


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def moe_oracle(x, router, gate, up, down, k, norm_topk_prob=True, shared=None):
    """``y`` ``(..., d)`` float64 for ``x`` ``(..., d)``: ``router`` ``(d, E)``, expert
    kernels ``gate``/``up`` ``(E, d, f)``, ``down`` ``(E, f, d)``; ``shared``: None or
    ``(gate (d, s), up (d, s), down (s, d), shared_gate (d, 1) or None)``. Each token
    takes the ``k`` largest softmax probabilities (ties: the lower expert index)."""
    x = np.asarray(x, np.float64)
    router, gate, up, down = (np.asarray(a, np.float64) for a in (router, gate, up, down))
    flat = x.reshape(-1, x.shape[-1])
    out = np.zeros_like(flat)
    for t, token in enumerate(flat):
        logits = [sum(token[i] * router[i, e] for i in range(len(token)))
                  for e in range(router.shape[1])]  # fmt: skip
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        probs = [v / sum(exps) for v in exps]
        order = sorted(range(len(probs)), key=lambda e: (-probs[e], e))[:k]
        weights = {e: probs[e] for e in order}
        if norm_topk_prob:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        for e, w in weights.items():
            hidden = _silu(token @ gate[e]) * (token @ up[e])
            out[t] += w * (hidden @ down[e])
        if shared is not None:
            s_gate, s_up, s_down, s_g = (None if a is None else np.asarray(a, np.float64)
                                         for a in shared)  # fmt: skip
            value = (_silu(token @ s_gate) * (token @ s_up)) @ s_down
            if s_g is not None:
                value = value / (1.0 + math.exp(-float(token @ s_g[:, 0])))
            out[t] += value
    return out.reshape(x.shape)
