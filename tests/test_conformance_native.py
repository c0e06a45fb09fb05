"""The verdict on a framework's own layer (`multiattn.conformance.departures`), on fixture
cases with results made from the oracle's numbers: agreement, a recorded departure, an
unrecorded one, and a recorded one that does not occur. NumPy only; the real layers run
in tests/test_conformance.py."""

import numpy as np
import pytest
from multiattn.conformance import fixtures
from multiattn.conformance.departures import KNOWN, classify, keep_mask, verdict
from multiattn.conformance.worker import compare


@pytest.fixture(scope="module")
def cases():
    names = {"mha_masked_rows_f32", "mha_contiguous_f32", "sdpa_lens_1d_f32", "sdpa_self_f64"}
    names |= {"sdpa_poisoned_nan_f32", "sdpa_poisoned_huge_f32", "sdpa_mqa_f32"}
    return {c.name: c for c in fixtures.load(names=names)}


def judged(target, case, result):
    passed = compare(case, result, {}, ("weights",) if "weights" not in result else ())["passed"]
    return verdict(target, case, passed, result)


def with_nan_rows(case):
    """The oracle's output and weights with NaN in every fully masked row."""
    out = case.expected["output"].copy()
    weights = case.expected["weights"].copy()
    heads = weights.shape[1] if weights.ndim == 4 else 1
    empty_w = ~keep_mask(case, heads).any(axis=-1)
    empty_o = empty_w.any(axis=1)
    if weights.ndim == 3:
        empty_w = empty_w[:, 0]
    out[empty_o] = np.nan
    weights[empty_w] = np.nan
    return {"output": out, "weights": weights}


def test_the_oracles_own_numbers_agree(cases):
    assert judged(
        "native-torch", cases["mha_contiguous_f32"], dict(cases["mha_contiguous_f32"].expected)
    ) == ("pass", "")


def test_a_recorded_nan_departure(cases):
    case = cases["mha_masked_rows_f32"]
    status, why = judged("native-torch", case, with_nan_rows(case))
    assert status == "depart"
    assert "output nan on 3 empty rows" in why and "weights nan on 6 empty rows" in why


def test_a_recorded_departure_that_does_not_occur_fails(cases):
    case = cases["mha_masked_rows_f32"]
    status, why = judged("native-torch", case, dict(case.expected))
    assert status == "fail" and "did not occur" in why


def test_nan_where_uniform_is_recorded_fails(cases):
    case = cases["mha_masked_rows_f32"]
    status, why = judged("native-paddle", case, with_nan_rows(case))
    assert status == "fail" and "recorded: output uniform" in why


def test_uniform_rows_are_recognised(cases):
    case = cases["sdpa_lens_1d_f32"]
    mean = case.inputs["value"].mean(axis=1)  # (batch, dv): uniform weights' output
    out = case.expected["output"].copy()
    out[1] = mean[1]  # batch 1 has length 0: every row empty
    status, why = judged("native-jax", case, {"output": out})
    assert status == "depart" and "output uniform on 4 empty rows" in why
    info = classify(case, {"output": out}, case.tolerance["output"])["output"]
    assert info == {"rest_rel": 0.0, "empty_rows": 4, "empty": "uniform"}


def test_an_error_on_rows_with_keys_always_fails(cases):
    case = cases["mha_masked_rows_f32"]
    result = with_nan_rows(case)
    result["output"][0, 1] += 1e-3  # row (0, 1) has 3 valid keys
    status, why = judged("native-torch", case, result)
    assert status == "fail" and "on rows with keys" in why


def test_an_unrecorded_departure_fails(cases):
    case = cases["sdpa_lens_1d_f32"]
    result = {"output": case.expected["output"] + 1.0}
    status, why = judged("native-torch", case, result)
    assert status == "fail" and "not a recorded departure" in why


def test_a_precision_allowance_covers_float64_computed_in_float32(cases):
    case = cases["sdpa_self_f64"]
    out = case.expected["output"].astype(np.float32).astype(np.float64) * (1 + 1e-7)
    assert judged("native-jax", case, {"output": out})[0] == "depart"
    assert judged("native-torch", case, {"output": out})[0] == "fail"
    assert judged("native-jax", case, {"output": out * 1.01})[0] == "fail"


def test_recorded_errors(cases):
    case = cases["mha_contiguous_f32"]
    assert verdict("native-torch", case, False, None, "RuntimeError: boom") == (
        "fail",
        "RuntimeError: boom",
    )


def test_every_recorded_target_is_a_builtin_native_target():
    from multiattn.conformance.targets import BUILTIN

    assert set(KNOWN) <= {n for n in BUILTIN if n.startswith("native-")}


def test_a_recorded_poisoned_departure(cases):
    """NaN in masked keys reaching every row of batch element 0 (the poisoned one); batch
    element 1 is clean and must agree."""
    case = cases["sdpa_poisoned_nan_f32"]
    assert not np.isfinite(case.inputs["key"][0]).all() and np.isfinite(case.inputs["key"][1]).all()
    out = case.expected["output"].copy()
    out[0] = np.nan
    status, why = judged("native-torch", case, {"output": out})
    assert status == "depart" and why == "output nan on 4 poisoned rows"
    out[1, 2] = np.nan  # a clean row
    status, why = judged("native-torch", case, {"output": out})
    assert status == "fail" and "off by inf on rows with keys" in why
    status, why = judged("native-torch", case, dict(case.expected))
    assert status == "fail" and "output nan on poisoned rows" in why and "did not occur" in why


def test_uniform_rows_over_huge_masked_values_are_recognised(cases):
    """An empty row given uniform weights averages the masked values of 1e30 too: still
    the kind "uniform", measured against the answer's own size."""
    case = cases["sdpa_poisoned_huge_f32"]
    out = case.expected["output"].copy()
    out[0, 0] = case.inputs["value"][0].mean(axis=0) * (1 + 1e-7)  # query 0 has length 0
    assert np.abs(out[0, 0]).max() > 1e28
    status, why = judged("native-jax", case, {"output": out})
    assert status == "depart" and why == "output uniform on 1 empty rows"


def test_grouped_heads(cases):
    """Rank-4 outputs of grouped-query cases are judged per (batch, head, query) row."""
    case = cases["sdpa_mqa_f32"]
    assert case.inputs["query"].shape[1] == 4 and case.inputs["key"].shape[1] == 1
    assert judged("native-torch", case, {"output": case.expected["output"]}) == ("pass", "")
    out = case.expected["output"].copy()
    out[1, 3, 0] += 1.0
    info = classify(case, {"output": out}, case.tolerance["output"])["output"]
    assert info["empty"] == "none" and info["rest_rel"] > 0.1
