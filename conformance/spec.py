"""The conformance cases as a specification: what each variant is and what it exercises.

Every variant (``cases.VARIANTS``) has a one-line description and a set of *properties*.
Most properties are computed from the variant's own inputs by the plain NumPy functions
below (an empty row is a query row of the combined keep mask with no allowed key; grouped
heads come from the shapes; poisoned from non-finite keys or values); the few that the
inputs cannot show are declared next to the description (`DESCRIPTIONS`) or by the
operation (``cases.OPERATIONS[op].declares``). The native targets' recorded departures
(`departures.KNOWN`) are written in terms of these properties.

``python -m multiattn.conformance --list-cases`` prints the table; ``docs/conformance.md``
holds it too (``python -m multiattn.conformance.spec`` writes it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Every property, with what it means. Computed ones first.
PROPERTIES: dict[str, str] = {
    "empty_rows": "some query row has no key it may attend (computed from the keep mask)",
    "causal": "a causal (bottom-right aligned) mask",
    "causal_more_queries": "causal with more queries than keys: the first rows are empty",
    "causal_one_query": "causal with one query, which sees every key",
    "grouped_heads": "fewer key/value heads than query heads (grouped- or multi-query)",
    "valid_lens": "valid lengths select the keys",
    "per_query_lens": "one valid length per query (2-D lengths)",
    "mask": "a boolean keep mask (True = may attend)",
    "poisoned": "keys or values hold NaN or an infinity where no query may attend",
    "blockwise": "params['block_size'] forces the blockwise (online-softmax) path",
    "custom_scale": "a score scale other than 1/sqrt(d)",
    "value_dim": "the value width differs from the key width",
    "self_attention": "one input is query, key and value",
    "rope": "rotary position embedding",
    # declared
    "cache": "decoded token by token through the key/value cache (declared by the op)",
    "huge_values": "masked keys and values hold 1e30: finite, but overflow if attended",
    "interleaved_heads": "heads split from the projections in interleaved order",
    "no_bias": "projections without biases",
    "zero_rows": "rows of zeros (the normalisation's epsilon matters)",
    "document": "a source document's convention, through its adapter (declared by the op)",
}


# --- keep masks and empty rows -------------------------------------------------------------


def keep_mask(
    batch: int,
    heads: int,
    queries: int,
    keys: int,
    *,
    lens: Any = None,
    mask: Any = None,
    causal: bool = False,
) -> np.ndarray:
    """The allowed (query, key) pairs, bool ``(batch, heads, queries, keys)``.

    ``lens``: ``(batch,)`` or per query ``(batch, queries)``; key ``j`` is kept where
    ``j < length``. ``mask``: bool ``(batch, queries, keys)`` or ``(batch, heads, queries,
    keys)`` (or broadcastable), True = may attend. ``causal``: bottom-right aligned, query
    ``i`` sees keys ``j <= i + keys - queries``. Written plainly here, independently of the
    oracle's helpers."""
    keep = np.ones((batch, heads, queries, keys), dtype=bool)
    if lens is not None:
        lens = np.asarray(lens)
        per_row = lens.reshape(batch, 1, -1, 1) if lens.ndim == 2 else lens.reshape(batch, 1, 1, 1)
        keep &= np.arange(keys) < per_row
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        keep &= m[:, None] if m.ndim == 3 else m
    if causal:
        i, j = np.arange(queries)[:, None], np.arange(keys)[None, :]
        keep &= j <= i + (keys - queries)
    return keep


def empty_rows(keep: np.ndarray) -> np.ndarray:
    """The query rows with no allowed key: bool, ``keep``'s shape without the last axis."""
    return ~np.asarray(keep, dtype=bool).any(axis=-1)


def poisoned_batch(inputs: dict) -> np.ndarray | None:
    """Per batch element: whether its keys or values hold NaN or an infinity (None when
    the op has no keys or values)."""
    names = [n for n in ("key", "value", "keys", "values", "k", "v") if n in inputs]
    if not names:
        return None
    bad = [~np.isfinite(np.asarray(inputs[n], dtype=np.float64)) for n in names]
    return np.any([b.reshape(len(b), -1).any(axis=1) for b in bad], axis=0)


