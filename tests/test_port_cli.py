"""``multiattn port``: checkpoint conversion in subprocesses (the outer test process loads
no framework). Every format pair of a chain converts bit-identically, the written files
load into the frameworks' own modules, and bad input writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _port_cli_support import GROUPED, ROTARY, write_keras_h5
from _port_oracle import PAIR_RTOL, assert_same_weights, compare, inputs, oracle_mha, random_weights
from safetensors.numpy import load_file, save_file

from multiattn.port.checkpoint import load_portable, metadata_for

MHA = {"num_heads": 2, "key_dim": 4, "value_dim": 4, "query_width": 8, "key_width": 5,
       "value_width": 6, "output_width": 8, "use_bias": True}  # fmt: skip
ENCODER = {"d_model": 8, "num_heads": 2, "dff": 12}


def port(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "KERAS_BACKEND": "numpy", **(env or {})}
    return subprocess.run([sys.executable, "-m", "multiattn.cli", "port", *args],
                          capture_output=True, text=True, env=full_env)  # fmt: skip


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Nothing was written" in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def only(directory: Path, *names: str) -> None:
    """``directory`` holds exactly ``names`` (no output, no temporary file left behind)."""
    assert sorted(p.name for p in directory.iterdir()) == sorted(names)


@pytest.fixture
def mha_file(tmp_path: Path) -> tuple[Path, dict]:
    w = random_weights("mha", MHA, seed=11)
    path = tmp_path / "mha.safetensors"
    save_file(w, str(path), metadata=metadata_for("mha", MHA))
    return path, w


def test_format_chain_is_bit_identical_and_loads_into_each_framework(tmp_path, mha_file):
    src, w = mha_file
    steps = [
        ("safetensors", "torch", "a.pt", ()),
        ("torch", "paddle", "b.pdparams", ("--num-heads", "2", "--trust-pickle")),
        ("paddle", "keras", "c.weights.h5", ("--num-heads", "2", "--trust-pickle")),
        ("keras", "keras-mha", "d.weights.h5", ()),
        ("keras-mha", "torch-safetensors", "e.safetensors", ()),
        ("torch-safetensors", "safetensors", "f.safetensors", ("--num-heads", "2")),
    ]
    current = src
    for src_fmt, dst_fmt, name, extra in steps:
        dst = tmp_path / name
        out = ok(port(str(current), str(dst), "--from", src_fmt, "--to", dst_fmt, "--module",
                      "mha", *extra)).stdout  # fmt: skip
        assert "query/kernel" in out and "output/bias" in out  # the report lists every tensor
        current = dst
    final = load_portable(current)
    assert final.config == MHA
    assert_same_weights(final.weights, w)
    assert sorted(load_file(str(tmp_path / "e.safetensors"))) == sorted(
        ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "out_proj.weight",
         "out_proj.bias"])  # fmt: skip

    # The files load into the frameworks' own modules and compute the same attention.
    q, k, v = inputs((2, 3, 8), (2, 4, 5), (2, 4, 6))
    np.savez(tmp_path / "x.npz", q=q, k=k, v=v)
    script = textwrap.dedent(f"""
        import json, numpy as np, torch, keras
        from keras.src.saving import saving_lib
        from multiattn.layers import MultiHeadAttention
        d = np.load({str(tmp_path / "x.npz")!r})
        q, k, v = d["q"], d["k"], d["v"]
        t = torch.nn.MultiheadAttention(8, 2, kdim=5, vdim=6, batch_first=True)
        t.load_state_dict(torch.load({str(tmp_path / "a.pt")!r}, weights_only=True), strict=True)
        out = {{"torch": t(*(torch.from_numpy(a) for a in (q, k, v)))[0].tolist()}}
        m = MultiHeadAttention(2, 4)
        m.build((None, None, 8), (None, None, 6), (None, None, 5))
        saving_lib.load_weights_only(m, {str(tmp_path / "c.weights.h5")!r})
        out["multiattn"] = keras.ops.convert_to_numpy(m(q, v, k)).tolist()
        km = keras.layers.MultiHeadAttention(2, 4)
        km.build((None, None, 8), (None, None, 6), (None, None, 5))
        saving_lib.load_weights_only(km, {str(tmp_path / "d.weights.h5")!r})
        out["keras"] = keras.ops.convert_to_numpy(km(q, v, k)).tolist()
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "KERAS_BACKEND": "torch"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    outs = json.loads(proc.stdout.strip().splitlines()[-1])
    want = oracle_mha(w, q, v, k)
    for name, got in outs.items():
        compare(f"cli file -> {name} vs oracle", np.array(got), want, PAIR_RTOL)


