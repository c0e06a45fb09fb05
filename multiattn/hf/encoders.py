"""The BERT-like encoder families of `multiattn.hf.pretrained`: BERT, RoBERTa,
XLM-RoBERTa, DistilBERT, ALBERT and ELECTRA (config options and tensor tables; imports no
framework).

All five load into one model, `multiattn.models.bert.BertModel`, described by the sizes
dict their `Family.read_sizes` returns: BERT's sizes (``vocab_size``, ``hidden_size``,
``num_layers``, ``num_heads``, ``intermediate_size``, ``max_positions``,
``type_vocab_size``, ``epsilon``) and the options where a family differs
(``position_padding_idx``: RoBERTa's positions counted from the pad id;
``type_vocab_size = 0``: DistilBERT's missing token types; ``embedding_size``,
``num_groups``, ``group_size``: ALBERT's factorised embedding and shared blocks;
``activation``), and, when ``config.json``'s ``architectures`` names the family's
``*ForMaskedLM`` class, ``masked_lm`` with the head's ``head_activation`` and
``head_epsilon``. A masked-LM checkpoint's table holds the base model's tensors under
`Family.prefix` (``roberta.embeddings...``) and the head's under their own names; the
decoder is tied to the word embeddings, so its weight (and bias, tied to the head's
bias) is read when present, checked, and not used.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ._common import Entry, Family, _int, _positive

__all__ = ["ALBERT", "BERT", "DISTILBERT", "ELECTRA", "ENCODER_FAMILIES", "ROBERTA",
           "XLM_ROBERTA", "bert_entries"]  # fmt: skip


def _encoder_sizes(raw: dict, where: str) -> dict[str, Any]:
    sizes = {
        "hidden_size": _int(raw, "hidden_size", where),
        "num_layers": _int(raw, "num_hidden_layers", where),
        "num_heads": _int(raw, "num_attention_heads", where),
        "intermediate_size": _int(raw, "intermediate_size", where),
        "epsilon": _positive(raw, "layer_norm_eps", where, 1e-12),
    }
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise ValueError(
            f"{where}: `hidden_size` ({sizes['hidden_size']}) must be divisible by "
            f"`num_attention_heads` ({sizes['num_heads']})."
        )
    return sizes


def _block_entries(s: dict, src: str, dst: str, names: dict[str, str],
                   qkv_bias: bool = True) -> list[Entry]:  # fmt: skip
    """One encoder block: HF module ``src + names[part]`` -> neutral ``dst + part``, for
    the parts ``query``, ``key``, ``value``, ``attn_out``, ``norm_1``, ``ffn_1``,
    ``ffn_2``, ``norm_2`` (`multiattn.layers.TransformerEncoderLayer`'s weights)."""
    e, h, f = s["hidden_size"], s["num_heads"], s["intermediate_size"]
    out = []
    for part in ("query", "key", "value"):
        hf = f"{src}{names[part]}."
        out.append(Entry(hf + "weight", (e, e), f"{dst}attention/{part}/kernel", "heads_in", h))
        if qkv_bias:
            out.append(Entry(hf + "bias", (e,), f"{dst}attention/{part}/bias", "heads_bias", h))
    hf = f"{src}{names['attn_out']}."
    out += [
        Entry(hf + "weight", (e, e), f"{dst}attention/output/kernel", "heads_out", h),
        Entry(hf + "bias", (e,), f"{dst}attention/output/bias"),
    ]
    for part, shape in (("ffn_1", (f, e)), ("ffn_2", (e, f))):
        hf = f"{src}{names[part]}."
        out += [
            Entry(hf + "weight", shape, f"{dst}{part}/kernel", "linear"),
            Entry(hf + "bias", shape[:1], f"{dst}{part}/bias"),
        ]
    for norm in ("norm_1", "norm_2"):
        hf = f"{src}{names[norm]}."
        out += [
            Entry(hf + "weight", (e,), f"{dst}{norm}/gamma"),
            Entry(hf + "bias", (e,), f"{dst}{norm}/beta"),
        ]
    return out


def _layer_entries(s: dict, i: int, names: dict[str, str], qkv_bias: bool = True) -> list:
    """The encoder layer ``i`` of BERT and ViT (``encoder.layer.<i>.``): ``names`` maps
    ``self``, ``attn_out``, ``norm_1``, ``norm_2`` to the HF modules."""
    parts = {
        **{p: f"{names['self']}.{p}" for p in ("query", "key", "value")},
        "attn_out": names["attn_out"], "norm_1": names["norm_1"], "norm_2": names["norm_2"],
        "ffn_1": "intermediate.dense", "ffn_2": "output.dense",
    }  # fmt: skip
    return _block_entries(s, f"encoder.layer.{i}.", f"layer_{i}/", parts, qkv_bias)


# --- the masked-LM head, shared ------------------------------------------------------


def masked_lm_of(raw: dict, where: str, architecture: str) -> bool:
    """Whether ``config.json``'s ``architectures`` names ``architecture`` (the family's
    ``*ForMaskedLM``): the checkpoint then holds that class's tensors. The head's decoder
    must be tied to the word embeddings (``tie_word_embeddings``, default true)."""
    names = raw.get("architectures") or []
    if not isinstance(names, list):
        raise ValueError(f"{where}: `architectures` must be a list; received {names!r}.")
    if architecture not in names:
        return False
    if raw.get("tie_word_embeddings", True) is not True:
        raise ValueError(
            f"{where}: config option `tie_word_embeddings` = "
            f"{raw.get('tie_word_embeddings')!r} is not implemented for {architecture} "
            "(multiattn's masked-LM head is tied to the word embeddings: True)."
        )
    return True


def _head(s: dict, dense: str, norm: str, bias: str) -> list[Entry]:
    """The head's tensors: ``dense`` (``hidden -> width``), ``norm`` (LayerNorm over
    ``width``) and the decoder's ``bias`` (``vocab_size``); ``width`` is the word
    embeddings' (ALBERT's ``embedding_size``, else ``hidden_size``)."""
    e, v = s["hidden_size"], s["vocab_size"]
    w = s.get("embedding_size") or e
    return [
        Entry(f"{dense}.weight", (w, e), "mlm/dense/kernel", "linear"),
        Entry(f"{dense}.bias", (w,), "mlm/dense/bias"),
        Entry(f"{norm}.weight", (w,), "mlm/norm/gamma"),
        Entry(f"{norm}.bias", (w,), "mlm/norm/beta"),
        Entry(bias, (v,), "mlm/bias"),
    ]


def _with_head(s: dict, prefix: str, base: list[Entry], head: list[Entry]) -> list[Entry]:
    """``base`` alone, or (``s["masked_lm"]``) under ``prefix.`` followed by ``head``."""
    if not s.get("masked_lm"):
        return base
    return [replace(e, hf=f"{prefix}.{e.hf}") for e in base] + head


def _buffers(s: dict, prefix: str, base: dict, decoder: str) -> dict:
    """``base`` buffers (under ``prefix.`` with the head), and the tied ``decoder``'s
    weight and bias that older checkpoints store (read, checked, not used)."""
    if not s.get("masked_lm"):
        return base
    w = s.get("embedding_size") or s["hidden_size"]
    return {**{f"{prefix}.{k}": v for k, v in base.items()},
            f"{decoder}.weight": (s["vocab_size"], w), f"{decoder}.bias": (s["vocab_size"],)}  # fmt: skip


def _position_buffer(s: dict) -> dict:
    return {"embeddings.position_ids": (1, s["max_positions"])}


# --- BERT -----------------------------------------------------------------------------

_BERT_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
)  # fmt: skip
_BERT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
_LAYER = "multiattn.models.bert:BertModel"
_BERT_FIXED = {"hidden_act": ("gelu",), "position_embedding_type": ("absolute",)}


