// kvserve live dashboard: polls /metrics (Prometheus text) and /ready, keeps the recent snapshots in
// memory and computes rates and histogram percentiles over the chosen window. No dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const POLL_MS = Number(params.get("interval_ms") || 2000);
const KEEP_S = 900;
const snapshots = [];  // [{t (s), m: Map(series -> value), ready}]
const LATENCIES = [
  ["TTFT", "kvserve_time_to_first_token_seconds"],
  ["inter-token latency", "kvserve_inter_token_latency_seconds"],
  ["end-to-end", "kvserve_e2e_request_latency_seconds"],
  ["queue time", "kvserve_request_queue_time_seconds"],
];

function parseMetrics(text) {
  const m = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    m.set(line.slice(0, space), Number(line.slice(space + 1)));
  }
  return m;
}

function sum(m, prefix) {  // every labelled series of one name, summed
  let total = 0;
  for (const [k, v] of m) if (k === prefix || k.startsWith(prefix + "{")) total += v;
  return total;
}

function buckets(m, name) {  // [[upper bound, cumulative count]], sorted
  const out = [];
  for (const [k, v] of m) {
    const match = k.match(new RegExp("^" + name + '_bucket\\{le="([^"]+)"\\}$'));
    if (match) out.push([match[1] === "+Inf" ? Infinity : Number(match[1]), v]);
  }
  return out.sort((a, b) => a[0] - b[0]);
}

function quantile(q, bs) {  // Prometheus histogram_quantile over cumulative bucket counts
  if (!bs.length) return null;
  const total = bs[bs.length - 1][1];
  if (total <= 0) return null;
  const rank = q * total;
  let prevBound = 0, prevCount = 0;
  for (const [bound, count] of bs) {
    if (count >= rank) {
      if (bound === Infinity) return prevBound;
      if (count === prevCount) return bound;
      return prevBound + (bound - prevBound) * (rank - prevCount) / (count - prevCount);
    }
    prevBound = bound; prevCount = count;
  }
  return prevBound;
}

function baseline(now, windowS) {  // the oldest snapshot inside the window, else the first
  for (const s of snapshots) if (now.t - s.t <= windowS) return s;
  return snapshots[0];
}

function delta(now, base, f) { return f(now.m) - (base === now ? 0 : f(base.m)); }

const busy = (s) => (s.m.get("kvserve_num_requests_running") || 0) + (s.m.get("kvserve_num_requests_waiting") || 0) > 0;
const generated = (m) => sum(m, "kvserve_generation_tokens_total");
const completed = (m) => sum(m, "kvserve_request_success_total");

// The window's busy time, as `bench serve` measures a run (first request sent to last one done; see
// docs/metrics.md "Throughput"): idle polls before the first activity and after the last completion
// are left out, and each edge is put halfway between the polls around it. Dividing by the whole
// window diluted a 1-minute run 5x in the 5-minute window.
function busySpan(recent) {
  const changed = (i) => i > 0 && (generated(recent[i].m) !== generated(recent[i - 1].m) ||
    completed(recent[i].m) !== completed(recent[i - 1].m));
  let first = -1, last = -1;
  for (let i = 0; i < recent.length; i++) {
    if (busy(recent[i]) || changed(i)) { if (first < 0) first = i; last = i; }
  }
  if (first < 0) return null;
  const start = first > 0 ? recent[first - 1] : recent[0];
  const startT = first > 0 ? (recent[first - 1].t + recent[first].t) / 2 : recent[0].t;
  const end = recent[last];
  const endT = busy(end) || last === 0 ? end.t : (recent[last - 1].t + end.t) / 2;
  return { start, end, seconds: endT - startT };
}

const fmt = {
  ms: (s) => (s === null || !isFinite(s) ? "-" : s < 1 ? (s * 1000).toFixed(1) + " ms" : s.toFixed(2) + " s"),
  pct: (x) => (x === null || !isFinite(x) ? "-" : (100 * x).toFixed(1) + "%"),
  num: (x, d = 2) => (x === null || !isFinite(x) ? "-" : x.toFixed(d)),
  int: (x) => (x === null || !isFinite(x) ? "-" : Math.round(x).toLocaleString("en")),
};

