"""The conformance cases as a specification (`multiattn.conformance.spec`): the property
computation on hand-made inputs, a description and properties for every variant, the
operation registry, the departure rules written in properties, and the docs table."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multiattn.conformance import cases as C
from multiattn.conformance import departures, fixtures, spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def loaded():
    return {c.name: c for c in fixtures.load()}


# --- keep masks and empty rows, by hand -------------------------------------------------


def test_a_zero_length_empties_every_row_of_its_batch_element():
    keep = spec.keep_mask(2, 1, 3, 4, lens=np.array([2, 0]))
    assert keep[0, 0].tolist() == [[True, True, False, False]] * 3
    assert spec.empty_rows(keep).tolist() == [[[False] * 3], [[True] * 3]]


def test_per_query_lengths_empty_only_their_rows():
    keep = spec.keep_mask(1, 1, 3, 4, lens=np.array([[1, 0, 4]]))
    assert spec.empty_rows(keep)[0, 0].tolist() == [False, True, False]


def test_an_all_false_mask_row_is_empty():
    mask = np.ones((1, 3, 2), dtype=bool)
    mask[0, 2] = False
    mask[0, 1, 0] = False  # partly masked: not empty
    assert spec.empty_rows(spec.keep_mask(1, 1, 3, 2, mask=mask))[0, 0].tolist() == [
        False,
        False,
        True,
    ]


def test_a_mask_per_head():
    mask = np.ones((1, 2, 2, 3), dtype=bool)
    mask[0, 1, 0] = False
    empty = spec.empty_rows(spec.keep_mask(1, 2, 2, 3, mask=mask))
    assert empty[0].tolist() == [[False, False], [True, False]]


def test_causal_is_bottom_right():
    # 5 queries over 3 keys: query i sees keys j <= i - 2, so rows 0 and 1 are empty
    keep = spec.keep_mask(1, 1, 5, 3, causal=True)
    assert spec.empty_rows(keep)[0, 0].tolist() == [True, True, False, False, False]
    assert keep[0, 0, 4].all() and keep[0, 0, 2].tolist() == [True, False, False]
    # one query over 4 keys sees them all; more keys than queries: nothing is empty
    assert spec.keep_mask(1, 1, 1, 4, causal=True).all()
    assert not spec.empty_rows(spec.keep_mask(1, 1, 3, 5, causal=True)).any()


def test_lengths_mask_and_causal_combine():
    # each alone leaves every row a key; together row 0 has none
    mask = np.ones((1, 2, 2), dtype=bool)
    mask[0, 0, 0] = False
    lens = np.array([[1, 2]])
    assert not spec.empty_rows(spec.keep_mask(1, 1, 2, 2, mask=mask)).any()
    assert not spec.empty_rows(spec.keep_mask(1, 1, 2, 2, lens=lens)).any()
    both = spec.keep_mask(1, 1, 2, 2, lens=lens, mask=mask, causal=True)
    assert spec.empty_rows(both)[0, 0].tolist() == [True, False]


def test_poisoned_batch_elements():
    key = np.zeros((3, 2, 2))
    value = np.zeros((3, 2, 2))
    key[1, 0, 1] = np.nan
    value[2, 1, 0] = -np.inf
    assert spec.poisoned_batch({"key": key, "value": value}).tolist() == [False, True, True]
    value[2, 1, 0] = 1e30  # finite
    assert spec.poisoned_batch({"key": key, "value": value}).tolist() == [False, True, False]
    assert spec.poisoned_batch({"x": key}) is None


# --- properties from inputs ---------------------------------------------------------------


def _sdpa_inputs(heads=1, kv_heads=1, tq=3, tk=4):
    shape = (2, heads) if heads > 1 else (2,)
    kv = (2, kv_heads) if heads > 1 else (2,)
    return {
        "query": np.zeros((*shape, tq, 2)),
        "key": np.zeros((*kv, tk, 2)),
        "value": np.zeros((*kv, tk, 2)),
    }


def test_properties_computed_from_sdpa_inputs():
    props = spec.computed_properties
    assert props("sdpa", _sdpa_inputs(), {}, {}) == set()
    assert props("sdpa", _sdpa_inputs(4, 2), {}, {}) == {"grouped_heads"}
    assert props("sdpa", _sdpa_inputs(4, 4), {}, {}) == set()
    assert props("sdpa", _sdpa_inputs(tq=5, tk=3), {}, {"causal": True}) == {
        "causal",
        "causal_more_queries",
        "empty_rows",
    }
    assert props("sdpa", _sdpa_inputs(tq=1), {}, {"causal": True}) == {
        "causal",
        "causal_one_query",
    }
    lens = {**_sdpa_inputs(), "valid_lens": np.array([[1, 2, 0], [4, 4, 4]])}
    assert props("sdpa", lens, {}, {"block_size": 2}) == {
        "valid_lens",
        "per_query_lens",
        "empty_rows",
        "blockwise",
    }
    poisoned = _sdpa_inputs()
    poisoned["value"][1, 3] = np.nan
    poisoned["valid_lens"] = np.array([4, 3])  # the NaN is past batch 1's length
    assert props("sdpa", poisoned, {}, {}) == {"valid_lens", "poisoned"}


def test_grouped_heads_and_value_width_from_mha_weights():
    inputs = {"query": np.zeros((1, 2, 6)), "value": np.zeros((1, 3, 6))}
    w = {"W_q": np.zeros((6, 8)), "W_k": np.zeros((6, 4)), "W_v": np.zeros((6, 6))}
    assert spec.computed_properties("mha", inputs, w, {}) == {"grouped_heads", "value_dim"}
    w = {"W_q": np.zeros((6, 8)), "W_k": np.zeros((6, 8)), "W_v": np.zeros((6, 8))}
    assert spec.computed_properties("mha", inputs, w, {}) == set()


def test_the_operation_declares_what_its_inputs_cannot_show():
    inputs = {"query": np.zeros((1, 3, 6))}
    assert {"cache", "causal"} <= spec.computed_properties("mha_decode", inputs, {}, {})


# --- every variant described ----------------------------------------------------------------


def test_every_variant_has_a_description_and_properties_that_exist():
    names = [v.name for v in C.VARIANTS]
    assert sorted(spec.DESCRIPTIONS) == sorted(names)
    for v in C.VARIANTS:
        text, declared = spec.DESCRIPTIONS[v.name]
        assert text.strip() and "\n" not in text, v.name
        assert set(declared) <= set(spec.PROPERTIES), v.name
        assert spec.variant_properties(v) <= set(spec.PROPERTIES), v.name


@pytest.mark.parametrize(
    "variant, wanted, absent",
    [
        ("sdpa_lens_1d", {"empty_rows", "valid_lens"}, {"per_query_lens", "causal"}),
        ("sdpa_causal_more_queries", {"empty_rows", "causal_more_queries"}, set()),
        ("sdpa_causal_cross", {"causal"}, {"empty_rows", "causal_more_queries"}),
        ("sdpa_blockwise_causal_one_query", {"causal_one_query", "blockwise"}, {"empty_rows"}),
        ("sdpa_mqa", {"grouped_heads", "mask"}, {"empty_rows"}),
        ("sdpa_poisoned_nan", {"poisoned", "empty_rows"}, {"huge_values"}),
        ("sdpa_poisoned_huge", {"huge_values", "empty_rows"}, {"poisoned"}),
        ("mha_masked_rows", {"empty_rows", "per_query_lens"}, {"grouped_heads"}),
        ("mha_value_dim", {"value_dim"}, {"empty_rows"}),
        ("cache_decoder_post_ln_mqa", {"cache", "grouped_heads"}, {"empty_rows"}),
        ("doc_tf_sdpa", {"empty_rows", "document", "mask"}, set()),
        ("doc_tf_mha", {"document", "mask"}, {"empty_rows"}),
        ("masked_softmax_zero_lens", {"empty_rows"}, set()),
    ],
)
def test_variant_properties(variant, wanted, absent):
    props = spec.variant_properties(next(v for v in C.VARIANTS if v.name == variant))
    assert wanted <= props and not absent & props, props


def test_stored_cases_show_their_variants_properties(loaded):
    """The properties computed from the rounded, stored arrays of every case are those of
    its variant's float64 inputs."""
    by_variant = {v.name: spec.variant_properties(v) for v in C.VARIANTS}
    for case in loaded.values():
        assert spec.case_properties(case) == by_variant[spec.variant_of(case.name)], case.name


