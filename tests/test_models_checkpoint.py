"""multiattn.hf.bert_weights (imports no framework): BERT names and layouts to the
neutral port layout, config reading, errors that name the tensor or key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _bert_oracle import EPSILON, SIZES, random_weights

from multiattn.hf.bert_weights import BertConfig, bert_to_neutral, layer_weights

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


def hf_state(prefix: str = "") -> dict[str, np.ndarray]:
    """A BERT state dict written from the neutral weights with explicit loops (the
    ``Linear`` convention: ``out[j] = sum_i W[j, i] x[i] + b[j]``, head-major features)."""
    w = random_weights()
    e, h = SIZES["hidden_size"], SIZES["num_heads"]
    d = e // h
    s = {
        "embeddings.word_embeddings.weight": w["embeddings/word"],
        "embeddings.position_embeddings.weight": w["embeddings/position"],
        "embeddings.token_type_embeddings.weight": w["embeddings/token_type"],
        "embeddings.LayerNorm.weight": w["embeddings/norm/gamma"],
        "embeddings.LayerNorm.bias": w["embeddings/norm/beta"],
        "embeddings.position_ids": np.arange(SIZES["max_positions"])[None],
        "pooler.dense.weight": np.zeros((e, e), np.float32),
        "pooler.dense.bias": np.zeros(e, np.float32),
    }
    for n in range(SIZES["num_layers"]):
        p, src = f"layer_{n}/", f"encoder.layer.{n}."
        for part in ("query", "key", "value"):
            kernel, bias = w[f"{p}attention/{part}/kernel"], w[f"{p}attention/{part}/bias"]
            weight = np.zeros((e, e), np.float32)
            flat_bias = np.zeros(e, np.float32)
            for head in range(h):
                for j in range(d):
                    weight[head * d + j, :] = kernel[:, head, j]
                    flat_bias[head * d + j] = bias[head, j]
            s[f"{src}attention.self.{part}.weight"] = weight
            s[f"{src}attention.self.{part}.bias"] = flat_bias
        out = w[f"{p}attention/output/kernel"]
        weight = np.zeros((e, e), np.float32)
        for head in range(h):
            for j in range(d):
                weight[:, head * d + j] = out[head, j, :]
        s[f"{src}attention.output.dense.weight"] = weight
        s[f"{src}attention.output.dense.bias"] = w[f"{p}attention/output/bias"]
        s[f"{src}intermediate.dense.weight"] = w[f"{p}ffn_1/kernel"].T.copy()
        s[f"{src}intermediate.dense.bias"] = w[f"{p}ffn_1/bias"]
        s[f"{src}output.dense.weight"] = w[f"{p}ffn_2/kernel"].T.copy()
        s[f"{src}output.dense.bias"] = w[f"{p}ffn_2/bias"]
        s[f"{src}attention.output.LayerNorm.weight"] = w[f"{p}norm_1/gamma"]
        s[f"{src}attention.output.LayerNorm.bias"] = w[f"{p}norm_1/beta"]
        s[f"{src}output.LayerNorm.weight"] = w[f"{p}norm_2/gamma"]
        s[f"{src}output.LayerNorm.bias"] = w[f"{p}norm_2/beta"]
    return {prefix + k: v for k, v in s.items()}


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_bert_to_neutral_is_exact(prefix):
    got = bert_to_neutral(hf_state(prefix), CONFIG)
    want = random_weights()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_layer_weights_strips_the_prefix():
    sub = layer_weights(random_weights(), 1)
    assert "attention/query/kernel" in sub and "norm_2/beta" in sub
    assert len(sub) == 16
    with pytest.raises(ValueError, match="layer 7"):
        layer_weights(random_weights(), 7)


def test_missing_or_misshapen_tensor_is_named():
    state = hf_state()
    del state["encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.output\.dense\.bias"):
        bert_to_neutral(state, CONFIG)
    state = hf_state()
    state["embeddings.word_embeddings.weight"] = state["embeddings.word_embeddings.weight"][:, :4]
    with pytest.raises(ValueError, match=r"word_embeddings.*\(40, 4\)"):
        bert_to_neutral(state, CONFIG)


def _config_json(tmp_path, **changes) -> str:
    raw = {
        "model_type": "bert",
        "hidden_act": "gelu",
        "hidden_size": 16,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 24,
        "max_position_embeddings": 12,
        "type_vocab_size": 2,
        "vocab_size": 40,
        "layer_norm_eps": 1e-12,
        **changes,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_config_from_json(tmp_path):
    assert BertConfig.from_json(_config_json(tmp_path)) == CONFIG


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_act": "gelu_new"}, "hidden_act"),
        ({"model_type": "roberta"}, "model_type"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"num_attention_heads": 5}, "divisible"),
    ],
)
def test_config_rejects_other_variants(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        BertConfig.from_json(_config_json(tmp_path, **changes))


# --- the model folder: paths stay inside it; malformed files name the key ---------------


def _model_dir(folder, pooling_path: str = "1_Pooling"):
    """A sentence-transformers folder holding the small BERT of `hf_state`."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    _config_json(folder)
    save_file(hf_state(), str(folder / "model.safetensors"))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 10}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": pooling_path,
         "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True})
    )
    return folder


