"""The conformance suite: fixtures match the oracle, the runner passes on every target,
fails (naming the case) on a perturbed fixture, and runs a user's own target. It cannot
be fooled (edited fixtures are reported as tampered, a selection of no case fails) and
never waits forever (a hung target is killed after --timeout, Ctrl-C stops the workers)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from _xla_flags import fast_compile_env, without_fast_compile
from multiattn.conformance import fixtures
from multiattn.conformance.departures import keep_mask, recorded
from multiattn.conformance.generate import check

ROOT = Path(__file__).resolve().parent.parent


def run_conformance(
    *args: str, env: dict | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """The runner in a subprocess; ``timeout`` bounds the test, not the runner."""
    return subprocess.run(
        [sys.executable, "-m", "multiattn.conformance", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
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
    poisoned = np.array([np.nan, 1.0])  # NaN inputs of the poisoned cases
    assert _same("input/key", poisoned, poisoned.copy(), 1.0)
    assert not _same("input/key", poisoned, np.array([np.nan, 2.0]), 1.0)


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


#: one case of every kind (float32, and the half-precision layer), run on keras-jax with
#: XLA's default compiler options
DEFAULT_COMPILE_CASES = (
    "masked_softmax_mask_f32", "scores_additive_f32", "sdpa_mask_f16",
    "sdpa_blockwise_everything_f32", "sdpa_gqa_causal_lens_f32", "mha_masked_rows_f32",
    "mha_contiguous_bf16", "mha_gqa_self_causal_rope_f32", "positional_interleaved_f32",
    "encoder_pre_ln_f32", "rope_offset_3_f32", "rms_norm_scale_f32", "cache_gqa_rope_f32",
    "decoder_pre_ln_gqa_rope_f32", "cache_decoder_pre_ln_gqa_rope_f32",
)  # fmt: skip


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One run of every target (the suite's longest step), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("full")
    report, html = tmp / "report.json", tmp / "report.html"
    # --timeout: a bound for a hung target; keras-jax compiles every case (slow CPUs,
    # busy machines). XLA compiles quickly here (`_xla_flags`); XLA's defaults:
    # test_keras_jax_with_xla_defaults
    proc = run_conformance("--require-all", "--json", str(report), "--html", str(html),
                           "--timeout", "3600", env=fast_compile_env(),
                           timeout=3 * 3600)  # fmt: skip
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
        "paddle-layers",
        "adapter-torch",
        "adapter-tensorflow",
        "adapter-paddle",
        *NATIVE,
    }
    ran = [e for r in data["targets"].values() for e in r["cases"] if e["status"] == "pass"]
    assert len(ran) > 500
    assert "<table>" in html.read_text()
    assert "frameworks' own layers" in proc.stdout


def test_keras_jax_with_xla_defaults(tmp_path):
    """The core compiled by XLA as users run it (the full run compiles quickly): a case
    of every kind passes, forward and gradients."""
    report = tmp_path / "report.json"
    proc = run_conformance("--targets", "keras-jax", "--require-all", "--json", str(report),
                           "--cases", ",".join(DEFAULT_COMPILE_CASES),
                           env={"XLA_FLAGS": without_fast_compile()}, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    cases = json.loads(report.read_text())["targets"]["keras-jax"]["cases"]
    assert sorted(e["case"] for e in cases) == sorted(DEFAULT_COMPILE_CASES)
    assert {e["status"] for e in cases} == {"pass"}


def test_native_targets_agree_except_on_recorded_departures(full_run):
    _, data, _ = full_run
    assert {row["target"] for row in data["native"]} == NATIVE
    for row in data["native"]:
        assert row["fail"] == 0, row
        assert row["agree"] > 0, row
    statuses = {(t, e["case"]): e["status"] for t in NATIVE for e in data["targets"][t]["cases"]}
    # the oracle's zeros for an empty row are what torch's SDPA gives: it agrees everywhere
    # except where NaN or inf in masked keys and values reaches its output
    cases = {c.name: c for c in fixtures.load()}
    torch_sdpa = {
        (c, s) for (t, c), s in statuses.items() if t == "native-torch" and c.startswith("sdpa")
    }
    assert {s for c, s in torch_sdpa if not recorded("native-torch", cases[c])} == {"pass"}
    assert {s for c, s in torch_sdpa if recorded("native-torch", cases[c])} == {"depart"}
    # in float32 a layer departs only on a case with a fully masked row, poisoned rows or a
    # recorded error
    for (target, name), status in statuses.items():
        if status == "depart" and name.endswith("_f32"):
            case = cases[name]
            has_empty_row = bool((~keep_mask(case).any(axis=-1)).any())
            poisoned = not np.isfinite(case.inputs.get("key", 0.0)).all()
            assert has_empty_row or poisoned or recorded(target, case).raises, (target, name)


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
        ("native-torch", "sdpa_poisoned_nan_f32", ["output nan on 4 poisoned rows"]),
        ("native-torch", "sdpa_blockwise_poisoned_inf_bf16", ["output nan on 4 poisoned rows"]),
        ("native-jax", "sdpa_poisoned_inf_f32", ["output nan on 4 poisoned rows"]),
        ("native-jax", "sdpa_poisoned_huge_f32", ["output uniform on 1 empty rows"]),
    ],
)
def test_recorded_departures_occur(full_run, target, case, words):
    _, data, _ = full_run
    event = next(e for e in data["targets"][target]["cases"] if e["case"] == case)
    assert event["status"] == "depart", event
    for word in words:
        assert word in event["reason"], event["reason"]


def perturbed_fixtures(tmp_path: Path, case_name: str, key: str, rename: str = "my_") -> Path:
    """A copy of the fixtures where one expected array of one case is off by 10%, and that
    case renamed ``rename + case_name`` (a case of one's own: a case that keeps a shipped
    name must be the shipped case)."""
    out = tmp_path / "perturbed"
    shutil.copytree(fixtures.DEFAULT_DIR, out)
    manifest = json.loads((out / "manifest.json").read_text())
    meta = next(c for c in manifest["cases"] if c["name"] == case_name)
    path = out / meta["file"]
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    arrays[f"{case_name}/{key}"] = arrays[f"{case_name}/{key}"] * 1.1 + 0.01
    for array in meta["arrays"]:
        arrays[f"{rename}{case_name}/{array}"] = arrays.pop(f"{case_name}/{array}")
    meta["name"] = rename + case_name
    np.savez_compressed(path, **arrays)
    manifest["files"][meta["file"]] = fixtures.sha256_of(path)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_runner_fails_and_names_the_case_on_a_perturbed_fixture(tmp_path):
    bad = perturbed_fixtures(tmp_path, "sdpa_causal_cross_f32", "expected/output")
    proc = run_conformance(
        "--targets", "keras-numpy", "--fixtures", str(bad), "--cases", "sdpa_*_f32,my_sdpa_*"
    )
    assert proc.returncode == 1, proc.stdout
    assert "my_sdpa_causal_cross_f32" in proc.stdout
    assert "FAILED" in proc.stdout
    assert f"fixtures of your own: {bad}" in proc.stdout.replace("\n", "")


def test_tolerance_override_from_the_command_line(tmp_path):
    bad = perturbed_fixtures(tmp_path, "sdpa_causal_cross_f32", "expected/output")
    proc = run_conformance(
        "--targets",
        "keras-numpy",
        "--fixtures",
        str(bad),
        "--cases",
        "my_sdpa_causal_cross_f32",
        "--tolerance",
        "float32=0.5",
    )
    assert proc.returncode == 0, proc.stdout
    assert "tolerance overrides" in proc.stdout


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


# --- fooled or hung: tampered fixtures, empty selections, hung targets, Ctrl-C ----------

FAKE_TARGETS = '''
"""Misbehaving user targets for the runner's tests."""
import os
import subprocess
import sys
import time
from pathlib import Path