def _bert_sizes(raw: dict, where: str, architecture: str = "BertForMaskedLM") -> dict:
    s = {
        **_encoder_sizes(raw, where),
        "vocab_size": _int(raw, "vocab_size", where),
        "max_positions": _int(raw, "max_position_embeddings", where),
        "type_vocab_size": _int(raw, "type_vocab_size", where),
    }
    if masked_lm_of(raw, where, architecture):
        s.update(masked_lm=True, head_activation="gelu", head_epsilon=s["epsilon"])
    return s


def _embeddings(s: dict, width: int) -> list[Entry]:
    """The word, position and token-type embeddings and their LayerNorm, ``width`` wide
    (ALBERT's and ELECTRA's ``embedding_size``, else ``hidden_size``)."""
    return [
        Entry("embeddings.word_embeddings.weight", (s["vocab_size"], width), "embeddings/word"),
        Entry("embeddings.position_embeddings.weight", (s["max_positions"], width),
              "embeddings/position"),
        Entry("embeddings.token_type_embeddings.weight", (s["type_vocab_size"], width),
              "embeddings/token_type"),
        Entry("embeddings.LayerNorm.weight", (width,), "embeddings/norm/gamma"),
        Entry("embeddings.LayerNorm.bias", (width,), "embeddings/norm/beta"),
    ]  # fmt: skip


