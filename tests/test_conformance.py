"""The conformance suite: fixtures match the oracle, the runner passes on every target,
fails (naming the case) on a perturbed fixture, and runs a user's own target."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multiattn.conformance import fixtures
from multiattn.conformance.departures import keep_mask, recorded
from multiattn.conformance.generate import check

ROOT = Path(__file__).resolve().parent.parent


def run_conformance(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "multiattn.conformance", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_fixtures_match_a_fresh_generation():
    assert check(fixtures.DEFAULT_DIR) == []


def test_fixture_check_tolerates_blas_rounding_only():
    """The drift check accepts the last-bit differences of another CPU's BLAS and
    nothing more: exact inputs, float64 outputs to 1e-13, gradients to 1e-8 of the
    case's largest gradient."""
    from multiattn.conformance.generate import EXPECTED_DRIFT, GRAD_DRIFT, _same

    x = np.linspace(-2.0, 3.0, 12)
    assert _same("input/q", x, x.copy(), 1.0)
    assert not _same("input/q", x, x + 1e-16 * 3, 1.0)
    assert _same("expected/output", x + 3.0 * EXPECTED_DRIFT / 4, x, 1.0)
    assert not _same("expected/output", x + 3.0 * EXPECTED_DRIFT * 2, x, 1.0)
    assert _same("grad/input/q", x + GRAD_DRIFT * 5.0 / 2, x, 5.0)
    assert not _same("grad/input/q", x + GRAD_DRIFT * 5.0 * 2, x, 5.0)
    inf = np.array([np.inf, 1.0])
    assert not _same("expected/output", np.array([1.0, 1.0]), inf, 1.0)


def test_fixtures_are_small_and_load_without_pickle():
    size = sum(p.stat().st_size for p in fixtures.DEFAULT_DIR.iterdir())
    assert size < 2 * 1024 * 1024
    cases = fixtures.load()
    assert len(cases) == len({c.name for c in cases}) > 100
    for path in fixtures.DEFAULT_DIR.glob("*.npz"):
        with np.load(path, allow_pickle=False) as archive:
            assert all(archive[k].dtype != object for k in archive.files)


def test_a_tampered_archive_is_refused(tmp_path):
    shutil.copytree(fixtures.DEFAULT_DIR, tmp_path / "fx")
    archive = tmp_path / "fx" / "sdpa.npz"
    archive.write_bytes(archive.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="sha256"):
        fixtures.load(tmp_path / "fx")


