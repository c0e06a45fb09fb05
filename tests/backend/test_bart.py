"""BART (`multiattn.models.bart`) against transformers.

A tiny random ``BartForConditionalGeneration`` (tests/_bart_models.py) is saved with
``save_pretrained`` (its generation config forcing the first new token, as
facebook/bart-large's does, and the last one), loaded with `from_pretrained` in float32
and compared with transformers run in float64: logits of a left-padded batch of two,
greedy ``generate`` token for token, ``save_pretrained`` read back by transformers with
identical tensors. A ``BartModel`` checkpoint (no ``model.`` prefix, no
``final_logits_bias``) with ``scale_embedding`` loads too; unimplemented config options
are refused by name.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
from _support import BACKEND, rel_err, to_np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _bart_models import VOCAB, build_bart, decoder_ids  # noqa: E402
from _hf_models import left_padded_batch  # noqa: E402

from multiattn.hf.bart import BART  # noqa: E402
from multiattn.hf.pretrained import PretrainedCausalLM, from_pretrained  # noqa: E402

# Max relative error of float32 logits against transformers in float64 (measured on the
# four Keras backends: at most 3e-7).
TOL = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(transformers model in float64, saved folder)``."""
    path = tmp_path_factory.mktemp("bart") / "m"
    return build_bart(path), path


def _hf(model, ids, mask, dec):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     decoder_input_ids=torch.tensor(dec))  # fmt: skip


def test_bart_matches_transformers_and_saves_back_bit_for_bit(built, tmp_path):
    hf, path = built
    model = from_pretrained(path)
    assert isinstance(model, PretrainedCausalLM) and model.dtype == "float32"
    ids, mask = left_padded_batch(VOCAB)
    dec = decoder_ids()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    assert keras.backend.standardize_dtype(out["logits"].dtype) == "float32"
    want = _hf(hf, ids, mask, dec)
    assert rel_err(to_np(out["logits"]), want.logits.numpy()) <= TOL
    real = mask.astype(bool)  # padded encoder positions carry no meaning
    enc, want_enc = to_np(out["encoder_last_hidden_state"]), want.encoder_last_hidden_state
    assert rel_err(enc[real], want_enc.numpy()[real]) <= TOL

    with torch.no_grad():
        tokens = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             do_sample=False, max_new_tokens=20, eos_token_id=None).numpy()  # fmt: skip
    got = model.generate(ids, attention_mask=mask, max_new_tokens=20)
    assert got.dtype == np.int64 and got.shape == (2, 21)
    # decoder start 2, forced bos 0 first and forced eos 2 last (the generation config)
    assert (got[:, :2] == [2, 0]).all() and (got[:, -1] == 2).all()
    assert len(set(got[:, 2:-1].ravel())) > 2  # not one token repeated
    np.testing.assert_array_equal(got, tokens)

    model.save_pretrained(tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["architectures"] == ["BartForConditionalGeneration"]
    assert json.loads((tmp_path / "again" / "generation_config.json").read_text())[
        "forced_bos_token_id"] == 0  # fmt: skip
    cls = transformers.BartForConditionalGeneration
    original, back = cls.from_pretrained(path).state_dict(), cls.from_pretrained(tmp_path / "again")
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert back.final_logits_bias.abs().max() > 0


@pytest.mark.skipif(
    BACKEND != "torch", reason="the loading is the backends' own; eager torch is cheapest"
)
def test_bart_model_checkpoint_with_scaled_embeddings(tmp_path):
    """A ``BartModel`` folder: the same tensors without ``model.``, no
    ``final_logits_bias`` (loaded as zeros, as transformers does); ``scale_embedding``
    and ``relu``."""
    hf = build_bart(tmp_path / "base", base=True, scale_embedding=True, activation_function="relu")
    model = from_pretrained(tmp_path / "base")
    ids, mask = left_padded_batch(VOCAB, length=7, pads=2)
    dec = decoder_ids(4)
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                decoder_attention_mask=np.ones_like(dec))  # fmt: skip
    want = _hf(hf, ids, mask, dec)
    assert rel_err(to_np(out["last_hidden_state"]), want.last_hidden_state.numpy()) <= TOL
    real = mask.astype(bool)
    enc = to_np(out["encoder_last_hidden_state"])[real]
    assert rel_err(enc, want.encoder_last_hidden_state.numpy()[real]) <= TOL
    assert not to_np(model.layer.final_logits_bias).any()


def _config(built) -> dict:
    return json.loads((built[1] / "config.json").read_text())


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"normalize_before": True}, "normalize_before"),  # mBART's pre-norm layout
        ({"add_final_layer_norm": True}, "add_final_layer_norm"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({"activation_function": "gelu_fast"}, "activation_function"),
        ({"scale_embedding": "yes"}, "scale_embedding"),
        ({"decoder_attention_heads": 5}, "decoder_attention_heads"),
        ({"forced_eos_token_id": VOCAB}, "forced_eos_token_id"),
        ({"decoder_start_token_id": -1}, "decoder_start_token_id"),
        ({"num_hidden_layers": 3}, "num_hidden_layers"),
        ({"some_new_option": 1}, "some_new_option"),
    ],
)
def test_unimplemented_config_options_are_refused_by_name(built, changes, named):
    with pytest.raises(ValueError, match=named):
        BART.check_config({**_config(built), **changes}, "test")


def test_decoding_ids_come_from_the_generation_config(built):
    """``generation_config.json`` over ``config.json`` (what transformers' generate
    reads); a list of forced end ids is kept whole."""
    sizes = BART.check_config(_config(built), "test")
    assert (sizes["decoder_start_token_id"], sizes["forced_bos_token_id"]) == (2, None)
    side = {"generation_config.json": {"forced_bos_token_id": 0, "forced_eos_token_id": [2, 5],
                                       "decoder_start_token_id": 1}}  # fmt: skip
    got = BART.read_generation(sizes, side, "test")
    assert (got["decoder_start_token_id"], got["forced_bos_token_id"]) == (1, 0)
    assert got["forced_eos_token_id"] == (2, 5)
    with pytest.raises(ValueError, match=r"generation_config\.json.*forced_bos_token_id"):
        BART.read_generation(sizes, {"generation_config.json": {"forced_bos_token_id": "a"}}, "t")
