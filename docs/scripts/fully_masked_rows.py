"""Measure what attention implementations do with a fully masked query row.

Run from the repository root with the project's virtualenv::

    .venv/bin/python docs/scripts/fully_masked_rows.py            # Markdown table
    .venv/bin/python docs/scripts/fully_masked_rows.py --json     # one JSON object per row

Every framework (and every Keras backend) is measured in a subprocess of its own: Keras reads
``KERAS_BACKEND`` once, and importing paddle after tensorflow in one process crashes.

The set-up is the same everywhere: a batch of two sequences, 4 queries and 4 keys of width 8,
one head. In batch row 0 the last key is padding; in batch row 1 *every* key is padding, so all
four of its query rows are fully masked. Layers get identity projections and no biases, so
their output is exactly ``weights @ value``. For the fully masked rows the output is
classified as

* ``NaN``: the output holds NaN;
* ``uniform``: the output equals the mean of the values (every key weighted ``1/keys``);
* ``zeros``: the output is zero;

and the gradient of ``sum(output)`` (all rows, masked ones included) with respect to the
query, key and value inputs is checked for NaN/Inf.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

BATCH, QUERIES, KEYS, WIDTH = 2, 4, 4, 8
LENGTHS = (KEYS - 1, 0)  # batch row 1 has no valid key
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# Keras' numpy backend computes float64 in float32, so multiattn does not offer it there.
NUMPY_DTYPES = ("float16", "bfloat16", "float32")

WORKERS = (
    "torch",
    "tensorflow",
    "jax",
    "paddle",
    "keras-jax",
    "keras-torch",
    "keras-tensorflow",
    "keras-numpy",
)


# --------------------------------------------------------------------------- shared helpers


def inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """query, key, value as float64 ``(BATCH, T, WIDTH)`` arrays."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((BATCH, QUERIES, WIDTH))
    k = rng.standard_normal((BATCH, KEYS, WIDTH))
    v = rng.standard_normal((BATCH, KEYS, WIDTH))
    return q, k, v


def keep_keys() -> np.ndarray:
    """``(BATCH, KEYS)`` bool, True = the key is real (may be attended)."""
    return np.arange(KEYS)[None, :] < np.array(LENGTHS)[:, None]


def keep_scores() -> np.ndarray:
    """``(BATCH, QUERIES, KEYS)`` bool, True = may attend."""
    return np.broadcast_to(keep_keys()[:, None, :], (BATCH, QUERIES, KEYS)).copy()


def tolerance(dtype: str) -> float:
    return {"float16": 2e-2, "bfloat16": 1e-1}.get(dtype, 1e-5)


def classify_output(out: np.ndarray, value: np.ndarray, dtype: str) -> str:
    """Classify the outputs of the fully masked batch row 1: ``(QUERIES, WIDTH)``."""
    row = np.asarray(out, dtype=np.float64)[1]
    if np.isnan(row).any():
        return "NaN"
    if np.isinf(row).any():
        return "Inf"
    tol = tolerance(dtype)
    if np.allclose(row, 0.0, atol=tol):
        return "zeros"
    mean = np.broadcast_to(value[1].mean(axis=0), row.shape)
    if np.allclose(row, mean, rtol=tol, atol=tol):
        return "uniform"
    return "other"


def classify_weights(weights: Any) -> str:
    """Classify the weights of the fully masked rows: ``(BATCH, [heads,] QUERIES, KEYS)``."""
    if weights is None:
        return "-"
    w = np.asarray(weights, dtype=np.float64)
    w = w.reshape(BATCH, -1, KEYS)[1]
    if np.isnan(w).any():
        return "NaN"
    if np.allclose(w, 0.0, atol=1e-6):
        return "zeros"
    if np.allclose(w, 1.0 / KEYS, atol=1e-2):
        return "uniform"
    return "other"


def grads_state(grads: Any) -> str:
    if grads is None:
        return "n/a"
    arrays = [np.asarray(g, dtype=np.float64) for g in grads]
    return "finite" if all(np.isfinite(a).all() for a in arrays) else "NaN"


def emit(api: str, backend: str, path: str, dtype: str, measure: Callable[[], tuple]) -> None:
    """Run ``measure`` (returning output, weights, grads) and print one result line."""
    v = inputs()[2]
    try:
        out, weights, grads = measure()
        row = {
            "output": classify_output(out, v, dtype),
            "weights": classify_weights(weights),
            "grads": grads_state(grads),
        }
    except Exception as err:  # report the failure instead of stopping the table
        traceback.print_exc()
        message = f"error: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
        row = {"output": message, "weights": "-", "grads": "-"}
    row.update(api=api, backend=backend, path=path, dtype=dtype)
    print("RESULT " + json.dumps(row), flush=True)