NATIVE = {
    "native-torch",
    "native-jax",
    "native-keras-jax",
    "native-keras-torch",
    "native-keras-tensorflow",
    "native-paddle",
}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One run of every target (the suite's longest step), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("full")
    report, html = tmp / "report.json", tmp / "report.html"
    proc = run_conformance("--require-all", "--json", str(report), "--html", str(html))
    data = json.loads(report.read_text()) if report.exists() else {}
    return proc, data, html


def test_every_target_passes_every_case(full_run):
    proc, data, html = full_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert {t for t, r in data["targets"].items() if r["status"] == "ran"} == {
        "keras-jax",
        "keras-torch",
        "keras-tensorflow",
        "keras-numpy",
        "paddle",
        "adapter-torch",
        "adapter-tensorflow",
        "adapter-paddle",
        *NATIVE,
    }
    ran = [e for r in data["targets"].values() for e in r["cases"] if e["status"] == "pass"]
    assert len(ran) > 500
    assert "<table>" in html.read_text()
    assert "frameworks' own layers" in proc.stdout


def test_native_targets_agree_except_on_recorded_departures(full_run):
    _, data, _ = full_run
    assert {row["target"] for row in data["native"]} == NATIVE
    for row in data["native"]:
        assert row["fail"] == 0, row
        assert row["agree"] > 0, row
    statuses = {(t, e["case"]): e["status"] for t in NATIVE for e in data["targets"][t]["cases"]}
    # the oracle's zeros for an empty row are what torch's SDPA gives: it agrees everywhere
    assert {
        s for (t, c), s in statuses.items() if t == "native-torch" and c.startswith("sdpa")
    } == {"pass"}
    # in float32 a layer departs only on a case with a fully masked row (or a recorded error)
    cases = {c.name: c for c in fixtures.load()}
    for (target, name), status in statuses.items():
        if status == "depart" and name.endswith("_f32"):
            has_empty_row = bool((~keep_mask(cases[name]).any(axis=-1)).any())
            assert has_empty_row or recorded(target, name).raises, (target, name)


@pytest.mark.parametrize(
    "target, case, words",
    [
        ("native-torch", "mha_masked_rows_f32", ["output nan", "weights nan"]),
        ("native-jax", "sdpa_lens_1d_f32", ["output uniform"]),
        ("native-jax", "mha_masked_rows_f32", ["output uniform"]),
        ("native-keras-tensorflow", "mha_masked_rows_f32", ["output uniform"]),
        ("native-keras-torch", "mha_masked_rows_f32", ["output uniform"]),
        ("native-paddle", "mha_masked_rows_f32", ["output uniform", "weights uniform"]),
        ("native-paddle", "mha_masked_rows_f64", ["output unmasked", "weights unmasked"]),
        ("native-jax", "sdpa_self_f64", ["off by"]),
        ("native-keras-jax", "mha_value_dim_f32", ["raises"]),
    ],
)
def test_recorded_departures_occur(full_run, target, case, words):
    _, data, _ = full_run
    event = next(e for e in data["targets"][target]["cases"] if e["case"] == case)
    assert event["status"] == "depart", event
    for word in words:
        assert word in event["reason"], event["reason"]


def perturbed_fixtures(tmp_path: Path, case_name: str, key: str) -> Path:
    """A copy of the fixtures where one expected array of one case is off by 10%."""
    out = tmp_path / "perturbed"
    shutil.copytree(fixtures.DEFAULT_DIR, out)
    manifest = json.loads((out / "manifest.json").read_text())
    meta = next(c for c in manifest["cases"] if c["name"] == case_name)
    path = out / meta["file"]
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    arrays[f"{case_name}/{key}"] = arrays[f"{case_name}/{key}"] * 1.1 + 0.01
    np.savez_compressed(path, **arrays)
    manifest["files"][meta["file"]] = fixtures.sha256_of(path)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_runner_fails_and_names_the_case_on_a_perturbed_fixture(tmp_path):
    bad = perturbed_fixtures(tmp_path, "sdpa_causal_cross_f32", "expected/output")
    proc = run_conformance(
        "--targets", "keras-numpy", "--fixtures", str(bad), "--cases", "sdpa_*_f32"
    )
    assert proc.returncode == 1, proc.stdout
    assert "sdpa_causal_cross_f32" in proc.stdout
    assert "FAILED" in proc.stdout


def test_tolerance_override_from_the_command_line(tmp_path):
    bad = perturbed_fixtures(tmp_path, "sdpa_causal_cross_f32", "expected/output")
    proc = run_conformance(
        "--targets",
        "keras-numpy",
        "--fixtures",
        str(bad),
        "--cases",
        "sdpa_causal_cross_f32",
        "--tolerance",
        "float32=0.5",
    )
    assert proc.returncode == 0, proc.stdout


def test_a_users_own_target(tmp_path):
    proc = run_conformance(
        "--target",
        "my_softmax_target:MySoftmax",
        "--cases",
        "masked_softmax_*",
        env={"PYTHONPATH": str(ROOT / "docs" / "examples")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "my_softmax_target:MySoftmax" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--targets", "mxnet"], "unknown target"),
        (["--tolerance", "float8=1"], "--tolerance"),
        (["--fixtures", "/nonexistent"], "--fixtures"),
        (["--target", "no_colon"], "MODULE:CALLABLE"),
    ],
)
def test_bad_arguments_are_usage_errors(args, message):
    proc = run_conformance(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_list_shows_every_builtin_target():
    proc = run_conformance("--list")
    assert proc.returncode == 0
    for name in (
        "keras-jax",
        "paddle",
        "adapter-torch",
        "adapter-tensorflow",
        "adapter-paddle",
        *NATIVE,
    ):
        assert name in proc.stdout
