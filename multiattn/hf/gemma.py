"""The Gemma families of `multiattn.hf.pretrained`: Gemma, Gemma 2 and Gemma 3 text
(config readers and tensor tables; imports no framework).

All three load into `multiattn.models.causal_lm.CausalLM`, as Llama does
(`multiattn.hf.causal_lm`), with the options of the shared blocks they need:

* Gemma: RMSNorm with the gain ``1 + weight`` (``norm_offset``, the final norm too), the
  token embeddings times ``sqrt(hidden_size)`` (``embed_scale``), the gated tanh GELU
  (``gelu_pytorch_tanh``), an explicit ``head_dim`` (default 256), a tied head by default.
* Gemma 2: also a norm after the attention and after the feed-forward network
  (``post_norms``), the attention scale ``query_pre_attn_scalar ** -0.5``
  (``query_scale``), soft-capped attention scores (``attention_softcap``) and logits
  (``logit_softcap``), and sliding-window layers among full ones (``layer_types``, or
  every other layer), as per-layer overrides of the block.
* Gemma 3 text: also query/key norms (``qk_norm``, Gemma's ``1 + weight``) and a rotary
  base per layer kind (``rope_parameters.sliding_attention`` / ``full_attention``, or the
  older ``rope_local_base_freq`` / ``rope_theta``), rope scaling on the full layers only.
"""

from __future__ import annotations

from typing import Any

from ._common import Entry, Family, _int, _positive
from .causal_lm import _ROPE_KEYS, _bool, _llama_like, _llama_sizes, _rope, llama_entries

__all__ = ["GEMMA", "GEMMA2", "GEMMA3_TEXT", "GEMMA_FAMILIES"]

_KINDS = ("sliding_attention", "full_attention")
# transformers 5 writes `use_bidirectional_attention: null` (Gemma, Gemma 2) or false.
_CAUSAL = {"use_bidirectional_attention": (None, False)}


def _gemma_sizes(raw: dict, where: str, rope: bool = True) -> dict[str, Any]:
    """Gemma's sizes (shared by the three): Llama's, with ``head_dim`` default 256,
    ``1 + weight`` norms, scaled embeddings, the gated tanh GELU, biases on all four
    attention projections or none, the head tied by default."""
    raw = {"head_dim": 256, **raw}
    if not rope:  # Gemma 3's rotary options are read per layer kind
        raw = {k: v for k, v in raw.items() if k not in _ROPE_KEYS}
    bias = _bool(raw, "attention_bias", where, False)
    sizes = _llama_sizes(raw, where)
    return {**sizes, "activation": "gelu_pytorch_tanh", "norm_offset": True,
            "embed_scale": sizes["hidden_size"] ** 0.5, "attention_bias": bias,
            "output_bias": bias, "tied": _bool(raw, "tie_word_embeddings", where, True)}  # fmt: skip


def _optional_positive(raw: dict, key: str, where: str) -> float | None:
    return None if raw.get(key) is None else _positive(raw, key, where)


def _layer_kinds(raw: dict, where: str, layers: int, pattern: int) -> list[str]:
    """``layer_types`` (one of `_KINDS` per layer), or, without it, every
    ``sliding_window_pattern``-th layer full and the others sliding (transformers'
    default: Gemma 2 every 2nd, Gemma 3 every 6th)."""
    kinds = raw.get("layer_types")
    if kinds is None:
        key = next((k for k in ("sliding_window_pattern", "_sliding_window_pattern")
                    if raw.get(k) is not None), None)  # fmt: skip
        if key is not None:
            pattern = _int(raw, key, where)
        return [_KINDS[(i + 1) % pattern == 0] for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in _KINDS for k in kinds):
        raise ValueError(
            f"{where}: config option `layer_types` = {kinds!r} is not implemented (multiattn "
            f"supports a list of {layers} kinds among {_KINDS})."
        )
    return kinds


def _windows(raw: dict, where: str, kinds: list[str]) -> list[dict]:
    """One override per layer: ``sliding_window`` on the sliding layers."""
    window = raw.get("sliding_window")
    if "sliding_attention" in kinds and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):  # fmt: skip
        raise ValueError(
            f"{where}: config option `sliding_window` = {window!r} is not implemented "
            "(sliding-window layers need a positive integer)."
        )
    return [{"sliding_window": window} if k == "sliding_attention" else {} for k in kinds]


def _gemma2_like(raw: dict, where: str, sizes: dict, pattern: int) -> tuple[dict, list]:
    """``(sizes, layer kinds)`` with the options Gemma 2 adds (Gemma 3 too): post norms,
    the attention scale, the two soft-caps and the per-layer sliding windows."""
    kinds = _layer_kinds(raw, where, sizes["num_layers"], pattern)
    return {**sizes, "post_norms": True,
            "query_scale": _positive(raw, "query_pre_attn_scalar", where, 256) ** -0.5,
            "attention_softcap": _optional_positive(raw, "attn_logit_softcapping", where),
            "logit_softcap": _optional_positive(raw, "final_logit_softcapping", where),
            "layers": _windows(raw, where, kinds)}, kinds  # fmt: skip


