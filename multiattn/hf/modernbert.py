"""The ModernBERT family of `multiattn.hf.pretrained` (``modernbert``: config reader and
tensor table; imports no framework). It loads into `multiattn.models.modernbert.
ModernBertModel`, the base model (``ModernBertModel``) or, when ``architectures`` names
``ModernBertForMaskedLM``, with its masked-LM head.

What the reader takes from ``config.json``:

* the layer kinds: ``layer_types`` (``"full_attention"`` / ``"sliding_attention"`` per
  layer), or, in earlier configs, every ``global_attn_every_n_layers``-th layer (default
  3, from layer 0) full and the others sliding;
* the sliding layers' window ``local_attention`` (default 128 tokens in all: each token
  attends the ``local_attention // 2`` tokens on either side, a symmetric
  ``sliding_window`` of ``local_attention // 2 + 1`` in multiattn's terms);
* the rotary base per kind: ``rope_parameters.full_attention`` /
  ``rope_parameters.sliding_attention`` (transformers 5), else ``global_rope_theta`` /
  ``local_rope_theta``; defaults 160000 and 10000; a ``rope_scaling`` applies to both,
  as in transformers;
* ``norm_eps``, ``norm_bias`` (every LayerNorm), ``attention_bias``, ``mlp_bias``,
  ``hidden_activation``, and for the head ``classifier_activation``, ``classifier_bias``
  and ``decoder_bias``; the head's decoder is tied to the word embeddings.

The first layer has no attention norm (transformers' ``Identity``).
"""

from __future__ import annotations

from dataclasses import replace

from ._common import Entry, Family, _int, _positive, _width_and_heads
from .causal_lm import _INPUTS, _bool, _rope
from .encoders import masked_lm_of
from .gemma import _KINDS, _layer_kinds

__all__ = ["MODERNBERT"]

_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "max_position_embeddings", "norm_eps", "norm_bias",
         "attention_bias", "mlp_bias", "hidden_activation", "layer_types",
         "global_attn_every_n_layers", "local_attention", "rope_parameters", "rope_scaling",
         "global_rope_theta", "local_rope_theta", "classifier_activation", "classifier_bias",
         "decoder_bias", "tie_word_embeddings")  # fmt: skip
#: transformers' activation names that multiattn computes the same way
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "silu", "swish", "relu")
_THETA = {"full_attention": (160000.0, "global_rope_theta"),
          "sliding_attention": (10000.0, "local_rope_theta")}  # fmt: skip
_ARCHITECTURE = "ModernBertForMaskedLM"
# dropouts, initialisation, the classification heads' pooling, kernel and training
# switches; and two keys earlier transformers versions wrote that no code of ModernBERT's
# reads (``layer_norm_eps``, ``position_embedding_type``)
_INERT = frozenset({
    "initializer_cutoff_factor", "embedding_dropout", "mlp_dropout", "attention_dropout",
    "classifier_pooling", "deterministic_flash_attn", "sparse_prediction",
    "sparse_pred_ignore_index", "reference_compile", "repad_logits_with_grad",
    "cls_token_id", "layer_norm_eps", "position_embedding_type",
})  # fmt: skip


def _activation(raw: dict, key: str, where: str) -> str:
    value = raw.get(key, "gelu")
    if value not in _ACTIVATIONS:
        raise ValueError(
            f"{where}: config option `{key}` = {value!r} is not implemented (supported: "
            f"{', '.join(_ACTIVATIONS)})."
        )
    return value


def _kinds(raw: dict, where: str, layers: int) -> list[str]:
    """Each layer's kind: ``layer_types``, else every ``global_attn_every_n_layers``-th
    layer full, from the first."""
    if raw.get("layer_types") is not None:
        return _layer_kinds(raw, where, layers, 1)
    every = _int(raw, "global_attn_every_n_layers", where, 3)
    return [_KINDS[i % every == 0] for i in range(layers)]


