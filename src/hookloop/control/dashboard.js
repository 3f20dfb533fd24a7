
"use strict";
const KEY = "hookloop.token";
const $ = (id) => document.getElementById(id);
const state = {
  job: null, seq: 0, timer: null, train: [], evals: [], keys: new Set(),
  inputs: new Map(), settings: {},
};

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
  if (typeof v !== "number") { return v === null || v === undefined ? "\u2013" : String(v); }
  if (Number.isInteger(v)) { return String(v); }
  const a = Math.abs(v);
  return (a !== 0 && (a >= 1e5 || a < 1e-3)) ? v.toExponential(3) : v.toPrecision(4);
}

function duration(s) {
  if (typeof s !== "number") { return "\u2013"; }
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + r + "s";
}

function render(st) {
  const held = st.paused ? " (paused at step " + st.paused_at_step + ")" : "";
  $("phase").textContent = (st.stopping ? st.phase + " (" + st.stopping + " filed)" : st.phase)
    + held;
  $("step").textContent = fmt(st.step) + (st.max_steps ? " / " + st.max_steps : "");
  $("epoch").textContent = fmt(st.epoch);
  $("rate").textContent = st.steps_per_s === null ? "\u2013" : fmt(st.steps_per_s);
  $("eta").textContent = duration(st.eta_s);
  const m = st.metrics || {}, e = st.eval || {};
  $("loss").textContent = fmt(m.loss);
  $("lr").textContent = fmt(m.lr);
  const at = st.eval_step !== null ? " @ " + st.eval_step : "";
  $("eval-loss").textContent = fmt(e.eval_loss) + at;
  $("ckpt").textContent = st.checkpoint ? "step " + st.checkpoint.step : "\u2013";
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
      || (!st.can_evaluate && c === "evaluate_now")
      || (c === "pause" && Boolean(st.paused)) || (c === "resume" && !st.paused);
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

// -- the Settings panel: the job's live settings (a `set` changes them at a step's end) --
const NUMBER = /^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/;

function settingText(v) {
  // a value as its input shows it: a list as "0.9, 0.95", null (off) as empty
  if (v === null || v === undefined) { return ""; }
  if (Array.isArray(v)) {
    const nested = v.some((x) => typeof x === "object" && x !== null);
    return nested ? JSON.stringify(v) : v.map(String).join(", ");
  }
  return String(v);
}

function settingValue(text, current) {
  // what an input's text stands for: numbers as numbers, empty as null (off), a list
  // as a list; anything else goes as typed and the server says what the key takes
  if (typeof current === "string") { return text; }
  const t = text.trim();
  if (t === "" || t === "null") { return null; }
  if (t.startsWith("[")) {
    try { return JSON.parse(t); } catch (e) { return t; }
  }
  if (Array.isArray(current) || t.includes(",")) {
    return t.split(",").map((part) => settingValue(part, 0));
  }
  if (NUMBER.test(t) && isFinite(Number(t))) { return Number(t); }
  if (t === "true" || t === "false") { return t === "true"; }
  return t;
}

function changeText(v) {
  if (v === null || v === undefined) { return "off"; }
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

function isEdited(input) { return input.value !== input.dataset.shown; }

function released(input, st) {
  // an applied input keeps what was sent until the job has acted on it
  const at = Number(input.dataset.hold);
  return st.phase === "finished" || st.step >= at + 2
    || (st.changes || []).some((rec) => rec.step >= at);
}

function refreshInput(input, value, st) {
  // never overwrite what the user is typing or has typed and not yet applied
  if (document.activeElement === input) { return; }
  if (input.dataset.hold !== undefined) {
    if (!released(input, st)) { return; }
    delete input.dataset.hold;
  } else if (isEdited(input)) {
    return;
  }
  input.value = settingText(value);
  input.dataset.shown = input.value;
  input.placeholder = value === null ? "off" : "";
  input.classList.remove("edited");
}

function settingInput(key) {
  const label = document.createElement("label");
  label.appendChild(document.createTextNode(key));
  const input = document.createElement("input");
  input.type = "text";
  input.autocomplete = "off";
  input.spellcheck = false;
  input.dataset.key = key;
  input.dataset.shown = "";
  input.setAttribute("aria-label", key);
  input.addEventListener("input", () => {
    delete input.dataset.hold;
    input.classList.toggle("edited", isEdited(input));
  });
  input.addEventListener("keydown", (ev) => { if (ev.key === "Enter") { applySettings(); } });
  label.appendChild(input);
  $("setting-fields").appendChild(label);
  return input;
}

function renderSettings(st) {
  const settings = st.settings;
  const live = Boolean(settings) && typeof settings === "object" && !Array.isArray(settings);
  $("settings").classList.toggle("hidden", !live);
  if (!live) { return; }
  state.settings = settings;
  for (const [key, value] of Object.entries(settings)) {
    if (!state.inputs.has(key)) { state.inputs.set(key, settingInput(key)); }
    refreshInput(state.inputs.get(key), value, st);
  }
  for (const [key, input] of state.inputs) {
    const idle = document.activeElement !== input && !isEdited(input);
    if (!(key in settings) && idle) {
      input.parentElement.remove();
      state.inputs.delete(key);
    }
  }
  $("apply").disabled = Boolean(st.stopping) || st.phase === "finished";
  renderChanges(Array.isArray(st.changes) ? st.changes : []);
}

function renderChanges(records) {
  const rows = [];
  for (const rec of records.slice().reverse()) {
    if (rec && Array.isArray(rec.changes)) { rows.push(...rec.changes); }
  }
  $("changes").classList.toggle("hidden", !rows.length);
  const body = $("change-rows");
  body.replaceChildren();
  for (const c of rows.slice(0, 12)) {
    const tr = document.createElement("tr");
    const cells = [fmt(c.step), String(c.key),
      changeText(c.old) + " \u2192 " + changeText(c.new), String(c.client || "")];
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

async function applySettings() {
  // one `set` with the edited keys only
  const values = {}, sent = [], msg = $("setting-message");
  for (const [key, input] of state.inputs) {
    if (isEdited(input) && input.dataset.hold === undefined) {
      values[key] = settingValue(input.value, state.settings[key]);
      sent.push(input);
    }
  }
  const scale = $("lr-scale").value.trim();
  if (scale) { values.lr_scale = settingValue(scale, 1); }
  msg.className = "";
  if (!Object.keys(values).length) {
    msg.textContent = "nothing to apply: edit a value first";
    return;
  }
  const asked = Object.entries(values).map(([k, v]) => k + "=" + JSON.stringify(v)).join(", ");
  msg.textContent = "sending set " + asked + "\u2026";
  try {
    const r = await api(base() + "/control", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ command: "set", values: values, client: "dashboard" }),
    });
    if (r.status === 200) {
      const at = typeof r.body.step === "number" ? r.body.step : 0;
      for (const input of sent) { input.dataset.hold = String(at); }
      $("lr-scale").value = "";
      msg.textContent = (r.body.status || "acknowledged") + ": " + asked + " (filed at step "
        + at + ", applied at the end of the step)";
    } else {
      msg.textContent = r.body.error || "HTTP " + r.status;
      msg.className = "bad";
    }
  } catch (err) {
    if (!(err instanceof Unauthorized)) {
      msg.textContent = "set failed: " + err.message;
      msg.className = "bad";
    }
  }
  poll();
}

function base() { return "/jobs/" + encodeURIComponent(state.job); }

async function poll() {
  clearTimeout(state.timer);
  try {
    const st = await api(base() + "/status");
    if (st.status !== 200) { throw new Error(st.body.error || "HTTP " + st.status); }
    render(st.body);
    renderSettings(st.body);
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
  setConn("connecting\u2026");
  try {
    const r = await api("/jobs");
    if (r.status !== 200 || !r.body.jobs || !r.body.jobs.length) { throw new Error("no job"); }
    state.job = r.body.jobs[0].job_id;
    $("job").textContent = state.job;
    document.title = "hookloop \u2013 " + state.job;
  } catch (err) {
    if (!(err instanceof Unauthorized)) { setConn("cannot reach the job", "down"); }
    return;
  }
  poll();
}

async function send(command, question) {
  // (the buttons stay disabled until the first status names the job)
  if (state.job === null) { return; }
  if (question && !window.confirm(question)) { return; }
  $("message").textContent = "sending " + command + "\u2026";
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
$("apply").addEventListener("click", applySettings);
$("lr-scale").addEventListener("keydown", (ev) => { if (ev.key === "Enter") { applySettings(); } });
$("log").addEventListener("change", draw);
for (const b of document.querySelectorAll("button[data-command]")) {
  b.addEventListener("click", () => send(b.dataset.command, b.dataset.confirm));
}
if (token()) { connect(); } else { showLogin(true); }
