"""Attention heatmaps with matplotlib (the optional extra ``multiattn[plot]``).

Nothing here imports a deep-learning framework: tensors of any backend are turned into
NumPy arrays through ``numpy.asarray`` (or their own ``numpy()``/``detach()`` methods), and
matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._checks import is_floating

__all__ = ["heatmaps"]


def _to_numpy(weights: Any) -> np.ndarray:
    if isinstance(weights, np.ndarray):
        return weights
    if hasattr(weights, "detach"):  # torch (and paddle) tensors
        weights = weights.detach()
        if "bfloat16" in str(weights.dtype):  # torch has no NumPy bfloat16
            weights = weights.float()
        if hasattr(weights, "cpu"):
            weights = weights.cpu()
    if hasattr(weights, "numpy"):  # tensorflow, torch, paddle
        return np.asarray(weights.numpy())
    return np.asarray(weights)  # jax arrays, lists, NumPy scalars


def _labels(name: str, labels: Any, panels: int, size: int) -> list[list[str] | None]:
    """One list of tick labels per panel (or None), from shared or per-panel labels."""
    if labels is None:
        return [None] * panels
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise TypeError(
            f"heatmaps: `{name}` must be a sequence of labels or one sequence per panel; "
            f"received {type(labels).__name__}."
        )
    per_panel = len(labels) > 0 and all(
        isinstance(item, Sequence) and not isinstance(item, str) for item in labels
    )
    rows = list(labels) if per_panel else [labels] * panels
    if len(rows) != panels:
        raise ValueError(
            f"heatmaps: `{name}` gives labels for {len(rows)} panels; the weights have "
            f"{panels} panels."
        )
    out = []
    for row in rows:
        row = [str(item) for item in row]
        if len(row) != size:
            raise ValueError(
                f"heatmaps: `{name}` must hold {size} labels per panel (the matching axis "
                f"of `weights`); received {len(row)}: {row!r}."
            )
        out.append(row)
    return out


def heatmaps(
    weights: Any,
    xlabels: Sequence[Any] | Sequence[Sequence[Any]] | None = None,
    ylabels: Sequence[Any] | Sequence[Sequence[Any]] | None = None,
    titles: Sequence[str] | None = None,
    *,
    xlabel: str = "keys",
    ylabel: str = "queries",
    cmap: str = "Reds",
    figsize: tuple[float, float] | None = None,
    cols: int | None = None,
    vmin: float | None = 0.0,
    vmax: float | None = None,
    colorbar: bool = True,
    annotate: bool = False,
):
    """Draw attention weights as heatmaps, one panel per head or per example.

    Args:
        weights: attention weights ``(queries, keys)``, ``(n, queries, keys)`` (one panel
            each, laid out in ``cols`` columns) or ``(rows, cols, queries, keys)`` (a grid,
            e.g. examples x heads). A NumPy array or a tensor of any framework; it is
            copied to NumPy (float). Rows are queries, columns keys, as in
            ``weights[..., q, k]`` returned by multiattn's attention functions.
        xlabels: tick labels of the keys: one sequence of ``keys`` labels shared by every
            panel, or one such sequence per panel. None: plain indices.
        ylabels: tick labels of the queries, the same way.
        titles: one title per panel (``n`` or ``rows * cols`` of them).
        xlabel, ylabel: axis titles (put on the outer panels).
        cmap: matplotlib colormap name.
        figsize: figure size in inches; default from the panel count.
        cols: panels per row for ``(n, queries, keys)`` input (default ``min(n, 4)``).
        vmin, vmax: colour range shared by all panels (default 0 to the largest weight).
        colorbar: add one colour bar for all panels.
        annotate: write each weight in its cell (for small maps).

    Returns:
        The ``matplotlib.figure.Figure``; save it with ``fig.savefig(path)``.

    Raises:
        ImportError: matplotlib is not installed (``pip install "multiattn[plot]"``).
        ValueError: ``weights`` has another rank, is empty or holds NaN/Inf; labels or
            titles do not match its shape.
    """
    arr = _to_numpy(weights)
    if arr.dtype.kind not in "iub" and not is_floating(arr.dtype):
        raise TypeError(f"heatmaps: `weights` must be numeric; received dtype {arr.dtype}.")
    arr = arr.astype(np.float64)
    if arr.ndim not in (2, 3, 4):
        raise ValueError(
            "heatmaps: `weights` must have shape (queries, keys), (n, queries, keys) or "
            f"(rows, cols, queries, keys); received shape {arr.shape}."
        )
    if arr.size == 0:
        raise ValueError(f"heatmaps: `weights` is empty; received shape {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        raise ValueError("heatmaps: `weights` holds NaN or Inf.")
    if cols is not None and (isinstance(cols, bool) or not isinstance(cols, int) or cols < 1):
        raise ValueError(f"heatmaps: `cols` must be a positive integer; received {cols!r}.")
    if arr.ndim == 2:
        grid = arr[None, None]
    elif arr.ndim == 3:
        n = arr.shape[0]
        ncols = min(n, cols or 4)
        nrows = -(-n // ncols)
        pad = np.full((nrows * ncols - n, *arr.shape[1:]), np.nan)
        grid = np.concatenate([arr, pad]).reshape(nrows, ncols, *arr.shape[1:])
    else:
        grid = arr
    nrows, ncols, nq, nk = grid.shape
    panels = arr.shape[0] if arr.ndim == 3 else nrows * ncols
    xl = _labels("xlabels", xlabels, panels, nk)
    yl = _labels("ylabels", ylabels, panels, nq)
    if titles is not None:
        titles = [str(t) for t in titles]
        if len(titles) != panels:
            raise ValueError(
                f"heatmaps: `titles` must hold {panels} titles (one per panel); "
                f"received {len(titles)}."
            )
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError('heatmaps needs matplotlib: pip install "multiattn[plot]"') from err

    if figsize is None:
        figsize = (1.2 + ncols * max(2.2, 0.32 * nk), 0.6 + nrows * max(2.0, 0.3 * nq))
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False, layout="constrained")
    top = float(np.nanmax(grid)) if vmax is None else vmax
    image = None
    for index in range(nrows * ncols):
        ax = axes[index // ncols, index % ncols]
        if index >= panels:
            ax.set_visible(False)
            continue
        panel = grid[index // ncols, index % ncols]
        image = ax.imshow(panel, cmap=cmap, vmin=vmin, vmax=top, aspect="auto")
        ax.set_xticks(range(nk), xl[index] if xl[index] is not None else range(nk))
        ax.set_yticks(range(nq), yl[index] if yl[index] is not None else range(nq))
        ax.tick_params(labelsize=8)
        if index // ncols == nrows - 1 or index + ncols >= panels:
            ax.set_xlabel(xlabel)
        if index % ncols == 0:
            ax.set_ylabel(ylabel)
        if titles is not None:
            ax.set_title(titles[index], fontsize=9)
        if annotate:
            for (i, j), value in np.ndenumerate(panel):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6)
    if colorbar and image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    return fig
