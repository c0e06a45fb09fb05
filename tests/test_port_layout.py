"""multiattn.port without any framework: the neutral layout, the torch and paddle name
mappings (exact round trips), the shape checks, and imports that load no framework."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from _port_oracle import assert_same_weights, random_weights
from hypothesis import given, settings
from hypothesis import strategies as st

from multiattn.port import PortableWeights, expected_shapes
from multiattn.port.layout import check_weights
from multiattn.port.names import (
    infer_config,
    neutral_to_paddle,
    neutral_to_torch,
    paddle_to_neutral,
    torch_to_neutral,
)

FRAMEWORKS = ("keras", "torch", "tensorflow", "jax", "paddle", "flax")


def test_importing_port_loads_no_framework():
    code = (
        "import sys, multiattn.port, multiattn.port.layout, multiattn.port.names, "
        "multiattn.port.api, multiattn.port.checkpoint, multiattn.port.cli\n"
        "from multiattn.port import PortableWeights, get_weights, convert\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@st.composite
def torch_mha_configs(draw):
    h = draw(st.integers(1, 4))
    d = draw(st.integers(1, 4))
    e = h * d
    same = draw(st.booleans())
    return {
        "num_heads": h,
        "key_dim": d,
        "value_dim": d,
        "query_width": e,
        "key_width": e if same else draw(st.integers(1, 7)),
        "value_width": e if same else draw(st.integers(1, 7)),
        "output_width": e,
        "use_bias": draw(st.booleans()),
    }


@settings(max_examples=40, deadline=None)
@given(torch_mha_configs(), st.integers(0, 2**16))
def test_mha_torch_and_paddle_names_round_trip_bit_identical(config, seed):
    w = random_weights("mha", config, seed)
    for to, back in ((neutral_to_torch, torch_to_neutral), (neutral_to_paddle, paddle_to_neutral)):
        flat = to("mha", w, config)
        assert_same_weights(back("mha", flat, config), w)
        # and the framework layout -> neutral -> framework layout
        assert_same_weights(to("mha", back("mha", flat, config), config), flat)
        layout = "torch" if to is neutral_to_torch else "paddle"
        assert infer_config(layout, "mha", flat, config["num_heads"]) == config


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 9), st.integers(0, 2**16))
def test_encoder_torch_and_paddle_names_round_trip_bit_identical(h, d, f, seed):
    config = {"d_model": h * d, "num_heads": h, "dff": f}
    w = random_weights("encoder", config, seed)
    for to, back in ((neutral_to_torch, torch_to_neutral), (neutral_to_paddle, paddle_to_neutral)):
        assert_same_weights(back("encoder", to("encoder", w, config), config), w)


def test_torch_packing_matches_torch_layout():
    """in_proj_weight rows are q, k, v, each (E, E) = (out, in); heads contiguous."""
    config = infer_config("torch", "mha", {"out_proj.weight": np.zeros((4, 4)),
                                           "in_proj_weight": np.zeros((12, 4)),
                                           "in_proj_bias": np.zeros(12)}, 2)  # fmt: skip
    w = random_weights("mha", config)
    flat = neutral_to_torch("mha", w, config)
    q = flat["in_proj_weight"][:4]  # q = x @ q.T: output feature 2*h + j is head h, depth j
    assert np.array_equal(q[2 * 1 + 0], w["query/kernel"][:, 1, 0])
    assert np.array_equal(flat["in_proj_bias"][8 + 3], w["value/bias"][1, 1])
    assert np.array_equal(flat["out_proj.weight"][:, 2 * 1 + 1], w["output/kernel"][1, 1])


def test_shape_error_names_weight_expected_and_received():
    config = {"d_model": 4, "num_heads": 2, "dff": 8}
    w = random_weights("encoder", config)
    w["ffn_2/kernel"] = w["ffn_2/kernel"][:5]
    with pytest.raises(
        ValueError, match=r"'ffn_2/kernel' must have shape \(8, 4\); received \(5, 4\)"
    ):
        PortableWeights("encoder", config, w)


def test_missing_and_extra_weights_are_named():
    config = {"units": 3, "query_width": 2, "key_width": 5}
    w = random_weights("additive", config)
    del w["score/kernel"]
    w["bias"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"missing \['score/kernel'\]; unexpected \['bias'\]"):
        check_weights(expected_shapes("additive", config), w)


def test_config_is_checked():
    with pytest.raises(ValueError, match=r"d_model.*divisible"):
        expected_shapes("encoder", {"d_model": 5, "num_heads": 2, "dff": 3})
    with pytest.raises(ValueError, match="missing key 'use_bias'"):
        expected_shapes("mha", {"num_heads": 1, "key_dim": 1, "value_dim": 1, "query_width": 1,
                                "key_width": 1, "value_width": 1, "output_width": 1})  # fmt: skip
    with pytest.raises(ValueError, match="`kind` must be one of"):
        expected_shapes("rnn", {})


def test_mha_layout_without_bias():
    config = {"num_heads": 2, "key_dim": 3, "value_dim": 5, "query_width": 4, "key_width": 6,
              "value_width": 7, "output_width": 9, "use_bias": False}  # fmt: skip
    assert expected_shapes("mha", config) == {
        "query/kernel": (4, 2, 3),
        "key/kernel": (6, 2, 3),
        "value/kernel": (7, 2, 5),
        "output/kernel": (2, 5, 9),
    }
    with pytest.raises(ValueError, match="torch/paddle MultiHeadAttention needs key_dim"):
        neutral_to_torch("mha", random_weights("mha", config), config)


def test_detection_imports_only_the_module_framework():
    """A torch module is read with torch alone: no Keras, TensorFlow, JAX or Paddle."""
    code = (
        "import sys, torch\n"
        "from multiattn import port\n"
        "m = torch.nn.MultiheadAttention(4, 2, kdim=3)\n"
        "w = port.get_weights(m)\n"
        "assert port.detect(m) == 'torch' and w.config['key_width'] == 3\n"
        "port.set_weights(m, w)\n"
        "try:\n"
        "    port.detect(object())\n"
        "except TypeError as err:\n"
        "    assert 'unsupported module of type builtins.object' in str(err)\n"
        "else:\n"
        "    raise AssertionError('no TypeError')\n"
        "print(sorted(m for m in ('keras', 'tensorflow', 'jax', 'paddle', 'flax') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_save_and_load_portable_round_trip(tmp_path):
    from safetensors.numpy import save_file

    from multiattn.port import load_portable, save_portable
    from multiattn.port.checkpoint import PortError

    config = {"d_model": 6, "num_heads": 3, "dff": 4, "norm_first": True, "epsilon": 1e-5,
              "activation": "gelu"}  # fmt: skip
    pw = PortableWeights("encoder", config, random_weights("encoder", config, seed=7))
    save_portable(pw, tmp_path / "enc.safetensors")
    back = load_portable(tmp_path / "enc.safetensors")
    assert back.kind == "encoder" and back.config == pw.config
    assert_same_weights(back, pw)
    save_file(pw.weights, str(tmp_path / "bare.safetensors"))
    with pytest.raises(PortError, match=r"no 'multiattn\.kind' metadata"):
        load_portable(tmp_path / "bare.safetensors")


# --- settings: grouped key/value heads, rotary position embedding ------------------------

GROUPED = {"num_heads": 6, "key_dim": 2, "value_dim": 3, "query_width": 4, "key_width": 5,
           "value_width": 7, "output_width": 9, "use_bias": True,
           "num_key_value_heads": 2}  # fmt: skip


def test_grouped_layout_has_kv_heads_in_key_and_value():
    assert expected_shapes("mha", GROUPED) == {
        "query/kernel": (4, 6, 2),
        "query/bias": (6, 2),
        "key/kernel": (5, 2, 2),
        "key/bias": (2, 2),
        "value/kernel": (7, 2, 3),
        "value/bias": (2, 3),
        "output/kernel": (6, 3, 9),
        "output/bias": (9,),
    }
    w = random_weights("mha", GROUPED)
    assert infer_config("neutral", "mha", w) == GROUPED  # read from the key kernel's heads
    assert PortableWeights("mha", GROUPED, w).config == GROUPED
    ungrouped = {k: v for k, v in GROUPED.items() if k != "num_key_value_heads"}
    with pytest.raises(ValueError, match=r"'key/kernel' must have shape \(5, 6, 2\); "
                                         r"received \(5, 2, 2\)"):  # fmt: skip
        PortableWeights("mha", ungrouped, w)


def test_settings_are_checked_and_canonical():
    from multiattn.port.layout import check_config

    base = {k: v for k, v in GROUPED.items() if k != "num_key_value_heads"}
    # the defaults are not recorded: H_kv = H, no RoPE; RoPE's base defaults to 10000
    assert check_config("mha", {**base, "num_key_value_heads": 6}) == base
    assert check_config("mha", {**base, "rotary_max_length": 8}) == {
        **base, "rotary_max_length": 8, "rotary_base": 10000.0}  # fmt: skip
    bad = [
        ({"num_key_value_heads": 4}, r"`num_key_value_heads` \(4\) must divide `num_heads`"),
        ({"num_key_value_heads": 0}, "`num_key_value_heads` must be a positive int"),
        ({"num_key_value_heads": True}, "`num_key_value_heads` has the wrong type"),
        ({"rotary_base": 100.0}, "`rotary_base` .* without `rotary_max_length`"),
        ({"rotary_max_length": 8, "rotary_base": -1.0}, "`rotary_base` must be a positive"),
        ({"rotary_max_length": 8, "rotary_base": float("inf")}, "`rotary_base` must be"),
        ({"rotary_max_length": 8, "key_dim": 3}, "needs an even `key_dim`; received 3"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            check_config("mha", {**base, **change})


def test_torch_and_paddle_layouts_refuse_settings_by_name():
    rotary = {"num_heads": 2, "key_dim": 2, "value_dim": 2, "query_width": 4, "key_width": 4,
              "value_width": 4, "output_width": 4, "use_bias": True,
              "rotary_max_length": 8}  # fmt: skip
    grouped = {**rotary, "num_heads": 4, "key_dim": 1, "value_dim": 1, "num_key_value_heads": 2}
    del grouped["rotary_max_length"]
    for to in (neutral_to_torch, neutral_to_paddle):
        with pytest.raises(ValueError, match=r"no grouped key/value heads; received "
                                             r"num_key_value_heads=2 \(num_heads=4\)"):  # fmt: skip
            to("mha", random_weights("mha", grouped), grouped)
        with pytest.raises(ValueError, match=r"no rotary position embedding; received "
                                             r"rotary_max_length=8 \(rotary_base=10000\.0\)"):  # fmt: skip
            to("mha", random_weights("mha", rotary), rotary)


def test_infer_config_checks_anchor_ranks_and_heads():
    w = random_weights("mha", GROUPED)
    with pytest.raises(ValueError, match=r"'query/kernel' must have 3 non-empty axes; received "
                                         r"shape \(4, 12\)"):  # fmt: skip
        infer_config("neutral", "mha", {**w, "query/kernel": np.zeros((4, 12))})
    flat = {"out_proj.weight": np.zeros((4, 4)), "in_proj_weight": np.zeros((12, 4))}
    for heads in (0, -1, True):
        with pytest.raises(ValueError, match=r"`num_heads` must be a positive int"):
            infer_config("torch", "mha", flat, heads)
