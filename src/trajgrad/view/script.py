"""The ``trajgrad view`` page's script (plain JavaScript, no library), inlined by the template.

It reads the embedded JSON, fills the episode table (sort by any column; filter by step
range, success, reward range, status, environment and text), renders one trajectory's tokens coloured by a
channel (role, advantage, ratio, IS weight, clip / correction masks, gradient weight,
learner-vs-sampler mismatch, log-probs, entropy) with turn boundaries, tool calls and tool
results and the per-token values on hover, and draws the learning curves as inline SVG.
Action tokens carry the class ``action`` (one element per action token).
"""

__all__ = ["SCRIPT"]

SCRIPT = r"""
(function () {
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const $ = (id) => document.getElementById(id);
const ESC = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"};
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ESC[c]);
function fmt(v, digits) {
  if (v === null || v === undefined) return "\u2014";
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  return Number(v.toPrecision(digits || 4)).toString();
}

// ------------------------------------------------------------------ header
$("run-name").textContent = D.run.name || D.run.path;
$("run-meta").textContent = ["model " + (D.run.model || "?"), "recipe " + (D.run.recipe || "?"), D.run.path].join(" \u00b7 ");
const caps = D.caps, capMsgs = [];
if (caps.rows < caps.trajectories_total)
  capMsgs.push("showing the newest " + caps.rows + " of " + caps.trajectories_total + " trajectories (cap --max-episodes " + caps.max_episodes + ")");
if (caps.detail < caps.rows)
  capMsgs.push("token detail embedded for the newest " + caps.detail + " of " + caps.rows + " rows (cap --max-tokens " + caps.max_tokens +
               " tokens)" + (D.serve ? "; the others load from the server when clicked" : "; run with --serve to open the others"));
if (caps.token_log_capped_at !== null && caps.token_log_capped_at !== undefined)
  capMsgs.push("tokens.jsonl reached its size cap (log.token_log_max_mb) at step " + caps.token_log_capped_at + ": later steps have no per-token values");
$("caps").textContent = capMsgs.join(" \u00b7 ");
$("notes").textContent = D.notes.join(" \u00b7 ");
$("objective").textContent = D.objective;

// ------------------------------------------------------------------ episode table
const COLS = [["step", "step"], ["id", "episode", "left"], ["seg", "seg"], ["reward", "reward"], ["success", "success"],
  ["turns", "turns"], ["len", "length"], ["act", "action tok."], ["versions", "policy ver."], ["lag", "lag"],
  ["status", "status", "left"]];
let sortKey = "i", sortDir = 1, selected = null;
const headRow = document.querySelector("#episodes thead tr");
const tbody = document.querySelector("#episodes tbody");
COLS.forEach(function (col) {
  const th = document.createElement("th");
  th.textContent = col[1];
  th.dataset.key = col[0];
  if (col[2]) th.className = col[2];
  th.addEventListener("click", function () {
    if (sortKey === col[0]) sortDir = -sortDir; else { sortKey = col[0]; sortDir = 1; }
    renderTable();
  });
  headRow.appendChild(th);
});
Array.from(new Set(D.rows.map((r) => r.status))).sort().forEach(function (s) {
  const o = document.createElement("option");
  o.value = s; o.textContent = s;
  $("status").appendChild(o);
});
const ENVS = Array.from(new Set(D.rows.map((r) => r.env))).filter((e) => e !== "").sort();
ENVS.forEach(function (e) {
  const o = document.createElement("option");
  o.value = e; o.textContent = e;
  $("environment").appendChild(o);
});
if (!ENVS.length) $("env-filter").style.display = "none";
function numInput(id) { const v = $(id).value.trim(); if (v === "") return null; const x = Number(v); return Number.isFinite(x) ? x : null; }
function sortValue(r, k) {
  if (k === "versions") return r.vmin;
  if (k === "success") return r.success === null ? -1 : (r.success ? 1 : 0);
  return r[k];
}
function filteredRows() {
  const smin = numInput("step-min"), smax = numInput("step-max"), rmin = numInput("reward-min"), rmax = numInput("reward-max");
  const succ = $("success").value, st = $("status").value, q = $("search").value.trim().toLowerCase();
  const env = $("environment").value;
  return D.rows.filter((r) =>
    (smin === null || (r.step !== null && r.step >= smin)) && (smax === null || (r.step !== null && r.step <= smax)) &&
    (rmin === null || (r.reward !== null && r.reward >= rmin)) && (rmax === null || (r.reward !== null && r.reward <= rmax)) &&
    (succ === "" || String(r.success) === succ) && (st === "" || r.status === st) && (env === "" || r.env === env) && (q === "" || r.search.indexOf(q) >= 0));
}
const RENDER_MAX = 1000;
function rowHtml(r) {
  const succ = r.success === null ? "\u2014" : (r.success ? "yes" : "no");
  const versions = r.vmin === r.vmax ? fmt(r.vmin) : fmt(r.vmin) + "\u2013" + fmt(r.vmax);
  return '<tr class="ep-row' + (r.i === selected ? " selected" : "") + '" data-i="' + r.i + '">' +
    '<td class="' + (r.step_src === "estimated" ? "est" : "") + '" title="' + esc(r.step_src) + '">' + fmt(r.step) + "</td>" +
    '<td class="left ep-id" title="' + esc(r.id + " \u00b7 task " + r.task) + '">' + esc(r.id) + "</td><td>" + r.seg + "</td><td>" + fmt(r.reward) + "</td>" +
    '<td class="' + (r.success === true ? "ok" : (r.success === false ? "bad" : "")) + '">' + succ + "</td>" +
    "<td>" + r.turns + "</td><td>" + r.len + "</td><td>" + r.act + "</td><td>" + versions + "</td><td>" + fmt(r.lag) + "</td>" +
    '<td class="left">' + esc(r.status) + "</td></tr>";
}
function renderTable() {
  const rows = filteredRows();
  rows.sort(function (a, b) {
    const x = sortValue(a, sortKey), y = sortValue(b, sortKey);
    if (x === y) return a.i - b.i;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * sortDir;
  });
  tbody.innerHTML = rows.slice(0, RENDER_MAX).map(rowHtml).join("");
  $("row-count").textContent = rows.length + " of " + D.rows.length + " rows";
  $("more").textContent = rows.length > RENDER_MAX ? "the first " + RENDER_MAX + " of " + rows.length + " matching rows are listed; narrow the filter" : "";
  headRow.querySelectorAll("th").forEach(function (th) {
    th.classList.remove("sorted-asc", "sorted-desc");
    if (th.dataset.key === sortKey) th.classList.add(sortDir > 0 ? "sorted-asc" : "sorted-desc");
  });
}
["step-min", "step-max", "reward-min", "reward-max", "search"].forEach((id) => $(id).addEventListener("input", renderTable));
["success", "status", "environment"].forEach((id) => $(id).addEventListener("change", renderTable));
tbody.addEventListener("click", function (ev) {
  const tr = ev.target.closest("tr.ep-row");
  if (tr) openEpisode(Number(tr.dataset.i));
});

// ------------------------------------------------------------------ token view
const CHANNELS = D.channels;
const DIVERGING = {adv: 1, grad: 1, mismatch: 1};
const LOGSCALE = {ratio: 1, is_weight: 1};
const BINARY = {zero_grad: 1, rc_keep: 0};  // value that is highlighted
const chanSel = $("channel");
[["role", "role (prompt / action / observation)"]].concat(Object.keys(CHANNELS).map((k) => [k, CHANNELS[k]])).forEach(function (c) {
  const o = document.createElement("option");
  o.value = c[0]; o.textContent = c[1];
  chanSel.appendChild(o);
});
chanSel.addEventListener("change", function () { if (selected !== null) showEpisode(selected); });
let current = null;

function tokenText(id) {
  const t = D.vocab[String(id)];
  if (t === undefined) return "\u27e8" + id + "\u27e9";
  return t.replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u2192\t");
}
function channelScale(vals, ch) {
  let m = 0, lo = 0;
  vals.forEach(function (v) {
    if (v === null || v === undefined) return;
    if (LOGSCALE[ch]) m = Math.max(m, Math.abs(Math.log(Math.max(v, 1e-12))));
    else if (DIVERGING[ch]) m = Math.max(m, Math.abs(v));
    else { m = Math.max(m, v); lo = Math.min(lo, v); }
  });
  return {max: m, min: lo};
}
const scales = {};
function runScale(ch) {  // one scale per channel over every loaded trajectory: colours compare across episodes
  if (ch === "role") return {max: 0, min: 0};
  const key = ch + ":" + Object.keys(D.detail).length;
  if (!(key in scales)) {
    let vals = [];
    Object.keys(D.detail).forEach(function (k) { const c = D.detail[k].ch[ch]; if (c) vals = vals.concat(c); });
    scales[key] = channelScale(vals, ch);
  }
  return scales[key];
}
function colour(v, ch, sc) {
  if (v === null || v === undefined) return "repeating-linear-gradient(45deg,#e5e7eb,#e5e7eb 3px,#fff 3px,#fff 6px)";
  if (ch in BINARY) return v === BINARY[ch] ? "rgba(234,88,12,0.85)" : "rgba(22,163,74,0.18)";
  let x;
  if (LOGSCALE[ch] || DIVERGING[ch]) {
    x = LOGSCALE[ch] ? Math.log(Math.max(v, 1e-12)) : v;
    const a = sc.max > 0 ? Math.min(1, Math.abs(x) / sc.max) * 0.6 : 0;
    return x >= 0 ? "rgba(220,38,38," + a.toFixed(3) + ")" : "rgba(37,99,235," + a.toFixed(3) + ")";
  }
  if (ch === "entropy") { const a = sc.max > 0 ? Math.min(1, v / sc.max) * 0.6 : 0; return "rgba(147,51,234," + a.toFixed(3) + ")"; }
  const a = sc.min < 0 ? Math.min(1, v / sc.min) * 0.6 : 0;  // log-probs: darker = less likely
  return "rgba(202,138,4," + a.toFixed(3) + ")";
}
function legend(ch, d, sc) {
  const L = $("legend");
  if (ch === "role") {
    L.innerHTML = '<span><span class="swatch" style="background:#fff"></span> prompt</span>' +
      '<span><span class="swatch" style="background:#dbeafe"></span> action (trained, ' + d.n_action + ' tokens)</span>' +
      '<span><span class="swatch" style="background:#f3e8ff"></span> observation / tool result</span>';
    return;
  }
  if (!(ch in d.ch)) { L.innerHTML = '<span class="note">' + esc(CHANNELS[ch]) + ": not recorded for this trajectory (no token-log record, or not used by the recipe)</span>"; return; }
  if (ch in BINARY) {
    const n = d.ch[ch].filter((v) => v === BINARY[ch]).length;
    L.innerHTML = '<span><span class="swatch" style="background:rgba(234,88,12,0.85)"></span> ' + esc(CHANNELS[ch]) + " = " + BINARY[ch] + " (" + n + " tokens)</span>" +
      '<span><span class="swatch" style="background:rgba(22,163,74,0.18)"></span> otherwise</span>';
    return;
  }
  let bar, lo, hi;
  if (LOGSCALE[ch]) { bar = "linear-gradient(90deg,rgba(37,99,235,.6),#fff,rgba(220,38,38,.6))"; lo = fmt(Math.exp(-sc.max)); hi = fmt(Math.exp(sc.max)); }
  else if (DIVERGING[ch]) { bar = "linear-gradient(90deg,rgba(37,99,235,.6),#fff,rgba(220,38,38,.6))"; lo = fmt(-sc.max); hi = fmt(sc.max); }
  else if (ch === "entropy") { bar = "linear-gradient(90deg,#fff,rgba(147,51,234,.85))"; lo = "0"; hi = fmt(sc.max); }
  else { bar = "linear-gradient(90deg,rgba(202,138,4,.85),#fff)"; lo = fmt(sc.min); hi = "0"; }
  L.innerHTML = "<span>" + esc(CHANNELS[ch]) + ":</span><span>" + lo + ' <span class="bar" style="background:' + bar + '"></span> ' + hi + "</span>" +
    '<span class="note">one scale for every loaded episode \u00b7 hatched: no value</span>';
}
function showEpisode(i) {
  const d = D.detail[String(i)], r = D.rows[i], ch = chanSel.value;
  current = d;
  const rec = d.step !== undefined ? " \u00b7 token record: step " + d.step + ", epoch " + (d.epoch + 1) + "/" + d.epochs : " \u00b7 no token record";
  $("episode-title").textContent = r.id + " (segment " + r.seg + ") \u00b7 reward " + fmt(r.reward) + " \u00b7 " + d.n_action + " action tokens" + rec;
  const sc = runScale(ch);
  legend(ch, d, sc);
  const parts = [];
  let a = 0, t = 0;
  for (let p = 0; p < d.ids.length; p++) {
    if (t < d.turns.length && d.turns[t].start === p) {
      const tu = d.turns[t];
      const tool = tu.tool ? " \u00b7 tool call: " + esc(tu.tool) + (tu.tool_error ? " (error: " + esc(tu.tool_error) + ")" : "") : "";
      parts.push('<span class="turn-head' + (tu.tool ? " tool" : "") + '">turn ' + tu.k + " \u00b7 policy v" + tu.version + " \u00b7 reward " + fmt(tu.reward) +
                 tool + (tu.cut ? " \u00b7 cut at max_new_tokens" : "") + "</span>");
      t++;
    }
    const k = d.turn[p];
    if (k >= 0 && d.turns[k].obs === p && d.turns[k].end > p)
      parts.push('<span class="obs-head">' + (d.turns[k].tool ? "tool result (" + esc(d.turns[k].tool) + ")" : "observation") + "</span>");
    const role = d.role[p];
    const cls = role === 1 ? "action" : (role === 2 ? "obs" : "prompt");
    let style = "";
    if (ch === "role") style = role === 1 ? "background:#dbeafe" : (role === 2 ? "background:#f3e8ff" : "");
    else if (role === 1 && (ch in d.ch)) style = "background:" + colour(d.ch[ch][a], ch, sc);
    parts.push('<span class="tok ' + cls + '" data-p="' + p + '"' + (role === 1 ? ' data-a="' + a + '"' : "") +
               (style ? ' style="' + style + '"' : "") + ">" + esc(tokenText(d.ids[p])) + "</span>");
    if (role === 1) a++;
  }
  $("tokens").innerHTML = parts.join("");
  tbody.querySelectorAll("tr.ep-row").forEach((tr) => tr.classList.toggle("selected", Number(tr.dataset.i) === i));
}
function openEpisode(i) {
  selected = i;
  if (D.detail[String(i)] !== undefined) { showEpisode(i); return; }
  if (!D.serve) {
    $("episode-title").textContent = D.rows[i].id + ": token detail not embedded (page cap); run trajgrad view with --serve";
    $("tokens").innerHTML = ""; $("legend").innerHTML = "";
    return;
  }
  $("episode-title").textContent = "loading " + D.rows[i].id + " \u2026";
  fetch("episode/" + i + ".json").then((res) => res.json()).then(function (got) {
    D.detail[String(i)] = got.detail;
    Object.assign(D.vocab, got.vocab);
    if (selected === i) showEpisode(i);
  }).catch(function (err) { $("episode-title").textContent = "could not load " + D.rows[i].id + ": " + err; });
}
const tip = $("tip");
$("tokens").addEventListener("mouseover", function (ev) {
  const el = ev.target.closest(".tok");
  if (!el || !current) { tip.style.display = "none"; return; }
  const p = Number(el.dataset.p), id = current.ids[p], k = current.turn[p];
  const lines = ["position " + p + " \u00b7 id " + id + " \u00b7 " + JSON.stringify(D.vocab[String(id)] === undefined ? "?" : D.vocab[String(id)]),
                 ["prompt", "action", "observation"][current.role[p]] + (k >= 0 ? " \u00b7 turn " + k : "")];
  if (el.dataset.a !== undefined) {
    const a = Number(el.dataset.a);
    Object.keys(CHANNELS).forEach(function (c) { if (c in current.ch) lines.push(c.padEnd(10) + " " + fmt(current.ch[c][a], 6)); });
  }
  tip.textContent = lines.join("\n");
  tip.style.display = "block";
});
$("tokens").addEventListener("mousemove", function (ev) {
  tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 4) + "px";
  tip.style.top = Math.min(ev.clientY + 14, window.innerHeight - tip.offsetHeight - 4) + "px";
});
$("tokens").addEventListener("mouseleave", function () { tip.style.display = "none"; });

// ------------------------------------------------------------------ learning curves (inline SVG)
const FEATURED = [/^reward\/mean$/, /^success\/rate$/, /^eval\/success/, /^loss$/, /^clip_frac$/, /^entropy$/,
  /^mismatch\/k3_learner_vs_sampler$/, /^grad_norm$/, /^kl\/k3$/, /^correction\//, /^len\/action_tokens$/];
const metricNames = Object.keys(D.curves).sort();
const shown = [];
FEATURED.forEach(function (re) { metricNames.forEach(function (m) { if (re.test(m) && shown.indexOf(m) < 0 && shown.length < 9) shown.push(m); }); });
metricNames.forEach(function (m) { const o = document.createElement("option"); o.value = m; o.textContent = m; $("metric-add").appendChild(o); });
$("metric-add").addEventListener("change", function () { const m = this.value; if (m && shown.indexOf(m) < 0) { shown.push(m); drawCurves(); } this.value = ""; });
function chartSvg(name, pts) {
  const W = 250, H = 110, L = 42, R = 6, T = 6, B = 18;
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  pts.forEach(function (q) { x0 = Math.min(x0, q[0]); x1 = Math.max(x1, q[0]); y0 = Math.min(y0, q[1]); y1 = Math.max(y1, q[1]); });
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const poly = pts.map((q) => sx(q[0]).toFixed(1) + "," + sy(q[1]).toFixed(1)).join(" ");
  const dots = pts.length <= 60 ? pts.map((q) => '<circle cx="' + sx(q[0]).toFixed(1) + '" cy="' + sy(q[1]).toFixed(1) + '" r="1.8" fill="#2563eb"/>').join("") : "";
  const last = pts[pts.length - 1];
  return '<div class="chart"><div class="title">' + esc(name) + " \u00b7 last " + fmt(last[1]) + " at step " + fmt(last[0]) + "</div>" +
    '<svg width="' + W + '" height="' + H + '" viewBox="0 0 ' + W + " " + H + '" role="img" aria-label="' + esc(name) + '">' +
    '<rect x="' + L + '" y="' + T + '" width="' + (W - L - R) + '" height="' + (H - T - B) + '" fill="none" stroke="#d9dde3"/>' +
    '<text x="' + (L - 3) + '" y="' + (T + 8) + '" font-size="9" text-anchor="end" fill="#6b7280">' + fmt(y1, 3) + "</text>" +
    '<text x="' + (L - 3) + '" y="' + (H - B) + '" font-size="9" text-anchor="end" fill="#6b7280">' + fmt(y0, 3) + "</text>" +
    '<text x="' + L + '" y="' + (H - 5) + '" font-size="9" fill="#6b7280">' + fmt(x0) + "</text>" +
    '<text x="' + (W - R) + '" y="' + (H - 5) + '" font-size="9" text-anchor="end" fill="#6b7280">step ' + fmt(x1) + "</text>" +
    '<polyline fill="none" stroke="#2563eb" stroke-width="1.4" points="' + poly + '"/>' + dots + "</svg></div>";
}
function drawCurves() {
  $("curves").innerHTML = shown.length ? shown.map((m) => chartSvg(m, D.curves[m])).join("") : '<span class="note">no metrics.jsonl records</span>';
}
drawCurves();
renderTable();
if (D.rows.length) {
  const last = D.rows.length - 1;
  if (D.detail[String(last)] !== undefined) openEpisode(last);
}
})();
"""