def version(name: str, value: str) -> None:
    print("VERSION " + json.dumps({"name": name, "version": value}), flush=True)


def identity_kernels(shape: tuple[int, ...]) -> np.ndarray:
    return np.eye(WIDTH).reshape(shape)


# --------------------------------------------------------------------------- torch worker


def worker_torch() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    version("torch", torch.__version__)
    q64, k64, v64 = inputs()

    def tensors(requires_grad: bool = True):
        return [
            torch.tensor(a, dtype=torch.float32, requires_grad=requires_grad)
            for a in (q64, k64, v64)
        ]

    def backward(out, ts):
        out.sum().backward()
        return [t.grad for t in ts]

    def mha(need_weights: bool):
        layer = torch.nn.MultiheadAttention(WIDTH, 1, bias=False, batch_first=True)
        with torch.no_grad():
            layer.in_proj_weight.copy_(torch.eye(WIDTH).repeat(3, 1))
            layer.out_proj.weight.copy_(torch.eye(WIDTH))
        ts = tensors()
        padding = torch.tensor(~keep_keys())  # True = ignore this key
        out, weights = layer(*ts, key_padding_mask=padding, need_weights=need_weights)
        return out.detach(), None if weights is None else weights.detach(), backward(out, ts)

    def mha_fast_path():
        # The inference fast path: eval mode, no autograd, self-attention (q is k is v).
        layer = torch.nn.MultiheadAttention(WIDTH, 1, bias=False, batch_first=True).eval()
        with torch.no_grad():
            layer.in_proj_weight.copy_(torch.eye(WIDTH).repeat(3, 1))
            layer.out_proj.weight.copy_(torch.eye(WIDTH))
            x = torch.tensor(v64, dtype=torch.float32)
            padding = torch.tensor(~keep_keys())
            out, _ = layer(x, x, x, key_padding_mask=padding, need_weights=False)
        return out, None, None

    def sdpa(kernel):
        ts = tensors()
        mask = torch.tensor(keep_scores()[:, None])  # (B, 1, Tq, Tk), True = take part
        heads = [t[:, None] for t in ts]  # (B, 1, T, D)
        if kernel is None:
            out = F.scaled_dot_product_attention(*heads, attn_mask=mask)
        else:
            with sdpa_kernel(kernel):
                out = F.scaled_dot_product_attention(*heads, attn_mask=mask)
        return out[:, 0].detach(), None, backward(out, ts)

    def d2l():
        # valid_lens masking by filling -1e6 before the softmax (the d2l document).
        ts = tensors()
        q, k, v = ts
        scores = torch.bmm(q, k.transpose(1, 2)) / WIDTH**0.5
        keep = torch.tensor(keep_scores())
        weights = torch.softmax(scores.masked_fill(~keep, -1e6), dim=-1)
        out = torch.bmm(weights, v)
        return out.detach(), weights.detach(), backward(out, ts)

    emit("torch.nn.MultiheadAttention", "torch", "need_weights=True", "float32", lambda: mha(True))
    emit(
        "torch.nn.MultiheadAttention", "torch", "need_weights=False", "float32", lambda: mha(False)
    )
    emit(
        "torch.nn.MultiheadAttention",
        "torch",
        "eval + no_grad, self-attention",
        "float32",
        mha_fast_path,
    )
    emit(
        "torch F.scaled_dot_product_attention",
        "torch",
        "default kernel",
        "float32",
        lambda: sdpa(None),
    )
    emit(
        "torch F.scaled_dot_product_attention",
        "torch",
        "SDPBackend.MATH",
        "float32",
        lambda: sdpa(SDPBackend.MATH),
    )
    emit("d2l masked_softmax (fill -1e6)", "torch", "explicit", "float32", d2l)


# --------------------------------------------------------------------------- tensorflow worker