def _projection(s: dict, name: str) -> list[Entry]:
    """The embeddings' projection ``embedding_size -> hidden_size`` (HF module ``name``)."""
    e, w = s["hidden_size"], s["embedding_size"]
    return [Entry(f"{name}.weight", (e, w), "embeddings/projection/kernel", "linear"),
            Entry(f"{name}.bias", (e,), "embeddings/projection/bias")]  # fmt: skip


def _bert_layers(s: dict) -> list[Entry]:
    names = {
        "self": "attention.self",
        "attn_out": "attention.output.dense",
        "norm_1": "attention.output.LayerNorm",
        "norm_2": "output.LayerNorm",
    }
    return [x for i in range(s["num_layers"]) for x in _layer_entries(s, i, names)]


def _bert_base(s: dict, pooler: bool) -> list[Entry]:
    e = s["hidden_size"]
    out = _embeddings(s, e) + _bert_layers(s)
    if pooler:
        out += [
            Entry("pooler.dense.weight", (e, e), "pooler/kernel", "linear"),
            Entry("pooler.dense.bias", (e,), "pooler/bias"),
        ]
    return out


def bert_entries(s: dict, pooler: bool = True) -> list[Entry]:
    """BERT's tensors for sizes ``s``: ``BertModel`` names, or ``BertForMaskedLM``'s
    (``bert.`` and ``cls.predictions``) with ``s["masked_lm"]``."""
    head = _head(s, "cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                 "cls.predictions.bias")  # fmt: skip
    return _with_head(s, "bert", _bert_base(s, pooler), head)


BERT = Family(
    model_type="bert",
    architecture="BertModel",
    prefix="bert",
    inputs=_BERT_INPUTS,
    layer=_LAYER,
    read_sizes=_bert_sizes,
    keys=_BERT_KEYS,
    entries=bert_entries,
    fixed=_BERT_FIXED,
    buffers=lambda s: _buffers(s, "bert", _position_buffer(s), "cls.predictions.decoder"),
    heads={"masked_lm": "BertForMaskedLM"},
)

# --- RoBERTa, XLM-RoBERTa -------------------------------------------------------------


def _roberta_sizes(architecture: str):
    def read(raw: dict, where: str) -> dict:
        s = _bert_sizes(raw, where, architecture)
        pad = raw.get("pad_token_id", 1)
        limit = min(s["vocab_size"], s["max_positions"] - 1)
        if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < limit:
            raise ValueError(
                f"{where}: `pad_token_id` (RoBERTa's position padding_idx) must be an "
                f"integer in [0, {limit}) (below vocab_size and max_position_embeddings - "
                f"1); received {pad!r}."
            )
        return {**s, "position_padding_idx": pad}

    return read


def _roberta_entries(s: dict, pooler: bool = True) -> list[Entry]:
    """RoBERTa's tensors: BERT's (``RobertaModel`` names), or ``RobertaForMaskedLM``'s
    (``roberta.`` and ``lm_head``)."""
    head = _head(s, "lm_head.dense", "lm_head.layer_norm", "lm_head.bias")
    return _with_head(s, "roberta", _bert_base(s, pooler), head)


def _roberta(model_type: str, name: str) -> Family:
    return Family(
        model_type=model_type,
        architecture=f"{name}Model",
        prefix="roberta",
        inputs=_BERT_INPUTS,
        layer=_LAYER,
        read_sizes=_roberta_sizes(f"{name}ForMaskedLM"),
        keys=_BERT_KEYS,
        entries=_roberta_entries,
        fixed=_BERT_FIXED,
        buffers=lambda s: _buffers(s, "roberta", _position_buffer(s), "lm_head.decoder"),
        heads={"masked_lm": f"{name}ForMaskedLM"},
    )


ROBERTA = _roberta("roberta", "Roberta")
XLM_ROBERTA = _roberta("xlm-roberta", "XLMRoberta")

# --- DistilBERT -----------------------------------------------------------------------

_DISTILBERT_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim",
                    "max_position_embeddings", "activation", "sinusoidal_pos_embds")  # fmt: skip