def test_empty_rows_agree_with_the_oracle_helpers_keep_mask(loaded):
    """`spec.keep_mask` (plain NumPy) against `departures.keep_mask` (built with the
    oracle's helpers) on every attention case."""
    for case in loaded.values():
        if case.op not in ("sdpa", "mha"):
            continue
        mine = C.OPERATIONS[case.op].rows(case.inputs, case.params)
        theirs = departures.keep_mask(case, mine.shape[1])
        assert np.array_equal(mine, theirs), case.name


# --- the operation registry -------------------------------------------------------------


def test_every_op_is_one_registry_entry():
    assert {v.op for v in C.VARIANTS} <= set(C.OPERATIONS)
    from multiattn.conformance.target_core import CORE_OPS, CoreTarget
    from multiattn.conformance.target_paddle import PADDLE_CORE_OPS

    assert CORE_OPS == {op for op, e in C.OPERATIONS.items() if e.core}
    for op in CORE_OPS:  # the core target calls each through its own method
        assert callable(getattr(CoreTarget, f"_forward_{op}", None)), op
    assert PADDLE_CORE_OPS <= CORE_OPS and "sdpa" in PADDLE_CORE_OPS
    assert "mha" not in PADDLE_CORE_OPS  # a layer: needs Keras
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        C.oracle("nope", {}, {}, {})


