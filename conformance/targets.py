"""The built-in conformance targets: what to run, in which process environment.

A target is a ``module:callable`` run by `multiattn.conformance.worker` in its own
process. The callable builds an object with ``name``, ``supports(case) -> True | reason``
and ``run(case) -> {"output": ..., "weights": ..., "grad/input/<name>": ...,
"grad/weight/<name>": ...}`` (NumPy arrays; gradients of ``sum(output * case.cotangent)``).
A plain function ``run(case)`` works too. Adding a target is one entry below, or, for your
own implementation, ``--target module:callable`` or an entry point in the group
``multiattn.conformance_targets``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points


@dataclass(frozen=True)
class TargetSpec:
    name: str
    factory: str  # module:callable
    env: dict[str, str | None] = field(default_factory=dict)  # None removes the variable
    requires: tuple[str, ...] = ()  # importable modules the target needs
    strict: str = ""  # framework whose deterministic settings --strict applies
    description: str = ""


_CORE = "multiattn.conformance.target_core:CoreTarget"

BUILTIN: dict[str, TargetSpec] = {
    spec.name: spec
    for spec in (
        TargetSpec(
            "keras-jax",
            _CORE,
            {"KERAS_BACKEND": "jax", "JAX_ENABLE_X64": "1"},
            ("jax",),
            "jax",
            "the core on Keras' jax backend",
        ),
        TargetSpec(
            "keras-torch",
            _CORE,
            {"KERAS_BACKEND": "torch"},
            ("torch",),
            "torch",
            "the core on Keras' torch backend",
        ),
        TargetSpec(
            "keras-tensorflow",
            _CORE,
            {"KERAS_BACKEND": "tensorflow"},
            ("tensorflow",),
            "tensorflow",
            "the core on Keras' tensorflow backend",
        ),
        TargetSpec(
            "keras-numpy",
            _CORE,
            {"KERAS_BACKEND": "numpy"},
            (),
            "",
            "the core on Keras' numpy backend (inference only)",
        ),
    )
}


for _spec in (
    TargetSpec(
        "paddle",
        "multiattn.conformance.target_paddle:PaddleCoreTarget",
        {"KERAS_BACKEND": None},
        ("paddle",),
        "",
        "the core functions on Paddle tensors",
    ),
    TargetSpec(
        "paddle-layers",
        "multiattn.conformance.target_paddle:PaddleLayerTarget",
        {"KERAS_BACKEND": None},
        ("paddle",),
        "",
        "the Paddle twins of the layers (multiattn.paddle.layers)",
    ),
    TargetSpec(
        "adapter-torch",
        "multiattn.conformance.target_adapters:TorchDocumentTarget",
        {"KERAS_BACKEND": "torch"},
        ("torch",),
        "torch",
        "the PyTorch (d2l) document adapter",
    ),
    TargetSpec(
        "adapter-tensorflow",
        "multiattn.conformance.target_adapters:TensorFlowDocumentTarget",
        {"KERAS_BACKEND": "tensorflow"},
        ("tensorflow",),
        "tensorflow",
        "the TensorFlow document adapter",
    ),
    TargetSpec(
        "adapter-paddle",
        "multiattn.conformance.target_paddle:PaddleDocumentTarget",
        {"KERAS_BACKEND": None},
        ("paddle",),
        "",
        "the PaddlePaddle document adapter",
    ),
):
    BUILTIN[_spec.name] = _spec


# The frameworks' own layers: informative targets whose recorded departures on fully
# masked rows are not failures (see multiattn.conformance.departures).
_NATIVE = "multiattn.conformance.target_native:"
for _spec in (
    TargetSpec(
        "native-torch",
        _NATIVE + "TorchNativeTarget",
        {"KERAS_BACKEND": None},
        ("torch",),
        "torch",
        "torch's own F.scaled_dot_product_attention and nn.MultiheadAttention",
    ),
    TargetSpec(
        "native-jax",
        _NATIVE + "JaxNativeTarget",
        {"KERAS_BACKEND": None, "JAX_ENABLE_X64": "1"},
        ("jax", "flax"),
        "jax",
        "jax.nn.dot_product_attention and flax.nnx.MultiHeadAttention",
    ),
    *(
        TargetSpec(
            f"native-keras-{backend}",
            _NATIVE + "KerasNativeTarget",
            {"KERAS_BACKEND": backend, **({"JAX_ENABLE_X64": "1"} if backend == "jax" else {})},
            (backend,),
            backend,
            f"keras.layers.MultiHeadAttention on Keras' {backend} backend",
        )
        for backend in ("jax", "torch", "tensorflow")
    ),
    TargetSpec(
        "native-paddle",
        "multiattn.conformance.target_native_paddle:PaddleNativeTarget",
        {"KERAS_BACKEND": None},
        ("paddle",),
        "",
        "paddle.nn.MultiHeadAttention",
    ),
):
    BUILTIN[_spec.name] = _spec


def discovered() -> dict[str, TargetSpec]:
    """Targets registered by installed packages (entry point group
    ``multiattn.conformance_targets``: ``name = "module:callable"``)."""
    found = {}
    for ep in entry_points(group="multiattn.conformance_targets"):
        found[ep.name] = TargetSpec(ep.name, ep.value, description="entry point")
    return found


def all_targets() -> dict[str, TargetSpec]:
    return {**BUILTIN, **discovered()}
