"""`multiattn port` refusals on whole models (issue 48 items 7, 14, 16): flags that do not
apply to a model, a config the loader refuses, a neutral model file with bad metadata or
mis-shaped tensors, unwritable destinations. Each is one ``multiattn port: error:`` line
that names what is wrong, and nothing is written. The port runs in a subprocess, so the
outer test process loads no framework (the pickle case imports torch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _port_cli_support import ok, only, port, refused
from multiattn.conformance.families import DIRECTORY
from safetensors import safe_open
from safetensors.numpy import save_file

from multiattn.hf.files import read_folder


def _folder(tmp_path: Path, family: str, **changes) -> Path:
    """A copy of the conformance suite's ``family`` folder, its config.json changed."""
    dst = tmp_path / family
    shutil.copytree(DIRECTORY / family, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


@pytest.fixture(scope="module")
def neutral(tmp_path_factory) -> tuple[dict, dict]:
    """The metadata and tensors of a neutral llama model file."""
    path = tmp_path_factory.mktemp("neutral") / "llama.safetensors"
    ok(port("--from", "hf", str(DIRECTORY / "llama"), str(path)))
    with safe_open(str(path), framework="numpy") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize(
    "flags",
    [["--num-heads", "2"], ["--module", "mha"], ["--prefix", "model."], ["--epsilon", "1e-5"],
     ["--rotary-base", "500"], ["--module", "encoder", "--num-heads", "2"]],
    ids=lambda f: "_".join(f).replace("--", ""),
)  # fmt: skip
@pytest.mark.parametrize("direction", ["from-hf", "to-hf"])
def test_module_flags_do_not_apply_to_models(tmp_path, neutral, flags, direction):
    if direction == "from-hf":
        args = ["--from", "hf", str(DIRECTORY / "llama"), str(tmp_path / "o.safetensors")]
        side = "--from hf"
    else:
        src = tmp_path / "m.safetensors"
        save_file(neutral[1], src, metadata=neutral[0])
        args, side = (
            ["--from", "safetensors", "--to", "hf", str(src), str(tmp_path / "o")],
            "--to hf",
        )
    names = ", ".join(f for f in flags if f.startswith("--"))
    refused(port(*args, *flags), f"{names} do", f"not apply to {side}")
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "o").exists()


def test_max_size_does_not_apply_to_a_model_folder(tmp_path):
    refused(
        port("--from", "hf", str(DIRECTORY / "llama"), str(tmp_path / "o"), "--max-size", "1G"),
        "--max-size does not apply to --from hf",
    )
    only(tmp_path)


def test_max_size_bounds_a_neutral_model_file(tmp_path, neutral):
    src = tmp_path / "m.safetensors"
    save_file(neutral[1], src, metadata=neutral[0])
    total = sum(v.nbytes for v in neutral[1].values())
    args = ("--from", "safetensors", "--to", "hf", str(src), str(tmp_path / "o"))
    refused(port(*args, "--max-size", f"{total - 1}B"), f"hold {total} bytes", "--max-size")
    only(tmp_path, "m.safetensors")
    ok(port(*args, "--max-size", f"{total}B"))
    assert (tmp_path / "o" / "model.safetensors").is_file()


_INF = float("inf")


@pytest.mark.parametrize(
    "family, key, change",
    [("llama", "rms_norm_eps", {"rms_norm_eps": _INF}),
     ("qwen2", "rms_norm_eps", {"rms_norm_eps": _INF}),
     ("gpt2", "layer_norm_epsilon", {"layer_norm_epsilon": _INF}),
     ("mistral", "rope_theta", {"rope_parameters": {"rope_theta": _INF, "rope_type": "default"}})],
    ids=["llama", "qwen2", "gpt2", "mistral-rope"],
)  # fmt: skip
@pytest.mark.parametrize("spelling", ["Infinity", "1e999"])
def test_infinite_config_number_is_refused_by_the_loaders_check(tmp_path, family, key, change,
                                                                spelling):  # fmt: skip
    src = _folder(tmp_path, family, **change)
    text = (src / "config.json").read_text()
    assert "Infinity" in text  # json writes inf so; 1e999 reads back as inf too
    (src / "config.json").write_text(text.replace("Infinity", spelling))
    want = f"`{key}` must be a positive finite number; received inf."
    with pytest.raises(ValueError) as err:
        read_folder(src)  # what from_pretrained checks a folder with
    assert want in str(err.value)
    refused(port("--from", "hf", str(src), str(tmp_path / "o.safetensors")), want)
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("value", [5, "full_attention", {"0": "full_attention"}], ids=repr)
def test_qwen2_layer_types_must_be_a_list(tmp_path, value):
    src = _folder(tmp_path, "qwen2", layer_types=value)
    want = f"`layer_types` must be a list of layer kinds (one per layer); received {value!r}."
    with pytest.raises(ValueError) as err:
        read_folder(src)
    assert want in str(err.value)
    refused(port("--from", "hf", str(src), str(tmp_path / "o.safetensors")), want)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"multiattn.config": None}, "the file's metadata has no 'multiattn.config'"),
        ({"multiattn.config": "{bad"}, "'multiattn.config' is not valid JSON"),
        ({"multiattn.config": "[1, 2]"}, "'multiattn.config' must be a JSON object; received list"),
        ({"multiattn.config": '{"model_type": "nope"}'}, "nope"),
        ({"multiattn.side_files": "[1]"}, "'multiattn.side_files' must be a JSON object"),
        ({"multiattn.side_files": '{"generation_config.json": 3}'},
         "'generation_config.json' holds int"),
        ({"multiattn.side_files": '{"x.json": {}}'}, "'x.json' is not one of"),
    ],
    ids=["no-config", "config-not-json", "config-list", "unknown-model-type", "side-files-list",
         "side-file-not-object", "side-file-unknown"],
)  # fmt: skip
def test_neutral_model_file_with_bad_metadata_is_refused(tmp_path, neutral, change, needle):
    meta = {k: v for k, v in {**neutral[0], **change}.items() if v is not None}
    src = tmp_path / "m.safetensors"
    save_file(neutral[1], src, metadata=meta)
    refused(port("--from", "safetensors", "--to", "hf", str(src), str(tmp_path / "o")), needle)
    only(tmp_path, "m.safetensors")