def test_encoder_torch_file_with_config_flags(tmp_path):
    w = random_weights("encoder", ENCODER, seed=12)
    src = tmp_path / "enc.safetensors"
    save_file(w, str(src), metadata=metadata_for("encoder", ENCODER))
    ok(port(str(src), str(tmp_path / "enc.pt"), "--from", "safetensors", "--to", "torch"))
    ok(port(str(tmp_path / "enc.pt"), str(tmp_path / "enc.weights.h5"), "--from", "torch", "--to",
            "keras", "--module", "encoder", "--num-heads", "2"))  # fmt: skip
    ok(port(str(tmp_path / "enc.weights.h5"), str(tmp_path / "back.safetensors"), "--from", "keras",
            "--norm-first", "true", "--epsilon", "1e-5", "--activation", "gelu"))  # fmt: skip
    back = load_portable(tmp_path / "back.safetensors")
    assert back.config == {**ENCODER, "norm_first": True, "epsilon": 1e-5, "activation": "gelu"}
    assert_same_weights(back.weights, w)


def test_prefix_selects_a_submodule(tmp_path):
    w = random_weights("mha", {**MHA, "key_width": 8, "value_width": 8}, seed=13)
    from multiattn.port.names import neutral_to_torch

    flat = neutral_to_torch("mha", w, {**MHA, "key_width": 8, "value_width": 8})
    tensors = {f"encoder.0.self_attn.{k}": v for k, v in flat.items()}
    tensors["encoder.0.linear1.weight"] = np.zeros((3, 8), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ok(port(str(tmp_path / "model.safetensors"), str(tmp_path / "attn.safetensors"), "--from",
            "torch-safetensors", "--module", "mha", "--num-heads", "2", "--prefix",
            "encoder.0.self_attn."))  # fmt: skip
    assert_same_weights(load_portable(tmp_path / "attn.safetensors").weights, w)
    # without the prefix the names are not those of a torch.nn.MultiheadAttention
    refused(port(str(tmp_path / "model.safetensors"), str(tmp_path / "x.safetensors"), "--from",
                 "torch-safetensors", "--module", "mha", "--num-heads", "2"), "--prefix")  # fmt: skip


def _torch_names(tmp_path: Path) -> dict:
    from multiattn.port.names import neutral_to_torch

    return neutral_to_torch("mha", random_weights("mha", MHA), MHA)


@pytest.mark.parametrize("defect", ["missing", "extra", "misshaped"])
def test_bad_tensors_are_refused_and_nothing_is_written(tmp_path, defect):
    flat = _torch_names(tmp_path)
    if defect == "missing":
        del flat["out_proj.bias"]
        needle = "missing ['out_proj.bias']"
    elif defect == "extra":
        flat["bias_k"] = np.zeros((1, 1, 8), np.float32)
        needle = "unexpected ['bias_k']"
    else:
        flat["out_proj.bias"] = np.zeros(7, np.float32)
        needle = "'out_proj.bias' must have shape (8,); received (7,)"
    save_file(flat, str(tmp_path / "in.safetensors"))
    for to in ("safetensors", "keras", "torch"):
        proc = port(str(tmp_path / "in.safetensors"), str(tmp_path / "out.weights.h5"), "--from",
                    "torch-safetensors", "--to", to, "--module", "mha", "--num-heads", "2")  # fmt: skip
        refused(proc, needle)
        only(tmp_path, "in.safetensors")


def test_pickles_need_the_trust_flag(tmp_path, mha_file):
    src, _ = mha_file
    pd = tmp_path / "w.pdparams"
    refused(port(str(src), str(pd), "--from", "safetensors", "--to", "paddle"), "--trust-pickle")
    assert not pd.exists()
    ok(port(str(src), str(pd), "--from", "safetensors", "--to", "paddle", "--trust-pickle"))
    out = tmp_path / "out.safetensors"
    refused(port(str(pd), str(out), "--from", "paddle", "--module", "mha", "--num-heads", "2"),
            "pickle", "--trust-pickle")  # fmt: skip
    assert not out.exists()
    # a full torch pickle (a module, not a state_dict) is refused the same way
    full = tmp_path / "full.pt"
    subprocess.run([sys.executable, "-c", "import torch; torch.save(torch.nn.MultiheadAttention("
                    f"8, 2, kdim=5, vdim=6), {str(full)!r})"], check=True)  # fmt: skip
    refused(port(str(full), str(out), "--from", "torch", "--module", "mha", "--num-heads", "2"),
            "not a plain state_dict", "--trust-pickle")  # fmt: skip
    assert not out.exists()
    ok(port(str(full), str(out), "--from", "torch", "--module", "mha", "--num-heads", "2",
            "--trust-pickle"))  # fmt: skip
    assert load_portable(out).config == MHA


def test_existing_output_needs_force(tmp_path, mha_file):
    src, _ = mha_file
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"old")
    refused(port(str(src), str(dst), "--from", "safetensors"), "--force")
    assert dst.read_bytes() == b"old"
    dst.chmod(0o640)
    ok(port(str(src), str(dst), "--from", "safetensors", "--force"))
    assert load_portable(dst).config == MHA
    assert dst.stat().st_mode & 0o777 == 0o640  # the replaced file keeps its mode
    fresh = tmp_path / "fresh.safetensors"
    ok(port(str(src), str(fresh), "--from", "safetensors"))
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    refused(port(str(src), str(tmp_path / "w.h5"), "--from", "safetensors", "--to", "keras"),
            ".weights.h5")  # fmt: skip