def test_load_checkpoint_reads_a_model_folder(tmp_path):
    from multiattn.hf.bert_weights import load_checkpoint

    config, options, weights = load_checkpoint(_model_dir(tmp_path / "m"))
    assert config == CONFIG and options.max_length == 10 and not options.normalize
    want = random_weights()
    assert sorted(weights) == sorted(want)
    assert all(np.array_equal(weights[k], want[k]) for k in want)


def test_paths_out_of_the_model_folder_are_refused(tmp_path):
    from multiattn.hf.bert_weights import load_checkpoint

    # a pooling config outside the folder, which the old code would have read
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    for path in ("../outside", "../../" + str(outside.relative_to(tmp_path.parent)),
                 str(outside)):  # fmt: skip
        model = _model_dir(tmp_path / "m", pooling_path=path)
        with pytest.raises(ValueError, match=r"outside the model folder"):
            load_checkpoint(model)
    # a symbolic link to a file outside the folder
    model = _model_dir(tmp_path / "n")
    (outside / "bert.json").write_text((model / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(outside / "bert.json")
    with pytest.raises(ValueError, match=r"'config\.json' leads to .*outside the model folder"):
        load_checkpoint(model)
    # links that stay inside the folder are followed
    model = _model_dir(tmp_path / "k")
    (model / "real.json").write_text((model / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("real.json")
    assert load_checkpoint(model)[0] == CONFIG


def test_a_cache_snapshot_loads_with_or_without_root(tmp_path):
    """A Hugging Face cache snapshot links its files into ../../blobs: the layout is
    recognised, so it loads as it is (and with `root`); a link elsewhere is refused."""
    from multiattn.hf.bert_weights import load_checkpoint

    repo = tmp_path / "models--x"
    source = _model_dir(tmp_path / "src")
    snapshot = repo / "snapshots" / "abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "modules.json",
                 "sentence_bert_config.json"):  # fmt: skip
        (repo / "blobs" / name).write_bytes((source / name).read_bytes())
        (snapshot / name).symlink_to(Path("../../blobs") / name)
    (snapshot / "1_Pooling").mkdir()
    (snapshot / "1_Pooling" / "config.json").write_bytes(
        (source / "1_Pooling" / "config.json").read_bytes())  # fmt: skip
    assert load_checkpoint(snapshot)[0] == CONFIG
    assert load_checkpoint(snapshot, root=repo)[0] == CONFIG
    (repo / "elsewhere").mkdir()
    (repo / "elsewhere" / "modules.json").write_bytes((source / "modules.json").read_bytes())
    (snapshot / "modules.json").unlink()
    (snapshot / "modules.json").symlink_to(repo / "elsewhere" / "modules.json")
    with pytest.raises(ValueError, match="outside the model folder"):
        load_checkpoint(snapshot)


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("config.json", "drop:hidden_size", "missing key `hidden_size`"),
        ("config.json", "drop:layer_norm_eps", "missing key `layer_norm_eps`"),
        ("config.json", {"num_hidden_layers": "6"}, "`num_hidden_layers` must be a positive"),
        ("config.json", {"vocab_size": 0}, "`vocab_size` must be a positive integer"),
        ("config.json", {"layer_norm_eps": "small"}, "`layer_norm_eps` must be a positive"),
        ("config.json", "{not json", r"config\.json' is not valid JSON"),
        ("config.json", "[1, 2]", r"config\.json' must hold a JSON object"),
        ("sentence_bert_config.json", "{}", "missing key `max_seq_length`"),
        ("modules.json", "{}", r"modules\.json' must hold a JSON array"),
        (
            "modules.json",
            '[{"path": ""}]',
            "modules.json entry 0 must be an object with a string `type`",
        ),
        ("modules.json", '[{"type": "x.Pooling"}]', "Pooling entry: missing key `path`"),
    ],
)
def test_malformed_files_name_the_key(tmp_path, file, content, match):
    from multiattn.hf.bert_weights import load_checkpoint

    model = _model_dir(tmp_path / "m")
    if isinstance(content, dict) or content.startswith("drop:"):
        raw = json.loads((model / file).read_text())
        if isinstance(content, dict):
            raw.update(content)
        else:
            del raw[content.removeprefix("drop:")]
        content = json.dumps(raw)
    (model / file).write_text(content)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(model)


def test_unreadable_weights_are_named(tmp_path):
    from multiattn.hf.bert_weights import load_checkpoint

    model = _model_dir(tmp_path / "m")
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read model\.safetensors"):
        load_checkpoint(model)
