"""Beam search (``generate(num_beams=k)``, `multiattn.decoding.beams`) against
transformers' ``generate(num_beams=k, do_sample=False)``.

Tiny random transformers models (Llama, GPT-2 and T5; hidden 32, 2 layers, vocabulary
64) are built and loaded once per module; for 2 and 3 beams, length penalties 1.0, 2.0
and 0.5, ``early_stopping`` False, True and ``"never"``, no end id, one or two (ids that
transformers' own beams emit, so that some hypotheses end early) and 1 to 3 returned
sequences, the tokens of a padded batch of two must be transformers' exactly, through
the default strategy of the backend and the other Python loops it runs; the compiled
loop refuses beam search by name, and so do the checks of the beam arguments.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _support import BACKEND

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _beam_cases as cases  # noqa: E402
from _hf_models import build  # noqa: E402

from multiattn.decoding import STRATEGIES  # noqa: E402
from multiattn.decoding.beams import BeamSearch, make_beam_search  # noqa: E402
from multiattn.hf.pretrained import from_pretrained  # noqa: E402

DTYPE = "float32" if BACKEND == "numpy" else "float64"
#: The Python loops this backend runs besides its default (the compiled loop refuses).
LOOPS = [n for n, c in STRATEGIES.items()
         if n != "compiled" and (c.backends is None or BACKEND in c.backends)]  # fmt: skip
#: Which settings run per model (all for Llama and T5, one for GPT-2).
RUN = {"llama": cases.SETTINGS, "t5": cases.SETTINGS[:3], "gpt2": cases.SETTINGS[1:2]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``case -> (transformers model in float64, multiattn model in DTYPE)``."""
    out = {}
    for case, make in cases.makers(transformers).items():
        path = tmp_path_factory.mktemp("beams") / case
        out[case] = (build(make, path), from_pretrained(path, dtype=DTYPE))
    return out


@pytest.mark.parametrize("case", ["llama", "t5", "gpt2"])
def test_beam_search_matches_transformers(models, case):
    hf, model = models[case]
    ids, mask = cases.prompts(case)
    start = 1 if case == "t5" else ids.shape[1]  # the first new column
    ends = cases.end_ids(torch, hf, ids, mask, start)
    fired = []
    for setting in RUN[case]:
        args = cases.options(setting, ends)
        want = cases.hf_generate(torch, hf, ids, mask, **args)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=cases.NEW, **args)
        assert got.dtype == np.int64 and got.shape[0] == 2 * args["num_return_sequences"]
        np.testing.assert_array_equal(got, want, err_msg=f"{case} {args}")
        fired.append(cases.ended_early(want, args["eos_token_id"], start))
    if case != "gpt2":
        assert any(fired), "no end id fired before the last column"
    # the other Python loops give the default's tokens; the compiled loop refuses by name
    args = cases.options(RUN[case][-1 if case == "gpt2" else 0], ends)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=cases.NEW, **args)
    for name in LOOPS:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=cases.NEW, **args,
                             strategy=name)  # fmt: skip
        np.testing.assert_array_equal(got, want, err_msg=name)
    if BACKEND in ("jax", "tensorflow") and case == "llama":
        with pytest.raises(ValueError, match=r"`strategy`='compiled'.*num_beams"):
            model.generate(ids, attention_mask=mask, **args, strategy="compiled")


def test_beam_caches_are_checked_against_memory(models, monkeypatch):
    """The caches of ``batch * num_beams`` rows are refused before anything is allocated
    when they would not fit: memory for one beam's caches and not for three."""
    from multiattn.decoding import generation

    model = models["llama"][1]
    ids, mask = cases.prompts("llama")
    block = model.layer.config.block
    one = 2 * block.num_key_value_heads * block.key_dim * 2 * (9 + 4) * model.layer.num_layers
    itemsize = np.dtype(DTYPE).itemsize
    monkeypatch.setattr(generation, "available_memory", lambda: one * itemsize * 2)
    model.generate(ids, attention_mask=mask, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"key/value caches.*num_beams"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3)


def test_beam_arguments_are_refused_by_name(models):
    model = models["llama"][1]
    ids, mask = cases.prompts("llama")

    def generate(**options):
        return model.generate(ids, attention_mask=mask, max_new_tokens=2, **options)

    refused = [
        ({"num_beams": 2, "do_sample": True}, ValueError, "do_sample.*num_beams"),
        ({"num_beams": 0}, ValueError, "num_beams"),
        ({"num_beams": 2.0}, TypeError, "num_beams"),
        ({"num_beams": True}, TypeError, "num_beams"),
        ({"num_beams": 2, "num_return_sequences": 3}, ValueError, "num_return_sequences"),
        ({"num_beams": 2, "num_return_sequences": 0}, ValueError, "num_return_sequences"),
        ({"num_beams": 2, "length_penalty": float("nan")}, ValueError, "length_penalty"),
        ({"num_beams": 2, "length_penalty": "1"}, TypeError, "length_penalty"),
        ({"num_beams": 2, "early_stopping": "always"}, ValueError, "early_stopping"),
        ({"num_beams": 2, "early_stopping": 1}, TypeError, "early_stopping"),
        ({"length_penalty": 2.0}, ValueError, "length_penalty.*num_beams > 1"),
        ({"early_stopping": True}, ValueError, "early_stopping.*num_beams > 1"),
        ({"num_return_sequences": 2}, ValueError, "num_return_sequences.*num_beams > 1"),
    ]
    for options, error, match in refused:
        with pytest.raises(error, match=match):
            generate(**options)
    assert make_beam_search(1, 1.0, False, 1, True) is None  # num_beams=1: no beams
    beams = make_beam_search(3, 0.5, "never", 2, False)
    assert isinstance(beams, BeamSearch) and not beams.in_graph
    assert repr(beams) == ("BeamSearch(num_beams=3, length_penalty=0.5, "
                           "early_stopping='never', num_return_sequences=2)")  # fmt: skip
    with pytest.raises(ValueError, match="num_beams"):
        BeamSearch(1)
