// fairserve live dashboard: polls GET /stats (schema: docs/metrics.md) and
// draws rolling charts on <canvas>. No dependencies, no build step.
// Query parameters: stats=<url> (default /stats), interval=<ms> (default
// 1000), span=<seconds of history shown> (default 120).
"use strict";

(() => {
  const params = new URLSearchParams(window.location.search);
  const STATS_URL = params.get("stats") || "/stats";
  const INTERVAL_MS = boundedInt(params.get("interval"), 1000, 100, 60000);
  const SPAN_S = boundedInt(params.get("span"), 120, 10, 3600);
  const MAX_POINTS = Math.ceil((SPAN_S * 1000) / INTERVAL_MS) + 10;
  const RATE_WINDOW_S = 10;
  const MAX_BARS = 12;
  const MAX_DYNAMIC_SERIES = 10;
  const PARTS = ["gateway", "scheduler", "kvcache"];

  const PALETTE = ["#4cc9f0", "#f72585", "#ffd166", "#06d6a0", "#b388ff",
                   "#ff8c42", "#90be6d", "#ef476f", "#a0c4ff", "#e9c46a"];
  const QUANTILES = [
    { key: "p50", label: "p50", color: "#06d6a0" },
    { key: "p95", label: "p95", color: "#ffd166" },
    { key: "p99", label: "p99", color: "#ef476f" },
  ];

  function boundedInt(text, fallback, low, high) {
    const value = Number.parseInt(text ?? "", 10);
    return Number.isFinite(value) ? Math.min(high, Math.max(low, value)) : fallback;
  }

  function isNumber(value) {
    return typeof value === "number" && Number.isFinite(value);
  }

  function numberOrNull(value) {
    return isNumber(value) ? value : null;
  }

  function sumOf(values) {
    let total = 0;
    for (const value of values) if (isNumber(value)) total += value;
    return total;
  }

  function formatTick(value, unit) {
    if (unit === "%") return `${Math.round(value)}%`;
    return Math.abs(value) >= 1e4 ? formatNumber(value, "") : String(Number(value.toFixed(2)));
  }

  // Units worth repeating next to each legend value; counts go bare.
  const LEGEND_UNITS = new Set(["ms", "tok/s", "/s", "%"]);

  function formatNumber(value, unit) {
    if (!isNumber(value)) return "–";
    if (unit === "%") return `${value.toFixed(1)}%`;
    const magnitude = Math.abs(value);
    let text;
    if (magnitude >= 1e6) text = `${(value / 1e6).toFixed(2)}M`;
    else if (magnitude >= 1e4) text = `${(value / 1e3).toFixed(1)}k`;
    else if (magnitude >= 100 || Number.isInteger(value)) text = `${Math.round(value)}`;
    else if (magnitude >= 10) text = value.toFixed(1);
    else text = value.toFixed(2);
    return unit && unit !== "%" ? `${text} ${unit}` : text;
  }

  // Rates and ratios of cumulative counters, over the last RATE_WINDOW_S
  // seconds of polls; a counter going down (a restart) starts over.
  class CounterMeter {
    constructor() { this.samples = []; }

    push(t, values) {
      if (!values.every(isNumber)) return null;
      const last = this.samples[this.samples.length - 1];
      if (last && values.some((value, i) => value < last.values[i])) this.samples = [];
      this.samples.push({ t, values });
      while (this.samples.length > 2 && this.samples[1].t <= t - RATE_WINDOW_S) this.samples.shift();
      const first = this.samples[0];
      if (first.t >= t) return null;
      return { seconds: t - first.t, deltas: values.map((value, i) => value - first.values[i]) };
    }
  }

  const meters = new Map();
  function meterDelta(name, t, values) {
    if (!meters.has(name)) meters.set(name, new CounterMeter());
    return meters.get(name).push(t, values);
  }
  function ratePerSecond(name, t, value) {
    const delta = meterDelta(name, t, [value]);
    return delta ? delta.deltas[0] / delta.seconds : null;
  }
  function ratioPercent(name, t, part, whole) {
    const delta = meterDelta(name, t, [part, whole]);
    return delta && delta.deltas[1] > 0 ? (100 * delta.deltas[0]) / delta.deltas[1] : null;
  }

  // ---- canvas helpers --------------------------------------------------

  function prepareCanvas(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth));
    const height = Math.max(1, Math.round(canvas.clientHeight));
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, width, height };
  }

  function niceStep(range, count) {
    const rough = range / count;
    const power = 10 ** Math.floor(Math.log10(rough));
    const fraction = rough / power;
    const nice = fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 2.5 ? 2.5 : fraction <= 5 ? 5 : 10;
    return nice * power;
  }

  function yTicks(maximum) {
    const top = maximum > 0 ? maximum : 1;
    const step = niceStep(top, 4);
    const ticks = [];
    for (let value = 0; value <= top + step * 0.999; value += step) ticks.push(value);
    return ticks;
  }

  function drawMessage(ctx, width, height, text) {
    ctx.fillStyle = "#8b949e";
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    ctx.fillText(text, width / 2, height / 2);
  }

  // ---- line chart over time ---------------------------------------------

  class LineChart {
    constructor(canvas, config) {
      this.canvas = canvas;
      this.config = config;
      this.points = []; // {t, values: {key: number|null}}
      this.series = new Map(); // key -> {label, color}
      for (const s of config.series || []) this.series.set(s.key, { label: s.label, color: s.color });
    }

    push(t, values) {
      if (values) {
        for (const key of Object.keys(values)) {
          if (!this.series.has(key) && this.series.size < MAX_DYNAMIC_SERIES) {
            this.series.set(key, { label: key, color: PALETTE[this.series.size % PALETTE.length] });
          }
        }
      }
      this.points.push({ t, values: values || {} });
      if (this.points.length > MAX_POINTS) this.points.shift();
    }

    latest(key) {
      const last = this.points[this.points.length - 1];
      return last ? numberOrNull(last.values[key]) : null;
    }

    stackedValues(point) {
      let base = 0;
      const stacked = new Map();
      for (const key of this.series.keys()) {
        const value = numberOrNull(point.values[key]);
        if (value === null) { stacked.set(key, null); continue; }
        stacked.set(key, [base, base + value]);
        base += value;
      }
      return stacked;
    }

    draw() {
      const { ctx, width, height } = prepareCanvas(this.canvas);
      const area = { left: 46, right: width - 10, top: 8, bottom: height - 18 };
      const last = this.points[this.points.length - 1];
      const now = last ? last.t : 0;
      const start = now - SPAN_S;
      const visible = this.points.filter((p) => p.t >= start);
      const levels = visible.map((p) => this.levels(p));
      let maximum = 0;
      for (const level of levels) {
        for (const pair of level.values()) if (pair) maximum = Math.max(maximum, pair[1] * 1.08);
      }
      const ticks = yTicks(Math.max(maximum, this.config.yMax ?? 0));
      const top = ticks[ticks.length - 1];
      const x = (t) => area.left + ((t - start) / SPAN_S) * (area.right - area.left);
      const y = (v) => area.bottom - (v / top) * (area.bottom - area.top);
      this.drawAxes(ctx, area, ticks, y);
      const hasData = levels.some((level) => [...level.values()].some((pair) => pair));
      if (!hasData) {
        drawMessage(ctx, width, height - 10, "no data yet");
        return;
      }
      for (const [key, style] of [...this.series.entries()].reverse()) {
        const path = visible.map((p, i) => ({ t: p.t, pair: levels[i].get(key) }));
        if (this.config.stacked) this.fillBand(ctx, path, x, y, style.color);
        this.strokeLine(ctx, path, x, y, style.color);
      }
    }

    levels(point) {
      if (this.config.stacked) return this.stackedValues(point);
      const level = new Map();
      for (const key of this.series.keys()) {
        const value = numberOrNull(point.values[key]);
        level.set(key, value === null ? null : [0, value]);
      }
      return level;
    }

    drawAxes(ctx, area, ticks, y) {
      ctx.strokeStyle = "#262d37";
      ctx.lineWidth = 1;
      ctx.fillStyle = "#8b949e";
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      for (const tick of ticks) {
        const py = Math.round(y(tick)) + 0.5;
        ctx.beginPath();
        ctx.moveTo(area.left, py);
        ctx.lineTo(area.right, py);
        ctx.stroke();
        ctx.fillText(formatTick(tick, this.config.unit), area.left - 6, py);
      }
      ctx.textBaseline = "top";
      for (let i = 0; i <= 4; i += 1) {
        ctx.textAlign = i === 0 ? "left" : i === 4 ? "right" : "center";
        const secondsAgo = SPAN_S - (SPAN_S * i) / 4;
        const px = area.left + ((area.right - area.left) * i) / 4;
        ctx.fillText(secondsAgo === 0 ? "now" : `-${Number(secondsAgo.toFixed(1))}s`, px, area.bottom + 4);
      }
    }

    strokeLine(ctx, path, x, y, color) {
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.8;
      ctx.lineJoin = "round";
      ctx.beginPath();
      let drawing = false;
      for (const { t, pair } of path) {
        if (!pair) { drawing = false; continue; }
        if (drawing) ctx.lineTo(x(t), y(pair[1]));
        else ctx.moveTo(x(t), y(pair[1]));
        drawing = true;
      }
      ctx.stroke();
      const end = path[path.length - 1];
      if (end && end.pair) {
        ctx.fillStyle = color;
        ctx.beginPath();
        ctx.arc(x(end.t), y(end.pair[1]), 2.5, 0, Math.PI * 2);
        ctx.fill();
      }
    }

    fillBand(ctx, path, x, y, color) {
      ctx.fillStyle = `${color}55`;
      let run = [];
      const flush = () => {
        if (run.length > 1) {
          ctx.beginPath();
          run.forEach(({ t, pair }, i) => (i ? ctx.lineTo(x(t), y(pair[1])) : ctx.moveTo(x(t), y(pair[1]))));
          for (let i = run.length - 1; i >= 0; i -= 1) ctx.lineTo(x(run[i].t), y(run[i].pair[0]));
          ctx.closePath();
          ctx.fill();
        }
        run = [];
      };
      for (const step of path) {
        if (step.pair) run.push(step);
        else flush();
      }
      flush();
    }

    legendItems() {
      return [...this.series.entries()].map(([key, style]) => ({
        label: style.label, color: style.color,
        value: formatNumber(this.latest(key), LEGEND_UNITS.has(this.config.unit) ? this.config.unit : ""),
      }));
    }
  }

  // ---- horizontal bar chart (current values) ------------------------------

  class BarChart {
    constructor(canvas, config) {
      this.canvas = canvas;
      this.config = config;
      this.bars = []; // {label, value, note}
    }

    push(_t, bars) {
      if (bars) this.bars = bars.filter((bar) => isNumber(bar.value)).slice(0, MAX_BARS);
    }

    draw() {
      const { ctx, width, height } = prepareCanvas(this.canvas);
      if (!this.bars.length) {
        drawMessage(ctx, width, height, "no data yet");
        return;
      }
      const labelWidth = 96;
      const noteWidth = 92;
      const left = labelWidth + 8;
      const right = width - noteWidth;
      const rowHeight = Math.min(26, (height - 6) / this.bars.length);
      const maximum = Math.max(...this.bars.map((bar) => bar.value), 1e-9);
      ctx.textBaseline = "middle";
      this.bars.forEach((bar, i) => {
        const top = 3 + i * rowHeight;
        const middle = top + rowHeight / 2;
        const length = Math.max(1, ((right - left) * bar.value) / maximum);
        ctx.fillStyle = "#d0d7de";
        ctx.textAlign = "right";
        ctx.fillText(truncate(ctx, bar.label, labelWidth), labelWidth, middle);
        ctx.fillStyle = PALETTE[i % PALETTE.length];
        ctx.fillRect(left, top + rowHeight * 0.18, length, rowHeight * 0.64);
        ctx.fillStyle = "#8b949e";
        ctx.textAlign = "left";
        const text = formatNumber(bar.value, "") + (bar.note ? ` · ${bar.note}` : "");
        ctx.fillText(truncate(ctx, text, noteWidth + (right - left - length) - 6), left + length + 6, middle);
      });
    }

    legendItems() {
      return this.config.legend ? [this.config.legend] : [];
    }
  }

  function truncate(ctx, text, maxWidth) {
    if (ctx.measureText(text).width <= maxWidth) return text;
    let cut = text;
    while (cut.length > 1 && ctx.measureText(`${cut}…`).width > maxWidth) cut = cut.slice(0, -1);
    return `${cut}…`;
  }

  // ---- what to chart ------------------------------------------------------

  function quantiles(summary) {
    if (!summary) return {};
    return { p50: numberOrNull(summary.p50), p95: numberOrNull(summary.p95), p99: numberOrNull(summary.p99) };
  }

  function workers(scheduler) {
    return Array.isArray(scheduler.workers) ? scheduler.workers : [];
  }

  function perWorker(scheduler, field) {
    const values = {};
    for (const w of workers(scheduler)) values[String(w.worker_id)] = numberOrNull(w[field]);
    return values;
  }

  function usedBlocks(w) {
    if (isNumber(w.used_blocks)) return w.used_blocks;
    if (![w.total_blocks, w.free_blocks, w.cached_blocks].every(isNumber)) return null;
    return w.total_blocks - w.free_blocks - w.cached_blocks;
  }

  function sumOverWorkers(scheduler, pick) {
    const values = workers(scheduler).map(pick);
    return values.length && values.every(isNumber) ? sumOf(values) : null;
  }

  const latencyChart = (id, title, name) => ({
    id, title, part: "gateway", unit: "ms", kind: "line", series: QUANTILES,
    sample: (stats) => quantiles(stats.gateway.latency_ms?.[name]),
  });

  const CHARTS = [
    latencyChart("ttft", "Time to first token", "ttft"),
    latencyChart("tpot", "Time per output token", "tpot"),
    {
      id: "throughput", title: "Throughput", part: "gateway", unit: "tok/s", kind: "line",
      series: [{ key: "output", label: "output", color: "#4cc9f0" },
               { key: "input", label: "input", color: "#b388ff" }],
      sample: (stats) => ({ output: numberOrNull(stats.gateway.window?.output_tokens_per_s),
                            input: numberOrNull(stats.gateway.window?.input_tokens_per_s) }),
    },
    latencyChart("itl", "Inter-token latency", "itl"),
    latencyChart("e2e", "End-to-end latency", "e2e"),
    latencyChart("queue_wait", "Queue wait", "queue_wait"),
    {
      id: "outcomes", title: "Finished requests by outcome", part: "gateway", unit: "/s", kind: "line",
      sample: (stats, t) => {
        const reasons = stats.gateway.totals?.finish_reasons;
        const values = {};
        if (reasons && typeof reasons === "object") {
          for (const [reason, count] of Object.entries(reasons)) {
            values[reason] = ratePerSecond(`finish:${reason}`, t, numberOrNull(count));
          }
        }
        return values;
      },
    },
    {
      id: "queues", title: "Queue lengths", part: "scheduler", unit: "requests", kind: "line",
      series: [{ key: "pending", label: "pending", color: "#ffd166" },
               { key: "prefilling", label: "prefilling", color: "#b388ff" },
               { key: "active", label: "active", color: "#06d6a0" }],
      sample: (stats) => ({ pending: numberOrNull(stats.scheduler.pending),
                            prefilling: numberOrNull(stats.scheduler.prefilling),
                            active: numberOrNull(stats.scheduler.active) }),
    },
    {
      id: "hit_rate", title: "Prefix cache hit rate", part: "kvcache", unit: "%", kind: "line", yMax: 100,
      series: [{ key: "recent", label: `last ${RATE_WINDOW_S}s (tokens)`, color: "#06d6a0" },
               { key: "lifetime", label: "since start", color: "#4cc9f0" }],
      sample: (stats, t) => {
        const kv = stats.kvcache;
        const lifetime = isNumber(kv.hit_tokens) && isNumber(kv.lookup_tokens) && kv.lookup_tokens > 0
          ? (100 * kv.hit_tokens) / kv.lookup_tokens : null;
        return { recent: ratioPercent("kv_hit_tokens", t, kv.hit_tokens, kv.lookup_tokens), lifetime };
      },
    },
    {
      id: "kv_blocks", title: "KV blocks (all workers)", part: "scheduler", unit: "blocks", kind: "line",
      stacked: true,
      series: [{ key: "used", label: "used", color: "#f72585" },
               { key: "cached", label: "cached", color: "#ffd166" },
               { key: "free", label: "free", color: "#06d6a0" }],
      sample: (stats) => ({
        used: sumOverWorkers(stats.scheduler, usedBlocks),
        cached: sumOverWorkers(stats.scheduler, (w) => numberOrNull(w.cached_blocks)),
        free: sumOverWorkers(stats.scheduler, (w) => numberOrNull(w.free_blocks)),
      }),
    },
    {
      id: "index_blocks", title: "KV index: blocks per worker", part: "kvcache", unit: "blocks", kind: "line",
      sample: (stats) => {
        const byWorker = stats.kvcache.blocks_by_worker;
        const values = {};
        if (byWorker && typeof byWorker === "object") {
          for (const [worker, blocks] of Object.entries(byWorker)) values[worker] = numberOrNull(blocks);
        }
        return values;
      },
    },
    {
      id: "pressure", title: "Evictions, preemptions, migrations, rejections", part: "scheduler", unit: "/s",
      kind: "line",
      series: [{ key: "evictions", label: "evictions", color: "#ff8c42" },
               { key: "preemptions", label: "preemptions", color: "#f72585" },
               { key: "migrations", label: "migrations", color: "#7209b7" },
               { key: "rejections", label: "rejections", color: "#ef476f" }],
      sample: (stats, t) => {
        const s = stats.scheduler;
        const evictions = sumOverWorkers(s, (w) => numberOrNull(w.evictions));
        const rejections = s.rejections && typeof s.rejections === "object"
          ? sumOf(Object.values(s.rejections)) : null;
        return {
          evictions: ratePerSecond("evictions", t, evictions),
          preemptions: ratePerSecond("preemptions", t, numberOrNull(s.preemptions)),
          migrations: ratePerSecond("migrations", t, numberOrNull(s.migrations)),
          rejections: ratePerSecond("rejections", t, rejections),
        };
      },
    },
    {
      id: "worker_running", title: "Running sequences per worker", part: "scheduler", unit: "seqs",
      kind: "line", sample: (stats) => perWorker(stats.scheduler, "running"),
    },
    {
      id: "worker_batch", title: "Batch size per worker", part: "scheduler", unit: "seqs", kind: "line",
      sample: (stats) => perWorker(stats.scheduler, "last_batch_size"),
    },
    {
      id: "worker_step", title: "Step time per worker", part: "scheduler", unit: "ms", kind: "line",
      sample: (stats) => perWorker(stats.scheduler, "last_step_ms"),
    },
    {
      id: "vtc_over_time", title: "Fairness: VTC counter per client", part: "scheduler", unit: "", kind: "line",
      sample: (stats) => {
        const clients = Array.isArray(stats.scheduler.clients) ? stats.scheduler.clients : [];
        const values = {};
        for (const c of clients) values[String(c.client_id)] = numberOrNull(c.counter);
        return values;
      },
    },
    {
      id: "clients", title: "Fairness: VTC counter and served tokens", part: "scheduler", unit: "", kind: "bar",
      legend: { label: "bar: VTC counter · note: served tokens", color: "#8b949e", value: "" },
      sample: (stats) => {
        const clients = Array.isArray(stats.scheduler.clients) ? stats.scheduler.clients : [];
        return clients
          .map((c) => ({ label: String(c.client_id), value: numberOrNull(c.counter),
                         note: isNumber(c.served_tokens) ? `${formatNumber(c.served_tokens, "")} tok` : "" }))
          .sort((a, b) => (b.value ?? 0) - (a.value ?? 0));
      },
    },
    {
      id: "sessions", title: "Sessions: output tokens", part: "gateway", unit: "", kind: "bar",
      legend: { label: "bar: output tokens · note: requests", color: "#8b949e", value: "" },
      sample: (stats) => {
        const sessions = Array.isArray(stats.gateway.sessions) ? stats.gateway.sessions : [];
        return sessions.map((s) => ({
          label: s.session_id ? String(s.session_id) : "(no session)",
          value: numberOrNull(s.output_tokens),
          note: isNumber(s.requests) ? `${s.requests} req` : "",
        }));
      },
    },
  ];

  const TILES = [
    { label: "Requests", part: "gateway", value: (s) => formatNumber(s.gateway.totals?.requests, "") },
    { label: "Requests/s", part: "gateway", value: (s) => formatNumber(s.gateway.window?.requests_per_s, "") },
    { label: "Out tok/s", part: "gateway", value: (s) => formatNumber(s.gateway.window?.output_tokens_per_s, "") },
    { label: "Pending", part: "scheduler", value: (s) => formatNumber(s.scheduler.pending, "") },
    { label: "Active", part: "scheduler", value: (s) => formatNumber(s.scheduler.active, "") },
    { label: "Preempted", part: "scheduler", value: (s) => formatNumber(s.scheduler.preemptions, "") },
    {
      label: "Rejected", part: "scheduler",
      value: (s) => formatNumber(s.scheduler.rejections ? sumOf(Object.values(s.scheduler.rejections)) : null, ""),
      title: (s) => gateSummary(s.scheduler.rejections),
    },
    {
      label: "Held back", part: "scheduler",
      value: (s) => formatNumber(s.scheduler.holds ? sumOf(Object.values(s.scheduler.holds)) : null, ""),
      title: (s) => gateSummary(s.scheduler.holds),
    },
    {
      label: "Workers up", part: "scheduler",
      value: (s) => `${workers(s.scheduler).filter((w) => w.healthy).length} / ${workers(s.scheduler).length}`,
    },
    { label: "Policy", part: "scheduler", value: (s) => String(s.scheduler.policy ?? "–") },
    {
      label: "Index nodes", part: "kvcache", value: (s) => formatNumber(s.kvcache.nodes, ""),
      title: (s) => `backend: ${s.kvcache.backend ?? "unknown"}`,
    },
  ];

  function gateSummary(byGate) {
    if (!byGate || typeof byGate !== "object") return "";
    return Object.entries(byGate).map(([gate, n]) => `${gate}: ${n}`).join(", ");
  }

  // ---- page ---------------------------------------------------------------

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function buildCharts(container) {
    return CHARTS.map((config) => {
      const card = element("article", "card");
      card.dataset.chart = config.id;
      card.dataset.part = config.part;
      const header = element("header");
      header.append(element("h2", "", config.title), element("span", "unit", config.unit),
                    element("span", "source", config.part));
      const legend = element("div", "legend");
      const plot = element("div", "plot");
      const canvas = element("canvas");
      canvas.setAttribute("role", "img");
      canvas.setAttribute("aria-label", config.title);
      plot.append(canvas, element("div", "overlay", `${config.part} unavailable`));
      card.append(header, legend, plot);
      container.append(card);
      const chart = config.kind === "bar" ? new BarChart(canvas, config) : new LineChart(canvas, config);
      return { config, card, legend, chart };
    });
  }

  function buildTiles(container) {
    return TILES.map((config) => {
      const tile = element("div", "tile");
      tile.dataset.part = config.part;
      const value = element("div", "value", "–");
      tile.append(element("div", "label", config.label), value);
      container.append(tile);
      return { config, tile, value };
    });
  }

  function renderLegend(node, items) {
    node.replaceChildren(...items.map((item) => {
      const entry = element("span", "item");
      const swatch = element("span", "swatch");
      swatch.style.background = item.color;
      entry.append(swatch, element("span", "", item.label));
      if (item.value) entry.append(element("span", "value", item.value));
      return entry;
    }));
  }

  function available(stats, part) {
    return Boolean(stats && stats[part] && typeof stats[part] === "object");
  }

  const charts = buildCharts(document.getElementById("charts"));
  const tiles = buildTiles(document.getElementById("tiles"));
  const updated = document.getElementById("updated");
  let polls = 0;
  let lastT = null;

  function update(stats) {
    const t = stats && isNumber(stats.ts) ? stats.ts : Date.now() / 1000;
    // Charts need increasing time; a server clock going back restarts nothing.
    const now = lastT !== null && t <= lastT ? lastT + INTERVAL_MS / 1000 : t;
    lastT = now;
    for (const part of PARTS) {
      const badge = document.querySelector(`.badge[data-part="${part}"]`);
      const ok = available(stats, part);
      badge.classList.toggle("ok", ok);
      badge.classList.toggle("unavailable", !ok);
    }
    for (const { config, card, legend, chart } of charts) {
      const ok = available(stats, config.part);
      card.classList.toggle("unavailable", !ok);
      let values = null;
      if (ok) {
        try {
          values = config.sample(stats, now);
        } catch (error) {
          values = null; // a malformed part reads as missing data, not as a broken page
        }
      }
      chart.push(now, values);
      chart.draw();
      renderLegend(legend, chart.legendItems());
    }
    for (const { config, tile, value } of tiles) {
      const ok = available(stats, config.part);
      tile.classList.toggle("unavailable", !ok);
      let text = "unavailable";
      if (ok) {
        try { text = config.value(stats); } catch (error) { text = "–"; }
      }
      value.textContent = text;
      tile.title = ok && config.title ? config.title(stats) : "";
    }
    polls += 1;
    document.body.dataset.polls = String(polls);
    updated.classList.toggle("stale", !stats);
    updated.textContent = stats
      ? `updated ${new Date(t * 1000).toLocaleTimeString()} · every ${INTERVAL_MS / 1000}s`
      : `/stats unreachable · retrying every ${INTERVAL_MS / 1000}s`;
  }

  async function fetchStats() {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), Math.max(INTERVAL_MS * 3, 2000));
    try {
      const response = await fetch(STATS_URL, { cache: "no-store", signal: controller.signal });
      if (!response.ok) return null;
      const stats = await response.json();
      return stats && typeof stats === "object" ? stats : null;
    } catch (error) {
      return null; // the gateway is down or slow: every part shows as unavailable
    } finally {
      clearTimeout(timer);
    }
  }

  async function loop() {
    for (;;) {
      const started = performance.now();
      update(await fetchStats());
      const elapsed = performance.now() - started;
      await new Promise((resolve) => setTimeout(resolve, Math.max(0, INTERVAL_MS - elapsed)));
    }
  }

  window.addEventListener("resize", () => {
    for (const { chart } of charts) chart.draw();
  });
  window.fairserveDashboard = { charts, tiles, get polls() { return polls; } };
  loop();
})();
