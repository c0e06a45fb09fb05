"""Worker: whole model families loaded sharded (``from_pretrained(path, distribution=...)``)
on 8 host devices (JAX), against the same checkpoints on one device.

Run by ``tests/test_distributed_jax.py`` in a process of its own with
``KERAS_BACKEND=jax``, ``JAX_PLATFORMS=cpu``, ``JAX_ENABLE_X64=1`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Tiny random transformers models
(Llama and Mistral with grouped key/value heads, Qwen2, GPT-2, BERT with a vocabulary the
model axis does not divide, ViT, T5) are saved with ``save_pretrained`` into a temporary
folder, then each is loaded twice: on one device and under
`multiattn.distributed.model_parallel` on a (2 batch x 4 model) mesh (Mistral on 4 x 2).
Prints one JSON object: per family the max relative error of the outputs, whether the
greedy tokens agree, the weights' shardings, the bytes of weights on each device; the KV
cache's sharding; one training step's loss and gradients under data x model parallelism;
Llama in float64; the refusals.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

# isort: off
# torch (and its triton) before anything may load TensorFlow (see tests/_support.py)
import torch
import transformers

# isort: on
import jax
import keras
import numpy as np
from keras.distribution import DeviceMesh, distribute_tensor, list_devices
from multiattn.conformance.families import redraw

from multiattn.distributed import model_parallel
from multiattn.hf.pretrained import _check_distribution, from_pretrained

VOCAB, CONTEXT, NEW = 64, 40, 20
LLAMA = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
         "max_position_embeddings": CONTEXT}  # fmt: skip
#: family -> (transformers model, mesh shape (batch, model)); the key/value heads: Llama 2
#: on a model axis of 4 (replicated), Qwen2 4 of 8 query heads on 4 (sharded), Mistral and
#: Phi-3 2 on 2 (sharded), Falcon 1 on 4 (replicated); BERT's vocabulary of 66 does not divide by 4 (split by width)
CASES = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), (2, 4)),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **{**LLAMA, "num_attention_heads": 8, "num_key_value_heads": 4})), (2, 4)),
    "mistral": (lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**LLAMA, sliding_window=5)), (4, 2)),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=CONTEXT)), (2, 4)),
    "bert": (lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=66, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=16)), (2, 4)),
    "vit": (lambda: transformers.ViTModel(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48)), (2, 4)),
    # issue 50: Phi-3's fused qkv_proj and gate_up_proj (split before they are placed),
    # 2 kv heads on 2 (sharded); Falcon-7B's one kv head on 4 (replicated), parallel
    # branches on one shared norm
    "phi3": (lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **LLAMA, pad_token_id=None, bos_token_id=1, eos_token_id=2)), (4, 2)),
    "falcon": (lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ffn_hidden_size=48, max_position_embeddings=CONTEXT)), (2, 4)),
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=48,
        decoder_start_token_id=0)), (2, 4)),
}  # fmt: skip
CAUSAL = ("llama", "qwen2", "mistral", "gpt2", "phi3", "falcon")


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def left_padded_batch(vocab: int, length: int = 9, pads: int = 3):
    """Two prompts, the second left-padded with ``pads`` pads (as tests/_hf_models.py)."""
    ids = np.random.default_rng(1).integers(1, vocab, (2, length))
    mask = np.ones((2, length), np.int64)
    mask[1, :pads] = 0
    ids[1, :pads] = 0
    return ids, mask


def inputs_of(case: str) -> dict:
    ids, mask = left_padded_batch(66 if case == "bert" else VOCAB)
    if case == "vit":
        return {"pixel_values": np.random.default_rng(2).standard_normal((2, 3, 16, 16))}
    if case == "t5":
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :5] * 0 + 1}
    return {"input_ids": ids, "attention_mask": mask}


def real_rows(case: str, name: str, value, inputs) -> np.ndarray:
    """The rows of real tokens (pad rows carry no meaning); T5's decoder has no pads."""
    value = np.asarray(value, np.float64)
    decoder = case == "t5" and name != "encoder_last_hidden_state"
    if "attention_mask" not in inputs or decoder or value.ndim != 3:
        return value
    return value[np.asarray(inputs["attention_mask"], bool)]


def spec_axes(sharding, rank: int) -> list:
    spec = list(sharding.spec) + [None] * (rank - len(sharding.spec))
    return [a if a is None or isinstance(a, str) else list(a) for a in spec]


def weights_report(layer, mesh_shape) -> dict:
    """Each weight's spec, shard shape and device count; the bytes device 0 holds, and
    those the specs say it should (each weight's bytes over the sizes of its split axes)."""
    sizes = dict(zip(("batch", "model"), mesh_shape))
    device0 = jax.devices()[0]
    specs, held, expected, total = {}, 0, 0, 0
    for v in layer.weights:
        value = v.value
        spec = spec_axes(value.sharding, len(v.shape))
        specs[v.path.split("/", 1)[1]] = spec
        assert len(value.sharding.device_set) == 8, v.path
        held += sum(s.data.nbytes for s in value.addressable_shards if s.device == device0)
        split = int(np.prod([sizes[a] for a in spec if a is not None]))
        expected += value.nbytes // split
        total += value.nbytes
    return {"specs": specs, "device0_bytes": held, "expected_device0_bytes": expected,
            "total_bytes": total}  # fmt: skip


