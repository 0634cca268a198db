// tokenmill's live dashboard: polls /dashboard/data every second and draws ten panels on canvases.
// No library: a small line chart and bar chart below. Each panel records how many points it drew
// (data-points) and its largest value (data-max), which the browser test reads.
"use strict";

const COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#4b5563"];
const HISTORY_S = 600;
let points = [];
let last = null;

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
  if (a >= 10) return v.toFixed(0);
  if (a >= 0.01 || a === 0) return v.toFixed(2);
  return v.toExponential(1);
}

function setup(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 440, h = canvas.clientHeight || 170;
  canvas.width = w * ratio;
  canvas.height = h * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h };
}

// series: [{name, values: [[t, v|null], ...]}]; lines: [{name, value}] drawn dashed across.
function lineChart(canvas, series, lines = []) {
  const { ctx, w, h } = setup(canvas);
  const left = 44, right = 8, top = 16, bottom = 16;
  let tMin = Infinity, tMax = -Infinity, vMax = 0, drawn = 0;
  for (const s of series) for (const [t, v] of s.values) {
    tMin = Math.min(tMin, t); tMax = Math.max(tMax, t);
    if (v !== null && isFinite(v)) { vMax = Math.max(vMax, v); drawn++; }
  }
  for (const l of lines) if (l.value !== null && isFinite(l.value)) vMax = Math.max(vMax, l.value);
  if (!isFinite(tMin)) { tMin = 0; tMax = 1; }
  if (tMax === tMin) tMax = tMin + 1;
  const yMax = vMax > 0 ? vMax * 1.1 : 1;
  const x = (t) => left + (w - left - right) * (t - tMin) / (tMax - tMin);
  const y = (v) => h - bottom - (h - top - bottom) * v / yMax;
  ctx.strokeStyle = "#e5e7eb"; ctx.fillStyle = "#6b7280"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = yMax * i / 4;
    ctx.beginPath(); ctx.moveTo(left, y(v)); ctx.lineTo(w - right, y(v)); ctx.stroke();
    ctx.fillText(fmt(v), 2, y(v) + 4);
  }
  ctx.fillText(`${Math.round(tMax - tMin)} s`, w - right - 30, h - 3);
  series.forEach((s, i) => {
    ctx.strokeStyle = s.color || COLORS[i % COLORS.length]; ctx.lineWidth = 1.5; ctx.beginPath();
    let pen = false;
    for (const [t, v] of s.values) {
      if (v === null || !isFinite(v)) { pen = false; continue; }
      if (pen) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      pen = true;
    }
    ctx.stroke();
  });
  ctx.setLineDash([5, 4]);
  lines.forEach((l, i) => {
    if (l.value === null || !isFinite(l.value)) return;
    ctx.strokeStyle = l.color || "#b91c1c"; ctx.beginPath();
    ctx.moveTo(left, y(l.value)); ctx.lineTo(w - right, y(l.value)); ctx.stroke();
  });
  ctx.setLineDash([]);
  let lx = left;  // legend along the top
  [...series, ...lines.filter((l) => l.value !== null)].forEach((s, i) => {
    ctx.fillStyle = s.color || (i < series.length ? COLORS[i % COLORS.length] : "#b91c1c");
    const end = s.values ? s.values[s.values.length - 1] : null;
    const text = `${s.name} ${fmt(s.values ? (end ? end[1] : null) : s.value)}`;
    ctx.fillText(text, lx, 11);
    lx += ctx.measureText(text).width + 12;
  });
  const panel = canvas.closest(".panel");
  panel.dataset.points = String(Number(panel.dataset.barPoints || 0) + drawn);
  panel.dataset.max = String(Math.max(vMax, Number(panel.dataset.barMax || 0)));
}

// bars: [[label, count], ...]
function barChart(canvas, bars, unit) {
  const { ctx, w, h } = setup(canvas);
  const max = Math.max(0, ...bars.map((b) => b[1]));
  const bw = (w - 8) / Math.max(bars.length, 1);
  bars.forEach(([label, count], i) => {
    const bh = max > 0 ? (h - 26) * count / max : 0;
    ctx.fillStyle = "#60a5fa";
    ctx.fillRect(4 + i * bw + 1, h - 14 - bh, bw - 2, bh);
    ctx.fillStyle = "#6b7280";
    if (bars.length <= 14 || i % 2 === 0) ctx.fillText(label, 4 + i * bw + 1, h - 2);
    if (count > 0) ctx.fillText(fmt(count), 4 + i * bw + 1, h - 16 - bh);
  });
  ctx.fillText(unit, w - 60, 10);
  const panel = canvas.closest(".panel");
  panel.dataset.barPoints = String(bars.filter((b) => b[1] > 0).length);
  panel.dataset.barMax = String(max);
}

