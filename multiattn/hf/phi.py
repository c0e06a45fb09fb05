"""The Phi and Phi-3 families of `multiattn.hf.pretrained` (config readers and tensor
tables; imports no framework). Both load into `multiattn.models.causal_lm.CausalLM`.

* Phi (``phi``: Phi-1, Phi-1.5, Phi-2): one LayerNorm per block read by the attention
  and the feed-forward network side by side (``parallel_residual`` with
  ``shared_norm``), rotary positions on the first ``partial_rotary_factor`` of each head
  (default 0.5), biases on every projection, the tanh GELU, a final LayerNorm and an
  output projection with a bias (``head_bias``).
* Phi-3 (``phi3``: Phi-3 and Phi-3.5 mini and medium, Phi-4-mini): Llama's blocks with the
  query, key and value projections fused into one ``qkv_proj`` and the gate and up
  projections into one ``gate_up_proj`` (``fused_qkv``, ``fused_gate_up``: the neutral
  weights keep them fused, the model splits them), an optional sliding window, and the
  ``longrope`` scaling (Phi-3 128k, Phi-3.5, Phi-4-mini) within the context it was
  pretrained on: there transformers rotates with the short factors and the tables' gain
  ``attention_factor`` (the ``per_plane`` scaling of `multiattn.ops.rotary_frequencies`),
  and the model's context is ``original_max_position_embeddings``; past it transformers
  switches every position of the call to the long factors, which multiattn does not, so
  longer inputs are refused (``max_positions``).
"""

from __future__ import annotations

import math

from ._common import Entry, Family, _int, _positive
from .causal_lm import (
    _INPUTS,
    _LAYER,
    _LLAMA_KEYS,
    _base,
    _bool,
    _llama_buffers,
    _lm_head,
    _mistral_sizes,
    _tied_buffer,
    partial_rope,
    qkv_entries,
)

__all__ = ["PHI", "PHI3", "PHI_FAMILIES"]

_DROPOUTS = frozenset({"resid_pdrop", "embd_pdrop", "attention_dropout"})

# --- Phi ------------------------------------------------------------------------------

_PHI_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
             "layer_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling",
             "rope_parameters", "partial_rotary_factor")  # fmt: skip


