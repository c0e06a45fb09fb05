"""Hugging Face checkpoints: reading, checking and writing their folders (no framework).

* `multiattn.hf.pretrained`: `from_pretrained` (also ``multiattn.models.from_pretrained``)
  reads a folder written by transformers' ``save_pretrained`` into the models of
  `multiattn.models`; `PretrainedModel.save_pretrained` writes one transformers reads back.
* `multiattn.hf.files`: the folder's files (``config.json``, safetensors, shards, the
  optional pickle), checked tensor by tensor.
* `multiattn.hf.families`: the families by ``model_type``, each a table of config options
  and tensor names (`multiattn.hf.causal_lm`: GPT-2, Llama, Qwen2, Mistral;
  `multiattn.hf.t5`; BERT and ViT there), on `multiattn.hf._common`'s `Entry`/`Family`.
* `multiattn.hf.bert_weights`: BERT checkpoints (and their tokenizer) as the neutral
  weight names of `multiattn.port`.

Submodules are imported on use; importing them imports no framework.
"""
