"""Decoder-only language models (`multiattn.models.causal_lm`) against transformers.

Tiny random transformers models (GPT-2, Llama with and without ``rope_scaling``, Qwen2,
Mistral with a sliding window) are built offline from a config, their parameters redrawn at
a scale where the logits are well separated, saved with ``save_pretrained``, loaded with
`from_pretrained` and compared with transformers run in float64: logits of a left-padded
batch, greedy ``generate`` token for token, sampling filters, and ``save_pretrained``
read back by transformers.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import keras
import numpy as np
import pytest
from _support import BACKEND, assert_close, rel_err, to_np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_models import build, left_padded_batch  # noqa: E402

from multiattn.decoding import STRATEGIES, CompiledLoop, CompiledStepLoop, Greedy  # noqa: E402
from multiattn.decoding.strategies import kept_functions  # noqa: E402
from multiattn.hf.pretrained import PretrainedCausalLM, from_pretrained  # noqa: E402

DTYPES = ("float32",) if BACKEND == "numpy" else ("float32", "float64")
VOCAB, CONTEXT = 64, 40
LLAMA_SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
               "max_position_embeddings": CONTEXT}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # fmt: skip
CASES = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                n_positions=CONTEXT)),
    "gpt2-untied": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                n_positions=CONTEXT, tie_word_embeddings=False)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_SIZES)),
    "llama-tied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**LLAMA_SIZES, tie_word_embeddings=True)),
    "llama-linear": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **LLAMA_SIZES, rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama3": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**LLAMA_SIZES, rope_scaling=LLAMA3)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA_SIZES)),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**LLAMA_SIZES, sliding_window=5)),
}  # fmt: skip
# Max relative error of the logits (max |diff| / max |want|) against transformers in
# float64. transformers computes the rotary angles in float32 even in a float64 model, so
# the rotary families agree in float64 only to about 1e-6 (GPT-2 to about 1e-15).
TOL = {"float32": 1e-5, "float64": 1e-12, "float64-rotary": 1e-6}
#: The decoding strategies this backend runs (`multiattn.decoding.STRATEGIES`).
RUNNABLE = [n for n, cls in STRATEGIES.items() if cls.backends is None or BACKEND in cls.backends]
#: The Python loop over the backend's own step: XLA's on jax and TensorFlow, the recorded
#: one on torch, the eager one elsewhere.
PYTHON_LOOP = {"jax": "compiled_step", "tensorflow": "compiled_step", "torch": "traced"}.get(
    BACKEND, "eager"
)


def _build(case: str, path):
    return build(CASES[case], path)


def _batch(length: int = 9, pads: int = 3):
    return left_padded_batch(VOCAB, length, pads)


def _hf_logits(model, ids, mask):
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))  # fmt: skip
    return out.logits.numpy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case, dtype):
    hf = _build(case, tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype=dtype)
    assert isinstance(model, PretrainedCausalLM) and model.dtype == dtype
    ids, mask = _batch()
    out = model(input_ids=ids, attention_mask=mask)
    assert keras.backend.standardize_dtype(out["logits"].dtype) == dtype
    assert tuple(out["last_hidden_state"].shape) == (2, 9, 32)
    got, want = to_np(out["logits"]), _hf_logits(hf, ids, mask)
    real = mask.astype(bool)  # pad positions carry no meaning in either library
    key = dtype + ("-rotary" if dtype == "float64" and not case.startswith("gpt2") else "")
    assert rel_err(got[real], want[real]) <= TOL[key], case


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generate_matches_transformers(tmp_path, case):
    hf = _build(case, tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype=DTYPES[-1])
    ids, mask = _batch()
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                           do_sample=False, max_new_tokens=20, pad_token_id=0,
                           eos_token_id=None).numpy()  # fmt: skip
    got = model.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
    assert got.dtype == np.int64 and got.shape == (2, 29)
    np.testing.assert_array_equal(got, want)


def test_generate_eos_then_pad_like_transformers(tmp_path):
    hf = _build("llama", tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype=DTYPES[-1])
    ids, mask = _batch()
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=12)
    eos = int(greedy[0, 9 + 2])  # the third token of row 0 becomes the end
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                           do_sample=False, max_new_tokens=12, pad_token_id=7,
                           eos_token_id=eos).numpy()  # fmt: skip
    got = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos,
                         pad_token_id=7)  # fmt: skip
    np.testing.assert_array_equal(got, want)
    assert (got[0, 12:] == 7).all()


def _hf_top(hf, seq, mask, new):
    """transformers' float64 next-token probabilities for each generated position."""
    full = np.concatenate([mask, np.ones((2, new), np.int64)], axis=1)
    logits = _hf_logits(hf, seq, full)[:, -new - 1 : -1]
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"top_p": 0.5}, {"top_k": 5, "top_p": 0.7}])
def test_sampling_is_seeded_and_filtered(tmp_path, filters):
    hf = _build("qwen2", tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype=DTYPES[-1])
    ids, mask = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 15, "do_sample": True,
            "temperature": 1.0, **filters}  # fmt: skip
    first = model.generate(ids, seed=3, **args)
    np.testing.assert_array_equal(first, model.generate(ids, seed=3, **args))
    probs = _hf_top(hf, first, mask, 15)
    new = first[:, 9:]
    order = np.argsort(-probs, axis=-1)
    rank = np.argmax(order == new[..., None], axis=-1)
    if "top_k" in filters:
        assert (rank < filters["top_k"]).all()
    if "top_p" in filters:
        ranked = np.take_along_axis(probs, order, axis=-1)
        before = np.take_along_axis(np.cumsum(ranked, -1) - ranked, rank[..., None], -1)
        assert (before[..., 0] < filters["top_p"] + 1e-9).all()
    others = [model.generate(ids, seed=s, **args) for s in (4, 5, 6)]
    assert any(not np.array_equal(o, first) for o in others)


