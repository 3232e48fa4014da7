"""The ``trajgrad view`` page: one self-contained HTML file (inline CSS and JS, data as JSON).

Nothing on the page loads from the network: no CDN, no fonts, no images; the learning
curves are inline SVG drawn by the page's own script (:mod:`trajgrad.view.script`). The data
(:func:`trajgrad.view.pagedata.page_data`) sits in a ``<script type="application/json">``
element, escaped so that no ``</script>`` inside it can end the element.
"""
from __future__ import annotations

import html
import json
from typing import Any, Dict

from .script import SCRIPT

__all__ = ["render_html", "CSS"]

CSS = r"""
:root { --fg:#1d2430; --muted:#6b7280; --line:#d9dde3; --bg:#fff; --panel:#f7f8fa; --accent:#2563eb; }
* { box-sizing: border-box; }
body { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg); background: var(--bg);
       margin: 0; }
header { padding: 10px 16px; border-bottom: 1px solid var(--line); background: var(--panel); }
header h1 { font-size: 16px; margin: 0 0 4px 0; }
header .meta, .note { color: var(--muted); }
main { display: grid; grid-template-columns: minmax(420px, 46%) 1fr; gap: 12px; padding: 12px 16px; }
section { border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; background: var(--bg); min-width: 0; }
section h2 { font-size: 13px; margin: 0 0 6px 0; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
#filters { display: flex; flex-wrap: wrap; gap: 6px 10px; align-items: center; margin-bottom: 6px; }
#filters label { display: inline-flex; gap: 4px; align-items: center; }
#filters input[type=number] { width: 64px; }
#filters input[type=search] { width: 150px; }
.table-wrap { max-height: 62vh; overflow: auto; border: 1px solid var(--line); }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { padding: 2px 6px; border-bottom: 1px solid #eef0f3; text-align: right; white-space: nowrap; }
th { position: sticky; top: 0; background: var(--panel); cursor: pointer; user-select: none; }
th.sorted-asc::after { content: " \25B2"; } th.sorted-desc::after { content: " \25BC"; }
td.left, th.left { text-align: left; }
td.ep-id { max-width: 210px; overflow: hidden; text-overflow: ellipsis; }
tr.ep-row { cursor: pointer; } tr.ep-row:hover { background: #eef4ff; } tr.ep-row.selected { background: #dbe7ff; }
td.ok { color: #15803d; } td.bad { color: #b91c1c; } td.est { color: var(--muted); font-style: italic; }
#tokens { font: 12px/1.9 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre-wrap;
          word-break: break-all; max-height: 62vh; overflow: auto; border: 1px solid var(--line); padding: 6px; }
.tok { border-radius: 2px; padding: 0 1px; }
.tok.prompt { color: #6b7280; }
.tok.obs { color: #7c3aed; }
.tok.action { outline: 1px solid rgba(0,0,0,.06); }
.turn-head { display: block; margin: 6px 0 2px 0; padding: 1px 6px; font: 11px system-ui, sans-serif;
             background: #eef2f7; border-left: 3px solid var(--accent); white-space: normal; }
.turn-head.tool { border-left-color: #d97706; }
.obs-head { display: block; margin: 2px 0; padding: 0 6px; font: 11px system-ui, sans-serif; color: #7c3aed;
            white-space: normal; }
#legend { display: flex; gap: 10px; align-items: center; flex-wrap: wrap; margin: 4px 0; }
#legend .swatch { display: inline-block; width: 14px; height: 10px; border: 1px solid #999; vertical-align: middle; }
#legend .bar { display: inline-block; width: 120px; height: 10px; vertical-align: middle; border: 1px solid #999; }
#tip { position: fixed; pointer-events: none; background: #111827; color: #f9fafb; padding: 4px 7px; border-radius: 4px;
       font: 11px/1.35 ui-monospace, monospace; white-space: pre; display: none; z-index: 10; }
#curves { display: grid; grid-template-columns: repeat(auto-fill, minmax(250px, 1fr)); gap: 8px; }
.chart { border: 1px solid #eef0f3; border-radius: 4px; padding: 2px 4px; }
.chart .title { font-size: 11px; color: var(--muted); }
.full { grid-column: 1 / -1; }
pre.objective { white-space: pre-wrap; font: 12px/1.45 ui-monospace, monospace; margin: 0; }
.caps { color: #92400e; }
button.link { background: none; border: none; color: var(--accent); cursor: pointer; padding: 0; font: inherit; }
"""

_BODY = """<header>
<h1>trajgrad view: <span id="run-name"></span></h1>
<div class="meta" id="run-meta"></div>
<div class="caps" id="caps"></div>
<div class="note" id="notes"></div>
</header>
<main>
<section id="episodes-panel">
<h2>Episodes</h2>
<div id="filters">
<label>step <input type="number" id="step-min" placeholder="min"> &ndash; <input type="number" id="step-max" placeholder="max"></label>
<label>success <select id="success"><option value="">any</option><option value="true">yes</option>
<option value="false">no</option><option value="null">unknown</option></select></label>
<label>reward <input type="number" id="reward-min" step="any" placeholder="min"> &ndash;
<input type="number" id="reward-max" step="any" placeholder="max"></label>
<label>status <select id="status"><option value="">any</option></select></label>
<label id="env-filter">environment <select id="environment"><option value="">any</option></select></label>
<label>search <input type="search" id="search" placeholder="episode, task, action text"></label>
<span id="row-count" class="note"></span>
</div>
<div class="table-wrap"><table id="episodes"><thead><tr></tr></thead><tbody></tbody></table></div>
<div id="more" class="note"></div>
</section>
<section id="episode-panel">
<h2>Episode tokens</h2>
<div><label>colour by <select id="channel"></select></label> <span id="episode-title" class="note">click an episode</span></div>
<div id="legend"></div>
<div id="tokens"></div>
</section>
<section class="full"><h2>Learning curves</h2>
<div><label>add a metric <select id="metric-add"><option value="">&mdash;</option></select></label></div>
<div id="curves"></div></section>
<section class="full"><h2>Objective (trajgrad explain)</h2><pre class="objective" id="objective"></pre></section>
</main>
<div id="tip"></div>"""


def _embed_json(data: Dict[str, Any]) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>``, ``&`` and line separators as escapes."""
    text = json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(data: Dict[str, Any]) -> str:
    """The page for ``data`` (from :func:`~trajgrad.view.pagedata.page_data`), as one string."""
    title = html.escape(f"trajgrad view: {data.get('run', {}).get('name') or data.get('run', {}).get('path', '')}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            f"<title>{title}</title>\n<link rel=\"icon\" href=\"data:,\">\n"
            f"<style>{CSS}</style></head>\n<body>\n{_BODY}\n"
            f"<script id=\"data\" type=\"application/json\">{_embed_json(data)}</script>\n"
            f"<script>{SCRIPT}</script>\n</body></html>\n")
