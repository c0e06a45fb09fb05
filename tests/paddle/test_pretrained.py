"""Hugging Face checkpoints on Paddle: ``from_pretrained(path, framework="paddle")`` builds
the Paddle twins of the families' models (`multiattn.paddle.models`). Tiny random
transformers models are saved with ``save_pretrained``, loaded, and compared with
transformers run in float64 (outputs, greedy tokens), and written back bit for bit."""

from __future__ import annotations

import os

import numpy as np
import paddle
import pytest
from _paddle_support import rel_err

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_models import build, left_padded_batch  # noqa: E402

from multiattn.hf.pretrained import PretrainedCausalLM, from_pretrained  # noqa: E402

VOCAB, CONTEXT = 64, 40
LLAMA = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
         "max_position_embeddings": CONTEXT}  # fmt: skip
CAUSAL = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                n_positions=CONTEXT)),
    "llama3": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **LLAMA, rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA)),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**LLAMA, sliding_window=5)),
}  # fmt: skip
ENCODERS = {
    "bert": lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=CONTEXT)),
    "vit": lambda: transformers.ViTModel(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48)),
}  # fmt: skip
T5 = lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(  # noqa: E731
    vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64,
    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))  # fmt: skip
# Relative error against transformers in float64 (its rotary angles are float32).
TOL = {"float32": 1e-5, "float64": 1e-6}


_build = build


def _batch(length: int = 9, pads: int = 3):
    return left_padded_batch(VOCAB, length, pads)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", sorted(CAUSAL))
def test_causal_lm_logits_and_greedy_tokens_match_transformers(tmp_path, case, dtype):
    hf = _build(CAUSAL[case], tmp_path / "m")
    model = from_pretrained(tmp_path / "m", framework="paddle", dtype=dtype)
    assert isinstance(model, PretrainedCausalLM) and isinstance(model.layer, paddle.nn.Layer)
    assert not model.layer.training and model.dtype == dtype
    ids, mask = _batch()
    out = model(input_ids=ids, attention_mask=mask)
    assert isinstance(out["logits"], paddle.Tensor)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(positions)).logits.numpy()  # fmt: skip
    real = mask.astype(bool)
    assert rel_err(out["logits"].numpy()[real], want[real]) <= TOL[dtype]
    if dtype == "float64":
        with torch.no_grad():
            tokens = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                 do_sample=False, max_new_tokens=20, pad_token_id=0,
                                 eos_token_id=None).numpy()  # fmt: skip
        got = model.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
        np.testing.assert_array_equal(got, tokens)


@pytest.mark.parametrize("case", sorted(ENCODERS))
def test_encoders_match_transformers_and_save_back_bit_for_bit(tmp_path, case):
    hf = _build(ENCODERS[case], tmp_path / "m")
    model = from_pretrained(tmp_path / "m", framework="paddle", dtype="float64")
    if case == "bert":
        ids, mask = _batch()
        inputs = {"input_ids": ids, "attention_mask": mask}
        real = mask.astype(bool)
    else:
        inputs = {"pixel_values": np.random.default_rng(2).standard_normal((2, 3, 8, 8))}
        real = np.ones((2, 5), bool)
    out = model(**inputs)
    with torch.no_grad():
        want = hf(**{k: torch.tensor(v) for k, v in inputs.items()})
    got = out["last_hidden_state"].numpy()
    assert rel_err(got[real], want.last_hidden_state.numpy()[real]) <= 1e-12
    assert rel_err(out["pooler_output"].numpy(), want.pooler_output.numpy()) <= 1e-12
    model.save_pretrained(tmp_path / "back")
    back = type(hf).from_pretrained(tmp_path / "back").state_dict()
    saved = type(hf).from_pretrained(tmp_path / "m").state_dict()
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name


def test_t5_logits_and_greedy_tokens_match_transformers(tmp_path):
    hf = _build(T5, tmp_path / "m")
    model = from_pretrained(tmp_path / "m", framework="paddle", dtype="float64")
    ids = np.random.default_rng(0).integers(2, VOCAB, (2, 7))
    mask = np.ones((2, 7), np.int64)
    mask[1, 5:] = 0
    decoder = np.random.default_rng(1).integers(2, VOCAB, (2, 4))
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  decoder_input_ids=torch.tensor(decoder))  # fmt: skip
        tokens = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             do_sample=False, max_new_tokens=10).numpy()  # fmt: skip
    # transformers computes T5's norm statistics in float32, even in a float64 model
    assert rel_err(out["logits"].numpy(), want.logits.numpy()) <= 1e-5
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10)
    np.testing.assert_array_equal(got, tokens)