function render() {
  const now = snapshots[snapshots.length - 1];
  if (!now) return;
  const windowS = Number($("window").value);
  const base = baseline(now, windowS);
  const m = now.m;
  const ready = now.ready || {};
  $("running").textContent = fmt.int(m.get("kvserve_num_requests_running"));
  $("waiting").textContent = fmt.int(m.get("kvserve_num_requests_waiting"));
  $("kv-usage").textContent = fmt.pct(m.get("kvserve_kv_cache_usage_ratio"));
  $("kv-blocks").textContent = ready.kv_total_blocks
    ? `${ready.kv_total_blocks - ready.kv_free_blocks} of ${ready.kv_total_blocks} blocks` : "-";
  const q = delta(now, base, (x) => sum(x, "kvserve_prefix_cache_queries_total"));
  const h = delta(now, base, (x) => sum(x, "kvserve_prefix_cache_hits_total"));
  $("hit-rate").textContent = q > 0 ? fmt.pct(h / q) : "-";
  const qt = sum(m, "kvserve_prefix_cache_queries_total");
  $("hit-rate-total").textContent = qt > 0 ? fmt.pct(sum(m, "kvserve_prefix_cache_hits_total") / qt) : "-";
  const active = busySpan(snapshots.filter((s) => now.t - s.t <= windowS));
  const activeS = active ? active.seconds : 0;
  const done = active ? completed(active.end.m) - completed(active.start.m) : 0;
  const gen = active ? generated(active.end.m) - generated(active.start.m) : 0;
  $("req-rate").textContent = activeS > 0 ? fmt.num(done / activeS) : "-";
  $("tok-rate").textContent = activeS > 0 ? fmt.num(gen / activeS, 1) : "-";
  $("busy-s").textContent = activeS > 0 ? fmt.num(activeS, 1) + " s" : "-";
  $("req-total").textContent = fmt.int(sum(m, "kvserve_request_success_total"));
  $("errors-total").textContent = fmt.int(sum(m, "kvserve_request_errors_total"));
  $("gen-total").textContent = fmt.int(sum(m, "kvserve_generation_tokens_total"));
  $("prompt-total").textContent = fmt.int(sum(m, "kvserve_prompt_tokens_total"));
  const proposed = delta(now, base, (x) => sum(x, "kvserve_spec_decode_num_draft_tokens_total"));
  const accepted = delta(now, base, (x) => sum(x, "kvserve_spec_decode_num_accepted_tokens_total"));
  $("spec-accept").textContent = proposed > 0 ? fmt.pct(accepted / proposed) : "off / idle";
  $("spec-counts").textContent = `${fmt.int(accepted)} / ${fmt.int(proposed)}`;
  $("preemptions").textContent = fmt.int(sum(m, "kvserve_num_preemptions_total"));
  const rows = [];
  for (const [label, name] of LATENCIES) {
    const nowB = buckets(m, name);
    const baseB = base === now ? [] : buckets(base.m, name);
    const windowB = nowB.map(([b, c], i) => [b, c - (baseB[i] ? baseB[i][1] : 0)]);
    const count = delta(now, base, (x) => x.get(name + "_count") || 0);
    const total = delta(now, base, (x) => x.get(name + "_sum") || 0);
    const key = name.replace("kvserve_", "").replace(/_seconds$/, "");
    rows.push(`<tr id="row-${key}"><td>${label}</td><td class="count">${fmt.int(count)}</td>` +
      `<td class="p50">${fmt.ms(quantile(0.5, windowB))}</td><td class="p90">${fmt.ms(quantile(0.9, windowB))}</td>` +
      `<td class="p99">${fmt.ms(quantile(0.99, windowB))}</td><td class="mean">${fmt.ms(count > 0 ? total / count : null)}</td></tr>`);
  }
  document.querySelector("#latency tbody").innerHTML = rows.join("");
  $("model").textContent = ready.model || "-";
  $("fingerprint").textContent = ready.system_fingerprint || "-";
  $("updated").textContent = new Date().toLocaleTimeString();
  drawCharts(windowS);
}

