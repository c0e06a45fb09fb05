"""Generate the conformance fixtures from the float64 oracle, or check them.

    python -m multiattn.conformance.generate            # (re)write conformance/fixtures
    python -m multiattn.conformance.generate --check    # regenerate in memory, fail on drift

Seeds are fixed per variant, so generation is deterministic. Writing the shipped fixtures
also rewrites the pin in the code (``conformance/fixtures_pin.py``: the sha256 of the new
manifest), through which the runner trusts them; ``--check`` fails when the pin is stale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from multiattn import reference

from . import fixtures
from .cases import VARIANTS, expand


def build_all() -> list[dict]:
    return [case for variant in VARIANTS for case in expand(variant)]


def check(directory: Path) -> list[str]:
    """Differences between the committed fixtures and a fresh generation (empty: none)."""
    problems = []
    fresh = {c["name"]: c for c in build_all()}
    manifest = fixtures.read_manifest(directory)
    if manifest["oracle_version"] != reference.ORACLE_VERSION:
        problems.append(
            f"oracle version {manifest['oracle_version']} != {reference.ORACLE_VERSION}"
        )
    digest = fixtures.manifest_digest(manifest)
    if Path(directory).resolve() == fixtures.DEFAULT_DIR.resolve() and (
        digest != fixtures.pinned_digest()
    ):
        problems.append(
            f"the manifest's sha256 {digest} is not the one pinned in {fixtures.PIN_FILE.name} "
            f"({fixtures.pinned_digest()}); regenerate the fixtures to update the pin"
        )
    verified = fixtures.verify(directory, pinned=False)  # a stale pin is reported above
    problems += [f"{key}: {why}" for key, why in verified.tampered.items()]
    sound = [m["name"] for m in manifest["cases"] if not verified.is_tampered(m)]
    stored = {c.name: c for c in fixtures.load(verified, sound)}
    for name in sorted((set(fresh) ^ set(stored)) - set(verified.tampered)):
        problems.append(
            f"{name}: {'missing from' if name in fresh else 'not generated but in'} the fixtures"
        )
    meta = {c["name"]: c for c in manifest["cases"]}
    for name in sorted(set(fresh) & set(stored)):
        new, old = fresh[name], stored[name]
        for key in ("params", "tolerance", "family", "op", "dtype"):
            if new[key] != meta[name][key]:
                problems.append(f"{name}: {key} changed ({meta[name][key]!r} -> {new[key]!r})")
        old_arrays = {f"input/{k}": v for k, v in old.inputs.items()}
        old_arrays.update({f"weight/{k}": v for k, v in old.weights.items()})
        old_arrays.update({f"expected/{k}": v for k, v in old.expected.items()})
        old_arrays.update({f"grad/{k}": v for k, v in old.grads.items()})
        old_arrays["cotangent"] = old.cotangent
        grad_scale = max(
            (float(np.abs(v).max(initial=0.0)) for k, v in old_arrays.items() if _is_grad(k)),
            default=0.0,
        )
        for key in sorted(set(new["arrays"]) | set(old_arrays)):
            a, b = new["arrays"].get(key), old_arrays.get(key)
            if a is None or b is None or a.shape != b.shape or not _same(key, a, b, grad_scale):
                problems.append(f"{name}: array {key} differs")
    return problems


#: How far a fresh generation may drift from the committed fixtures (max absolute
#: difference over the largest magnitude). Inputs, weights and cotangents come from
#: seeded generators and must match exactly. Expected outputs are float64 oracle results:
#: NumPy's BLAS picks its kernels by CPU, so their last bits differ between machines
#: (seen: 2e-16). Gradients are central differences, which scale that rounding by 1/eps
#: (seen: 1e-9 of the case's largest gradient); they are compared against the case's
#: largest gradient, since some (a key bias, whose gradient is exactly 0) are pure noise.
EXPECTED_DRIFT = 1e-13
GRAD_DRIFT = 1e-8


def _is_grad(key: str) -> bool:
    return key.startswith("grad/")


def _same(key: str, a: np.ndarray, b: np.ndarray, grad_scale: float) -> bool:
    if np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f"):
        return True  # NaN where the other has NaN (the poisoned inputs) is the same
    if not (key.startswith("expected/") or _is_grad(key)) or a.dtype.kind != "f":
        return False
    if not (
        np.all(np.isfinite(a) == np.isfinite(b))
        and np.array_equal(a[~np.isfinite(a)], b[~np.isfinite(b)])
    ):
        return False
    diff = float(np.abs(np.where(np.isfinite(a), a - b, 0.0)).max(initial=0.0))
    if _is_grad(key):
        return diff <= GRAD_DRIFT * grad_scale
    return diff <= EXPECTED_DRIFT * float(np.abs(np.where(np.isfinite(b), b, 0.0)).max(initial=0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multiattn.conformance.generate")
    parser.add_argument("--check", action="store_true", help="regenerate in memory and compare")
    parser.add_argument("--out", type=Path, default=fixtures.DEFAULT_DIR, help="fixture directory")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for line in problems:
            print(f"drift: {line}")
        print("fixtures match the oracle" if not problems else f"{len(problems)} difference(s)")
        return 1 if problems else 0
    with tempfile.TemporaryDirectory(
        dir=args.out.parent if args.out.parent.exists() else None
    ) as tmp:
        manifest = fixtures.write(build_all(), Path(tmp), reference.ORACLE_VERSION)
        args.out.mkdir(parents=True, exist_ok=True)
        for old in args.out.glob("*.npz"):
            old.unlink()
        for path in Path(tmp).iterdir():
            path.replace(args.out / path.name)
    if args.out.resolve() == fixtures.DEFAULT_DIR.resolve():
        fixtures.write_pin(fixtures.manifest_digest(manifest))
        print(f"pinned the manifest's sha256 in {fixtures.PIN_FILE}")
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {len(manifest['cases'])} cases to {args.out} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
