"""The BERT sentence encoder of `multiattn.models.bert` on Paddle tensors.

Keras has no Paddle backend, so the Keras layers cannot run here. This variant keeps its
parameters in Paddle's own modules (``paddle.nn.Embedding``, ``paddle.nn.LayerNorm`` and one
``paddle.nn.TransformerEncoderLayer`` per block, loaded through `multiattn.port.set_weights`)
and computes with the multiattn core on Paddle tensors, through the Paddle ops namespace
(`multiattn.backends._paddle_ops`): `multiattn.ops.split_heads`,
`multiattn.ops.scaled_dot_product_attention`, `multiattn.ops.merge_heads` and
`multiattn.ops.layer_norm`. Only the projections (``x @ W + b``), the GELU and the pooling
are written here with Paddle operations. Paddle's own attention is never called.

Importing this module imports paddle first (importing paddle after TensorFlow crashes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# isort: off
# First: checks that TensorFlow is not loaded, imports paddle, registers the namespace.
from ..backends import paddle as _paddle_adapter  # noqa: F401

# isort: on
import numpy as np
import paddle

from .. import ops as core
from .checkpoint import BertConfig, SentenceOptions, layer_weights, load_checkpoint

__all__ = ["PaddleBertSentenceEncoder", "from_checkpoint"]


class PaddleBertSentenceEncoder(paddle.nn.Layer):
    """BERT encoder with mean pooling on Paddle: token ids -> one embedding per sentence.

    Args:
        config: the encoder's sizes (`multiattn.models.checkpoint.BertConfig`).
        normalize: L2-normalise the pooled embedding.

    Call arguments (``forward``):
        token_ids: int ``(batch, seq)`` (paddle.Tensor or NumPy).
        attention_mask: int or bool ``(batch, seq)``; non-zero = real token, 0 = padding
            (exactly zero attention weight, left out of the mean).
        token_type_ids: int ``(batch, seq)``, default zeros.

    Returns:
        ``(batch, hidden_size)`` float32 paddle.Tensor (the parameters' dtype).
    """

    def __init__(self, config: BertConfig, normalize: bool = True):
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(
                f"PaddleBertSentenceEncoder: `config` must be a BertConfig; received {config!r}."
            )
        if not isinstance(normalize, bool):
            raise TypeError(
                f"PaddleBertSentenceEncoder: `normalize` must be a bool; received {normalize!r}."
            )
        self.config, self.normalize = config, normalize
        e = config.hidden_size
        self.word = paddle.nn.Embedding(config.vocab_size, e)
        self.position = paddle.nn.Embedding(config.max_positions, e)
        self.token_type = paddle.nn.Embedding(config.type_vocab_size, e)
        self.embedding_norm = paddle.nn.LayerNorm(e, epsilon=config.epsilon)
        self.blocks = paddle.nn.LayerList(
            paddle.nn.TransformerEncoderLayer(
                e,
                config.num_heads,
                config.intermediate_size,
                dropout=0.0,
                activation="gelu",
                normalize_before=False,
                layer_norm_eps=config.epsilon,
            )
            for _ in range(config.num_layers)
        )

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign neutral BERT weights (`multiattn.models.checkpoint` names): the embeddings
        directly, every block through `multiattn.port.set_weights`."""
        from ..port import set_weights

        for name, param in (
            ("embeddings/word", self.word.weight),
            ("embeddings/position", self.position.weight),
            ("embeddings/token_type", self.token_type.weight),
            ("embeddings/norm/gamma", self.embedding_norm.weight),
            ("embeddings/norm/beta", self.embedding_norm.bias),
        ):
            if name not in weights:
                raise ValueError(f"PaddleBertSentenceEncoder.set_weights: no {name!r}.")
            value = np.asarray(weights[name])
            if value.shape != tuple(param.shape):
                raise ValueError(
                    f"PaddleBertSentenceEncoder.set_weights: {name!r} must have shape "
                    f"{tuple(param.shape)}; received {value.shape}."
                )
            param.set_value(value.astype(np.float32))
        for i, block in enumerate(self.blocks):
            set_weights(block, layer_weights(weights, i))

    def _block(self, block: Any, x: paddle.Tensor, keep: paddle.Tensor) -> paddle.Tensor:
        attn, h = block.self_attn, self.config.num_heads
        q, k, v = (
            core.split_heads(paddle.matmul(x, proj.weight) + proj.bias, h)  # (B, H, T, D)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        heads = core.scaled_dot_product_attention(q, k, v, mask=keep)
        mixed = paddle.matmul(core.merge_heads(heads), attn.out_proj.weight) + attn.out_proj.bias
        eps = self.config.epsilon
        x = core.layer_norm(x + mixed, block.norm1.weight, block.norm1.bias, epsilon=eps)
        hidden = paddle.nn.functional.gelu(
            paddle.matmul(x, block.linear1.weight) + block.linear1.bias, approximate=False
        )
        ffn = paddle.matmul(hidden, block.linear2.weight) + block.linear2.bias
        return core.layer_norm(x + ffn, block.norm2.weight, block.norm2.bias, epsilon=eps)

    def forward(self, token_ids, attention_mask, token_type_ids=None) -> paddle.Tensor:
        where = "PaddleBertSentenceEncoder"
        token_ids = paddle.to_tensor(token_ids).astype("int64")
        attention_mask = paddle.to_tensor(attention_mask)
        if token_ids.ndim != 2 or tuple(attention_mask.shape) != tuple(token_ids.shape):
            raise ValueError(
                f"{where}: `token_ids` and `attention_mask` must both be (batch, seq); received "
                f"{tuple(token_ids.shape)} and {tuple(attention_mask.shape)}."
            )
        seq = int(token_ids.shape[1])
        if seq > self.config.max_positions:
            raise ValueError(
                f"{where}: sequences may hold at most max_positions={self.config.max_positions}"
                f" tokens; received token_ids of shape {tuple(token_ids.shape)}."
            )
        if token_type_ids is None:
            token_type_ids = paddle.zeros_like(token_ids)
        token_type_ids = paddle.to_tensor(token_type_ids).astype("int64")
        positions = paddle.arange(seq, dtype="int64").unsqueeze(0)
        x = self.word(token_ids) + self.token_type(token_type_ids)  # BERT's order
        x = x + self.position(positions)
        x = core.layer_norm(
            x, self.embedding_norm.weight, self.embedding_norm.bias, epsilon=self.config.epsilon
        )
        real = attention_mask != 0  # (B, T), True = real token
        keep = real.unsqueeze([1, 2])  # (B, 1, 1, T): padded keys are never attended
        for block in self.blocks:
            x = self._block(block, x, keep)
        weight = real.astype(x.dtype).unsqueeze(-1)
        pooled = (x * weight).sum(axis=1) / paddle.clip(weight.sum(axis=1), min=1e-9)
        if not self.normalize:
            return pooled
        norm = paddle.sqrt((pooled * pooled).sum(axis=-1, keepdim=True))
        return pooled / paddle.clip(norm, min=1e-12)


def from_checkpoint(model_dir: str | Path) -> tuple[PaddleBertSentenceEncoder, SentenceOptions]:
    """A `PaddleBertSentenceEncoder` (in eval mode) with a sentence-transformers BERT
    directory's weights. Returns ``(encoder, options)``."""
    config, options, weights = load_checkpoint(model_dir)
    encoder = PaddleBertSentenceEncoder(config, normalize=options.normalize)
    encoder.set_weights(weights)
    encoder.eval()
    return encoder, options