def test_interrupted_write_leaves_no_file(tmp_path, mha_file):
    """A writer that dies half-way leaves neither a partial DST nor a temporary file, and an
    existing DST unchanged."""
    src, _ = mha_file
    dst = tmp_path / "out.safetensors"
    script = textwrap.dedent(f"""
        import sys, safetensors.numpy as stn
        from multiattn.port.cli import main
        def dying(tensors, filename, metadata=None):
            with open(filename, "wb") as fh:
                fh.write(b"half a file")
            raise KeyboardInterrupt
        stn.save_file = dying
        sys.exit(main([{str(src)!r}, {str(dst)!r}, "--from", "safetensors", "--force"]))
    """)
    for existing in (False, True):
        if existing:
            dst.write_bytes(b"old")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert proc.returncode == 130, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr == "multiattn port: error: interrupted. Nothing was written.\n"
        if existing:
            assert dst.read_bytes() == b"old"
            only(tmp_path, "mha.safetensors", "out.safetensors")
        else:
            only(tmp_path, "mha.safetensors")


# --- grouped key/value heads and rotary position embedding -----------------------------

# Keras' own h5 files (written here by write_keras_h5) carry no multiattn attributes.


def test_grouped_and_rotary_settings_travel_through_files(tmp_path):
    gw, rw = random_weights("mha", GROUPED, seed=21), random_weights("mha", ROTARY, seed=22)
    save_file(gw, str(tmp_path / "g.safetensors"), metadata=metadata_for("mha", GROUPED))
    save_file(rw, str(tmp_path / "r.safetensors"), metadata=metadata_for("mha", ROTARY))
    for name, config, w in (("g", GROUPED, gw), ("r", ROTARY, rw)):
        ok(port(str(tmp_path / f"{name}.safetensors"), str(tmp_path / f"{name}.weights.h5"),
                "--from", "safetensors", "--to", "keras"))  # fmt: skip
        ok(port(str(tmp_path / f"{name}.weights.h5"), str(tmp_path / f"{name}2.safetensors"),
                "--from", "keras"))  # fmt: skip
        back = load_portable(tmp_path / f"{name}2.safetensors")
        assert back.config == config  # carried by the h5 file's attributes
        assert_same_weights(back.weights, w)

    # Keras' own h5 files carry no metadata: the key/value heads show in the shapes, RoPE
    # is given with flags
    write_keras_h5(tmp_path / "plain_g.weights.h5", gw, GROUPED)
    ok(port(str(tmp_path / "plain_g.weights.h5"), str(tmp_path / "pg.safetensors"), "--from",
            "keras"))  # fmt: skip
    assert load_portable(tmp_path / "pg.safetensors").config == GROUPED
    write_keras_h5(tmp_path / "plain_r.weights.h5", rw, ROTARY)
    ok(port(str(tmp_path / "plain_r.weights.h5"), str(tmp_path / "pr.safetensors"), "--from",
            "keras", "--rotary-max-length", "16", "--rotary-base", "500"))  # fmt: skip
    assert load_portable(tmp_path / "pr.safetensors").config == ROTARY
    refused(port(str(tmp_path / "plain_r.weights.h5"), str(tmp_path / "x.safetensors"),
                 "--from", "keras", "--rotary-base", "500"),
            "`rotary_base` (500.0) is given without `rotary_max_length`")  # fmt: skip

    # formats whose modules have no grouped heads or no RoPE refuse, naming the setting
    for name, needle in (("g", "num_key_value_heads=2"), ("r", "rotary_max_length=16")):
        for to, extra in (("torch", ()), ("torch-safetensors", ()), ("keras-mha", ()),
                          ("paddle", ("--trust-pickle",))):  # fmt: skip
            dst = tmp_path / ("x.weights.h5" if to == "keras-mha" else "x.out")
            refused(port(str(tmp_path / f"{name}.safetensors"), str(dst), "--from",
                         "safetensors", "--to", to, *extra), needle)  # fmt: skip
            assert not dst.exists()


