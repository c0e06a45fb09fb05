"""Worker: training steps of a TransformerEncoderLayer under PyTorch's
DistributedDataParallel (2 CPU processes, gloo on 127.0.0.1) against the same steps in
one process on the concatenated batches.

Run by ``tests/test_distributed_torch.py`` with ``KERAS_BACKEND=torch``; starts the two
ranks itself (``torch.multiprocessing.spawn``). Prints one JSON object of relative
errors.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from multiattn.layers import TransformerEncoderLayer

WORLD, BATCH, SEQ, D_MODEL, HEADS, DFF, STEPS, LR = 2, 8, 16, 32, 4, 64, 2, 0.05


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS, BATCH, SEQ, D_MODEL)).astype("float32")
    y = rng.standard_normal((STEPS, BATCH, SEQ, D_MODEL)).astype("float32")
    lens = rng.integers(1, SEQ + 1, size=(STEPS, BATCH)).astype("int32")
    return x, y, lens


def make_layer(weights=None):
    """The layer, with ``weights`` or with random weights drawn by NumPy (Keras' own
    seeding, ``keras.utils.set_random_seed``, would import TensorFlow)."""
    layer = TransformerEncoderLayer(D_MODEL, HEADS, DFF, rate=0.0, seed=1)
    layer.build((BATCH, SEQ, D_MODEL))
    if weights is None:
        rng = np.random.default_rng(1)
        weights = [
            (
                rng.standard_normal(w.shape) * 0.2 + (1.0 if w.path.endswith("gamma") else 0.0)
            ).astype("float32")
            for w in layer.weights
        ]
    # Copies: on the torch backend the variables may share memory with the arrays given
    # to set_weights, and get_weights may return views of the variables.
    layer.set_weights([np.array(w, copy=True) for w in weights])
    return layer


def train(module, layer, batches):
    """``STEPS`` SGD steps of the mean squared error; ``module`` is the layer itself or
    its DistributedDataParallel wrapper. Returns the weights after the steps and the
    gradients of the first step (under DDP: averaged over the ranks)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    first_grads = None
    for x, y, lens in batches:
        optimizer.zero_grad()
        out = module(torch.from_numpy(x), valid_lens=torch.from_numpy(lens), training=True)
        loss = torch.mean((out - torch.from_numpy(y)) ** 2)
        loss.backward()
        if first_grads is None:
            first_grads = [w.value.grad.detach().numpy().copy() for w in layer.weights]
        optimizer.step()
    return [np.array(w, copy=True) for w in layer.get_weights()], first_grads


def train_rank(rank: int, tmp: str) -> None:
    """This rank's half of every batch through the DistributedDataParallel wrapper;
    saves the weights and the first step's gradients. The wrapper (and its reducer)
    lives only inside this function: see `rank_main`."""
    initial = list(np.load(Path(tmp) / "initial.npz").values())
    layer = make_layer(initial)
    module = DistributedDataParallel(layer)
    x, y, lens = data()
    part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    batches = [(x[s, part], y[s, part], lens[s, part]) for s in range(STEPS)]
    weights, grads = train(module, layer, batches)
    np.savez(Path(tmp) / f"rank{rank}.npz", *weights)
    np.savez(Path(tmp) / f"grads{rank}.npz", *grads)


def rank_main(rank: int, port: int, tmp: str) -> None:
    # A rank that hangs (a collective the other rank never joins) prints where it is
    # and exits instead of blocking the test run.
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        train_rank(rank, tmp)
        # Every DDP object is freed here, while the process group is still registered.
        # Freed after destroy_process_group(), the reducer would drop the group's last
        # reference while holding the GIL, and the gloo group's destructor joins worker
        # threads that may need the GIL to free a finished allreduce: a deadlock
        # (torch 2.13; seen as a rank hanging after its last step).
        gc.collect()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def main() -> dict:
    torch.set_num_threads(1)
    initial = [np.array(w, copy=True) for w in make_layer().get_weights()]
    x, y, lens = data()
    layer = make_layer(initial)
    single, single_grads = train(layer, layer, [(x[s], y[s], lens[s]) for s in range(STEPS)])
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "initial.npz", *initial)
        torch.multiprocessing.spawn(rank_main, args=(free_port(), tmp), nprocs=WORLD, join=True)
        ranks = [list(np.load(Path(tmp) / f"rank{r}.npz").values()) for r in range(WORLD)]
        grads = list(np.load(Path(tmp) / "grads0.npz").values())
    names = [w.path.split("/", 1)[1] for w in layer.weights]
    # Per weight: the updated weights, and the first step's gradients (DDP's average of
    # the two halves' gradients against the gradient of the whole batch). The key bias
    # has a zero gradient in exact arithmetic (it shifts a whole row of scores): its
    # gradients are compared with the scale of all gradients.
    weights = {n: rel_err(d, s) for n, d, s in zip(names, ranks[0], single)}
    scale = max(float(np.abs(g).max()) for g in single_grads)
    gradients = {
        n: rel_err(d, s) if not n.endswith("key/bias") else float(np.abs(d - s).max()) / scale
        for n, d, s in zip(names, grads, single_grads)
    }
    return {
        "world": WORLD,
        "steps": STEPS,
        "weights": weights,
        "gradients": gradients,
        "ranks_identical": all(
            np.array_equal(a, b) for r in ranks[1:] for a, b in zip(ranks[0], r)
        ),
        "largest_update": max(float(np.abs(s - w0).max()) for s, w0 in zip(single, initial)),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