@pytest.mark.parametrize("case", ["gpt2", "gpt2-untied", "llama-tied", "mistral", "qwen2"])
def test_save_pretrained_round_trip(tmp_path, case):
    hf = _build(case, tmp_path / "m").float()
    model = from_pretrained(tmp_path / "m")
    model.save_pretrained(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    mine = model.state_dict()
    for name, value in mine.items():
        np.testing.assert_array_equal(value, want[name].numpy(), err_msg=name)


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("case", "changes", "match"),
    [
        ("llama", {"made_up_option": 1}, "made_up_option"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ("gpt2", {"activation_function": "relu"}, "activation_function"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse"),
        ("mistral", {"sliding_window": 0}, "sliding_window"),
        ("mistral", {"sliding_window": 2.5}, "sliding_window"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_options_are_refused_by_name(tmp_path, case, changes, match):
    _build(case, tmp_path / "m")
    _edit_config(tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path / "m")


def test_bad_generate_inputs(tmp_path):
    _build("llama", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    with pytest.raises(ValueError, match="max_new_tokens=32"):
        model.generate(ids, max_new_tokens=CONTEXT - 8)
    model.generate(ids, max_new_tokens=CONTEXT - 9)  # exactly fills the context
    long = np.ones((1, CONTEXT + 1), np.int64)
    with pytest.raises(ValueError, match=rf"prompt \(`input_ids`\) holds {CONTEXT + 1} tokens"):
        model.generate(long, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_positions"):
        model(input_ids=long)
    right = mask[:, ::-1].copy()
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(ids + VOCAB, max_new_tokens=2)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.generate(ids, max_new_tokens=2.0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(ids, max_new_tokens=2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids, max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(TypeError, match="unsupported argument"):
        model(input_ids=ids, token_type_ids=ids)


@pytest.mark.parametrize("strategy", RUNNABLE)
def test_every_strategy_samples_the_eager_tokens(tmp_path, strategy):
    """Sampling through each strategy the backend runs (the default's compiled or
    recorded step, or the eager one) draws the tokens of the eager step; the compiled
    loop, which cannot draw, is refused by name."""
    _build("mistral", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": True, "seed": 1}
    if strategy == "compiled":
        with pytest.raises(ValueError, match=r"strategy.*'compiled'.*compiled_step"):
            model.generate(ids, **args, strategy=strategy)
        return
    want = model.generate(ids, **args, strategy="eager")
    np.testing.assert_array_equal(model.generate(ids, **args, strategy=strategy), want)
    np.testing.assert_array_equal(model.generate(ids, **args), want)


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="compiled on jax and TF")
def test_prefill_is_compiled_once_and_matches_the_eager_step(tmp_path):
    """On jax and TensorFlow the prompt goes through the caches compiled by XLA (the
    index static; on jax the caches donated), once per prompt shape; its logits and
    caches are the eager step's to float32 rounding."""
    from multiattn.config import owned_caches

    _build("llama3", tmp_path / "m")
    layer = from_pretrained(tmp_path / "m").layer
    ids, mask = _batch()
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    slots = np.concatenate([mask, np.ones((2, 3), np.int64)], axis=1).astype(bool)
    with owned_caches():
        prefill = CompiledStepLoop().prompt_step(layer)
        got, got_caches = prefill(ids, positions, layer.init_caches(2, 12), 0, slots)
        assert CompiledLoop().prompt_step(layer) is prefill
    want, want_caches = layer.step(ids, positions, layer.init_caches(2, 12), 0, slots)
    real = mask[:, -1].astype(bool)
    assert_close(to_np(got)[real], to_np(want)[real], "float32", {"float32": 1e-5})
    for g, w in zip(got_caches, want_caches):
        for a, b in zip(g, w):
            assert_close(to_np(a), to_np(b), "float32", {"float32": 1e-5})


def test_compiled_step_is_kept_and_follows_new_weights(tmp_path):
    """The compiled (jax, TensorFlow) or recorded (torch) functions are made once and
    kept on the model for later generate calls; after the weights change the generated
    tokens of the default strategy and of the Python loop over the backend's step are
    those of the new weights in the eager step: the kept functions read the weights as
    arguments or variables, not as constants of their trace."""
    _build("llama", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 6}
    first = model.generate(ids, **args)
    model.generate(ids, **args, strategy=PYTHON_LOOP)
    kept = dict(kept_functions(model.layer))
    assert bool(kept) == (BACKEND != "numpy")
    model.generate(ids, **args)
    model.generate(ids, **args, strategy=PYTHON_LOOP)
    assert kept_functions(model.layer) == kept  # the very same functions
    rng = np.random.default_rng(3)
    for w in model.layer.weights:
        w.assign(rng.standard_normal(tuple(w.shape)).astype(w.dtype) * 0.3)
    want = model.generate(ids, **args, strategy="eager")
    np.testing.assert_array_equal(model.generate(ids, **args), want)
    np.testing.assert_array_equal(model.generate(ids, **args, strategy=PYTHON_LOOP), want)
    assert not np.array_equal(want, first)


def _large_copies(hlo: str, shapes: list) -> list:
    """The copies and transposes of XLA program text ``hlo``, outside its entry
    computation, whose result has the sizes of one of ``shapes`` (unit axes aside, in any
    order)."""
    wanted = {tuple(sorted(n for n in shape if n != 1)) for shape in shapes}
    found, entry = [], False
    for line in hlo.splitlines():
        entry = line.startswith("ENTRY") or (entry and line.strip() != "}")
        result = re.search(r"= [a-z0-9]+\[([0-9,]*)\]\S* (copy|transpose)\(", line)
        if result and not entry:
            dims = tuple(sorted(int(n) for n in result.group(1).split(",") if n and n != "1"))
            if dims in wanted:
                found.append(line.strip()[:160])
    return found


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="compiled on jax and TF")
@pytest.mark.parametrize("case", ["gpt2", "llama"])
@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_loop_copies_no_cache(tmp_path, case, batch):
    """XLA's optimised program of the compiled greedy loop holds no copy or transpose of
    a cache outside its entry (which copies the caches passed in, once): every step
    updates the caches in place and reads them where they are. Each of these held one
    per cache and step before: the loop carrying unit axes (jax and TensorFlow), the
    update of a four-axis view (TensorFlow) and the scores with the keys on the right
    (TensorFlow, a transposed key cache)."""
    from multiattn.config import owned_caches

    _build(case, tmp_path / "m")
    layer = from_pretrained(tmp_path / "m").layer
    ids = np.random.default_rng(0).integers(1, VOCAB, (batch, 6))
    strategy = CompiledLoop()
    with owned_caches(index_checked=True):
        logits, state, _ = layer._prefill(ids, np.ones_like(ids), 5, strategy.prompt_step(layer))
        with owned_caches(index_checked=True, values_checked=True):
            hlo = strategy.loop(layer, Greedy()).optimized_hlo(logits, state, 5, (), None)
    assert " while(" in hlo
    shapes = [tuple(c.shape) for c in keras.tree.flatten(state["caches"])]
    assert shapes and not _large_copies(hlo, shapes), _large_copies(hlo, shapes)


@pytest.mark.parametrize("strategy", RUNNABLE)
def test_nan_in_masked_cache_slots_changes_no_token(tmp_path, strategy):
    """The pad token's embedding set to NaN puts NaN keys and values in the padded
    (masked) slots of the caches: generate then keeps the attention's screen on (its
    check after the prompt fails) and gives the tokens of the same model with a finite
    pad embedding, through every strategy the backend runs."""
    _build("llama", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    assert not model.layer.tied
    ids, mask = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 6, "strategy": strategy}
    want = model.generate(ids, **args)
    word = to_np(model.layer.word).copy()
    word[0] = np.nan  # id 0 is the pad of the second row
    model.layer.word.assign(word)
    np.testing.assert_array_equal(model.generate(ids, **args), want)


@pytest.mark.skipif(BACKEND != "torch", reason="the traced step is torch's")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("case", ["gpt2", "llama3", "mistral"])
def test_torch_traced_step_matches_the_eager_step(tmp_path, case, fused):
    """generate on torch replays a recorded step (one recording per shape, kept across
    calls); it gives the tokens of strategy="eager", which runs the eager step. The attention path is forced (measured, it depends on the machine's
    load): the fused kernel's screen of the query is a branch the recording guards."""
    from multiattn import config
    from multiattn.decoding.torch_step import TracedStep

    _build(case, tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": True, "seed": 4}
    with config.settings(fused_attention=fused):
        traced = model.generate(ids, **args)
        model.generate(ids, **args)
        step = kept_functions(model.layer)["traced"]
        assert isinstance(step, TracedStep) and len(step._recordings) == 1
        recordings = list(step._recordings.values())
        assert all(r is not None for r in recordings)
        if fused:
            assert all(r[2] for r in recordings)  # guarded
        # the new keys and values are written into the caches, not selected over a copy
        graph = str(recordings[0][0].inlined_graph)
        assert graph.count("aten::index_copy_") == 2 * model.layer.num_layers
        eager = model.generate(ids, **args, strategy="eager")
        assert kept_functions(model.layer)["traced"] is step
    np.testing.assert_array_equal(traced, eager)


@pytest.mark.skipif(BACKEND != "torch", reason="the traced step is torch's")
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "blas"])
def test_torch_traced_step_records_with_either_projection_library(tmp_path, onednn):
    """The projections' library is measured per product (oneDNN won some on an AVX2-only
    AMD EPYC); torch.jit.trace cannot record oneDNN's operator, so a recording takes BLAS
    whatever was measured or forced, and the step is recorded, not run eagerly."""
    from multiattn import config
    from multiattn.tuning import Fixed

    _build("llama3", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    library = Fixed(torch_linear="onednn" if onednn else "blas")
    with config.settings(autotune=library), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "could not be recorded"
        traced = model.generate(ids, attention_mask=mask, max_new_tokens=5)
        recordings = list(kept_functions(model.layer)["traced"]._recordings.values())
        assert recordings and all(r is not None for r in recordings)
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=5, strategy="eager")
    np.testing.assert_array_equal(traced, eager)


@pytest.mark.skipif(
    BACKEND not in ("torch", "jax", "tensorflow"), reason="a kept compiled or recorded step"
)
def test_kept_step_follows_a_changed_setting(tmp_path):
    """generate keeps its compiled (jax, TensorFlow) or recorded (torch) step from call to
    call; under another settings block it makes a step of its own instead of replaying
    the one made under the first: forcing the fused kernel and then the explicit path
    gives two steps (on torch only the fused one guards its query screen), and the same
    tokens as the eager step."""
    from multiattn import config

    _build("gpt2", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 6}
    tokens = {}
    for fused in (True, False):
        with config.settings(fused_attention=fused):
            tokens[fused] = model.generate(ids, **args, strategy=PYTHON_LOOP)
    step = kept_functions(model.layer)["traced" if BACKEND == "torch" else "step"]
    if BACKEND == "torch":
        recordings = {key[-1]: r for key, r in step._recordings.items()}
        assert len(recordings) == 2
        guarded = {dict(key)["fused_attention"]: bool(r[2]) for key, r in recordings.items()}
        assert guarded == {True: True, False: False}
    else:
        batch, seq = ids.shape
        layer = model.layer
        one = np.ones((batch, 1), "int32")
        slots = np.ones((batch, seq + 4), bool)
        hlo = {}
        for fused in (True, False):
            with config.settings(fused_attention=fused):
                caches = layer.init_caches(batch, seq + 4)
                hlo[fused] = step.optimized_hlo(one, one * seq, caches, np.int32(seq), slots)
        assert hlo[True] != hlo[False]
    eager = model.generate(ids, **args, strategy="eager")
    np.testing.assert_array_equal(tokens[True], eager)
    np.testing.assert_array_equal(tokens[False], eager)


@pytest.mark.skipif(BACKEND != "torch", reason="the traced step is torch's")
def test_torch_traced_step_guards_the_branch_it_recorded(tmp_path):
    """A replay whose inputs take another branch (a NaN in a masked cache slot: the
    attention's exact path for non-finite inputs) runs the step eagerly: the masked NaN
    has no effect, as in the eager step."""
    from multiattn.decoding.torch_step import TracedStep

    _build("llama", tmp_path / "m")
    layer = from_pretrained(tmp_path / "m").layer
    ids, mask = _batch()
    batch, seq = ids.shape
    slots = torch.tensor(np.concatenate([mask, np.ones((batch, 4), np.int64)], 1) > 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        _, caches = layer.step(ids, positions, layer.init_caches(batch, seq + 4), 0, slots)
        step = TracedStep(layer.step, list(layer.variables))
        token = np.array([[5], [7]], np.int32)
        where = (mask.sum(1)[:, None]).astype(np.int32)
        args = (token, where, caches, np.asarray(seq, np.int32), slots)
        clean = step(*args)[0]
        assert rel_err(to_np(clean), to_np(layer.step(*args)[0])) < 1e-5
        poisoned = [(k.clone(), v.clone()) for k, v in caches]
        poisoned[0][0][1, :, 0] = float("nan")  # row 1 starts with padding: slot 0 masked
        args = (token, where, poisoned, np.asarray(seq, np.int32), slots)
        want = to_np(layer.step(*args)[0])
        got = to_np(step(*args)[0])
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(BACKEND != "torch", reason="the traced step is torch's")
def test_torch_step_that_cannot_be_recorded_runs_eagerly(tmp_path, monkeypatch):
    from multiattn.decoding.torch_step import TracedStep

    _build("gpt2", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5)

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot record")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    kept_functions(model.layer).pop("traced", None)
    with pytest.warns(RuntimeWarning, match="cannot record"):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5)
    np.testing.assert_array_equal(got, want)
    assert isinstance(kept_functions(model.layer)["traced"], TracedStep)


@pytest.mark.parametrize("ends", ["none", "one row", "every row"])
def test_compiled_loop_gives_the_python_loop_tokens(tmp_path, ends):
    """Greedy generate runs its tokens in one compiled loop on jax and TensorFlow (kept
    on the model); it gives the tokens of the Python loop over the compiled step and of
    the eager step, end of sequence, padding after it and the early stop when every row
    has ended included."""
    _build("llama", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8)
    eos = {"none": None, "one row": int(greedy[0, 11]),
           "every row": [int(greedy[0, 10]), int(greedy[1, 12])]}[ends]  # fmt: skip
    args = {"attention_mask": mask, "max_new_tokens": 8, "eos_token_id": eos, "pad_token_id": 3}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.generate(ids, **args)
    assert not [w for w in caught if "donated" in str(w.message)]  # jax: nothing wasted
    compiled = BACKEND in ("jax", "tensorflow")
    assert (("loop", "Greedy()") in kept_functions(model.layer)) == compiled
    for strategy in RUNNABLE:
        np.testing.assert_array_equal(model.generate(ids, **args, strategy=strategy), got)
    if ends == "every row":
        assert got.shape[1] < ids.shape[1] + 8


def test_strategy_argument_is_checked_by_name(tmp_path):
    """``strategy`` takes None, a name of `STRATEGIES` or a `Strategy`; an unknown name, a
    strategy of another backend and a non-strategy are refused, naming the argument."""
    from multiattn.decoding import EagerLoop, TracedLoop

    _build("gpt2", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids, mask = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 3}
    with pytest.raises(ValueError, match=r"`strategy`.*'loop'"):
        model.generate(ids, **args, strategy="loop")
    with pytest.raises(TypeError, match=r"`strategy`.*3"):
        model.generate(ids, **args, strategy=3)
    with pytest.raises(TypeError, match="`strategy`"):
        model.generate(ids, **args, strategy=EagerLoop)  # the class, not an object
    foreign = "compiled" if BACKEND not in ("jax", "tensorflow") else "traced"
    with pytest.raises(ValueError, match=f"`strategy`='{foreign}' runs on .*{BACKEND}"):
        model.generate(ids, **args, strategy=foreign)
    if BACKEND != "torch":
        with pytest.raises(ValueError, match="torch"):
            model.generate(ids, **args, strategy=TracedLoop())
    want = model.generate(ids, **args)
    np.testing.assert_array_equal(model.generate(ids, **args, strategy=EagerLoop()), want)


def test_process_cores_counts_the_cores_this_process_may_run_on():
    from multiattn import config

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert config.process_cores() == max(1, cores)


def test_tensorflow_keeps_one_concrete_function_per_argument_signature():
    """TensorFlow: `generate`'s compiled functions are called through a concrete function
    kept per signature (`_signature`): the structure, each array's shape and dtype, each
    Python value's type and value, as ``tf.function`` traces; a cache index as a NumPy
    scalar (the Python loop's steps) selects one trace for every step."""
    if BACKEND != "tensorflow":
        pytest.skip("TensorFlow's dispatch")
    import tensorflow as tf

    from multiattn.decoding.compiled import signature as _signature

    def sig(flag=True, x=None, n=5, name="x"):
        return _signature(((flag,), {name: tf.zeros((2, 3)) if x is None else x, "n": n}))

    assert sig() == sig(x=tf.ones((2, 3)))  # the values of arrays select nothing
    for other in (sig(x=tf.zeros((2, 4))), sig(x=tf.zeros((2, 3), "int32")), sig(n=6),
                  sig(flag=1), sig(name="y"), sig(n=None)):  # fmt: skip
        assert other != sig()
    assert _signature((np.int32(3),)) == _signature((np.int32(4),))


def test_block_key_mask_through_the_cache():
    from multiattn.layers import TransformerDecoderOnlyLayer

    block = TransformerDecoderOnlyLayer(16, 4, 24, rate=0.0, norm="rms", norm_first=True,
                                        num_key_value_heads=2, rotary_max_length=12,
                                        sliding_window=4)  # fmt: skip
    x = np.random.default_rng(0).normal(size=(2, 7, 16)).astype("float32")
    mask = np.ones((2, 7), bool)
    mask[1, :3] = False
    full = to_np(block(x, mask=mask[:, None, :]))
    slots = np.concatenate([mask, np.ones((2, 5), bool)], axis=1)
    cache = block.init_cache(2, 12)
    first, cache = block(x[:, :5], cache=cache, cache_index=0, key_mask=slots)
    rest, _ = block(x[:, 5:], cache=cache, cache_index=5, key_mask=slots)
    got = np.concatenate([to_np(first), to_np(rest)], axis=1)
    np.testing.assert_allclose(got[mask], full[mask], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="key_mask"):
        block(x, key_mask=slots)
    with pytest.raises(ValueError, match="key_mask"):
        block(x[:, :1], cache=block.init_cache(2, 12), cache_index=0, key_mask=slots[:, :5])


@pytest.mark.parametrize("case", ["gpt2", "llama3"])
def test_keras_serialization_round_trip(tmp_path, case):
    _build(case, tmp_path / "m")
    layer = from_pretrained(tmp_path / "m").layer
    again = keras.layers.deserialize(keras.layers.serialize(layer))
    assert again.get_config() == layer.get_config() and again.config == layer.config
    block = layer.config.block  # one config, handed to every block
    assert all(b.config is block for b in layer.blocks) and block.norm_first and block.rate == 0
    assert (block.rotary_max_length is None) == (case == "gpt2") == layer.learned_positions
    again.set_neutral_weights(layer.neutral_weights())
    ids, mask = _batch()
    want = to_np(layer(ids, mask)["logits"])
    np.testing.assert_array_equal(to_np(again(ids, mask)["logits"]), want)


def test_causal_lm_config_is_checked():
    from multiattn.models.causal_lm import CausalLM, CausalLMConfig

    block = {"d_model": 8, "num_heads": 2, "dff": 16}
    for changes, error, named in [
        ({"vocab_size": 0}, ValueError, "vocab_size"),
        ({"tied": "yes"}, TypeError, "tied"),
        ({"block": {**block, "norm": "batch"}}, ValueError, "norm"),
        ({"block": {**block, "width": 8}}, ValueError, "width"),
        ({"block": 8}, TypeError, "config"),
    ]:
        with pytest.raises(error, match=named):
            CausalLMConfig(**{"vocab_size": 10, "num_layers": 1, "max_positions": 8,
                              "block": block, **changes})  # fmt: skip
    with pytest.raises(TypeError, match="config"):
        CausalLM("gpt2")


def test_default_generate_times_nothing_and_runs_one_loop(tmp_path, monkeypatch):
    """Autotune off (the default): greedy ``generate`` takes every choice's default and
    times nothing, and decodes the whole batch in one loop; the tokens are those of the
    Python loop over the step."""
    from multiattn import config, tuning
    from multiattn.decoding.strategies import choose_strategy, model_backend
    from multiattn.tuning import _store

    _build("llama", tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    ids = np.random.default_rng(5).integers(1, VOCAB, (4, 6))
    monkeypatch.setattr(_store, "_measure", lambda *a: pytest.fail("timed a choice"))
    tuning.reset()
    chosen = type(choose_strategy(model_backend(model.layer), Greedy()))
    loops, run = [], chosen.run
    monkeypatch.setattr(chosen, "run", lambda self, *a: loops.append(a[3]) or run(self, *a))
    got = model.generate(ids, max_new_tokens=5)
    assert tuning.decisions() == [] and config.tuner() is None  # nothing asked, nothing kept
    assert len(loops) == 1 and loops[0].shape == ids.shape  # the whole batch at once
    want = model.generate(ids, max_new_tokens=5, strategy="eager")
    np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's traced step")
def test_torch_generate_never_imports_tensorflow(tmp_path):
    """On Keras' torch backend, loading and greedy ``generate`` (its step recorded by
    ``torch.jit.trace``) import no TensorFlow: importing paddle afterwards stays
    possible."""
    import subprocess
    import sys

    _build("gpt2", tmp_path / "m")
    script = (
        "import sys, numpy as np\n"
        "from multiattn.models import from_pretrained\n"
        f"m = from_pretrained({str(tmp_path / 'm')!r})\n"
        "m.generate(np.ones((2, 3), 'int64'), max_new_tokens=3)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] == 'tensorflow')[:3])\n"
    )
    env = dict(os.environ, KERAS_BACKEND="torch")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
