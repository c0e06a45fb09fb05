"""The OPT family of `multiattn.hf.pretrained` (config reader and tensor table; imports no
framework). It loads into `multiattn.models.causal_lm.CausalLM`.

OPT (transformers' ``modeling_opt.py``): learned positions whose table starts 2 rows
before position 0 (``position_offset``), LayerNorm pre-norm blocks with a final norm, or
post-norm blocks without one (``do_layer_norm_before=False``: OPT-350m), word
embeddings of their own width projected in and out (``word_embed_proj_dim``:
``embed_projection``), ReLU, biases on every projection or none (``enable_bias``) and a
head tied to the word embeddings by default.
"""

from __future__ import annotations

from ._common import Entry, Family, _int, _width_and_heads
from .causal_lm import _INPUTS, _LAYER, _base, _bool, _lm_head, qkv_entries

__all__ = ["OPT"]

_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "ffn_dim",
         "max_position_embeddings", "do_layer_norm_before", "_remove_final_layer_norm",
         "word_embed_proj_dim", "num_attention_heads", "enable_bias",
         "tie_word_embeddings")  # fmt: skip


def _sizes(raw: dict, where: str) -> dict:
    e, h = _width_and_heads(raw, where)
    pre = _bool(raw, "do_layer_norm_before", where, True)
    width = _int(raw, "word_embed_proj_dim", where, e)
    bias = _bool(raw, "enable_bias", where, True)
    return _base({
        "vocab_size": _int(raw, "vocab_size", where), "hidden_size": e,
        "num_layers": _int(raw, "num_hidden_layers", where), "num_heads": h,
        "intermediate_size": _int(raw, "ffn_dim", where),
        "max_positions": _int(raw, "max_position_embeddings", where), "epsilon": 1e-5,
        "norm": "layer", "norm_first": pre, "activation": "relu", "gated": False,
        "attention_bias": bias, "output_bias": bias, "ffn_bias": bias,
        "learned_positions": True, "position_offset": 2,
        "final_norm": pre and not _bool(raw, "_remove_final_layer_norm", where, False),
        "embed_projection": None if width == e else width,
        "tied": _bool(raw, "tie_word_embeddings", where, True),
    })  # fmt: skip


def _norm(src: str, dst: str, e: int) -> list[Entry]:
    return [Entry(src + ".weight", (e,), dst + "/gamma"), Entry(src + ".bias", (e,), dst + "/beta")]


def opt_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """``OPTForCausalLM``'s tensors for sizes ``s``."""
    e, f, h, v = s["hidden_size"], s["intermediate_size"], s["num_heads"], s["vocab_size"]
    width = s["embed_projection"] or e
    top = "model.decoder."
    out = [Entry(top + "embed_tokens.weight", (v, width), "embed/word"),
           Entry(top + "embed_positions.weight", (s["max_positions"] + 2, e),
                 "embed/position")]  # fmt: skip
    if s["embed_projection"] is not None:
        out += [Entry(top + "project_in.weight", (e, width), "embed/project_in", "linear"),
                Entry(top + "project_out.weight", (width, e), "project_out/kernel", "linear")]  # fmt: skip
    for i in range(s["num_layers"]):
        src, dst = f"{top}layers.{i}.", f"layer_{i}/"
        out += qkv_entries(s, src + "self_attn.", dst)
        attn_out = dst + "self_attention/attention_output/"
        out.append(Entry(src + "self_attn.out_proj.weight", (e, e), attn_out + "kernel",
                         "heads_out", h))  # fmt: skip
        out.append(Entry(src + "fc1.weight", (f, e), dst + "ffn/up/kernel", "linear"))
        out.append(Entry(src + "fc2.weight", (e, f), dst + "ffn/down/kernel", "linear"))
        if s["attention_bias"]:
            out += [Entry(src + "self_attn.out_proj.bias", (e,), attn_out + "bias"),
                    Entry(src + "fc1.bias", (f,), dst + "ffn/up/bias"),
                    Entry(src + "fc2.bias", (e,), dst + "ffn/down/bias")]  # fmt: skip
        out += _norm(src + "self_attn_layer_norm", dst + "norm_1", e)
        out += _norm(src + "final_layer_norm", dst + "norm_2", e)
    if s["final_norm"]:
        out += _norm(top + "final_layer_norm", "final_norm", e)
    return out + [Entry(x.hf, (v, width), x.name, x.kind) for x in _lm_head(s)]


def _buffers(s: dict) -> dict:
    """A tied head's ``lm_head.weight``, which older checkpoints store."""
    if not s["tied"]:
        return {}
    return {"lm_head.weight": (s["vocab_size"], s["embed_projection"] or s["hidden_size"])}


OPT = Family(
    model_type="opt",
    architecture="OPTForCausalLM",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_sizes,
    keys=_KEYS,
    entries=opt_entries,
    fixed={"activation_function": ("relu",), "layer_norm_elementwise_affine": (True,)},
    inert=frozenset(
        {"dropout", "attention_dropout", "activation_dropout", "layerdrop", "init_std"}
    ),
    buffers=_buffers,
)
