"""The model surfaces under bad input: token ids checked by every model call (eagerly
refused, NaN inside a compiled function, never another id's row), prompts with a row of
pads only, pad ids outside the vocabulary, an empty batch and a temperature that
overflows. Tiny random models made by transformers, saved and loaded."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from _support import BACKEND, to_np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from multiattn.hf.pretrained import from_pretrained  # noqa: E402

VOCAB = 40
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32)),
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, num_heads=2, num_layers=1, d_ff=24,
        decoder_start_token_id=0)),
    "bert": lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32, type_vocab_size=2)),
}  # fmt: skip


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    out = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        make().save_pretrained(path)
        out[name] = from_pretrained(path)
    return out


def _inputs(name, ids):
    if name == "t5":
        return {"input_ids": ids, "decoder_input_ids": np.zeros((1, 2), np.int64)}
    return {"input_ids": ids}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "bad, named",
    [
        (np.array([[1, -1, 3]]), "received -1"),  # would read the last row
        (np.array([[1, VOCAB, 3]]), f"received {VOCAB}"),  # NaN on jax, an error elsewhere
        (np.array([[1, 2**32 + 5, 3]]), "4294967301"),  # would wrap to id 5 in int32
        (np.array([[1.0, 2.7, 3.0]]), "integer"),  # would be truncated
    ],
)
def test_model_call_refuses_ids_outside_the_vocabulary(loaded, name, bad, named):
    model = loaded[name]
    model(**_inputs(name, np.array([[1, 2, 3]])))  # in range: fine
    with pytest.raises(ValueError, match=named):
        model(**_inputs(name, bad))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "mask, named",
    [
        (np.array([["1", "1", "0"]]), "received <U1"),  # strings: the framework's own error
        (np.array([[1, None, 1]], dtype=object), "received object"),
        (np.array([[1 + 0j, 1, 0]]), "received complex128"),
        (np.ones((1, 4), np.int64), r"the shape of the ids \(1, 3\); received \(1, 4\)"),
    ],
)
def test_model_call_refuses_a_mask_of_another_dtype_or_shape(loaded, name, mask, named):
    ids = np.array([[1, 2, 3]])
    with pytest.raises(ValueError, match=f"`attention_mask`.*{named}"):
        loaded[name](**_inputs(name, ids), attention_mask=mask)


def test_bert_refuses_token_types_outside_the_table(loaded):
    model = loaded["bert"]
    ids = np.array([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"token_type_ids.*received 2"):
        model(input_ids=ids, token_type_ids=np.array([[0, 1, 2]]))
    with pytest.raises(ValueError, match=r"token_type_ids.*received -1"):
        model(input_ids=ids, token_type_ids=np.array([[0, -1, 0]]))


@pytest.mark.skipif(BACKEND != "jax", reason="a compiled call: jax.jit")
def test_compiled_call_gives_nan_for_an_id_outside_never_another_row(loaded):
    import jax

    layer = loaded["llama"].layer
    logits = jax.jit(lambda ids: layer(ids)["logits"])
    good = to_np(logits(np.array([[1, 2, 3]], np.int32)))
    assert np.isfinite(good).all()
    out = to_np(logits(np.array([[1, -1, 3]], np.int32)))
    np.testing.assert_array_equal(out[0, 0], good[0, 0])  # before the bad token: as before
    assert np.isnan(out[0, 1:]).all()  # the bad token and those that attend to it


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_generate_refuses_a_row_of_pads_only(loaded, name):
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    mask = np.array([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"rows \[1\] hold none"):
        loaded[name].generate(ids, attention_mask=mask, max_new_tokens=2)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_generate_refuses_a_pad_id_outside_the_vocabulary(loaded, name):
    ids = np.array([[1, 2, 3]])
    with pytest.raises(ValueError, match="pad_token_id"):
        loaded[name].generate(ids, max_new_tokens=2, eos_token_id=3, pad_token_id=VOCAB)
    with pytest.raises(ValueError, match="pad_token_id"):
        loaded[name].generate(ids, max_new_tokens=2, pad_token_id=10**6)


def test_generate_refuses_an_empty_batch(loaded):
    with pytest.raises(ValueError, match="batch and seq at least 1"):
        loaded["llama"].generate(np.zeros((0, 3), np.int64), max_new_tokens=2)


def test_sampling_refuses_a_temperature_that_overflows(loaded):
    with pytest.raises(ValueError, match=r"overflow.*temperature"):
        loaded["llama"].generate(np.array([[1, 2, 3]]), max_new_tokens=2, do_sample=True,
                                 temperature=1e-320, seed=0)  # fmt: skip
    tokens = loaded["llama"].generate(np.array([[1, 2, 3]]), max_new_tokens=2, do_sample=True,
                                      temperature=np.float32(0.7), top_p=np.float32(0.9), seed=0)  # fmt: skip
    assert tokens.shape == (1, 5)


def test_keras_layer_ids_are_checked_too(loaded):
    layer = loaded["llama"].layer
    with pytest.raises(ValueError, match="received -1"):
        layer(keras.ops.convert_to_tensor(np.array([[1, -1]], np.int32)))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_from_pretrained_refuses_a_weight_that_is_not_finite(tmp_path, value):
    from safetensors.numpy import load_file, save_file

    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    state = load_file(tmp_path / "model.safetensors")
    state[name][3, 5] = value
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{name}' holds 1 non-finite.*\(3, 5\)"):
        from_pretrained(tmp_path)


def test_save_pretrained_refuses_bad_arguments_and_unwritable_paths(loaded, tmp_path):
    model = loaded["llama"]
    with pytest.raises(TypeError, match="overwrite"):
        model.save_pretrained(tmp_path / "a", overwrite="no")  # a truthy string
    with pytest.raises(TypeError, match="path"):
        model.save_pretrained(None)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot write"):
        model.save_pretrained(tmp_path / "file" / "inside")
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(ValueError, match="cannot write"):
            model.save_pretrained(tmp_path / "ro" / "m")


def test_save_pretrained_follows_a_link_and_refuses_a_folder_filled_meanwhile(
    loaded, tmp_path, monkeypatch
):
    from multiattn.hf import files

    model = loaded["llama"]
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "stale.bin").write_text("old")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    model.save_pretrained(tmp_path / "link", overwrite=True)
    assert (tmp_path / "link").is_symlink()
    written = {p.name for p in (tmp_path / "real").iterdir()}  # the target's files replaced
    assert "stale.bin" not in written and {"config.json", "model.safetensors"} <= written
    # another save fills the new folder between this save's check and its rename
    rename = files._replace

    def racing(tmp, target, overwrite, given):
        target.mkdir()
        (target / "config.json").write_text("{}")
        rename(tmp, target, overwrite, given)

    monkeypatch.setattr(files, "_replace", racing)
    with pytest.raises(ValueError, match="filled by another save"):
        model.save_pretrained(tmp_path / "new")
    assert (tmp_path / "new" / "config.json").read_text() == "{}"  # the other save's, kept
    assert not list(tmp_path.glob(".new.tmp-*"))


def test_a_later_save_removes_the_leftovers_of_killed_saves(loaded, tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(dead.stdout)
    left = [tmp_path / f".m.tmp-{pid}-abc", tmp_path / f".m.old-{pid}"]
    running = tmp_path / f".m.tmp-{os.getpid()}-xyz"  # a save of a live process: kept
    for folder in (*left, running):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"0" * 10)
    loaded["llama"].save_pretrained(tmp_path / "m")
    assert not any(p.exists() for p in left) and running.exists()


def test_from_pretrained_refuses_a_config_with_more_blocks_than_the_weights_hold(tmp_path):
    import json

    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    # refused from the counts, before the million blocks' tensors are listed
    with pytest.raises(
        ValueError, match=r"1000000 blocks \(`num_hidden_layers`\) but the weights hold"
    ):
        from_pretrained(tmp_path)


def test_from_pretrained_refuses_a_shard_that_is_not_a_regular_file(tmp_path):
    import json

    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    os.mkfifo(tmp_path / "shard.safetensors")  # reading it would block forever
    index = {"weight_map": {"model.embed_tokens.weight": "shard.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"shard\.safetensors must be a regular file"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_generate_refuses_caches_larger_than_the_available_memory(loaded, name, tmp_path):
    import json

    from multiattn._system import available_memory

    available = available_memory()
    assert available is not None
    # both tiny models cache 2 x 2 heads x 8 floats (128 bytes) per token and layer:
    # twice the available memory's worth of tokens
    new = 2 * available // 128 + 1
    model = loaded[name]
    if name == "llama":  # a context that long passes every other check
        torch.manual_seed(0)
        MODELS["llama"]().save_pretrained(tmp_path)
        raw = json.loads((tmp_path / "config.json").read_text())
        raw["max_position_embeddings"] = new + 3
        (tmp_path / "config.json").write_text(json.dumps(raw))
        model = from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"caches would take [\d,]+ bytes"):
        model.generate(np.array([[1, 2, 3]]), max_new_tokens=new)


def test_generation_config_carries_over_through_save_and_port(tmp_path):
    import json
    from pathlib import Path

    from multiattn.port.models import convert_model

    torch.manual_seed(0)
    hf = MODELS["llama"]()
    hf.generation_config.max_new_tokens = 7  # a decoding default a user set
    hf.save_pretrained(tmp_path / "src")
    want = json.loads((tmp_path / "src" / "generation_config.json").read_text())
    assert want["max_new_tokens"] == 7
    from_pretrained(tmp_path / "src").save_pretrained(tmp_path / "saved")
    convert_model(tmp_path / "src", tmp_path / "ported", "hf", "hf", False, False)
    neutral = tmp_path / "model.safetensors"
    convert_model(tmp_path / "src", neutral, "hf", "safetensors", False, False)
    convert_model(neutral, tmp_path / "back", "safetensors", "hf", False, False)
    for folder in ("saved", "ported", "back"):
        got = json.loads(Path(tmp_path / folder / "generation_config.json").read_text())
        assert got == want, folder
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert again.generation_config.max_new_tokens == 7


def test_a_compressed_pickle_is_refused_before_it_is_inflated(tmp_path):
    """``pytorch_model.bin`` is opened memory-mapped: a record compressed to inflate (a
    1 MB file holding 1 GiB, for one) is an error naming the file, not an allocation."""
    import zipfile

    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(tmp_path, safe_serialization=False)
    if not (tmp_path / "pytorch_model.bin").exists():  # this transformers writes safetensors only
        from safetensors.torch import load_file

        torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    plain = zipfile.ZipFile(tmp_path / "pytorch_model.bin")
    records = {info.filename: plain.read(info) for info in plain.infolist()}
    with zipfile.ZipFile(tmp_path / "packed.bin", "w", zipfile.ZIP_DEFLATED) as packed:
        for name, data in records.items():
            packed.writestr(name, data)
    (tmp_path / "packed.bin").replace(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"cannot read pytorch_model\.bin .*uncompressed zip"):
        from_pretrained(tmp_path, trust_pickle=True)


def test_a_bfloat16_pickle_loads_in_bfloat16(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    MODELS["llama"]().to(torch.bfloat16).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    model = from_pretrained(tmp_path, trust_pickle=True)
    assert model.dtype == ("float32" if BACKEND == "numpy" else "bfloat16")
    written = model.state_dict()
    for name, value in state.items():
        want = value.float().numpy()
        np.testing.assert_array_equal(np.asarray(written[name], np.float32), want, err_msg=name)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_model_call_refuses_an_empty_batch_or_sequence(loaded, name, shape):
    with pytest.raises(ValueError, match=r"`input_ids` must hold at least one row"):
        loaded[name](**_inputs(name, np.zeros(shape, np.int64)))


def test_bert_errors_name_input_ids_as_the_call_does(loaded):
    model = loaded["bert"]
    with pytest.raises(ValueError, match=r"`input_ids` must hold token ids.*received -1"):
        model(input_ids=np.array([[1, -1, 3]]))
    with pytest.raises(ValueError, match=r"`input_ids` must be an integer"):
        model(input_ids=np.array([[1.0, 2.5]]))
    with pytest.raises(ValueError, match=r"max_positions=32.*`input_ids` of shape \(1, 33\)"):
        model(input_ids=np.ones((1, 33), np.int64))


def test_generate_names_input_ids_for_a_prompt_past_the_context(loaded):
    with pytest.raises(ValueError, match=r"prompt \(`input_ids`\) holds 33 tokens"):
        loaded["llama"].generate(np.ones((1, 33), np.int64), max_new_tokens=1)
