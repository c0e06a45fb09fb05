"""`multiattn.plot.heatmaps` in the outer process: NumPy input, the Agg backend."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import matplotlib

matplotlib.use("Agg")

from multiattn.plot import heatmaps

FRAMEWORKS = ("keras", "torch", "tensorflow", "jax", "paddle")


def weights(*shape: int) -> np.ndarray:
    scores = np.random.default_rng(0).standard_normal(shape)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]


def test_single_map_is_written_with_labels(tmp_path):
    w = weights(3, 4)
    fig = heatmaps(w, xlabels=list("abcd"), ylabels=["x", "y", "z"], titles=["one"])
    path = tmp_path / "map.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    (ax,) = visible_axes(fig)
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcd")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y", "z"]
    assert ax.get_title() == "one"
    np.testing.assert_array_equal(ax.images[0].get_array(), w)


def test_plotting_imports_no_framework():
    """In a fresh process (this one may hold frameworks other tests imported)."""
    code = (
        "import sys, numpy as np, matplotlib; matplotlib.use('Agg');"
        "from multiattn.plot import heatmaps;"
        "heatmaps(np.full((3, 4), 0.25)).savefig(sys.argv[1]);"
        f"print(sorted(set({FRAMEWORKS!r}) & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code, "/dev/null"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_panels_per_example_with_their_own_labels():
    w = weights(5, 2, 3)
    xl = [[f"k{i}{j}" for j in range(3)] for i in range(5)]
    fig = heatmaps(w, xlabels=xl, cols=2, titles=[f"ex {i}" for i in range(5)])
    axes = visible_axes(fig)
    assert len(axes) == 5  # a 3 x 2 grid with the last cell hidden
    for i, ax in enumerate(axes):
        assert [t.get_text() for t in ax.get_xticklabels()] == xl[i]
        np.testing.assert_array_equal(ax.images[0].get_array(), w[i])
    assert len(fig.axes) == 7  # six grid cells and one colour bar


def test_grid_input():
    w = weights(2, 3, 4, 4)
    fig = heatmaps(w, colorbar=False)
    axes = visible_axes(fig)
    assert len(axes) == 6
    np.testing.assert_array_equal(axes[4].images[0].get_array(), w[1, 1])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"weights": np.zeros(3)}, ValueError, r"received shape \(3,\)"),
        ({"weights": np.zeros((0, 3))}, ValueError, "empty"),
        ({"weights": np.array([[np.nan, 1.0]])}, ValueError, "NaN"),
        ({"weights": np.array([["a"]])}, TypeError, "numeric"),
        ({"weights": np.zeros((2, 3)), "xlabels": ["a", "b"]}, ValueError, "3 labels"),
        ({"weights": np.zeros((2, 3)), "ylabels": "ab"}, TypeError, "ylabels"),
        ({"weights": np.zeros((2, 2, 3)), "xlabels": [list("abc")] * 3}, ValueError, "3 panels"),
        ({"weights": np.zeros((2, 2, 3)), "titles": ["a"]}, ValueError, "2 titles"),
        ({"weights": np.zeros((2, 2, 3)), "cols": 0}, ValueError, "cols"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        heatmaps(**kwargs)
