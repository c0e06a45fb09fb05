"""Reverse digit sequences with the RNN encoder-decoder and additive attention (document 003).

The source is 3 to 8 random digits (padded, with valid lengths); the target is the same
digits reversed, followed by an end token. `Seq2SeqEncoder` reads the source and
`Seq2SeqAttentionDecoder` learns with teacher forcing; accuracy is measured with greedy
decoding on held-out sequences that never occur in the training set.

    python examples/rnn_reverse.py --backend jax            # full run
    python examples/rnn_reverse.py --backend torch --quick  # a short run (CI)
    python examples/rnn_reverse.py --figure docs/images/rnn_reverse_attention.png

The last line printed is ``RESULT {json}`` with the accuracies and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

PAD, BOS, EOS, FIRST_DIGIT = 0, 1, 2, 3
VOCAB = FIRST_DIGIT + 10
MIN_LEN, MAX_LEN = 3, 8
# (training sequences, epochs, batch size) of the full and the quick run
FULL = (8000, 4, 128)
QUICK = (4000, 4, 128)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="jax", choices=["jax", "torch", "tensorflow"])
    parser.add_argument("--quick", action="store_true", help="fewer sequences and epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figure", help="save a heatmap of the attention weights (PNG)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads per framework (small ops: 1 is best)"
    )
    parser.add_argument("--epochs", type=int, help="override the number of epochs")
    parser.add_argument("--train-size", type=int, help="override the training set size")
    return parser.parse_args(argv)


def make_data(rng: np.random.Generator, n: int, exclude: set | None = None):
    """``n`` distinct sequences (none of them in ``exclude``) and their reversals.

    Returns ``src (n, MAX_LEN)``, ``lens (n,)``, ``tgt_in (n, MAX_LEN + 1)`` (BOS then the
    reversed digits), ``tgt_out (n, MAX_LEN + 1)`` (the reversed digits then EOS) and
    ``weight (n, MAX_LEN + 1)`` (1 on the positions that count: digits and EOS).
    """
    seen = set(exclude or ())
    rows = []
    while len(rows) < n:
        length = int(rng.integers(MIN_LEN, MAX_LEN + 1))
        digits = tuple(int(d) for d in rng.integers(0, 10, length) + FIRST_DIGIT)
        if digits not in seen:
            seen.add(digits)
            rows.append(digits)
    src = np.full((n, MAX_LEN), PAD, np.int32)
    tgt_in = np.full((n, MAX_LEN + 1), PAD, np.int32)
    tgt_out = np.full((n, MAX_LEN + 1), PAD, np.int32)
    weight = np.zeros((n, MAX_LEN + 1), np.float32)
    lens = np.array([len(r) for r in rows], np.int32)
    for i, digits in enumerate(rows):
        length = len(digits)
        src[i, :length] = digits
        tgt_in[i, 0] = BOS
        tgt_in[i, 1 : length + 1] = digits[::-1]
        tgt_out[i, :length] = digits[::-1]
        tgt_out[i, length] = EOS
        weight[i, : length + 1] = 1.0
    return src, lens, tgt_in, tgt_out, weight, set(rows)


def token_name(t: int) -> str:
    return {PAD: "pad", BOS: "bos", EOS: "eos"}.get(int(t), str(int(t) - FIRST_DIGIT))


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _threads import limit_threads

    limit_threads(args.backend, args.threads)
    import keras
    from _keras_progress import RichProgress

    from multiattn import layers

    if keras.backend.backend() != args.backend:
        raise SystemExit(f"Keras was already imported with backend {keras.backend.backend()}")
    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    n_train, epochs, batch = QUICK if args.quick else FULL
    n_train = args.train_size or n_train
    epochs = args.epochs or epochs
    src, lens, tgt_in, tgt_out, weight, seen = make_data(rng, n_train)
    test = make_data(rng, 1000, exclude=seen)

    encoder = layers.Seq2SeqEncoder(VOCAB, 32, 64, name="encoder")
    decoder = layers.Seq2SeqAttentionDecoder(VOCAB, 32, 64, name="decoder")
    src_in = keras.Input((MAX_LEN,), dtype="int32", name="src")
    lens_in = keras.Input((), dtype="int32", name="valid_lens")
    dec_in = keras.Input((MAX_LEN + 1,), dtype="int32", name="tgt_in")
    enc_out, state = encoder(src_in, valid_lens=lens_in)
    logits = decoder(dec_in, enc_out, state, valid_lens=lens_in)
    model = keras.Model([src_in, lens_in, dec_in], logits)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # XLA compilation of the unrolled decoder costs TensorFlow more than it saves here.
        jit_compile=False if args.backend == "tensorflow" else "auto",
    )
    callbacks = [] if args.no_progress else [RichProgress(epochs, -(-n_train // batch))]
    fit_start = time.perf_counter()
    history = model.fit(
        [src, lens, tgt_in],
        tgt_out,
        sample_weight=weight,
        batch_size=batch,
        epochs=epochs,
        verbose=0,
        callbacks=callbacks,
    )
    train_s = time.perf_counter() - fit_start

    # Greedy decoding of held-out sequences: each step is fed the previous prediction.
    t_src, t_lens, _, t_out, t_weight, _ = test
    enc_out, state = encoder(t_src, valid_lens=t_lens)
    tokens, att = decoder.decode(enc_out, state, BOS, MAX_LEN + 1, valid_lens=t_lens)
    tokens = np.asarray(keras.ops.convert_to_numpy(tokens))
    att = np.asarray(keras.ops.convert_to_numpy(att), np.float64)
    counted = t_weight > 0
    token_acc = float((tokens == t_out)[counted].mean())
    seq_acc = float(np.all((tokens == t_out) | ~counted, axis=1).mean())

    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        from multiattn.plot import heatmaps

        pick = np.flatnonzero(t_lens == MAX_LEN)[:4]
        fig = heatmaps(
            att[pick, : MAX_LEN + 1, :MAX_LEN],
            xlabels=[[token_name(t) for t in t_src[i]] for i in pick],
            ylabels=[[token_name(t) for t in tokens[i]] for i in pick],
            titles=[f"example {i}" for i in pick],
            xlabel="source digit",
            ylabel="predicted token",
            cols=4,
        )
        fig.savefig(args.figure, dpi=80)
    result = {
        "example": "rnn_reverse",
        "backend": args.backend,
        "quick": args.quick,
        "train_sequences": n_train,
        "epochs": epochs,
        "final_loss": float(history.history["loss"][-1]),
        "token_accuracy": token_acc,
        "sequence_accuracy": seq_acc,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
    }
    print(
        f"{args.backend}: held-out token accuracy {token_acc:.4f}, sequence accuracy "
        f"{seq_acc:.4f} (greedy decoding), training {train_s:.1f} s"
    )
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
