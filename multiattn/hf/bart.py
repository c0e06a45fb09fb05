"""The BART family of `multiattn.hf.pretrained`: config options and tensor table
(imports no framework).

``model_type: "bart"`` loads into `multiattn.models.bart.BartForConditionalGeneration`:
an encoder and a decoder of post-LayerNorm blocks with biases everywhere, learned
positions (offset 2), the token embeddings optionally scaled by ``sqrt(d_model)``
(``scale_embedding``), a LayerNorm after the embeddings of each stack
(``layernorm_embedding``), and the output projection tied to the shared embeddings plus
the ``final_logits_bias`` buffer. The tensors carry ``BartForConditionalGeneration``'s
names (``model.`` prefixed); a ``BartModel`` checkpoint holds the same tensors without
the prefix and without ``final_logits_bias``, and loads with a zero bias (what
transformers gives it).

Decoding reads ``decoder_start_token_id``, ``forced_bos_token_id`` and
``forced_eos_token_id`` from ``generation_config.json`` where the folder has one (what
transformers' ``generate`` reads), else from ``config.json``. The pre-norm variants
(``normalize_before``, mBART's layout), a final LayerNorm per stack
(``add_final_layer_norm``), an untied output projection and other activations are
refused by name.
"""

from __future__ import annotations

from typing import Any

from ._common import Entry, Family, _int

__all__ = ["ACTIVATIONS", "BART"]

#: ``activation_function`` -> the activation of the blocks' feed-forward network (Keras'
#: names; ``gelu`` is the exact GELU, as transformers' ``ACT2FN["gelu"]``).
ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}

_KEYS = (
    "vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
    "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim",
    "max_position_embeddings", "activation_function", "scale_embedding",
    "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
    "num_hidden_layers",
)  # fmt: skip
#: Keys of older BART configs (fairseq's options) that must hold BART's value.
_FIXED = {
    "is_encoder_decoder": (True,),
    "tie_word_embeddings": (True,),
    "normalize_before": (False,),
    "add_final_layer_norm": (False,),
    "add_bias_logits": (False,),
    "normalize_embedding": (True,),
    "static_position_embeddings": (False,),
    "extra_pos_embeddings": (2,),
}
#: Training-only keys (dropouts, layer drop, initialisation) and metadata.
_INERT = frozenset({
    "dropout", "attention_dropout", "activation_dropout", "classifier_dropout",
    "classif_dropout", "encoder_layerdrop", "decoder_layerdrop", "init_std", "output_past",
    "gradient_checkpointing",
})  # fmt: skip


def _token(where: str, key: str, value: Any, vocab: int, optional: bool) -> int | None:
    """A token id in ``[0, vocab)`` (None allowed where ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise ValueError(
            f"{where}: `{key}` must be a token id in [0, {vocab}){' or null' * optional}; "
            f"received {value!r}."
        )
    return value


def _tokens(where: str, key: str, value: Any, vocab: int) -> tuple[int, ...]:
    """``forced_eos_token_id``: None, an id or a list of ids, as a tuple (empty: none)."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError(f"{where}: `{key}` must be a token id, a list of them or null; "
                         f"received {value!r}.")  # fmt: skip
    return tuple(_token(where, key, v, vocab, False) for v in values)


def _decoding(raw: dict, where: str, vocab: int, defaults: dict) -> dict:
    """The decoding ids of a config object (``config.json`` or ``generation_config.json``);
    a key it lacks keeps its value in ``defaults``."""
    out = dict(defaults)
    if "decoder_start_token_id" in raw:
        out["decoder_start_token_id"] = _token(where, "decoder_start_token_id",
                                               raw["decoder_start_token_id"], vocab, False)  # fmt: skip
    if "forced_bos_token_id" in raw:
        out["forced_bos_token_id"] = _token(where, "forced_bos_token_id",
                                            raw["forced_bos_token_id"], vocab, True)  # fmt: skip
    if "forced_eos_token_id" in raw:
        out["forced_eos_token_id"] = _tokens(where, "forced_eos_token_id",
                                             raw["forced_eos_token_id"], vocab)  # fmt: skip
    return out


def _bart_sizes(raw: dict, where: str) -> dict:
    act = raw.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"{where}: config option `activation_function` = {act!r} is not implemented "
            f"(multiattn's bart supports {', '.join(repr(k) for k in ACTIVATIONS)})."
        )
    scale = raw.get("scale_embedding", False)
    if not isinstance(scale, bool):
        raise ValueError(f"{where}: `scale_embedding` must be a bool; received {scale!r}.")
    e, vocab = _int(raw, "d_model", where), _int(raw, "vocab_size", where)
    sizes = {
        "vocab_size": vocab,
        "hidden_size": e,
        "num_layers": _int(raw, "encoder_layers", where, 12),
        "num_decoder_layers": _int(raw, "decoder_layers", where, 12),
        "num_heads": _int(raw, "encoder_attention_heads", where, 16),
        "num_decoder_heads": _int(raw, "decoder_attention_heads", where, 16),
        "intermediate_size": _int(raw, "encoder_ffn_dim", where, 4096),
        "decoder_intermediate_size": _int(raw, "decoder_ffn_dim", where, 4096),
        "max_positions": _int(raw, "max_position_embeddings", where, 1024),
        "activation": ACTIVATIONS[act],
        "scale_embedding": scale,
    }
    for key, heads in (("encoder_attention_heads", sizes["num_heads"]),
                       ("decoder_attention_heads", sizes["num_decoder_heads"])):  # fmt: skip
        if e % heads:
            raise ValueError(f"{where}: `d_model` ({e}) must be divisible by `{key}` ({heads}).")
    if "num_hidden_layers" in raw and raw["num_hidden_layers"] != sizes["num_layers"]:
        raise ValueError(
            f"{where}: `num_hidden_layers` ({raw['num_hidden_layers']!r}) is transformers' "
            f"other name of `encoder_layers` ({sizes['num_layers']}); they must agree."
        )
    # transformers' BartConfig defaults for the keys a config.json lacks
    raw = {"decoder_start_token_id": 2, "forced_eos_token_id": 2, **raw}
    return {**sizes, **_decoding(raw, where, vocab, {"forced_bos_token_id": None})}


