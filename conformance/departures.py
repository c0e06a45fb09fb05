"""Where the frameworks' own attention layers depart from the oracle, and the record of it.

Native targets (``native-*``, `multiattn.conformance.target_native`) run each framework's
own layer on the cases it can express. They are informative: the oracle gives a query row
in which no key may be attended ("empty row") zero weights, and the frameworks do not all
agree (NaN, uniform weights; see ``docs/fully-masked-rows.md``). For a native target a
case is one of

* ``pass``: agrees with the oracle within the case's tolerance;
* ``depart``: departs, **only** on empty rows or on poisoned rows, in the way recorded in
  `KNOWN` below (rules on the cases' op, dtype and properties, from
  `multiattn.conformance.spec`: "rows with ``empty_rows`` are uniform");
* ``fail``: departs anywhere else, or differently from the record, or a recorded
  departure did not occur (the record is then out of date);
* ``skip``: not applicable (the layer cannot express the case).

*Poisoned rows* are the query rows of a batch element whose keys or values hold NaN or an
infinity (the ``sdpa_*poisoned_*`` cases hold them only where no query may attend, so the
oracle's answer is that of any other values there).

`classify` measures a departure: for each returned array, the worst relative error over
the other rows that have an allowed key (these must agree), what the empty rows hold:
``"nan"``, ``"uniform"`` (weights ``1/keys``; for an output, the mean of the values that
weights ``1/keys`` give), ``"unmasked"`` (the softmax over every key, as if the row had
no mask) or ``"zeros"`` (what the oracle wants, so no departure), and what the poisoned
rows hold: ``"nan"`` or ``"agree"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from multiattn import reference as ref

from . import spec
from .fixtures import Case


@dataclass(frozen=True)
class Departure:
    """A recorded departure, on the cases of ``ops`` (empty: any op) that have every
    property in ``when`` and none in ``unless`` (see `multiattn.conformance.spec`), in
    ``dtypes`` (empty: any dtype):

    * ``empty``: array name -> what its empty rows hold (``"nan"``, ``"uniform"``,
      ``"unmasked"``);
    * ``poisoned``: array name -> what its poisoned rows hold (``"nan"``);
    * ``within``: the rows with an allowed key agree only to this relative error (the
      layer computes in a lower precision than the case's dtype);
    * ``raises``: the layer raises an error whose message contains this text.
    """

    ops: tuple[str, ...] = ()
    when: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    empty: dict[str, str] = field(default_factory=dict)
    within: float | None = None
    raises: str = ""
    why: str = ""
    poisoned: dict[str, str] = field(default_factory=dict)

    def applies(self, case: Case, properties: set[str]) -> bool:
        return (
            (not self.ops or case.op in self.ops)
            and (not self.dtypes or case.dtype in self.dtypes)
            and set(self.when) <= properties
            and not set(self.unless) & properties
        )

    def rule(self) -> str:
        """The rule in words: ``"sdpa with empty_rows, not poisoned, in float64"``."""
        parts = ["/".join(self.ops) or "any case"]
        parts += [f"with {' and '.join(self.when)}"] if self.when else []
        parts += [f"not {' or '.join(self.unless)}"] if self.unless else []
        parts += [f"in {'/'.join(self.dtypes)}"] if self.dtypes else []
        return ", ".join(parts)


# An empty row in a poisoned batch element is judged as poisoned (`classify`), so the
# rules on empty rows leave the poisoned cases out.
_F32_LOGITS = "computes float64 attention logits in float32"
_MHA_EMPTY = dict(ops=("mha",), when=("empty_rows",))
_SDPA_POISONED = dict(ops=("sdpa",), when=("poisoned",), poisoned={"output": "nan"})
_KERAS_MHA = Departure(
    **_MHA_EMPTY,
    empty={"output": "uniform"},
    why="the fused path (ops.dot_product_attention) gives uniform rows; the explicit path, "
    "taken with return_attention_scores=True, gives zeros",
)

# Measured by running the frameworks (torch 2.13.0, jax 0.10.2, flax 0.12.8, keras 3.15.1,
# tensorflow 2.21.0, paddlepaddle 3.3.1, CPU). A case with an empty row that no rule covers
# for a target agrees with the oracle there (the layer gives zeros).
KNOWN: dict[str, tuple[Departure, ...]] = {
    "native-torch": (
        Departure(
            **_SDPA_POISONED,
            why="the mask is added to the scores (NaN + -inf is NaN) and the zero weights "
            "multiply the values (0 * NaN, 0 * inf)",
        ),
        Departure(
            **_MHA_EMPTY,
            empty={"output": "nan", "weights": "nan"},
            why="nn.MultiheadAttention with need_weights=True fills masked scores with -inf",
        ),
    ),
    "native-jax": (
        Departure(
            ("sdpa",),
            ("empty_rows",),
            ("poisoned",),
            empty={"output": "uniform"},
            why="masked scores become a large negative number",
        ),
        Departure(
            **_SDPA_POISONED,
            why="the zero weights of masked keys multiply their values (0 * NaN, 0 * inf)",
        ),
        Departure(
            **_MHA_EMPTY,
            empty={"output": "uniform"},
            why="flax.nnx.MultiHeadAttention masks with the dtype's lowest value",
        ),
        Departure(dtypes=("float64",), within=1e-6, why=_F32_LOGITS),
    ),
    "native-keras-jax": (  # run in float32 only
        _KERAS_MHA,
        Departure(
            ("mha",),
            ("value_dim",),
            raises="cannot reshape",
            why="the fused path on jax needs value_dim == key_dim",
        ),
    ),
    "native-keras-torch": (
        _KERAS_MHA,
        Departure(dtypes=("float64",), within=1e-6, why=_F32_LOGITS),
    ),
    "native-keras-tensorflow": (
        _KERAS_MHA,
        Departure(dtypes=("float64",), within=1e-7, why=_F32_LOGITS),
    ),
    "native-paddle": (
        Departure(
            **_MHA_EMPTY,
            dtypes=("float32",),
            empty={"output": "uniform", "weights": "uniform"},
            why="a boolean attn_mask becomes the additive (mask - 1) * 1e9",
        ),
        Departure(
            **_MHA_EMPTY,
            dtypes=("float64",),
            empty={"output": "unmasked", "weights": "unmasked"},
            why="in float64, adding -1e9 to every score of a row keeps their differences",
        ),
    ),
}


KIND_TOL = 1e-4  # how close an empty row must be to an answer to be called that answer


def recorded(target: str, case: Case) -> Departure | None:
    """Every recorded departure of ``target`` that applies to ``case`` (by its op, dtype
    and properties), merged into one."""
    rules = KNOWN.get(target, ())
    if not rules:
        return None
    properties = spec.case_properties(case)
    found = [d for d in rules if d.applies(case, properties)]
    if not found:
        return None
    within = [d.within for d in found if d.within is not None]
    return Departure(
        (case.op,),
        empty={k: v for d in found for k, v in d.empty.items()},
        within=max(within) if within else None,
        raises=next((d.raises for d in found if d.raises), ""),
        why="; ".join(d.why for d in found if d.why),
        poisoned={k: v for d in found for k, v in d.poisoned.items()},
    )


# --- measuring a departure ---------------------------------------------------------------


def keep_mask(case: Case, heads: int = 1) -> np.ndarray:
    """The case's allowed (query, key) pairs, bool ``(batch, heads, queries, keys)``, from
    its valid lengths, boolean mask and causal flag (oracle helpers, float64 side). A mask
    per head gives every head."""
    if case.op == "sdpa":
        b, tq = case.inputs["query"].shape[0], case.inputs["query"].shape[-2]
        tk = case.inputs["key"].shape[-2]
    elif case.op == "mha":
        b, tq = case.inputs["query"].shape[:2]
        tk = tq if case.params.get("self") else case.inputs["value"].shape[1]
    else:
        raise ValueError(f"keep_mask: op {case.op!r} has no attention rows")
    shape = (b, heads, tq, tk)
    keep = np.ones(shape, dtype=bool)
    if "valid_lens" in case.inputs:
        keep &= ref.valid_lens_mask(case.inputs["valid_lens"], shape)
    if "mask" in case.inputs:
        m = np.asarray(case.inputs["mask"], dtype=bool)
        keep = keep & (m[:, None] if m.ndim == 3 else m)
    if case.params.get("causal"):
        keep &= ref.causal_mask(tq, tk)
    return keep


def poisoned_rows(case: Case, shape: tuple[int, ...]) -> np.ndarray:
    """The poisoned rows, bool of ``shape`` ``(batch, queries)`` or ``(batch, heads,
    queries)``: every row of a batch element whose keys or values hold NaN or an infinity."""
    if case.op != "sdpa":
        return np.zeros(shape, dtype=bool)
    k, v = case.inputs["key"], case.inputs["value"]
    bad = ~(np.isfinite(k.reshape(len(k), -1)).all(1) & np.isfinite(v.reshape(len(v), -1)).all(1))
    return np.broadcast_to(bad.reshape((-1,) + (1,) * (len(shape) - 1)), shape)


def _alternatives(case: Case, array: str) -> dict[str, np.ndarray]:
    """What ``array`` would be in every row under two other answers for an empty row:
    ``"uniform"`` (weights ``1/keys`` on every key) and ``"unmasked"`` (the softmax over
    every key, as if there were no mask: what an additive mask of large finite values
    gives when the dtype is precise enough to keep the scores' differences)."""
    from .cases import _mha_kernels, repeat_kv_heads

    want = case.expected[array]
    p, x = case.params, case.inputs
    if case.op == "sdpa":
        key, value = (repeat_kv_heads(x["query"], x[n]) for n in ("key", "value"))
        free = ref.scaled_dot_product_attention(x["query"], key, value, scale=p.get("scale"))
    else:
        value = x["query"] if p.get("self") else x["value"]
        key = value if p.get("self") else x["key"]
        free = ref.multi_head_attention(
            x["query"], value, key, weights=_mha_kernels(case.weights, p)
        )
    unmasked = free[0] if array == "output" else free[1]
    if array == "weights":
        return {"uniform": np.full(want.shape, 1.0 / want.shape[-1]), "unmasked": unmasked}
    if case.op == "sdpa":
        mean = value.mean(axis=-2, keepdims=True)  # (B, [H,] 1, dv)
        return {"uniform": np.broadcast_to(mean, want.shape), "unmasked": unmasked}
    # mha: the mean of the projected values of every head, then the output projection
    w = _mha_kernels(case.weights, p)
    value = x["query"] if p.get("self") else x["value"]
    v = np.einsum("bte,ehd->bhtd", value, w["value_kernel"])
    if "value_bias" in w:
        v = v + w["value_bias"][None, :, None, :]
    out = np.einsum("bhd,hdo->bo", v.mean(axis=2), w["output_kernel"])
    if "output_bias" in w:
        out = out + w["output_bias"]
    return {"uniform": np.broadcast_to(out[:, None, :], want.shape), "unmasked": unmasked}


def classify(case: Case, result: dict[str, np.ndarray], tol: float) -> dict[str, dict]:
    """Per returned array: ``rest_rel`` (max relative error over the rows with an allowed
    key that are not poisoned), ``empty_rows`` (how many, poisoned ones left out) and
    ``empty`` (``"none"``, ``"zeros"``, ``"nan"``, ``"uniform"``, ``"unmasked"`` or
    ``"other"``; for ``"other"`` also ``empty_rel``); where the case has poisoned rows,
    ``poisoned_rows`` and ``poisoned`` (``"agree"``, ``"nan"`` or ``"other"``, then also
    ``poisoned_rel``). Rows within ``tol`` (relative) of the oracle, or of uniform weights,
    count as equal."""
    out = {}
    for name in ("output", "weights"):
        if name not in result or name not in case.expected:
            continue
        want = case.expected[name]
        got = np.asarray(result[name], dtype=np.float64)
        if got.shape != want.shape:
            out[name] = {"shape": list(got.shape), "expected_shape": list(want.shape)}
            continue
        heads = want.shape[1] if want.ndim == 4 else 1
        empty = ~keep_mask(case, heads).any(axis=-1)  # (B, heads, Tq)
        if want.ndim == 3:
            empty = empty.any(axis=1)  # (B, Tq)
        poisoned = poisoned_rows(case, empty.shape)
        empty = empty & ~poisoned
        scale = float(np.abs(want).max(initial=0.0)) or 1.0
        err = np.abs(got - want) / scale
        err = np.where(np.isnan(err), np.inf, err)
        rows = err.max(axis=-1)  # one error per row
        info: dict = {
            "rest_rel": float(rows[~empty & ~poisoned].max(initial=0.0)),
            "empty_rows": int(empty.sum()),
        }
        if not empty.any():
            info["empty"] = "none"
        elif np.isnan(got[empty]).any():
            info["empty"] = "nan"
        elif rows[empty].max() <= tol:
            info["empty"] = "zeros"
        else:
            info["empty"] = "other"
            info["empty_rel"] = float(rows[empty].max())
            for kind, alt in _alternatives(case, name).items():
                # the kind of answer, not its precision: -1e9 added in float64 rounds the
                # scores to about 1e-7; relative to the answer itself where it is larger
                # (uniform weights over masked values of 1e30)
                size = max(scale, float(np.abs(alt[empty]).max()))
                if float(np.abs(got[empty] - alt[empty]).max() / size) <= max(tol, KIND_TOL):
                    info["empty"] = kind
                    del info["empty_rel"]
                    break
        if poisoned.any():
            info["poisoned_rows"] = int(poisoned.sum())
            if np.isnan(got[poisoned]).any():
                info["poisoned"] = "nan"
            elif rows[poisoned].max() <= tol:
                info["poisoned"] = "agree"
            else:
                info["poisoned"] = "other"
                info["poisoned_rel"] = float(rows[poisoned].max())
        out[name] = info
    return out


def verdict(
    target: str, case: Case, passed: bool, result: dict | None, error: str = ""
) -> tuple[str, str]:
    """Status (``pass`` / ``depart`` / ``fail``) of a native target's case and a one-line
    description. ``error``: the message of an exception the layer raised (then
    ``result`` is None)."""
    dep = recorded(target, case)
    if error:
        if dep is not None and dep.raises and dep.raises in error:
            return "depart", f"raises: {error.splitlines()[0][:160]}"
        return "fail", error
    if dep is not None and dep.raises:
        return "fail", f"the recorded error ({dep.raises!r}) was not raised"
    if passed:
        if dep is None or (not dep.empty and not dep.poisoned and dep.within is not None):
            return "pass", ""  # a precision allowance is not required to be used
        recorded_text = _describe(dep.empty, poisoned=dep.poisoned)
        return "fail", f"the recorded departure ({recorded_text}) did not occur"
    tol = case.tolerance["output"]
    if dep is not None and dep.within is not None:
        tol = max(tol, dep.within)
    found = classify(case, result or {}, tol)
    text = []
    for name, info in found.items():
        if "shape" in info:
            return "fail", f"{name} has shape {info['shape']}, expected {info['expected_shape']}"
        if info["rest_rel"] > case.tolerance["output"]:
            rel = info["rest_rel"]
            text.append(
                f"{name} off by {'inf' if math.isinf(rel) else f'{rel:.1e}'} on rows with keys"
            )
        if info["empty"] in ("nan", "uniform", "unmasked", "other"):
            extra = f" (error {info['empty_rel']:.1e})" if info["empty"] == "other" else ""
            text.append(f"{name} {info['empty']}{extra} on {info['empty_rows']} empty rows")
        if info.get("poisoned") in ("nan", "other"):
            extra = f" (error {info['poisoned_rel']:.1e})" if info["poisoned"] == "other" else ""
            text.append(
                f"{name} {info['poisoned']}{extra} on {info['poisoned_rows']} poisoned rows"
            )
    description = "; ".join(text) or "departs"
    observed = {
        n: i["empty"] for n, i in found.items() if i.get("empty") in ("nan", "uniform", "unmasked")
    }
    observed_poisoned = {n: i["poisoned"] for n, i in found.items() if i.get("poisoned") == "nan"}
    clean = all(
        i["rest_rel"] <= tol and "other" not in (i["empty"], i.get("poisoned"))
        for i in found.values()
    )
    if dep is not None and clean and observed == dep.empty and observed_poisoned == dep.poisoned:
        return "depart", description
    if dep is not None:
        recorded_text = _describe(dep.empty, dep.within, dep.poisoned)
        return "fail", f"{description}; recorded: {recorded_text}"
    return "fail", description + " (not a recorded departure)"


def _describe(
    empty: dict[str, str], within: float | None = None, poisoned: dict[str, str] | None = None
) -> str:
    parts = [f"{name} {kind} on empty rows" for name, kind in empty.items()]
    parts += [f"{name} {kind} on poisoned rows" for name, kind in (poisoned or {}).items()]
    if within is not None:
        parts.append(f"other rows within {within:.0e}")
    return ", ".join(parts) or "none"
