"""``paddle.nn.Layer`` twins of the `multiattn.models` families, from the same definitions.

* `BertModel` and `BertSentenceEncoder` (`multiattn.models.bert`), `ViTModel`
  (`multiattn.models.vit`), `CausalLM` (`multiattn.models.causal_lm`: GPT-2, Llama,
  Qwen2, Mistral and the other decoder families, with ``generate``), `ModernBertModel`
  (`multiattn.models.modernbert`),
  `T5ForConditionalGeneration` (`multiattn.models.t5`), `BartForConditionalGeneration`
  (`multiattn.models.bart`);
  their ``generate`` is `multiattn.decoding`'s, through its eager strategy
  (`multiattn.decoding.EagerLoop`: a Python loop over the eager step, on Paddle);
* `from_checkpoint`: a sentence-transformers BERT folder as a `BertSentenceEncoder` (what
  `multiattn.models.bert.from_checkpoint` does on Keras), and `set_bert_weights`.

`multiattn.models.from_pretrained(path, framework="paddle")` loads Hugging Face folders
into these. Calls take Paddle tensors or NumPy arrays and return Paddle tensors; the
parameters are Paddle parameters (see `multiattn.paddle.layers`).
"""

from __future__ import annotations

from ..models import bart as _bart
from ..models import bert as _bert
from ..models import causal_lm as _causal_lm
from ..models import modernbert as _modernbert
from ..models import t5 as _t5
from ..models import vit as _vit
from . import layers as _layers  # noqa: F401  (the layer twins first: the models build them)
from ._twin import definition, twin

__all__ = [
    "BartConfig",
    "BartForConditionalGeneration",
    "BertModel",
    "BertSentenceEncoder",
    "CausalLM",
    "CausalLMConfig",
    "ModernBertConfig",
    "ModernBertModel",
    "T5Config",
    "T5ForConditionalGeneration",
    "ViTModel",
    "from_checkpoint",
    "set_bert_weights",
]

BertModel = twin(_bert.BertModel)
BertSentenceEncoder = twin(_bert.BertSentenceEncoder)
ViTModel = twin(_vit.ViTModel)
CausalLM = twin(_causal_lm.CausalLM)
CausalLMConfig = _causal_lm.CausalLMConfig  # a plain dataclass: the same on Keras
ModernBertModel = twin(_modernbert.ModernBertModel)
ModernBertConfig = _modernbert.ModernBertConfig  # a plain dataclass: the same on Keras
T5Attention = twin(_t5.T5Attention)
T5Block = twin(_t5.T5Block)
T5ForConditionalGeneration = twin(_t5.T5ForConditionalGeneration)
T5Config = _t5.T5Config  # a plain dataclass: the same on Keras
BartForConditionalGeneration = twin(_bart.BartForConditionalGeneration)
BartConfig = _bart.BartConfig  # a plain dataclass: the same on Keras
from_checkpoint = definition(_bert.from_checkpoint)
set_bert_weights = definition(_bert.set_bert_weights)