def _generation(sizes: dict, side_files: dict, where: str) -> dict:
    """The decoding ids of ``generation_config.json`` (where the folder has one) over
    those of ``config.json``."""
    raw = side_files.get("generation_config.json")
    if raw is None:
        return sizes
    return _decoding(raw, f"{where} (generation_config.json)", sizes["vocab_size"], sizes)


def _attention(src: str, dst: str, e: int, h: int) -> list[Entry]:
    out = []
    for hf, part in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        out += [Entry(f"{src}{hf}.weight", (e, e), f"{dst}{part}/kernel", "heads_in", h),
                Entry(f"{src}{hf}.bias", (e,), f"{dst}{part}/bias", "heads_bias", h)]  # fmt: skip
    out.append(Entry(f"{src}out_proj.weight", (e, e), f"{dst}attention_output/kernel",
                     "heads_out", h))  # fmt: skip
    out.append(Entry(f"{src}out_proj.bias", (e,), f"{dst}attention_output/bias"))
    return out


def _norm(src: str, dst: str, e: int) -> list[Entry]:
    return [Entry(f"{src}.weight", (e,), f"{dst}/gamma"), Entry(f"{src}.bias", (e,), f"{dst}/beta")]


def _stack(s: dict, side: str) -> list[Entry]:
    """One stack's positions, embedding norm and blocks (``model.<side>.`` names)."""
    e, decoder = s["hidden_size"], side == "decoder"
    count = s["num_decoder_layers"] if decoder else s["num_layers"]
    heads = s["num_decoder_heads"] if decoder else s["num_heads"]
    f = s["decoder_intermediate_size"] if decoder else s["intermediate_size"]
    top = f"model.{side}."
    out = [Entry(f"{top}embed_positions.weight", (s["max_positions"] + 2, e), f"{side}/positions")]
    out += _norm(f"{top}layernorm_embedding", f"{side}/embedding_norm", e)
    for i in range(count):
        src, dst = f"{top}layers.{i}.", f"{side}/layer_{i}/"
        attn = "self_attention/" if decoder else "attention/"
        out += _attention(f"{src}self_attn.", dst + attn, e, heads)
        out += _norm(f"{src}self_attn_layer_norm", f"{dst}norm_1", e)
        if decoder:
            out += _attention(f"{src}encoder_attn.", f"{dst}cross_attention/", e, heads)
            out += _norm(f"{src}encoder_attn_layer_norm", f"{dst}norm_2", e)
        out += [
            Entry(f"{src}fc1.weight", (f, e), f"{dst}ffn_1/kernel", "linear"),
            Entry(f"{src}fc1.bias", (f,), f"{dst}ffn_1/bias"),
            Entry(f"{src}fc2.weight", (e, f), f"{dst}ffn_2/kernel", "linear"),
            Entry(f"{src}fc2.bias", (e,), f"{dst}ffn_2/bias"),
        ]
        out += _norm(f"{src}final_layer_norm", f"{dst}norm_{3 if decoder else 2}", e)
    return out


def bart_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """BART's tensors (``BartForConditionalGeneration`` names) for sizes ``s``."""
    shared = Entry("model.shared.weight", (s["vocab_size"], s["hidden_size"]), "shared")
    bias = Entry("final_logits_bias", (1, s["vocab_size"]), "final_logits_bias", "squeeze")
    return [shared, *_stack(s, "encoder"), *_stack(s, "decoder"), bias]


def _bart_buffers(s: dict) -> dict:
    """Copies of ``model.shared.weight`` some checkpoints hold (tied: read, not used)."""
    shape = (s["vocab_size"], s["hidden_size"])
    names = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
             "lm_head.weight")  # fmt: skip
    return dict.fromkeys(names, shape)


BART = Family(
    model_type="bart",
    architecture="BartForConditionalGeneration",
    prefix="",
    inputs=("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask"),
    layer="multiattn.models.bart:BartForConditionalGeneration",
    read_sizes=_bart_sizes,
    keys=_KEYS,
    entries=bart_entries,
    fixed=_FIXED,
    inert=_INERT,
    buffers=_bart_buffers,
    base_prefix="model.",
    zeros=lambda s: {"final_logits_bias": (1, s["vocab_size"])},
    read_generation=_generation,
)
