"""The Paddle holders: the part of ``keras.layers.Layer`` that multiattn's layer
definitions use, on a ``paddle.nn.Layer``, and Paddle stand-ins for the three Keras
layers those definitions build as sublayers (``EinsumDense``, ``Dropout`` and the weights
of ``LayerNormalization``).

A holder holds parameters and runs no model math of its own: `PaddleLayer` turns
``add_weight`` into Paddle parameters, builds on the first call from the call's shapes
(as Keras does), casts floating inputs to the compute dtype, passes the Paddle layer's
``training`` flag, and refuses tensors of other frameworks. `EinsumDense` and `Dropout`
compute through the `multiattn.ops` namespace of their input, like every definition.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import types
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import paddle

from .._checks import describe, is_floating
from ..namespaces.keras import framework_of, get_ops
from ..ops.activations import activation, check_activation

__all__ = ["Dropout", "EinsumDense", "KerasLayerNormalization", "PaddleLayer", "keras_on_paddle"]

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def dtype_name(where: str, dtype: Any) -> str:
    """A layer's ``dtype`` on Paddle: None (float32), a floating dtype name, or a Keras
    dtype policy (object or config) whose compute and variable dtypes agree. Mixed
    precision policies are refused: a Paddle layer holds its parameters in its one dtype."""
    if dtype is None:
        return "float32"
    if isinstance(dtype, dict):  # a serialized Keras DTypePolicy
        dtype = dtype.get("config", {}).get("name", dtype)
    if hasattr(dtype, "compute_dtype") and hasattr(dtype, "variable_dtype"):
        if dtype.compute_dtype != dtype.variable_dtype:
            raise ValueError(
                f"{where}: mixed-precision dtype policies are not supported on Paddle; "
                f"received `dtype`={dtype.name!r}."
            )
        dtype = dtype.compute_dtype
    name = str(dtype).replace("paddle.", "")
    if name.startswith("mixed_"):
        raise ValueError(
            f"{where}: mixed-precision dtype policies are not supported on Paddle; "
            f"received `dtype`={name!r}."
        )
    if name not in _FLOAT_DTYPES:
        raise ValueError(
            f"{where}: `dtype` must be one of {', '.join(_FLOAT_DTYPES)} (or a Keras dtype "
            f"policy of one); received {describe(dtype)}."
        )
    return name


def _refuse_settings(where: str, **settings: Any) -> None:
    """Keras settings with no Paddle counterpart: refused when set, never dropped."""
    given = sorted(k for k, v in settings.items() if v is not None)
    if given:
        raise ValueError(
            f"{where}: {', '.join(f'`{k}`' for k in given)} not supported on Paddle "
            f"(received {', '.join(f'{k}={settings[k]!r}' for k in given)}); use Paddle's "
            "own means (weight decay in the optimizer, gradient clipping)."
        )


def _forward_with_signature_of(call: Any) -> Any:
    """A ``forward`` with the parameters of ``call`` (``paddle.jit.to_static`` reads the
    parameters of ``forward``) that runs `PaddleLayer._forward`."""
    sig = inspect.signature(call)
    params = list(sig.parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params):
        return PaddleLayer.forward
    defaults = {f"_d{i}": p.default for i, p in enumerate(params)}
    parts, star = ["self"], False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}=_d{i}")
    names = ", ".join(f"{p.name!r}: {p.name}" for p in params)
    source = f"def forward({', '.join(parts)}):\n    return self._forward_arguments({{{names}}})\n"
    scope: dict = dict(defaults)
    exec(source, scope)
    forward = scope["forward"]
    forward.__doc__ = call.__doc__
    return forward


class PaddleLayer(paddle.nn.Layer):
    """A ``paddle.nn.Layer`` offering the ``keras.layers.Layer`` surface the definitions use.

    * ``name``, ``dtype`` (a floating dtype name or a Keras dtype policy; default
      float32), ``trainable``: the Keras layer arguments; others raise ``TypeError``.
    * ``add_weight``: a Paddle parameter, initialised by the same Keras initializer as the
      Keras twin (so both start from the same distribution).
    * Calling the layer (Paddle's ``__call__`` -> ``forward``) builds it on the first
      call from the shapes of the call's arguments (``build(x_shape)`` gets the shape of
      ``x``, as in Keras), converts NumPy arrays to Paddle tensors, casts floating inputs
      to the compute dtype, and passes ``training=self.training`` (``layer.train()`` /
      ``layer.eval()``) where the call takes ``training`` and it is not given.
    """

    _WHERE: str | None = None

    def __init__(self, name: str | None = None, dtype: Any = None, trainable: bool = True, **kw):
        where = self._where()
        if kw:
            raise TypeError(
                f"{where}: unknown argument(s) {', '.join(sorted(kw))} (a Paddle layer takes "
                "the Keras layer arguments `name`, `dtype` and `trainable` only)."
            )
        compute = dtype_name(where, dtype)
        super().__init__(name_scope=name, dtype=compute)
        self.name = name or _snake(type(self).__name__)
        self._compute_dtype = compute
        self.trainable = bool(trainable)
        self.built = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "call" in cls.__dict__ and "forward" not in cls.__dict__:
            cls.forward = _forward_with_signature_of(cls.__dict__["call"])
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_marks_built", False):

            @functools.wraps(build)
            def marked(self, *args, **kw):
                build(self, *args, **kw)
                self.built = True

            marked._marks_built = True
            cls.build = marked

    def _where(self) -> str:
        return getattr(self, "_WHERE", None) or type(self).__name__

    # -- Keras' layer surface ----------------------------------------------------------------

    @property
    def compute_dtype(self) -> str:
        return self._compute_dtype

    variable_dtype = compute_dtype
    dtype_policy = compute_dtype

    def build(self, *args: Any, **kwargs: Any) -> None:
        self.built = True

    def add_weight(
        self,
        shape: Any = None,
        initializer: Any = None,
        dtype: Any = None,
        trainable: bool = True,
        name: str | None = None,
        regularizer: Any = None,
        constraint: Any = None,
        **kwargs: Any,
    ) -> Any:
        """A Paddle parameter of ``shape``, drawn by the Keras ``initializer`` (default
        ``glorot_uniform``, as Keras for floating weights)."""
        where = f"{self._where()}.add_weight"
        _refuse_settings(where, regularizer=regularizer, constraint=constraint)
        dtype = self.variable_dtype if dtype is None else dtype_name(where, dtype)
        shape = tuple(int(d) for d in (shape or ()))
        init = keras.initializers.get("glorot_uniform" if initializer is None else initializer)
        value = np.asarray(keras.ops.convert_to_numpy(init(shape, dtype="float32")))
        param = self.create_parameter(
            list(shape), dtype=dtype, default_initializer=paddle.nn.initializer.Constant(0.0)
        )
        param.set_value(paddle.to_tensor(value, dtype="float32").astype(dtype))
        param.stop_gradient = not (trainable and self.trainable)
        param.keras_name = name or f"variable_{len(self._parameters)}"
        param.assign = functools.partial(_assign, param)  # as a Keras variable
        return param

    # -- variables by path, and calls on given values ------------------------------------------

    def _owned(self, prefix: str = "") -> list:
        """``(owner, attribute, parameter)`` of every parameter, owners depth first; each
        parameter gets ``path``, its Keras path (layer names joined by ``/``)."""
        path = f"{prefix}{self.name}/"
        found = []
        for attr, param in self._parameters.items():
            if param is not None:
                param.path = path + getattr(param, "keras_name", attr)
                found.append((self, attr, param))
        for layer in self._sub_layers.values():
            if isinstance(layer, PaddleLayer):
                found += [f for f in layer._owned(path) if all(f[2] is not g[2] for g in found)]
        return found

    @property
    def trainable_variables(self) -> list:
        """The trainable parameters, each with ``path`` (as Keras names its variables)."""
        return [p for _, _, p in self._owned() if not p.stop_gradient]

    @property
    def weights(self) -> list:
        """Every parameter, each with ``path``."""
        return [p for _, _, p in self._owned()]

    @property
    def non_trainable_variables(self) -> list:
        return [p for _, _, p in self._owned() if p.stop_gradient]

    @contextlib.contextmanager
    def stateless_scope(self, values: Any) -> Iterator[None]:
        """Within the scope the layer reads ``values`` (tensors, in the order of
        `trainable_variables`) in place of its trainable parameters, differentiably: the
        Paddle counterpart of Keras' ``StatelessScope``. The parameters are restored on exit."""
        owned = [o for o in self._owned() if not o[2].stop_gradient]
        values = list(values)
        if len(values) != len(owned):
            raise ValueError(
                f"{self._where()}.stateless_scope: `values` must hold {len(owned)} tensors (one "
                f"per trainable variable); received {len(values)}."
            )
        for (owner, attr, param), value in zip(owned, values):
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"{self._where()}.stateless_scope: the value for {param.path} must have "
                    f"shape {tuple(param.shape)}; received {tuple(value.shape)}."
                )
            owner._parameters[attr] = value
        try:
            yield
        finally:
            for owner, attr, param in owned:
                owner._parameters[attr] = param

    def stateless_call(self, trainable_variables: Any, non_trainable_variables: Any, *args, **kw):
        """``(outputs, non_trainable_variables)`` of a call reading ``trainable_variables``
        (see `stateless_scope`), as Keras' ``stateless_call`` returns them."""
        with self.stateless_scope(trainable_variables):
            return self(*args, **kw), list(non_trainable_variables)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if isinstance(value, (list, tuple)):  # sublayers kept in a list are still sublayers
            for i, item in enumerate(value):
                if isinstance(item, paddle.nn.Layer):
                    self.add_sublayer(f"{name.lstrip('_')}_{i}", item)

    def get_config(self) -> dict:
        return {"name": self.name, "dtype": self.compute_dtype, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config: dict) -> Any:
        """The layer of a config, a Keras twin's ``get_config()`` included."""
        return cls(**config)

    # -- the call ------------------------------------------------------------------------------

    @functools.cached_property
    def _call_signature(self) -> inspect.Signature:
        return inspect.signature(self.call)

    def _convert(self, x: Any, name: str) -> Any:
        framework = framework_of(x)
        if framework not in (None, "paddle"):
            raise TypeError(
                f"{self._where()}: `{name}` must be a Paddle tensor or a NumPy array; received "
                f"{describe(x)} (a {framework} tensor). A Paddle layer computes on Paddle tensors."
            )
        if isinstance(x, (np.ndarray, np.generic)):
            kind = np.asarray(x).dtype.kind
            if kind not in "biuf" and not is_floating(np.asarray(x).dtype):  # strings, objects,
                # complex: paddle's own error names no argument
                raise TypeError(
                    f"{self._where()}: `{name}` must be a bool, integer or floating array; "
                    f"received dtype {np.asarray(x).dtype}."
                )
            return paddle.to_tensor(x, dtype=self.compute_dtype if kind == "f" else None)
        if isinstance(x, paddle.Tensor) and x.is_floating_point():
            if get_ops(x).dtype_name(x) != self.compute_dtype:
                return x.astype(self.compute_dtype)
        return x

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(self._call_signature.bind(*args, **kwargs))

    def _forward_arguments(self, arguments: dict) -> Any:
        bound = self._call_signature.bind_partial()
        bound.arguments.update(arguments)
        return self._forward(bound)

    def _forward(self, bound: inspect.BoundArguments) -> Any:
        for key, value in bound.arguments.items():
            if isinstance(value, (np.ndarray, np.generic, paddle.Tensor)) or framework_of(value):
                bound.arguments[key] = self._convert(value, key)
        if "training" in self._call_signature.parameters:
            if bound.arguments.get("training") is None:
                bound.arguments["training"] = self.training
        if not self.built:
            self._build_from(bound)
        return self.call(*bound.args, **bound.kwargs)

    def _build_from(self, bound: inspect.BoundArguments) -> None:
        """Keras' rule: ``build(x_shape, y_shape)`` gets the shapes of the call arguments
        ``x`` and ``y``; a single ``build`` argument gets the shape of the first."""
        params = [p for p in inspect.signature(self.build).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
        first = next(iter(bound.arguments.values()))
        if len(params) <= 1 or not all(p.name.endswith("_shape") for p in params):
            self.build(tuple(first.shape)) if params else self.build()
            return
        shapes = {}
        for p in params:
            value = bound.arguments.get(p.name[: -len("_shape")])
            shapes[p.name] = None if value is None else tuple(value.shape)
        self.build(**shapes)


def _assign(param: Any, value: Any) -> None:
    """``param`` set to ``value`` (an array or tensor) in the parameter's dtype."""
    if not isinstance(value, paddle.Tensor):
        value = np.asarray(value)  # bfloat16 (ml_dtypes) goes in as its bits, which Paddle reads so
        value = paddle.to_tensor(value.view(np.uint16) if value.dtype.name == "bfloat16" else value)
    param.set_value(value.astype(param.dtype))


def _sigmoid(x: Any) -> Any:
    ops = get_ops(x)  # (1 + tanh(x / 2)) / 2: never overflows
    return (ops.tanh(x * 0.5) + 1.0) * 0.5


def _activation(where: str, name: Any) -> Any:
    """A sublayer's activation on Paddle, by name: Keras' ``linear`` object for none (the
    definitions test for it), else a function over the namespace."""
    if name is None or name == "linear":
        return keras.activations.linear
    if name == "sigmoid":
        return _sigmoid
    name = check_activation(where, name)
    return functools.partial(activation, name=name)


class EinsumDense(PaddleLayer):
    """Paddle stand-in for ``keras.layers.EinsumDense``: the same arguments, kernel and
    bias shapes and initialisation; ``equation`` with explicit letters (no ``...``)."""

    def __init__(
        self,
        equation: str,
        output_shape: Any,
        activation: Any = None,
        bias_axes: str | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        lora_rank: Any = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        _refuse_settings(
            "EinsumDense",
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            lora_rank=lora_rank,
        )
        self.equation = equation
        shape = output_shape if isinstance(output_shape, (list, tuple)) else [output_shape]
        self.partial_output_shape = list(shape)
        self.bias_axes = bias_axes
        self.activation = _activation("EinsumDense", activation)
        self.kernel_initializer = kernel_initializer
        self.bias_initializer = bias_initializer
        self.quantization_mode = None
        self.lora_enabled = False
        self.activity_regularizer = None
        self.bias = None

    def build(self, input_shape):
        spec_in, rest = self.equation.split(",")
        spec_kernel, spec_out = rest.split("->")
        if spec_in.startswith("..."):  # Keras: the shape excludes the ellipsis axes
            spec_in, spec_out = spec_in[3:], spec_out[3:]
            dims = dict(zip(spec_in, tuple(input_shape)[len(tuple(input_shape)) - len(spec_in) :]))
            given = self.partial_output_shape
        else:  # Keras: the shape excludes the first (batch) axis
            dims = dict(zip(spec_in, input_shape))
            given = [None, *self.partial_output_shape]
        for c, d in zip(spec_out, given):
            if d is not None:
                dims[c] = d
        self.kernel = self.add_weight(
            tuple(dims[c] for c in spec_kernel), self.kernel_initializer, name="kernel"
        )
        if self.bias_axes:
            first = min(spec_out.find(c) for c in self.bias_axes)
            shape = tuple(dims[c] if c in self.bias_axes else 1 for c in spec_out[first:])
            self.bias = self.add_weight(shape, self.bias_initializer, name="bias")

    def call(self, inputs):
        ops = get_ops(inputs)
        y = ops.einsum(self.equation, inputs, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)


class Dropout(PaddleLayer):
    """Paddle stand-in for ``keras.layers.Dropout``: ``rate``; with ``seed`` the draws
    come from a seeded generator (reproducible), without it from Paddle's own generator
    (``paddle.seed``). ``noise_shape`` is refused."""

    def __init__(self, rate: float, noise_shape: Any = None, seed: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        _refuse_settings("Dropout", noise_shape=noise_shape)
        self.rate = float(rate)
        self.seed = seed
        self.seed_generator = None if seed is None else keras.random.SeedGenerator(seed)

    def call(self, inputs, training=False):
        if not training or self.rate == 0.0:
            return inputs
        return get_ops(inputs).dropout(inputs, self.rate, seed=self.seed_generator)


class Embedding(PaddleLayer):
    """Paddle stand-in for ``keras.layers.Embedding``: ``embeddings`` ``(input_dim,
    output_dim)``, the rows of integer ``inputs``. ``mask_zero`` is refused (no Keras
    masks on Paddle)."""

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        embeddings_initializer: Any = "uniform",
        embeddings_regularizer: Any = None,
        embeddings_constraint: Any = None,
        mask_zero: bool = False,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        _refuse_settings(
            "Embedding",
            embeddings_regularizer=embeddings_regularizer,
            embeddings_constraint=embeddings_constraint,
            mask_zero=mask_zero or None,
        )
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings_initializer = embeddings_initializer

    def build(self, input_shape=None):
        self.embeddings = self.add_weight(
            (self.input_dim, self.output_dim), self.embeddings_initializer, name="embeddings"
        )

    def call(self, inputs):
        return get_ops(inputs).take(self.embeddings, inputs, axis=0)


class KerasLayerNormalization(PaddleLayer):
    """What ``multiattn.layers.LayerNormalization`` inherits from
    ``keras.layers.LayerNormalization`` on Paddle: the arguments and the ``gamma`` and
    ``beta`` weights. Its computation is multiattn's (`multiattn.ops.layer_norm`, over
    the last axis); Keras' own computation (other axes, ``rms_scaling``) does not exist
    on Paddle and is refused."""

    def __init__(
        self,
        axis: Any = -1,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        rms_scaling: bool = False,
        beta_initializer: Any = "zeros",
        gamma_initializer: Any = "ones",
        beta_regularizer: Any = None,
        gamma_regularizer: Any = None,
        beta_constraint: Any = None,
        gamma_constraint: Any = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        _refuse_settings(
            "LayerNormalization",
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
        )
        if rms_scaling:
            raise ValueError(
                "LayerNormalization: `rms_scaling=True` (Keras' deprecated option) is not "
                "supported on Paddle; use multiattn.paddle.layers.RMSNormalization."
            )
        self.axis, self.epsilon = axis, float(epsilon)
        self.center, self.scale, self.rms_scaling = center, scale, rms_scaling
        self.beta_initializer, self.gamma_initializer = beta_initializer, gamma_initializer
        self.gamma = self.beta = None

    def build(self, input_shape):
        axes = self.axis if isinstance(self.axis, list) else [self.axis]
        shape = tuple(input_shape[a] for a in axes)
        if self.scale:
            self.gamma = self.add_weight(shape, self.gamma_initializer, name="gamma")
        if self.center:
            self.beta = self.add_weight(shape, self.beta_initializer, name="beta")

    def call(self, inputs):
        raise ValueError(
            f"LayerNormalization: on Paddle the layer normalises over the last axis only; "
            f"received `axis`={self.axis!r} for inputs of shape {tuple(inputs.shape)}."
        )


def _scalar_or_tensor(x: Any, like: Any) -> Any:
    return x if isinstance(x, paddle.Tensor) else paddle.full([], x, dtype=like.dtype)


class _KerasOps:
    """``keras.ops`` as the definitions see it on Paddle: the operations of the Paddle
    namespace (`multiattn.namespaces.paddle`), and Paddle's own functions for the few
    ``keras.ops`` names outside the namespace contract that the model definitions use
    (each with the ``keras.ops`` meaning)."""

    def __init__(self) -> None:
        functional = paddle.nn.functional
        self._namespace = get_ops(paddle.zeros([0]))
        self._extra = {
            "ones_like": lambda x, dtype=None: paddle.ones_like(x, dtype=dtype),
            "cumsum": lambda x, axis=None, dtype=None: paddle.cumsum(x, axis=axis, dtype=dtype),
            "maximum": lambda a, b: paddle.maximum(a, _scalar_or_tensor(b, a)),
            "minimum": lambda a, b: paddle.minimum(a, _scalar_or_tensor(b, a)),
            "sqrt": paddle.sqrt,
            "sigmoid": _sigmoid,
            "relu": functional.relu,
            "gelu": lambda x, approximate=True: functional.gelu(x, approximate=approximate),
            "argmax": lambda x, axis=None, keepdims=False: paddle.argmax(
                x, axis=axis, keepdim=keepdims
            ),
            "full": lambda shape, fill_value, dtype=None: paddle.full(
                list(shape), fill_value, dtype=dtype
            ),
            "stack": lambda xs, axis=0: paddle.stack(list(xs), axis=axis),
        }

    def __getattr__(self, name: str) -> Any:
        if name in self._extra:
            return self._extra[name]
        try:
            return getattr(self._namespace, name)
        except AttributeError:
            raise AttributeError(
                f"keras.ops.{name} has no Paddle counterpart in multiattn (a definition run "
                "on Paddle may use the operations of the namespace contract and a few more, "
                "listed in multiattn.paddle._holder._KerasOps)."
            ) from None


def keras_on_paddle() -> types.ModuleType:
    """The ``keras`` the definitions see on Paddle: Keras itself, except that
    ``keras.layers`` names the holders above (the sublayers a definition builds)."""
    module = types.ModuleType("keras")
    module.__getattr__ = lambda name: getattr(keras, name)  # type: ignore[method-assign]
    module.ops = _KerasOps()
    module.layers = types.SimpleNamespace(
        Layer=PaddleLayer,
        EinsumDense=EinsumDense,
        Dropout=Dropout,
        Embedding=Embedding,
        LayerNormalization=KerasLayerNormalization,
    )
    return module
