"""The temporary file of ``multiattn port``: SIGTERM, SIGINT and SIGHUP during the write
remove it and leave DST as it was; after SIGKILL it stays under a recognisable name, and the
next write to the same destination removes it (and nothing else)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _port_cli_support import MHA, ok, only, port
from _port_oracle import assert_same_weights, random_weights
from safetensors.numpy import save_file

from multiattn.port.checkpoint import load_portable, metadata_for

# .DST.multiattn-port.HOST.PID.XXXXXXXX.tmp
TEMP = re.compile(r"\.out\.safetensors\.multiattn-port\.([A-Za-z0-9-]+)\.(\d+)\.[a-z0-9_]+\.tmp")


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "in.safetensors"
    save_file(random_weights("mha", MHA, seed=5), str(path), metadata=metadata_for("mha", MHA))
    return path


def _slow_writer(src: Path, dst: Path, marker: Path, ignored: str = "") -> subprocess.Popen:
    """``multiattn port`` whose safetensors writer writes half a file into the temporary
    file, says where (``marker``) and then stalls, to be stopped from outside.

    It starts with the default disposition of SIGTERM, SIGINT and SIGHUP, as a shell
    starts it, whatever this test process inherited (under ``nohup`` SIGHUP arrives
    ignored, and the port keeps what is ignored); ``ignored`` names one to ignore.

    The stall sleeps in short slices, returning to the interpreter between them as a
    writer does between chunks: the kernel may hand a signal sent to the process to any
    of its threads (NumPy's BLAS starts some), and Python runs the handler in the main
    thread only when that thread next runs Python code, so one long sleep there would
    hold the handler until it ended (a run where SIGHUP went unanswered for 60 s)."""
    script = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        import safetensors.numpy as stn
        from multiattn.port.cli import main
        for name in ("SIGTERM", "SIGINT", "SIGHUP"):
            ignore = name == {ignored!r}
            signal.signal(getattr(signal, name), signal.SIG_IGN if ignore else signal.SIG_DFL)
        def stalling(tensors, filename, metadata=None):
            with open(filename, "wb") as fh:
                fh.write(b"half a file")
            pathlib.Path({str(marker)!r}).write_text(filename)
            for _ in range(2400):
                time.sleep(0.05)
        stn.save_file = stalling
        sys.exit(main([{str(src)!r}, {str(dst)!r}, "--from", "safetensors", "--force"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)
    temp = Path(marker.read_text())
    assert temp.exists() and TEMP.fullmatch(temp.name), temp
    assert int(TEMP.fullmatch(temp.name).group(2)) == proc.pid
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
@pytest.mark.parametrize("existing", [False, True])
def test_signal_during_write_removes_the_temporary_file(tmp_path, src, sig, existing):
    dst, marker = tmp_path / "out.safetensors", tmp_path.parent / f"{tmp_path.name}.marker"
    if existing:
        dst.write_bytes(b"old")
    proc = _slow_writer(src, dst, marker)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"multiattn port: error: interrupted by {sig.name} while writing; the temporary file "
        "was removed. Nothing was written."
    )
    if existing:
        assert dst.read_bytes() == b"old"
        only(tmp_path, "in.safetensors", "out.safetensors")
    else:
        only(tmp_path, "in.safetensors")


def test_an_ignored_signal_stays_ignored_during_the_write(tmp_path, src):
    """Started with SIGHUP ignored (``nohup``), the port does not take SIGHUP over: the
    write goes on; SIGTERM still stops it and removes the temporary file."""
    dst, marker = tmp_path / "out.safetensors", tmp_path.parent / f"{tmp_path.name}.marker"
    proc = _slow_writer(src, dst, marker, ignored="SIGHUP")
    proc.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM while writing" in stderr
    only(tmp_path, "in.safetensors")


def test_sigkill_leaves_a_recognisable_file_the_next_run_removes(tmp_path, src):
    dst, marker = tmp_path / "out.safetensors", tmp_path.parent / f"{tmp_path.name}.marker"
    proc = _slow_writer(src, dst, marker)
    temp = Path(marker.read_text())
    proc.kill()
    proc.communicate(timeout=60)
    assert temp.exists()  # nothing can run on SIGKILL
    host = TEMP.fullmatch(temp.name).group(1)
    # Leftovers the next run must keep: a live process's file (this test's own pid), another
    # destination's, another host's, and a link with a leftover's name.
    keep = [
        tmp_path / f".out.safetensors.multiattn-port.{host}.{os.getpid()}.abcdefgh.tmp",
        tmp_path / f".other.safetensors.multiattn-port.{host}.{proc.pid}.abcdefgh.tmp",
        tmp_path / f".out.safetensors.multiattn-port.not-{host}.{proc.pid}.abcdefgh.tmp",
    ]
    for path in keep:
        path.write_bytes(b"keep")
    link = tmp_path / f".out.safetensors.multiattn-port.{host}.{proc.pid}.linkxxxx.tmp"
    link.symlink_to(src)
    done = ok(port(str(src), str(dst), "--from", "safetensors", "--force"))
    assert f"removed {temp}, left by a killed run" in done.stderr
    assert not temp.exists()
    assert all(path.read_bytes() == b"keep" for path in keep) and link.is_symlink()
    assert_same_weights(load_portable(dst).weights, random_weights("mha", MHA, seed=5))
    only(tmp_path, "in.safetensors", "out.safetensors", link.name, *(p.name for p in keep))