# --- departures written in properties ---------------------------------------------------------


def test_departure_rules_name_known_properties():
    for rules in departures.KNOWN.values():
        for rule in rules:
            assert set(rule.when) | set(rule.unless) <= set(spec.PROPERTIES), rule
            assert rule.rule()


@pytest.mark.parametrize(
    "target, case, empty, poisoned",
    [
        ("native-torch", "sdpa_lens_1d_f32", None, None),  # torch's SDPA gives zeros
        ("native-torch", "sdpa_poisoned_nan_f32", {}, {"output": "nan"}),
        ("native-torch", "mha_masked_rows_f64", {"output": "nan", "weights": "nan"}, {}),
        ("native-jax", "sdpa_poisoned_nan_f32", {}, {"output": "nan"}),
        ("native-jax", "sdpa_poisoned_huge_f32", {"output": "uniform"}, {}),
        ("native-jax", "sdpa_blockwise_everything_f32", {"output": "uniform"}, {}),
        ("native-jax", "sdpa_causal_cross_f32", None, None),
        ("native-paddle", "mha_masked_rows_f32", {"output": "uniform", "weights": "uniform"}, {}),
        ("native-paddle", "mha_masked_rows_f16", None, None),
    ],
)
def test_recorded_departures_follow_from_properties(loaded, target, case, empty, poisoned):
    dep = departures.recorded(target, loaded[case])
    if empty is None:
        assert dep is None
    else:
        assert (dep.empty, dep.poisoned) == (empty, poisoned)


def test_a_precision_rule_by_dtype(loaded):
    assert departures.recorded("native-jax", loaded["sdpa_self_f64"]).within == 1e-6
    assert departures.recorded("native-jax", loaded["sdpa_self_f32"]) is None


# --- the docs and the CLI -------------------------------------------------------------------


def test_the_docs_table_is_the_registrys():
    text = (ROOT / "docs" / "conformance.md").read_text()
    assert spec.update_doc(text) == text, "run python -m multiattn.conformance.spec"


def test_list_cases():
    proc = subprocess.run(
        [sys.executable, "-m", "multiattn.conformance", "--list-cases"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for v in C.VARIANTS:
        assert v.name in proc.stdout
    assert "empty_rows, causal, causal_more_queries" in proc.stdout
