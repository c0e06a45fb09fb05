"""Fixture files: NumPy archives plus one JSON manifest, loaded without pickle.

Layout of a fixture directory::

    manifest.json      {"format": 1, "oracle_version": ..., "files": {name: sha256},
                        "cases": [{"name", "family", "op", "dtype", "params", "tolerance",
                                   "file", "arrays": [...]}, ...]}
    <family>.npz       arrays keyed "<case>/<input|weight|expected|grad>/<name>" and
                       "<case>/cotangent"

Trust: every archive is checked against its sha256 in the manifest, and the shipped
manifest against the digest pinned in the code (``fixtures_pin.py``, written by the
generator); see `verify`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1
DEFAULT_DIR = Path(__file__).resolve().parent / "fixtures"
#: Where the generator pins the digest of the shipped manifest (a module, so part of the code).
PIN_FILE = Path(__file__).resolve().parent / "fixtures_pin.py"


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


def manifest_digest(manifest: dict) -> str:
    """The sha256 of a manifest's canonical JSON (sorted keys, no whitespace), so that line
    endings and indentation do not change it."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def pinned_digest() -> str:
    """The digest of the shipped manifest, pinned in the code (`fixtures_pin`)."""
    from . import fixtures_pin

    return fixtures_pin.MANIFEST_SHA256


def write_pin(digest: str) -> None:
    """Pin ``digest`` as the shipped manifest's, in `PIN_FILE` (the generator calls this)."""
    Path(PIN_FILE).write_text(
        '"""Written by ``python -m multiattn.conformance.generate``: do not edit.\n\n'
        "The sha256 of the canonical JSON of the shipped ``fixtures/manifest.json`` (see\n"
        "`multiattn.conformance.fixtures.manifest_digest`). The manifest holds the cases, their\n"
        "tolerances and the sha256 of every archive, so this one value, in the code, vouches for\n"
        'all of the shipped fixtures.\n"""\n\n'
        f'MANIFEST_SHA256 = "{digest}"\n'
    )
    from . import fixtures_pin

    fixtures_pin.MANIFEST_SHA256 = digest  # this process sees the new pin too


_ARRAY_KINDS = ("input", "weight", "expected", "grad")
_CASE_KEYS = {"name": str, "family": str, "op": str, "dtype": str, "params": dict}


def read_manifest(directory: Path) -> dict:
    """The manifest of a fixture directory, checked for its format and structure (not for
    whether it can be trusted: see `verify`)."""
    path = Path(directory) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"no manifest.json in fixture directory {directory}")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{path}: unsupported fixture format {found!r} (expected {FORMAT})")
    if not isinstance(manifest.get("cases"), list) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path}: needs a list 'cases' and an object 'files'")
    seen = set()
    for i, meta in enumerate(manifest["cases"]):
        where = f"{path}: cases[{i}]"
        if not isinstance(meta, dict):
            raise ValueError(f"{where} is {type(meta).__name__}, not an object")
        for key, kind in {**_CASE_KEYS, "file": str, "arrays": list, "tolerance": dict}.items():
            if not isinstance(meta.get(key), kind):
                raise ValueError(
                    f"{where}: {key!r} must be a {kind.__name__}; got {meta.get(key)!r}"
                )
        tol = meta["tolerance"]
        if not all(isinstance(tol.get(k), (int, float)) for k in ("output", "grad")):
            raise ValueError(
                f"{where} ({meta['name']}): tolerance needs numbers 'output' and 'grad'; got {tol!r}"
            )
        odd = [
            a
            for a in meta["arrays"]
            if not isinstance(a, str)
            or (a != "cotangent" and a.split("/", 1)[0] not in _ARRAY_KINDS)
            or (a != "cotangent" and "/" not in a)
        ]
        if odd:
            raise ValueError(
                f"{where} ({meta['name']}): array names must be 'cotangent' or "
                f"'<{'|'.join(_ARRAY_KINDS)}>/<name>'; got {odd[0]!r}"
            )
        if "expected/output" not in meta["arrays"]:
            raise ValueError(f"{where} ({meta['name']}): no 'expected/output' array to compare")
        if meta["name"] in seen:
            raise ValueError(f"{where}: case {meta['name']!r} appears twice")
        seen.add(meta["name"])
    return manifest


