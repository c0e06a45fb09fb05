"""The namespace contract against the library: every ``ops.<name>`` the library uses is
declared in `multiattn.namespaces.contract.Namespace`, and every Keras namespace class implements
the contract (the Paddle namespace is checked in ``tests/paddle/test_ops.py``). Imports
no framework."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from multiattn.namespaces import contract as _contract
from multiattn.namespaces import keras as _namespace

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("multiattn", "backends") for p in (ROOT / d).rglob("*.py"))
NAMES = ("ops", "ns")  # what the library calls a namespace


def _is_get_ops(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("get_ops", "keras_namespace")
    )


def _not_a_namespace(value: ast.AST | None) -> bool:
    """A binding of ``ops`` to something else than a namespace: ``keras.ops`` itself."""
    return isinstance(value, ast.Attribute) and ast.unparse(value) == "keras.ops"


class _Uses(ast.NodeVisitor):
    """Attributes read on ``ops``/``ns`` where that name is a namespace: a parameter, or
    bound by assignment (``get_ops(...)``, ``self.ops``, a tuple unpacking). A name bound
    to ``keras.ops`` or to an imported module (``from multiattn import ops``) is not."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, bool]] = [{}]
        self.found: dict[str, set[str]] = {}
        self.where = ""

    def _bind(self, scope: dict[str, bool], target: ast.AST, value: ast.AST | None) -> None:
        if isinstance(target, ast.Name) and target.id in NAMES:
            scope[target.id] = not _not_a_namespace(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) else None
            for i, elt in enumerate(target.elts):
                self._bind(scope, elt, values[i] if values and i < len(values) else None)

    def _collect(self, body: ast.AST, scope: dict[str, bool]) -> None:
        """Bindings made directly in this scope (not in nested functions)."""
        for node in ast.iter_child_nodes(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    self._bind(scope, t, node.value)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                self._bind(scope, node.target, node.value)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                self._bind(scope, node.target, None)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    name = (alias.asname or alias.name).partition(".")[0]
                    if name in NAMES:
                        scope[name] = False
            self._collect(node, scope)

    def visit_Module(self, node: ast.Module) -> None:
        self._collect(node, self.scopes[0])
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope: dict[str, bool] = {}
        args = node.args
        for a in (*args.posonlyargs, *args.args, *args.kwonlyargs):
            if a.arg in NAMES:
                scope[a.arg] = True
        self._collect(node, scope)
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _is_namespace(self, name: str) -> bool:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        value = node.value
        if _is_get_ops(value) or (
            isinstance(value, ast.Name) and value.id in NAMES and self._is_namespace(value.id)
        ):
            self.found.setdefault(node.attr, set()).add(self.where)
        self.generic_visit(node)


def operations_used() -> dict[str, set[str]]:
    """``{name: files}`` of every attribute the library reads on a namespace."""
    uses = _Uses()
    for path in SOURCES:
        uses.where = str(path.relative_to(ROOT))
        uses.scopes = [{}]
        uses.visit(ast.parse(path.read_text(), filename=str(path)))
    return uses.found


def test_the_scan_finds_the_namespace_uses():
    used = operations_used()
    # one of each way the library reaches a namespace
    assert "einsum" in used  # ops = get_ops(...)
    assert "zeros_like" in used or "slice" in used  # ops, ... = self.ops, ... (blockwise_grad)
    assert "tanh" in used  # ops, query, ... = _query_key(...) (scoring)
    assert "dtype_name" in used  # a parameter named ns (_checks)
    assert "repeat" not in used or "multiattn/layers/grouped_query.py" not in used["repeat"]


def test_every_namespace_use_is_in_the_contract():
    declared = set(_contract.OPERATIONS) | set(_contract.CAPABILITIES)
    missing = {name: sorted(files) for name, files in operations_used().items()}
    missing = {n: f for n, f in missing.items() if n not in declared}
    assert not missing, f"used on a namespace but not declared in the contract: {missing}"


def test_no_capability_probing_in_the_library():
    for path in SOURCES:
        text = path.read_text()
        for probe in ("hasattr(ops", "getattr(ops", "hasattr(ns", "getattr(ns"):
            assert probe not in text, f"{path.relative_to(ROOT)} probes a namespace: {probe}"


@pytest.mark.parametrize(
    "cls",
    [_namespace.KerasNamespace, *_namespace._KERAS_NAMESPACES.values()],
    ids=lambda c: c.__name__,
)
def test_keras_namespaces_implement_the_contract(cls):
    _contract.check_namespace(cls)
    assert not getattr(cls, "__abstractmethods__", None)
    abstract = _contract.Namespace.__abstractmethods__
    for name in _contract.OPERATIONS:
        flag = _contract._OPTIONAL.get(name)
        if flag is None and name not in abstract:
            continue  # the contract's own default may serve (xla_device: None)
        if flag is None or getattr(cls, flag):
            assert getattr(cls, name) is not getattr(_contract.Namespace, name), name


class _Partial(_contract.Namespace):
    def einsum(self, subscripts, *operands):
        return None


def test_a_namespace_missing_an_operation_is_refused():
    with pytest.raises(TypeError, match="abstract"):
        _Partial()
    with pytest.raises(TypeError, match=r"Bare does not implement .*operation 'abs' is missing"):
        _contract.check_namespace(type("Bare", (), {"backend": "x"}))


def test_write_cache_claimed_but_missing_is_refused():
    claims = type("Claims", (_namespace.KerasNamespace,), {"writes_in_place": True})
    with pytest.raises(TypeError, match="'write_cache' is not implemented but writes_in_place"):
        _contract.check_namespace(claims)
    _contract.check_namespace(_namespace.KerasNamespace)  # claims nothing: not required
    with pytest.raises(NotImplementedError, match="writes_in_place is False"):
        _contract.Namespace.write_cache(_namespace.KerasNamespace, None, None, 0)


def test_signature_mismatches_name_the_problem():
    def contract(self, x, axis=None, keepdims=False): ...

    assert (
        _contract.signature_mismatches(contract, lambda self, x, axis=None, keepdims=1, **k: 0)
        == []
    )
    problems = _contract.signature_mismatches(contract, lambda self, x, axis=None, **kw: 0)
    assert problems == [
        "positional parameters ['x', 'axis'] do not start with ['x', 'axis', 'keepdims']"
    ]
    assert _contract.signature_mismatches(contract, lambda self, x, *a, **kw: 0) == []
    problems = _contract.signature_mismatches(contract, lambda self, x, axis: 0)
    assert any("'axis' must be optional" in p for p in problems)
    assert any("'keepdims'" in p for p in problems)
    problems = _contract.signature_mismatches(contract, lambda self, axis=None, x=None: 0)
    assert any("positional" in p for p in problems)
    problems = _contract.signature_mismatches(
        contract, lambda self, x, axis=None, keepdims=0, y=1: 0
    )
    assert problems == []
    problems = _contract.signature_mismatches(
        contract, lambda self, x, axis=None, keepdims=0, *, y: 0
    )
    assert problems == ["extra parameter 'y' must be optional"]


def test_register_namespace_validates_its_arguments():
    with pytest.raises(ValueError, match=r"`module`.*'a\.b'"):
        _namespace.register_namespace("a.b", lambda x: False, object)
    with pytest.raises(TypeError, match="`is_tensor` must be callable; received 3"):
        _namespace.register_namespace("mine", 3, object)
