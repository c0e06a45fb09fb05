"""What every family table of `multiattn.hf.families` is built from (no framework).

`Entry` (one tensor: the Hugging Face name and shape, the neutral name and the exact
transform between the two), `Family` (one ``model_type``: its config keys, checked, and
its tensor table), the config keys every family accepts or fixes (`COMMON_INERT`,
`COMMON_FIXED`) and the checked readers of config values. It imports no other module of
the package, so `multiattn.hf.families` (the registry, `FAMILIES`) and the family
modules it lists (`multiattn.hf.causal_lm`, `multiattn.hf.t5`) all import
it without importing one another in a circle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["COMMON_FIXED", "COMMON_INERT", "Entry", "Family"]

# Keys of every transformers config that do not change a base encoder's inference output.
COMMON_INERT = frozenset(
    {
        "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
        "model_type", "initializer_range", "hidden_dropout_prob",
        "attention_probs_dropout_prob", "classifier_dropout", "use_cache", "pad_token_id",
        "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
        "tie_word_embeddings", "gradient_checkpointing", "id2label", "label2id",
        "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
        "task_specific_params", "return_dict", "chunk_size_feed_forward", "torchscript",
        "use_bfloat16", "tie_encoder_decoder", "_attn_implementation_autoset",
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
        "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
        "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens",
        # the repository's own modelling code, which transformers runs only with
        # trust_remote_code; multiattn builds the built-in class of `model_type`
        "auto_map",
    }
)  # fmt: skip
# Keys that must hold their default: a different value changes the model.
COMMON_FIXED = {
    "is_decoder": (False,),
    "add_cross_attention": (False,),
    "is_encoder_decoder": (False,),
    "cross_attention_hidden_size": (None,),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    "pruned_heads": ({},),
}


@dataclass(frozen=True)
class Entry:
    """One tensor: Hugging Face ``hf`` name and shape, neutral ``name``, and ``kind``:

    ``same`` (identical), ``linear`` (HF ``(out, in)`` <-> ``(in, out)``), ``heads_in``
    (HF ``(H*D, E)`` <-> ``(E, H, D)``), ``heads_bias`` (``(H*D,)`` <-> ``(H, D)``),
    ``heads_out`` (HF ``(E, H*D)`` <-> ``(H, D, E)``), ``patch`` (a convolution kernel
    ``(E, C, p, q)`` <-> ``(C*p*q, E)``), ``squeeze`` (the leading unit axis dropped),
    ``rows_heads`` (a kernel stored ``(in, out)``, HF ``(H*D, E)`` <-> ``(H, D, E)``),
    ``grouped_qkv`` (a fused query/key/value projection whose HF rows, or bias, come in
    ``heads`` groups of ``group`` query heads, one key head and one value head, each
    ``D`` wide: GPT-NeoX's per-head ``(H, 3, D)``) <-> the neutral fused kernel ``(E, (H
    + 2 H_kv) D)`` (or bias) of the query heads, then the keys, then the values.
    """

    hf: str
    shape: tuple[int, ...]
    name: str
    kind: str = "same"
    heads: int = 1
    group: int = 1  # ``grouped_qkv``: query heads per group

    def to_neutral(self, a: np.ndarray) -> np.ndarray:
        h, k = self.heads, self.kind
        if k == "linear":
            a = a.T
        elif k == "heads_in":
            a = a.T.reshape(a.shape[1], h, -1)
        elif k == "heads_bias":
            a = a.reshape(h, -1)
        elif k == "heads_out":
            a = a.T.reshape(h, -1, a.shape[0])
        elif k == "patch":
            a = a.reshape(a.shape[0], -1).T
        elif k == "squeeze":
            a = a.reshape(a.shape[1:])
        elif k == "rows_heads":
            a = a.reshape(h, -1, a.shape[1])
        elif k == "grouped_qkv":
            g = a.reshape(h, self.group + 2, -1, *a.shape[1:])
            parts = (g[:, : self.group], g[:, self.group], g[:, self.group + 1])
            a = np.concatenate([p.reshape(-1, *a.shape[1:]) for p in parts]).T
        return np.ascontiguousarray(a)

    def _grouped_to_hf(self, a: np.ndarray) -> np.ndarray:
        """The inverse of ``grouped_qkv``'s `to_neutral`."""
        a = a.T
        h, m = self.heads, self.group
        width = a.shape[0] // (h * (m + 2))  # D
        q, k, v = np.split(a, [h * m * width, h * (m + 1) * width])
        rest = a.shape[1:]
        groups = [q.reshape(h, m, width, *rest), k.reshape(h, 1, width, *rest),
                  v.reshape(h, 1, width, *rest)]  # fmt: skip
        return np.ascontiguousarray(np.concatenate(groups, axis=1).reshape(self.shape))

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        k = self.kind
        if k == "grouped_qkv":
            return self._grouped_to_hf(a)
        if k in ("linear", "heads_in", "heads_out", "patch"):
            # every neutral kernel flattens to (in, out) in HF's feature order
            rows = a.shape[0] if k != "heads_out" else a.shape[0] * a.shape[1]
            a = a.reshape(rows, -1).T
        return np.ascontiguousarray(a.reshape(self.shape))