_DISTILBERT_ACTIVATIONS = ("gelu", "relu", "gelu_new")


def _distilbert_sizes(raw: dict, where: str) -> dict:
    e, h = _int(raw, "dim", where, 768), _int(raw, "n_heads", where, 12)
    if e % h:
        raise ValueError(f"{where}: `dim` ({e}) must be divisible by `n_heads` ({h}).")
    act = raw.get("activation", "gelu")
    if act not in _DISTILBERT_ACTIVATIONS:
        raise ValueError(
            f"{where}: config option `activation` = {act!r} is not implemented (multiattn's "
            f"distilbert supports {', '.join(map(repr, _DISTILBERT_ACTIVATIONS))})."
        )
    sinusoidal = raw.get("sinusoidal_pos_embds", False)
    if not isinstance(sinusoidal, bool):
        raise ValueError(
            f"{where}: `sinusoidal_pos_embds` must be a bool; received {sinusoidal!r}."
        )
    s = {
        "vocab_size": _int(raw, "vocab_size", where, 30522), "hidden_size": e,
        "num_layers": _int(raw, "n_layers", where, 6), "num_heads": h,
        "intermediate_size": _int(raw, "hidden_dim", where, 3072),
        "max_positions": _int(raw, "max_position_embeddings", where, 512),
        "type_vocab_size": 0, "epsilon": 1e-12, "activation": act,
    }  # fmt: skip
    if masked_lm_of(raw, where, "DistilBertForMaskedLM"):
        s.update(masked_lm=True, head_activation=act, head_epsilon=1e-12)
    return s


def _distilbert_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """DistilBERT's tensors: ``DistilBertModel`` names (no token types, no pooler), or
    ``DistilBertForMaskedLM``'s (``distilbert.`` and ``vocab_*``)."""
    e = s["hidden_size"]
    base = [
        Entry("embeddings.word_embeddings.weight", (s["vocab_size"], e), "embeddings/word"),
        Entry("embeddings.position_embeddings.weight", (s["max_positions"], e),
              "embeddings/position"),
        Entry("embeddings.LayerNorm.weight", (e,), "embeddings/norm/gamma"),
        Entry("embeddings.LayerNorm.bias", (e,), "embeddings/norm/beta"),
    ]  # fmt: skip
    names = {"query": "attention.q_lin", "key": "attention.k_lin", "value": "attention.v_lin",
             "attn_out": "attention.out_lin", "norm_1": "sa_layer_norm", "ffn_1": "ffn.lin1",
             "ffn_2": "ffn.lin2", "norm_2": "output_layer_norm"}  # fmt: skip
    for i in range(s["num_layers"]):
        base += _block_entries(s, f"transformer.layer.{i}.", f"layer_{i}/", names)
    head = _head(s, "vocab_transform", "vocab_layer_norm", "vocab_projector.bias")
    return _with_head(s, "distilbert", base, head)


