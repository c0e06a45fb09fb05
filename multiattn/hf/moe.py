"""The mixture-of-experts language-model families of `multiattn.hf.pretrained`: Mixtral,
Qwen2-MoE and Qwen3-MoE (config options and tensor tables; imports no framework).

Each loads into `multiattn.models.causal_lm.CausalLM` with the sizes of the Llama-like
families (`multiattn.hf.causal_lm`) plus ``moe``: the fields of
`multiattn.layers.MoEConfig` (experts, top-k, expert width, ``norm_topk_prob``, the
shared expert, the blocks left dense). The blocks' feed-forward networks are then
`multiattn.layers.MixtureOfExperts`.

Tensors: transformers 5 keeps each block's experts fused in memory
(``mlp.experts.gate_up_proj`` ``(E, 2f, d)``, ``mlp.experts.down_proj`` ``(E, d, f)``),
but its ``save_pretrained`` writes them back one tensor per expert, as the published
checkpoints hold them, and that is the layout read and written here: Mixtral's
``model.layers.<i>.block_sparse_moe.experts.<j>.w1``/``w3``/``w2`` (gate, up, down) and
``block_sparse_moe.gate`` (the router), Qwen's ``model.layers.<i>.mlp.experts.<j>.
gate_proj``/``up_proj``/``down_proj`` and ``mlp.gate``, Qwen2-MoE's
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``. Each maps to a neutral
per-expert kernel ``layer_<i>/ffn/experts/<j>/<part>/kernel`` (a transpose), which
`CausalLM` stacks into its ``(E, ...)`` kernels (`multiattn.models._moe_weights`), bit
for bit both ways.

Training-only options are inert in inference and not read: ``output_router_logits``,
``router_aux_loss_coef`` (the load-balancing loss) and Mixtral's
``router_jitter_noise`` (transformers multiplies the hidden states by uniform noise in
training mode only).
"""

from __future__ import annotations

from typing import Any

from ._common import Entry, Family, _int
from .causal_lm import (
    _INPUTS,
    _LAYER,
    _LLAMA_KEYS,
    _bool,
    _full_layers,
    _llama_buffers,
    _llama_sizes,
    _mistral_sizes,
    llama_entries,
)

__all__ = ["MIXTRAL", "MOE_FAMILIES", "QWEN2_MOE", "QWEN3_MOE", "moe_entries"]

# Read by no forward pass in inference: the router's auxiliary loss (and its logits as
# outputs), Mixtral's training-mode jitter, and the attention dropout.
_MOE_INERT = frozenset({"output_router_logits", "router_aux_loss_coef", "attention_dropout"})
_QWEN_MOE_KEYS = ("layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")  # fmt: skip


def _top_k(raw: dict, where: str, experts_key: str, experts: int, k: int) -> tuple[int, int]:
    e, k = _int(raw, experts_key, where, experts), _int(raw, "num_experts_per_tok", where, k)
    if k > e:
        raise ValueError(
            f"{where}: `num_experts_per_tok` ({k}) must be at most `{experts_key}` ({e})."
        )
    return e, k


def _dense_layers(raw: dict, where: str, layers: int) -> list[int]:
    """The blocks Qwen's MoE models keep dense: those in ``mlp_only_layers`` and those
    whose ``index + 1`` is not a multiple of ``decoder_sparse_step``."""
    step = _int(raw, "decoder_sparse_step", where, 1)
    only = raw.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in only
    ):
        raise ValueError(
            f"{where}: `mlp_only_layers` must be a list of layer indices in [0, {layers}); "
            f"received {only!r}."
        )
    return [i for i in range(layers) if i in only or (i + 1) % step]


# --- Mixtral --------------------------------------------------------------------------


def _mixtral_sizes(raw: dict, where: str) -> dict:
    """Mistral's sizes (``head_dim`` null means ``hidden_size // num_attention_heads``;
    ``rope_theta`` 1e6 when the config gives none, as MixtralConfig's), and every
    block a mixture of ``num_local_experts`` experts of width ``intermediate_size``, the
    top ``num_experts_per_tok`` renormalised."""
    raw = dict(raw)
    if raw.get("head_dim") is None:
        raw.pop("head_dim", None)
    params = raw.get("rope_parameters")
    if "rope_theta" not in raw and not (isinstance(params, dict) and "rope_theta" in params):
        raw["rope_theta"] = 1e6
    sizes = _mistral_sizes(raw, where)
    e, k = _top_k(raw, where, "num_local_experts", 8, 2)
    moe = {"num_experts": e, "num_experts_per_tok": k,
           "expert_dff": sizes["intermediate_size"], "norm_topk_prob": True}  # fmt: skip
    return {**sizes, "moe": moe}


# --- Qwen2-MoE, Qwen3-MoE -------------------------------------------------------------


def _experts_key(raw: dict, where: str) -> str:
    """The key of the expert count: ``num_experts`` (Qwen's published configs), or
    ``num_local_experts``, which transformers 5 writes for Qwen3-MoE (its config maps
    ``num_experts`` onto it); both given must agree."""
    both = [key for key in ("num_experts", "num_local_experts") if raw.get(key) is not None]
    if len(both) == 2 and raw["num_experts"] != raw["num_local_experts"]:
        raise ValueError(
            f"{where}: `num_experts` ({raw['num_experts']!r}) and `num_local_experts` "
            f"({raw['num_local_experts']!r}) name the same count and must agree."
        )
    return both[-1] if both else "num_experts"


