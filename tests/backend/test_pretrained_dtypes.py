"""Checkpoints in the dtypes they ship in: float16 and bfloat16 folders made by
transformers load in their own dtype (``dtype=None``, as transformers' ``dtype="auto"``),
compute about as accurately as transformers does in that dtype, upcast to float32 on
request (then greedy tokens are transformers' float32 tokens), save back bit for bit, and
load with no random initialisation and one tensor in memory at a time."""

from __future__ import annotations

import json
import os
import weakref

import keras
import numpy as np
import pytest
from _support import BACKEND, to_np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from multiattn.hf import _tensors  # noqa: E402
from multiattn.hf.pretrained import from_pretrained  # noqa: E402

VOCAB = 96
MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True)),
    # issue 50's layouts: fused qkv/gate_up projections; parallel branches on one LayerNorm
    # with one key/value head
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=None, bos_token_id=1, eos_token_id=2)),
    "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_hidden_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, bos_token_id=1, eos_token_id=2)),
}  # fmt: skip
#: the NumPy backend computes a half-precision checkpoint in float32 (stated in
#: `from_pretrained`); every other Keras backend keeps the dtype
UPCAST = BACKEND == "numpy"


def _saved(family: str, dtype: str, path):
    """A random ``family`` model saved by transformers in ``dtype``; returns the float64
    copy of exactly those (rounded) weights, the reference."""
    torch.manual_seed(0)
    model = MODELS[family]().to(getattr(torch, dtype)).eval()
    model.save_pretrained(path)
    return model.double()


def _ids():
    return np.random.default_rng(3).integers(1, VOCAB, (2, 10))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_half_precision_checkpoint_loads_in_its_dtype_and_computes_as_transformers_does(
    tmp_path, family, dtype
):
    """The error of multiattn's logits from the float64 computation with the same weights
    is at most twice transformers' own error in that dtype (plus float32 rounding of the
    logits' scale): the parts transformers keeps in float32 (norm statistics, softmax,
    rotary tables) are kept in float32 here too, or the error would be several times
    larger."""
    reference = _saved(family, dtype, tmp_path)
    ids = _ids()
    with torch.no_grad():
        want = reference(torch.tensor(ids)).logits.numpy()
        low = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=getattr(torch, dtype)
        )
        theirs = low(torch.tensor(ids)).logits.double().numpy()
    _assert_as_accurate_as_transformers(from_pretrained(tmp_path), dtype, ids, want, theirs)


def _assert_as_accurate_as_transformers(model, dtype, ids, want, theirs) -> None:
    """``model``'s logits on ``ids`` are at most twice as far from the float64 ``want`` as
    transformers' logits in ``dtype`` (``theirs``) are (plus float32 rounding)."""
    assert model.dtype == ("float32" if UPCAST else dtype)
    got = to_np(keras.ops.cast(model(input_ids=ids)["logits"], "float32")).astype(np.float64)
    scale = np.abs(want).max()
    their_error = np.abs(theirs - want).max()
    bound = 2 * their_error if not UPCAST else 1e-5 * scale
    assert np.abs(got - want).max() <= bound + 1e-6 * scale


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_modernbert_computes_as_transformers_does(tmp_path, dtype):
    """ModernBERT's masked-LM logits in the checkpoint's dtype, local and global layers
    (windows of 2 tokens on either side), as accurate as transformers' in that dtype."""
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=32, local_attention=4,
        global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(tmp_path)
    ids = _ids()
    with torch.no_grad():
        want = model.double()(torch.tensor(ids)).logits.numpy()
        low = transformers.ModernBertForMaskedLM.from_pretrained(
            tmp_path, dtype=getattr(torch, dtype)
        )
        theirs = low(torch.tensor(ids)).logits.double().numpy()
    _assert_as_accurate_as_transformers(from_pretrained(tmp_path), dtype, ids, want, theirs)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_bfloat16_checkpoint_upcast_to_float32_generates_transformers_float32_tokens(
    tmp_path, family
):
    _saved(family, "bfloat16", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        want = hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=int),
                           max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()  # fmt: skip
    model = from_pretrained(tmp_path, dtype="float32")
    assert model.dtype == "float32"
    got = np.asarray(model.generate(ids, max_new_tokens=6))
    np.testing.assert_array_equal(got[:, -6:], want[:, -6:])


def test_save_pretrained_writes_a_bfloat16_checkpoint_back_bit_for_bit(tmp_path):
    from safetensors.numpy import load_file

    _saved("qwen2", "bfloat16", tmp_path / "in")
    model = from_pretrained(tmp_path / "in")
    model.save_pretrained(tmp_path / "out")
    source = load_file(tmp_path / "in" / "model.safetensors")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(written) == sorted(source)
    want = "float32" if UPCAST else "bfloat16"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == want
    for name, value in source.items():
        assert written[name].dtype.name == want, name
        if not UPCAST:  # the same bits
            np.testing.assert_array_equal(written[name].view(np.uint16), value.view(np.uint16))
        else:  # exactly the bfloat16 values, widened
            np.testing.assert_array_equal(written[name], value.astype(np.float32))


def test_dtype_none_refuses_a_tensor_wider_than_the_config_dtype(tmp_path):
    """A float32 tensor in a folder whose config says bfloat16 would be rounded: refused
    with the tensor named, unless a dtype is asked for."""
    _saved("qwen2", "float32", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    with pytest.raises(ValueError, match=r"tensor '.*' is float32 but config.json's `dtype`"):
        from_pretrained(tmp_path)
    assert from_pretrained(tmp_path, dtype="float32").dtype == "float32"


def _random_draws(monkeypatch) -> list:
    """Every draw an initializer makes, recorded (Keras' random initializers draw through
    the backend's random module)."""
    from keras.src.backend import random

    draws = []
    for name in ("uniform", "normal", "truncated_normal"):
        real = getattr(random, name)

        def record(*args, _real=real, _name=name, **kwargs):
            draws.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(random, name, record)
    return draws


def test_loading_draws_no_random_initial_values(tmp_path, monkeypatch):
    from multiattn.models import CausalLM

    _saved("qwen2", "float32", tmp_path)
    draws = _random_draws(monkeypatch)
    model = from_pretrained(tmp_path)
    assert draws == []
    CausalLM.from_sizes(model.sizes)  # the probe sees a model built outside loading
    assert draws


def test_loading_holds_one_checkpoint_tensor_at_a_time(tmp_path, monkeypatch):
    """Every tensor read from the file is released before the next is read: the
    checkpoint is never whole in memory (the variables are its only copy)."""
    _saved("gpt2", "float32", tmp_path)  # its fused q/k/v are split as they are read
    alive, most = [], [0]
    real = _tensors.Lazy.__getitem__

    def read(self, key):
        value = real(self, key)
        if isinstance(self, _tensors.Tensors) and isinstance(value, np.ndarray):
            alive[:] = [r for r in alive if r() is not None and r() is not value]
            alive.append(weakref.ref(value))
            most[0] = max(most[0], len(alive))
        return value

    monkeypatch.setattr(_tensors.Lazy, "__getitem__", read)
    from_pretrained(tmp_path)
    assert alive, "no tensor was read through the probe"
    assert most[0] <= 2