def _distilbert_buffers(s: dict) -> dict:
    out = _buffers(s, "distilbert", _position_buffer(s), "vocab_projector")
    out.pop("vocab_projector.bias", None)  # the head's own bias: an entry
    return out


DISTILBERT = Family(
    model_type="distilbert",
    architecture="DistilBertModel",
    prefix="distilbert",
    inputs=("input_ids", "attention_mask"),
    layer=_LAYER,
    read_sizes=_distilbert_sizes,
    keys=_DISTILBERT_KEYS,
    entries=_distilbert_entries,
    inert=frozenset({"dropout", "attention_dropout", "qa_dropout", "seq_classif_dropout"}),
    buffers=_distilbert_buffers,
    heads={"masked_lm": "DistilBertForMaskedLM"},
)

# --- ALBERT ---------------------------------------------------------------------------

_ALBERT_KEYS = (*_BERT_KEYS, "embedding_size", "num_hidden_groups", "inner_group_num",
                "hidden_act")  # fmt: skip
_ALBERT_ACTIVATIONS = ("gelu_new", "gelu", "relu")


def _albert_sizes(raw: dict, where: str) -> dict:
    s = {
        **_encoder_sizes(raw, where),
        "vocab_size": _int(raw, "vocab_size", where, 30000),
        "max_positions": _int(raw, "max_position_embeddings", where, 512),
        "type_vocab_size": _int(raw, "type_vocab_size", where, 2),
        "embedding_size": _int(raw, "embedding_size", where, 128),
        "num_groups": _int(raw, "num_hidden_groups", where, 1),
        "group_size": _int(raw, "inner_group_num", where, 1),
    }
    if s["num_groups"] > s["num_layers"]:
        raise ValueError(
            f"{where}: `num_hidden_groups` ({s['num_groups']}) must be at most "
            f"`num_hidden_layers` ({s['num_layers']}) (a group no layer runs)."
        )
    act = raw.get("hidden_act", "gelu_new")
    if act not in _ALBERT_ACTIVATIONS:
        raise ValueError(
            f"{where}: config option `hidden_act` = {act!r} is not implemented (multiattn's "
            f"albert supports {', '.join(map(repr, _ALBERT_ACTIVATIONS))})."
        )
    s["activation"] = act
    if masked_lm_of(raw, where, "AlbertForMaskedLM"):
        s.update(masked_lm=True, head_activation=act, head_epsilon=s["epsilon"])
    return s


def _albert_entries(s: dict, pooler: bool = True) -> list[Entry]:
    """ALBERT's tensors: ``AlbertModel`` names (``num_groups * group_size`` distinct
    blocks, written once however many layers run them), or ``AlbertForMaskedLM``'s
    (``albert.`` and ``predictions``)."""
    e = s["hidden_size"]
    base = _embeddings(s, s["embedding_size"]) + _projection(
        s, "encoder.embedding_hidden_mapping_in"
    )
    names = {"query": "attention.query", "key": "attention.key", "value": "attention.value",
             "attn_out": "attention.dense", "norm_1": "attention.LayerNorm", "ffn_1": "ffn",
             "ffn_2": "ffn_output", "norm_2": "full_layer_layer_norm"}  # fmt: skip
    for g in range(s["num_groups"]):
        for j in range(s["group_size"]):
            src = f"encoder.albert_layer_groups.{g}.albert_layers.{j}."
            base += _block_entries(s, src, f"layer_{g * s['group_size'] + j}/", names)
    if pooler:
        base += [
            Entry("pooler.weight", (e, e), "pooler/kernel", "linear"),
            Entry("pooler.bias", (e,), "pooler/bias"),
        ]
    head = _head(s, "predictions.dense", "predictions.LayerNorm", "predictions.bias")
    return _with_head(s, "albert", base, head)


