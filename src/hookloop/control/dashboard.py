"""The live dashboard: one self-contained page served at ``GET /``.

No external assets: the style sheet and the script are inline, the chart is an
inline SVG redrawn from ``/jobs/{id}/history``, and the page polls
``/jobs/{id}/status`` once a second.

How the page authenticates, and why this way: it asks once for the job's
token (``hookloop ctl JOB token`` prints it), keeps it in the tab's
``sessionStorage`` and sends it in an ``Authorization: Bearer`` header with each
``fetch``. So

- the token never appears in a URL, hence never in server or proxy logs,
  browser history, bookmarks or ``Referer`` headers; the page itself is
  served without authentication and holds no secret;
- the browser never attaches it on its own (unlike a cookie), so another site
  cannot make the browser send commands (no CSRF, and DNS rebinding gains
  nothing), and the server sends no CORS headers at all;
- it lives only as long as the tab (``sessionStorage`` is per tab, per origin).

Its weakness, script injection reading ``sessionStorage``, is closed by the
page's own strictness: every server value goes into the page through
``textContent`` or SVG attributes, never as markup, and a
``Content-Security-Policy`` allows only this exact script and style sheet
(pinned by their SHA-256) and connections to this origin. The token input is
not inside a ``<form>``, so even a page whose script failed could not submit
it in a query string.
"""

from __future__ import annotations

import base64
import hashlib

STYLE = """
:root { color-scheme: light dark; --fg: #1b1f24; --bg: #f6f7f9; --card: #fff; --mute: #6a737d;
  --line: #2f6fde; --eval: #d2522b; --grid: #d9dde3; --ok: #1a7f37; --bad: #c62828; }
@media (prefers-color-scheme: dark) {
  :root { --fg: #e6e9ee; --bg: #14171c; --card: #1d2128; --mute: #98a1ad; --grid: #333a44;
    --line: #6ea1ff; --eval: #ff8a5c; }
}
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, sans-serif; color: var(--fg); background: var(--bg); }
header { display: flex; gap: 1em; align-items: baseline; padding: 12px 20px;
  border-bottom: 1px solid var(--grid); flex-wrap: wrap; }
header h1 { font-size: 18px; margin: 0; }
#job { font-family: ui-monospace, monospace; color: var(--mute); }
#conn { margin-left: auto; font-size: 12px; color: var(--mute); }
#conn.live { color: var(--ok); } #conn.down { color: var(--bad); }
main { padding: 16px 20px; max-width: 1100px; margin: 0 auto; }
section { background: var(--card); border: 1px solid var(--grid); border-radius: 8px;
  padding: 14px 16px; margin-bottom: 14px; }
.hidden { display: none; }
#login p { margin: 0 0 8px; color: var(--mute); }
#login input { width: min(36em, 100%); padding: 6px 8px; font-family: ui-monospace, monospace; }
dl { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr));
  gap: 10px 18px; margin: 0; }
dt { font-size: 12px; color: var(--mute); }
dd { margin: 0; font-size: 17px; font-variant-numeric: tabular-nums; }
progress { width: 100%; height: 8px; margin-top: 12px; }
#chart { width: 100%; height: auto; display: block; }
#chart .grid { stroke: var(--grid); stroke-width: 1; }
#chart .curve { fill: none; stroke: var(--line); stroke-width: 1.6; }
#chart .eval { fill: var(--eval); }
#chart text { fill: var(--mute); font-size: 11px; }
.row { display: flex; gap: 8px; align-items: center; flex-wrap: wrap; }
.legend { color: var(--mute); font-size: 12px; margin-left: auto; }
button { padding: 6px 12px; border-radius: 6px; border: 1px solid var(--grid);
  background: var(--card); color: var(--fg); cursor: pointer; font: inherit; }
button:hover { border-color: var(--line); }
button.danger { color: var(--bad); }
button:disabled { opacity: .5; cursor: default; }
#message { margin-top: 10px; min-height: 1.4em; color: var(--mute); }
#costs table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
#costs th, #costs td { text-align: right; padding: 2px 8px; border-bottom: 1px solid var(--grid); }
#costs th:nth-child(-n+2), #costs td:nth-child(-n+2) { text-align: left; }
#costs caption { text-align: left; color: var(--mute); padding-bottom: 6px; }
"""