def worker_tensorflow() -> None:
    import tensorflow as tf

    version("tensorflow", tf.__version__)
    q64, k64, v64 = inputs()

    def tf_document():
        # The TensorFlow tutorial: mask value 1 = masked out, logits += mask * -1e9.
        ts = [tf.constant(a, dtype=tf.float32) for a in (q64, k64, v64)]
        masked_out = tf.constant(~keep_scores(), dtype=tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(ts)
            q, k, v = ts
            logits = tf.matmul(q, k, transpose_b=True) / tf.math.sqrt(float(WIDTH))
            logits += masked_out * -1e9
            weights = tf.nn.softmax(logits, axis=-1)
            out = tf.matmul(weights, v)
            loss = tf.reduce_sum(out)
        return out.numpy(), weights.numpy(), tape.gradient(loss, ts)

    emit("TF document (mask * -1e9)", "tensorflow", "explicit", "float32", tf_document)


# --------------------------------------------------------------------------- jax worker


def worker_jax() -> None:
    import jax
    import jax.numpy as jnp

    version("jax", jax.__version__)
    q64, k64, v64 = inputs()
    mask = jnp.asarray(keep_scores()[:, None])  # (B, 1, Tq, Tk), True = keep

    def attention(q, k, v):
        # jax.nn layout is (B, T, heads, D).
        out = jax.nn.dot_product_attention(q[:, :, None], k[:, :, None], v[:, :, None], mask=mask)
        return out[:, :, 0]

    def measure():
        args = [jnp.asarray(a, dtype=jnp.float32) for a in (q64, k64, v64)]
        out = attention(*args)
        grads = jax.grad(lambda *a: jnp.sum(attention(*a)), argnums=(0, 1, 2))(*args)
        return np.asarray(out), None, grads

    emit("jax.nn.dot_product_attention", "jax", "default (xla)", "float32", measure)


# --------------------------------------------------------------------------- paddle worker


def worker_paddle() -> None:
    import paddle

    version("paddle", paddle.__version__)
    q64, k64, v64 = inputs()

    def measure():
        layer = paddle.nn.MultiHeadAttention(WIDTH, 1, need_weights=True, bias_attr=False)
        for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj):
            linear.weight.set_value(paddle.eye(WIDTH))
        ts = [paddle.to_tensor(a, dtype="float32", stop_gradient=False) for a in (q64, k64, v64)]
        mask = paddle.to_tensor(keep_scores()[:, None])  # bool, True = keep
        out, weights = layer(*ts, attn_mask=mask)
        out.sum().backward()
        return out.numpy(), weights.numpy(), [t.grad.numpy() for t in ts]

    emit("paddle.nn.MultiHeadAttention", "paddle", "bool attn_mask", "float32", measure)


# --------------------------------------------------------------------------- keras workers