def _gemma2_sizes(raw: dict, where: str) -> dict:
    return _gemma2_like(raw, where, _gemma_sizes(raw, where), 2)[0]


def _gemma3_rope(raw: dict, where: str) -> dict[str, tuple[float, dict | None]]:
    """``kind -> (rope_theta, rope_scaling)`` for the two layer kinds: from transformers
    5's ``rope_parameters`` keyed by kind, or from ``rope_theta`` (default 1e6) and
    ``rope_scaling`` (full layers) and ``rope_local_base_freq`` (default 1e4; sliding
    layers, never scaled)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(_KINDS):
        if set(params) - set(_KINDS):
            raise ValueError(
                f"{where}: config option `rope_parameters` = {params!r} is not implemented "
                f"(multiattn's gemma3_text reads the kinds {_KINDS})."
            )
        default = {"sliding_attention": 10000.0, "full_attention": 1000000.0}
        return {
            kind: _rope(
                {"rope_parameters": {"rope_theta": default[kind], **(params.get(kind) or {})}},
                f"{where} ({kind})",
            )
            for kind in _KINDS
        }
    full = _rope({"rope_theta": 1000000.0, **{k: raw[k] for k in _ROPE_KEYS if k in raw}}, where)
    local = _positive(raw, "rope_local_base_freq", where, 10000.0)
    return {"full_attention": full, "sliding_attention": (local, None)}


def _gemma3_sizes(raw: dict, where: str) -> dict:
    sizes, kinds = _gemma2_like(raw, where, _gemma_sizes(raw, where, rope=False), 6)
    rope = _gemma3_rope(raw, where)
    theta, scaling = rope["full_attention"]
    layers = [
        {**layer, "rope_theta": rope[kind][0], "rope_scaling": rope[kind][1]}
        if kind == "sliding_attention" else layer
        for kind, layer in zip(kinds, sizes["layers"])
    ]  # fmt: skip
    return {**sizes, "qk_norm": True, "rope_theta": theta, "rope_scaling": scaling,
            "layers": layers}  # fmt: skip


def gemma_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """Gemma's tensors: Llama's table (with ``q_norm``/``k_norm`` for ``qk_norm``); with
    ``post_norms`` (Gemma 2 and 3) ``post_attention_layernorm`` is the norm after the
    attention (``post_norm_1``), and ``pre_feedforward_layernorm`` (``norm_2``) and
    ``post_feedforward_layernorm`` (``post_norm_2``) follow."""
    out = llama_entries(s, pooler)
    if not s.get("post_norms"):
        return out
    e, moved = s["hidden_size"], []
    for entry in out:
        if entry.hf.endswith(".post_attention_layernorm.weight"):
            src, dst = entry.hf.rsplit("post_attention_layernorm", 1)[0], entry.name.split("/")[0]
            moved += [
                Entry(entry.hf, (e,), f"{dst}/post_norm_1/scale"),
                Entry(src + "pre_feedforward_layernorm.weight", (e,), f"{dst}/norm_2/scale"),
                Entry(src + "post_feedforward_layernorm.weight", (e,), f"{dst}/post_norm_2/scale"),
            ]
        else:
            moved.append(entry)
    return moved


def _gemma_family(model_type, architecture, sizes, keys=(), fixed=None) -> Family:
    """Llama's family (`_llama_like`) with Gemma's tensor table, ``attention_bias`` read,
    and causal attention required."""
    return _llama_like(model_type, architecture, sizes, keys=("attention_bias", *keys),
                       fixed={**_CAUSAL, **(fixed or {})}, entries=gemma_entries)  # fmt: skip


_GEMMA2_KEYS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "sliding_window", "layer_types")  # fmt: skip
GEMMA = _gemma_family(
    "gemma", "GemmaForCausalLM", lambda raw, where: _gemma_sizes(raw, where),
    fixed={"hidden_act": ("gelu_pytorch_tanh",)},
)  # fmt: skip
GEMMA2 = _gemma_family(
    "gemma2", "Gemma2ForCausalLM", _gemma2_sizes, keys=_GEMMA2_KEYS,
    fixed={"hidden_activation": ("gelu_pytorch_tanh",)},
)  # fmt: skip
GEMMA3_TEXT = _gemma_family(
    "gemma3_text", "Gemma3ForCausalLM", _gemma3_sizes,
    keys=(*_GEMMA2_KEYS, "rope_local_base_freq", "sliding_window_pattern",
          "_sliding_window_pattern"),
    fixed={"hidden_activation": ("gelu_pytorch_tanh",)},
)  # fmt: skip

GEMMA_FAMILIES = (GEMMA, GEMMA2, GEMMA3_TEXT)
