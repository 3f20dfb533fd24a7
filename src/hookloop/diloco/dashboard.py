"""The page ``GET /dashboard`` serves: the server's status, refreshed every two seconds,
with buttons for the admin routes (pausing and resuming the outer loop among them). It
reads ``/status`` and posts to ``/control/...`` with the bearer token typed into the
page (kept in the tab's sessionStorage).

The page itself holds no secret and is served without the token. What it shows
comes from workers (their ids and host names), so it is written for hostile
values: every value enters the document through ``textContent`` or ``dataset``,
never as markup, and the page is served with a Content-Security-Policy that
allows only this page's own script and style sheet (pinned by their SHA-256,
:func:`hookloop.control.pages.page_csp`) and connections to its own origin, so
an inline handler or injected ``<script>`` would not run either. Buttons are
wired with ``addEventListener``.
"""

from __future__ import annotations

from hookloop.control.pages import page, page_csp

STYLE = """
body { font-family: sans-serif; margin: 2em; }
td, th { padding: 2px 10px; text-align: left; }
.err { color: #b00; }
"""

SCRIPT = """
"use strict";
const KEY = "hookloop.diloco.token";
const $ = (id) => document.getElementById(id);

function headers() {
  const h = { "Content-Type": "application/json" };
  const token = $("tok").value;
  if (token) { h.Authorization = "Bearer " + token; }
  return h;
}

async function act(action, body) {
  const r = await fetch("/control/" + encodeURIComponent(action), {
    method: "POST", headers: headers(), body: JSON.stringify(body),
    cache: "no-store", credentials: "omit",
  });
  const msg = $("msg");
  msg.className = r.ok ? "" : "err";
  msg.textContent = action + ": " + await r.text();
  refresh();
}

function cell(row, value) {
  const td = document.createElement("td");
  td.textContent = String(value);
  row.appendChild(td);
  return td;
}

function workerRow(id, w) {
  const tr = document.createElement("tr");
  cell(tr, id);
  cell(tr, w.hostname);
  cell(tr, w.sync_round);
  cell(tr, Number(w.steps_per_second).toFixed(2));
  cell(tr, new Date(w.last_heartbeat * 1000).toLocaleTimeString());
  const kick = document.createElement("button");
  kick.type = "button";
  kick.textContent = "kick";
  kick.dataset.id = id;
  kick.addEventListener("click", () => act("kick_worker", { worker_id: kick.dataset.id }));
  cell(tr, "").appendChild(kick);
  return tr;
}

function pauseLine(s) {
  if (!s.paused) { return "outer loop running"; }
  return "outer loop PAUSED since " + new Date(s.paused_since * 1000).toLocaleString()
    + " by " + s.paused_by + ": no round advances, workers train on locally";
}

function summary(s) {
  return "mode " + s.mode + " \\u00b7 round " + s.sync_round + " \\u00b7 workers "
    + s.num_registered + "/" + s.num_workers + " \\u00b7 outer lr " + s.outer_lr
    + " momentum " + s.outer_momentum + " \\u00b7 " + s.model_params + " parameters ("
    + s.model_size_mb + " MB) \\u00b7 up " + Math.round(s.uptime_seconds) + " s";
}

async function refresh() {
  const box = $("summary");
  try {
    const opts = { headers: headers(), cache: "no-store", credentials: "omit" };
    const r = await fetch("/status", opts);
    const s = await r.json();
    if (!r.ok) {
      box.className = "err";
      box.textContent = String(s.error);
      return;
    }
    box.className = "";
    box.textContent = summary(s);
    $("paused").className = s.paused ? "err" : "";
    $("paused").textContent = pauseLine(s);
    $("workers").replaceChildren(
      ...Object.entries(s.workers).map(([id, w]) => workerRow(id, w)));
  } catch (e) {
    box.className = "err";
    box.textContent = "server unreachable";
  }
}

function numbers(fields) {
  // the inputs that hold a value, as numbers
  const body = {};
  for (const [key, id] of Object.entries(fields)) {
    const text = $(id).value.trim();
    if (text) { body[key] = Number(text); }
  }
  return body;
}

$("tok").value = sessionStorage.getItem(KEY) || "";
$("tok").addEventListener("change", () => {
  sessionStorage.setItem(KEY, $("tok").value);
  refresh();
});
$("apply-optimizer").addEventListener("click",
  () => act("update_optimizer", numbers({ lr: "lr", momentum: "mom" })));
$("apply-workers").addEventListener("click",
  () => act("update_num_workers", numbers({ num_workers: "nw" })));
$("save").addEventListener("click", () => act("save_state", {}));
$("pause").addEventListener("click", () => act("pause", { client: "dashboard" }));
$("resume").addEventListener("click", () => act("resume", { client: "dashboard" }));
$("shutdown").addEventListener("click", () => {
  if (window.confirm("Shut the server down?")) { act("shutdown", {}); }
});
refresh();
setInterval(refresh, 2000);
"""

BODY = """
<h1>DiLoCo server</h1>
<p>Token (only if the server has one): <input id="tok" type="password" size="40"
  autocomplete="off" aria-label="token"></p>
<div id="summary">loading...</div>
<p id="paused"></p>
<h2>Workers</h2>
<table><thead><tr><th>id</th><th>host</th><th>syncs</th><th>steps/s</th>
<th>last heartbeat</th><th></th></tr></thead><tbody id="workers"></tbody></table>
<h2>Admin</h2>
<p>outer lr <input id="lr" size="6"> momentum <input id="mom" size="6">
<button type="button" id="apply-optimizer">apply</button>
&nbsp; workers <input id="nw" size="4">
<button type="button" id="apply-workers">apply</button>
&nbsp; <button type="button" id="save">save now</button>
<button type="button" id="pause">pause rounds</button>
<button type="button" id="resume">resume rounds</button>
<button type="button" id="shutdown">shut down</button></p>
<p id="msg"></p>
"""

#: The Content-Security-Policy the page is served with: only this script and style.
CSP = page_csp(SCRIPT, STYLE)

#: The page itself, as served.
PAGE = page("DiLoCo Dashboard", STYLE, BODY, SCRIPT)
