"""Fixture files: NumPy archives plus one JSON manifest, loaded without pickle.

Layout of a fixture directory::

    manifest.json      {"format": 1, "oracle_version": ..., "files": {name: sha256},
                        "cases": [{"name", "family", "op", "dtype", "params", "tolerance",
                                   "file", "arrays": [...]}, ...]}
    <family>.npz       arrays keyed "<case>/<input|weight|expected|grad>/<name>" and
                       "<case>/cotangent"
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1
DEFAULT_DIR = Path(__file__).resolve().parent / "fixtures"


@dataclass
class Case:
    """One conformance case: an op called in one way, in one dtype."""

    name: str
    family: str
    op: str
    dtype: str
    params: dict[str, Any]
    tolerance: dict[str, float]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    expected: dict[str, np.ndarray] = field(default_factory=dict)
    grads: dict[str, np.ndarray] = field(default_factory=dict)
    cotangent: np.ndarray | None = None

    @classmethod
    def from_arrays(cls, meta: dict, arrays: dict[str, np.ndarray]) -> Case:
        case = cls(
            meta["name"],
            meta["family"],
            meta["op"],
            meta["dtype"],
            meta["params"],
            meta["tolerance"],
        )
        for key, value in arrays.items():
            if key == "cotangent":
                case.cotangent = value
                continue
            kind, name = key.split("/", 1)
            {
                "input": case.inputs,
                "weight": case.weights,
                "expected": case.expected,
                "grad": case.grads,
            }[kind][name] = value
        return case


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(cases: list[dict], directory: Path, oracle_version: str) -> dict:
    """Write ``cases`` (from `conformance.cases.expand`) to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    by_family: dict[str, dict[str, np.ndarray]] = {}
    entries = []
    for case in cases:
        file = f"{case['family']}.npz"
        bucket = by_family.setdefault(file, {})
        for key, value in case["arrays"].items():
            bucket[f"{case['name']}/{key}"] = value
        entries.append(
            {
                "name": case["name"],
                "family": case["family"],
                "op": case["op"],
                "dtype": case["dtype"],
                "params": case["params"],
                "tolerance": case["tolerance"],
                "file": file,
                "arrays": sorted(case["arrays"]),
            }
        )
    files = {}
    for file, arrays in sorted(by_family.items()):
        path = directory / file
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        files[file] = sha256_of(path)
    manifest = {
        "format": FORMAT,
        "oracle_version": oracle_version,
        "files": files,
        "cases": entries,
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"no manifest.json in fixture directory {directory}")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"{path}: unsupported fixture format {manifest.get('format')!r} (expected {FORMAT})"
        )
    return manifest


def load(directory: Path | None = None, names: set[str] | None = None) -> list[Case]:
    """Load the cases of a fixture directory (all, or those in ``names``).

    Every archive's sha256 is checked against the manifest; arrays load with
    ``allow_pickle=False``.
    """
    directory = Path(directory or DEFAULT_DIR)
    manifest = read_manifest(directory)
    wanted = [c for c in manifest["cases"] if names is None or c["name"] in names]
    archives: dict[str, Any] = {}
    cases = []
    for meta in wanted:
        file = meta["file"]
        if file not in archives:
            path = directory / file
            digest = sha256_of(path)
            if digest != manifest["files"].get(file):
                raise ValueError(f"{path}: sha256 {digest} does not match the manifest")
            archives[file] = np.load(path, allow_pickle=False)
        archive = archives[file]
        arrays = {key: archive[f"{meta['name']}/{key}"] for key in meta["arrays"]}
        cases.append(Case.from_arrays(meta, arrays))
    return cases