def keras_grads(backend: str, fn: Callable, arrays: list) -> Any:
    """Gradients of ``sum(fn(*arrays))`` w.r.t. every array, or None without autodiff."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def loss(*a):
            return jnp.sum(fn(*a).astype("float32"))

        return jax.grad(loss, argnums=tuple(range(len(arrays))))(*arrays)
    if backend == "torch":
        ts = [a.detach().clone().requires_grad_(True) for a in arrays]
        fn(*ts).float().sum().backward()
        return [t.grad.float() for t in ts]
    if backend == "tensorflow":
        import tensorflow as tf

        ts = [tf.convert_to_tensor(a) for a in arrays]
        with tf.GradientTape() as tape:
            tape.watch(ts)
            loss = tf.reduce_sum(tf.cast(fn(*ts), "float32"))
        return [tf.cast(g, "float32") for g in tape.gradient(loss, ts)]
    return None


def worker_keras(backend: str) -> None:
    os.environ["KERAS_BACKEND"] = backend
    import keras

    import multiattn

    assert keras.backend.backend() == backend
    version("keras", keras.__version__)
    q64, k64, v64 = inputs()
    ops = keras.ops

    def tensors(dtype: str) -> list:
        return [ops.convert_to_tensor(a, dtype=dtype) for a in (q64, k64, v64)]

    def to_numpy(x: Any) -> np.ndarray:
        return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")))

    def run(fn: Callable, dtype: str, weights_index: int | None = None):
        args = tensors(dtype)
        result = fn(*args)
        got = keras.backend.standardize_dtype(
            (result if weights_index is None else result[0]).dtype
        )
        if got != dtype:
            raise TypeError(f"asked for {dtype}, computed {got}")
        if weights_index is None:
            out, weights = result, None
        else:
            out, weights = result[0], to_numpy(result[weights_index])

        def output_only(*a):
            r = fn(*a)
            return r if weights_index is None else r[0]

        return to_numpy(out), weights, keras_grads(backend, output_only, args)

    # keras.layers.MultiHeadAttention with identity projections.
    def keras_layer(dtype: str):
        layer = keras.layers.MultiHeadAttention(1, WIDTH, use_bias=False, dtype=dtype)
        layer(*tensors(dtype)[:2])
        layer.set_weights(
            [identity_kernels((WIDTH, 1, WIDTH))] * 3 + [identity_kernels((1, WIDTH, WIDTH))]
        )
        return layer

    mask = keep_scores()  # (B, Tq, Tk), True = attend

    def keras_mha(scores: bool):
        layer = keras_layer("float32")

        def fn(q, k, v):
            return layer(
                q,
                v,
                k,
                attention_mask=ops.convert_to_tensor(mask),
                return_attention_scores=scores,
            )

        return run(fn, "float32", 1 if scores else None)

    emit(
        "keras.layers.MultiHeadAttention",
        backend,
        "fused (ops.dot_product_attention)",
        "float32",
        lambda: keras_mha(False),
    )
    emit(
        "keras.layers.MultiHeadAttention",
        backend,
        "explicit (return_attention_scores=True)",
        "float32",
        lambda: keras_mha(True),
    )

    def keras_dpa():
        mask4 = ops.convert_to_tensor(mask[:, None])  # (B, 1, Tq, Tk), True = attend

        def fn(q, k, v):
            out = ops.dot_product_attention(
                ops.expand_dims(q, 2), ops.expand_dims(k, 2), ops.expand_dims(v, 2), mask=mask4
            )
            return out[:, :, 0]

        return run(fn, "float32")

    emit("keras.ops.dot_product_attention", backend, "-", "float32", keras_dpa)

    # multiattn, every floating dtype. Without weights the core takes its fused path where it
    # can (float32, and half precision computed in float32); with them, the explicit path.
    lens = np.array(LENGTHS, dtype="int32")
    mha_cache: dict[str, Any] = {}

    def multiattn_layer(dtype: str):
        if dtype not in mha_cache:
            layer = multiattn.layers.MultiHeadAttention(1, WIDTH, use_bias=False, dtype=dtype)
            layer(*tensors(dtype)[:2])
            layer.set_weights(
                [identity_kernels((WIDTH, 1, WIDTH))] * 3 + [identity_kernels((1, WIDTH, WIDTH))]
            )
            mha_cache[dtype] = layer
        return mha_cache[dtype]

    for dtype in NUMPY_DTYPES if backend == "numpy" else FLOAT_DTYPES:

        def sdpa(q, k, v, weights=False):
            return multiattn.ops.scaled_dot_product_attention(
                q, k, v, valid_lens=lens, return_weights=weights
            )

        def layer_call(q, k, v, weights=False, dtype=dtype):
            return multiattn_layer(dtype)(q, v, k, valid_lens=lens, return_weights=weights)

        for api, fn in (
            ("multiattn.ops.scaled_dot_product_attention", sdpa),
            ("multiattn.layers.MultiHeadAttention", layer_call),
        ):
            emit(
                api,
                backend,
                "return_weights=False",
                dtype,
                lambda fn=fn, dtype=dtype: run(fn, dtype),
            )
            emit(
                api,
                backend,
                "return_weights=True",
                dtype,
                lambda fn=fn, dtype=dtype: run(
                    lambda *a: fn(*a, weights=True), dtype, weights_index=1
                ),
            )

    if backend == "numpy":
        from multiattn import reference

        def oracle():
            q, k, v = inputs()
            out, weights = reference.scaled_dot_product_attention(q, k, v, valid_lens=lens)
            return out, weights, None

        emit("multiattn.reference (float64 oracle)", "numpy", "-", "float64", oracle)


# --------------------------------------------------------------------------- parent


def run_worker(name: str, verbose: bool) -> tuple[list[dict], dict[str, str]]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    env.pop("KERAS_BACKEND", None)
    if name == "keras-jax":
        env["JAX_ENABLE_X64"] = "1"  # without it JAX silently turns float64 into float32
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", name],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if verbose:
        print(proc.stderr, file=sys.stderr)
    rows, versions = [], {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            rows.append(json.loads(line[len("RESULT ") :]))
        elif line.startswith("VERSION "):
            item = json.loads(line[len("VERSION ") :])
            versions[item["name"]] = item["version"]
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        rows.append(
            {
                "api": f"worker {name}",
                "backend": name,
                "path": "-",
                "dtype": "-",
                "output": f"crashed (exit {proc.returncode}): {tail[:80]}",
                "weights": "-",
                "grads": "-",
            }
        )
    return rows, versions


def merge_dtypes(rows: list[dict]) -> list[dict]:
    """Collapse rows that differ only in dtype into one row listing the dtypes."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        key = (row["api"], row["backend"], row["path"], row["output"], row["weights"], row["grads"])
        if key in merged:
            merged[key]["dtype"] += ", " + row["dtype"]
        else:
            merged[key] = dict(row)
    return list(merged.values())


def markdown(rows: list[dict]) -> str:
    header = ("API", "backend", "path", "dtypes", "output", "weights", "gradients")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = (r["api"], r["backend"], r["path"], r["dtype"], r["output"], r["weights"])
        lines.append("| " + " | ".join((*cells, r["grads"])) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print JSON lines, not a table")
    parser.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    args = parser.parse_args()
    if args.worker:
        if args.worker.startswith("keras-"):
            worker_keras(args.worker.removeprefix("keras-"))
        else:
            globals()[f"worker_{args.worker}"]()
        return
    rows, versions = [], {}
    for name in WORKERS:
        worker_rows, worker_versions = run_worker(name, args.verbose)
        rows += worker_rows
        versions.update(worker_versions)
    rows = merge_dtypes(rows)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(
        "Measured with Python "
        + ".".join(map(str, sys.version_info[:3]))
        + ", numpy "
        + np.__version__
        + ", "
        + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    )
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
