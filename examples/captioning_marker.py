"""Caption a synthetic feature map with `FeatureMapAttention` (document 003, captioning).

Each "image" is a 5 x 5 grid of CNN-like features: noise, plus channels that encode each
cell's row and column (as a CNN's receptive fields would). One cell holds a marker of one
of four kinds. The caption is three tokens: the marker's kind, its row and its column.
The kind shows in the average over the grid, but the row and the column of the marker can
only be read by attending to the marker's cell, so the decoder has to learn where to look.

The decoder is the one of the document: ``h0 = MLP(mean of the features)``; at each step
``context, map = FeatureMapAttention(h, features)``, ``h = GRUCell([embed(token),
context], h)``, ``logits = Dense(h)``. The script reports the held-out token accuracy of
greedy captions and how often the attention map's strongest cell is the marker's cell.

    python examples/captioning_marker.py --backend jax [--quick] [--figure PATH]

The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

H = W = 5
KINDS = 4
NOISE_CH = 8
# channels: noise, row one-hot (H), column one-hot (W), marker flag, marker kind one-hot
CHANNELS = NOISE_CH + H + W + 1 + KINDS
BOS, FIRST_KIND = 0, 1
FIRST_ROW = FIRST_KIND + KINDS
FIRST_COL = FIRST_ROW + H
VOCAB = FIRST_COL + W
STEPS = 3
# (training images, epochs, batch size) of the full and the quick run
FULL = (4000, 5, 128)
QUICK = (2000, 4, 128)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="jax", choices=["jax", "torch", "tensorflow"])
    parser.add_argument("--quick", action="store_true", help="fewer images and epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figure", help="save the attention maps of a few images (PNG)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per framework")
    return parser.parse_args(argv)


def make_data(rng: np.random.Generator, n: int):
    """``features (n, H, W, CHANNELS)``, captions ``(n, 3)`` and marker cells ``(n, 2)``."""
    feats = np.zeros((n, H, W, CHANNELS), np.float32)
    feats[..., :NOISE_CH] = rng.standard_normal((n, H, W, NOISE_CH))
    rows, cols = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    feats[:, rows, cols, NOISE_CH + rows] = 1.0
    feats[:, rows, cols, NOISE_CH + H + cols] = 1.0
    r, c, kind = rng.integers(0, H, n), rng.integers(0, W, n), rng.integers(0, KINDS, n)
    idx = np.arange(n)
    feats[idx, r, c, NOISE_CH + H + W] = 2.0
    feats[idx, r, c, NOISE_CH + H + W + 1 + kind] = 2.0
    captions = np.stack([FIRST_KIND + kind, FIRST_ROW + r, FIRST_COL + c], 1).astype(np.int32)
    return feats, captions, np.stack([r, c], 1)


def build_model(keras, layers, units: int = 48):
    """The captioning decoder as a Keras model, and a greedy captioning function."""
    h0_layer = keras.layers.Dense(units, activation="tanh", name="init_state")
    attention = layers.FeatureMapAttention(units, name="feature_map_attention")
    embedding = keras.layers.Embedding(VOCAB, 16, name="embedding")
    cell = keras.layers.GRUCell(units, name="cell")
    head = keras.layers.Dense(VOCAB, name="logits")

    def step(token_vectors, features, h):
        context, weights = attention(h, features)
        h, _ = cell(keras.ops.concatenate([token_vectors, context], -1), h)
        return head(h), h, weights

    def initial_state(features):
        return h0_layer(keras.ops.mean(features, axis=(1, 2)))

    features_in = keras.Input((H, W, CHANNELS), name="features")
    tokens_in = keras.Input((STEPS,), dtype="int32", name="tokens_in")
    h = initial_state(features_in)
    embedded = embedding(tokens_in)
    logits = []
    for t in range(STEPS):  # teacher forcing
        step_logits, h, _ = step(embedded[:, t], features_in, h)
        logits.append(step_logits)
    model = keras.Model([features_in, tokens_in], keras.ops.stack(logits, 1))

    def caption(features):
        h = initial_state(features)
        token = keras.ops.full((features.shape[0],), BOS, dtype="int32")
        tokens, maps = [], []
        for _ in range(STEPS):
            step_logits, h, weights = step(embedding(token), features, h)
            token = keras.ops.cast(keras.ops.argmax(step_logits, -1), "int32")
            tokens.append(token)
            maps.append(weights)
        return keras.ops.stack(tokens, 1), keras.ops.stack(maps, 1)

    return model, caption


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
    feats, captions, _ = make_data(rng, n_train)
    t_feats, t_captions, t_cells = make_data(rng, 1000)
    tokens_in = np.concatenate([np.full((n_train, 1), BOS, np.int32), captions[:, :-1]], 1)

    model, caption = build_model(keras, layers)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callbacks = [] if args.no_progress else [RichProgress(epochs, -(-n_train // batch))]
    fit_start = time.perf_counter()
    history = model.fit(
        [feats, tokens_in],
        captions,
        batch_size=batch,
        epochs=epochs,
        verbose=0,
        callbacks=callbacks,
    )
    train_s = time.perf_counter() - fit_start

    tokens, maps = caption(keras.ops.convert_to_tensor(t_feats))
    tokens = np.asarray(keras.ops.convert_to_numpy(tokens))
    maps = np.asarray(keras.ops.convert_to_numpy(maps), np.float64)  # (n, STEPS, H, W)
    token_acc = float((tokens == t_captions).mean())
    marker = t_cells[:, 0] * W + t_cells[:, 1]
    strongest = maps.reshape(len(maps), STEPS, H * W).argmax(-1)
    pointing = (strongest == marker[:, None]).mean(0)  # per step
    marker_weight = maps.reshape(len(maps), STEPS, H * W)[np.arange(len(maps)), :, marker]

    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        from multiattn.plot import heatmaps

        names = ["kind", "row", "column"]
        pick = np.arange(4)
        fig = heatmaps(
            maps[pick],
            titles=[
                f"step {s + 1} ({names[s]}), marker at ({t_cells[i, 0]}, {t_cells[i, 1]})"
                for i in pick
                for s in range(STEPS)
            ],
            xlabel="grid column",
            ylabel="grid row",
            cmap="viridis",
            vmax=1.0,
        )
        fig.savefig(args.figure, dpi=70)
    result = {
        "example": "captioning_marker",
        "backend": args.backend,
        "quick": args.quick,
        "train_images": n_train,
        "epochs": epochs,
        "final_loss": float(history.history["loss"][-1]),
        "token_accuracy": token_acc,
        "caption_accuracy": float(np.all(tokens == t_captions, 1).mean()),
        "pointing_per_step": [round(float(p), 4) for p in pointing],
        "pointing_any_step": float((strongest == marker[:, None]).any(1).mean()),
        "mean_marker_weight_per_step": [round(float(m), 4) for m in marker_weight.mean(0)],
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
    }
    print(
        f"{args.backend}: held-out token accuracy {token_acc:.4f}; attention peak on the "
        f"marker per step {', '.join(f'{p:.3f}' for p in pointing)}; training {train_s:.1f} s"
    )
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
