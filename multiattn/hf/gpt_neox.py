"""The GPT-NeoX family of `multiattn.hf.pretrained` (Pythia, GPT-NeoX-20B): config reader
and tensor table; imports no framework.

It loads into `multiattn.models.causal_lm.CausalLM` with the blocks' options that
transformers' ``modeling_gpt_neox.py`` fixes: LayerNorm with offsets (``layer_norm_eps``),
the attention and the feed-forward network side by side on two norms
(``parallel_residual``, unless ``use_parallel_residual`` is false), rotary positions on
the first ``partial_rotary_factor`` of each head (``rotary_dim``; default 0.25), one
fused query/key/value projection whose rows come per head (``(H, 3, D)``: the Entry
kind ``grouped_qkv``), biases on every projection or none (``attention_bias``, the
attention's; the feed-forward network always has them), the exact GELU and an untied
head (``embed_out``).
"""

from __future__ import annotations

from ._common import Entry, Family, _int, _positive, _width_and_heads
from .causal_lm import _INPUTS, _LAYER, _base, _bool, _lm_head, partial_rope

__all__ = ["GPT_NEOX"]

_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "intermediate_size", "max_position_embeddings", "layer_norm_eps",
         "use_parallel_residual", "attention_bias", "tie_word_embeddings", "rope_theta",
         "rope_scaling", "rope_parameters", "rotary_pct", "rotary_emb_base")  # fmt: skip


def _sizes(raw: dict, where: str) -> dict:
    e, h = _width_and_heads(raw, where)
    if "rotary_emb_base" in raw and "rope_theta" not in raw:  # the name before 5.0
        raw = {**raw, "rope_theta": _positive(raw, "rotary_emb_base", where)}
    bias = _bool(raw, "attention_bias", where, True)
    return _base({
        "vocab_size": _int(raw, "vocab_size", where), "hidden_size": e,
        "num_layers": _int(raw, "num_hidden_layers", where), "num_heads": h,
        "intermediate_size": _int(raw, "intermediate_size", where),
        "max_positions": _int(raw, "max_position_embeddings", where),
        "epsilon": _positive(raw, "layer_norm_eps", where, 1e-5), "norm": "layer",
        "activation": "gelu", "gated": False, "attention_bias": bias, "output_bias": bias,
        "ffn_bias": True, "parallel_residual": _bool(raw, "use_parallel_residual", where, True),
        "tied": _bool(raw, "tie_word_embeddings", where, False), "fused_qkv": True,
        **partial_rope(raw, where, e // h, "rotary_pct", 0.25),
    })  # fmt: skip


def _norm(src: str, dst: str, e: int) -> list[Entry]:
    return [Entry(src + ".weight", (e,), dst + "/gamma"), Entry(src + ".bias", (e,), dst + "/beta")]


def neox_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """``GPTNeoXForCausalLM``'s tensors for sizes ``s``."""
    e, f, h = s["hidden_size"], s["intermediate_size"], s["num_heads"]
    out = [Entry("gpt_neox.embed_in.weight", (s["vocab_size"], e), "embed/word")]
    for i in range(s["num_layers"]):
        src, dst = f"gpt_neox.layers.{i}.", f"layer_{i}/"
        out += _norm(src + "input_layernorm", dst + "norm_1", e)
        out += _norm(src + "post_attention_layernorm", dst + "norm_2", e)
        out.append(Entry(src + "attention.query_key_value.weight", (3 * e, e),
                         dst + "qkv/kernel", "grouped_qkv", h))  # fmt: skip
        out.append(Entry(src + "attention.dense.weight", (e, e),
                         dst + "self_attention/attention_output/kernel", "heads_out", h))  # fmt: skip
        if s["attention_bias"]:
            out += [
                Entry(src + "attention.query_key_value.bias", (3 * e,), dst + "qkv/bias",
                      "grouped_qkv", h),
                Entry(src + "attention.dense.bias", (e,),
                      dst + "self_attention/attention_output/bias"),
            ]  # fmt: skip
        out += [
            Entry(src + "mlp.dense_h_to_4h.weight", (f, e), dst + "ffn/up/kernel", "linear"),
            Entry(src + "mlp.dense_h_to_4h.bias", (f,), dst + "ffn/up/bias"),
            Entry(src + "mlp.dense_4h_to_h.weight", (e, f), dst + "ffn/down/kernel", "linear"),
            Entry(src + "mlp.dense_4h_to_h.bias", (e,), dst + "ffn/down/bias"),
        ]  # fmt: skip
    out += _norm("gpt_neox.final_layer_norm", "final_norm", e)
    head = _lm_head(s)
    return out + [Entry("embed_out.weight", x.shape, x.name, x.kind) for x in head]


def _buffers(s: dict) -> dict:
    """What checkpoints written before transformers 5 also hold: each layer's causal mask,
    its ``masked_bias`` and the rotary table's inverse frequencies."""
    p, d = s["max_positions"], s["rotary_dim"] or s["hidden_size"] // s["num_heads"]
    out = {}
    for i in range(s["num_layers"]):
        src = f"gpt_neox.layers.{i}.attention."
        out.update({src + "bias": (1, 1, p, p), src + "masked_bias": (),
                    src + "rotary_emb.inv_freq": (d // 2,)})  # fmt: skip
    if s["tied"]:
        out["embed_out.weight"] = (s["vocab_size"], s["hidden_size"])
    return out


GPT_NEOX = Family(
    model_type="gpt_neox",
    architecture="GPTNeoXForCausalLM",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_sizes,
    keys=_KEYS,
    entries=neox_entries,
    fixed={"hidden_act": ("gelu",)},
    inert=frozenset({"attention_dropout", "hidden_dropout", "classifier_dropout"}),
    buffers=_buffers,
)