# --- properties ----------------------------------------------------------------------------


def _heads_of(op: str, inputs: dict, weights: dict) -> tuple[int, int] | None:
    """(query heads, key/value heads) where the shapes show them, else None."""
    if op == "sdpa" and inputs["query"].ndim == 4:
        return inputs["query"].shape[-3], inputs["key"].shape[-3]
    for prefix in ("", "self_"):
        if f"{prefix}W_q" in weights and f"{prefix}W_k" in weights:
            # same head width for queries and keys: the widths are in the heads' ratio
            return weights[f"{prefix}W_q"].shape[1], weights[f"{prefix}W_k"].shape[1]
    return None


def _value_dim(op: str, inputs: dict, weights: dict) -> bool:
    if op == "sdpa":
        return inputs["value"].shape[-1] != inputs["query"].shape[-1]
    if "W_v" in weights and "W_k" in weights:
        return weights["W_v"].shape[1] != weights["W_k"].shape[1]
    return False


def computed_properties(op: str, inputs: dict, weights: dict, params: dict) -> set[str]:
    """The properties that ``op``'s inputs, weights and parameters show."""
    from .cases import OPERATIONS

    found = set(OPERATIONS[op].declares) if op in OPERATIONS else set()
    keep = OPERATIONS[op].rows(inputs, params) if op in OPERATIONS else None
    if keep is not None and empty_rows(keep).any():
        found.add("empty_rows")
    causal = bool(params.get("causal"))
    if causal:
        found.add("causal")
    if causal and keep is not None:
        tq, tk = keep.shape[-2:]
        found |= {"causal_more_queries"} if tq > tk else set()
        found |= {"causal_one_query"} if tq == 1 else set()
    heads = _heads_of(op, inputs, weights)
    if heads is not None and heads[1] < heads[0]:
        found.add("grouped_heads")
    lens = [inputs[n] for n in ("valid_lens", "context_valid_lens") if n in inputs]
    found |= {"valid_lens"} if lens else set()
    found |= {"per_query_lens"} if any(np.ndim(x) >= 2 for x in lens) else set()
    found |= {"mask"} if "mask" in inputs else set()
    bad = poisoned_batch(inputs)
    found |= {"poisoned"} if bad is not None and bad.any() else set()
    found |= {"blockwise"} if "block_size" in params else set()
    found |= {"custom_scale"} if params.get("scale") is not None else set()
    found |= {"value_dim"} if _value_dim(op, inputs, weights) else set()
    found |= {"self_attention"} if params.get("self") else set()
    found |= {"rope"} if op == "rope" or params.get("rotary_max_length") else set()
    return found


def variant_of(case_name: str) -> str:
    """The variant of a case name ``<variant>_<f64|f32|f16|bf16>``."""
    return case_name.rsplit("_", 1)[0]


def case_properties(case) -> set[str]:
    """The properties of a loaded `fixtures.Case`: computed from its arrays, plus those
    its variant declares."""
    declared = DESCRIPTIONS.get(variant_of(case.name), ("", ()))[1]
    return computed_properties(case.op, case.inputs, case.weights, case.params) | set(declared)


def variant_properties(variant) -> set[str]:
    """The properties of a `cases.Variant`, from its float64 inputs."""
    from .cases import seed_of

    inputs, weights, params = variant.build(np.random.default_rng(seed_of(variant.name)))
    declared = DESCRIPTIONS.get(variant.name, ("", ()))[1]
    return computed_properties(variant.op, inputs, weights, params) | set(declared)


def ordered(properties: set[str]) -> list[str]:
    """``properties`` in the order of `PROPERTIES`."""
    return [p for p in PROPERTIES if p in properties] + sorted(set(properties) - set(PROPERTIES))


# --- the variants, described ----------------------------------------------------------------