class TamperedError(ValueError):
    """Fixtures that do not match what vouches for them: the shipped manifest against the
    digest pinned in the code, an archive against its sha256 in the manifest, a case named
    like a shipped one against the shipped case."""


@dataclass
class Fixtures:
    """A verified fixture directory: its manifest, and what in it cannot be trusted.

    ``tampered`` maps an archive (``sdpa.npz``) or a case name to what is wrong with it;
    their cases are not run. ``shipped`` is true for the fixtures the code pins (the
    shipped directory, or an exact copy of its manifest).
    """

    directory: Path
    manifest: dict
    digest: str
    shipped: bool
    tampered: dict[str, str] = field(default_factory=dict)

    def is_tampered(self, meta: dict) -> bool:
        return meta["name"] in self.tampered or meta["file"] in self.tampered

    def select(self, patterns: list[str]) -> tuple[list[str], list[str]]:
        """Names of the cases matching any of the glob ``patterns``: (sound, tampered)."""
        sound, bad = [], []
        for meta in self.manifest["cases"]:
            if any(fnmatch.fnmatchcase(meta["name"], p) for p in patterns):
                (bad if self.is_tampered(meta) else sound).append(meta["name"])
        return sound, bad


def _is_default(directory: Path | None) -> bool:
    return directory is None or Path(directory).resolve() == Path(DEFAULT_DIR).resolve()