def _qwen_moe(raw: dict, where: str, sizes: dict, shared: bool) -> dict:
    key = _experts_key(raw, where) if not shared else "num_experts"
    e, k = _top_k(raw, where, key, 60 if shared else 128, 4 if shared else 8)
    moe: dict[str, Any] = {
        "num_experts": e, "num_experts_per_tok": k,
        "expert_dff": _int(raw, "moe_intermediate_size", where, 1408 if shared else 768),
        "norm_topk_prob": _bool(raw, "norm_topk_prob", where, False),
        "dense_layers": _dense_layers(raw, where, sizes["num_layers"]),
    }  # fmt: skip
    if shared:
        moe["shared_expert_dff"] = _int(raw, "shared_expert_intermediate_size", where, 5632)
    return {**sizes, "moe": moe}


def _qwen2_moe_sizes(raw: dict, where: str) -> dict:
    """Qwen2's sizes (query/key/value biases from ``qkv_bias``), mixtures of experts with
    a sigmoid-gated shared expert in the blocks ``decoder_sparse_step`` and
    ``mlp_only_layers`` leave sparse."""
    _full_layers(raw, where, "qwen2_moe")
    sizes = {**_llama_sizes(raw, where), "attention_bias": _bool(raw, "qkv_bias", where, True)}
    return _qwen_moe(raw, where, sizes, shared=True)


def _qwen3_moe_sizes(raw: dict, where: str) -> dict:
    """Qwen3's attention (RMSNorm of each head's queries and keys; biases on the four
    projections or none, ``attention_bias``; ``head_dim`` default ``hidden_size //
    num_attention_heads``, as Qwen3MoeAttention's) and Qwen2-MoE's routing without the
    shared expert."""
    _full_layers(raw, where, "qwen3_moe")
    bias = _bool(raw, "attention_bias", where, False)
    sizes = {**_llama_sizes(raw, where), "attention_bias": bias, "output_bias": bias,
             "qk_norm": True}  # fmt: skip
    return _qwen_moe(raw, where, sizes, shared=False)


# --- the tensors ----------------------------------------------------------------------

_NAMES = {  # family -> (the block's MoE module, the expert parts gate / up / down)
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def moe_entries(s: dict, pooler: bool = False, names: str = "qwen") -> list[Entry]:
    """The tensors of sizes ``s``: Llama's (`llama_entries`: attention, norms, dense
    feed-forward networks of the blocks in ``moe["dense_layers"]``), with each mixture's
    router, experts and shared expert in place of the dense network elsewhere."""
    moe, e = s["moe"], s["hidden_size"]
    dense = set(moe.get("dense_layers", ()))
    sparse = [i for i in range(s["num_layers"]) if i not in dense]
    skip = tuple(f"layer_{i}/ffn/" for i in sparse)
    out = [entry for entry in llama_entries(s) if not entry.name.startswith(skip)]
    module, parts = _NAMES[names]
    n, f = moe["num_experts"], moe["expert_dff"]
    for i in sparse:
        src, dst = f"model.layers.{i}.{module}.", f"layer_{i}/ffn/"
        out.append(Entry(src + "gate.weight", (n, e), dst + "router/kernel", "linear"))
        for j in range(n):
            for hf, part, shape in zip(parts, ("gate", "up", "down"), ((f, e), (f, e), (e, f))):
                out.append(Entry(f"{src}experts.{j}.{hf}.weight", shape,
                                 f"{dst}experts/{j}/{part}/kernel", "linear"))  # fmt: skip
        shared = moe.get("shared_expert_dff")
        if shared:
            for hf, part, shape in zip(_NAMES["qwen"][1], ("gate", "up", "down"),
                                       ((shared, e), (shared, e), (e, shared))):  # fmt: skip
                out.append(Entry(f"{src}shared_expert.{hf}.weight", shape,
                                 f"{dst}shared_expert/{part}/kernel", "linear"))  # fmt: skip
            out.append(Entry(src + "shared_expert_gate.weight", (1, e),
                             dst + "shared_expert_gate/kernel", "linear"))  # fmt: skip
    return out


def _mixtral_entries(s: dict, pooler: bool = False) -> list[Entry]:
    return moe_entries(s, pooler, names="mixtral")


MIXTRAL = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_mixtral_sizes,
    keys=(*_LLAMA_KEYS, "sliding_window", "num_local_experts", "num_experts_per_tok"),
    entries=_mixtral_entries,
    fixed={"hidden_act": ("silu",)},
    inert=_MOE_INERT | {"router_jitter_noise"},
    buffers=_llama_buffers,
)
QWEN2_MOE = Family(
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_qwen2_moe_sizes,
    keys=(*_LLAMA_KEYS, *_QWEN_MOE_KEYS, "qkv_bias", "shared_expert_intermediate_size"),
    entries=moe_entries,
    fixed={"hidden_act": ("silu",), "use_sliding_window": (False,)},
    # `sliding_window` and `max_window_layers` act only with use_sliding_window=True.
    inert=_MOE_INERT | {"sliding_window", "max_window_layers"},
    buffers=_llama_buffers,
)
QWEN3_MOE = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    prefix="",
    inputs=_INPUTS,
    layer=_LAYER,
    read_sizes=_qwen3_moe_sizes,
    keys=(*_LLAMA_KEYS, *_QWEN_MOE_KEYS, "num_local_experts", "attention_bias"),
    entries=moe_entries,
    fixed={"hidden_act": ("silu",), "use_sliding_window": (False,)},
    inert=_MOE_INERT | {"sliding_window", "max_window_layers"},
    buffers=_llama_buffers,
)

MOE_FAMILIES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
