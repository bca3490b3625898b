// astraflow live dashboard: polls /dashboard/data?after=SEQ every second and redraws.
// Figures are the dataflow report's, flattened (dataflow/history.py), plus the metric points
// the launcher posts (held-out accuracy). Charts are uPlot; no build step.
"use strict";

const POLL_MS = 1000;
const MAX_POINTS = 3600;
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2",
                 "#ca8a04", "#db2777", "#4b5563", "#65a30d"];

// Each chart: the figures it plots (regexes over figure names) and how a series is labelled.
const CHARTS = [
  { id: "version", title: "Version per policy", match: [/^policy\/([^/]+)\/version$/] },
  { id: "reward", title: "Sampled reward (mean of the last samples ingested)",
    match: [/^policy\/([^/]+)\/reward_mean$/] },
  { id: "heldout", title: "Held-out evaluation (by version published)", points: "eval" },
  { id: "throughput", title: "Samples/s: produced per pool, consumed per trainer",
    match: [/^pool\/([^/]+)\/samples_per_s$/, /^trainer\/([^/]+)\/samples_per_s$/] },
  { id: "pools", title: "Pool size: nodes seen, desired, dead-band target",
    match: [/^pool\/([^/]+)\/(nodes|desired_nodes|target_nodes)$/] },
  { id: "buffers", title: "Buffers (samples): buffered, in flight, cap",
    match: [/^policy\/([^/]+)\/(buffered_samples|in_flight_samples|max_buffered)$/] },
  { id: "waiting", title: "Trainer time waiting for batches (fraction)",
    match: [/^trainer\/([^/]+)\/waiting_fraction$/] },
  { id: "transfer", title: "Weight transfer per node: last refresh (s)",
    match: [/^node\/([^/]+)\/refresh_s\/(.+)$/] },
];

// Evaluation figures that are not scores (counts, timings) stay off the held-out chart.
const NOT_SCORES = /^(n|turns|invalid_actions|tokens|.*_s)$/;

const state = { seq: 0, t: [], f: {}, points: [], report: null };
const charts = {};

function ingest(data) {
  for (const snap of data.snapshots) {
    const n = state.t.length;
    state.t.push(snap.t);
    for (const [key, value] of Object.entries(snap.f)) {
      if (!(key in state.f)) state.f[key] = new Array(n).fill(null);
      state.f[key].push(value);
    }
    for (const series of Object.values(state.f)) {
      if (series.length < n + 1) series.push(null);
    }
  }
  const extra = state.t.length - MAX_POINTS;
  if (extra > 0) {
    state.t.splice(0, extra);
    for (const series of Object.values(state.f)) series.splice(0, extra);
  }
  state.points.push(...data.points);
  if (state.points.length > MAX_POINTS) state.points.splice(0, state.points.length - MAX_POINTS);
  state.report = data.report;
  state.seq = data.seq;
}

function seriesOf(chart) {
  // [{label, x, y}] for a chart: figure columns over snapshot times, or metric points
  if (chart.points) {
    const bySeries = {};
    for (const p of state.points) {
      if (p.source !== chart.points) continue;
      for (const [name, value] of Object.entries(p.values)) {
        if (NOT_SCORES.test(name)) continue;
        const label = `${p.policy} ${name}`;
        const s = (bySeries[label] ||= { label, x: [], y: [] });
        s.x.push(p.time);
        s.y.push(value);
      }
    }
    return Object.values(bySeries);
  }
  const out = [];
  for (const key of Object.keys(state.f).sort()) {
    for (const re of chart.match) {
      const m = key.match(re);
      if (m) out.push({ label: m.slice(1).join(" "), key, x: state.t, y: state.f[key] });
    }
  }
  return out;
}

