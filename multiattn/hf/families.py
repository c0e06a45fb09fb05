"""The model families `multiattn.hf.pretrained` loads: config options and tensor tables.

Imports no framework. Each `Family` says, for one Hugging Face ``model_type``:

* which ``config.json`` keys it reads (`Family.read_sizes`, every value checked), which
  keys may only hold the value it implements (``hidden_act: "gelu"``, ...), and which keys
  do not change the base model's forward pass in inference (dropout rates, token ids,
  labels, initialisation, metadata); any other key is refused by name;
* the table of its tensors (`Entry`): the Hugging Face name and shape, the neutral name
  (`multiattn.port` layout: kernels ``(in, out)``, attention kernels with a head axis) and
  the exact transform between the two (a transpose and/or a reshape, so values are copied
  bit for bit both ways).

`FAMILIES` is the one registry: ``model_type`` -> `Family`.
"""

from __future__ import annotations

import numpy as np

# `Entry`, `Family` and the common config keys live in `._hf_common`, which the family
# modules listed in `FAMILIES` (`.hf_causal_lm`, `.hf_t5`) import too; re-exported here.
from ._common import COMMON_FIXED as COMMON_FIXED
from ._common import COMMON_INERT as COMMON_INERT
from ._common import Entry, Family, _int
from .bart import BART
from .causal_lm import CAUSAL_LM_FAMILIES
from .encoders import BERT, ENCODER_FAMILIES, _encoder_sizes, _layer_entries
from .encoders import bert_entries as bert_entries
from .falcon import FALCON
from .gemma import GEMMA_FAMILIES
from .gpt_neox import GPT_NEOX
from .modernbert import MODERNBERT
from .moe import MOE_FAMILIES
from .opt import OPT
from .phi import PHI_FAMILIES
from .t5 import T5

__all__ = ["FAMILIES", "Entry", "Family", "family_of", "from_hf", "to_hf"]


def _pair(raw: dict, key: str, where: str, default: int) -> tuple[int, int]:
    value = raw.get(key, default)
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return (_int({key: value[0]}, key, where), _int({key: value[1]}, key, where))
    v = _int({key: value}, key, where)
    return (v, v)


# --- ViT ------------------------------------------------------------------------------

_VIT_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "layer_norm_eps", "image_size", "patch_size", "num_channels", "qkv_bias",
    "pooler_output_size", "pooler_act",
)  # fmt: skip
POOLER_ACTIVATIONS = ("tanh", "relu", "gelu", "sigmoid", "linear")


def _vit_sizes(raw: dict, where: str) -> dict:
    s = _encoder_sizes(raw, where)
    image, patch = _pair(raw, "image_size", where, 224), _pair(raw, "patch_size", where, 16)
    if image[0] % patch[0] or image[1] % patch[1]:
        raise ValueError(
            f"{where}: `image_size` {list(image)} must be a multiple of `patch_size` {list(patch)}."
        )
    qkv_bias = raw.get("qkv_bias", True)
    if not isinstance(qkv_bias, bool):
        raise ValueError(f"{where}: `qkv_bias` must be a bool; received {qkv_bias!r}.")
    act = raw.get("pooler_act", "tanh")
    if act not in POOLER_ACTIVATIONS:
        raise ValueError(
            f"{where}: config option `pooler_act` = {act!r} is not implemented (supported: "
            f"{', '.join(POOLER_ACTIVATIONS)})."
        )
    return {
        **s,
        "image_size": image,
        "patch_size": patch,
        "num_channels": _int(raw, "num_channels", where, 3),
        "qkv_bias": qkv_bias,
        "pooler_output_size": s["hidden_size"]
        if raw.get("pooler_output_size") is None
        else _int(raw, "pooler_output_size", where),
        "pooler_act": act,
    }


def vit_entries(s: dict, pooler: bool = True) -> list[Entry]:
    """ViT's tensors (``ViTModel`` names) for sizes ``s``."""
    e, c = s["hidden_size"], s["num_channels"]
    (ih, iw), (ph, pw) = s["image_size"], s["patch_size"]
    patches = (ih // ph) * (iw // pw)
    out = [
        Entry("embeddings.cls_token", (1, 1, e), "embeddings/cls", "squeeze"),
        Entry("embeddings.position_embeddings", (1, patches + 1, e), "embeddings/position",
              "squeeze"),
        Entry("embeddings.patch_embeddings.projection.weight", (e, c, ph, pw),
              "embeddings/patch/kernel", "patch"),
        Entry("embeddings.patch_embeddings.projection.bias", (e,), "embeddings/patch/bias"),
    ]  # fmt: skip
    names = {
        "self": "attention.attention",
        "attn_out": "attention.output.dense",
        "norm_1": "layernorm_before",
        "norm_2": "layernorm_after",
    }
    for i in range(s["num_layers"]):
        out += _layer_entries(s, i, names, qkv_bias=s["qkv_bias"])
    out += [
        Entry("layernorm.weight", (e,), "final_norm/gamma"),
        Entry("layernorm.bias", (e,), "final_norm/beta"),
    ]
    if pooler:
        p = s["pooler_output_size"]
        out += [
            Entry("pooler.dense.weight", (p, e), "pooler/kernel", "linear"),
            Entry("pooler.dense.bias", (p,), "pooler/bias"),
        ]
    return out


VIT = Family(
    model_type="vit",
    architecture="ViTModel",
    prefix="vit",
    inputs=("pixel_values",),
    layer="multiattn.models.vit:ViTModel",
    read_sizes=_vit_sizes,
    keys=_VIT_KEYS,
    entries=vit_entries,
    fixed={"hidden_act": ("gelu",)},
    inert=frozenset({"encoder_stride"}),  # used only by the masked-image-modelling head
)

#: ``model_type`` -> `Family`: the families `multiattn.hf.pretrained` loads.
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        BERT,
        *ENCODER_FAMILIES,
        VIT,
        *CAUSAL_LM_FAMILIES,
        *GEMMA_FAMILIES,
        *MOE_FAMILIES,
        GPT_NEOX,
        *PHI_FAMILIES,
        OPT,
        FALCON,
        MODERNBERT,
        T5,
        BART,
    )
}


def family_of(raw: dict, where: str) -> Family:
    """The `Family` of a config.json object; ValueError listing the supported ones."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where}: unsupported model_type {model_type!r}; supported: "
            f"{', '.join(sorted(FAMILIES))}."
        )
    return FAMILIES[model_type]


def from_hf(entries: list[Entry], state: dict[str, np.ndarray]) -> dict:
    """Neutral weights from a state dict whose names and shapes were already checked."""
    return {e.name: e.to_neutral(np.asarray(state[e.hf])) for e in entries}


def to_hf(entries: list[Entry], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named arrays from neutral weights (exact inverse of `from_hf`)."""
    return {e.hf: e.to_hf(np.asarray(weights[e.name])) for e in entries}
