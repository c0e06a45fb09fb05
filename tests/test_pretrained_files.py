"""The framework-free part of `multiattn.hf.pretrained`: config options, tensor names
and shapes, safetensors files (single, sharded, truncated), pickles, atomic writing.

The checkpoints here are written with ``safetensors.numpy`` from hand-written configs; the
tensor names come from a listing written out below, independently of
`multiattn.hf.families`. Numerics against transformers are in
``tests/backend/test_pretrained.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multiattn.hf import files as hf_files
from multiattn.hf.families import FAMILIES, bert_entries, vit_entries
from multiattn.hf.files import read_folder, write_folder

BERT_CONFIG = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_act": "gelu",
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 12,
    "max_position_embeddings": 6,
    "type_vocab_size": 2,
    "vocab_size": 10,
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.1,
    "pad_token_id": 0,
}
VIT_CONFIG = {
    "model_type": "vit",
    "hidden_act": "gelu",
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 12,
    "image_size": 8,
    "patch_size": 4,
    "num_channels": 3,
    "qkv_bias": True,
    "layer_norm_eps": 1e-12,
    "encoder_stride": 4,
}


def bert_state(layers: int = 2, e: int = 8, f: int = 12, pooler: bool = True) -> dict:
    """BertModel's tensors for `BERT_CONFIG`, listed by hand."""
    rng = np.random.default_rng(0)
    shapes = {
        "embeddings.word_embeddings.weight": (10, e),
        "embeddings.position_embeddings.weight": (6, e),
        "embeddings.token_type_embeddings.weight": (2, e),
        "embeddings.LayerNorm.weight": (e,),
        "embeddings.LayerNorm.bias": (e,),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for part in ("query", "key", "value"):
            shapes[f"{p}attention.self.{part}.weight"] = (e, e)
            shapes[f"{p}attention.self.{part}.bias"] = (e,)
        shapes.update({
            f"{p}attention.output.dense.weight": (e, e),
            f"{p}attention.output.dense.bias": (e,),
            f"{p}attention.output.LayerNorm.weight": (e,),
            f"{p}attention.output.LayerNorm.bias": (e,),
            f"{p}intermediate.dense.weight": (f, e),
            f"{p}intermediate.dense.bias": (f,),
            f"{p}output.dense.weight": (e, f),
            f"{p}output.dense.bias": (e,),
            f"{p}output.LayerNorm.weight": (e,),
            f"{p}output.LayerNorm.bias": (e,),
        })  # fmt: skip
    if pooler:
        shapes["pooler.dense.weight"] = (e, e)
        shapes["pooler.dense.bias"] = (e,)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write(folder: Path, config: dict | None = None, state: dict | None = None) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(BERT_CONFIG if config is None else config))
    save_file(bert_state() if state is None else state, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return folder


def test_bert_table_matches_the_hand_listing():
    sizes = FAMILIES["bert"].check_config(BERT_CONFIG, "t")
    assert {e.hf: e.shape for e in bert_entries(sizes)} == {
        k: v.shape for k, v in bert_state().items()
    }


def test_reads_a_bert_folder(tmp_path):
    loaded = read_folder(write(tmp_path / "m"))
    state = bert_state()
    assert loaded.family.model_type == "bert" and loaded.ignored == []
    w = loaded.weights
    assert len(w) == len(state)
    # spot checks written from BERT's convention: Linear weight (out, in), head-major out
    q = state["encoder.layer.1.attention.self.query.weight"]
    np.testing.assert_array_equal(w["layer_1/attention/query/kernel"][:, 1, 0], q[4 + 0, :])
    o = state["encoder.layer.0.attention.output.dense.weight"]
    np.testing.assert_array_equal(w["layer_0/attention/output/kernel"][1, 3, :], o[:, 4 + 3])
    b = state["encoder.layer.0.attention.self.value.bias"]
    np.testing.assert_array_equal(w["layer_0/attention/value/bias"][1], b[4:])
    np.testing.assert_array_equal(w["pooler/kernel"], state["pooler.dense.weight"].T)


def test_sharded_index(tmp_path):
    from safetensors.numpy import save_file

    state = bert_state()
    names = sorted(state)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(BERT_CONFIG))
    weight_map = {}
    for shard, part in (("a.safetensors", names[::2]), ("b.safetensors", names[1::2])):
        save_file({k: state[k] for k in part}, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(read_folder(folder).weights) == len(state)
    weight_map[names[0]] = "b.safetensors"  # the index and the shards disagree
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"but model\.safetensors\.index\.json places it"):
        read_folder(folder)
    weight_map[names[0]] = "a.safetensors"
    index.write_text(json.dumps({"weight_map": {**weight_map, "extra": "a.safetensors"}}))
    with pytest.raises(ValueError, match=r"lists tensor 'extra', found in no shard"):
        read_folder(folder)


