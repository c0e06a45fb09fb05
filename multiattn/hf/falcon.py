"""The Falcon family of `multiattn.hf.pretrained` (config reader and tensor table; imports
no framework). It loads into `multiattn.models.causal_lm.CausalLM`.

Falcon (transformers' ``modeling_falcon.py``) comes in three layouts, all rotary
(``alibi`` is refused), LayerNorm, exact GELU (``activation``), biases on every projection
or none (``bias``) and a tied head by default:

* ``new_decoder_architecture`` (Falcon-40B, -180B, -11B): grouped key/value heads
  (``num_kv_heads``), the attention and the feed-forward network side by side on two
  norms (``ln_attn``, ``ln_mlp``; one shared ``input_layernorm`` with
  ``num_ln_in_parallel_attn: 1``);
* the first layout with ``multi_query`` (Falcon-7B): one key/value head, both branches
  side by side on one norm (``parallel_attn``) or one after the other;
* the first layout without ``multi_query``: a key/value head per query head.

The fused ``query_key_value`` rows come in groups of query heads, one key head and one
value head (the Entry kind ``grouped_qkv``): ``num_kv_heads`` groups of ``H / num_kv_heads``
query heads (new layout), one group of every query head (multi-query), or one group per
head.
"""

from __future__ import annotations

from ._common import Entry, Family, _int, _positive, _width_and_heads
from .causal_lm import _INPUTS, _LAYER, _base, _bool, _lm_head, _rope, _tied_buffer

__all__ = ["FALCON"]

_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_kv_heads", "num_ln_in_parallel_attn", "layer_norm_epsilon",
         "new_decoder_architecture", "multi_query", "parallel_attn", "bias",
         "max_position_embeddings", "ffn_hidden_size", "tie_word_embeddings", "rope_theta",
         "rope_scaling", "rope_parameters", "num_key_value_heads")  # fmt: skip


def _kv_heads(raw: dict, where: str, h: int, new: bool, mqa: bool) -> int:
    """The key/value heads: the fused projection's groups (`falcon_entries`). The
    ``num_key_value_heads`` that transformers 5.25 and later derive and write (from
    ``num_kv_heads``, ``new_decoder_architecture`` and ``multi_query``; a stored value is
    recomputed on loading) must agree with that derivation."""
    kv = _derived_kv(raw, where, h, new, mqa)
    stored = raw.get("num_key_value_heads")
    if stored is not None and stored != kv:
        raise ValueError(
            f"{where}: `num_key_value_heads` ({stored!r}) disagrees with the {kv} key/value "
            f"heads that `num_kv_heads`, `new_decoder_architecture` and `multi_query` give."
        )
    return kv


def _derived_kv(raw: dict, where: str, h: int, new: bool, mqa: bool) -> int:
    kv = _int(raw, "num_kv_heads", where, h)
    if new:
        if h % kv:
            raise ValueError(
                f"{where}: `num_attention_heads` ({h}) must be a multiple of `num_kv_heads` ({kv})."
            )
        return kv
    if mqa:
        return 1
    if kv != h:  # transformers' first layout holds a key/value head per query head
        raise ValueError(
            f"{where}: config option `num_kv_heads` = {kv} is not implemented with "
            f"new_decoder_architecture=false and multi_query=false (it must equal "
            f"num_attention_heads={h})."
        )
    return h


