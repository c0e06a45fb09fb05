"""multiattn on 8 JAX host devices: keras.distribution data and model parallelism with
`multiattn.distributed.layout_map`, per-device memory, and ring attention.

The outer test process imports no framework: each worker in ``tests/distributed/`` runs
in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (JAX splits
the CPU into 8 devices) and reports numbers as JSON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).resolve().parent / "distributed"
ROOT = WORKERS.parent.parent
F32_TOL = 1e-6  # the float32 conformance bound (max relative error)
F64_TOL = 1e-12
# Per-device memory budget for the large encoder layer's gradient step: more than the
# sharded program needs per device, less than the unsharded one needs.
BUDGET = 1 << 30  # 1 GiB

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="needs jax (extra 'jax')"
)


# a bound for a hung run, not a speed test: the sharded run took about 60 s on a 2-core CPU
def run_worker(script: str, *args: str, x64: bool = False, timeout: float = 1800) -> dict:
    env = dict(os.environ)
    # the caller's XLA options (the test harness's quick-compile ones) and 8 host devices
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("JAX_ENABLE_X64", None)
    if x64:
        env["JAX_ENABLE_X64"] = "1"
    proc = subprocess.run(
        [sys.executable, str(WORKERS / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded_report():
    return run_worker("jax_sharded.py", "equality", "memory", x64=True)


@pytest.fixture(scope="module")
def sharded(sharded_report):
    return sharded_report["equality"]


@pytest.fixture(scope="module")
def memory(sharded_report):
    return sharded_report["memory"]


def long_rows_tol(keys: int) -> float:
    """The float32 bound for attention over up to ``keys`` keys: the conformance bound,
    or ``sqrt(keys)`` units of float32 roundoff where that is larger. A softmax-weighted
    sum's rounding error grows with the number of terms while the outputs (averages of
    many values) shrink: over 2048 keys the core's direct attention on one device was
    1.0e-6 to 1.8e-6 from the oracle (three seeds), ring attention 0.4e-6 to 1.1e-6."""
    return max(F32_TOL, keys**0.5 * 2.0**-24)


@pytest.fixture(scope="module")
def ring():
    return run_worker("jax_ring.py", x64=True)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["data_parallel", "model_parallel"])
def test_sharded_encoder_equals_single_device(sharded, mode, dtype):
    assert sharded["devices"] == 8
    errors = sharded[f"{mode}_{dtype}"]
    # float64 shows that sharding changes nothing but the order of the sums. In float32
    # the output is within the conformance bound of the single-device output; a gradient
    # sums over the whole batch in a different order on each side, and two float32
    # results each within the bound of the exact one may differ by twice the bound.
    tol = F64_TOL if dtype == "float64" else F32_TOL
    grad_tol = F64_TOL if dtype == "float64" else 2 * F32_TOL
    assert errors["forward"] <= tol, errors
    assert errors["grad_input"] <= grad_tol, errors
    assert errors["grad_weights"] <= grad_tol, errors
    # Zero in exact arithmetic; both runs must keep it at rounding level.
    assert errors["grad_key_bias"] <= grad_tol, errors


@pytest.mark.parametrize("mode", ["fit_data_parallel", "fit_model_parallel"])
def test_model_fit_under_a_distribution_equals_single_device(sharded, mode):
    errors = sharded[mode]
    assert errors["weights"] <= F32_TOL, errors
    assert errors["key_bias"] <= F32_TOL, errors


def test_weights_are_sharded_as_the_layout_map_says(sharded):
    weights = sharded["weights"]
    assert len(weights) == 16
    mesh = {"batch": 2, "model": 4}
    sharded_paths = set()
    for path, w in weights.items():
        want = w["layout"] if w["layout"] is not None else [None] * len(w["shape"])
        assert w["spec"] == want, path
        assert w["devices"] == 8, path
        shard = [n // (mesh[a] if a else 1) for n, a in zip(w["shape"], want)]
        assert w["shard_shape"] == shard, path
        if any(want):
            sharded_paths.add(path.split("/", 1)[1])
    assert sharded_paths == {
        "attention/query/kernel",
        "attention/key/kernel",
        "attention/value/kernel",
        "attention/attention_output/kernel",
        "attention/query/bias",
        "attention/key/bias",
        "attention/value/bias",
        "ffn_1/kernel",
        "ffn_1/bias",
        "ffn_2/kernel",
    }
    # Heads are split over the model axis, the feed-forward by column then by row.
    prefix = next(iter(weights)).split("/", 1)[0]
    assert weights[f"{prefix}/attention/query/kernel"]["spec"] == [None, "model", None]
    assert weights[f"{prefix}/attention/attention_output/kernel"]["spec"] == ["model", None, None]
    assert weights[f"{prefix}/ffn_1/kernel"]["spec"] == [None, "model"]
    assert weights[f"{prefix}/ffn_2/kernel"]["spec"] == ["model", None]
    assert sharded["output_spec"] == ["batch", None, None]


def test_model_parallel_fits_a_per_device_budget_one_device_exceeds(memory):
    one, per_device = memory["one_device"], memory["mesh_2x4"]
    assert one["total"] > BUDGET, one
    assert per_device["total"] < BUDGET, per_device
    # The weights are split four ways over the model axis, but for the replicated
    # ones: the two layer norms' gamma and beta and the two output biases, (d_model,)
    # float32 each.
    replicated = 6 * memory["size"]["d_model"] * 4
    assert (
        per_device["weights_on_device0"] - replicated
        == (one["weights_on_device0"] - replicated) // 4
    )


@pytest.mark.parametrize(
    "case", ["float32_full", "float32_causal", "float32_causal_cross", "float32_batch_x_seq"]
)
def test_ring_attention_equals_the_oracle_float32(ring, case):
    assert ring["tokens"] == 8 * 256
    assert ring[case]["oracle"] <= long_rows_tol(ring["tokens"]), ring[case]


def test_ring_attention_float64_and_empty_rows(ring):
    assert ring["float64_causal"]["oracle"] <= F64_TOL
    assert ring["float32_causal"]["empty_rows_zero"] is True
    assert ring["output_spec"] == ["batch", "seq"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ring_attention_gradients_equal_direct_attention(ring, dtype):
    tol = long_rows_tol(ring["tokens"]) if dtype == "float32" else F64_TOL
    errors = ring["gradients"][dtype]
    assert max(errors.values()) <= tol, errors


# --- whole model families loaded sharded (tests/distributed/jax_models.py) -------------

#: float32 outputs of a sharded model against one device: the families' bound against
#: transformers (tests/_decoder_families.py). Split over the model axis, each projection
#: sums its products in another order: 3e-7 to 1.4e-6 apart here (8 host devices).
FAMILY_TOL = 1e-5
#: family -> whether its key/value cache is split by head (the model axis divides the
#: key/value heads: Llama's 2 on 4 do not, and are replicated)
CACHE_SHARDED = {"llama": False, "qwen2": True, "mistral": True, "gpt2": True, "t5": True,
                 "phi3": True, "falcon": False}  # fmt: skip


@pytest.fixture(scope="module")
def families():
    return run_worker("jax_models.py", x64=True)


@pytest.mark.parametrize(
    "case", ["llama", "qwen2", "mistral", "gpt2", "phi3", "falcon", "bert", "vit", "t5"]
)
def test_families_loaded_sharded_equal_one_device(families, case):
    report = families["families"][case]
    assert report["errors"] and max(report["errors"].values()) <= FAMILY_TOL, report["errors"]
    # each device holds the bytes the layout map's specs give it (the norms, biases of
    # width E and unsplit vocabularies replicated: a large part of so small a model)
    assert report["device0_bytes"] == report["expected_device0_bytes"]
    assert report["device0_bytes"] < 0.6 * report["total_bytes"], report
    assert any("model" in str(spec) for spec in report["specs"].values())
    if case in CACHE_SHARDED:
        assert report["tokens_equal"] and report["new_tokens"] >= 20, report
        assert ("model" in report["cache_spec"]) == CACHE_SHARDED[case], report["cache_spec"]


def test_a_loaded_model_trains_under_data_and_model_parallelism(families):
    step = families["train_step"]
    assert step["loss"] <= FAMILY_TOL and step["grads"] <= FAMILY_TOL, step
    assert 0 < step["sharded_grads"] < step["n_grads"], step


def test_a_float64_model_loaded_sharded_equals_one_device(families):
    assert families["float64"]["dtype"] == "float64"
    assert families["float64"]["logits"] <= F64_TOL


def test_sharded_loading_refuses_by_name(families):
    refusals = families["refusals"]
    assert "does not divide by 8" in refusals["heads"]
    assert refusals["not_a_distribution"].startswith("TypeError: from_pretrained: `distribution`")
    assert "needs the jax backend" in refusals["backend"]