#: variant -> (one-line description, declared properties).
DESCRIPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "masked_softmax_plain": ("softmax over the last axis, no mask", ()),
    "masked_softmax_lens_1d": ("one valid length per batch element", ()),
    "masked_softmax_lens_2d": ("one valid length per row", ()),
    "masked_softmax_zero_lens": ("lengths of 0: rows with nothing to attend are zeros", ()),
    "masked_softmax_mask": ("a random boolean mask, every row keeping its first entry", ()),
    "masked_softmax_all_masked_rows": ("mask and lengths together, two rows fully masked", ()),
    "scores_dot": ("query-key dot products", ()),
    "scores_scaled_dot": ("dot products scaled by 1/sqrt(d)", ()),
    "scores_scaled_dot_custom_scale": ("dot products with a given scale", ()),
    "scores_additive": ("additive (Bahdanau) scores of different query and key widths", ()),
    "scores_general": ("bilinear (Luong 'general') scores", ()),
    "sdpa_self": ("as many keys as queries, no mask", ()),
    "sdpa_cross": ("more keys than queries, no mask", ()),
    "sdpa_causal_self": ("causal, as many keys as queries", ()),
    "sdpa_causal_cross": ("causal, more keys than queries", ()),
    "sdpa_causal_more_queries": ("causal, more queries than keys", ()),
    "sdpa_custom_scale": ("a given score scale", ()),
    "sdpa_lens_1d": ("one valid length per batch element, one of them 0", ()),
    "sdpa_lens_2d": ("one valid length per query, some 0", ()),
    "sdpa_mask": ("a random boolean mask with one all-False row", ()),
    "sdpa_value_dim": ("values narrower than keys", ()),
    "sdpa_blockwise_causal_cross": ("sdpa_causal_cross through blocks of 3", ()),
    "sdpa_blockwise_causal_more_queries": ("sdpa_causal_more_queries through blocks of 2", ()),
    "sdpa_blockwise_lens_1d": ("sdpa_lens_1d through blocks of 3", ()),
    "sdpa_blockwise_lens_2d": ("sdpa_lens_2d through blocks of 2", ()),
    "sdpa_blockwise_mask": ("sdpa_mask through blocks of 3", ()),
    "sdpa_blockwise_everything": (
        "mask, per-query lengths, causal and a given scale at once, in blocks of 3",
        (),
    ),
    "sdpa_causal_one_query": ("causal, one query over five keys", ()),
    "sdpa_blockwise_causal_one_query": ("sdpa_causal_one_query through blocks of 2", ()),
    "sdpa_poisoned_nan": ("NaN in the keys and values no query may attend", ()),
    "sdpa_poisoned_inf": ("inf in the keys and values no query may attend", ()),
    "sdpa_poisoned_huge": ("1e30 in the keys and values no query may attend", ("huge_values",)),
    "sdpa_blockwise_poisoned_nan": ("sdpa_poisoned_nan through blocks of 2", ()),
    "sdpa_blockwise_poisoned_inf": ("sdpa_poisoned_inf through blocks of 2", ()),
    "sdpa_blockwise_poisoned_huge": ("sdpa_poisoned_huge through blocks of 2", ("huge_values",)),
    "sdpa_gqa_causal_lens": ("4 query heads over 2 key/value heads, causal, per-query lengths", ()),
    "sdpa_mqa": ("4 query heads over one key/value head, a mask per query head", ()),
    "sdpa_blockwise_gqa_causal_lens": ("sdpa_gqa_causal_lens through blocks of 2", ()),
    "mha_contiguous": ("multi-head attention, heads split contiguously", ()),
    "mha_interleaved": ("heads split in interleaved order", ("interleaved_heads",)),
    "mha_widths": ("query, key, value and output of different widths", ()),
    "mha_value_dim": ("value heads wider than key heads", ()),
    "mha_no_bias": ("projections without biases", ("no_bias",)),
    "mha_self_causal": ("causal self-attention of one input", ()),
    "mha_masked_rows": ("per-query lengths with zeros: some rows attend nothing", ()),
    "positional_interleaved": ("sinusoidal encoding, sin and cos interleaved", ()),
    "positional_concatenated": ("sinusoidal encoding, sines then cosines", ()),
    "encoder_post_ln": ("Transformer encoder layer, LayerNorm after each block", ()),
    "encoder_pre_ln": ("Transformer encoder layer, LayerNorm before each block", ()),
    "mha_gqa_cross": ("grouped-query cross-attention, 4 heads over 2", ()),
    "mha_mqa_cross": ("multi-query cross-attention, 4 heads over 1", ()),
    "mha_gqa_self_causal_rope": ("grouped-query causal self-attention with RoPE", ()),
    "mha_mqa_self_causal_rope": ("multi-query causal self-attention with RoPE", ()),
    "rope_offset_0": ("rotary embedding from position 0", ()),
    "rope_offset_3": ("rotary embedding from position 3", ()),
    "cache_mha": ("token-by-token decoding equals one causal pass", ()),
    "cache_gqa": ("decoding with 2 key/value heads for 4 query heads", ()),
    "cache_mqa": ("decoding with one key/value head", ()),
    "cache_gqa_rope": ("grouped-query decoding with RoPE", ()),
    "decoder_post_ln": ("Transformer decoder layer in one pass, post-LayerNorm", ()),
    "decoder_pre_ln_gqa_rope": ("decoder layer, pre-LayerNorm, grouped-query, RoPE", ()),
    "cache_decoder_post_ln": ("decoder_post_ln decoded token by token", ()),
    "cache_decoder_pre_ln_gqa_rope": ("decoder_pre_ln_gqa_rope decoded token by token", ()),
    "cache_decoder_post_ln_mqa": ("post-LayerNorm multi-query decoder, token by token", ()),
    "rms_norm_scale": ("RMSNorm with a learned scale", ()),
    "rms_norm_no_scale": ("RMSNorm without a scale", ()),
    "rms_norm_zero_rows": ("RMSNorm of rows of zeros", ("zero_rows",)),
    "doc_d2l_masked_softmax_lens_1d": ("the d2l masked softmax, lengths per batch element", ()),
    "doc_d2l_masked_softmax_lens_2d": ("the d2l masked softmax, lengths per row", ()),
    "doc_d2l_additive": ("the d2l additive attention", ()),
    "doc_d2l_dot": ("the d2l dot-product attention", ()),
    "doc_paddle_dot": ("the PaddlePaddle document's dot-product attention", ()),
    "doc_paddle_mha_interleaved": (
        "the PaddlePaddle document's multi-head attention",
        ("interleaved_heads",),
    ),
    "doc_tf_sdpa": ("the TensorFlow document's attention, mask 1 = masked out", ()),
    "doc_tf_mha": ("the TensorFlow document's multi-head attention", ()),
    "doc_tf_encoder": ("the TensorFlow document's encoder layer", ()),
}


