"""The decoder-only language-model families of `multiattn.hf.pretrained`: GPT-2,
Llama, Qwen2 and Mistral (config options and tensor tables; imports no framework).

All four load into one model, `multiattn.models.causal_lm.CausalLM`, described by the
sizes dict their `read_sizes` returns (the same keys for every family): widths and
counts, the normalisation (``norm``: ``"layer"`` or ``"rms"``), the feed-forward network
(``activation``, ``gated``), which projections carry biases, the positions (learned
``learned_positions`` or rotary ``rope_theta``/``rope_scaling``), ``sliding_window``,
``tied`` (output projection = word embeddings) and ``fused_qkv`` (GPT-2's one
``c_attn`` projection for queries, keys and values).
"""

from __future__ import annotations

from typing import Any

from ..ops.rotary import check_rotary_scaling
from ._common import Entry, Family, _int, _positive

__all__ = ["CAUSAL_LM_FAMILIES", "GPT2", "LLAMA", "MISTRAL", "QWEN2", "QWEN3"]

_INPUTS = ("input_ids", "attention_mask")
_LAYER = "multiattn.models.causal_lm:CausalLM"


def _bool(raw: dict, key: str, where: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: `{key}` must be a bool; received {value!r}.")
    return value


def _divisible(where: str, e: int, h: int, kv: int) -> None:
    if h % kv:
        raise ValueError(
            f"{where}: `num_attention_heads` ({h}) must be a multiple of "
            f"`num_key_value_heads` ({kv})."
        )


def _base(s: dict) -> dict[str, Any]:
    """Defaults shared by the families (each overrides what it changes)."""
    return {
        "num_key_value_heads": s["num_heads"], "head_dim": s["hidden_size"] // s["num_heads"],
        "norm": "rms", "activation": "silu", "gated": True, "attention_bias": False,
        "output_bias": False, "ffn_bias": False, "learned_positions": False,
        "rope_theta": 10000.0, "rope_scaling": None, "sliding_window": None,
        "fused_qkv": False, **s,
    }  # fmt: skip


# --- GPT-2 ----------------------------------------------------------------------------

_GPT2_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
              "layer_norm_epsilon", "tie_word_embeddings")  # fmt: skip


def _gpt2_sizes(raw: dict, where: str) -> dict:
    e, h = _int(raw, "n_embd", where), _int(raw, "n_head", where)
    if e % h:
        raise ValueError(f"{where}: `n_embd` ({e}) must be divisible by `n_head` ({h}).")
    inner = 4 * e if raw.get("n_inner") is None else _int(raw, "n_inner", where)
    return _base({
        "vocab_size": _int(raw, "vocab_size", where), "hidden_size": e,
        "num_layers": _int(raw, "n_layer", where), "num_heads": h,
        "intermediate_size": inner, "max_positions": _int(raw, "n_positions", where),
        "epsilon": _positive(raw, "layer_norm_epsilon", where, 1e-5), "norm": "layer",
        "activation": "gelu_new", "gated": False, "attention_bias": True,
        "output_bias": True, "ffn_bias": True, "learned_positions": True,
        "tied": _bool(raw, "tie_word_embeddings", where, True), "fused_qkv": True,
    })  # fmt: skip


def _lm_head(s: dict) -> list[Entry]:
    if s["tied"]:
        return []
    return [Entry("lm_head.weight", (s["vocab_size"], s["hidden_size"]), "lm_head/kernel",
                  "linear")]  # fmt: skip


