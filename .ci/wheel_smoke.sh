#!/usr/bin/env bash
# CI: build the wheel and use it from a fresh virtual environment, away from the checkout.
#
# The fresh environment gets the dependencies already installed in the checkout's .venv
# through a .pth file naming .venv's site-packages: a plain path entry, so .venv's own .pth
# files (the editable install's import hook among them) are not run and `multiattn` can
# only come from the wheel. Checked: `import multiattn` fails before the wheel is
# installed and resolves into the fresh environment after. Then, from a directory outside
# the checkout: every module of the installed package is imported (pkgutil.walk_packages),
# `multiattn demo` runs on the numpy backend and `multiattn conformance` runs the Paddle
# target (the subpackages a hand-written package list once left out of the wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="$ROOT/.venv/bin/python"
START=$SECONDS

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir "$TMP/src" "$TMP/dist" "$TMP/run"

# Build from a copy of the files git knows of (tracked or not ignored), so no build/ or
# egg-info of the checkout goes into the wheel or is left behind.
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf - | tar -xf - -C "$TMP/src"
"$PY" -m pip wheel --no-deps -q -w "$TMP/dist" "$TMP/src"
WHEEL="$(echo "$TMP"/dist/multiattn-*.whl)"
echo "wheel-smoke: built $(basename "$WHEEL")"

"$PY" -m venv --without-pip "$TMP/venv"
VPY="$TMP/venv/bin/python"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
SITE="$(purelib "$VPY")"
purelib "$PY" >"$SITE/_repo_venv_deps.pth"
echo "wheel-smoke: fresh venv $TMP/venv; dependencies from $(cat "$SITE/_repo_venv_deps.pth")"

cd "$TMP/run"  # neither the checkout nor its copy is on sys.path from here
if before="$("$VPY" -c 'import multiattn' 2>&1)" || [[ $before != *"No module named 'multiattn'"* ]]; then
    echo "wheel-smoke: before the wheel is installed, import multiattn must fail; got: $before" >&2
    exit 1
fi
echo "wheel-smoke: before the wheel, import multiattn fails (as it must)"

"$PY" -m pip --python "$VPY" install -q --no-deps --no-index --ignore-installed "$WHEEL"
echo "wheel-smoke: installed the wheel ($((SECONDS - START))s so far)"

"$VPY" - "$SITE" "$TMP/src" <<'EOF'
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's dependency
    import tomli as tomllib

site, src = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
# Paddle must be imported before anything imports TensorFlow (else it crashes): its
# subpackage first, then the rest in walk order.
import multiattn
import multiattn.paddle  # noqa: F401

home = Path(multiattn.__file__).resolve().parent
print(f"wheel-smoke: multiattn.__file__ = {multiattn.__file__}")
assert home == site / "multiattn", f"multiattn comes from {home}, not the wheel in {site}"
OPTIONAL = {"torch", "tensorflow", "jax", "jaxlib", "flax", "paddle", "matplotlib"}
ALONE = "import importlib, sys; print(importlib.import_module(sys.argv[1]).__file__)"
imported, alone, skipped = [], [], []
for info in pkgutil.walk_packages(multiattn.__path__, "multiattn."):
    name = info.name
    if name.rpartition(".")[2] == "__main__":
        skipped.append(f"{name} (runs the program when imported)")
        continue
    try:
        where = importlib.import_module(name).__file__
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] not in OPTIONAL:
            raise
        skipped.append(f"{name} (needs {err.name}, not installed)")
        continue
    except ImportError as err:
        # An adapter that selects its own Keras backend (Keras reads it once per process)
        # cannot share this process: it is imported alone in a new one.
        env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
        run = [sys.executable, "-c", ALONE, name]
        done = subprocess.run(run, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{name} fails to import alone too:\n{done.stderr[-3000:]}")
        where = done.stdout.strip().splitlines()[-1]
        alone.append(f"{name} ({str(err).split(', but ')[0]})")
    assert Path(where).resolve().is_relative_to(home), f"{name} comes from {where}"
    imported.append(name)
packages = sorted(n for n in imported if hasattr(sys.modules.get(n), "__path__"))
print(f"wheel-smoke: imported {len(imported)} modules; packages: multiattn {' '.join(packages)}")
# Every module of the source folders (pyproject's package-dir) was installed and walked.
walked = {"multiattn", *imported, *(reason.split()[0] for reason in skipped)}
setuptools = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]
for package, folder in setuptools["package-dir"].items():
    base = src / folder
    for path in base.rglob("*.py"):
        parts = path.relative_to(base).with_suffix("").parts
        if all(base.joinpath(*parts[:i], "__init__.py").is_file() for i in range(len(parts))):
            name = ".".join((package, *parts)).removesuffix(".__init__")
            assert name in walked, f"{name} ({path.relative_to(src)}) is not in the wheel"
for reason in alone:
    print(f"wheel-smoke: imported in a process of its own: {reason}")
for reason in skipped:
    print(f"wheel-smoke: skipped {reason}")
EOF

echo "wheel-smoke: ($((SECONDS - START))s so far) \$ multiattn demo --backends numpy"
"$TMP/venv/bin/multiattn" demo --backends numpy
echo "wheel-smoke: ($((SECONDS - START))s so far) \$ multiattn conformance --targets paddle --require-all"
"$TMP/venv/bin/multiattn" conformance --targets paddle --require-all
echo "wheel-smoke: passed in $((SECONDS - START))s"
