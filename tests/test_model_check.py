"""``multiattn conformance --model DIR``: a user's model folder on every framework against
transformers in float64 (conformance/model_check.py)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multiattn.conformance import model_check as mc

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)


# The folder is written by transformers in a process of its own: this process must not
# import a framework (later tests check that plotting imports none).
_MAKE_BERT = """
import sys, torch
from transformers import BertConfig, BertModel
torch.manual_seed(0)
config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=24, max_position_embeddings=16)
BertModel(config).save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "bert"
    proc = subprocess.run([sys.executable, "-c", _MAKE_BERT, str(path)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def test_compare_uses_real_positions_only_and_scales_by_the_reference():
    want = {"last_hidden_state": np.array([[[1.0, -4.0], [2.0, 2.0]], [[1.0, 1.0], [9.0, 9.0]]])}
    got = {"last_hidden_state": want["last_hidden_state"].copy()}
    got["last_hidden_state"][0, 0, 1] += 0.04  # a real position: counted
    got["last_hidden_state"][1, 1] = 1e6  # padding: ignored
    mask = np.array([[1, 1], [1, 0]])
    row = mc.compare(got, want, {"attention_mask": mask})["last_hidden_state"]
    assert row["max_abs"] == pytest.approx(0.04)
    assert row["relative"] == pytest.approx(0.04 / 4.0)  # 9.0 sits at the padding
    ids = {"generated_ids": np.array([[1, 2, 3], [4, 5, 6]])}
    other = {"generated_ids": np.array([[1, 2, 3], [4, 0, 6]])}
    assert mc.compare(other, ids, {})["generated_ids"]["token_match"] == pytest.approx(5 / 6)


@pytest.mark.parametrize("arch,side", [("BertModel", "right"), ("LlamaForCausalLM", "left")])
def test_inputs_pad_the_second_row_on_the_models_side(arch, side):
    config = {"vocab_size": 7, "architectures": [arch], "type_vocab_size": 2}
    x = mc.make_inputs(config, ("input_ids", "attention_mask", "token_type_ids"), 2, 5, 0)
    assert x["input_ids"].shape == (2, 5) and x["input_ids"].max() < 7
    assert x["attention_mask"][0].all()
    padded = x["attention_mask"][1]
    assert list(padded) == ([0, 0, 1, 1, 1] if side == "left" else [1, 1, 1, 0, 0])
    assert set(np.unique(x["token_type_ids"])) <= {0, 1}
    images = mc.make_inputs({"image_size": 8, "num_channels": 3}, ("pixel_values",), 2, 5, 0)
    assert images["pixel_values"].shape == (2, 3, 8, 8)


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "multiattn.cli", "conformance", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_a_folder_agrees_on_numpy_torch_and_paddle(bert_folder, tmp_path):
    report_path = tmp_path / "r.json"
    proc = _cli("--model", str(bert_folder), "--frameworks", "numpy,torch,paddle",
                "--json", str(report_path), "--timeout", "300")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["model_type"] == "bert" and report["reference"] == "transformers, float64"
    for name in ("numpy", "torch", "paddle"):
        res = report["frameworks"][name]
        assert res["status"] == "ran" and res["agree"], res
        assert set(res["outputs"]) == {"last_hidden_state", "pooler_output"}
        assert all(r["relative"] < 1e-5 for r in res["outputs"].values())
    assert "agrees" in proc.stdout


def test_bad_arguments_are_refused_by_name(tmp_path):
    proc = _cli("--model", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "--model" in proc.stderr and "not a folder" in proc.stderr
    proc = _cli("--model", str(tmp_path), "--frameworks", "mxnet")
    assert proc.returncode == 2 and "mxnet" in proc.stderr
    proc = _cli("--model", str(tmp_path), "--frameworks", "numpy")
    assert proc.returncode != 0 and "no config.json" in proc.stderr


def test_hostile_folders_and_unwritable_reports_are_refused_before_any_run(bert_folder, tmp_path):
    folder = tmp_path / "hostile"
    shutil.copytree(bert_folder, folder)
    (folder / "model.safetensors").unlink()
    index = {"weight_map": {"embeddings.word_embeddings.weight": "../../../../../etc/passwd"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = _cli("--model", str(folder), "--frameworks", "numpy")
    assert proc.returncode == 2 and "outside the model folder" in proc.stderr
    assert "Traceback" not in proc.stderr  # multiattn's check ran before transformers'
    proc = _cli("--model", str(bert_folder), "--json", str(tmp_path / "no" / "such" / "r.json"))
    assert proc.returncode == 2 and "--json" in proc.stderr


def test_jobs_a_worker_did_not_finish_are_reported_and_finished_ones_kept(tmp_path):
    inputs = {"input_ids": np.zeros((1, 3), np.int64)}
    jobs = mc._jobs([{"name": n, "model": tmp_path, "inputs": inputs, "tokens": 0}
                     for n in ("done", "left")], tmp_path / "jobs")  # fmt: skip
    (tmp_path / "numpy-done.json").write_text('{"status": "ran"}')  # an earlier run's
    ran = mc._run_worker("numpy", jobs, "float32", 0.5, tmp_path)  # killed while importing
    assert {n: r[0]["status"] for n, r in ran.items()} == {"done": "hung", "left": "hung"}
    assert "0.5s" in ran["left"][0]["reason"]
    done, left = ({"out": str(tmp_path / f"numpy-{n}.npz"),
                   "status": str(tmp_path / f"numpy-{n}.json")} for n in ("done", "left"))  # fmt: skip
    np.savez(done["out"], logits=np.ones(2))
    Path(done["status"]).write_text(json.dumps({"status": "ran"}))
    crashed = mc._crashed(-11, b"Fatal Python error: Segmentation fault\n")
    assert mc._job_result(done, crashed)[0] == {"status": "ran"}
    assert mc._job_result(done, crashed)[1]["logits"].tolist() == [1.0, 1.0]
    assert mc._job_result(left, crashed)[0] == {
        "status": "crashed",
        "reason": "exit -11: Fatal Python error: Segmentation fault",
    }


def test_a_worker_reports_each_job_whether_it_ran_or_failed(bert_folder, tmp_path):
    inputs = mc.make_inputs(mc._config(bert_folder), ("input_ids",), 1, 4, 0)
    cases = [{"name": "bert", "model": bert_folder, "inputs": inputs, "tokens": 0},
             {"name": "empty", "model": tmp_path, "inputs": inputs, "tokens": 0}]  # fmt: skip
    ran = mc._run_worker("numpy", mc._jobs(cases, tmp_path / "jobs"), "float32", 300, tmp_path)
    assert ran["bert"][0] == {"status": "ran"} and ran["bert"][1]["last_hidden_state"].ndim == 3
    assert ran["empty"][0]["status"] == "error" and ran["empty"][1] == {}


def test_without_transformers_the_reference_is_numpy_in_float64(bert_folder, monkeypatch, capsys):
    def missing(*args, **kwargs):
        raise ImportError("no transformers")

    monkeypatch.setattr(mc, "transformers_reference", missing)
    args = mc._parser().parse_args(["--model", str(bert_folder), "--tokens", "0"])
    args.frameworks = ["numpy"]
    report = mc.check_model(args)
    assert report["reference"] == "multiattn on NumPy, float64"
    said = capsys.readouterr().err.splitlines()[0]  # said first, not only in the table title
    assert "transformers is not installed" in said and "multiattn[hf]" in said
    res = report["frameworks"]["numpy"]
    assert res["status"] == "ran" and res["agree"], res
    # float32 against float64 of the same definition: rounding apart, not equal
    assert all(0 < r["relative"] < 1e-5 for r in res["outputs"].values())


def _family_case(name: str) -> tuple[dict, dict]:
    from multiattn.conformance import families

    folder = families.DIRECTORY / name
    return json.loads((folder / "config.json").read_text()), families.load_expected(folder)[0]


def test_float64_bounds_follow_what_transformers_computes_in_float32():
    eps = 2.0**-23  # float32's spacing at 1
    # Llama (1 layer, prompt of 6): transformers rounds 3 RMS norms and 1 layer of rotary
    # angles (up to position 5, an error growing with the position) to float32
    config, inputs = _family_case("llama")
    assert config["num_hidden_layers"] == 1 and inputs["input_ids"].shape[1] == 6
    bound = mc.tolerance(config, inputs, "float64", "torch", "transformers")
    assert bound["tolerance"] == pytest.approx(1e-9 + 8 * eps * (3 + 6))
    assert "3 RMS norms" in bound["basis"] and "6 rotary angles" in bound["basis"]
    assert 2.9e-7 < bound["tolerance"] < 1e-4  # the measured error passes, a real bug fails
    longer = {**inputs, "input_ids": np.zeros((2, 101), np.int64)}
    assert mc.tolerance(config, longer, "float64", "torch", "transformers")["tolerance"] == (
        pytest.approx(1e-9 + 8 * eps * (3 + 101))
    )
    # T5 (1 layer each side): the variances of 2 + 1 encoder and 3 + 1 decoder norms
    config, inputs = _family_case("t5")
    bound = mc.tolerance(config, inputs, "float64", "jax", "transformers")
    assert bound["tolerance"] == pytest.approx(1e-9 + 8 * eps * 7)
    # GPT-2 and BERT: transformers stays in float64, so does the bound
    for name in ("gpt2", "bert"):
        config, inputs = _family_case(name)
        assert mc.tolerance(config, inputs, "float64", "paddle", "transformers") == {
            "tolerance": 1e-9,
            "basis": "1.0e-09 float64 arithmetic",
        }


def test_float64_bounds_follow_the_frameworks_own_arithmetic():
    config, inputs = _family_case("bert")
    # TensorFlow's float64 exact GELU is off by up to about 5e-9 (one per layer)
    tf = mc.tolerance(config, inputs, "float64", "tensorflow", "transformers")
    assert tf["tolerance"] == pytest.approx(1e-9 + 8 * 5.1e-9) and "GELU" in tf["basis"]
    # Keras' NumPy backend computes float64 in float32: float32's bound
    assert mc.tolerance(config, inputs, "float64", "numpy", "transformers")["tolerance"] == 1e-4
    assert mc.tolerance(config, inputs, "float32", "jax", "transformers")["tolerance"] == 1e-4
    # without transformers the reference is that same float32 arithmetic
    fallback = mc.tolerance(config, inputs, "float64", "jax", "numpy")
    assert fallback["tolerance"] == pytest.approx(1e-9 + 1e-4)


def test_the_console_names_each_bound_and_the_first_line_of_each_failure():
    rows = {
        "llama": {
            "jax": {"status": "ran", "agree": True, "tolerance": 8.6e-6, "basis": "b1"},
            "torch": {"status": "ran", "agree": True, "tolerance": 8.6e-6, "basis": "b1"},
            "numpy": {
                "status": "ran",
                "agree": False,
                "tolerance": 1e-4,
                "basis": "b2",
                "outputs": {"logits": {"max_abs": 1.0, "relative": 0.5}},
            },
            "paddle": {"status": "error", "reason": "ValueError: bad\nsecond line"},
        }
    }
    lines = mc.bound_lines(rows)
    assert "bound for llama on jax, torch: 8.6e-06 (b1)" in lines
    assert "bound for llama on numpy: 1.0e-04 (b2)" in lines
    assert "FAILED llama on numpy: logits: relative error 5.00e-01 > 1.0e-04" in lines
    assert "FAILED llama on paddle: ValueError: bad" in lines
    assert not any("second line" in line for line in lines)


def test_a_float64_t5_folder_agrees_with_transformers_under_the_bound_it_names(tmp_path):
    from multiattn.conformance import families

    report_path = tmp_path / "r.json"
    proc = _cli("--model", str(families.DIRECTORY / "t5"), "--frameworks", "torch",
                "--dtype", "float64", "--json", str(report_path), "--timeout", "300")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(report_path.read_text())["frameworks"]["torch"]
    assert res["agree"] and "RMS norm variances" in res["basis"]
    assert max(r["relative"] for r in res["outputs"].values() if "relative" in r) > 1e-9
    assert "bound for" in proc.stdout and "RMS norm variances" in proc.stdout


def test_a_length_past_the_models_context_is_refused_with_the_reason(bert_folder):
    """The context is read from the folder before any worker runs: the reason is the
    whole message, not a framework's wrapper around it."""
    context = json.loads((bert_folder / "config.json").read_text())["max_position_embeddings"]
    proc = _cli("--model", str(bert_folder), "--length", str(context + 1))
    assert proc.returncode == 2
    assert f"pass the model's context of {context} positions" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_non_finite_weight_is_refused_before_transformers_reads_the_folder(bert_folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "nan"
    shutil.copytree(bert_folder, folder)
    state = load_file(folder / "model.safetensors")
    state["embeddings.word_embeddings.weight"][2, 3] = np.nan
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    proc = _cli("--model", str(folder), "--frameworks", "numpy")
    assert proc.returncode == 2
    assert "'embeddings.word_embeddings.weight' holds 1 non-finite value(s)" in proc.stderr
    assert "Loading weights" not in proc.stderr  # transformers never started
