"""``multiattn demo``: the same attention under every installed Keras backend.

Each backend runs in its own process (Keras reads ``KERAS_BACKEND`` once). Every worker
computes masked scaled dot-product attention and a multi-head attention layer on the same
inputs and weights (a fully masked query row included); the parent compares each result
with the float64 oracle and prints one table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

BACKENDS = {"jax": "jax", "torch": "torch", "tensorflow": "tensorflow", "numpy": "numpy"}
TOLERANCE = 1e-6  # max relative error against the oracle, float32


def _inputs() -> dict:
    rng = np.random.default_rng(2024)
    b, tq, tk, e, h, d = 2, 5, 7, 16, 4, 4
    return {
        "query": rng.standard_normal((b, tq, e)),
        "value": rng.standard_normal((b, tk, e)),
        "valid_lens": np.array([[0, 3, 7, 5, 1], [7, 2, 0, 4, 6]]),
        "weights": {
            "query_kernel": rng.standard_normal((e, h, d)) * 0.3,
            "key_kernel": rng.standard_normal((e, h, d)) * 0.3,
            "value_kernel": rng.standard_normal((e, h, d)) * 0.3,
            "output_kernel": rng.standard_normal((h, d, e)) * 0.3,
            "query_bias": rng.standard_normal((h, d)) * 0.1,
            "key_bias": rng.standard_normal((h, d)) * 0.1,
            "value_bias": rng.standard_normal((h, d)) * 0.1,
            "output_bias": rng.standard_normal((e,)) * 0.1,
        },
        "heads": h,
        "key_dim": d,
    }


def _worker() -> None:
    import keras

    from multiattn import layers, ops

    data = _inputs()
    f32 = {k: data[k].astype("float32") for k in ("query", "value")}
    sdpa = ops.scaled_dot_product_attention(
        f32["query"], f32["value"], f32["value"], valid_lens=data["valid_lens"], causal=True
    )
    mha = layers.MultiHeadAttention(data["heads"], data["key_dim"])
    mha(f32["query"], f32["value"])
    for name, array in data["weights"].items():
        getattr(mha, name).assign(array.astype("float32"))
    out = mha(f32["query"], f32["value"], valid_lens=data["valid_lens"])
    print(
        json.dumps(
            {
                "backend": keras.backend.backend(),
                "sdpa": keras.ops.convert_to_numpy(sdpa).tolist(),
                "mha": keras.ops.convert_to_numpy(out).tolist(),
            }
        )
    )


def _expected() -> dict:
    from . import reference as ref

    data = _inputs()
    # The oracle sees the float32-rounded inputs the backends see.
    rounded = {k: data[k].astype(np.float32).astype(np.float64) for k in ("query", "value")}
    weights = {k: w.astype(np.float32).astype(np.float64) for k, w in data["weights"].items()}
    sdpa, _ = ref.scaled_dot_product_attention(
        rounded["query"],
        rounded["value"],
        rounded["value"],
        valid_lens=data["valid_lens"],
        causal=True,
    )
    mha, _ = ref.multi_head_attention(
        rounded["query"], rounded["value"], weights=weights, valid_lens=data["valid_lens"]
    )
    return {"sdpa": sdpa, "mha": mha}


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def run(backends: list[str] | None = None) -> int:
    """Run the demo; return the process exit code (0 when every backend agrees)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    want = _expected()
    table = Table(
        title="multiattn: the same attention on every backend (float32 vs float64 oracle)"
    )
    for col in ("backend", "status", "sdpa max rel err", "mha max rel err", "zero row"):
        table.add_column(col)
    failures = 0
    results = {}
    for backend in backends or list(BACKENDS):
        if backend != "numpy" and importlib.util.find_spec(BACKENDS[backend]) is None:
            table.add_row(backend, "[yellow]skipped[/] (not installed)", "", "", "")
            continue
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        with console.status(f"running on {backend}..."):
            proc = subprocess.run(
                [sys.executable, "-m", "multiattn.demo", "--worker"],
                env=env,
                capture_output=True,
                text=True,
            )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            failures += 1
            table.add_row(
                backend,
                "[red]error[/]",
                (proc.stderr.strip().splitlines()[-1:] and proc.stderr.strip().splitlines()[-1])
                or "",
                "",
                "",
            )
            continue
        res = json.loads(lines[-1])
        sdpa, mha = np.array(res["sdpa"]), np.array(res["mha"])
        results[backend] = (sdpa, mha)
        e1, e2 = _rel(sdpa, want["sdpa"]), _rel(mha, want["mha"])
        zero_row = bool(np.all(sdpa[0, 0] == 0.0))
        ok = e1 <= TOLERANCE and e2 <= TOLERANCE and zero_row
        failures += not ok
        table.add_row(
            backend,
            "[green]agrees[/]" if ok else "[red]differs[/]",
            f"{e1:.1e}",
            f"{e2:.1e}",
            "zeros" if zero_row else "NOT zeros",
        )
    console.print(table)
    if len(results) > 1:
        sdpas = [r[0] for r in results.values()]
        spread = max(float(np.abs(a - b).max()) for a in sdpas for b in sdpas)
        console.print(
            f"largest difference between two backends: {spread:.1e} (tolerance {TOLERANCE:.0e} relative to the oracle)"
        )
    console.print(
        "[green]all backends agree[/]"
        if not failures
        else f"[red]{failures} backend(s) disagree[/]"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        sys.exit(run())