function drawLines(canvas, series, colors, windowS) {
  const ctx = canvas.getContext("2d");
  const w = (canvas.width = canvas.clientWidth * devicePixelRatio);
  const hgt = (canvas.height = canvas.clientHeight * devicePixelRatio);
  ctx.clearRect(0, 0, w, hgt);
  const last = snapshots[snapshots.length - 1];
  const tEnd = last.t;
  // the x axis spans the history the page has (at least 10 s), up to the window
  const spanS = Math.min(windowS, Math.max(10, tEnd - snapshots[0].t));
  const max = Math.max(1, ...series.flat().map((p) => p[1]));
  const dpr = devicePixelRatio;
  const axisH = 16 * dpr;  // the time axis' labels, under the plot
  const plotH = hgt - axisH;
  ctx.fillStyle = "#66707c";
  ctx.font = `${11 * dpr}px sans-serif`;
  ctx.fillText(fmt.num(max, max < 10 ? 1 : 0), 4, 12 * dpr);
  ctx.strokeStyle = "#d9dee4";
  ctx.lineWidth = dpr;
  ctx.beginPath(); ctx.moveTo(0, plotH); ctx.lineTo(w, plotH); ctx.stroke();
  // time axis: wall-clock ticks every `step` seconds, about five across the span
  const step = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600].find((s) => spanS / s <= 6) || 900;
  const wallEnd = last.wall;
  const labels = [];
  ctx.textAlign = "center";
  for (let tick = Math.floor(wallEnd / step) * step; tick >= wallEnd - spanS; tick -= step) {
    const x = w * (1 - (wallEnd - tick) / spanS);
    const label = new Date(tick * 1000).toLocaleTimeString("en-GB", { hour12: false });
    ctx.beginPath(); ctx.moveTo(x, plotH); ctx.lineTo(x, plotH + 4 * dpr); ctx.stroke();
    if (x > 25 * dpr && x < w - 25 * dpr) { ctx.fillText(label, x, hgt - 3 * dpr); labels.unshift(label); }
  }
  ctx.textAlign = "start";
  canvas.dataset.timeAxis = labels.join(" ");  // what the axis shows, for tests and screen readers
  canvas.setAttribute("aria-label", `time axis ${labels[0] || ""} to ${labels[labels.length - 1] || ""}`);
  series.forEach((points, i) => {
    ctx.strokeStyle = colors[i];
    ctx.lineWidth = 2 * dpr;
    ctx.beginPath();
    points.forEach(([t, v], j) => {
      const x = w * (1 - (tEnd - t) / spanS);
      const y = plotH - 2 * dpr - (plotH - 20 * dpr) * (v / max);
      j ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
  });
}

function drawCharts(windowS) {
  const recent = snapshots.filter((s) => snapshots[snapshots.length - 1].t - s.t <= windowS);
  drawLines($("chart-queue"), [
    recent.map((s) => [s.t, s.m.get("kvserve_num_requests_running") || 0]),
    recent.map((s) => [s.t, s.m.get("kvserve_num_requests_waiting") || 0]),
  ], ["#2563eb", "#ea580c"], windowS);
  const rates = [];
  for (let i = 1; i < recent.length; i++) {
    const dt = recent[i].t - recent[i - 1].t;
    const dg = sum(recent[i].m, "kvserve_generation_tokens_total") - sum(recent[i - 1].m, "kvserve_generation_tokens_total");
    if (dt > 0) rates.push([recent[i].t, Math.max(0, dg / dt)]);
  }
  drawLines($("chart-tokens"), [rates], ["#15803d"], windowS);
}

async function poll() {
  try {
    const [metrics, ready] = await Promise.all([
      fetch("/metrics").then((r) => r.text()),
      // /ready's details (model, fingerprint, blocks) need the key on a server with --api-key
      kvAuth.fetch("/ready").then((r) => r.json().then((body) => ({ ok: r.ok, body }))),
    ]);
    const t = performance.now() / 1000;
    snapshots.push({ t, wall: Date.now() / 1000, m: parseMetrics(metrics), ready: ready.body });
    while (snapshots.length > 2 && t - snapshots[0].t > KEEP_S) snapshots.shift();
    $("server-status").textContent = ready.ok ? "ready" : `not ready (${ready.body.status})`;
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    render();
  } catch (err) {
    $("server-status").textContent = "unreachable: " + err.message;
  }
  setTimeout(poll, POLL_MS);
}

$("window").addEventListener("change", render);
// One keyed call first: a server with --api-key answers 401 and the page asks for the key (auth.js);
// /ready alone would answer 200 without its details.
kvAuth.fetch("/v1/models").catch(() => null).then(poll);
