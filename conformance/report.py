"""Reports of a conformance run: terminal table, JSON and HTML heatmap."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any


def case_error(event: dict) -> tuple[float, float]:
    """Largest (absolute, relative) error over the arrays of one case event."""
    metrics = event.get("metrics") or {}
    abs_err = max(
        (m.get("max_abs", math.inf if not m.get("ok", True) else 0.0) for m in metrics.values()),
        default=0.0,
    )
    rel_err = max(
        (m.get("max_rel", math.inf if not m.get("ok", True) else 0.0) for m in metrics.values()),
        default=0.0,
    )
    return abs_err, rel_err


def failure_reason(event: dict) -> str:
    """Why a failed or errored case event failed, in one line: the first line of the error
    it raised, or each array outside its tolerance (missing, of another shape, or its
    relative error over the tolerance)."""
    if event.get("reason"):
        return (str(event["reason"]).strip().splitlines() or [""])[0]
    bad = []
    for key, m in (event.get("metrics") or {}).items():
        if m.get("missing"):
            bad.append(f"{key}: {m.get('reason', 'not returned')}")
        elif "expected_shape" in m:
            bad.append(f"{key}: shape {m['shape']}, expected {m['expected_shape']}")
        elif not m.get("ok", True):
            bad.append(f"{key}: relative error {m['max_rel']:.1e} > {m['tol']:.0e}")
    return "; ".join(bad) or event.get("status", "")


def family_rows(results: dict[str, dict]) -> list[dict]:
    rows = []
    for target, res in results.items():
        if res["status"] != "ran":
            rows.append(
                {
                    "target": target,
                    "family": "-",
                    "status": res["status"],
                    "reason": res.get("reason", ""),
                }
            )
            continue
        families: dict[str, list[dict]] = {}
        for event in res["cases"]:
            families.setdefault(event["family"], []).append(event)
        for family, events in families.items():
            ran = [e for e in events if e["status"] != "skip"]
            if not ran:
                continue  # a family the target does not implement
            errs = [case_error(e) for e in ran]
            failed = [e["case"] for e in ran if e["status"] not in ("pass", "depart")]
            rows.append(
                {
                    "target": target,
                    "family": family,
                    "status": "fail" if failed else ("pass" if ran else "skip"),
                    "cases": len(ran),
                    "skipped": len(events) - len(ran),
                    "failed": failed,
                    "departed": [e["case"] for e in ran if e["status"] == "depart"],
                    "max_abs": max((a for a, _ in errs), default=None),
                    "max_rel": max((r for _, r in errs), default=None),
                }
            )
    return rows


def print_table(results: dict[str, dict], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="multiattn conformance: max error against the float64 oracle")
    for col in ("target", "family", "cases", "max abs err", "max rel err", "result"):
        table.add_column(col, justify="right" if "err" in col or col == "cases" else "left")
    style = {
        "pass": "[green]pass[/]",
        "fail": "[red]FAIL[/]",
        "skip": "[yellow]skip[/]",
        "skipped": "[yellow]skipped[/]",
        "crashed": "[red]CRASHED[/]",
        "hung": "[red]HUNG[/]",
        "tampered": "[red]TAMPERED[/]",
        "interrupted": "[yellow]interrupted[/]",
    }
    last = None
    for row in family_rows(results):
        name = row["target"] if row["target"] != last else ""
        last = row["target"]
        if row["family"] == "-":
            reason = escape(str(row["reason"]))
            table.add_row(name, "", "", "", "", f"{style[row['status']]} {reason}")
            continue
        cases = f"{row['cases']}" + (f" +{row['skipped']} skip" if row["skipped"] else "")
        fmt = lambda v: "" if v is None else ("inf" if math.isinf(v) else f"{v:.1e}")  # noqa: E731
        result = style[row["status"]]
        if row["departed"]:
            result += f" [blue]({len(row['departed'])} recorded departures)[/]"
        if row["failed"]:
            result += (
                " " + ", ".join(row["failed"][:3]) + (" ..." if len(row["failed"]) > 3 else "")
            )
        table.add_row(name, row["family"], cases, fmt(row["max_abs"]), fmt(row["max_rel"]), result)
    console.print(table)
    print_native_summary(results, console)


def native_summary(results: dict[str, dict]) -> list[dict]:
    """Per informative target (a framework's own layer): how many cases agree with the
    oracle, depart in a recorded way, are not applicable, or fail; and the departures."""
    rows = []
    for target, res in results.items():
        if not res.get("informative"):
            continue
        count = {"pass": 0, "depart": 0, "skip": 0, "fail": 0}
        for e in res["cases"]:
            count["fail" if e["status"] in ("fail", "error") else e["status"]] += 1
        rows.append(
            {
                "target": target,
                "status": res["status"],
                "agree": count["pass"],
                "depart": count["depart"],
                "n/a": count["skip"],
                "fail": count["fail"],
                "departures": [
                    (e["case"], e.get("reason", ""))
                    for e in res["cases"]
                    if e["status"] in ("depart", "fail", "error")
                ],
            }
        )
    return rows


def print_native_summary(results: dict[str, dict], console: Any) -> None:
    from rich.table import Table

    rows = native_summary(results)
    if not rows:
        return
    table = Table(
        title="frameworks' own layers: agree with the oracle / recorded departure "
        "(fully masked rows, NaN or inf in masked keys) / not applicable / FAIL"
    )
    for col in ("target", "agree", "depart", "n/a", "fail"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for row in rows:
        fail = f"[red]{row['fail']}[/]" if row["fail"] else "0"
        table.add_row(row["target"], str(row["agree"]), str(row["depart"]), str(row["n/a"]), fail)
    console.print(table)
    for row in rows:
        for case, reason in row["departures"]:
            console.print(f"  {row['target']} {case}: {reason}", highlight=False, soft_wrap=True)


def write_json(results: dict[str, dict], path: Path, meta: dict) -> None:
    Path(path).write_text(
        json.dumps(
            {
                **meta,
                "targets": results,
                "summary": family_rows(results),
                "native": native_summary(results),
            },
            indent=1,
            default=str,
        )
    )


def _color(rel: float | None, tol: float | None, status: str) -> str:
    if status == "skip" or rel is None:
        return "#eeeeee"
    if status == "depart":
        return "#4575b4"
    if status != "pass":
        return "#d73027"
    # green (tiny error) to yellow (at the tolerance) on a log scale
    frac = (
        0.0
        if not rel or not tol
        else min(1.0, max(0.0, 1 + math.log10(max(rel, 1e-18) / tol) / 10))
    )
    r, g = int(26 + frac * (254 - 26)), int(152 + frac * (224 - 152))
    return f"rgb({r},{g},80)"


def write_html(results: dict[str, dict], path: Path, meta: dict) -> None:
    """A heatmap of the max relative error per target (rows) and case (columns)."""
    cases: list[str] = []
    for res in results.values():
        for event in res.get("cases", []):
            if event["case"] not in cases:
                cases.append(event["case"])
    head = "".join(f'<th class="c"><div>{html.escape(c)}</div></th>' for c in cases)
    body = []
    for target, res in results.items():
        by_case = {e["case"]: e for e in res.get("cases", [])}
        cells = []
        for c in cases:
            e = by_case.get(c)
            if e is None:
                cells.append('<td style="background:#fff"></td>')
                continue
            _, rel = case_error(e) if e["status"] in ("pass", "fail", "depart") else (None, None)
            tol = max((m.get("tol", 0) for m in (e.get("metrics") or {}).values()), default=None)
            title = f"{target} / {c}: {e['status']}" + (
                f", max rel {rel:.2e} (tol {tol:.0e})" if rel is not None and tol else ""
            )
            if e.get("reason"):
                title += f" ({e['reason']})"
            cells.append(
                f'<td title="{html.escape(title)}" style="background:{_color(rel, tol, e["status"])}"></td>'
            )
        label = html.escape(target) + (
            ""
            if res["status"] == "ran"
            else f" ({html.escape(res['status'])}: {html.escape(res.get('reason', ''))})"
        )
        body.append(f"<tr><th>{label}</th>{''.join(cells)}</tr>")
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>multiattn conformance</title>
<style>body{{font-family:sans-serif}} table{{border-collapse:collapse}} td{{width:14px;height:14px;border:1px solid #fff}}
th.c{{height:190px;white-space:nowrap;vertical-align:bottom}} th.c div{{transform:rotate(-70deg);width:14px;font-weight:normal;font-size:11px}}
tbody th{{text-align:right;padding-right:8px;font-size:13px}}</style></head><body>
<h1>multiattn conformance</h1><p>{html.escape(json.dumps(meta))}</p>
<p>Cell colour: max relative error against the float64 oracle on a log scale, green (far below the case's
tolerance) to yellow (at the tolerance); red: failed or errored; blue: a framework's own layer departs as
recorded (fully masked rows, NaN or inf in masked keys); grey: the target does not support the case.
Hover a cell for the numbers.</p>
<table><thead><tr><th></th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></body></html>"""
    Path(path).write_text(doc)