def _read_archive(path: Path, digest: str | None) -> Any:
    """The archive at ``path``, read once, hashed, loaded from those bytes (so what is loaded
    is what was hashed); raises `TamperedError` when it is missing or its sha256 is not
    ``digest``."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TamperedError(f"{path}: cannot be read ({err.strerror or err})") from None
    found = hashlib.sha256(data).hexdigest()
    if found != digest:
        raise TamperedError(
            f"{path}: sha256 {found} does not match the manifest"
            + (f" ({digest})" if digest else " (which lists no sha256 for it)")
        )
    return np.load(io.BytesIO(data), allow_pickle=False)


def _shipped(pinned: bool = True) -> Fixtures:
    directory = Path(DEFAULT_DIR)
    manifest = read_manifest(directory)
    digest, pin = manifest_digest(manifest), pinned_digest()
    if pinned and digest != pin:
        raise TamperedError(
            f"{directory / 'manifest.json'}: sha256 {digest} is not the one the code pins "
            f"({pin}): the shipped fixtures were edited. Reinstall multiattn, or regenerate "
            "them with python -m multiattn.conformance.generate"
        )
    return Fixtures(directory, manifest, digest, shipped=True)


def _same_arrays(mine: Any, theirs: Any, case: str, keys: list[str]) -> bool:
    for key in keys:
        try:
            a, b = mine[f"{case}/{key}"], theirs[f"{case}/{key}"]
        except KeyError:
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            return False
    return True


def verify(directory: Path | None = None, *, pinned: bool = True) -> Fixtures:
    """Check a fixture directory against what vouches for it, before anything runs.

    * The shipped fixtures (``directory`` None or `DEFAULT_DIR`): the manifest's digest must
      be the one pinned in the code, else `TamperedError` (nothing in it can be trusted).
    * Every archive: its sha256 must be the manifest's, else the archive is tampered.
    * Any other directory is trusted as its manifest says, except that a case carrying the
      name of a shipped case must be that case: the same op, parameters, tolerances and
      arrays (bit for bit), else that case is tampered.

    Raises `FileNotFoundError` / `ValueError` for a directory that is not a fixture
    directory, `TamperedError` for shipped fixtures that were edited (``pinned=False``, for
    the generator's check, skips that one test).
    """
    if _is_default(directory):
        fixtures = _shipped(pinned)
    else:
        directory = Path(directory)
        manifest = read_manifest(directory)
        digest = manifest_digest(manifest)
        fixtures = Fixtures(directory, manifest, digest, shipped=digest == pinned_digest())
    manifest = fixtures.manifest
    archives: dict[str, Any] = {}
    for file in sorted({meta["file"] for meta in manifest["cases"]}):
        try:
            archives[file] = _read_archive(fixtures.directory / file, manifest["files"].get(file))
        except TamperedError as err:
            fixtures.tampered[file] = str(err)
    if not fixtures.shipped:
        _check_shipped_names(fixtures, archives)
    return fixtures


def _check_shipped_names(fixtures: Fixtures, archives: dict[str, Any]) -> None:
    """Mark tampered every case of a directory of one's own that carries a shipped case's
    name but is not that case."""
    try:
        shipped = _shipped()
    except (OSError, ValueError) as err:
        # Nothing to compare with: mistrust every case named like one of the shipped ones.
        try:
            names = {m["name"] for m in read_manifest(DEFAULT_DIR)["cases"]}
        except (OSError, ValueError):
            names = set()
        for meta in fixtures.manifest["cases"]:
            if meta["name"] in names:
                fixtures.tampered[meta["name"]] = (
                    f"case {meta['name']} is named like a shipped case, and the shipped "
                    f"fixtures to compare it with cannot be trusted: {err}"
                )
        return
    theirs = {m["name"]: m for m in shipped.manifest["cases"]}
    shipped_archives: dict[str, Any] = {}
    for meta in fixtures.manifest["cases"]:
        ref = theirs.get(meta["name"])
        if ref is None or meta["file"] in fixtures.tampered:
            continue
        differs = [
            key for key in ("family", "op", "dtype", "params", "tolerance") if meta[key] != ref[key]
        ]
        if sorted(meta["arrays"]) != sorted(ref["arrays"]):
            differs.append("arrays")
        elif fixtures.manifest["files"].get(meta["file"]) != shipped.manifest["files"].get(
            ref["file"]
        ):  # not the shipped archive: compare this case's arrays
            try:
                if ref["file"] not in shipped_archives:
                    shipped_archives[ref["file"]] = _read_archive(
                        shipped.directory / ref["file"], shipped.manifest["files"].get(ref["file"])
                    )
            except TamperedError as err:
                fixtures.tampered[meta["name"]] = (
                    f"case {meta['name']} is named like a shipped case, and the shipped "
                    f"archive to compare it with cannot be trusted: {err}"
                )
                continue
            mine, ours = archives[meta["file"]], shipped_archives[ref["file"]]
            if not _same_arrays(mine, ours, meta["name"], meta["arrays"]):
                differs.append("arrays' values")
        if differs:
            fixtures.tampered[meta["name"]] = (
                f"case {meta['name']} differs from the shipped case of that name "
                f"({', '.join(differs)}); give a case of your own a name of its own"
            )


def load(
    source: Path | Fixtures | None = None, names: set[str] | list[str] | None = None
) -> list[Case]:
    """Load the cases of a fixture directory (all, or those in ``names``), in manifest order.

    ``source`` is a directory (verified first, see `verify`) or an already verified
    `Fixtures`. Raises `TamperedError` if a wanted case cannot be trusted. Every archive is
    hashed as it is read and its sha256 checked against the manifest; arrays load with
    ``allow_pickle=False``.
    """
    fixtures = source if isinstance(source, Fixtures) else verify(source)
    manifest = fixtures.manifest
    wanted = [c for c in manifest["cases"] if names is None or c["name"] in names]
    for meta in wanted:
        if fixtures.is_tampered(meta):
            raise TamperedError(
                fixtures.tampered.get(meta["name"]) or fixtures.tampered[meta["file"]]
            )
    archives: dict[str, Any] = {}
    cases = []
    for meta in wanted:
        file = meta["file"]
        if file not in archives:
            archives[file] = _read_archive(fixtures.directory / file, manifest["files"].get(file))
        archive = archives[file]
        try:
            arrays = {key: archive[f"{meta['name']}/{key}"] for key in meta["arrays"]}
        except KeyError as err:
            raise ValueError(
                f"{fixtures.directory / file}: no array {err} (case {meta['name']})"
            ) from None
        cases.append(Case.from_arrays(meta, arrays))
    return cases