def test_task_head_checkpoint_loads_the_base_model(tmp_path):
    state = {"bert." + k: v for k, v in bert_state().items()}
    state["classifier.weight"] = np.zeros((3, 8), np.float32)
    with pytest.warns(UserWarning, match="classifier.weight"):
        loaded = read_folder(write(tmp_path / "m", state=state))
    assert loaded.ignored == ["classifier.weight"]


def test_position_ids_buffer_is_accepted(tmp_path):
    state = {**bert_state(), "embeddings.position_ids": np.arange(6)[None]}
    assert "embeddings/word" in read_folder(write(tmp_path / "m", state=state)).weights


# --- every refusal names what is wrong -------------------------------------------------


def test_no_folder_no_config_no_weights(tmp_path):
    with pytest.raises(ValueError, match="must be an existing folder"):
        read_folder(tmp_path / "missing")
    folder = write(tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match=r"no config\.json"):
        read_folder(folder)
    folder = write(tmp_path / "n")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no weights.*model\.safetensors.*pytorch_model\.bin"):
        read_folder(folder)
    with pytest.raises(TypeError, match="`path`"):
        read_folder(3)


def test_unknown_model_type_lists_the_supported(tmp_path):
    folder = write(tmp_path / "m", config={**BERT_CONFIG, "model_type": "deberta-v2"})
    supported = (
        "albert, bart, bert, distilbert, electra, falcon, gemma, gemma2, gemma3_text, gpt2, "
        "gpt_neox, llama, mistral, mixtral, modernbert, opt, phi, phi3, qwen2, qwen2_moe, qwen3, "
        "qwen3_moe, roberta, t5, vit, xlm-roberta"
    )
    with pytest.raises(
        ValueError, match=rf"unsupported model_type 'deberta-v2'; supported: {supported}"
    ):
        read_folder(folder)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu_new"}, "`hidden_act` = 'gelu_new' is not implemented"),
        ({"position_embedding_type": "relative_key"}, "`position_embedding_type`"),
        ({"is_decoder": True}, "`is_decoder` = True is not implemented"),
        ({"add_cross_attention": True}, "`add_cross_attention`"),
        ({"output_attentions": True}, "`output_attentions`"),
        ({"pruned_heads": {"0": [1]}}, "`pruned_heads`"),
        ({"rotary_value": True}, "config option `rotary_value` is not implemented"),
        ({"num_attention_heads": 3}, "divisible"),
        ({"vocab_size": 0}, "`vocab_size` must be a positive integer"),
        ({"layer_norm_eps": -1}, "`layer_norm_eps` must be a positive finite number"),
        ({"layer_norm_eps": float("inf")}, "`layer_norm_eps` must be a positive finite number"),
    ],
)
def test_bert_config_refusals(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        read_folder(write(tmp_path / "m", config={**BERT_CONFIG, **change}))


def test_missing_config_key(tmp_path):
    config = dict(BERT_CONFIG)
    del config["hidden_size"]
    with pytest.raises(ValueError, match=r"config\.json has no `hidden_size`"):
        read_folder(write(tmp_path / "m", config=config))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "relu"}, "`hidden_act`"),
        ({"pooler_act": "softmax"}, "`pooler_act` = 'softmax' is not implemented"),
        ({"image_size": 10}, "must be a multiple of `patch_size`"),
        ({"qkv_bias": "yes"}, "`qkv_bias` must be a bool"),
        ({"use_mask_token": True}, "config option `use_mask_token`"),
    ],
)
def test_vit_config_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        FAMILIES["vit"].check_config({**VIT_CONFIG, **change}, "t")


