"""The T5 family of `multiattn.hf.pretrained`: config options and tensor table
(imports no framework).

``model_type: "t5"`` loads into `multiattn.models.t5.T5ForConditionalGeneration`: an
encoder-decoder with relative position biases, RMS-style normalisation without biases,
a ``relu`` or gated ``gelu_new`` (``gated-gelu``) feed-forward network, and the output
projection tied to the shared embeddings with the decoder output scaled by
``d_model ** -0.5`` unless ``scale_decoder_outputs`` is false (transformers 5 writes it).
A ``T5Model`` checkpoint holds the same tensors and loads the same way (its config reads
the same). ``tie_word_embeddings: false`` (T5 v1.1 and Flan-T5 configs of earlier
transformers releases, whose meaning transformers 5 changed: it ties the projection and
drops the scaling) and other feed-forward forms are refused by name.
"""

from __future__ import annotations

from .._checks import check_relative_buckets
from ._common import Entry, Family, _int, _positive

__all__ = ["FEED_FORWARD", "T5"]

#: ``feed_forward_proj`` -> (activation of `multiattn.layers.FeedForward`, gated).
FEED_FORWARD = {"relu": ("relu", False), "gated-gelu": ("gelu_new", True)}

_KEYS = (
    "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
    "num_heads", "relative_attention_num_buckets", "relative_attention_max_distance",
    "layer_norm_epsilon", "feed_forward_proj", "dense_act_fn", "is_gated_act",
    "decoder_start_token_id", "pad_token_id", "scale_decoder_outputs",
)  # fmt: skip


def _feed_forward(raw: dict, where: str) -> tuple[str, bool]:
    proj = raw.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD:
        raise ValueError(
            f"{where}: config option `feed_forward_proj` = {proj!r} is not implemented "
            f"(multiattn's t5 supports {', '.join(repr(k) for k in FEED_FORWARD)})."
        )
    activation, gated = FEED_FORWARD[proj]
    derived = {"dense_act_fn": activation if gated else proj, "is_gated_act": gated}
    for key, want in derived.items():
        if key in raw and raw[key] != want:
            raise ValueError(
                f"{where}: config option `{key}` = {raw[key]!r} disagrees with "
                f"`feed_forward_proj` = {proj!r} (expected {want!r}); not implemented."
            )
    return activation, gated


def _token(raw: dict, key: str, where: str, default: int | None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: `{key}` must be a token id (int >= 0); received {value!r}.")
    return value


def _t5_sizes(raw: dict, where: str) -> dict:
    activation, gated = _feed_forward(raw, where)
    layers = _int(raw, "num_layers", where)
    pad = _token(raw, "pad_token_id", where, 0)
    vocab = _int(raw, "vocab_size", where)
    start = _token(raw, "decoder_start_token_id", where, pad)
    scale = raw.get("scale_decoder_outputs", True)
    if not isinstance(scale, bool):
        raise ValueError(f"{where}: `scale_decoder_outputs` must be a bool; received {scale!r}.")
    if start >= vocab:
        raise ValueError(
            f"{where}: `decoder_start_token_id` ({start}) must be below `vocab_size` ({vocab})."
        )
    buckets = _int(raw, "relative_attention_num_buckets", where, 32)
    distance = _int(raw, "relative_attention_max_distance", where, 128)
    names = ("relative_attention_num_buckets", "relative_attention_max_distance")
    check_relative_buckets(where, buckets, distance, names)
    return {
        "vocab_size": vocab,
        "hidden_size": _int(raw, "d_model", where),
        "num_layers": layers,
        "num_decoder_layers": _int(raw, "num_decoder_layers", where, layers),
        "num_heads": _int(raw, "num_heads", where),
        "head_dim": _int(raw, "d_kv", where),
        "intermediate_size": _int(raw, "d_ff", where),
        "num_buckets": buckets,
        "max_distance": distance,
        "epsilon": _positive(raw, "layer_norm_epsilon", where, 1e-6),
        "activation": activation,
        "gated": gated,
        "decoder_start_token_id": start,
        "scale_output": scale,
    }


def _attention(src: str, dst: str, s: dict) -> list[Entry]:
    e, h, d = s["hidden_size"], s["num_heads"], s["head_dim"]
    out = [
        Entry(f"{src}{hf}.weight", (h * d, e), f"{dst}{part}/kernel", "heads_in", h)
        for hf, part in (("q", "query"), ("k", "key"), ("v", "value"))
    ]
    out.append(Entry(f"{src}o.weight", (e, h * d), f"{dst}attention_output/kernel",
                     "heads_out", h))  # fmt: skip
    return out


def _ffn(src: str, dst: str, s: dict) -> list[Entry]:
    e, f = s["hidden_size"], s["intermediate_size"]
    parts = (("wi_0", "gate"), ("wi_1", "up")) if s["gated"] else (("wi", "up"),)
    out = [Entry(f"{src}{hf}.weight", (f, e), f"{dst}{n}/kernel", "linear") for hf, n in parts]
    out.append(Entry(f"{src}wo.weight", (e, f), f"{dst}down/kernel", "linear"))
    return out


def _stack(s: dict, side: str) -> list[Entry]:
    """The encoder's or the decoder's blocks, relative bias and final norm."""
    e, decoder = s["hidden_size"], side == "decoder"
    count = s["num_decoder_layers"] if decoder else s["num_layers"]
    out = [Entry(f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 (s["num_buckets"], s["num_heads"]), f"{side}/relative_bias")]  # fmt: skip
    for i in range(count):
        src, dst = f"{side}.block.{i}.layer.", f"{side}/layer_{i}/"
        out += _attention(f"{src}0.SelfAttention.", f"{dst}self_attention/", s)
        out.append(Entry(f"{src}0.layer_norm.weight", (e,), f"{dst}norm_1/scale"))
        ffn = 1
        if decoder:
            out += _attention(f"{src}1.EncDecAttention.", f"{dst}cross_attention/", s)
            out.append(Entry(f"{src}1.layer_norm.weight", (e,), f"{dst}norm_2/scale"))
            ffn = 2
        out += _ffn(f"{src}{ffn}.DenseReluDense.", f"{dst}ffn/", s)
        out.append(Entry(f"{src}{ffn}.layer_norm.weight", (e,), f"{dst}norm_3/scale"))
    out.append(Entry(f"{side}.final_layer_norm.weight", (e,), f"{side}/final_norm/scale"))
    return out


def t5_entries(s: dict, pooler: bool = False) -> list[Entry]:
    """T5's tensors (``T5ForConditionalGeneration`` names) for sizes ``s``."""
    shared = Entry("shared.weight", (s["vocab_size"], s["hidden_size"]), "shared")
    return [shared, *_stack(s, "encoder"), *_stack(s, "decoder")]


def _t5_buffers(s: dict) -> dict:
    """Copies of ``shared.weight`` some checkpoints hold (tied: read, not used)."""
    shape = (s["vocab_size"], s["hidden_size"])
    names = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
    return dict.fromkeys(names, shape)


T5 = Family(
    model_type="t5",
    architecture="T5ForConditionalGeneration",
    prefix="",
    inputs=("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask"),
    layer="multiattn.models.t5:T5ForConditionalGeneration",
    read_sizes=_t5_sizes,
    keys=_KEYS,
    entries=t5_entries,
    fixed={"is_encoder_decoder": (True,), "tie_word_embeddings": (True,)},
    inert=frozenset(
        {"dropout_rate", "classifier_dropout", "initializer_factor", "n_positions", "output_past"}
    ),
    buffers=_t5_buffers,
)
