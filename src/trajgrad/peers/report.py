"""The conformance report of ``trajgrad verify --peer``: a table per peer, Markdown and HTML."""
from __future__ import annotations

import html
from pathlib import Path
from typing import List, Sequence

from ._case import CaseResult
from ._cases import UNCOVERED


def table(results: Sequence[CaseResult]) -> str:
    """Plain-text table for the terminal."""
    rows = [f"{'peer function':<72} {'trajgrad':<10} {'max dev':>9}  result"]
    for r in results:
        rows.append(f"{r.case.function[:72]:<72} {r.case.recipe:<10} {r.worst:>9.1e}  {r.status}"
                    + (f"  ({r.error})" if r.error else ""))
        rows += [f"{'':<72} {'':<10} {'':>9}    · {c}" for c in r.conventions]
    agree = sum(r.status.startswith("agrees") for r in results)
    rows.append(f"{agree} of {len(results)} functions agree (outright or with the option named)")
    return "\n".join(rows)


def markdown(peer: str, version: str, results: Sequence[CaseResult]) -> str:
    lines = [f"# Conformance: {peer} {version} against trajgrad", "",
             "Each peer function runs unchanged behind verify's adapter signature and goes through the §24 battery "
             "against the trajgrad recipe named (float64, ragged masks). Objective checks: value, gradient, ratio one, "
             "zero advantage, padding, far off-policy. Conventions: one line per documented difference.", "",
             "| peer function | trajgrad recipe | largest deviation | result | documented differences |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        conv = "<br>".join(r.conventions) or "–"
        res = r.status + (f" ({r.error})" if r.error else "")
        lines.append(f"| `{r.case.function}` | `{r.case.recipe}` | {r.worst:.1e} | {res} | {conv} |")
    agree = sum(r.status.startswith("agrees") for r in results)
    lines += ["", f"{agree} of {len(results)} functions agree, outright or with the option named."]
    uncovered = _uncovered(peer)
    if uncovered:
        lines += ["", "## Not in the table", "", "| peer function or setting | why |", "| --- | --- |"]
        lines += [f"| `{name}` | {why} |" for name, why in uncovered]
    return "\n".join(lines) + "\n"


def _uncovered(peer: str):
    return UNCOVERED.get(peer, [])


def html_page(peer: str, version: str, results: Sequence[CaseResult]) -> str:
    esc = html.escape
    rows: List[str] = []
    for r in results:
        cls = "ok" if r.status.startswith("agrees") else "bad"
        conv = "<br>".join(esc(c) for c in r.conventions) or "–"
        rows.append(f"<tr class='{cls}'><td><code>{esc(r.case.function)}</code></td><td><code>{esc(r.case.recipe)}</code>"
                    f"</td><td>{r.worst:.1e}</td><td>{esc(r.status)}{esc(' (' + r.error + ')') if r.error else ''}</td>"
                    f"<td>{conv}</td></tr><tr><td colspan='5'><details><summary>checks</summary><pre>{esc(r.table)}"
                    "</pre></details></td></tr>")
    return ("<!doctype html><meta charset='utf-8'><title>trajgrad conformance: " + esc(peer) + "</title>"
            "<style>body{font:14px system-ui;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:4px 8px;vertical-align:top}tr.ok td:nth-child(4){color:#070}tr.bad td:nth-child(4){color:#b00}"
            "</style>" f"<h1>Conformance: {esc(peer)} {esc(version)} against trajgrad</h1><table><tr><th>peer function"
            "</th><th>trajgrad recipe</th><th>largest deviation</th><th>result</th><th>documented differences</th></tr>"
            + "".join(rows) + "</table>"
            + ("<h2>Not in the table</h2><table><tr><th>peer function or setting</th><th>why</th></tr>"
               + "".join(f"<tr><td><code>{esc(n)}</code></td><td>{esc(w)}</td></tr>" for n, w in _uncovered(peer))
               + "</table>" if _uncovered(peer) else ""))


def write(peer: str, version: str, results: Sequence[CaseResult], out_dir: Path) -> List[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, page = out_dir / f"conformance-{peer}.md", out_dir / f"conformance-{peer}.html"
    md.write_text(markdown(peer, version, results))
    page.write_text(html_page(peer, version, results))
    return [md, page]