def _sizes(raw: dict, where: str) -> dict:
    e, h = _width_and_heads(raw, where)
    new = _bool(raw, "new_decoder_architecture", where, False)
    parallel = new or _bool(raw, "parallel_attn", where, True)
    kv = _kv_heads(raw, where, h, new, _bool(raw, "multi_query", where, True))
    norms = raw.get("num_ln_in_parallel_attn")
    if norms not in (None, 1, 2):
        raise ValueError(
            f"{where}: config option `num_ln_in_parallel_attn` = {norms!r} is not implemented "
            "(multiattn's falcon supports null, 1 or 2)."
        )
    two = new and norms in (None, 2)  # the first layout's parallel blocks share one norm
    bias = _bool(raw, "bias", where, False)
    theta, scaling = _rope(raw, where)
    return _base({
        "vocab_size": _int(raw, "vocab_size", where), "hidden_size": e,
        "num_layers": _int(raw, "num_hidden_layers", where), "num_heads": h,
        "num_key_value_heads": kv, "intermediate_size": _int(raw, "ffn_hidden_size", where,
                                                             4 * e),
        # FalconConfig's default: Falcon-7B's and -40B's configs do not write it
        "max_positions": _int(raw, "max_position_embeddings", where, 2048),
        "epsilon": _positive(raw, "layer_norm_epsilon", where, 1e-5), "norm": "layer",
        "activation": "gelu", "gated": False, "attention_bias": bias, "output_bias": bias,
        "ffn_bias": bias, "parallel_residual": parallel, "shared_norm": parallel and not two,
        "rope_theta": theta, "rope_scaling": scaling,
        "tied": _bool(raw, "tie_word_embeddings", where, True), "fused_qkv": True,
    })  # fmt: skip


def _norm(src: str, dst: str, e: int) -> list[Entry]:
    return [Entry(src + ".weight", (e,), dst + "/gamma"), Entry(src + ".bias", (e,), dst + "/beta")]


def _layer_norms(s: dict, src: str, dst: str) -> list[Entry]:
    e = s["hidden_size"]
    if not s["parallel_residual"]:
        names = ("input_layernorm", "post_attention_layernorm")
    elif s["shared_norm"]:
        names = ("input_layernorm",)
    else:
        names = ("ln_attn", "ln_mlp")
    return [x for i, n in enumerate(names) for x in _norm(src + n, f"{dst}norm_{i + 1}", e)]


def falcon_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """``FalconForCausalLM``'s tensors for sizes ``s``."""
    e, f, h, kv = s["hidden_size"], s["intermediate_size"], s["num_heads"], s["num_key_value_heads"]
    groups, group = kv, h // kv  # every layout: a group per key/value head
    rows = (h + 2 * kv) * (e // h)
    out = [Entry("transformer.word_embeddings.weight", (s["vocab_size"], e), "embed/word")]
    for i in range(s["num_layers"]):
        src, dst = f"transformer.h.{i}.", f"layer_{i}/"
        qkv = src + "self_attention.query_key_value."
        dense = src + "self_attention.dense."
        out += _layer_norms(s, src, dst)
        out += [
            Entry(qkv + "weight", (rows, e), dst + "qkv/kernel", "grouped_qkv", groups, group),
            Entry(dense + "weight", (e, e), dst + "self_attention/attention_output/kernel",
                  "heads_out", h),
            Entry(src + "mlp.dense_h_to_4h.weight", (f, e), dst + "ffn/up/kernel", "linear"),
            Entry(src + "mlp.dense_4h_to_h.weight", (e, f), dst + "ffn/down/kernel", "linear"),
        ]  # fmt: skip
        if s["attention_bias"]:
            out += [
                Entry(qkv + "bias", (rows,), dst + "qkv/bias", "grouped_qkv", groups, group),
                Entry(dense + "bias", (e,), dst + "self_attention/attention_output/bias"),
                Entry(src + "mlp.dense_h_to_4h.bias", (f,), dst + "ffn/up/bias"),
                Entry(src + "mlp.dense_4h_to_h.bias", (e,), dst + "ffn/down/bias"),
            ]  # fmt: skip
    return out + _norm("transformer.ln_f", "final_norm", e) + _lm_head(s)


FALCON = Family(
    model_type="falcon",
    architecture="FalconForCausalLM",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_sizes,
    keys=_KEYS,
    entries=falcon_entries,
    fixed={
        "activation": ("gelu",),
        "alibi": (False,),
        "apply_residual_connection_post_layernorm": (False,),
    },
    inert=frozenset({"hidden_dropout", "attention_dropout"}),
    buffers=_tied_buffer,
)
