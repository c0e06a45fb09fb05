"""A mixture of experts' neutral weights: one kernel per expert (as checkpoints store
them) <-> the stacked kernels of `multiattn.layers.MixtureOfExperts` (exact copies)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from ..hf._tensors import Lazy

__all__ = ["stack_experts", "unstack_experts"]

_PARTS = ("gate", "up", "down")
_PER_EXPERT = re.compile(r"^.+/experts/\d+/(gate|up|down)/kernel$")


def stack_experts(weights: Mapping, num_experts: dict[str, int]) -> Mapping:
    """Neutral weights with each expert's kernels, ``<ffn>/experts/<i>/<part>/kernel``
    (``(d, f)`` for ``gate`` and ``up``, ``(f, d)`` for ``down``: the names a family's
    tensor table gives them), as the stacked kernels of a `MixtureOfExperts`,
    ``<ffn>/<part>_kernel`` ``(E, ...)``: exact copies, made as each is looked up
    (``weights`` may be lazy; one stacked kernel in memory at a time).

    ``num_experts`` maps each mixture's ``<ffn>`` prefix (``layer_0/ffn``, ...) to its
    ``E``; a missing expert kernel is refused naming it."""
    stacked = {f"{ffn}/{part}_kernel": (ffn, part) for ffn in num_experts for part in _PARTS}
    for name, (ffn, part) in stacked.items():
        for i in range(num_experts[ffn]):
            if f"{ffn}/experts/{i}/{part}/kernel" not in weights:
                raise ValueError(
                    f"MixtureOfExperts: `weights` has no '{ffn}/experts/{i}/{part}/kernel' "
                    f"(needed for '{name}')."
                )

    def make(name: str) -> np.ndarray:
        if name not in stacked:
            return weights[name]
        ffn, part = stacked[name]
        return np.stack([np.asarray(weights[f"{ffn}/experts/{i}/{part}/kernel"])
                         for i in range(num_experts[ffn])])  # fmt: skip

    kept = [k for k in weights if not _PER_EXPERT.match(k)]
    return Lazy(kept + list(stacked), make)


def unstack_experts(weights: dict, num_experts: dict[str, int]) -> dict:
    """The inverse of `stack_experts`: ``<ffn>/<part>_kernel`` ``(E, ...)`` -> the ``E``
    kernels ``<ffn>/experts/<i>/<part>/kernel`` (exact, contiguous copies)."""
    out = dict(weights)
    for ffn, e in num_experts.items():
        for part in _PARTS:
            kernel = np.asarray(out.pop(f"{ffn}/{part}_kernel"))
            for i in range(e):
                out[f"{ffn}/experts/{i}/{part}/kernel"] = np.ascontiguousarray(kernel[i])
    return out