def gpt2_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """GPT-2's tensors (``GPT2LMHeadModel`` names; Conv1D kernels stored ``(in, out)``)."""
    e, f, h = s["hidden_size"], s["intermediate_size"], s["num_heads"]
    out = [
        Entry("transformer.wte.weight", (s["vocab_size"], e), "embed/word"),
        Entry("transformer.wpe.weight", (s["max_positions"], e), "embed/position"),
    ]
    for i in range(s["num_layers"]):
        src, dst = f"transformer.h.{i}.", f"layer_{i}/"
        out += [
            Entry(src + "ln_1.weight", (e,), dst + "norm_1/gamma"),
            Entry(src + "ln_1.bias", (e,), dst + "norm_1/beta"),
            Entry(src + "attn.c_attn.weight", (e, 3 * e), dst + "qkv/kernel"),
            Entry(src + "attn.c_attn.bias", (3 * e,), dst + "qkv/bias"),
            Entry(src + "attn.c_proj.weight", (e, e),
                  dst + "self_attention/attention_output/kernel", "rows_heads", h),
            Entry(src + "attn.c_proj.bias", (e,), dst + "self_attention/attention_output/bias"),
            Entry(src + "ln_2.weight", (e,), dst + "norm_2/gamma"),
            Entry(src + "ln_2.bias", (e,), dst + "norm_2/beta"),
            Entry(src + "mlp.c_fc.weight", (e, f), dst + "ffn/up/kernel"),
            Entry(src + "mlp.c_fc.bias", (f,), dst + "ffn/up/bias"),
            Entry(src + "mlp.c_proj.weight", (f, e), dst + "ffn/down/kernel"),
            Entry(src + "mlp.c_proj.bias", (e,), dst + "ffn/down/bias"),
        ]  # fmt: skip
    out += [
        Entry("transformer.ln_f.weight", (e,), "final_norm/gamma"),
        Entry("transformer.ln_f.bias", (e,), "final_norm/beta"),
    ]
    return out + _lm_head(s)


def _tied_buffer(s: dict) -> dict:
    return {"lm_head.weight": (s["vocab_size"], s["hidden_size"])} if s["tied"] else {}


def _gpt2_buffers(s: dict) -> dict:
    p = s["max_positions"]
    out = _tied_buffer(s)
    for i in range(s["num_layers"]):
        out[f"transformer.h.{i}.attn.bias"] = (1, 1, p, p)
        out[f"transformer.h.{i}.attn.masked_bias"] = ()
    return out


GPT2 = Family(
    model_type="gpt2",
    architecture="GPT2LMHeadModel",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_gpt2_sizes,
    keys=_GPT2_KEYS,
    entries=gpt2_entries,
    fixed={
        "activation_function": ("gelu_new",),
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "reorder_and_upcast_attn": (False,),
    },
    inert=frozenset(
        {
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
            "summary_type",
            "summary_use_proj",
            "summary_activation",
            "summary_proj_to_labels",
            "summary_first_dropout",
            "n_ctx",
        }
    ),
    buffers=_gpt2_buffers,
)

# --- Llama, Qwen2, Mistral ------------------------------------------------------------

_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
_LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
               *_ROPE_KEYS)  # fmt: skip


def _rope(raw: dict, where: str) -> tuple[float, dict | None]:
    """``(theta, scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta``
    and ``rope_scaling`` (earlier); a scaling other than linear/llama3 is refused."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: `rope_parameters` must be an object; received {params!r}.")
    params = dict(params)
    theta = _positive(raw, "rope_theta", where, 10000.0)  # checked even when overridden
    if "rope_theta" in params:
        inner = _positive(params, "rope_theta", where)
        if "rope_theta" in raw and inner != theta:
            raise ValueError(
                f"{where}: `rope_theta` ({raw['rope_theta']!r}) and "
                f"`rope_parameters.rope_theta` ({params['rope_theta']!r}) disagree."
            )
        theta = inner
        params.pop("rope_theta")
    scaling = raw.get("rope_scaling") or params or None
    try:
        scaling = check_rotary_scaling(where, scaling, "rope_scaling")
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{where}: config option `rope_scaling`/`rope_parameters` is not implemented as "
            f"given ({err})"
        ) from None
    return theta, scaling


def partial_rope(raw: dict, where: str, head_dim: int, legacy: str = "", default: float = 1.0,
                 ) -> dict:  # fmt: skip
    """The rotary sizes of a family that may rotate only part of each head: ``rope_theta``,
    ``rope_scaling`` (`_rope`) and ``rotary_dim`` (``int(head_dim * factor)``, None for
    the whole head), the factor read from ``rope_parameters.partial_rotary_factor``
    (transformers 5) or the config's top-level key ``legacy`` (earlier:
    ``partial_rotary_factor``, GPT-NeoX's ``rotary_pct``), else ``default`` (the
    family's: GPT-NeoX 0.25, Phi 0.5)."""
    params = raw.get("rope_parameters")
    rest = {k: v for k, v in raw.items() if k != "rope_parameters"}
    factor = float(default)
    if legacy and legacy in raw:
        factor = _positive(raw, legacy, where)
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        factor = _positive(params, "partial_rotary_factor", where)
        params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    if params is not None:
        rest["rope_parameters"] = params
    if factor > 1:
        raise ValueError(f"{where}: `partial_rotary_factor` must be at most 1; received {factor}.")
    theta, scaling = _rope(rest, where)
    dim = int(head_dim * factor)
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rotary_dim": None if dim == head_dim else dim}  # fmt: skip


