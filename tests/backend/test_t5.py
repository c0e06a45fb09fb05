"""T5 (`multiattn.models.t5`) against transformers.

Tiny random ``T5ForConditionalGeneration`` models (``relu`` and ``gated-gelu``
feed-forward networks) are built offline from a config, their parameters redrawn at a
scale where the logits are well separated, saved with ``save_pretrained``, loaded with
`from_pretrained` and compared with transformers run in float64: logits of a padded batch
of two, greedy ``generate`` token for token, ``save_pretrained`` read back by
transformers with identical tensors, the relative position buckets, and bad inputs.
The models are built once per module.
"""

from __future__ import annotations

import json
import os
import shutil

import keras
import numpy as np
import pytest
from _support import BACKEND, rel_err, to_np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from multiattn.hf.pretrained import from_pretrained  # noqa: E402
from multiattn.models.t5 import relative_buckets  # noqa: E402

VOCAB = 64
SIZES = {"vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "num_heads": 4, "num_layers": 2,
         "num_decoder_layers": 2, "d_ff": 64, "decoder_start_token_id": 0}  # fmt: skip
CASES = ("relu", "gated-gelu", "gated-gelu-unscaled")
# "unscaled": transformers 5 reads tie_word_embeddings=False as a tied projection without
# the d_model ** -0.5 scaling (it writes scale_decoder_outputs: false).
CONFIGS = {"relu": {"feed_forward_proj": "relu"}, "gated-gelu": {"feed_forward_proj": "gated-gelu"},
           "gated-gelu-unscaled": {"feed_forward_proj": "gated-gelu",
                                   "tie_word_embeddings": False}}  # fmt: skip
DTYPE = "float32" if BACKEND == "numpy" else "float64"
# Max relative error of the logits against transformers in float64. transformers computes
# T5's norm statistics in float32 even in a float64 model, so float64 agrees to about
# 1e-6; float32 to about 1e-5 (transformers' own float32 model: 7.5e-6).
TOL = {"float64": 1e-5, "float32": 5e-5}


def _redraw(model, seed: int = 0):
    """Every parameter redrawn: N(0, 0.3), embeddings and relative biases N(0, 1), norm
    weights N(1, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "layer_norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_((1.0 if "shared" in name or "relative" in name else 0.3) * noise)
    return model.eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``case -> (transformers model in float64, saved folder)``."""
    out = {}
    for case in CASES:
        torch.manual_seed(0)
        config = transformers.T5Config(**SIZES, **CONFIGS[case])
        model = _redraw(transformers.T5ForConditionalGeneration(config), seed=3)
        path = tmp_path_factory.mktemp("t5") / case
        model.save_pretrained(path)
        out[case] = (model.double(), path)
    return out


@pytest.fixture(scope="module")
def loaded(built):
    """``case -> model`` loaded by `from_pretrained` in ``DTYPE``."""
    return {case: from_pretrained(path, dtype=DTYPE) for case, (_, path) in built.items()}


def _batch():
    """Encoder ids with row 1 right-padded, decoder ids starting with the start token."""
    rng = np.random.default_rng(1)
    ids, mask = rng.integers(2, VOCAB, (2, 9)), np.ones((2, 9), np.int64)
    ids[1, 6:], mask[1, 6:] = 0, 0
    dec = rng.integers(2, VOCAB, (2, 7))
    dec[:, 0] = 0
    return ids, mask, dec


def _hf(model, ids, mask, dec):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     decoder_input_ids=torch.tensor(dec), output_hidden_states=True)  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(built, loaded, case):
    ids, mask, dec = _batch()
    out = loaded[case](input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    assert keras.backend.standardize_dtype(out["logits"].dtype) == DTYPE
    assert tuple(out["logits"].shape) == (2, 7, VOCAB)
    assert tuple(out["last_hidden_state"].shape) == (2, 7, 32)
    assert tuple(out["encoder_last_hidden_state"].shape) == (2, 9, 32)
    want = _hf(built[case][0], ids, mask, dec)
    assert rel_err(to_np(out["logits"]), want.logits.numpy()) <= TOL[DTYPE]
    decoder_states = want.decoder_hidden_states[-1].numpy()  # after the final norm
    assert rel_err(to_np(out["last_hidden_state"]), decoder_states) <= TOL[DTYPE]
    real = mask.astype(bool)  # padded encoder positions carry no meaning
    enc, want_enc = to_np(out["encoder_last_hidden_state"]), want.encoder_last_hidden_state
    assert rel_err(enc[real], want_enc.numpy()[real]) <= TOL[DTYPE]


@pytest.mark.skipif(BACKEND == "numpy", reason="float32 is the numpy case above")
def test_float32_logits_match_transformers(built):
    hf, path = built["gated-gelu"]
    model = from_pretrained(path)
    ids, mask, dec = _batch()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                decoder_attention_mask=np.ones_like(dec))  # fmt: skip
    want = _hf(hf, ids, mask, dec).logits.numpy()
    assert rel_err(to_np(out["logits"]), want) <= TOL["float32"]


@pytest.mark.parametrize("case", CASES[:2])
def test_greedy_generate_matches_transformers(built, loaded, case):
    ids, mask, _ = _batch()
    with torch.no_grad():
        want = built[case][0].generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
            max_new_tokens=20, eos_token_id=None, pad_token_id=0,
        ).numpy()  # fmt: skip
    got = loaded[case].generate(ids, attention_mask=mask, max_new_tokens=20)
    assert got.dtype == np.int64 and got.shape == (2, 21)
    assert len(set(got[:, 1:].ravel())) > 3  # not a degenerate repetition
    np.testing.assert_array_equal(got, want)


