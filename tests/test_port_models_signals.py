"""Stopping ``multiattn port`` while it writes a whole model (issue 48 items 7, 12): SIGTERM,
SIGINT and SIGHUP during ``--to hf`` remove the temporary folder, say so and exit with
128 + the signal number, as the single-file formats do; after SIGKILL the leftover (a
``.DST.tmp-PID-*`` folder, or for ``--to safetensors`` a
``.DST.multiattn-port.HOST.PID.XXXXXXXX.tmp`` file) is named as docs/porting.md says, and
the next run to the same destination removes it and says so."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _port_cli_support import ok, only, port
from multiattn.conformance.families import DIRECTORY

SRC = DIRECTORY / "llama"
FOLDER_TEMP = re.compile(r"\.out\.tmp-(\d+)-[A-Za-z0-9_]+")
FILE_TEMP = re.compile(r"\.out\.safetensors\.multiattn-port\.[A-Za-z0-9-]+\.(\d+)\.[a-z0-9_]+\.tmp")


def _stalled(dst: Path, to: str, marker: Path) -> tuple[subprocess.Popen, Path]:
    """``multiattn port --from hf SRC dst --to to`` whose safetensors writer writes half a
    file, says where (``marker``) and stalls (in short sleeps, so that the main thread
    runs signal handlers), to be stopped from outside; returns the process and the
    temporary path (the folder for ``--to hf``, else the file)."""
    script = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        import safetensors.numpy as stn
        from multiattn.port.cli import main
        for name in ("SIGTERM", "SIGINT", "SIGHUP"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        def stalling(tensors, filename, metadata=None):
            with open(filename, "wb") as fh:
                fh.write(b"half a file")
            pathlib.Path({str(marker)!r}).write_text(str(filename))
            for _ in range(2400):
                time.sleep(0.05)
        stn.save_file = stalling
        sys.exit(main(["--from", "hf", {str(SRC)!r}, {str(dst)!r}, "--to", {to!r}, "--force"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)
    written = Path(marker.read_text())
    temp = written.parent if to == "hf" else written
    pattern = FOLDER_TEMP if to == "hf" else FILE_TEMP
    match = pattern.fullmatch(temp.name)
    assert match and int(match.group(1)) == proc.pid, temp
    return proc, temp


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name
)
@pytest.mark.parametrize("existing", [False, True], ids=["new", "force"])
def test_signal_during_folder_write_removes_the_temporary_folder(tmp_path, sig, existing):
    out, marker = tmp_path / "out", tmp_path.parent / f"{tmp_path.name}.marker"
    if existing:
        out.mkdir()
        (out / "old.txt").write_text("old")
    proc, temp = _stalled(out, "hf", marker)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"multiattn port: error: interrupted by {sig.name} while writing; the temporary folder "
        "was removed. Nothing was written."
    )
    assert not temp.exists()
    if existing:
        only(out, "old.txt")
        only(tmp_path, "out")
    else:
        only(tmp_path)


@pytest.mark.parametrize("to", ["hf", "safetensors"])
def test_sigkill_leaves_the_documented_name_the_next_run_removes(tmp_path, to):
    out = tmp_path / ("out" if to == "hf" else "out.safetensors")
    proc, temp = _stalled(out, to, tmp_path.parent / f"{tmp_path.name}.marker")
    proc.kill()
    proc.communicate(timeout=60)
    assert temp.exists()  # nothing can run on SIGKILL
    done = ok(port("--from", "hf", str(SRC), str(out), "--to", to))
    assert f"multiattn port: removed {temp}, left by a killed run." in done.stderr
    assert not temp.exists()
    only(tmp_path, out.name)