def _rope_of_kinds(raw: dict, where: str) -> dict[str, tuple]:
    """``kind -> (rope_theta, rope_scaling)``, as transformers' ``ModernBertConfig``
    builds ``rope_parameters``: the kind's entry, its theta else the legacy key's else
    the default, updated by ``rope_scaling``."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - set(_KINDS):
        raise ValueError(
            f"{where}: config option `rope_parameters` = {params!r} is not implemented "
            f"(multiattn's modernbert reads the kinds {_KINDS})."
        )
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: `rope_scaling` must be an object; received {scaling!r}.")
    out = {}
    for kind, (default, legacy) in _THETA.items():
        entry = params.get(kind) or {}
        if not isinstance(entry, dict):
            raise ValueError(
                f"{where}: `rope_parameters.{kind}` must be an object; received {entry!r}."
            )
        theta = entry.get("rope_theta", raw.get(legacy, default))
        merged = {**entry, "rope_theta": theta, **scaling}
        out[kind] = _rope({"rope_parameters": merged}, f"{where} ({kind})")
    return out


def _sizes(raw: dict, where: str) -> dict:
    e, h = _width_and_heads(raw, where)
    layers = _int(raw, "num_hidden_layers", where)
    kinds, rope = _kinds(raw, where, layers), _rope_of_kinds(raw, where)
    window = _int(raw, "local_attention", where, 128) // 2 + 1
    sliding = {"sliding_window": window, "rope_theta": rope["sliding_attention"][0],
               "rope_scaling": rope["sliding_attention"][1]}  # fmt: skip
    overrides = [dict(sliding) if kind == "sliding_attention" else {} for kind in kinds]
    overrides[0]["attention_norm"] = False  # transformers' Identity
    attention_bias = _bool(raw, "attention_bias", where, False)
    masked_lm = masked_lm_of(raw, where, _ARCHITECTURE)
    return {
        "vocab_size": _int(raw, "vocab_size", where), "hidden_size": e, "num_heads": h,
        "num_layers": layers, "intermediate_size": _int(raw, "intermediate_size", where),
        "max_positions": _int(raw, "max_position_embeddings", where, 8192),
        "epsilon": _positive(raw, "norm_eps", where, 1e-5), "norm": "layer",
        "norm_bias": _bool(raw, "norm_bias", where, False), "gated": True,
        "activation": _activation(raw, "hidden_activation", where),
        "attention_bias": attention_bias, "output_bias": attention_bias,
        "ffn_bias": _bool(raw, "mlp_bias", where, False),
        "rope_theta": rope["full_attention"][0], "rope_scaling": rope["full_attention"][1],
        "layers": overrides, "masked_lm": masked_lm,
        **({"head_activation": _activation(raw, "classifier_activation", where),
            "head_bias": _bool(raw, "classifier_bias", where, False),
            "decoder_bias": _bool(raw, "decoder_bias", where, True)} if masked_lm else {}),
    }  # fmt: skip


def _proj(src: str, dst: str, shape: tuple, bias: bool, kind: str = "linear",
          heads: int = 1) -> list[Entry]:  # fmt: skip
    """A projection's weight (and, with ``bias``, its ``(out,)`` bias)."""
    out = [Entry(src + ".weight", shape, dst + "/kernel", kind, heads)]
    return out + ([Entry(src + ".bias", (shape[0],), dst + "/bias")] if bias else [])


def _norm(s: dict, src: str, dst: str) -> list[Entry]:
    e = s["hidden_size"]
    out = [Entry(src + ".weight", (e,), dst + "/gamma")]
    return out + ([Entry(src + ".bias", (e,), dst + "/beta")] if s["norm_bias"] else [])


def modernbert_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """``ModernBertModel``'s tensors for sizes ``s``, or ``ModernBertForMaskedLM``'s (the
    base model's under ``model.``, then ``head.`` and the decoder's bias)."""
    e, f, h, v = s["hidden_size"], s["intermediate_size"], s["num_heads"], s["vocab_size"]
    qkv, ffn = s["attention_bias"], s["ffn_bias"]
    out = [Entry("embeddings.tok_embeddings.weight", (v, e), "embed/word"),
           *_norm(s, "embeddings.norm", "embed/norm")]  # fmt: skip
    for i in range(s["num_layers"]):
        src, dst = f"layers.{i}.", f"layer_{i}/"
        if i:
            out += _norm(s, src + "attn_norm", dst + "norm_1")
        out += _proj(src + "attn.Wqkv", dst + "qkv", (3 * e, e), qkv)
        out += _proj(src + "attn.Wo", dst + "self_attention/attention_output", (e, e), qkv,
                     "heads_out", h)  # fmt: skip
        out += _norm(s, src + "mlp_norm", dst + "norm_2")
        out += _proj(src + "mlp.Wi", dst + "ffn/gate_up", (2 * f, e), ffn)
        out += _proj(src + "mlp.Wo", dst + "ffn/down", (e, f), ffn)
    out += _norm(s, "final_norm", "final_norm")
    if not s["masked_lm"]:
        return out
    head = [*_proj("head.dense", "mlm/dense", (e, e), s["head_bias"]),
            *_norm(s, "head.norm", "mlm/norm")]  # fmt: skip
    if s["decoder_bias"]:
        head.append(Entry("decoder.bias", (v,), "mlm/bias"))
    return [replace(x, hf=f"model.{x.hf}") for x in out] + head


def _buffers(s: dict) -> dict:
    """The tied decoder's weight, which a masked-LM checkpoint may store (read, checked,
    not used)."""
    return {"decoder.weight": (s["vocab_size"], s["hidden_size"])} if s["masked_lm"] else {}


MODERNBERT = Family(
    model_type="modernbert",
    architecture="ModernBertModel",
    prefix="model",
    inputs=_INPUTS,
    layer="multiattn.models.modernbert:ModernBertModel",
    read_sizes=_sizes,
    keys=_KEYS,
    entries=modernbert_entries,
    inert=_INERT,
    buffers=_buffers,
    heads={"masked_lm": _ARCHITECTURE},
)
