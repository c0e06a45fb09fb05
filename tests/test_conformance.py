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


def test_every_target_passes_every_case(tmp_path):
    report = tmp_path / "report.json"
    html = tmp_path / "report.html"
    proc = run_conformance("--require-all", "--json", str(report), "--html", str(html))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads(report.read_text())
    assert {t for t, r in data["targets"].items() if r["status"] == "ran"} == {
        "keras-jax",
        "keras-torch",
        "keras-tensorflow",
        "keras-numpy",
        "paddle",
        "adapter-torch",
        "adapter-tensorflow",
        "adapter-paddle",
    }
    ran = [e for r in data["targets"].values() for e in r["cases"] if e["status"] == "pass"]
    assert len(ran) > 500
    assert "<table>" in html.read_text()


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
    for name in ("keras-jax", "paddle", "adapter-torch", "adapter-tensorflow", "adapter-paddle"):
        assert name in proc.stdout