SCRIPT = """
"use strict";
const KEY = "hookloop.token";
const $ = (id) => document.getElementById(id);
const state = { job: null, seq: 0, timer: null, train: [], evals: [], keys: new Set() };

function token() { return sessionStorage.getItem(KEY) || ""; }

function showLogin(show, why) {
  $("login").classList.toggle("hidden", !show);
  $("app").classList.toggle("hidden", show);
  if (why) { $("login-why").textContent = why; }
  if (show) { $("token").focus(); }
}

function setConn(text, cls) {
  const el = $("conn");
  el.textContent = text;
  el.className = cls || "";
}

class Unauthorized extends Error {}

async function api(path, options) {
  const opts = Object.assign({ cache: "no-store", credentials: "omit" }, options || {});
  opts.headers = Object.assign({}, opts.headers || {}, { Authorization: "Bearer " + token() });
  const response = await fetch(path, opts);
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (response.status === 401) {
    sessionStorage.removeItem(KEY);
    clearTimeout(state.timer);
    showLogin(true, "The token was not accepted. Paste it again.");
    throw new Unauthorized();
  }
  return { status: response.status, body: body || {} };
}

function fmt(v) {
  if (typeof v !== "number") { return v === null || v === undefined ? "\\u2013" : String(v); }
  if (Number.isInteger(v)) { return String(v); }
  const a = Math.abs(v);
  return (a !== 0 && (a >= 1e5 || a < 1e-3)) ? v.toExponential(3) : v.toPrecision(4);
}

function duration(s) {
  if (typeof s !== "number") { return "\\u2013"; }
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + r + "s";
}

function render(st) {
  $("phase").textContent = st.stopping ? st.phase + " (" + st.stopping + " filed)" : st.phase;
  $("step").textContent = fmt(st.step) + (st.max_steps ? " / " + st.max_steps : "");
  $("epoch").textContent = fmt(st.epoch);
  $("rate").textContent = st.steps_per_s === null ? "\\u2013" : fmt(st.steps_per_s);
  $("eta").textContent = duration(st.eta_s);
  const m = st.metrics || {}, e = st.eval || {};
  $("loss").textContent = fmt(m.loss);
  $("lr").textContent = fmt(m.lr);
  const at = st.eval_step !== null ? " @ " + st.eval_step : "";
  $("eval-loss").textContent = fmt(e.eval_loss) + at;
  $("ckpt").textContent = st.checkpoint ? "step " + st.checkpoint.step : "\\u2013";
  const bar = $("progress");
  if (st.max_steps) {
    bar.max = st.max_steps;
    bar.value = st.step;
  } else {
    bar.removeAttribute("value");
  }
  for (const b of document.querySelectorAll("button[data-command]")) {
    const c = b.dataset.command;
    b.disabled = Boolean(st.stopping) || st.phase === "finished"
      || (!st.can_save && (c === "save_checkpoint" || c === "save_and_stop"))
      || (!st.can_evaluate && c === "evaluate_now");
  }
}

const COST_COLUMNS = ["callback", "event", "calls", "total_ms", "us_per_call", "share"];

function renderCosts(rows) {
  // callbacks.profile=true: the cost of each handler, most expensive first (top 12)
  $("costs").classList.toggle("hidden", !Array.isArray(rows));
  if (!Array.isArray(rows)) { return; }
  const body = $("cost-rows");
  body.replaceChildren();
  for (const row of rows.slice(0, 12)) {
    const tr = document.createElement("tr");
    for (const key of COST_COLUMNS) {
      const td = document.createElement("td");
      const v = row[key];
      td.textContent = key === "share" && typeof v === "number"
        ? (100 * v).toFixed(2) + " %" : fmt(v);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

function addRecord(rec) {
  const values = {};
  for (const [k, v] of Object.entries(rec)) {
    if (typeof v === "number" && !["seq", "step", "time"].includes(k)) { values[k] = v; }
  }
  if (rec.kind === "train") {
    state.train.push({ step: rec.step, values: values });
    for (const k of Object.keys(values)) {
      if (!state.keys.has(k)) {
        state.keys.add(k);
        const opt = document.createElement("option");
        opt.value = k; opt.textContent = k;
        $("metric").appendChild(opt);
      }
    }
  } else if (rec.kind === "eval") {
    state.evals.push({ step: rec.step, values: values });
  }
}

const SVG = "http://www.w3.org/2000/svg";
function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) { el.setAttribute(k, String(v)); }
  if (text !== undefined) { el.textContent = text; }
  return el;
}

function draw() {
  const svg = $("chart"), key = $("metric").value || "loss", logScale = $("log").checked;
  const W = 800, H = 300, L = 64, R = 12, T = 12, B = 28;
  const ok = (v) => typeof v === "number" && isFinite(v) && (!logScale || v > 0);
  const tf = (v) => (logScale ? Math.log10(v) : v);
  const pick = (list, k) => list.filter((p) => ok(p.values[k])).map((p) => [p.step, p.values[k]]);
  const pts = pick(state.train, key);
  const evs = pick(state.evals, key.startsWith("eval_") ? key : "eval_" + key);
  const all = pts.concat(evs);
  svg.replaceChildren();
  svg.setAttribute("data-points", String(pts.length));
  const evText = evs.length ? ", " + evs.length + " evaluations" : "";
  $("points").textContent = pts.length + " points" + evText;
  if (!all.length) {
    const note = "waiting for logged values of " + key;
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, note));
    return;
  }
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = Math.min(...all.map((p) => tf(p[1]))), y1 = Math.max(...all.map((p) => tf(p[1])));
  if (x1 === x0) { x1 = x0 + 1; }
  if (y1 === y0) { y1 = y0 + 1; y0 = y0 - 1; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (tf(y) - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const yv = y0 + ((y1 - y0) * i) / 4, yp = T + (1 - i / 4) * (H - T - B);
    svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: yp, y2: yp, class: "grid" }));
    const label = fmt(logScale ? Math.pow(10, yv) : yv);
    svg.appendChild(svgEl("text", { x: L - 6, y: yp + 4, "text-anchor": "end" }, label));
  }
  svg.appendChild(svgEl("text", { x: L, y: H - 8 }, "step " + x0));
  svg.appendChild(svgEl("text", { x: W - R, y: H - 8, "text-anchor": "end" }, "step " + x1));
  svg.appendChild(svgEl("polyline", {
    class: "curve",
    points: pts.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "),
  }));
  for (const p of evs) {
    svg.appendChild(svgEl("circle", { class: "eval", cx: sx(p[0]), cy: sy(p[1]), r: 3.5 }));
  }
}

function base() { return "/jobs/" + encodeURIComponent(state.job); }

async function poll() {
  clearTimeout(state.timer);
  try {
    const st = await api(base() + "/status");
    if (st.status !== 200) { throw new Error(st.body.error || "HTTP " + st.status); }
    render(st.body);
    renderCosts(st.body.callback_profile);
    if (st.body.history_seq > state.seq) {
      const h = await api(base() + "/history?after=" + state.seq);
      if (h.status === 200) {
        for (const rec of h.body.records) { addRecord(rec); }
        state.seq = h.body.last_seq;
        draw();
      }
    }
    setConn("live", "live");
  } catch (err) {
    if (err instanceof Unauthorized) { return; }
    setConn("disconnected: the job has ended or cannot be reached", "down");
  }
  state.timer = setTimeout(poll, 1000);
}

async function connect() {
  showLogin(false);
  setConn("connecting\\u2026");
  try {
    const r = await api("/jobs");
    if (r.status !== 200 || !r.body.jobs || !r.body.jobs.length) { throw new Error("no job"); }
    state.job = r.body.jobs[0].job_id;
    $("job").textContent = state.job;
    document.title = "hookloop \\u2013 " + state.job;
  } catch (err) {
    if (!(err instanceof Unauthorized)) { setConn("cannot reach the job", "down"); }
    return;
  }
  poll();
}

async function send(command, question) {
  if (question && !window.confirm(question)) { return; }
  $("message").textContent = "sending " + command + "\\u2026";
  try {
    const r = await api(base() + "/control", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ command: command }),
    });
    $("message").textContent = r.body.message || r.body.error || "HTTP " + r.status;
  } catch (err) {
    if (!(err instanceof Unauthorized)) {
      $("message").textContent = command + " failed: " + err.message;
    }
  }
  poll();
}

function login() {
  const value = $("token").value.trim();
  if (!value) { return; }
  sessionStorage.setItem(KEY, value);
  $("token").value = "";
  connect();
}

$("connect").addEventListener("click", login);
$("token").addEventListener("keydown", (ev) => { if (ev.key === "Enter") { login(); } });
$("forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  clearTimeout(state.timer);
  showLogin(true, "Token forgotten.");
});
$("metric").addEventListener("change", draw);
$("log").addEventListener("change", draw);
for (const b of document.querySelectorAll("button[data-command]")) {
  b.addEventListener("click", () => send(b.dataset.command, b.dataset.confirm));
}
if (token()) { connect(); } else { showLogin(true); }
"""