def test_missing_tensor_is_named(tmp_path):
    state = bert_state()
    del state["encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match=r"no tensor 'encoder\.layer\.1\.output\.dense\.bias'"):
        read_folder(write(tmp_path / "m", state=state))


def test_wrong_shape_is_named(tmp_path):
    state = bert_state()
    state["encoder.layer.0.intermediate.dense.weight"] = np.zeros((11, 8), np.float32)
    with pytest.raises(
        ValueError, match=r"'encoder\.layer\.0\.intermediate\.dense\.weight' must have shape "
        r"\(12, 8\) for this config; received \(11, 8\)"
    ):  # fmt: skip
        read_folder(write(tmp_path / "m", state=state))


def test_unexpected_tensor_is_named(tmp_path):
    state = {**bert_state(), "encoder.layer.2.output.dense.bias": np.zeros(8, np.float32)}
    with pytest.raises(ValueError, match=r"unexpected tensor 'encoder\.layer\.2\.output"):
        read_folder(write(tmp_path / "m", state=state))


def test_integer_weights_refused(tmp_path):
    state = {**bert_state(), "embeddings.LayerNorm.bias": np.zeros(8, np.int32)}
    with pytest.raises(
        ValueError,
        match=r"'embeddings\.LayerNorm\.bias' has dtype int32; multiattn loads weights of",
    ):
        read_folder(write(tmp_path / "m", state=state))


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file_refused(tmp_path, keep):
    folder = write(tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"cannot read model\.safetensors.*truncated"):
        read_folder(folder)


def test_tampered_header_refused(tmp_path):
    folder = write(tmp_path / "m")
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = data[8 : 8 + int.from_bytes(data[:8], "little")].decode()
    header = header.replace('"shape":[10,8]', '"shape":[20,8]', 1)  # more data than stored
    assert '"shape":[20,8]' in header
    path.write_bytes(bytes(data[:8]) + header.encode() + bytes(data[8 + len(header) :]))
    with pytest.raises(ValueError, match=r"cannot read model\.safetensors"):
        read_folder(folder)


def test_pickle_without_trust_is_refused(tmp_path):
    folder = write(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin, a Python pickle.*trust_pickle"):
        read_folder(folder)


def test_config_path_out_of_the_folder_refused(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(BERT_CONFIG))
    folder = write(tmp_path / "m")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the model folder"):
        read_folder(folder)


# --- exact transforms and atomic writing -----------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    heads=st.integers(1, 4),
    head_dim=st.integers(1, 3),
    layers=st.integers(1, 2),
    patch=st.integers(1, 3),
    grid=st.integers(1, 3),
    qkv_bias=st.booleans(),
)
def test_tables_invert_exactly(heads, head_dim, layers, patch, grid, qkv_bias):
    e = heads * head_dim
    vit = {**VIT_CONFIG, "hidden_size": e, "num_attention_heads": heads,
           "num_hidden_layers": layers, "patch_size": patch, "image_size": patch * grid,
           "qkv_bias": qkv_bias, "pooler_output_size": e + 1}  # fmt: skip
    bert = {**BERT_CONFIG, "hidden_size": e, "num_attention_heads": heads,
            "num_hidden_layers": layers}  # fmt: skip
    rng = np.random.default_rng(heads * 100 + head_dim)
    for family, config, table in (("vit", vit, vit_entries), ("bert", bert, bert_entries)):
        entries = table(FAMILIES[family].check_config(config, "t"))
        state = {x.hf: rng.standard_normal(x.shape).astype(np.float32) for x in entries}
        neutral = {x.name: x.to_neutral(state[x.hf]) for x in entries}
        back = {x.hf: x.to_hf(neutral[x.name]) for x in entries}
        for name, value in state.items():
            assert back[name].tobytes() == value.tobytes(), name


def _loaded(tmp_path):
    return read_folder(write(tmp_path / "src"))


def test_write_folder_round_trip(tmp_path):
    from safetensors.numpy import load_file

    loaded = _loaded(tmp_path)
    out = write_folder(tmp_path / "out", loaded.family, loaded.sizes, loaded.config, loaded.weights)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    state = load_file(out / "model.safetensors")
    want = bert_state()
    assert sorted(state) == sorted(want)
    assert all(state[k].tobytes() == want[k].tobytes() for k in want)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertModel"] and config["dtype"] == "float32"
    assert config["hidden_dropout_prob"] == 0.1  # settings are written back, none dropped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temp left


def test_write_folder_is_atomic(tmp_path, monkeypatch):
    import safetensors.numpy

    loaded = _loaded(tmp_path)

    def broken(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    args = (loaded.family, loaded.sizes, loaded.config, loaded.weights)
    with pytest.raises(OSError, match="disk full"):
        write_folder(tmp_path / "out", *args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing half written
    # an existing folder survives a failed overwrite untouched
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "x").write_text("old")
    with pytest.raises(OSError, match="disk full"):
        write_folder(tmp_path / "keep", *args, overwrite=True)
    assert (tmp_path / "keep" / "x").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "src"]


def test_write_folder_refuses_a_non_empty_folder(tmp_path):
    loaded = _loaded(tmp_path)
    args = (loaded.family, loaded.sizes, loaded.config, loaded.weights)
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "x").write_text("old")
    with pytest.raises(ValueError, match="non-empty folder; pass overwrite=True"):
        write_folder(tmp_path / "keep", *args)
    write_folder(tmp_path / "keep", *args, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    with pytest.raises(ValueError, match="is a file"):
        write_folder(tmp_path / "keep" / "config.json", *args)


def test_modules_import_no_framework():
    import subprocess
    import sys

    code = (
        "import sys, multiattn.hf.pretrained, multiattn.hf.files; "
        "loaded = [m for m in ('torch', 'tensorflow', 'jax', 'keras', 'paddle') "
        "if m in sys.modules]; assert not loaded, loaded"
    )
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert hf_files.SAFETENSORS == "model.safetensors"


# --- dtypes, and the Hugging Face cache layout ------------------------------------------


def _raw_safetensors(path: Path, tensors: dict[str, tuple[str, tuple, bytes]]) -> None:
    """A safetensors file written by hand (8-byte header length, JSON header, data), for
    dtypes NumPy cannot make: ``name -> (dtype tag, shape, raw bytes)``."""
    header, data = {}, b""
    for name, (tag, shape, raw) in tensors.items():
        header[name] = {
            "dtype": tag,
            "shape": list(shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_a_float8_weight_is_refused_naming_the_tensor_and_its_dtype(tmp_path):
    folder = write(tmp_path / "m")
    state = bert_state()
    name = "embeddings.LayerNorm.weight"
    tensors = {k: ("F32", v.shape, v.tobytes()) for k, v in state.items()}
    tensors[name] = ("F8_E4M3", (8,), bytes(8))
    _raw_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype F8_E4M3; multiattn loads"):
        read_folder(folder)


def test_a_bfloat16_folder_is_read_in_bfloat16_without_reading_its_data(tmp_path):
    import ml_dtypes

    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in bert_state().items()}
    loaded = read_folder(write(tmp_path / "m", config={**BERT_CONFIG, "dtype": "bfloat16"},
                               state=state))  # fmt: skip
    assert set(loaded.dtypes.values()) == {"bfloat16"}
    assert hf_files.checkpoint_dtype(loaded.config, loaded.dtypes, "t") == "bfloat16"
    word = loaded.weights["embeddings/word"]
    assert word.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(word.view(np.uint16),
                                  state["embeddings.word_embeddings.weight"].view(np.uint16))  # fmt: skip


@pytest.mark.parametrize(
    ("config", "dtypes", "want"),
    [
        ({"dtype": "bfloat16"}, {"a": "bfloat16", "b": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, {"a": "float16"}, "float16"),  # transformers 4's key
        ({}, {"a": "float16"}, "float16"),  # no key: the tensors' dtype
        ({}, {"a": "float16", "b": "bfloat16"}, "float32"),  # mixed, no key: float32
        ({"dtype": "float32"}, {"a": "bfloat16"}, "float32"),  # widening loses nothing
        ({"dtype": "bfloat16"}, {"a": "bfloat16", "ids": "int64"}, "bfloat16"),  # buffers
    ],
)
def test_checkpoint_dtype_follows_the_config_then_the_tensors(config, dtypes, want):
    assert hf_files.checkpoint_dtype(config, dtypes, "t") == want


@pytest.mark.parametrize(
    ("config", "dtypes", "match"),
    [
        ({"dtype": "bfloat16"}, {"w": "float32"}, r"tensor 'w' is float32 but .*would lose"),
        ({"dtype": "float16"}, {"w": "bfloat16"}, r"tensor 'w' is bfloat16 but"),
        ({"dtype": "auto"}, {"w": "float32"}, r"`dtype` must be one of .*received 'auto'"),
        ({"torch_dtype": "int8"}, {"w": "float32"}, r"`torch_dtype` must be one of"),
    ],
)
def test_checkpoint_dtype_refuses_a_lossy_or_unknown_dtype(config, dtypes, match):
    with pytest.raises(ValueError, match=match):
        hf_files.checkpoint_dtype(config, dtypes, "t")


def _cache_snapshot(tmp_path: Path) -> Path:
    """``repo/snapshots/rev`` whose files are links into ``repo/blobs``, as the Hugging
    Face cache lays out a downloaded model."""
    source = write(tmp_path / "source")
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        (repo / "blobs" / f"blob{i}").write_bytes((source / name).read_bytes())
        (snapshot / name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    return snapshot


def test_a_cache_snapshot_whose_links_lead_into_its_blobs_loads(tmp_path):
    loaded = read_folder(_cache_snapshot(tmp_path))
    np.testing.assert_array_equal(loaded.weights["embeddings/word"],
                                  bert_state()["embeddings.word_embeddings.weight"])  # fmt: skip


@pytest.mark.parametrize("where", ["other repository's blobs", "repository outside blobs"])
def test_a_cache_snapshot_link_anywhere_else_is_refused(tmp_path, where):
    snapshot = _cache_snapshot(tmp_path)
    if where == "other repository's blobs":
        elsewhere = tmp_path / "models--org--other" / "blobs"
    else:
        elsewhere = snapshot.parent.parent / "refs"
    elsewhere.mkdir(parents=True)
    (elsewhere / "weights").write_bytes((snapshot / "model.safetensors").read_bytes())
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(elsewhere / "weights")
    with pytest.raises(ValueError, match="outside the model folder"):
        read_folder(snapshot)


LLAMA_CONFIG = {
    "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
    "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16,
    "rms_norm_eps": 1e-6,
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_theta": -1.0}, r"`rope_theta` must be a positive finite number; received -1\.0"),
        (
            {"rope_theta": -1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
            r"`rope_theta` must be a positive finite number",
        ),
        (
            {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
            r"`rope_theta` \(500000\.0\) and `rope_parameters\.rope_theta` \(10000\.0\) disagree",
        ),
    ],
)
def test_a_rotary_base_is_checked_wherever_the_config_gives_it(change, match):
    with pytest.raises(ValueError, match=match):
        FAMILIES["llama"].check_config({**LLAMA_CONFIG, **change}, "t")


def test_a_rotary_base_given_twice_alike_is_accepted():
    both = {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert FAMILIES["llama"].check_config({**LLAMA_CONFIG, **both}, "t")["rope_theta"] == 1e4
