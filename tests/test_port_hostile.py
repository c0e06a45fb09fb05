"""``multiattn port`` on hostile and malformed input: every case ends in one
``multiattn port: error: ...`` line and exit status 1, never a traceback, and writes
nothing. HDF5 files are read only from their own bytes (no external storage, virtual
datasets or links), and every name, shape and dtype is checked before any tensor data is
read. Each file is made here, in ``tmp_path``; the CLI runs in a subprocess."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from _port_cli_support import MHA, keras_h5_names, only, port, refused, write_keras_h5
from _port_oracle import random_weights
from safetensors.numpy import save_file

from multiattn.port.checkpoint import metadata_for


def _limit_memory() -> None:
    """Run with 1.5 GiB of address space: reading any of the large datasets below (3.6 GB
    each) would fail with MemoryError instead of the refusal the tests expect."""
    cap = 1536 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _safetensors(path: Path, tensors: dict, metadata: dict | None) -> Path:
    save_file(tensors, str(path), metadata=metadata)
    return path


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.fixture
def mha_file(tmp_path: Path) -> Path:
    return _safetensors(tmp_path / "in.safetensors", random_weights("mha", MHA),
                        metadata_for("mha", MHA))  # fmt: skip


# --- safetensors -------------------------------------------------------------------------


def test_truncated_safetensors(tmp_path, mha_file):
    data = mha_file.read_bytes()
    mha_file.write_bytes(data[: len(data) - 8])
    refused(port(str(mha_file), str(tmp_path / "out.safetensors"), "--from", "safetensors"),
            "not a readable safetensors file", "in.safetensors")  # fmt: skip
    only(tmp_path, "in.safetensors")


@pytest.mark.parametrize(
    "name, raw",
    [
        ("oversized_header", struct.pack("<Q", 2**40) + b"{}"),
        ("header_too_small", b"\x01\x00"),
        ("empty", b""),
    ],
)
def test_malformed_safetensors_header(tmp_path, name, raw):
    src = tmp_path / "in.safetensors"
    src.write_bytes(raw)
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "safetensors"),
            "not a readable safetensors file")  # fmt: skip
    only(tmp_path, "in.safetensors")


def test_safetensors_header_that_lies_about_sizes(tmp_path):
    """A header declaring a 40 GB tensor over 4 bytes of data."""
    src = _raw_safetensors(tmp_path / "in.safetensors", {"query/kernel": {
        "dtype": "F32", "shape": [100000, 100000, 1], "data_offsets": [0, 4]}}, b"\0" * 4)  # fmt: skip
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "safetensors",
                 "--module", "mha"), "not a readable safetensors file")  # fmt: skip
    only(tmp_path, "in.safetensors")


BAD_METADATA = {
    "not_json": ({"multiattn.kind": "mha", "multiattn.config": "{not json"}, "not valid JSON"),
    "not_object": (
        {"multiattn.kind": "mha", "multiattn.config": "[1, 2]"},
        "must be a JSON object",
    ),
    "unknown_kind": (
        {"multiattn.kind": "rnn", "multiattn.config": "{}"},
        "'multiattn.kind' must be one of mha, encoder, additive, decoder, decoder_only; received 'rnn'",
    ),
    "config_without_kind": ({"multiattn.config": json.dumps(MHA)}, "no 'multiattn.kind'"),
    "zero_heads": (
        {"multiattn.kind": "mha", "multiattn.config": json.dumps({**MHA, "num_heads": 0})},
        "`num_heads` must be a positive int; received 0",
    ),
    "missing_key": (
        {
            "multiattn.kind": "mha",
            "multiattn.config": json.dumps({k: v for k, v in MHA.items() if k != "use_bias"}),
        },
        "missing key 'use_bias'",
    ),
    "unknown_key": (
        {"multiattn.kind": "mha", "multiattn.config": json.dumps({**MHA, "shell": "rm -rf"})},
        "unknown key(s) ['shell']",
    ),
    "kv_heads_not_dividing": (
        {
            "multiattn.kind": "mha",
            "multiattn.config": json.dumps({**MHA, "num_key_value_heads": 3}),
        },
        "`num_key_value_heads` (3) must divide `num_heads` (2)",
    ),
    "deeply_nested": (
        {"multiattn.kind": "mha", "multiattn.config": "[" * 30000 + "]" * 30000},
        "not valid JSON",
    ),
    "too_long": (
        {"multiattn.kind": "mha", "multiattn.config": " " * 70000 + "{}"},
        "at most 65536 characters",
    ),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_bad_metadata(tmp_path, case):
    metadata, needle = BAD_METADATA[case]
    src = _safetensors(tmp_path / "in.safetensors", random_weights("mha", MHA), metadata)
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "safetensors"), needle)
    only(tmp_path, "in.safetensors")


def test_non_float_tensors(tmp_path):
    w = random_weights("mha", MHA)
    w["query/kernel"] = w["query/kernel"].astype(np.int32)
    src = _safetensors(tmp_path / "in.safetensors", w, metadata_for("mha", MHA))
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "safetensors"),
            "'query/kernel' must be float16, float32 or float64; received dtype int32")  # fmt: skip
    src = _raw_safetensors(tmp_path / "in.safetensors", {
        "__metadata__": metadata_for("additive", {"units": 1, "query_width": 1, "key_width": 1}),
        "query/kernel": {"dtype": "BF16", "shape": [1, 1], "data_offsets": [0, 2]},
        "key/kernel": {"dtype": "BF16", "shape": [1, 1], "data_offsets": [2, 4]},
        "score/kernel": {"dtype": "BF16", "shape": [1], "data_offsets": [4, 6]},
    }, b"\0" * 6)  # fmt: skip
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "safetensors"),
            "received dtype bfloat16")  # fmt: skip
    only(tmp_path, "in.safetensors")


# --- the command line ----------------------------------------------------------------------

BAD_FLAGS = {
    "zero_heads": (
        ("--from", "torch-safetensors", "--module", "mha", "--num-heads", "0"),
        "--num-heads must be a positive integer; received 0",
    ),
    "negative_heads": (
        ("--from", "torch-safetensors", "--module", "mha", "--num-heads", "-2"),
        "--num-heads must be a positive integer; received -2",
    ),
    "nan_epsilon": (("--from", "safetensors", "--epsilon", "nan"), "--epsilon must be"),
    "zero_rotary": (
        ("--from", "safetensors", "--rotary-max-length", "0"),
        "--rotary-max-length must be a positive integer",
    ),
    "bad_max_size": (("--from", "safetensors", "--max-size", "lots"), "--max-size"),
    "encoder_flag_on_mha": (
        ("--from", "safetensors", "--norm-first", "true"),
        "--norm-first apply to encoder files only",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flags(tmp_path, mha_file, case):
    flags, needle = BAD_FLAGS[case]
    refused(port(str(mha_file), str(tmp_path / "out.safetensors"), *flags), needle)
    only(tmp_path, "in.safetensors")


def test_size_limit(tmp_path, mha_file):
    refused(port(str(mha_file), str(tmp_path / "out.safetensors"), "--from", "safetensors",
                 "--max-size", "512"), "hold 992 bytes, more than the limit of 512 (--max-size)")  # fmt: skip
    only(tmp_path, "in.safetensors")


def test_unreadable_and_unwritable_paths(tmp_path, mha_file):
    out = str(tmp_path / "out.safetensors")
    refused(port(str(tmp_path / "nope.safetensors"), out, "--from", "safetensors"),
            "no such file")  # fmt: skip
    (tmp_path / "folder").mkdir()
    refused(port(str(tmp_path / "folder"), out, "--from", "safetensors"), "is a directory")
    os.mkfifo(tmp_path / "fifo")  # opening a FIFO for reading would block forever
    refused(port(str(tmp_path / "fifo"), out, "--from", "safetensors", timeout=60),
            "not a regular file")  # fmt: skip
    refused(port(str(mha_file), str(tmp_path / "folder"), "--from", "safetensors", "--force"),
            "is a directory")  # fmt: skip
    # the destination's parent is a file; /proc takes no new files, even from root
    refused(port(str(mha_file), str(mha_file / "out.safetensors"), "--from", "safetensors"),
            "cannot write")  # fmt: skip
    refused(port(str(mha_file), "/proc/multiattn-test/out.safetensors", "--from",
                 "safetensors"), "cannot write")  # fmt: skip
    only(tmp_path, "in.safetensors", "folder", "fifo")
    assert list((tmp_path / "folder").iterdir()) == []


# --- HDF5 ----------------------------------------------------------------------------------


@pytest.fixture
def h5_file(tmp_path: Path) -> tuple[Path, dict]:
    w = random_weights("mha", MHA, seed=3)
    path = tmp_path / "in.weights.h5"
    write_keras_h5(path, w, MHA)
    return path, w


def _replace(path: Path, name: str, make) -> None:
    with h5py.File(path, "a") as fh:
        del fh[name]
        make(fh, name)


def test_h5_external_storage_is_not_followed(tmp_path, h5_file):
    """A dataset whose bytes live in another local file (h5py ``external=``), of exactly the
    expected shape: converting it would copy that file into the output."""
    src, _ = h5_file
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.full((8, 2, 4), 7.0, np.float32).tobytes())
    _replace(src, "vars/0", lambda fh, n: fh.create_dataset(
        n, shape=(8, 2, 4), dtype="f4", external=[(str(secret), 0, 8 * 2 * 4 * 4)]))  # fmt: skip
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras"),
            "dataset 'vars/0' has external storage", str(secret))  # fmt: skip
    only(tmp_path, "in.weights.h5", "secret.bin")


def test_h5_virtual_dataset(tmp_path, h5_file):
    src, w = h5_file
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as fh:
        fh.create_dataset("q", data=w["query/kernel"])

    def virtual(fh, name):
        layout = h5py.VirtualLayout(shape=(8, 2, 4), dtype="f4")
        layout[:] = h5py.VirtualSource(str(other), "q", shape=(8, 2, 4))
        fh.create_virtual_dataset(name, layout)

    _replace(src, "vars/0", virtual)
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras"),
            "dataset 'vars/0' is virtual")  # fmt: skip
    only(tmp_path, "in.weights.h5", "other.h5")


@pytest.mark.parametrize("link", ["soft", "external"])
def test_h5_links(tmp_path, h5_file, link):
    src, w = h5_file
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as fh:
        fh.create_dataset("q", data=w["query/kernel"])
    with h5py.File(src, "a") as fh:
        fh.create_dataset("data/q", data=w["query/kernel"])
    if link == "soft":
        _replace(src, "vars/0", lambda fh, n: fh.__setitem__(n, h5py.SoftLink("/data/q")))
        needle = "'vars/0' is a soft link (to '/data/q')"
    else:
        _replace(src, "vars/0", lambda fh, n: fh.__setitem__(n, h5py.ExternalLink(str(other),
                                                                                "/q")))  # fmt: skip
        needle = "'vars/0' is an external link"
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras"), needle)
    only(tmp_path, "in.weights.h5", "other.h5")


def test_h5_named_datatype(tmp_path, h5_file):
    src, _ = h5_file
    with h5py.File(src, "a") as fh:
        fh["a_type"] = np.dtype("f4")
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras"),
            "'a_type' is a Datatype")  # fmt: skip


def test_h5_compressed_bomb_is_refused_before_reading(tmp_path, h5_file):
    """A few KB on disk, 3.6 GB once read: a chunked, compressed 30000 x 30000 dataset
    with nothing written (HDF5 returns its fill value). Its shape is refused from the
    metadata; the run is capped at 1.5 GiB of memory, so reading it would fail otherwise."""
    src, _ = h5_file
    _replace(src, "vars/0", lambda fh, n: fh.create_dataset(
        n, shape=(30000, 30000), dtype="f4", chunks=(1000, 1000), compression="gzip"))  # fmt: skip
    assert src.stat().st_size < 64 * 1024
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras", timeout=60,
                 preexec_fn=_limit_memory),
            "'query/kernel' (stored as 'vars/0') must have 3 non-empty axes; received shape "
            "(30000, 30000)")  # fmt: skip
    # consistent but enormous shapes (E = H = 30000, D = 1) pass every shape check and
    # hit the size limit, still before anything is read
    config = {**MHA, "num_heads": 30000, "key_dim": 1, "value_dim": 1, "query_width": 30000,
              "key_width": 30000, "value_width": 30000, "output_width": 30000}  # fmt: skip
    from multiattn.port import expected_shapes

    shapes = expected_shapes("mha", config)
    with h5py.File(src, "w") as fh:
        for i, name in enumerate(keras_h5_names(config)):
            fh.create_dataset(f"vars/{i}", shape=shapes[name], dtype="f4",
                              chunks=tuple(min(s, 1000) for s in shapes[name]),
                              compression="gzip")  # fmt: skip
    assert src.stat().st_size < 64 * 1024
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras", timeout=60,
                 preexec_fn=_limit_memory), "more than the limit")  # fmt: skip
    only(tmp_path, "in.weights.h5")


def test_h5_truncated_and_malformed(tmp_path, h5_file):
    src, w = h5_file
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras"),
            "not a readable HDF5 file")  # fmt: skip
    write_keras_h5(src, {**w, "query/kernel": w["query/kernel"].astype(np.int64)}, MHA)
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras"),
            "'vars/0' must be float16, float32 or float64; received dtype int64")  # fmt: skip
    write_keras_h5(src, w, MHA)
    with h5py.File(src, "a") as fh:
        fh.attrs["multiattn.kind"] = "mha"  # a variable-length string: size unknown upfront
    refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "keras"),
            "'multiattn.kind' must be a fixed-length byte string")  # fmt: skip
    only(tmp_path, "in.weights.h5")


# --- torch and paddle pickles ------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_files(tmp_path_factory) -> Path:
    """A valid torch state_dict file and one with a non-tensor entry (made with torch in a
    subprocess)."""
    folder = tmp_path_factory.mktemp("torch")
    script = textwrap.dedent(f"""
        import torch
        torch.manual_seed(0)
        m = torch.nn.MultiheadAttention(8, 2, kdim=5, vdim=6)
        torch.save(m.state_dict(), {str(folder / "valid.pt")!r})
        torch.save({{"out_proj.bias": [1, 2]}}, {str(folder / "list.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    return folder


@pytest.mark.parametrize("defect", ["truncated_zip", "garbage", "empty"])
def test_corrupt_torch_file_does_not_suggest_trust_pickle(tmp_path, torch_files, defect):
    data = (torch_files / "valid.pt").read_bytes()
    raw = {"truncated_zip": data[: len(data) // 2], "garbage": b"\x00garbage" * 10,
           "empty": b""}[defect]  # fmt: skip
    src = tmp_path / "in.pt"
    src.write_bytes(raw)
    for trust in ((), ("--trust-pickle",)):
        message = refused(port(str(src), str(tmp_path / "out.safetensors"), "--from", "torch",
                               "--module", "mha", "--num-heads", "2", *trust),
                          "not a readable torch file")  # fmt: skip
        assert "trust" not in message and "weights_only" not in message, message
    only(tmp_path, "in.pt")


def test_torch_file_with_non_tensor_entries(tmp_path, torch_files):
    refused(port(str(torch_files / "list.pt"), str(tmp_path / "out.safetensors"), "--from",
                 "torch", "--module", "mha", "--num-heads", "2"),
            "entry 'out_proj.bias' is list")  # fmt: skip
    only(tmp_path)


def test_pdparams_that_fail_after_loading(tmp_path):
    import pickle

    cases = {
        "list": ([1, 2, 3], "expected a state_dict; got list"),
        "nested": ({"q_proj.weight": {"w": np.zeros(2)}}, "entry 'q_proj.weight' is dict"),
        "text": ({"q_proj.weight": "weights"}, "entry 'q_proj.weight' is str"),
    }
    for name, (obj, _) in cases.items():
        with open(tmp_path / f"{name}.pdparams", "wb") as fh:
            pickle.dump(obj, fh, protocol=4)
    (tmp_path / "garbage.pdparams").write_bytes(b"garbage garbage")
    cases["garbage"] = (None, "paddle.load failed")
    for name, (_, needle) in cases.items():
        refused(port(str(tmp_path / f"{name}.pdparams"), str(tmp_path / "out.safetensors"),
                     "--from", "paddle", "--module", "mha", "--num-heads", "2",
                     "--trust-pickle"), needle)  # fmt: skip
    only(tmp_path, *(f"{name}.pdparams" for name in cases))