@pytest.mark.parametrize(
    "name, shape, want",
    [("final_norm/scale", (15,), "(16,)"),  # 31 vs 32 elements: the reshape failed before
     ("layer_0/ffn/gate/kernel", (24, 16), "(16, 24)"),  # same size, transposed: was accepted
     ("layer_0/self_attention/key/kernel", (16, 4, 2), "(16, 2, 4)")],
    ids=["short", "transposed", "heads-swapped"],
)  # fmt: skip
def test_mis_shaped_tensor_of_a_model_file_is_named_with_its_shape(tmp_path, neutral, name, shape,
                                                                   want):  # fmt: skip
    tensors = dict(neutral[1])
    tensors[name] = np.zeros(shape, tensors[name].dtype)
    src = tmp_path / "m.safetensors"
    save_file(tensors, src, metadata=neutral[0])
    got = f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"
    refused(
        port("--from", "safetensors", "--to", "hf", str(src), str(tmp_path / "o")),
        f"weight {name!r} must have shape {want}; received {got}",
    )
    only(tmp_path, "m.safetensors")


def test_non_finite_tensor_of_a_model_file_is_named(tmp_path, neutral):
    tensors = dict(neutral[1])
    tensors["final_norm/scale"] = tensors["final_norm/scale"].copy()
    tensors["final_norm/scale"][3] = np.nan
    src = tmp_path / "m.safetensors"
    save_file(tensors, src, metadata=neutral[0])
    refused(
        port("--from", "safetensors", "--to", "hf", str(src), str(tmp_path / "o")),
        "'model.norm.weight' holds 1 non-finite value(s)",
    )
    only(tmp_path, "m.safetensors")


@pytest.mark.parametrize("held", ["5", "{'a': 5}", "[1, 2]"])
def test_pickle_that_holds_no_state_dict_is_refused(tmp_path, held):
    import subprocess
    import sys

    src = tmp_path / "folder"
    shutil.copytree(DIRECTORY / "llama", src)
    (src / "model.safetensors").unlink()
    single = tmp_path / "single.bin"
    code = (f"import torch; torch.save({held}, {str(src / 'pytorch_model.bin')!r}); "
            f"torch.save({held}, {str(single)!r})")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
    refused(
        port("--from", "hf", "--trust-pickle", str(src), str(tmp_path / "o.safetensors")),
        "pytorch_model.bin",
    )
    refused(
        port("--from", "torch", "--num-heads", "2", str(single), str(tmp_path / "o.safetensors")),
        "expected a state_dict",
    )
    only(tmp_path, "folder", "single.bin")


@pytest.mark.parametrize("to", ["hf", "safetensors"])
def test_destination_under_a_file_is_refused_naming_the_file(tmp_path, to):
    (tmp_path / "afile").write_text("x")
    for dst in (tmp_path / "afile" / "o", tmp_path / "afile" / "sub" / "o"):
        refused(
            port("--from", "hf", "--to", to, str(DIRECTORY / "llama"), str(dst)),
            f"{dst}: cannot write: {tmp_path / 'afile'} is a file, not a folder.",
        )
    assert (tmp_path / "afile").read_text() == "x"
    only(tmp_path, "afile")


@pytest.mark.parametrize("to", ["hf", "safetensors"])
def test_destination_in_an_unwritable_place_is_refused(tmp_path, to):
    dst = Path("/proc/multiattn-port-test-output")
    refused(port("--from", "hf", "--to", to, str(DIRECTORY / "llama"), str(dst)), "cannot write")
    assert not dst.exists()


def test_destination_with_missing_parents_is_made(tmp_path):
    dst = tmp_path / "a" / "b" / "o"
    ok(port("--from", "hf", "--to", "hf", str(DIRECTORY / "llama"), str(dst)))
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]  # fmt: skip


@pytest.mark.parametrize("to", ["hf", "safetensors"])
def test_non_finite_tensor_of_a_model_folder_is_named(tmp_path, to):
    from safetensors.numpy import load_file

    src = tmp_path / "folder"
    shutil.copytree(DIRECTORY / "llama", src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.norm.weight"][2] = np.inf
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    refused(
        port("--from", "hf", "--to", to, str(src), str(tmp_path / "o")),
        "'model.norm.weight' holds 1 non-finite value(s)",
    )
    only(tmp_path, "folder")