function series(name, get, color) {
  return { name, color, values: points.map((p) => [p.t - last.now, get(p)]) };
}

function keysOf(field) {
  const keys = new Set();
  for (const p of points) for (const k of Object.keys(p[field] || {})) keys.add(k);
  return [...keys].sort();
}

function note(id, text) { document.querySelector(`#${id} .note`).textContent = text; }

function list(id, items) {
  const ul = document.querySelector(`#${id} .list`);
  ul.replaceChildren(...items.map((text) => { const li = document.createElement("li"); li.textContent = text; return li; }));
}

function bucketLabel(le) { return le === "+Inf" || !isFinite(le) ? "+Inf" : fmt(Number(le)); }

function draw() {
  const d = last, s = d.settings, cur = points[points.length - 1] || {};
  const canvas = (id, bars = false) => document.querySelector(`#${id} canvas${bars ? ".bars" : ":not(.bars)"}`);
  lineChart(canvas("throughput"), [
    series("now", (p) => p.tokens_per_s),
    series("1 min", (p) => p.tokens_per_s_1m),
  ], [{ name: s.throughput_baseline ? "baseline" : "baseline (best minute)", value: cur.baseline }]);
  note("throughput", `${fmt(cur.tokens_per_s_1m)} tok/s over the last minute; ${fmt(100 * cur.utilization)}% of the baseline`);

  lineChart(canvas("phases"), [
    series("prefill", (p) => p.prefill_tps),
    series("decode", (p) => p.decode_tps),
    ...keysOf("routes_tps").map((r) => series(r.replace("/v1/", ""), (p) => (p.routes_tps || {})[r] ?? null)),
  ]);
  note("phases", `model ${d.model}`);

  barChart(canvas("batch", true), d.distributions.batch_size.map(([le, n]) => [bucketLabel(le), n]), "steps");
  lineChart(canvas("batch"), [series("mean batch", (p) => p.batch_size_mean), series("running", (p) => p.running)]);

  const mib = (b) => (b === undefined ? null : b / 1048576);
  lineChart(canvas("memory"), [
    series("used blocks", (p) => (p.kv_blocks || {}).used ?? null),
    series("cached (free)", (p) => (p.kv_blocks || {}).cached ?? null),
    series("free blocks", (p) => (p.kv_blocks || {}).free ?? null),
    ...(cur.kv_tier_capacity_blocks ? [series("KV tier blocks", (p) => p.kv_tier_blocks ?? null)] : []),
  ]);
  const rss = cur.rss_bytes || {};
  const tier = cur.kv_tier_capacity_blocks
    ? ` · KV tier ${fmt(cur.kv_tier_blocks)} of ${fmt(cur.kv_tier_capacity_blocks)} blocks, ${fmt(cur.kv_tier_hit_tps)} prompt tok/s from it`
    : "";
  note("memory", `KV ${fmt(100 * cur.kv_usage)}% of ${s.num_blocks} blocks${tier} · RSS ` +
    Object.entries(rss).map(([k, v]) => `${k} ${fmt(mib(v))} MiB`).join(", "));

  lineChart(canvas("latency"), [
    series("TTFT p50", (p) => p.ttft_p50), series("TTFT p99", (p) => p.ttft_p99),
    series("ITL p99", (p) => p.itl_p99), series("E2E p99", (p) => p.e2e_p99),
  ], [{ name: "TTFT SLO", value: s.slo_ttft_s, color: "#b91c1c" }, { name: "ITL SLO", value: s.slo_itl_s, color: "#f97316" }]);
  note("latency", `TTFT p99 ${fmt(cur.ttft_p99)} s · ITL p99 ${fmt(cur.itl_p99)} s · E2E p50 ${fmt(cur.e2e_p50)} s`);

  barChart(canvas("queue", true), d.distributions.queue_time_s.map(([le, n]) => [bucketLabel(le), n]), "queue time (s)");
  lineChart(canvas("queue"), [series("waiting", (p) => p.waiting), series("running", (p) => p.running)]);
  note("queue", `queue time p50 ${fmt(cur.queue_p50)} s, p99 ${fmt(cur.queue_p99)} s (last minute)`);

  const gpu = points.some((p) => p.gpu_memory_bytes > 0);
  lineChart(canvas("device"), [
    ...keysOf("cpu_busy_cores").map((k) => series(`${k} CPU cores`, (p) => (p.cpu_busy_cores || {})[k] ?? null)),
    ...(gpu ? [series("GPU util", (p) => p.gpu_utilization)] : []),
    series("memory GB/s (steps, est.)", (p) => p.memory_bandwidth_bytes_per_s / 1e9),
  ]);
  const peak = cur.memory_bandwidth_peak_bytes_per_s;
  const draw = `memory ${fmt(cur.memory_bandwidth_bytes_per_s / 1e9)} GB/s drawn by the steps (estimated)` +
    (peak > 0 ? ` of ${fmt(peak / 1e9)} GB/s measured (${fmt(100 * cur.memory_bandwidth_bytes_per_s / peak)}%)`
      : " (tokenmill info --bandwidth measures the peak)");
  note("device", (gpu ? `GPU memory ${fmt(mib(cur.gpu_memory_bytes))} MiB` : "CPU: busy cores of the server and engine processes") + ` · ${draw}`);

  lineChart(canvas("errors"), keysOf("errors_per_s").map((k) => series(k, (p) => (p.errors_per_s || {})[k] ?? null)));
  const totals = Object.entries(d.errors.totals).filter(([, n]) => n > 0).map(([k, n]) => `${k} ${n}`).join(", ");
  list("errors", [
    `totals: ${totals || "none"}`,
    ...d.errors.recent.slice(-8).reverse().map((e) =>
      `${new Date(e.time * 1000).toLocaleTimeString()} ${e.type} ${e.status} ${e.route} ${e.model}`),
  ]);

  lineChart(canvas("scaling"), ["current", "target", "min", "max"].map((k) => series(k, (p) => (p.replicas || {})[k] ?? null)));
  const r = cur.replicas || {};
  list("scaling", [
    `replicas: ${r.current} current, ${r.target} target (min ${r.min}, max ${r.max})`,
    ...d.scaling_events.slice(-5).reverse().map((e) =>
      `${new Date(e.t * 1000).toLocaleTimeString()} ${e.from} → ${e.current} (target ${e.target})`),
  ]);

  lineChart(canvas("cost"), [
    series("$ / 1M tokens", (p) => (s.cost_per_hour === null ? null : p.cost_per_million)),
    series("utilization", (p) => p.utilization),
  ]);
  note("cost", s.cost_per_hour === null ? "no --cost-per-hour given: utilization only" :
    `$${s.cost_per_hour}/hour · $${fmt(cur.cost_per_million)} per 1M tokens at ${fmt(100 * cur.utilization)}% utilization`);
}

