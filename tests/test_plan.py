"""The attention planner (`multiattn.ops.plan`): every decision rule on plain values.

The planner touches no tensor, so these tests need no framework: each builds an
`AttentionSpec` by hand and checks the `AttentionPlan`; hypothesis checks invariants
over many specs. The paths themselves are tested against the float64 oracle in
``tests/backend`` (`test_attention.py`, `test_blockwise.py`).
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multiattn.namespaces import contract as _contract
from multiattn.ops import blockwise
from multiattn.ops import plan as plan_module
from multiattn.ops.plan import (
    AttentionPlan,
    AttentionSpec,
    Capabilities,
    largest_divisor,
    plan_attention,
    wants_backward_timing,
    wants_chunks,
    wants_timing,
)

GIB = 1 << 30
NO_FUSED = Capabilities()
FUSED = Capabilities(has_fused_attention=True)  # a kernel that forms the scores (jax, tf)
STREAMS = Capabilities(
    has_fused_attention=True, fused_attention_streams=True, fused_attention_groups=True
)  # a kernel in linear memory taking grouped heads (torch)


def spec(**kw) -> AttentionSpec:
    """A small float32 self-attention call, changed by ``kw``."""
    base = dict(
        batch=2,
        heads=4,
        kv_heads=4,
        queries=16,
        keys=16,
        key_width=8,
        value_width=8,
        dtype="float32",
        capabilities=FUSED,
        memory_budget=GIB,
    )
    base.update(kw)
    return AttentionSpec(**base)


def plan(**kw) -> AttentionPlan:
    return plan_attention(spec(**kw))


# --- fused or explicit ----------------------------------------------------------------


@pytest.mark.parametrize("caps", [FUSED, STREAMS], ids=["fused", "streams"])
def test_weights_or_dropout_take_the_explicit_path(caps):
    for wanted in ({"weights": True}, {"dropout": True}):
        p = plan(capabilities=caps, fused_faster=True, **wanted)
        assert p.path == "explicit" and p.weights == wanted.get("weights", False)
        assert p.dropout == wanted.get("dropout", False)


def test_weights_win_over_the_memory_budget():
    p = plan(weights=True, memory_budget=1024, queries=512, keys=512)
    assert p.path == "explicit" and p.blocks is None


def test_the_measurement_decides_between_fused_and_explicit():
    assert plan(fused_faster=True).path == "fused"
    assert plan(fused_faster=False).path == "explicit"


def test_without_a_measurement_the_namespace_default_applies():
    pays = dataclasses.replace(FUSED, fused_attention_pays=True)
    loses = dataclasses.replace(FUSED, fused_attention_pays=False)
    assert plan(capabilities=pays).path == "fused"
    assert plan(capabilities=loses).path == "explicit"


@pytest.mark.parametrize(
    "kw",
    [
        {"capabilities": NO_FUSED},
        {"dtype": "float64"},
        {"value_width": 16},
        {"key_width": None, "value_width": None},
    ],
    ids=["no-kernel", "float64", "value-width", "unknown-width"],
)
def test_ineligible_calls_are_never_fused_nor_timed(kw):
    s = spec(fused_faster=True, **kw)
    assert plan_attention(s).path == "explicit" and not wants_timing(s)


@pytest.mark.parametrize("caps", [FUSED, STREAMS], ids=["fused", "streams"])
def test_a_bias_is_never_fused_and_goes_blockwise_over_the_budget(caps):
    s = spec(capabilities=caps, fused_faster=True, bias=True)
    assert plan_attention(s).path == "explicit" and not wants_timing(s)
    over = spec(capabilities=caps, bias=True, memory_budget=1024, queries=512, keys=512)
    assert plan_attention(over).path == "blockwise"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_is_computed_in_float32_and_may_be_fused(dtype):
    s = spec(dtype=dtype, fused_faster=True)
    assert s.compute_dtype == "float32" and plan_attention(s).path == "fused"


def test_timing_is_wanted_only_where_it_decides():
    assert wants_timing(spec())
    assert not wants_timing(spec(weights=True))
    assert not wants_timing(spec(capabilities=STREAMS))  # streams: fused regardless
    assert not wants_timing(spec(memory_budget=1024))  # blockwise regardless


# --- masks, causal, empty rows ------------------------------------------------------------


def test_an_unmasked_call_screens_only_the_query_on_the_fused_path():
    assert plan(fused_faster=True).screen == "query"
    assert plan(fused_faster=False).screen == "none"
    p = plan(fused_faster=False, mask=True)
    assert p.screen == "all" and p.empty_rows == "zero_outputs"


def test_a_mask_on_the_fused_path_lets_empty_rows_attend_then_zeroes_them():
    p = plan(mask=True, fused_faster=True)
    assert (p.path, p.empty_rows, p.screen) == ("fused", "kernel_then_zero", "all")


def test_returned_weights_zero_empty_rows_in_the_weights():
    assert plan(mask=True, weights=True).empty_rows == "zero_weights"
    assert plan(weights=True).empty_rows == "none"


def test_square_causal_uses_the_kernel_flag_where_the_kernel_streams():
    p = plan(capabilities=STREAMS, causal=True)
    assert (p.path, p.causal, p.empty_rows) == ("fused", "kernel", "none")
    assert not p.fold_masks


def test_causal_with_more_keys_than_queries_builds_the_mask():
    p = plan(capabilities=STREAMS, causal=True, queries=4, keys=16, fused_faster=True)
    assert (p.path, p.causal, p.empty_rows) == ("fused", "mask", "kernel_then_zero")
    assert plan(capabilities=STREAMS, causal=True, queries=4, keys=16).path == "fused"
    s = spec(capabilities=STREAMS, causal=True, queries=4, keys=16)
    assert wants_timing(s)  # not streaming: the kernel must earn its place


def test_causal_over_one_query_hides_nothing():
    p = plan(causal=True, queries=1, fused_faster=False)
    assert p.causal == "none" and p.screen == "none" and p.empty_rows == "none"


def test_lengths_per_sequence_stream_but_per_query_lengths_do_not():
    p = plan(capabilities=STREAMS, lengths="per_sequence", memory_budget=1024)
    assert (p.path, p.lengths) == ("fused", "mask")
    p = plan(capabilities=STREAMS, lengths="per_query", memory_budget=1024)
    assert (p.path, p.lengths) == ("blockwise", "blocks")


def test_lengths_and_causal_together_are_not_left_to_the_kernel():
    p = plan(capabilities=STREAMS, lengths="per_sequence", causal=True, fused_faster=True)
    assert (p.path, p.causal, p.lengths) == ("fused", "mask", "mask")


def test_a_caller_mask_never_streams():
    s = spec(capabilities=STREAMS, mask=True, memory_budget=1024)
    assert plan_attention(s).path == "blockwise"


# --- the memory budget and blocks ---------------------------------------------------------


def test_scores_over_the_budget_take_the_blockwise_path():
    scores = 2 * 4 * 16 * 16 * 4
    assert plan(memory_budget=scores).path != "blockwise"
    p = plan(memory_budget=scores - 1, causal=True, lengths="per_query")
    assert (p.path, p.causal, p.lengths, p.empty_rows) == (
        "blockwise",
        "blocks",
        "blocks",
        "online",
    )
    assert p.blocks == blockwise.plan_blocks((2, 4, 16, 16), 4, None, budget=scores - 1)


def test_float64_scores_count_eight_bytes():
    scores32 = 2 * 4 * 16 * 16 * 4
    assert plan(memory_budget=scores32, dtype="float64").path == "blockwise"


def test_a_streaming_kernel_needs_no_blocks_whatever_the_budget():
    assert plan(capabilities=STREAMS, memory_budget=1024).path == "fused"


def test_a_streaming_kernel_refused_by_the_caller_is_not_taken():
    """``settings(fused_attention=False)``: the explicit path within the budget, the
    blockwise path beyond it."""
    assert plan(capabilities=STREAMS, fused_faster=False).path == "explicit"
    assert plan(capabilities=STREAMS, fused_faster=False, memory_budget=1024).path == "blockwise"
    causal = plan(capabilities=STREAMS, fused_faster=False, causal=True)
    assert (causal.path, causal.causal) == ("explicit", "mask")


def test_a_forced_block_size_wins_over_streaming_and_is_clipped():
    p = plan(capabilities=STREAMS, block_size=(4, 100))
    assert (p.path, p.blocks) == ("blockwise", (4, 16))


def test_a_forced_block_size_needs_static_lengths():
    with pytest.raises(ValueError, match="block_size"):
        plan(queries=None, block_size=(4, 4))


def test_unknown_lengths_never_take_blocks_by_budget():
    assert plan(queries=None, memory_budget=1).path != "blockwise"


def test_traced_calls_limit_the_number_of_query_blocks():
    kw = dict(batch=1, heads=1, kv_heads=1, queries=8192, keys=8192, memory_budget=1 << 16)
    eager, traced = plan(**kw).blocks, plan(traced=True, **kw).blocks
    assert math.ceil(8192 / eager[0]) > blockwise.MAX_QUERY_BLOCKS
    assert math.ceil(8192 / traced[0]) <= blockwise.MAX_QUERY_BLOCKS


# --- grouped heads ------------------------------------------------------------------------


def test_grouped_heads_are_repeated_only_for_a_kernel_without_groups_and_for_blocks():
    grouped = dict(heads=8, kv_heads=2)
    assert plan(fused_faster=True, **grouped).repeat_kv  # FUSED takes no groups
    assert not plan(capabilities=STREAMS, **grouped).repeat_kv
    assert not plan(fused_faster=False, **grouped).repeat_kv  # explicit: grouped contraction
    assert plan(memory_budget=1024, **grouped).repeat_kv
    assert not plan(fused_faster=True).repeat_kv  # nothing to repeat


def test_key_value_heads_must_divide_the_query_heads():
    with pytest.raises(ValueError, match="must divide"):
        spec(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="must divide"):
        spec(heads=None, kv_heads=2)


@pytest.mark.parametrize(
    "kw", [{"lengths": "batch"}, {"queries": -1}, {"batch": 2.0}, {"heads": True, "kv_heads": True}]
)
def test_a_spec_refuses_malformed_facts(kw):
    with pytest.raises(ValueError, match="AttentionSpec"):
        spec(**kw)


# --- plans no path implements -------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"path": "explicit", "causal": "kernel"},  # the kernel's flag off the fused path
        {"path": "fused", "causal": "kernel", "lengths": "mask", "screen": "all"},
        {"path": "fused", "blocks": (4, 4), "screen": "query"},
        {"path": "blockwise", "empty_rows": "online"},  # no blocks
        {"path": "blockwise", "blocks": (4, 4), "empty_rows": "online", "causal": "mask"},
        {"path": "explicit", "causal": "blocks"},
        {"path": "fused", "weights": True, "screen": "query"},
        {"path": "blockwise", "blocks": (4, 4), "empty_rows": "online", "dropout": True},
        {"path": "explicit", "empty_rows": "online"},
        {"path": "explicit", "repeat_kv": True},
        {"path": "fused"},  # an unscreened query could zero a row inside the kernel
        {"path": "ring"},
        {"path": "explicit", "chunks": 0},
        {"path": "explicit", "chunks": True},
        {"path": "explicit", "chunks": 2, "weights": True},
        {"path": "explicit", "chunks": 2, "dropout": True},
        {"path": "fused", "chunks": 2, "screen": "query"},
        {"path": "blockwise", "blocks": (4, 4), "empty_rows": "online", "chunks": 2},
        {"path": "fused", "backward": "recompute", "screen": "query"},
        {"path": "blockwise", "blocks": (4, 4), "empty_rows": "online", "backward": "saved"},
        {"path": "explicit", "backward": "recompute", "weights": True},
        {"path": "explicit", "backward": "saved", "dropout": True},
        {"path": "explicit", "backward": "recompute", "bias": True},
        {"path": "explicit", "backward": "manual"},
        {"path": "explicit", "backward": True},
    ],
)
def test_a_plan_no_path_implements_cannot_be_built(kw):
    with pytest.raises(ValueError, match="AttentionPlan"):
        AttentionPlan(**kw)


# --- slices of the batch ---------------------------------------------------------------

MAPS = Capabilities(maps_batch=True)  # explicit path only (no fused kernel)


@pytest.mark.parametrize(
    ("batch", "asked", "chunks"),
    [(8, 4, 4), (8, 3, 2), (6, 4, 3), (6, 8, 6), (1, 8, 1), (7, 4, 1), (8, None, 1), (8, 1, 1)],
)
def test_chunks_are_the_largest_divisor_of_the_batch_not_above_the_request(batch, asked, chunks):
    p = plan(batch=batch, chunks=asked, capabilities=MAPS)
    assert p.path == "explicit" and p.chunks == chunks


@pytest.mark.parametrize(
    "kw",
    [
        {"capabilities": NO_FUSED},  # a namespace that does not map batches
        {"capabilities": MAPS, "weights": True},
        {"capabilities": MAPS, "dropout": True},
        {"capabilities": MAPS, "batch": None},
        {"capabilities": MAPS, "block_size": (4, 4)},  # blockwise
        {"capabilities": Capabilities(has_fused_attention=True, maps_batch=True)},  # fused
    ],
)
def test_chunks_apply_only_to_the_explicit_path_of_a_namespace_that_maps_batches(kw):
    assert plan(**{"batch": 8, "chunks": 4, **kw}).chunks == 1


def test_chunks_are_chosen_only_for_compiled_explicit_calls_with_a_batch():
    assert wants_chunks(spec(batch=8, capabilities=MAPS, traced=True))
    for kw in (
        {"traced": False},
        {"chunks": 2},  # asked for: nothing to measure
        {"chunks": 1},
        {"batch": 1},
        {"batch": None},
        {"weights": True},
        {"capabilities": NO_FUSED},
        {"block_size": (4, 4)},
    ):
        assert not wants_chunks(spec(**{"batch": 8, "capabilities": MAPS, "traced": True, **kw}))


def test_chunks_are_chosen_in_eager_calls_where_the_slices_pay_eagerly():
    eager = Capabilities(maps_batch=True, maps_batch_eagerly=True)  # Paddle's
    assert wants_chunks(spec(batch=8, capabilities=eager, traced=False))
    assert not wants_chunks(spec(batch=8, capabilities=MAPS, traced=False))
    for kw in ({"chunks": 2}, {"batch": 1}, {"weights": True}):
        assert not wants_chunks(spec(**{"batch": 8, "capabilities": eager, **kw}))


MIB = 1 << 20


def test_the_mapping_threshold_is_glibcs_largest():
    # mallopt(3): DEFAULT_MMAP_THRESHOLD_MAX is 4 * 1024 * 1024 * sizeof(long) on 64-bit
    assert plan_module.MMAP_THRESHOLD_MAX == 4 * 1024 * 1024 * 8 == 32 * MIB
    assert plan_module.SLICE_SCORE_BYTES == 16 * MIB
    assert isinstance(plan_module.glibc(), bool)


@pytest.mark.parametrize(
    ("backend", "device", "rows", "want"),
    [
        ("tensorflow", "cpu", 1, True),  # a batch-1 decoding step compiled by XLA
        ("tensorflow", "cpu", 8, False),
        ("tensorflow", "cpu", None, False),  # a size unknown
        ("tensorflow", None, 1, False),  # TensorFlow's own graph or eager
        ("tensorflow", "gpu", 1, False),  # an accelerator: never a CPU's choice
        ("jax", "cpu", 1, False),
        ("torch", None, 1, False),
    ],
)
def test_joined_projections_only_for_one_row_under_xla_on_a_cpu(backend, device, rows, want):
    assert plan_module.joins_projections(backend, device, rows) is want


@pytest.mark.parametrize(
    ("sizes", "dtype", "device", "want"),
    [
        # (batch, heads, queries, keys): scores of batch * heads * queries * keys * 4 bytes
        ((8, 8, 512, 512), "float32", "cpu", 4),  # 64 MiB: 4 slices of 16 MiB
        ((8, 8, 512, 512), "float16", "cpu", 4),  # computed in float32: the same bytes
        ((8, 8, 512, 256), "float32", "cpu", 1),  # 32 MiB: at the threshold, not above
        ((8, 8, 512, 512), "float64", "cpu", 8),  # 128 MiB: 8 slices of 16 MiB
        ((16, 8, 512, 1024), "float32", "cpu", 16),  # 256 MiB: 16 slices of 16 MiB
        ((32, 8, 512, 1024), "float32", "cpu", 16),  # 512 MiB: at most 16 slices
        ((3, 16, 1024, 1024), "float32", "cpu", 1),  # 192 MiB, no power of two divides 3
        ((6, 16, 1024, 1024), "float32", "cpu", 2),  # 384 MiB: the most slices dividing 6
        ((8, 8, 512, 512), "float32", "gpu", 1),  # a CPU's allocator only
        ((8, 8, 512, 512), "float32", None, 1),  # not compiled by XLA
        ((None, 8, 512, 512), "float32", "cpu", 1),  # a size unknown
        ((8, 8, None, 512), "float32", "cpu", 1),
    ],
)
def test_default_chunks_keep_each_slices_scores_under_the_mapping_threshold(
    monkeypatch, sizes, dtype, device, want
):
    b, h, tq, tk = sizes
    s = spec(batch=b, heads=h, kv_heads=h, queries=tq, keys=tk, dtype=dtype, capabilities=MAPS)
    monkeypatch.setattr(plan_module, "glibc", lambda: True)
    assert plan_module.default_chunks(s, device) == want
    monkeypatch.setattr(plan_module, "glibc", lambda: False)  # musl, macOS
    assert plan_module.default_chunks(s, device) == 1


@pytest.mark.parametrize(
    ("batch", "wanted", "slices"), [(8, 4, 4), (6, 4, 3), (7, 4, 1), (2, 8, 2), (5, 1, 1)]
)
def test_the_largest_divisor_not_above_the_setting(batch, wanted, slices):
    assert largest_divisor(batch, wanted) == slices


# --- the explicit path's own backward pass ------------------------------------------------


@pytest.mark.parametrize("backward", ["recompute", "saved"])
def test_the_own_backward_pass_is_taken_where_decided_on_the_explicit_path(backward):
    assert plan(capabilities=NO_FUSED, backward=backward).backward == backward
    assert plan(capabilities=MAPS, batch=8, chunks=4, backward=backward).chunks == 4
    for kw in (
        {"backward": None},  # not decided: automatic
        {"backward": "autodiff"},
        {"backward": backward, "weights": True},
        {"backward": backward, "dropout": True},
        {"backward": backward, "bias": True},
        {"backward": backward, "block_size": (4, 4)},  # blockwise: its own backward
        {"backward": backward, "capabilities": FUSED, "fused_faster": True},
    ):
        p = plan(**{"capabilities": NO_FUSED, **kw})
        assert p.backward == "autodiff", (kw, p)


@pytest.mark.parametrize("backward", ["manual", True, ""])
def test_a_spec_refuses_an_unknown_backward(backward):
    with pytest.raises(ValueError, match="backward"):
        spec(backward=backward)


def test_backward_timing_is_wanted_only_for_compiled_explicit_calls_without_bias():
    assert wants_backward_timing(spec(capabilities=NO_FUSED, traced=True))
    for kw in (
        {"traced": False},  # eager: differentiated automatically
        {"backward": "recompute"},  # decided: nothing to measure
        {"backward": "autodiff"},
        {"weights": True},
        {"dropout": True},
        {"bias": True},
        {"block_size": (4, 4)},
        {"capabilities": FUSED, "fused_faster": True},
    ):
        assert not wants_backward_timing(
            spec(**{"capabilities": NO_FUSED, "traced": True, **kw})
        ), kw


def test_capabilities_are_the_contract_flags_with_its_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(Capabilities)}
    assert set(fields) <= set(_contract.CAPABILITIES)
    assert fields == {name: getattr(_contract.Namespace, name) for name in fields}


def test_capabilities_are_read_from_a_namespace():
    class Namespace:
        has_fused_attention = True
        fused_attention_streams = False
        fused_attention_groups = 1
        fused_attention_pays = False
        softmax_exact_zeros = True
        maps_batch = 1
        maps_batch_eagerly = 1

    caps = Capabilities.of(Namespace())
    assert caps == Capabilities(
        has_fused_attention=True,
        fused_attention_groups=True,
        fused_attention_pays=False,
        softmax_exact_zeros=True,
        maps_batch=True,
        maps_batch_eagerly=True,
    )


def test_the_planner_imports_no_framework():
    code = (
        "import sys, multiattn.ops.plan\n"
        "print(sorted(m for m in ('keras', 'torch', 'jax', 'tensorflow', 'paddle')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- invariants over many specs -------------------------------------------------------

_size = st.integers(1, 64)
_caps = st.builds(
    Capabilities,
    has_fused_attention=st.booleans(),
    fused_attention_streams=st.booleans(),
    fused_attention_groups=st.booleans(),
    fused_attention_pays=st.booleans(),
    softmax_exact_zeros=st.booleans(),
)


@st.composite
def specs(draw) -> AttentionSpec:
    kv_heads = draw(st.integers(1, 4))
    width = draw(st.sampled_from([8, 16]))
    block = draw(st.none() | st.tuples(st.integers(1, 80), st.integers(1, 80)))
    causal = draw(st.booleans())
    static = block is not None or causal or draw(st.booleans())
    return AttentionSpec(
        batch=draw(st.none() | _size),
        heads=kv_heads * draw(st.integers(1, 4)),
        kv_heads=kv_heads,
        queries=draw(_size if static else st.none() | _size),
        keys=draw(_size if static else st.none() | _size),
        key_width=width,
        value_width=draw(st.sampled_from([width, 2 * width])),
        dtype=draw(st.sampled_from(["float16", "bfloat16", "float32", "float64"])),
        capabilities=draw(_caps),
        memory_budget=draw(st.integers(64, 1 << 22)),
        mask=draw(st.booleans()),
        lengths=draw(st.sampled_from(["none", "per_sequence", "per_query"])),
        causal=causal,
        weights=draw(st.booleans()),
        dropout=draw(st.booleans()),
        traced=draw(st.booleans()),
        block_size=block,
        fused_faster=draw(st.none() | st.booleans()),
        chunks=draw(st.none() | st.integers(1, 20)),
        bias=draw(st.booleans()),
        backward=draw(st.none() | st.sampled_from(["autodiff", "recompute", "saved"])),
    )


def _score_bytes(s: AttentionSpec, rows: int, cols: int) -> int:
    itemsize = 8 if s.compute_dtype == "float64" else 4
    return (s.batch or 1) * (s.heads or 1) * rows * cols * itemsize


@settings(max_examples=400, deadline=None)
@given(specs())
def test_plan_invariants(s):
    p = plan_attention(s)
    if s.weights or s.dropout:
        assert p.path == "explicit" and p.blocks is None
    if p.path == "fused":
        assert s.capabilities.has_fused_attention and s.compute_dtype == "float32"
        assert s.key_width == s.value_width and p.screen != "none"
    if p.causal == "kernel":
        assert p.path == "fused" and s.queries == s.keys and not s.mask
        assert s.lengths == "none"
    if s.masked:
        # only a square causal mask left to the kernel leaves no row empty
        assert p.screen == "all" and (p.empty_rows != "none") == (p.causal != "kernel")
    else:
        assert p.empty_rows in ("none", "online") and p.screen != "all"
    assert (p.causal == "none") == (not s.causal or s.queries == 1)
    assert (p.lengths == "none") == (s.lengths == "none")
    assert p.repeat_kv <= (s.groups > 1)
    assert (p.path == "explicit") <= (not p.repeat_kv)
    if p.chunks > 1:
        assert p.path == "explicit" and s.capabilities.maps_batch and not (s.weights or s.dropout)
        assert s.batch % p.chunks == 0 and p.chunks <= s.chunks
    else:
        assert p.chunks == 1
    if p.backward != "autodiff":
        assert p.path == "explicit" and s.backward == p.backward
        assert not (s.weights or s.dropout or s.bias)
    if wants_backward_timing(s):
        assert p.path == "explicit" and s.traced and s.backward is None


@settings(max_examples=400, deadline=None)
@given(specs())
def test_blocks_cover_the_sequences_and_respect_the_budget(s):
    p = plan_attention(s)
    if p.path != "blockwise":
        # the direct path forms the scores only within the budget, unless a kernel
        # streams, the weights are wanted, or the sizes are unknown
        known = None not in (s.queries, s.keys)
        if known and _score_bytes(s, s.queries, s.keys) > s.memory_budget:
            streams = p.path == "fused" and s.capabilities.fused_attention_streams
            assert s.weights or s.dropout or (streams and not s.mask)
        return
    bq, bk = p.blocks
    for size, block in ((s.queries, bq), (s.keys, bk)):
        count = math.ceil(size / block)
        assert 1 <= block <= size and (count - 1) * block < size <= count * block
    if s.block_size is not None:
        assert p.blocks == (min(s.block_size[0], s.queries), min(s.block_size[1], s.keys))
        return
    assert _score_bytes(s, s.queries, s.keys) > s.memory_budget
    floor_q = min(s.queries, blockwise.MIN_BLOCK)
    if s.traced:
        assert math.ceil(s.queries / bq) <= blockwise.MAX_QUERY_BLOCKS
        floor_q = max(floor_q, math.ceil(s.queries / blockwise.MAX_QUERY_BLOCKS))
    # one block's scores stay within the share of the budget, unless the smallest
    # blocks allowed are larger
    share = max(s.memory_budget // blockwise.SCORE_SHARE, 1)
    smallest = _score_bytes(s, floor_q, min(s.keys, blockwise.MIN_BLOCK))
    assert _score_bytes(s, bq, bk) <= max(share, smallest)


def test_within_the_budget_the_direct_path_runs_traced_or_not():
    """Blockwise or direct is decided by the budget and a forced block size alone: no
    spec field (and so no tuner) takes the blockwise path for scores that fit."""
    large = dict(batch=1, heads=8, kv_heads=8, queries=1024, keys=1024, key_width=64)
    for traced in (False, True):
        assert plan(**large, value_width=64, traced=traced).blocks is None
        over = plan(**large, value_width=64, traced=traced, memory_budget=16 << 20)
        assert over.path == "blockwise"
    assert "blockwise_faster" not in {f.name for f in dataclasses.fields(AttentionSpec)}
