"""One conformance target in its own process; prints one JSON line per event.

    python -m multiattn.conformance.worker --target keras-jax [--fixtures DIR] [--cases GLOB]

Events: ``{"event": "start", "target", "total", "informative"}``; per case ``{"event":
"begin", "case"}`` and then ``{"event": "case", "case", "family", "dtype", "status",
"metrics" | "reason"}``; at the end ``{"event": "done"}``. When the fixtures cannot be
trusted: ``{"event": "tampered", "reason"}`` and exit code 3. Events are the only output
on stdout (anything else printed goes to stderr). Status is ``pass``, ``fail``, ``skip``
(the target does not support the case) or ``error`` (it raised); an informative target (a
framework's own layer, ``informative = True``) may also report ``depart``: a recorded
departure on fully masked rows (see `multiattn.conformance.departures`), with what
departed in ``reason``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

from . import departures, fixtures
from .import_order import import_triton_first

#: Where events go: the process's original stdout. `claim_stdout` points file descriptor 1
#: (``print``, and whatever a framework's C code writes there) at stderr, so that nothing but
#: events reaches the runner on this stream.
_events = sys.stdout
TAMPERED_EXIT = 3


def claim_stdout() -> None:
    global _events
    sys.stdout.flush()
    _events = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def emit(**event: Any) -> None:
    _events.write(json.dumps(event) + "\n")
    _events.flush()


def exit_with_parent() -> None:
    """End this process when the runner that started it is gone (killed without a chance
    to stop its workers), instead of running, or hanging, on as an orphan."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def compare(
    case: fixtures.Case,
    result: dict[str, np.ndarray],
    overrides: dict[str, float],
    unchecked: tuple[str, ...] = (),
) -> dict:
    """Max absolute and relative error of every expected array; pass/fail against tolerances.

    Relative error is ``max|got - want| / max|want|`` for outputs; for gradients the
    denominator is the largest expected gradient of the case, since some gradients are
    exactly zero (the key bias never changes a softmax) and have no scale of their own.
    Expected arrays named in ``unchecked`` (ones the target's layer does not return, such
    as the weights of a fused attention function) are not compared.
    """
    metrics = {}
    grad_scale = max((float(np.abs(g).max(initial=0.0)) for g in case.grads.values()), default=0.0)
    passed = True
    tolerance = {**case.tolerance, **overrides}
    expected = {**case.expected, **{f"grad/{k}": v for k, v in case.grads.items()}}
    for key, want in expected.items():
        if key in unchecked:
            continue
        if key not in result:
            if key.startswith("grad/") and not any(k.startswith("grad/") for k in result):
                continue  # the target computes no gradients (inference-only framework)
            metrics[key] = {"missing": True}
            passed = False
            continue
        got = np.asarray(result[key], dtype=np.float64)
        if got.shape != want.shape:
            metrics[key] = {"shape": list(got.shape), "expected_shape": list(want.shape)}
            passed = False
            continue
        diff = np.abs(got - want)
        max_abs = float(diff.max(initial=0.0)) if np.all(np.isfinite(got)) else float("inf")
        scale = grad_scale if key.startswith("grad/") else float(np.abs(want).max(initial=0.0))
        max_rel = max_abs / scale if scale > 0 else max_abs
        tol = tolerance["grad" if key.startswith("grad/") else "output"]
        ok = max_rel <= tol
        passed &= ok
        metrics[key] = {"max_abs": max_abs, "max_rel": max_rel, "tol": tol, "ok": ok}
    if not metrics:  # nothing compared is no evidence of agreement
        metrics["output"] = {"missing": True, "reason": "no expected array was compared"}
        passed = False
    return {"passed": passed, "metrics": metrics}


def apply_strict(framework: str) -> None:
    """Deterministic kernels, highest matmul precision, no TF32."""
    if framework == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
    elif framework == "torch":
        import torch

        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif framework == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
        tf.config.experimental.enable_tensor_float_32_execution(False)


def load_target(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    obj = getattr(importlib.import_module(module), attr or "Target")
    target = obj() if isinstance(obj, type) or not hasattr(obj, "run") else obj
    if callable(target) and not hasattr(target, "run"):  # a plain function run(case) -> dict
        fn = target
        target = type(
            "FunctionTarget",
            (),
            {"name": spec, "run": staticmethod(fn), "supports": staticmethod(lambda c: True)},
        )()
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multiattn.conformance.worker")
    parser.add_argument("--target", required=True, help="module:callable of the target")
    parser.add_argument("--name", default=None)
    parser.add_argument("--fixtures", default=None)
    parser.add_argument("--cases", default="*")
    parser.add_argument("--tolerance", default="{}", help="JSON {dtype: {output|grad: tol}}")
    parser.add_argument("--strict", default="", help="framework to make deterministic")
    parser.add_argument(
        "--manifest-sha256",
        default="",
        help="the manifest digest the runner verified: refuse any other manifest",
    )
    args = parser.parse_args(argv)
    import_triton_first()  # before the target can load TensorFlow (see `import_order`)
    claim_stdout()
    if os.name == "posix":
        exit_with_parent()
    if args.strict:
        apply_strict(args.strict)
    target = load_target(args.target)
    name = args.name or getattr(target, "name", args.target)
    patterns = [p.strip() for p in args.cases.split(",") if p.strip()]
    try:
        verified = fixtures.verify(args.fixtures)
        if args.manifest_sha256 and verified.digest != args.manifest_sha256:
            raise fixtures.TamperedError(
                f"{verified.directory / 'manifest.json'} changed since the run started "
                f"(sha256 {verified.digest}, verified {args.manifest_sha256})"
            )
        sound, _ = verified.select(patterns)  # the runner reports the tampered ones
        cases = fixtures.load(verified, sound)
    except fixtures.TamperedError as err:
        emit(event="tampered", reason=str(err))
        return TAMPERED_EXIT
    overrides = json.loads(args.tolerance)
    informative = bool(getattr(target, "informative", False))
    emit(event="start", target=name, total=len(cases), informative=informative)
    for case in cases:
        emit(event="begin", case=case.name)  # so that a hang can be placed
        base = {"event": "case", "case": case.name, "family": case.family, "dtype": case.dtype}
        support = target.supports(case) if hasattr(target, "supports") else True
        if support is not True:
            emit(**base, status="skip", reason=str(support or "not supported"))
            continue
        try:
            result = target.run(case)
            unchecked = tuple(target.unchecked(case)) if hasattr(target, "unchecked") else ()
            verdict = compare(case, result, overrides.get(case.dtype, {}), unchecked)
            status, note = ("pass" if verdict["passed"] else "fail"), ""
            if informative:
                status, note = departures.verdict(
                    getattr(target, "name", name), case, verdict["passed"], result
                )
        except Exception as err:  # reported, never fatal for the other cases
            if informative:  # a recorded error of a framework's own layer is a departure
                status, note = departures.verdict(
                    getattr(target, "name", name), case, False, None, f"{type(err).__name__}: {err}"
                )
                if status == "depart":
                    emit(**base, status=status, reason=note)
                    continue
            emit(
                **base,
                status="error",
                reason=f"{type(err).__name__}: {err}",
                trace=traceback.format_exc()[-3000:],
            )
            continue
        extra = {"reason": note} if note else {}
        emit(**base, status=status, metrics=verdict["metrics"], **extra)
    emit(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