def test_grouped_and_rotary_h5_files_load_into_multiattn(tmp_path):
    """The .weights.h5 files written for grouped and rotary layers load into multiattn
    layers built with those settings, which compute the float64 oracle's attention."""
    from _port_oracle import _mha_ref

    from multiattn import reference

    gw, rw = random_weights("mha", GROUPED, seed=23), random_weights("mha", ROTARY, seed=24)
    for name, config, w in (("g", GROUPED, gw), ("r", ROTARY, rw)):
        save_file(w, str(tmp_path / f"{name}.safetensors"), metadata=metadata_for("mha", config))
        ok(port(str(tmp_path / f"{name}.safetensors"), str(tmp_path / f"{name}.weights.h5"),
                "--from", "safetensors", "--to", "keras"))  # fmt: skip
    q, k, v = inputs((2, 3, 8), (2, 4, 5), (2, 4, 6), seed=3)
    rq, rkv = inputs((2, 5, 8), (2, 6, 8), seed=4)
    np.savez(tmp_path / "x.npz", q=q, k=k, v=v, rq=rq, rkv=rkv)
    script = textwrap.dedent(f"""
        import json, numpy as np, keras
        from keras.src.saving import saving_lib
        from multiattn.layers import MultiHeadAttention
        d = np.load({str(tmp_path / "x.npz")!r})
        g = MultiHeadAttention(4, 2, value_dim=3, output_dim=7, num_key_value_heads=2)
        g.build((None, None, 8), (None, None, 6), (None, None, 5))
        saving_lib.load_weights_only(g, {str(tmp_path / "g.weights.h5")!r})
        r = MultiHeadAttention(2, 4, rotary_max_length=16, rotary_base=500.0)
        r.build((None, None, 8), (None, None, 8), (None, None, 8))
        saving_lib.load_weights_only(r, {str(tmp_path / "r.weights.h5")!r})
        out = {{"g": keras.ops.convert_to_numpy(g(d["q"], d["v"], d["k"])).tolist(),
                "r": keras.ops.convert_to_numpy(r(d["rq"], d["rkv"])).tolist()}}
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "KERAS_BACKEND": "numpy"}, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    outs = json.loads(proc.stdout.strip().splitlines()[-1])
    want_g, _ = reference.multi_head_attention(q, v, k, weights=_mha_ref(gw))
    want_r, _ = reference.multi_head_attention(rq, rkv, weights=_mha_ref(rw), rotary_base=500.0)
    compare("cli grouped h5 -> multiattn vs oracle", np.array(outs["g"]), want_g, PAIR_RTOL)
    compare("cli rotary h5 -> multiattn vs oracle", np.array(outs["r"]), want_r, PAIR_RTOL)