def test_generate_eos_then_pad_like_transformers(built, loaded):
    ids, mask, _ = _batch()
    # Another length first: the compiled step must not be reused with relaxed shapes.
    greedy = loaded["gated-gelu"].generate(ids, attention_mask=mask, max_new_tokens=9)
    eos = int(greedy[0, 3])  # the third new token of row 0 becomes the end
    with torch.no_grad():
        want = built["gated-gelu"][0].generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
            max_new_tokens=8, eos_token_id=eos, pad_token_id=7,
        ).numpy()  # fmt: skip
    got = loaded["gated-gelu"].generate(ids, attention_mask=mask, max_new_tokens=8,
                                        eos_token_id=eos, pad_token_id=7)  # fmt: skip
    np.testing.assert_array_equal(got, want)
    assert got[0, 3] == eos and (got[0, 4:] == 7).all()


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_every_strategy_gives_the_eager_tokens(loaded, do_sample):
    """T5 decodes through the same strategies as the decoder-only models
    (`multiattn.decoding`): each one the backend runs gives the eager step's tokens,
    with an end id and its padding; the compiled loop takes greedy decoding only."""
    from multiattn.decoding import STRATEGIES

    model = loaded["gated-gelu"]
    ids, mask, _ = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": do_sample, "seed": 2}
    eos = int(model.generate(ids, attention_mask=mask, max_new_tokens=3)[0, 2])
    want = model.generate(ids, **args, eos_token_id=eos, pad_token_id=5, strategy="eager")
    for name, cls in STRATEGIES.items():
        if (cls.backends is not None and BACKEND not in cls.backends) or (
            do_sample and cls.in_graph_only
        ):
            continue
        got = model.generate(ids, **args, eos_token_id=eos, pad_token_id=5, strategy=name)
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_save_round_trip_gives_transformers_identical_tensors(built, tmp_path):
    _, path = built["gated-gelu"]
    model = from_pretrained(path)
    model.save_pretrained(tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["architectures"] == ["T5ForConditionalGeneration"]
    original = transformers.T5ForConditionalGeneration.from_pretrained(path).state_dict()
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "again")
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_match_transformers(bidirectional):
    attention = transformers.models.t5.modeling_t5.T5Attention
    distance = np.arange(-300, 301)[None, :]
    want = attention._relative_position_bucket(
        torch.tensor(distance), bidirectional=bidirectional, num_buckets=32, max_distance=128
    ).numpy()
    got = to_np(relative_buckets(distance, bidirectional, 32, 128))
    np.testing.assert_array_equal(got, want)


def _edited(built, tmp_path, **changes):
    folder = tmp_path / "edited"
    shutil.copytree(built["relu"][1], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"feed_forward_proj": "gated-silu", "dense_act_fn": "silu"}, "feed_forward_proj"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({"scale_decoder_outputs": "yes"}, "scale_decoder_outputs"),
        ({"dense_act_fn": "gelu"}, "dense_act_fn"),
        ({"some_new_option": 1}, "some_new_option"),
        # the bucket arithmetic's preconditions: no bucket per distance, or no range left
        # for the logarithmic buckets (a division by zero, then NaN or wrapped indices)
        ({"relative_attention_num_buckets": 1}, "relative_attention_num_buckets"),
        ({"relative_attention_num_buckets": 3}, "relative_attention_num_buckets"),
        ({"relative_attention_max_distance": 16}, "relative_attention_max_distance"),
    ],
)
def test_unimplemented_config_options_are_refused_by_name(built, tmp_path, changes, named):
    with pytest.raises(ValueError, match=named):
        from_pretrained(_edited(built, tmp_path, **changes))


def test_config_is_checked_and_round_trips(loaded):
    from multiattn.models.t5 import T5Config, T5ForConditionalGeneration

    model = loaded["relu"].layer
    config = model.config
    assert isinstance(config, T5Config) and config.num_decoder_layers == 2
    again = T5ForConditionalGeneration.from_config(model.get_config())
    assert again.config == config and again.decoder_blocks[0].config == config
    fields = config.to_dict()
    for changes, error, named in [
        ({"num_heads": 0}, ValueError, "num_heads"),
        ({"gated": 1}, TypeError, "gated"),
        ({"activation": "gelu_fast"}, ValueError, "activation"),
        ({"decoder_start_token_id": VOCAB}, ValueError, "decoder_start_token_id"),
        ({"num_buckets": 2}, ValueError, "num_buckets"),
        ({"max_distance": 8, "num_buckets": 16}, ValueError, "max_distance"),
    ]:
        with pytest.raises(error, match=named):
            T5Config(**{**fields, **changes})
    with pytest.raises(TypeError, match="config"):
        T5ForConditionalGeneration([1, 2])


def test_bad_inputs_are_refused(loaded):
    model = loaded["relu"]
    ids, mask, dec = _batch()
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="`attention_mask`"):
        model(input_ids=ids, attention_mask=mask[:, :5], decoder_input_ids=dec)
    with pytest.raises(ValueError, match="`decoder_input_ids`"):
        model(input_ids=ids, decoder_input_ids=dec.astype(np.float32))
    with pytest.raises(TypeError, match="decoder_inputs_embeds"):
        model(input_ids=ids, decoder_input_ids=dec, decoder_inputs_embeds=dec)
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(ids + VOCAB, max_new_tokens=3)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.generate(ids, max_new_tokens=None)