def family(case: str, path: str) -> dict:
    _, mesh_shape = CASES[case]
    mesh = DeviceMesh(mesh_shape, ("batch", "model"), list_devices())
    dist = model_parallel(mesh)
    one = from_pretrained(path)
    sharded = from_pretrained(path, distribution=dist)
    inputs = inputs_of(case)
    want, got = one(**inputs), sharded(**inputs)
    out = {
        "errors": {
            k: rel_err(real_rows(case, k, got[k], inputs), real_rows(case, k, want[k], inputs))
            for k in want
        },
        "mesh": list(mesh_shape),
        **weights_report(sharded.layer, mesh_shape),
    }
    if case in CAUSAL or case == "t5":
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        tokens_one = np.asarray(one.generate(ids, mask, max_new_tokens=NEW))
        tokens = np.asarray(sharded.generate(ids, mask, max_new_tokens=NEW))
        out["tokens_equal"] = bool(np.array_equal(tokens, tokens_one))
        out["new_tokens"] = int(tokens.shape[1] - (0 if case == "t5" else ids.shape[1]))
        layer = sharded.layer
        blocks = layer.decoder_blocks if case == "t5" else layer.blocks
        with dist.scope():
            cache = blocks[0].self_attention.init_cache(2, 8)
        out["cache_spec"] = spec_axes(cache[0].sharding, 4)
        out["kv_heads"] = int(cache[0].shape[1])
    return out


def train_step(path: str) -> dict:
    """One ``jax.value_and_grad`` of the next-token cross-entropy of the loaded Llama
    (mean over real positions), the batch split over the batch axis and the weights over
    the model axis of a 2 x 4 mesh, against one device."""
    ids, mask = left_padded_batch(VOCAB)
    ids = np.concatenate([ids, ids[::-1]])  # a batch of 4: 2 rows per replica
    mask = np.concatenate([mask, mask[::-1]])
    mesh = DeviceMesh((2, 4), ("batch", "model"), list_devices())
    dist = model_parallel(mesh)

    def run(model, distribution=None):
        layer = model.layer
        x, m = ids.astype("int32"), mask.astype("int32")
        if distribution is not None:
            x = distribute_tensor(x, distribution.get_data_layout(x.shape))
            m = distribute_tensor(m, distribution.get_data_layout(m.shape))
        trainable = [v.value for v in layer.trainable_variables]
        fixed = [v.value for v in layer.non_trainable_variables]

        @jax.jit
        def step(trainable, x, m):
            def loss(trainable):
                out, _ = layer.stateless_call(trainable, fixed, x, attention_mask=m)
                logp = jax.nn.log_softmax(out["logits"][:, :-1].astype("float32"), axis=-1)
                picked = jax.numpy.take_along_axis(logp, x[:, 1:, None], axis=-1)[..., 0]
                w = m[:, 1:] * m[:, :-1]
                return -(picked * w).sum() / w.sum()

            return jax.value_and_grad(loss)(trainable)

        value, grads = step(trainable, x, m)
        return (
            float(value),
            [np.asarray(g) for g in grads],
            [str(getattr(g.sharding, "spec", "")) for g in grads],
        )

    loss0, grads0, _ = run(from_pretrained(path))
    loss1, grads1, specs = run(from_pretrained(path, distribution=dist), dist)
    return {
        "loss": abs(loss1 - loss0) / abs(loss0),
        "grads": max(rel_err(a, b) for a, b in zip(grads1, grads0)),
        "sharded_grads": sum("model" in s for s in specs),
        "n_grads": len(specs),
    }


def float64(path: str) -> dict:
    """Llama in float64: logits and tokens, sharded on 2 x 4 against one device."""
    dist = model_parallel(DeviceMesh((2, 4), ("batch", "model"), list_devices()))
    one = from_pretrained(path, dtype="float64")
    sharded = from_pretrained(path, dtype="float64", distribution=dist)
    inputs = inputs_of("llama")
    rows = np.asarray(inputs["attention_mask"], bool)
    logits = np.asarray(sharded(**inputs)["logits"])
    return {
        "dtype": str(logits.dtype),
        "logits": rel_err(logits[rows], np.asarray(one(**inputs)["logits"])[rows]),
    }


def refusals(path: str) -> dict:
    """The errors' messages: a mesh whose model axis does not divide the query heads, a
    distribution that is not one, a distribution on another backend."""
    out = {}
    mesh = DeviceMesh((1, 8), ("batch", "model"), list_devices())
    for name, call in (
        ("heads", lambda: from_pretrained(path, distribution=model_parallel(mesh))),
        ("not_a_distribution", lambda: from_pretrained(path, distribution=mesh)),
        ("backend", lambda: _check_distribution(model_parallel(mesh), "torch")),
    ):
        try:
            call()
            out[name] = None
        except (ValueError, TypeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def main() -> dict:
    assert keras.backend.backend() == "jax" and len(jax.devices()) == 8
    report = {"devices": len(jax.devices()), "x64": bool(jax.config.jax_enable_x64)}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for case, (make, _) in CASES.items():
            torch.manual_seed(0)
            paths[case] = os.path.join(tmp, case)
            redraw(make()).save_pretrained(paths[case])
        report["families"] = {}
        for case in CASES:
            start = time.perf_counter()
            report["families"][case] = family(case, paths[case])
            print(case, f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
        report["train_step"] = train_step(paths["llama"])
        report["float64"] = float64(paths["llama"])
        report["refusals"] = refusals(paths["llama"])
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
