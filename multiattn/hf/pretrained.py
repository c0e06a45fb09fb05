"""Hugging Face checkpoints in, Hugging Face checkpoints out: `from_pretrained`.

``from_pretrained(path)`` reads a folder written by transformers' ``save_pretrained``
(``config.json`` and ``model.safetensors`` or a sharded ``model.safetensors.index.json``),
picks the family from ``model_type`` (`multiattn.hf.families.FAMILIES`: ``bert``,
``vit``, the causal language models ``gpt2``, ``llama``, ``qwen2``, ``mistral``, and
the encoder-decoder ``t5``), checks the config and every tensor (`multiattn.hf.files`) and returns a
`PretrainedModel`: a Keras layer built from multiattn layers holding the weights, callable
with transformers' argument names, with a `PretrainedModel.save_pretrained` that
transformers reads back bit for bit.

Importing this module imports no framework; Keras is imported by `from_pretrained`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .._checks import check_mask_dtype
from ._tensors import Lazy
from .families import Family, to_hf
from .files import checkpoint_dtype, read_folder, write_folder

__all__ = ["DTYPES", "FRAMEWORKS", "PretrainedCausalLM", "PretrainedModel", "from_pretrained"]

FRAMEWORKS = ("jax", "torch", "tensorflow", "numpy", "paddle")
DTYPES = ("float32", "float64", "float16", "bfloat16")
HALF = ("float16", "bfloat16")


def _is_numpy(value: Any) -> bool:
    """A NumPy array or a nested list (not None, not a framework tensor)."""
    return value is not None and (isinstance(value, np.ndarray) or not hasattr(value, "dtype"))


def _check_int32_ids(where: str, name: str, value: Any) -> None:
    """NumPy (or list) ids beyond int32 refused before a framework converts them: jax
    without 64-bit mode casts int64 to int32 and wraps (``2**32 + 5`` would read id 5).
    The model's call checks the range against its vocabulary."""
    if not _is_numpy(value):
        return  # a framework tensor: its values reach the model as they are
    arr = np.asarray(value)
    if arr.dtype.kind in "iu" and arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        bad = arr[(arr < -(2**31)) | (arr >= 2**31)].flat[0]
        raise ValueError(
            f"{where}: `{name}` must hold token ids; received {bad}, beyond the int32 "
            f"range (ids are below the vocabulary size)."
        )