function aligned(series) {
  // uPlot wants one x array: merge the series' x values, null where a series has none
  if (series.every((s) => s.x === state.t)) return [state.t, ...series.map((s) => s.y)];
  const xs = [...new Set(series.flatMap((s) => s.x))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const ys = series.map((s) => {
    const y = new Array(xs.length).fill(null);
    s.x.forEach((x, i) => { y[index.get(x)] = s.y[i]; });
    return y;
  });
  return [xs, ...ys];
}

function panel(id, title) {
  let el = document.getElementById(`chart-${id}`);
  if (!el) {
    el = document.createElement("div");
    el.className = "panel";
    el.id = `chart-${id}`;
    const h = document.createElement("h2");
    h.textContent = title;
    const body = document.createElement("div");
    body.className = "body";
    el.append(h, body);
    document.getElementById("charts").append(el);
  }
  return el.querySelector(".body");
}

function draw(chart) {
  const body = panel(chart.id, chart.title);
  const series = seriesOf(chart);
  const labels = series.map((s) => s.label).join("|");
  const held = charts[chart.id];
  if (!series.length) {
    if (!body.querySelector(".empty")) {
      body.replaceChildren(Object.assign(document.createElement("div"),
        { className: "empty", textContent: "no data yet" }));
    }
    return;
  }
  const data = aligned(series);
  if (held && held.labels === labels) {
    held.plot.setData(data);
    return;
  }
  if (held) held.plot.destroy();
  body.replaceChildren();
  const opts = {
    width: Math.max(400, body.clientWidth || 580), height: 220,
    scales: { x: { time: true } },
    series: [{}, ...series.map((s, i) => ({
      label: s.label, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
      points: { show: chart.points !== undefined },
    }))],
    axes: [{}, { size: 60 }],
  };
  charts[chart.id] = { labels, plot: new uPlot(opts, data, body) };
}

function drawVersions() {
  const el = document.getElementById("versions");
  const parts = [];
  for (const [name, p] of Object.entries(state.report?.policies ?? {})) {
    const span = document.createElement("span");
    span.append(`${name} `, Object.assign(document.createElement("b"),
      { textContent: p.latest_version ?? "–" }));
    parts.push(span);
  }
  const tasks = state.report?.tasks;
  if (tasks) parts.push(`tasks done ${tasks.done}, pending ${tasks.pending}`);
  el.replaceChildren(...parts);
}

function drawStaleness() {
  const el = document.getElementById("staleness");
  const bins = [];
  for (const p of Object.values(state.report?.policies ?? {})) {
    p.served_staleness.forEach((n, i) => { bins[i] = (bins[i] ?? 0) + n; });
  }
  const top = Math.max(1, ...bins.map((n) => n ?? 0));
  el.replaceChildren(...Array.from(bins, (n, i) => {
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.title = `${n ?? 0} samples served ${i} version(s) behind`;
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.height = `${(100 * (n ?? 0)) / top}%`;
    bar.append(String(n ?? 0), fill, String(i));
    return bar;
  }));
}

function drawPools() {
  const rows = [["pool", "nodes", "desired", "target", "samples/s", "leased", "failures"]];
  for (const [name, p] of Object.entries(state.report?.pools ?? {})) {
    rows.push([name, p.nodes, p.desired_nodes ?? "–", p.target_nodes ?? "–",
               p.samples_per_s.toFixed(1), p.leased, p.failures]);
  }
  document.getElementById("pools").replaceChildren(...rows.map((r, i) => {
    const tr = document.createElement("tr");
    tr.append(...r.map((v) => Object.assign(document.createElement(i ? "td" : "th"),
      { textContent: String(v) })));
    return tr;
  }));
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const reply = await fetch(`/dashboard/data?after=${state.seq}`,
                              { credentials: "same-origin", cache: "no-store" });
    if (reply.status === 401) {
      window.location.assign("/dashboard");
      return;
    }
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    ingest(await reply.json());
    CHARTS.forEach(draw);
    drawVersions();
    drawStaleness();
    drawPools();
    status.className = "status";
    status.textContent = `updated ${new Date().toLocaleTimeString()} · ${state.t.length} snapshots`;
  } catch (err) {
    status.className = "status bad";
    status.textContent = `no answer from the dataflow service (${err.message}); retrying`;
  }
  setTimeout(poll, POLL_MS);
}

// What a test (or a curious user in the console) can read: points per chart and series.
window.astraflowDashboard = {
  seq: () => state.seq,
  charts: () => Object.fromEntries(Object.entries(charts).map(([id, c]) => [id, {
    series: c.plot.series.length - 1,
    points: c.plot.data[0].length,
    values: c.plot.data.slice(1).reduce((n, ys) => n + ys.filter((y) => y !== null).length, 0),
    last: Math.max(...c.plot.data.slice(1).map((ys) => ys.findLast((y) => y !== null) ?? -Infinity)),
  }])),
  staleness: () => document.querySelectorAll("#staleness .bar").length,
};

poll();
