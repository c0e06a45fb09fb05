"""Shared by the tests that build transformers models: saving a redrawn model, and a
left-padded batch of two prompts."""

from __future__ import annotations

import numpy as np


def build(make, path):
    """``make()`` redrawn (`multiattn.conformance.families.redraw`), saved to ``path``
    with ``save_pretrained``; returned in float64 as the reference."""
    import torch
    from multiattn.conformance.families import redraw

    torch.manual_seed(0)
    model = redraw(make())
    model.save_pretrained(path)
    return model.double()


def left_padded_batch(vocab: int, length: int = 9, pads: int = 3):
    """Two prompts, the second left-padded with ``pads`` pads (id 0 under the mask)."""
    ids = np.random.default_rng(1).integers(1, vocab, (2, length))
    mask = np.ones((2, length), np.int64)
    mask[1, :pads] = 0
    ids[1, :pads] = 0
    return ids, mask