// The API key the page was opened with: /dashboard#key=KEY (a fragment never reaches the server), else
// asked for once the server answers 401. Kept in this tab's sessionStorage, sent as a header only.
const KEY_ITEM = "tokenmill-api-key";
let asked = false;

function apiKey() {
  const match = /(?:^#|&)key=([^&]*)/.exec(location.hash);
  if (match) {
    sessionStorage.setItem(KEY_ITEM, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search); // off the address bar and history
  }
  return sessionStorage.getItem(KEY_ITEM);
}

function askForKey() {
  sessionStorage.removeItem(KEY_ITEM);
  if (asked) return;
  asked = true; // once: a cancelled prompt must not come back every second
  const key = window.prompt("This server needs an API key to show its dashboard:");
  if (key) sessionStorage.setItem(KEY_ITEM, key.trim());
}

async function refresh() {
  const since = points.length ? points[points.length - 1].t : 0;
  try {
    const key = apiKey();
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    const response = await fetch(`/dashboard/data?since=${since}`, { credentials: "same-origin", headers });
    if (response.status === 401) {
      askForKey();
      throw new Error("HTTP 401: open the page as /dashboard#key=YOUR_API_KEY");
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    last = await response.json();
    points = points.concat(last.points).filter((p) => p.t > last.now - HISTORY_S);
    document.getElementById("model").textContent = last.model;
    document.getElementById("status").textContent = `updated ${new Date(last.now * 1000).toLocaleTimeString()}`;
    draw();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (err) {
    document.getElementById("status").textContent = `no data: ${err.message}`;
  }
  setTimeout(refresh, 1000 * ((last && last.interval_s) || 1));
}

refresh();