class Hang:
    """Starts a child process, notes both pids, then hangs (bounded, in case nothing
    kills it)."""

    name = "hang"

    def run(self, case):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        Path(os.environ["FAKE_TARGET_NOTE"]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(300)
        return {}


class Crash:
    name = "crash"

    def run(self, case):
        os._exit(7)


class Forge:
    """Tries to forge a passing case on stdout, then answers nonsense."""

    name = "forge"

    def run(self, case):
        print('{"event": "case", "case": "%s", "family": "x", "dtype": "float32", '
              '"status": "pass", "metrics": {}}' % case.name, flush=True)
        return {"output": case.expected["output"] + 1.0}


class Raise:
    name = "raise"

    def run(self, case):
        raise ValueError("the kernel refused this mask\\nsecond line of the message")


class NoCase:
    name = "no-case"

    def supports(self, case):
        return "supports nothing"

    def run(self, case):
        raise AssertionError("never called")
'''


@pytest.fixture
def fake_targets(tmp_path):
    """Environment for the runner in which ``fake_targets:<Class>`` can be imported, and the
    file where the Hang target notes its pids."""
    (tmp_path / "fake_targets.py").write_text(textwrap.dedent(FAKE_TARGETS))
    note = tmp_path / "pids"
    return {"PYTHONPATH": str(tmp_path), "FAKE_TARGET_NOTE": str(note)}, note


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def assert_dead(pids: list[int], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in pids if alive(p)]
    for pid in survivors:  # clean up what the test started before failing
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"still running: {survivors}"


def tampered_copy(tmp_path: Path, case_name: str, tolerance: float) -> Path:
    """A copy of the shipped fixtures in which one case has garbage expected values and a
    tolerance loose enough to pass them, with every sha256 in the manifest updated to
    match: all an editor of the files could do."""
    out = tmp_path / "tampered"
    shutil.copytree(fixtures.DEFAULT_DIR, out)
    manifest = json.loads((out / "manifest.json").read_text())
    meta = next(c for c in manifest["cases"] if c["name"] == case_name)
    meta["tolerance"] = {"output": tolerance, "grad": tolerance}
    path = out / meta["file"]
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    key = f"{case_name}/expected/output"
    arrays[key] = np.full_like(arrays[key], 42.0)
    np.savez_compressed(path, **arrays)
    manifest["files"][meta["file"]] = fixtures.sha256_of(path)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def test_the_shipped_manifest_is_pinned_by_the_code():
    manifest = fixtures.read_manifest(fixtures.DEFAULT_DIR)
    assert fixtures.manifest_digest(manifest) == fixtures.pinned_digest()
    verified = fixtures.verify()
    assert verified.shipped and verified.tampered == {}


def test_edited_tolerances_in_the_shipped_fixtures_are_refused(tmp_path, monkeypatch, capsys):
    """Garbage expected values with a tolerance to match, and every sha256 of the manifest
    updated: the manifest no longer has the digest pinned in the code, nothing runs."""
    from multiattn.conformance import runner

    copy = tampered_copy(tmp_path, "masked_softmax_plain_f32", 1e9)
    monkeypatch.setattr(fixtures, "DEFAULT_DIR", copy)  # as if the shipped files were edited
    with pytest.raises(fixtures.TamperedError, match="pins"):
        fixtures.verify()
    with pytest.raises(fixtures.TamperedError):
        fixtures.load(names={"masked_softmax_plain_f64"})
    code = runner.main(["--targets", "keras-numpy", "--cases", "masked_softmax_plain_f32"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "TAMPERED" in out and "nothing ran" in out
    assert "passed" not in out


def test_edited_tolerances_in_a_copied_fixture_directory_are_refused(tmp_path):
    """In a directory of one's own, a case that keeps a shipped case's name must be that
    case: the edited one is reported as tampered, the others still run and pass."""
    copy = tampered_copy(tmp_path, "masked_softmax_plain_f32", 1e9)
    verified = fixtures.verify(copy)
    assert not verified.shipped
    assert set(verified.tampered) == {"masked_softmax_plain_f32"}
    assert "tolerance" in verified.tampered["masked_softmax_plain_f32"]
    proc = run_conformance(
        "--targets", "keras-numpy", "--fixtures", str(copy), "--cases", "masked_softmax_plain_*"
    )
    assert proc.returncode == 1, proc.stdout
    lines = [line for line in proc.stdout.splitlines() if "TAMPERED" in line]
    assert len(lines) == 1 and "masked_softmax_plain_f32" in lines[0], proc.stdout
    assert "every case of every target that ran passed" not in proc.stdout
    assert "2 case runs" in proc.stdout  # f16 and bf16 (keras-numpy runs no float64)
    # the arrays alone (same tolerance, expected values of another case) are caught too
    manifest = json.loads((copy / "manifest.json").read_text())
    shipped = {c["name"]: c for c in fixtures.read_manifest(fixtures.DEFAULT_DIR)["cases"]}
    for meta in manifest["cases"]:
        meta["tolerance"] = shipped[meta["name"]]["tolerance"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert "arrays' values" in fixtures.verify(copy).tampered["masked_softmax_plain_f32"]


def test_a_tampered_archive_is_reported_as_tampered_not_as_a_crash(tmp_path):
    copy = tmp_path / "fx"
    shutil.copytree(fixtures.DEFAULT_DIR, copy)
    archive = copy / "sdpa.npz"
    data = archive.read_bytes()
    archive.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    proc = run_conformance(
        "--targets",
        "keras-numpy",
        "--fixtures",
        str(copy),
        "--cases",
        "masked_softmax_plain_f32,sdpa_self_f32",
    )
    assert proc.returncode == 1, proc.stdout
    assert "crash" not in proc.stdout.lower(), proc.stdout
    tampered = [line for line in proc.stdout.splitlines() if line.startswith("TAMPERED")]
    assert len(tampered) == 1, proc.stdout
    assert "sdpa.npz" in tampered[0] and "sha256" in tampered[0] and "1 selected" in tampered[0]
    assert "1 case runs" in proc.stdout  # masked_softmax_plain_f32 still ran
    # nothing but tampered cases selected: no target runs at all
    proc = run_conformance("--fixtures", str(copy), "--cases", "sdpa_self_f32")
    assert proc.returncode == 1 and "every selected case is tampered" in proc.stdout


def test_a_worker_that_meets_tampered_fixtures_reports_them(tmp_path):
    """A worker checks the fixtures itself: the manifest the runner verified, and every
    archive it loads (here: changed after the runner checked them)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "multiattn.conformance.worker",
            "--target",
            "multiattn.conformance.target_core:CoreTarget",
            "--cases",
            "masked_softmax_plain_f32",
            "--manifest-sha256",
            "0" * 64,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": "numpy"},
        timeout=600,
    )
    assert proc.returncode == 3, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [e["event"] for e in events] == ["tampered"]
    assert "changed since the run started" in events[0]["reason"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cases", "no_such_case_*"], "selects none of the"),
        (["--cases", ","], "selects none of the"),
        (["--targets", ","], "--targets names no target"),
        (["--timeout", "0"], "--timeout must be a positive number"),
        (["--timeout", "nan"], "--timeout must be a positive number"),
    ],
)
def test_a_selection_of_nothing_is_a_usage_error(args, message):
    proc = run_conformance(*args)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_manifest_without_cases_is_an_error(tmp_path):
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format": fixtures.FORMAT, "oracle_version": "1", "files": {}, "cases": []})
    )
    proc = run_conformance("--targets", "keras-numpy", "--fixtures", str(tmp_path))
    assert proc.returncode == 2, proc.stdout
    assert "lists no case" in proc.stderr


def test_a_run_in_which_no_case_ran_fails(fake_targets):
    env, _ = fake_targets
    proc = run_conformance("--target", "fake_targets:NoCase", "--cases", "sdpa_self_*", env=env)
    assert proc.returncode == 1, proc.stdout
    assert "no case ran" in proc.stdout
    assert "passed" not in proc.stdout


def test_a_hung_target_is_killed_with_its_children_and_reported(fake_targets):
    env, note = fake_targets
    start = time.monotonic()
    proc = run_conformance(
        "--target",
        "fake_targets:Hang",
        "--targets",
        "keras-numpy",
        "--cases",
        "masked_softmax_plain_f32",
        "--timeout",
        "30",  # far more than the worker needs to start on a busy machine
        "--json",
        str(note.with_name("report.json")),
        env=env,
        timeout=280,  # the hang sleeps 300 s: only the runner's --timeout ends it sooner
    )
    assert time.monotonic() - start < 250
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "HUNG" in proc.stdout and "hung targets: user-1:fake_targets:Hang" in proc.stdout
    report = json.loads(note.with_name("report.json").read_text())
    hung = report["targets"]["user-1:fake_targets:Hang"]
    assert hung["status"] == "hung"
    assert (
        hung["reason"]
        == "killed after 30s (--timeout) in case masked_softmax_plain_f32 (0 of 1 cases reported)"
    )
    assert report["targets"]["keras-numpy"]["status"] == "ran"  # the others are unaffected
    assert_dead([int(pid) for pid in note.read_text().split()])


def test_a_crashing_user_target_is_reported(fake_targets):
    env, note = fake_targets
    report = note.with_name("report.json")
    proc = run_conformance(
        "--target",
        "fake_targets:Crash",
        "--target",
        "fake_targets:Missing",
        "--cases",
        "masked_softmax_plain_f32",
        "--json",
        str(report),
        env=env,
    )
    assert proc.returncode == 1, proc.stdout
    assert "crashed targets: user-1:fake_targets:Crash, user-2:fake_targets:Missing" in proc.stdout
    targets = json.loads(report.read_text())["targets"]
    crash, missing = targets["user-1:fake_targets:Crash"], targets["user-2:fake_targets:Missing"]
    assert crash["status"] == missing["status"] == "crashed"
    assert crash["reason"].startswith("exit code 7 in case masked_softmax_plain_f32")
    assert missing["reason"].startswith("exit code 1 while starting")
    assert "Missing" in missing["reason"]  # the AttributeError from the stderr tail


def test_a_target_cannot_forge_events_on_stdout(fake_targets):
    env, _ = fake_targets
    proc = run_conformance(
        "--target", "fake_targets:Forge", "--cases", "masked_softmax_plain_f32", env=env
    )
    assert proc.returncode == 1, proc.stdout
    assert "FAILED user-1:fake_targets:Forge masked_softmax_plain_f32" in proc.stdout


def test_ctrl_c_stops_the_workers_and_exits_130(fake_targets):
    env, note = fake_targets
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "multiattn.conformance",
            "--target",
            "fake_targets:Hang",
            "--cases",
            "masked_softmax_plain_f32",
            "--timeout",
            "600",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        # as from a terminal, even when this test runs where SIGINT is ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not note.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert note.exists(), "the hanging target never started"
        time.sleep(0.5)  # the pids are written
        pids = [int(pid) for pid in note.read_text().split()]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "interrupted" in err and "user-1:fake_targets:Hang" in err
    assert "Traceback" not in out + err
    assert_dead(pids, within=10)


def test_generating_the_shipped_fixtures_updates_the_pin(tmp_path, monkeypatch):
    """The generator rewrites the pin with the fixtures; --check reports a stale pin."""
    from multiattn.conformance import fixtures_pin, generate
    from multiattn.conformance.cases import VARIANTS, expand

    shipped = tmp_path / "fixtures"
    monkeypatch.setattr(fixtures, "DEFAULT_DIR", shipped)
    monkeypatch.setattr(fixtures, "PIN_FILE", tmp_path / "fixtures_pin.py")
    monkeypatch.setattr(fixtures_pin, "MANIFEST_SHA256", fixtures_pin.MANIFEST_SHA256)
    monkeypatch.setattr(generate, "build_all", lambda: expand(VARIANTS[0]))
    assert generate.main(["--out", str(shipped)]) == 0
    digest = fixtures.manifest_digest(fixtures.read_manifest(shipped))
    assert f'MANIFEST_SHA256 = "{digest}"' in (tmp_path / "fixtures_pin.py").read_text()
    assert fixtures.verify().shipped
    assert generate.check(shipped) == []
    monkeypatch.setattr(fixtures_pin, "MANIFEST_SHA256", "0" * 64)  # a pin left stale
    assert any("regenerate the fixtures to update the pin" in p for p in generate.check(shipped))
    with pytest.raises(fixtures.TamperedError, match="pins"):
        fixtures.verify()


def test_the_console_gives_the_first_line_of_each_failures_reason(fake_targets):
    env, _ = fake_targets
    proc = run_conformance("--target", "fake_targets:Raise", "--target", "fake_targets:Forge",
                           "--cases", "masked_softmax_plain_f32", env=env)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())  # the console may wrap a long line
    assert "FAILED user-1:fake_targets:Raise masked_softmax_plain_f32: ValueError: the kernel " \
           "refused this mask" in out  # fmt: skip
    assert "second line" not in out  # the rest is in --json
    assert "FAILED user-2:fake_targets:Forge masked_softmax_plain_f32: output: relative " \
           "error" in out  # fmt: skip


def test_help_names_the_whole_model_checks_and_what_target_runs():
    proc = run_conformance("--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for option in ("--model", "--families", "--frameworks", "--dtype"):
        assert option in text
    assert "also run" not in text and "Only the targets given run" in text


@pytest.mark.parametrize("listing", ["--list-cases", "--list"])
def test_a_listing_whose_reader_has_gone_ends_quietly(listing):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line (as `| head` once it has read)
    try:
        proc = subprocess.run([sys.executable, "-m", "multiattn.conformance", listing],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)  # fmt: skip
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr
