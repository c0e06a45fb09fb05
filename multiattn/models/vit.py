"""The Vision Transformer base model built from multiattn layers (Keras jax, torch,
tensorflow, numpy).

``ViTModel`` computes what transformers' ``ViTModel`` computes in inference: the image is
cut into non-overlapping patches, each projected to ``hidden_size`` (a convolution with
stride = kernel = patch, written as one projection of the flattened patches), a learned
CLS vector is put in front, learned position embeddings are added, then pre-LayerNorm
`multiattn.layers.TransformerEncoderLayer` blocks (``norm_first=True``, exact GELU), a final
LayerNormalization and optionally a pooler (a projection and an activation applied to the
CLS token's state).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .._checks import check_positive_int
from ..hf.families import POOLER_ACTIVATIONS as _POOLER_ACTIVATIONS
from ..layers import LayerNormalization, TransformerEncoderLayer
from ..layers._base import keras_default
from .bert import assign_weight, pooler_activation

__all__ = ["ViTModel"]


def _pair(where: str, name: str, value: Any) -> tuple[int, int]:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return tuple(check_positive_int(where, name, v) for v in value)
    v = check_positive_int(where, name, value)
    return (v, v)


@keras.saving.register_keras_serializable(package="multiattn")
class ViTModel(keras.layers.Layer):
    """Vision Transformer encoder: images -> patch states and a pooled vector.

    Sublayers and weights: ``patch`` (``EinsumDense``, kernel ``(channels*ph*pw, hidden)``,
    the flattened patch in channel, row, column order), ``cls`` ``(1, hidden)``,
    ``position_embeddings`` ``(patches + 1, hidden)``, ``blocks`` (``num_layers``
    pre-LayerNorm `multiattn.layers.TransformerEncoderLayer`, no dropout), ``final_norm``
    and, with ``add_pooling_layer``, ``pooler`` (``EinsumDense`` ``(hidden,
    pooler_output_size)`` with ``pooler_act``).

    Args:
        hidden_size, num_layers, num_heads, intermediate_size: encoder sizes
            (``hidden_size`` divisible by ``num_heads``).
        image_size, patch_size: int or ``(height, width)``; the image must be a whole
            number of patches.
        num_channels: image channels.
        epsilon: LayerNormalization epsilon (ViT: 1e-12).
        activation: feed-forward activation (``"gelu"``: exact GELU).
        add_pooling_layer, pooler_output_size, pooler_act: the pooler (``pooler_act`` one
            of ``tanh``, ``relu``, ``gelu``, ``sigmoid``, ``linear``).

    Call arguments:
        pixel_values: float ``(batch, num_channels, height, width)`` (channels first, as
            transformers), height and width equal to ``image_size``.

    Returns:
        ``{"last_hidden_state": (batch, patches + 1, hidden), "pooler_output": (batch,
        pooler_output_size)}`` (``pooler_output`` only with ``add_pooling_layer``), in the
        layer's compute dtype; the input is cast to it.
    """

    def __init__(
        self,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        intermediate_size: int,
        image_size: Any = 224,
        patch_size: Any = 16,
        num_channels: int = 3,
        epsilon: float = 1e-12,
        activation: str = "gelu",
        add_pooling_layer: bool = True,
        pooler_output_size: int | None = None,
        pooler_act: str = "tanh",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        where = "ViTModel"
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("intermediate_size", intermediate_size),
            ("num_channels", num_channels),
        ):
            setattr(self, name, check_positive_int(where, name, value))
        self.image_size = _pair(where, "image_size", image_size)
        self.patch_size = _pair(where, "patch_size", patch_size)
        if any(i % p for i, p in zip(self.image_size, self.patch_size)):
            raise ValueError(
                f"{where}: `image_size` {self.image_size} must be a multiple of `patch_size` "
                f"{self.patch_size}."
            )
        if not isinstance(add_pooling_layer, bool):
            raise TypeError(
                f"{where}: `add_pooling_layer` must be a bool; received {add_pooling_layer!r}."
            )
        if pooler_act not in _POOLER_ACTIVATIONS:
            raise ValueError(
                f"{where}: `pooler_act` must be one of {', '.join(_POOLER_ACTIVATIONS)}; "
                f"received {pooler_act!r}."
            )
        self.pooler_output_size = check_positive_int(
            where, "pooler_output_size", pooler_output_size or hidden_size
        )
        self.epsilon, self.activation = epsilon, activation
        self.add_pooling_layer, self.pooler_act = add_pooling_layer, pooler_act
        self._make_sublayers()

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row."""
        return tuple(i // p for i, p in zip(self.image_size, self.patch_size))

    def _make_sublayers(self) -> None:
        dtype, e = self.dtype_policy, self.hidden_size
        self.patch = keras.layers.EinsumDense(
            "bnk,ke->bne",
            (None, e),
            bias_axes="e",
            name="patch",
            dtype=dtype,
            kernel_initializer=keras_default("glorot_uniform"),
        )
        self.blocks = [
            TransformerEncoderLayer(
                e,
                self.num_heads,
                self.intermediate_size,
                rate=0.0,
                norm_first=True,
                epsilon=self.epsilon,
                activation=self.activation,
                name=f"layer_{i}",
                dtype=dtype,
            )
            for i in range(self.num_layers)
        ]
        self.final_norm = LayerNormalization(epsilon=self.epsilon, name="final_norm", dtype=dtype)
        self.pooler = None
        if self.add_pooling_layer:
            self.pooler = keras.layers.EinsumDense(
                "be,ep->bp",
                (self.pooler_output_size,),
                bias_axes="p",
                name="pooler",
                dtype=dtype,
                kernel_initializer=keras_default("glorot_uniform"),
            )

    def build(self, pixel_values_shape=None):
        e = self.hidden_size
        (ph, pw), (gh, gw) = self.patch_size, self.grid
        self.cls = self.add_weight(shape=(1, e), initializer="zeros", name="cls")
        self.position_embeddings = self.add_weight(
            shape=(gh * gw + 1, e), initializer="zeros", name="position_embeddings"
        )
        self.patch.build((None, gh * gw, self.num_channels * ph * pw))
        for block in self.blocks:
            block.build((None, None, e))
        self.final_norm.build((None, None, e))
        if self.pooler is not None:
            self.pooler.build((None, e))

    def _patches(self, pixel_values):
        """``(batch, C, H, W)`` -> ``(batch, patches, C*ph*pw)``, patches row by row."""
        ops = keras.ops
        (ph, pw), (gh, gw) = self.patch_size, self.grid
        x = ops.reshape(pixel_values, (-1, self.num_channels, gh, ph, gw, pw))
        x = ops.transpose(x, (0, 2, 4, 1, 3, 5))  # (batch, gh, gw, C, ph, pw)
        return ops.reshape(x, (-1, gh * gw, self.num_channels * ph * pw))

    def call(self, pixel_values):
        ops = keras.ops
        want = (self.num_channels, *self.image_size)
        if len(pixel_values.shape) != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ValueError(
                f"ViTModel: `pixel_values` must have shape (batch, {want[0]}, {want[1]}, "
                f"{want[2]}) (channels first); received {tuple(pixel_values.shape)}."
            )
        x = self.patch(self._patches(ops.cast(pixel_values, self.compute_dtype)))
        cls = ops.broadcast_to(ops.expand_dims(self.cls, 0), (ops.shape(x)[0], 1, self.hidden_size))
        x = ops.concatenate([ops.cast(cls, x.dtype), x], axis=1)
        x = x + ops.cast(self.position_embeddings, x.dtype)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        out = {"last_hidden_state": x}
        if self.pooler is not None:
            out["pooler_output"] = pooler_activation(self.pooler_act)(self.pooler(x[:, 0]))
        return out

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "image_size": list(self.image_size),
            "patch_size": list(self.patch_size),
            "num_channels": self.num_channels,
            "epsilon": self.epsilon,
            "activation": self.activation,
            "add_pooling_layer": self.add_pooling_layer,
            "pooler_output_size": self.pooler_output_size,
            "pooler_act": self.pooler_act,
        }

    # --- the protocol of `multiattn.hf.pretrained` --------------------------------

    @classmethod
    def from_sizes(cls, sizes: dict, pooler: bool, dtype: Any = None) -> ViTModel:
        """A built `ViTModel` from `multiattn.hf.families` sizes."""
        keys = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "image_size",
                "patch_size", "num_channels", "epsilon", "pooler_output_size", "pooler_act")  # fmt: skip
        model = cls(**{k: sizes[k] for k in keys}, add_pooling_layer=pooler, dtype=dtype)
        model.build()
        return model

    def _variables(self) -> dict[str, Any]:
        out = {
            "embeddings/cls": self.cls,
            "embeddings/position": self.position_embeddings,
            "embeddings/patch/kernel": self.patch.kernel,
            "embeddings/patch/bias": self.patch.bias,
            "final_norm/gamma": self.final_norm.gamma,
            "final_norm/beta": self.final_norm.beta,
        }
        if self.pooler is not None:
            out["pooler/kernel"], out["pooler/bias"] = self.pooler.kernel, self.pooler.bias
        return out

    def set_neutral_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign neutral weights (`multiattn.hf.families` ViT names); the blocks
        through `multiattn.port.set_weights`. A missing ``layer_<i>/attention/*/bias``
        (``qkv_bias=False``) is zero."""
        from ..port import set_weights

        for name, variable in self._variables().items():
            assign_weight(name, variable, weights, "ViTModel")
        d = self.hidden_size // self.num_heads
        for i, block in enumerate(self.blocks):
            prefix = f"layer_{i}/"
            sub = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
            for part in ("query", "key", "value"):
                sub.setdefault(f"attention/{part}/bias", np.zeros((self.num_heads, d), np.float32))
            set_weights(block, sub)

    def neutral_weights(self) -> dict[str, np.ndarray]:
        """The neutral weights as NumPy arrays in the variables' dtype."""
        from ..port import get_weights

        out = {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in self._variables().items()}
        for i, block in enumerate(self.blocks):
            out.update({f"layer_{i}/{k}": v for k, v in get_weights(block).weights.items()})
        return out