def table() -> list[dict]:
    """One row per variant: name, op, dtypes, description, properties."""
    from .cases import DTYPE_SUFFIX, VARIANTS

    return [
        {
            "variant": v.name,
            "op": v.op,
            "dtypes": [DTYPE_SUFFIX[d] for d in v.dtypes],
            "description": DESCRIPTIONS[v.name][0],
            "properties": ordered(variant_properties(v)),
        }
        for v in VARIANTS
    ]


TABLE_BEGIN = "<!-- cases table: written by python -m multiattn.conformance.spec -->"
TABLE_END = "<!-- end of cases table -->"


def markdown_table() -> str:
    """The properties and the cases in Markdown tables, between `TABLE_BEGIN` and
    `TABLE_END`."""
    lines = [TABLE_BEGIN, "", "| property | meaning |", "| --- | --- |"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in PROPERTIES.items()]
    lines += [
        "",
        "| variant | op | dtypes | description | properties |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in table():
        props = ", ".join(f"`{p}`" for p in row["properties"])
        lines.append(
            f"| `{row['variant']}` | `{row['op']}` | {' '.join(row['dtypes'])} "
            f"| {row['description']} | {props} |"
        )
    return "\n".join([*lines, "", TABLE_END])


def update_doc(text: str) -> str:
    """``text`` with its cases table replaced by a fresh one."""
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    return text[:start] + markdown_table() + text[end:]


if __name__ == "__main__":  # pragma: no cover - rewrites docs/conformance.md
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "conformance.md"
    doc.write_text(update_doc(doc.read_text()))
