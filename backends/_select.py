"""Choosing Keras' backend from an adapter module, before Keras is imported.

Imports nothing of Keras: an adapter calls `require_keras_backend` first thing, so that
importing ``multiattn.backends.torch`` alone selects Keras' torch backend.
"""

from __future__ import annotations

import os
import sys


def require_keras_backend(name: str) -> None:
    """Select Keras backend ``name`` before Keras is imported, or check the active one."""
    module = f"multiattn.backends.{name}"
    if "keras" in sys.modules:
        import keras

        active = keras.backend.backend()
        if active != name:
            raise ImportError(
                f"{module} needs Keras' {name!r} backend, but Keras is already running the "
                f"{active!r} backend, and Keras reads its backend once per process. Set "
                f"KERAS_BACKEND={name} (or leave it unset and import {module} before anything "
                "imports Keras) in a new Python process."
            )
        return
    requested = os.environ.get("KERAS_BACKEND", "").strip()
    if not requested:
        os.environ["KERAS_BACKEND"] = name
    elif requested.lower() != name:
        raise ImportError(
            f"{module} needs Keras' {name!r} backend, but KERAS_BACKEND={requested!r} "
            f"selects the {requested.lower()!r} backend. Set KERAS_BACKEND={name}, or unset "
            f"it and this import selects {name!r}."
        )