ALBERT = Family(
    model_type="albert",
    architecture="AlbertModel",
    prefix="albert",
    inputs=_BERT_INPUTS,
    layer=_LAYER,
    read_sizes=_albert_sizes,
    keys=_ALBERT_KEYS,
    entries=_albert_entries,
    fixed={"position_embedding_type": ("absolute",)},
    inert=frozenset({"classifier_dropout_prob"}),
    buffers=lambda s: _buffers(s, "albert", _position_buffer(s), "predictions.decoder"),
    heads={"masked_lm": "AlbertForMaskedLM"},
)

# --- ELECTRA --------------------------------------------------------------------------

_ELECTRA_KEYS = (*_BERT_KEYS, "embedding_size")


def _electra_sizes(raw: dict, where: str) -> dict:
    """BERT's sizes, word embeddings of ``embedding_size`` (projected to ``hidden_size``
    when it differs), no pooler, and a head when ``architectures`` names one: the
    generator's masked-LM head (``ElectraForMaskedLM``, exact GELU) or the discriminator's
    (``ElectraForPreTraining``, ``hidden_act``)."""
    s = _bert_sizes(raw, where, "ElectraForMaskedLM")
    width = _int(raw, "embedding_size", where, s["hidden_size"])
    if width != s["hidden_size"]:
        s["embedding_size"] = width
    if "ElectraForPreTraining" in (raw.get("architectures") or []):
        if s.get("masked_lm"):
            raise ValueError(
                f"{where}: `architectures` names both ElectraForMaskedLM and "
                "ElectraForPreTraining; a checkpoint holds one head."
            )
        s.update(discriminator=True, head_activation="gelu")
    return s


def _electra_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """ELECTRA's tensors: ``ElectraModel`` names (BERT's blocks, the embeddings'
    ``embeddings_project``, no pooler), or a head checkpoint's (``electra.`` and
    ``generator_predictions`` / ``discriminator_predictions``)."""
    e = s["hidden_size"]
    base = _embeddings(s, s.get("embedding_size") or e)
    if "embedding_size" in s:
        base += _projection(s, "embeddings_project")
    base += _bert_layers(s)
    if s.get("discriminator"):
        src = "discriminator_predictions."
        head = [Entry(src + "dense.weight", (e, e), "discriminator/dense/kernel", "linear"),
                Entry(src + "dense.bias", (e,), "discriminator/dense/bias"),
                Entry(src + "dense_prediction.weight", (1, e), "discriminator/prediction/kernel",
                      "linear"),
                Entry(src + "dense_prediction.bias", (1,), "discriminator/prediction/bias")]  # fmt: skip
        return [replace(x, hf=f"electra.{x.hf}") for x in base] + head
    head = _head(s, "generator_predictions.dense", "generator_predictions.LayerNorm",
                 "generator_lm_head.bias")  # fmt: skip
    return _with_head(s, "electra", base, head)


def _electra_buffers(s: dict) -> dict:
    if s.get("discriminator"):
        return {f"electra.{k}": v for k, v in _position_buffer(s).items()}
    return _buffers(s, "electra", _position_buffer(s), "generator_lm_head")


ELECTRA = Family(
    model_type="electra",
    architecture="ElectraModel",
    prefix="electra",
    inputs=_BERT_INPUTS,
    layer=_LAYER,
    read_sizes=_electra_sizes,
    keys=_ELECTRA_KEYS,
    entries=_electra_entries,
    fixed=_BERT_FIXED,
    # the summary keys configure ElectraForMultipleChoice's head only
    inert=frozenset(
        {"summary_type", "summary_use_proj", "summary_activation", "summary_last_dropout"}
    ),
    buffers=_electra_buffers,
    heads={"masked_lm": "ElectraForMaskedLM", "discriminator": "ElectraForPreTraining"},
)

#: the encoder families besides BERT, for the registry (`multiattn.hf.families.FAMILIES`)
ENCODER_FAMILIES = (ROBERTA, XLM_ROBERTA, DISTILBERT, ALBERT, ELECTRA)
