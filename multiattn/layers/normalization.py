"""Layer normalisation computed by the core."""

from __future__ import annotations

import keras

from ..ops.normalization import layer_norm

__all__ = ["LayerNormalization"]


@keras.saving.register_keras_serializable(package="multiattn")
class LayerNormalization(keras.layers.LayerNormalization):
    """``keras.layers.LayerNormalization`` computed by `multiattn.ops.layer_norm`.

    Same arguments, weights (``gamma``, ``beta``) and config as the Keras layer. For the
    usual normalisation over the last axis it keeps float64 exact on every backend
    (Keras computes float64 in float32 outside TensorFlow); other axes and RMS scaling
    fall back to the Keras implementation.

    Call arguments:
        inputs: ``(..., width)``.

    Returns:
        The normalised inputs in the layer's compute dtype.
    """

    def call(self, inputs):
        axes = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
        rank = len(inputs.shape)
        if self.rms_scaling or [a % rank for a in axes] != [rank - 1]:
            return super().call(inputs)
        out = layer_norm(
            inputs,
            self.gamma if self.scale else None,
            self.beta if self.center else None,
            epsilon=self.epsilon,
        )
        return keras.ops.cast(out, self.compute_dtype)