def _int(raw: dict, key: str, where: str, default: Any = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{where}: config.json has no `{key}`.")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: `{key}` must be a positive integer; received {value!r}.")
    return value


def _width_and_heads(raw: dict, where: str) -> tuple[int, int]:
    """``(hidden_size, num_attention_heads)``, the width a multiple of the heads."""
    e, h = _int(raw, "hidden_size", where), _int(raw, "num_attention_heads", where)
    if e % h:
        raise ValueError(
            f"{where}: `hidden_size` ({e}) must be divisible by `num_attention_heads` ({h})."
        )
    return e, h


def _positive(raw: dict, key: str, where: str, default: Any = None) -> float:
    """A positive, finite number (JSON's ``Infinity`` or ``1e999`` as a norm epsilon or a
    rotary base leaves the model without meaning)."""
    value = raw.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            or not math.isfinite(value)):  # fmt: skip
        raise ValueError(f"{where}: `{key}` must be a positive finite number; received {value!r}.")
    return float(value)


@dataclass(frozen=True)
class Family:
    """One ``model_type``: how its config is read and its tensors are named."""

    model_type: str
    architecture: str  # the transformers class written to ``architectures``
    prefix: str  # the base model's prefix inside task-head checkpoints
    inputs: tuple[str, ...]
    layer: str  # "module:Class" of the Keras layer, built by `from_sizes`
    read_sizes: Callable[[dict, str], dict]
    keys: tuple[str, ...]  # the config keys `read_sizes` reads
    entries: Callable[[dict], list]
    fixed: dict = field(default_factory=dict)
    inert: frozenset = frozenset()
    buffers: Callable[[dict], dict] = lambda sizes: {}  # read, checked, not used
    # The prefix of the base model in the entries' names, which a base-model checkpoint
    # lacks (BART's entries carry ``BartForConditionalGeneration``'s ``model.`` names; a
    # ``BartModel`` checkpoint's tensors are read under them). "" for none.
    base_prefix: str = ""
    # Tensors of the entries a checkpoint may lack (name -> shape), read as zeros then,
    # the value transformers gives them (a ``BartModel`` has no ``final_logits_bias``).
    zeros: Callable[[dict], dict] = lambda sizes: {}
    # ``(sizes, side files, where) -> sizes``: what the family's decoding reads from the
    # folder's side files (``generation_config.json``); by default nothing.
    read_generation: Callable[[dict, dict, str], dict] = lambda sizes, side, where: sizes
    # The task heads whose checkpoints the family reads: sizes key -> transformers class
    # (an encoder's ``{"masked_lm": "BertForMaskedLM"}``). A config whose ``architectures``
    # names such a class has that key true in its sizes; its entries are the head's
    # checkpoint names (the base model's under ``prefix``, then the head's), and
    # `save_pretrained` writes it back as that class.
    heads: dict = field(default_factory=dict)

    def head_of(self, sizes: dict) -> str:
        """The sizes key of the task head a model of ``sizes`` carries ("" for none)."""
        return next((key for key in self.heads if sizes.get(key)), "")

    def architecture_of(self, sizes: dict) -> str:
        """The transformers class a model of ``sizes`` is written back as."""
        head = self.head_of(sizes)
        return self.heads[head] if head else self.architecture

    def check_config(self, raw: dict, where: str) -> dict:
        """The sizes of ``raw`` (a config.json object); refuses what is not implemented."""
        got = raw.get("model_type")
        if got != self.model_type:
            raise ValueError(
                f"{where}: `model_type` must be {self.model_type!r}; received {got!r}."
            )
        fixed = {**COMMON_FIXED, **self.fixed}
        sizes = self.read_sizes(raw, where)
        for key, value in raw.items():
            if key in fixed:
                if value not in fixed[key]:
                    allowed = " or ".join(repr(v) for v in fixed[key])
                    raise ValueError(
                        f"{where}: config option `{key}` = {value!r} is not implemented "
                        f"(multiattn's {self.model_type} supports {allowed})."
                    )
            elif key not in COMMON_INERT and key not in self.inert and key not in self.keys:
                raise ValueError(
                    f"{where}: config option `{key}` is not implemented for model_type "
                    f"{self.model_type!r}; refusing to load rather than ignore it."
                )
        return sizes