def _llama_sizes(raw: dict, where: str) -> dict:
    e, h = _int(raw, "hidden_size", where), _int(raw, "num_attention_heads", where)
    kv = _int(raw, "num_key_value_heads", where, h)
    _divisible(where, e, h, kv)
    if raw.get("head_dim") is None and e % h:
        raise ValueError(
            f"{where}: `hidden_size` ({e}) must be divisible by `num_attention_heads` ({h})."
        )
    theta, scaling = _rope(raw, where)
    return _base({
        "vocab_size": _int(raw, "vocab_size", where), "hidden_size": e,
        "num_layers": _int(raw, "num_hidden_layers", where), "num_heads": h,
        "num_key_value_heads": kv, "head_dim": _int(raw, "head_dim", where, e // h),
        "intermediate_size": _int(raw, "intermediate_size", where),
        "max_positions": _int(raw, "max_position_embeddings", where),
        "epsilon": _positive(raw, "rms_norm_eps", where, 1e-6), "rope_theta": theta,
        "rope_scaling": scaling, "tied": _bool(raw, "tie_word_embeddings", where, False),
    })  # fmt: skip


def _full_layers(raw: dict, where: str, model_type: str) -> None:
    """Refuses a ``layer_types`` holding another kind than ``full_attention``."""
    types = raw.get("layer_types")
    if types is not None and not isinstance(types, list):
        raise ValueError(
            f"{where}: `layer_types` must be a list of layer kinds (one per layer); "
            f"received {types!r}."
        )
    if types is not None and any(t != "full_attention" for t in types):
        raise ValueError(
            f"{where}: config option `layer_types` = {types!r} is not implemented "
            f"(multiattn's {model_type} supports only 'full_attention' layers)."
        )


def _qwen2_sizes(raw: dict, where: str) -> dict:
    _full_layers(raw, where, "qwen2")
    return {**_llama_sizes(raw, where), "attention_bias": True}


def _mistral_sizes(raw: dict, where: str) -> dict:
    window = raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):  # fmt: skip
        raise ValueError(
            f"{where}: config option `sliding_window` = {window!r} is not implemented "
            "(multiattn's mistral supports None or a positive integer)."
        )
    return {**_llama_sizes(raw, where), "sliding_window": window}


def qkv_entries(s: dict, src: str, dst: str) -> list[Entry]:
    """Separate query, key and value projections ``src{q,k,v}_proj.weight`` (and ``.bias``
    with ``s["attention_bias"]``) -> ``dst + "self_attention/<part>/"``: ``num_heads``
    query heads, ``num_key_value_heads`` key and value heads of ``head_dim``."""
    e, d = s["hidden_size"], s.get("head_dim") or s["hidden_size"] // s["num_heads"]
    kv = s.get("num_key_value_heads") or s["num_heads"]
    out = []
    for part, hf, n in (("query", "q", s["num_heads"]), ("key", "k", kv), ("value", "v", kv)):
        name, to = f"{src}{hf}_proj.", f"{dst}self_attention/{part}/"
        out.append(Entry(name + "weight", (n * d, e), to + "kernel", "heads_in", n))
        if s["attention_bias"]:
            out.append(Entry(name + "bias", (n * d,), to + "bias", "heads_bias", n))
    return out