BODY = """
<header>
  <h1>hookloop</h1><span id="job"></span><span id="conn">not connected</span>
</header>
<main>
  <section id="login" class="hidden">
    <p id="login-why">This job's control page needs its token.</p>
    <p>Run <code>hookloop ctl JOB token</code> (or read the <code>auth_token</code> file in the
    job's directory) and paste it here. It stays in this tab only and is sent as a request
    header, never in a URL.</p>
    <div class="row">
      <input id="token" type="password" autocomplete="off" spellcheck="false"
             placeholder="token" aria-label="token">
      <button id="connect" type="button">Connect</button>
    </div>
  </section>
  <div id="app" class="hidden">
    <section>
      <dl>
        <div><dt>phase</dt><dd id="phase">&#8211;</dd></div>
        <div><dt>step</dt><dd id="step">&#8211;</dd></div>
        <div><dt>epoch</dt><dd id="epoch">&#8211;</dd></div>
        <div><dt>steps / s</dt><dd id="rate">&#8211;</dd></div>
        <div><dt>ETA</dt><dd id="eta">&#8211;</dd></div>
        <div><dt>loss</dt><dd id="loss">&#8211;</dd></div>
        <div><dt>lr</dt><dd id="lr">&#8211;</dd></div>
        <div><dt>eval loss</dt><dd id="eval-loss">&#8211;</dd></div>
        <div><dt>last checkpoint</dt><dd id="ckpt">&#8211;</dd></div>
      </dl>
      <progress id="progress"></progress>
    </section>
    <section>
      <div class="row">
        <label>metric <select id="metric"><option value="loss">loss</option></select></label>
        <label><input id="log" type="checkbox"> log scale</label>
        <span class="legend"><span id="points">0 points</span> &#183; line: train,
          dots: evaluation</span>
      </div>
      <svg id="chart" viewBox="0 0 800 300" role="img" aria-label="metric curve"
           data-points="0"></svg>
    </section>
    <section>
      <div class="row">
        <button type="button" data-command="save_checkpoint">Save checkpoint</button>
        <button type="button" data-command="evaluate_now">Evaluate now</button>
        <button type="button" data-command="graceful_stop"
                data-confirm="Stop training after this step (saving a checkpoint)?">Stop</button>
        <button type="button" data-command="save_and_stop"
                data-confirm="Save a checkpoint and stop training?">Save &amp; stop</button>
        <button type="button" class="danger" data-command="abort"
                data-confirm="Abort training now, WITHOUT saving?">Abort</button>
        <button type="button" id="forget" class="legend">Forget token</button>
      </div>
      <div id="message"></div>
    </section>
    <section id="costs" class="hidden">
      <table>
        <caption>Cost per callback (callbacks.profile=true), most expensive first</caption>
        <thead><tr><th>callback</th><th>event</th><th>calls</th><th>total ms</th>
          <th>&#181;s / call</th><th>share of run</th></tr></thead>
        <tbody id="cost-rows"></tbody>
      </table>
    </section>
  </div>
</main>
"""


def _digest(text: str) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


#: The Content-Security-Policy the page is served with: only this script and style.
CSP = "; ".join(
    [
        "default-src 'none'",
        f"script-src {_digest(SCRIPT)}",
        f"style-src {_digest(STYLE)}",
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)

#: The page itself, as served.
PAGE = (
    '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
    '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
    '<meta name="referrer" content="no-referrer">\n'
    '<link rel="icon" href="data:,">\n'
    "<title>hookloop</title>\n"
    f"<style>{STYLE}</style>\n</head><body>{BODY}<script>{SCRIPT}</script>\n</body></html>\n"
).encode()