def _phi_sizes(raw: dict, where: str) -> dict:
    e, h = _int(raw, "hidden_size", where), _int(raw, "num_attention_heads", where)
    kv = _int(raw, "num_key_value_heads", where, h)
    if e % h or h % kv:
        raise ValueError(
            f"{where}: `hidden_size` ({e}) must be divisible by `num_attention_heads` ({h}), "
            f"and that by `num_key_value_heads` ({kv})."
        )
    return _base({
        "vocab_size": _int(raw, "vocab_size", where), "hidden_size": e,
        "num_layers": _int(raw, "num_hidden_layers", where), "num_heads": h,
        "num_key_value_heads": kv, "intermediate_size": _int(raw, "intermediate_size", where),
        "max_positions": _int(raw, "max_position_embeddings", where),
        "epsilon": _positive(raw, "layer_norm_eps", where, 1e-5), "norm": "layer",
        "activation": "gelu_new", "gated": False, "attention_bias": True,
        "output_bias": True, "ffn_bias": True, "parallel_residual": True,
        "shared_norm": True, "head_bias": True,
        "tied": _bool(raw, "tie_word_embeddings", where, False),
        **partial_rope(raw, where, e // h, "partial_rotary_factor", 0.5),
    })  # fmt: skip


def _pair(src: str, dst: str, shape: tuple, kind: str = "same", heads: int = 1) -> list:
    """A projection's weight and bias (HF ``src.weight``/``src.bias`` -> ``dst/kernel``,
    ``dst/bias``): a ``linear`` or ``heads_out`` kernel, whose bias ``(out,)`` is kept as
    it is."""
    return [Entry(src + ".weight", shape, dst + "/kernel", kind, heads),
            Entry(src + ".bias", (shape[0],), dst + "/bias")]  # fmt: skip


def phi_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """``PhiForCausalLM``'s tensors for sizes ``s``."""
    e, f, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    h = s["num_heads"]
    out = [Entry("model.embed_tokens.weight", (s["vocab_size"], e), "embed/word")]
    for i in range(s["num_layers"]):
        src, dst = f"model.layers.{i}.", f"layer_{i}/"
        out += qkv_entries(s, src + "self_attn.", dst)
        out += _pair(src + "self_attn.dense", dst + "self_attention/attention_output",
                     (e, h * d), "heads_out", h)  # fmt: skip
        out += _pair(src + "mlp.fc1", dst + "ffn/up", (f, e), "linear")
        out += _pair(src + "mlp.fc2", dst + "ffn/down", (e, f), "linear")
        out += [Entry(src + "input_layernorm.weight", (e,), dst + "norm_1/gamma"),
                Entry(src + "input_layernorm.bias", (e,), dst + "norm_1/beta")]  # fmt: skip
    out += [Entry("model.final_layernorm.weight", (e,), "final_norm/gamma"),
            Entry("model.final_layernorm.bias", (e,), "final_norm/beta")]  # fmt: skip
    return out + _lm_head(s) + [Entry("lm_head.bias", (s["vocab_size"],), "lm_head/bias")]


PHI = Family(
    model_type="phi",
    architecture="PhiForCausalLM",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_phi_sizes,
    keys=_PHI_KEYS,
    entries=phi_entries,
    fixed={"hidden_act": ("gelu_new",), "qk_layernorm": (False,)},
    inert=_DROPOUTS,
    buffers=_tied_buffer,
)

# --- Phi-3 ----------------------------------------------------------------------------


def _phi3_sizes(raw: dict, where: str) -> dict:
    """Llama's sizes (Mistral's sliding window), the two fused projections, and the rotary
    options of ``rope_parameters`` with its ``partial_rotary_factor`` (default 1); a
    longrope scaling as `_longrope` reads it."""
    raw, longrope = _without_longrope(raw)
    sizes = _mistral_sizes({k: v for k, v in raw.items() if k != "rope_parameters"}, where)
    if raw.get("head_dim") is None:
        sizes["head_dim"] = sizes["hidden_size"] // sizes["num_heads"]
    sizes.update(partial_rope(raw, where, sizes["head_dim"], "partial_rotary_factor"))
    if longrope is not None:
        planes = (sizes["rotary_dim"] or sizes["head_dim"]) // 2
        sizes.update(_longrope(raw, longrope, where, sizes["max_positions"], planes))
    return {**sizes, "fused_qkv": True, "fused_gate_up": True}


_LONGROPE = ("longrope", "su")  # "su": its name in Phi-3's first configs


def _without_longrope(raw: dict) -> tuple[dict, dict | None]:
    """``raw`` without its longrope scaling (in ``rope_parameters`` or ``rope_scaling``),
    and that scaling (None if it has none)."""
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if isinstance(value, dict) and value.get("rope_type", value.get("type")) in _LONGROPE:
            kept = {k: v for k, v in value.items() if k in ("rope_theta", "partial_rotary_factor")}
            return {**raw, key: kept or None}, value
    return raw, None


def _longrope(raw: dict, scaling: dict, where: str, context: int, planes: int) -> dict:
    """The sizes of a longrope scaling within its original context: the short factors and
    transformers' gain (``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original))``
    with ``factor`` given or ``max_position_embeddings / original``, 1 if at most 1), and
    ``max_positions`` = ``original_max_position_embeddings``."""
    original = _int(scaling, "original_max_position_embeddings", where,
                    raw.get("original_max_position_embeddings"))  # fmt: skip
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not isinstance(value, list) or len(value) != planes:
            raise ValueError(
                f"{where}: `rope_parameters.{key}` must be a list of {planes} numbers (one per "
                f"rotated plane); received {value!r}."
            )
    factor = scaling.get("factor")
    factor = context / original if factor is None else _positive(scaling, "factor", where)
    gain = scaling.get("attention_factor")
    if gain is None:
        gain = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    else:
        gain = _positive(scaling, "attention_factor", where)
    return {"rope_scaling": {"rope_type": "per_plane", "factors": list(scaling["short_factor"]),
                             "attention_factor": gain},
            "max_positions": min(context, original)}  # fmt: skip


def phi3_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """``Phi3ForCausalLM``'s tensors for sizes ``s`` (the fused projections' rows: the
    query heads, the key heads, the value heads; the gate, then the up projection)."""
    e, f, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    h, kv = s["num_heads"], s["num_key_value_heads"]
    out = [Entry("model.embed_tokens.weight", (s["vocab_size"], e), "embed/word")]
    for i in range(s["num_layers"]):
        src, dst = f"model.layers.{i}.", f"layer_{i}/"
        out += [
            Entry(src + "self_attn.qkv_proj.weight", ((h + 2 * kv) * d, e), dst + "qkv/kernel",
                  "linear"),
            Entry(src + "self_attn.o_proj.weight", (e, h * d),
                  dst + "self_attention/attention_output/kernel", "heads_out", h),
            Entry(src + "mlp.gate_up_proj.weight", (2 * f, e), dst + "ffn/gate_up/kernel",
                  "linear"),
            Entry(src + "mlp.down_proj.weight", (e, f), dst + "ffn/down/kernel", "linear"),
            Entry(src + "input_layernorm.weight", (e,), dst + "norm_1/scale"),
            Entry(src + "post_attention_layernorm.weight", (e,), dst + "norm_2/scale"),
        ]  # fmt: skip
    out.append(Entry("model.norm.weight", (e,), "final_norm/scale"))
    return out + _lm_head(s)


PHI3 = Family(
    model_type="phi3",
    architecture="Phi3ForCausalLM",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_phi3_sizes,
    keys=(*_LLAMA_KEYS, "sliding_window", "partial_rotary_factor"),
    entries=phi3_entries,
    # `attention_bias`: written by the checkpoints' own modelling code (false in all)
    fixed={"hidden_act": ("silu",), "attention_bias": (False,)},
    # `original_max_position_embeddings` acts only with a longrope scaling (`_longrope`).
    inert=_DROPOUTS | {"original_max_position_embeddings"},
    buffers=_llama_buffers,
)

PHI_FAMILIES = (PHI, PHI3)
