"""The bad-input sweep (``docs/scripts/bad_input_sweep.py``): its classifier, its
catalogue, and whole runs on the numpy backend (structure only: how many invalid inputs
are refused clearly is the sweep's output, not a requirement here)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "scripts" / "bad_input_sweep.py"


def _load():
    spec = importlib.util.spec_from_file_location("bad_input_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sweep = _load()


def _run(tmp_path: Path, *args: str, selftest: bool = False, timeout: float = 300):
    env = dict(os.environ)
    env.pop(sweep.SELFTEST_ENV, None)
    if selftest:
        env[sweep.SELFTEST_ENV] = "1"
    report = tmp_path / "sweep.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(report), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    data = json.loads(report.read_text()) if report.exists() else None
    return proc, data


# --- the classifier ------------------------------------------------------------------------


class _Custom(ValueError):
    pass


@pytest.mark.parametrize(
    ("exc", "names", "want"),
    [
        (None, ("x",), "silent"),
        (ValueError("masked_softmax: `axis` must be an integer"), ("axis",), "clear"),
        (TypeError("f: `valid_lens` must hold integer lengths"), ("valid_lens",), "clear"),
        (_Custom("f: `scale` must be positive"), ("scale",), "clear"),
        (
            ValueError("`d_model` (10) must be divisible by `num_heads` (3)"),
            ("d_model", "num_heads"),
            "clear",
        ),
        (ValueError("f: `offset` must be a non-negative int"), ("cache_index",), "unclear"),
        (ValueError("Invalid dtype: object"), ("x",), "unclear"),
        (RuntimeError("f: `query` has the wrong shape"), ("query",), "unclear"),
        (IndexError("`offset` 8 is out of bounds"), ("offset",), "unclear"),
        (AttributeError("'NoneType' object has no attribute 'shape'"), ("query",), "unclear"),
        (ZeroDivisionError("float division by zero"), ("query",), "unclear"),
    ],
)
def test_classify(exc, names, want):
    assert sweep.classify(exc, names) == want


def test_argument_names_are_whole_words():
    assert sweep.names_argument("f: `key` must have width 8", ["key"])
    assert sweep.names_argument("received key (2, 4, 8)", ["key"])
    assert not sweep.names_argument("f: `key_dim` must be a positive integer", ["key"])
    assert not sweep.names_argument("f: `keys` must be", ["key"])
    assert not sweep.names_argument("f: `valid_lens` may not exceed", ["context_valid_lens"])
    assert not sweep.names_argument("positions 0..9 exceed max_length=8", ["x"])
    assert sweep.names_argument("MultiHeadAttention: `valid_lens` may not", ["valid_lens"])


def test_keras_argument_list_does_not_count_as_naming():
    """Keras appends the call's arguments to an exception leaving a layer: they name every
    argument and must not make an error clear."""
    wrapped = ValueError(
        "Exception encountered when calling MultiHeadAttention.call().\n\n"
        "\x1b[1mMultiHeadAttention: positions 6..6 exceed max_length=6 (`offset`=6).\x1b[0m\n\n"
        "Arguments received by MultiHeadAttention.call():\n"
        "  • query=np.ndarray(shape=(2, 1, 8), dtype=float32)\n"
        "  • cache_index=6"
    )
    assert sweep.classify(wrapped, ("cache_index",)) == "unclear"
    assert sweep.classify(wrapped, ("offset",)) == "clear"
    message = sweep.library_message(wrapped)
    assert "\x1b" not in message and "Arguments received" not in message
    assert message.endswith("(`offset`=6).")


# --- the catalogue -------------------------------------------------------------------------


def test_catalogue_is_well_formed():
    cases = [c for c in sweep.CASES if not c.id.startswith("_selftest")]
    assert 150 <= len([c for c in cases if c.surface in ("ops", "layers")]) <= 260
    assert len({c.id for c in cases}) == len(cases)
    surfaces = {c.surface for c in cases}
    assert surfaces == {"ops", "layers", *MODEL_SURFACES}
    for surface in MODEL_SURFACES:
        assert len([c for c in cases if c.surface == surface]) >= 5, surface
    assert all(c.args and all(isinstance(a, str) and a for a in c.args) for c in cases)
    targets = {c.target for c in cases}
    for needed in (
        "ops.masked_softmax",
        "ops.scaled_dot_product_attention",
        "ops.score_attention",
        "ops.additive_scores",
        "ops.general_scores",
        "ops.rotary_embedding",
        "ops.causal_mask",
        "ops.valid_lens_to_mask",
        "ops.sinusoidal_encoding",
        "ops.split_heads",
        "ops.merge_heads",
        "ops.layer_norm",
        "layers.MultiHeadAttention",
        "layers.MultiHeadAttention.call",
        "layers.MultiHeadAttention.init_cache",
        "layers.MultiHeadAttention(cache)",
        "layers.TransformerEncoderLayer",
        "layers.TransformerDecoderLayer",
        "layers.TransformerDecoderLayer.call",
        "layers.RotaryEmbedding",
        "layers.PositionEmbedding",
        "layers.PositionalEncoding",
        "layers.LayerNormalization",
        "layers.DotProductAttention",
        "layers.AdditiveAttention",
    ):
        assert needed in targets, needed
    paddle = [c for c in cases if c.paddle]
    assert paddle and not any(c.target.startswith(("layers.", "cli.")) for c in paddle)
    assert all(c.only == ("numpy",) for c in cases if c.target.startswith("cli."))


# --- whole runs ----------------------------------------------------------------------------

MODEL_SURFACES = ("model.call", "model.generate", "checkpoint.from_pretrained",
                  "checkpoint.save_pretrained", "cli.port", "cli.conformance")  # fmt: skip
#: The whole ops and layers catalogue, and a sample of the model surfaces (each of those
#: loads tiny transformers models; each CLI case is an interpreter of its own).
SAMPLE = ("ops.*", "layers.*", "model.call:bert_*", "model.generate:llama_top_*",
          "checkpoint.*", "cli.port:missing_folder", "cli.conformance:no_config_json")  # fmt: skip


def test_numpy_run_of_the_catalogue(tmp_path):
    """The ops and layers cases and a sample of the model surfaces (`SAMPLE`) on numpy."""
    args = [a for p in SAMPLE for a in ("--cases", p)]
    proc, data = _run(tmp_path, "--backends", "numpy", "--details", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Invalid inputs per backend" in proc.stdout
    assert {"started", "finished", "revision", "catalogue", "backends", "classification"} <= set(
        data
    )
    catalogue = {c["id"]: c for c in data["catalogue"]}
    assert len(catalogue) == len(sweep.cases_for("numpy", SAMPLE))
    assert {c["surface"] for c in catalogue.values()} == {"ops", "layers", *MODEL_SURFACES}
    assert "Runs per surface" in proc.stdout
    (backend,) = data["backends"]
    assert backend["backend"] == "numpy"
    assert backend["versions"]["keras_backend"] == "numpy"
    counts = backend["counts"]
    assert set(counts) == {"clear", "unclear", "silent", "not_run", "setup_error"}
    assert sum(counts.values()) == backend["cases"] == len(backend["results"]) == len(catalogue)
    # The harness's valid set-ups all work and every case ran to a verdict.
    assert counts["setup_error"] == 0 and counts["not_run"] == 0, backend["notes"]
    assert counts["clear"] > 0
    for r in backend["results"]:
        assert r["backend"] == "numpy"
        assert r["id"] in catalogue and r["args"] == catalogue[r["id"]]["args"]
        assert r["outcome"] in ("clear", "unclear", "silent")
        if r["outcome"] == "silent":
            assert "result" in r
        else:
            assert r["exc_type"] and "message" in r
        if r["outcome"] == "clear":
            assert sweep.names_argument(r["message"], r["args"])


def test_crash_and_setup_failure_are_reported(tmp_path):
    names = ("clear", "unclear", "silent", "setup_fails", "segfault", "after_the_segfault")
    args = ["--backends", "numpy"]
    for name in names:
        args += ["--cases", f"_selftest:{name}"]
    proc, data = _run(tmp_path, *args, selftest=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (backend,) = data["backends"]
    got = {r["id"].split(":")[1]: r for r in backend["results"]}
    assert list(got) == list(names)
    assert got["clear"]["outcome"] == "clear"
    assert got["unclear"]["outcome"] == "unclear"
    assert got["silent"]["outcome"] == "silent"
    assert got["setup_fails"]["outcome"] == "setup_error"
    assert got["segfault"]["outcome"] == "unclear" and got["segfault"]["exc_type"] == "crash"
    assert got["after_the_segfault"]["outcome"] == "clear"  # a fresh worker went on
    assert backend["counts"] == {
        "clear": 2,
        "unclear": 2,
        "silent": 1,
        "not_run": 0,
        "setup_error": 1,
    }
    assert any("crashed" in n for n in backend["notes"])


def test_hang_is_reported_at_the_backend_timeout(tmp_path):
    args = ["--backends", "numpy", "--cases", "_selftest:*hang", "--timeout", "20"]
    proc, data = _run(tmp_path, *args, selftest=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (backend,) = data["backends"]
    got = {r["id"].split(":")[1]: r for r in backend["results"]}
    assert got["hang"]["outcome"] == "unclear" and got["hang"]["exc_type"] == "timeout"
    assert got["after_the_hang"]["outcome"] == "not_run"
    assert any("timeout" in n for n in backend["notes"])
    assert backend["seconds"] < 60


@pytest.mark.parametrize(
    ("pattern", "strict", "code"),
    [
        ("_selftest:clear", True, 0),
        ("_selftest:silent", True, 1),
        ("_selftest:silent", False, 0),
    ],
)
def test_exit_code(tmp_path, pattern, strict, code):
    args = ["--backends", "numpy", "--cases", pattern] + (["--strict"] if strict else [])
    proc, _ = _run(tmp_path, *args, selftest=True)
    assert proc.returncode == code, proc.stdout + proc.stderr


def test_unknown_backend_is_a_usage_error(tmp_path):
    proc, _ = _run(tmp_path, "--backends", "mxnet")
    assert proc.returncode == 2
    assert "mxnet" in proc.stderr