class PretrainedModel:
    """A loaded Hugging Face base model on the process's Keras backend.

    Attributes:
        family: the `multiattn.hf.families.Family` (``family.model_type``).
        config: the ``config.json`` object it was loaded from (written back by
            `save_pretrained`).
        layer: the Keras layer (`multiattn.models.bert.BertModel` or
            `multiattn.models.vit.ViTModel`) holding the weights.
        ignored_tensors: task-head tensors of the checkpoint outside the base model.
    """

    def __init__(self, family: Family, config: dict, sizes: dict, layer: Any, ignored=(),
                 side_files: dict | None = None):  # fmt: skip
        self.family, self.config, self.sizes, self.layer = family, config, sizes, layer
        self.ignored_tensors = list(ignored)
        self.side_files = dict(side_files or {})  # generation_config.json, written back

    @property
    def dtype(self) -> str:
        """The compute and variable dtype (the checkpoint's, unless `from_pretrained` was
        given another or upcast it)."""
        return self.layer.compute_dtype

    def __repr__(self) -> str:
        return (
            f"PretrainedModel({self.family.architecture}, layers={self.sizes['num_layers']}, "
            f"hidden={self.sizes['hidden_size']}, dtype={self.dtype})"
        )

    def __call__(self, **inputs: Any) -> dict[str, Any]:
        """Run the model (inference).

        Args:
            **inputs: transformers' names, NumPy arrays or backend tensors. BERT:
                ``input_ids`` int ``(batch, seq)``, ``attention_mask`` ``(batch, seq)``
                (1 / True = real token, may be attended; 0 = padding; default all ones),
                ``token_type_ids`` (default zeros). ViT: ``pixel_values`` float
                ``(batch, channels, height, width)``. Causal LMs: ``input_ids``,
                ``attention_mask`` (left padding for generation). T5: ``input_ids``,
                ``attention_mask``, ``decoder_input_ids`` (required),
                ``decoder_attention_mask``.

        Returns:
            ``{"last_hidden_state": ..., "pooler_output": ...}`` backend tensors in the
            model's dtype (``pooler_output`` only if the checkpoint has a pooler); causal
            LMs ``{"logits": (batch, seq, vocab), "last_hidden_state": ...}``; T5 also
            ``"encoder_last_hidden_state"`` (``last_hidden_state`` is the decoder's).

        Raises:
            TypeError: an argument the family does not take (named), or none given.
        """
        allowed = self.family.inputs
        unknown = sorted(set(inputs) - set(allowed))
        if unknown:
            raise TypeError(
                f"{self.family.architecture}: unsupported argument(s) {', '.join(unknown)}; "
                f"accepted: {', '.join(allowed)}."
            )
        first = allowed[0]
        if inputs.get(first) is None:
            raise TypeError(f"{self.family.architecture}: `{first}` is required.")
        for name, value in inputs.items():
            if name.endswith("_ids"):
                _check_int32_ids(self.family.architecture, name, value)
            elif name.endswith("attention_mask") and _is_numpy(value):
                check_mask_dtype(self.family.architecture, name, str(np.asarray(value).dtype))
        return dict(self.layer(**{k: v for k, v in inputs.items() if v is not None}))

    def state_dict(self) -> dict[str, np.ndarray]:
        """The weights as NumPy arrays under transformers' names (``BertModel`` /
        ``ViTModel``, no prefix)."""
        weights = self.layer.neutral_weights()
        entries = self.family.entries(self.sizes, pooler="pooler/kernel" in weights)
        return to_hf(entries, weights)

    def save_pretrained(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write ``config.json`` and ``model.safetensors`` that transformers'
        ``AutoModel.from_pretrained`` loads with tensors identical to this model's.

        Written into a temporary folder next to ``path`` and renamed into place; on error
        nothing is left at ``path``. ``path`` must not exist or be empty unless
        ``overwrite=True``. Returns ``path``.
        """
        weights = self.layer.neutral_weights()
        return write_folder(path, self.family, self.sizes, self.config, weights, overwrite,
                            self.side_files)  # fmt: skip


class PretrainedCausalLM(PretrainedModel):
    """A loaded language model with `generate`: decoder-only (``gpt2``, ``llama``,
    ``qwen2``, ``mistral``; called with ``input_ids`` and ``attention_mask``) or the
    encoder-decoder ``t5`` (also ``decoder_input_ids``; `generate` returns the decoder's
    tokens from ``decoder_start_token_id``). Returns ``{"logits": ...,
    "last_hidden_state": ...}`` (T5: and ``"encoder_last_hidden_state"``)."""

    def generate(self, input_ids: Any, attention_mask: Any = None, **options: Any) -> np.ndarray:
        """Greedy or sampled continuation through the KV cache; see
        `multiattn.decoding.GenerationMixin.generate` for the options."""
        return self.layer.generate(input_ids, attention_mask, **options)


def _check_framework(framework: Any) -> str:
    if framework is not None and framework not in FRAMEWORKS:
        raise ValueError(
            f"from_pretrained: `framework` must be one of {', '.join(FRAMEWORKS)} or None; "
            f"received {framework!r}."
        )
    if framework == "paddle":
        import multiattn.paddle  # noqa: F401  (paddle first; ImportError after TensorFlow)

        return framework
    import keras

    current = keras.backend.backend()
    if framework is None:
        return current
    if framework != current:
        raise ValueError(
            f"from_pretrained: framework={framework!r}, but this process's Keras backend is "
            f"{current!r} (Keras reads KERAS_BACKEND once, before it is first imported)."
        )
    return framework


def from_pretrained(
    path: str | Path,
    framework: str | None = None,
    dtype: str | None = None,
    trust_pickle: bool = False,
    distribution: Any = None,
) -> PretrainedModel:
    """Load a Hugging Face model folder into multiattn layers.

    Args:
        path: a folder with ``config.json`` and ``model.safetensors`` (or a sharded
            ``model.safetensors.index.json``; ``pytorch_model.bin`` only with
            ``trust_pickle``). Task-head checkpoints (``bert.`` / ``vit.`` prefixed
            tensors) load their base model; the head's tensors are listed in a warning.
        framework: ``paddle`` for the Paddle twin (`multiattn.paddle.models`; imports
            paddle, which must come before TensorFlow in a process), else the Keras
            backend to run on (``jax``, ``torch``, ``tensorflow``, ``numpy``): default,
            and the only Keras value accepted, is the process's backend.
        dtype: ``float32``, ``float64``, ``float16`` or ``bfloat16``: the variables and
            the computation (weights are converted, rounding to nearest even); None
            (default) keeps the checkpoint's dtype, as transformers' ``dtype="auto"``:
            ``config.json``'s ``dtype`` (or ``torch_dtype``), else the tensors' own; on the
            ``numpy`` backend, and on Paddle on a CPU (whose kernels have no half
            precision), a float16 or bfloat16 checkpoint is computed in float32.
            Which parts of a half-precision model run in float32: see ``docs/models.md``.
        trust_pickle: allow reading ``pytorch_model.bin`` (a pickle; only tensors are
            unpickled, through torch's weights-only loader).
        distribution: a ``keras.distribution.Distribution`` (jax backend only), e.g.
            `multiattn.distributed.model_parallel` ``(mesh)``: the model is built under
            its scope, so each variable is made with its layout (sharded zeros), and
            each tensor, read one at a time, is placed from the host onto its shards
            (`_sharded_assignment`): no device holds a whole sharded weight. See
            ``docs/scaling-out.md``.

    Returns:
        A `PretrainedModel`.

    Raises:
        ValueError: no folder, no config.json, no weights, an unsupported ``model_type``
            (the supported ones are listed), a config option that is not implemented (named),
            a missing, unexpected or mis-shaped tensor (named), a tensor of a dtype
            multiattn does not load (float8, integers: named), with ``dtype=None`` a tensor
            wider than the config's dtype (named: loading would lose information), a
            non-finite weight (named), an unreadable or truncated weights file, a link out
            of the folder (other than a cache snapshot's into its ``blobs``), a pickle
            without ``trust_pickle``, a bad ``framework``/``dtype``, a ``distribution``
            on a backend other than jax.
        TypeError: ``trust_pickle`` not a bool, ``path`` not a path, ``distribution``
            not a ``keras.distribution.Distribution``.
    """
    if not isinstance(trust_pickle, bool):
        raise TypeError(
            f"from_pretrained: `trust_pickle` must be a bool; received {trust_pickle!r}."
        )
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(
            f"from_pretrained: `dtype` must be one of {', '.join(DTYPES)} or None; "
            f"received {dtype!r}."
        )
    framework = _check_framework(framework)
    _check_distribution(distribution, framework)
    loaded = read_folder(path, trust_pickle=trust_pickle)
    where = f"from_pretrained({str(path)!r})"
    if dtype in HALF and not _half_kernels(framework):
        raise ValueError(
            f"{where}: dtype={dtype!r}: Paddle's CPU kernels have no float16 or bfloat16 "
            "arithmetic; pass dtype='float32' (or None, which upcasts a half-precision "
            "checkpoint there)."
        )
    dtype = dtype or _kept_dtype(checkpoint_dtype(loaded.config, loaded.dtypes, where), framework)
    module, name = loaded.family.layer.split(":")
    if framework == "paddle":  # the Paddle twin of the same definition
        module = "multiattn.paddle.models"
    cls = getattr(importlib.import_module(module), name)
    from ..layers import zero_initialized

    with zero_initialized(), _scope(distribution):  # assigned from the checkpoint next
        layer = cls.from_sizes(loaded.sizes, "pooler/kernel" in loaded.weights, dtype)
    with _sharded_assignment(distribution):
        layer.set_neutral_weights(_cast(loaded.weights, dtype))
    if framework == "paddle":
        layer.eval()  # inference, as on Keras; `model.layer.train()` to fine-tune
    model_class = PretrainedCausalLM if hasattr(layer, "generate") else PretrainedModel
    return model_class(loaded.family, loaded.config, loaded.sizes, layer, loaded.ignored,
                       loaded.side_files)  # fmt: skip


def _check_distribution(distribution: Any, framework: str) -> None:
    """A ``keras.distribution.Distribution`` on the jax backend, or None."""
    if distribution is None:
        return
    if framework != "jax":
        raise ValueError(
            f"from_pretrained: `distribution` needs the jax backend (keras.distribution "
            f"shards variables on JAX only); this model would run on {framework!r}."
        )
    # keras.distribution exports DataParallel and ModelParallel, not their base class
    is_distribution = all(
        callable(getattr(distribution, name, None))
        for name in ("scope", "get_variable_layout", "get_data_layout")
    )
    if not is_distribution:
        raise TypeError(
            f"from_pretrained: `distribution` must be a keras.distribution.Distribution "
            f"(e.g. multiattn.distributed.model_parallel(mesh)); received "
            f"{type(distribution).__name__}."
        )


def _scope(distribution: Any) -> Any:
    """``distribution.scope()``, or a scope that does nothing."""
    return contextlib.nullcontext() if distribution is None else distribution.scope()


@contextlib.contextmanager
def _sharded_assignment(distribution: Any) -> Iterator[None]:
    """Around the assignment of a distributed model's weights: each NumPy tensor becomes
    a JAX array on the host's CPU device (not an accelerator's), from which
    ``variable.assign`` places each device's slice onto that device. Without a
    distribution, or without a CPU device in the process (``JAX_PLATFORMS`` without
    ``cpu``; then it is the first accelerator), nothing changes."""
    if distribution is None:
        yield
        return
    import jax

    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend in this process
        yield
        return
    with jax.default_device(host):
        yield


def _half_kernels(framework: str) -> bool:
    """Whether ``framework`` (on its current device) computes float16 and bfloat16:
    Paddle's CPU kernels do not (no half-precision ``add``); the Keras backends do."""
    if framework != "paddle":
        return True
    import paddle

    return not paddle.get_device().startswith("cpu")


def _kept_dtype(dtype: str, framework: str) -> str:
    """The checkpoint's ``dtype``, upcast to float32 for half precision where it is not
    computed (`_half_kernels`) or slow: the NumPy backend (NumPy has no fast
    half-precision matrix products) and Paddle on a CPU."""
    upcast = framework == "numpy" or not _half_kernels(framework)
    return "float32" if dtype in HALF and upcast else dtype


def _cast(weights: Mapping, dtype: str) -> Lazy:
    """``weights`` cast to ``dtype`` (NumPy's rounding to nearest even) as each is read."""
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    return Lazy(weights, lambda name: np.asarray(weights[name]).astype(target, copy=False))