def llama_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """Llama / Qwen2 / Qwen3 / Mistral tensors (``LlamaForCausalLM`` names) for sizes
    ``s``: with ``qk_norm`` also Qwen3's ``q_norm``/``k_norm``, with ``output_bias``
    the ``o_proj`` bias."""
    e, f, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    h = s["num_heads"]
    out = [Entry("model.embed_tokens.weight", (s["vocab_size"], e), "embed/word")]
    for i in range(s["num_layers"]):
        src, dst = f"model.layers.{i}.", f"layer_{i}/"
        out += qkv_entries(s, src + "self_attn.", dst)
        if s["output_bias"]:
            out.append(Entry(src + "self_attn.o_proj.bias", (e,),
                             dst + "self_attention/attention_output/bias"))  # fmt: skip
        if s.get("qk_norm"):
            out += [Entry(f"{src}self_attn.{hf}_norm.weight", (d,),
                          f"{dst}self_attention/{part}_norm/scale")
                    for hf, part in (("q", "query"), ("k", "key"))]  # fmt: skip
        out += [
            Entry(src + "self_attn.o_proj.weight", (e, h * d),
                  dst + "self_attention/attention_output/kernel", "heads_out", h),
            Entry(src + "mlp.gate_proj.weight", (f, e), dst + "ffn/gate/kernel", "linear"),
            Entry(src + "mlp.up_proj.weight", (f, e), dst + "ffn/up/kernel", "linear"),
            Entry(src + "mlp.down_proj.weight", (e, f), dst + "ffn/down/kernel", "linear"),
            Entry(src + "input_layernorm.weight", (e,), dst + "norm_1/scale"),
            Entry(src + "post_attention_layernorm.weight", (e,), dst + "norm_2/scale"),
        ]  # fmt: skip
    out.append(Entry("model.norm.weight", (e,), "final_norm/scale"))
    return out + _lm_head(s)


def _llama_buffers(s: dict) -> dict:
    rotary = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": (s["head_dim"] // 2,)
              for i in range(s["num_layers"])}  # fmt: skip
    return {**_tied_buffer(s), **rotary}


_LLAMA_FIXED = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
                "pretraining_tp": (1,)}  # fmt: skip
_LLAMA_INERT = frozenset({"attention_dropout"})


def _llama_like(model_type: str, architecture: str, sizes, keys=(), fixed=None, inert=(),
                entries=llama_entries):  # fmt: skip
    """A family over Llama's reader keys, buffers and (by default) tensor table: ``keys``,
    ``inert`` add to Llama's; ``fixed`` replaces Llama's (default: Llama's own)."""
    return Family(
        model_type=model_type,
        architecture=architecture,
        prefix="",
        inputs=_INPUTS,
        layer=_LAYER,
        read_sizes=sizes,
        keys=_LLAMA_KEYS + tuple(keys),
        entries=entries,
        fixed=fixed if fixed is not None else _LLAMA_FIXED,
        inert=_LLAMA_INERT | frozenset(inert),
        buffers=_llama_buffers,
    )


LLAMA = _llama_like("llama", "LlamaForCausalLM", _llama_sizes)
QWEN2 = _llama_like(
    "qwen2",
    "Qwen2ForCausalLM",
    _qwen2_sizes,
    keys=("layer_types",),
    fixed={"hidden_act": ("silu",), "use_sliding_window": (False,)},
    # `sliding_window` and `max_window_layers` act only with use_sliding_window=True.
    inert=("sliding_window", "max_window_layers"),
)

# --- Qwen3: the model entry of docs/design.md's "How to add a family" -----------------


def _qwen3_sizes(raw: dict, where: str) -> dict:
    """Llama's sizes, with ``head_dim`` given (default 128, as Qwen3Config's), biases on
    all four attention projections or none (``attention_bias``) and ``qk_norm``."""
    _full_layers(raw, where, "qwen3")
    bias = _bool(raw, "attention_bias", where, False)
    raw = {"head_dim": 128, **raw}
    return {**_llama_sizes(raw, where), "attention_bias": bias, "output_bias": bias,
            "qk_norm": True}  # fmt: skip


QWEN3 = _llama_like(
    "qwen3",
    "Qwen3ForCausalLM",
    _qwen3_sizes,
    keys=("layer_types", "attention_bias"),
    fixed={"hidden_act": ("silu",), "use_sliding_window": (False,)},
    # `sliding_window` and `max_window_layers` act only with use_sliding_window=True.
    inert=("sliding_window", "max_window_layers"),
)
MISTRAL = _llama_like(
    "mistral",
    "MistralForCausalLM",
    _mistral_sizes,
    keys=("sliding_window",),
    fixed={"hidden_act": ("silu",)},
)

CAUSAL_LM_FAMILIES = (GPT2, LLAMA, QWEN2, QWEN3, MISTRAL)