_GENERATE_IN_A_PROCESS = """
import json, sys
import multiattn.paddle  # paddle first
import numpy as np
from multiattn.models import from_pretrained
ids, mask = (np.array(a) for a in json.loads(sys.argv[2]))
model = from_pretrained(sys.argv[1], framework="paddle")
print(json.dumps(model.generate(ids, attention_mask=mask, max_new_tokens=6).tolist()))
"""


@pytest.mark.parametrize("keras_backend", ["torch", "jax"])
def test_paddle_generate_whatever_keras_backend_is_chosen(tmp_path, keras_backend):
    """A Paddle model generates on Paddle also in a process whose Keras runs on another
    backend (the prompt and cache masks were made as that backend's tensors)."""
    import json
    import subprocess
    import sys

    _build(CAUSAL["llama3"], tmp_path / "m")
    ids, mask = _batch()
    want = from_pretrained(tmp_path / "m", framework="paddle").generate(
        ids, attention_mask=mask, max_new_tokens=6
    )
    env = {**os.environ, "KERAS_BACKEND": keras_backend}
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE_IN_A_PROCESS, str(tmp_path / "m"),
         json.dumps([ids.tolist(), mask.tolist()])],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_array_equal(np.array(json.loads(proc.stdout.splitlines()[-1])), want)


def test_paddle_models_decode_through_the_eager_strategy(tmp_path):
    """Paddle's models decode through `multiattn.decoding.EagerLoop` (the default there,
    and ``strategy="eager"``); the compiled and recorded strategies of the Keras backends
    are refused by name, and sampling is seeded as on Keras."""
    from multiattn.decoding import EagerLoop, Greedy, choose_strategy
    from multiattn.decoding.strategies import model_backend

    _build(CAUSAL["qwen2"], tmp_path / "m")
    model = from_pretrained(tmp_path / "m", framework="paddle")
    assert model_backend(model.layer) == "paddle"
    assert type(choose_strategy("paddle", Greedy())) is EagerLoop
    ids, mask = _batch()
    args = {"attention_mask": mask, "max_new_tokens": 5}
    want = model.generate(ids, **args)
    np.testing.assert_array_equal(model.generate(ids, **args, strategy="eager"), want)
    for name in ("compiled", "compiled_step", "traced"):
        with pytest.raises(ValueError, match=f"`strategy`='{name}'.*computes on paddle"):
            model.generate(ids, **args, strategy=name)
    sampled = model.generate(ids, **args, do_sample=True, top_k=4, seed=9)
    np.testing.assert_array_equal(model.generate(ids, **args, do_sample=True, top_k=4, seed=9),
                                  sampled)  # fmt: skip
    assert sampled.shape == (2, 14) and sampled.dtype == np.int64


@pytest.mark.parametrize("case", ["llama", "t5"])
def test_paddle_model_calls_refuse_ids_outside_the_vocabulary(tmp_path, case):
    build(CAUSAL["llama3"] if case == "llama" else T5, tmp_path / case)
    model = from_pretrained(tmp_path / case, framework="paddle")
    extra = {"decoder_input_ids": np.zeros((1, 2), np.int64)} if case == "t5" else {}
    model(input_ids=np.array([[1, 2, 3]]), **extra)
    for bad, named in [(np.array([[1, -1, 3]]), "received -1"),
                       (paddle.to_tensor([[1, VOCAB]]), f"received {VOCAB}"),
                       (np.array([[1, 2**32 + 5]]), "4294967301"),
                       (np.array([[1.0, 2.0]]), "integer")]:  # fmt: skip
        with pytest.raises(ValueError, match=named):
            model(input_ids=bad, **extra)
    with pytest.raises(ValueError, match=r"rows \[0\] hold none"):
        model.generate(np.array([[1, 2]]), attention_mask=np.zeros((1, 2)), max_new_tokens=1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_checkpoint_loads_upcast_on_paddle_cpu(tmp_path, dtype):
    """Paddle's CPU kernels have no half-precision arithmetic: ``dtype=None`` computes a
    float16 or bfloat16 checkpoint in float32 there (its rounded weights, exactly), and
    asking for the half dtype is refused up front."""
    torch.manual_seed(0)
    hf = CAUSAL["qwen2"]().to(getattr(torch, dtype)).eval()
    hf.save_pretrained(tmp_path)
    hf = hf.double()
    ids, mask = _batch()
    model = from_pretrained(tmp_path, framework="paddle")
    assert model.dtype == "float32"
    out = model(input_ids=ids, attention_mask=mask)["logits"].numpy()
    with torch.no_grad():
        want = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert rel_err(out[real], want[real]) <= TOL["float32"]
    with pytest.raises(ValueError, match="Paddle's CPU kernels have no float16 or bfloat16"):
        from_pretrained(tmp_path, framework="paddle", dtype=dtype)
