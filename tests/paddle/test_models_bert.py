"""The BERT sentence encoder on Paddle (`multiattn.paddle.models.BertSentenceEncoder`, the
twin of the Keras definition) against the float64 oracle; padding; argument checks."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from _bert_oracle import EPSILON, SIZES, random_batch, random_weights, sentence_embedding

from multiattn.hf.bert_weights import BertConfig, bert_sizes
from multiattn.paddle.models import BertSentenceEncoder, set_bert_weights

CONFIG = BertConfig(
    vocab_size=SIZES["vocab_size"],
    hidden_size=SIZES["hidden_size"],
    num_layers=SIZES["num_layers"],
    num_heads=SIZES["num_heads"],
    intermediate_size=SIZES["intermediate_size"],
    max_positions=SIZES["max_positions"],
    type_vocab_size=SIZES["type_vocab_size"],
    epsilon=EPSILON,
)


def make_encoder(normalize: bool = True) -> BertSentenceEncoder:
    encoder = BertSentenceEncoder(**bert_sizes(CONFIG), normalize=normalize)
    set_bert_weights(encoder, random_weights())  # blocks through multiattn.port
    encoder.eval()
    return encoder


@pytest.mark.parametrize("normalize", [True, False])
def test_matches_oracle(normalize):
    batch = random_batch()
    out = make_encoder(normalize)(
        batch["token_ids"], batch["attention_mask"], batch["token_type_ids"]
    )
    assert isinstance(out, paddle.Tensor)
    got = out.numpy().astype(np.float64)
    want = sentence_embedding(random_weights(), **batch, normalize=normalize)
    assert got.shape == (4, SIZES["hidden_size"])
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 2e-6, f"max relative error {err:.2e}"
    np.testing.assert_array_equal(got[3], 0.0)  # no real token: pools to zeros


def test_padding_changes_nothing():
    batch = random_batch()
    encoder = make_encoder()
    ids, types = batch["token_ids"][1:2, :5], batch["token_type_ids"][1:2, :5]
    alone = encoder(ids, np.ones_like(ids), types).numpy()
    padded = encoder(
        batch["token_ids"][1:2], batch["attention_mask"][1:2], batch["token_type_ids"][1:2]
    ).numpy()
    np.testing.assert_allclose(padded, alone, rtol=0, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(TypeError, match="normalize"):
        BertSentenceEncoder(**bert_sizes(CONFIG), normalize=1)
    encoder = make_encoder()
    ids = np.ones((2, 3), np.int32)
    with pytest.raises(
        ValueError, match=r"`attention_mask` must have the shape of the ids \(2, 3\)"
    ):
        encoder(ids, ids[:, :2])
    with pytest.raises(TypeError, match=r"`attention_mask` must be a bool, integer.*dtype <U1"):
        encoder(ids, np.full((2, 3), "1"))
    long = np.ones((1, SIZES["max_positions"] + 1), np.int32)
    with pytest.raises(ValueError, match="max_positions"):
        encoder(long, long)
    w = random_weights()
    w["embeddings/position"] = w["embeddings/position"][:3]
    with pytest.raises(ValueError, match="embeddings/position"):
        set_bert_weights(BertSentenceEncoder(**bert_sizes(CONFIG)), w)
