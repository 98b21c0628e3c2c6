// Mariana web UI: polls the coordinator's JSON API about once a second and draws
// jobs, the selected job's charts, services, the sample cache and model versions.
//
// Plain DOM, no framework and no build step. Every string from the API reaches the
// page as a text node or an attribute value (el() below), never as markup. Any field
// may be missing (an older coordinator, an endpoint not there yet): it shows as "—".
"use strict";

(() => {
  const POLL_MS = 1000;
  const MODELS_EVERY_MS = 5000;
  const JOBS_SHOWN = 200;  // the newest jobs the table lists (asked of /v1/status: its size stays bounded)
  const HISTORY_RETRY_MS = 15000;   // a 404 history endpoint is asked again this often
  const FETCH_TIMEOUT_MS = 5000;
  const MAX_CHART_POINTS = 1500;    // longer series are thinned before drawing
  const DASH = "—";
  const SVG_NS = "http://www.w3.org/2000/svg";

  const state = {
    online: null,          // null: not asked yet
    error: "",
    status: null,          // /v1/status
    jobs: [],              // newest first
    models: null,          // /v1/models, or {missing: true}
    modelsAt: 0,
    pinned: jobFromHash(), // a job chosen by a click (or #job=ID); null: follow the running one
    skew: 0,               // server clock - this clock, seconds (from the Date header)
    lastOk: 0,
    jobMem: new Map(),     // job id -> what this page remembers of it (see memOf)
  };

  // ---- small helpers ---------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);
  const isNum = (x) => typeof x === "number" && Number.isFinite(x);
  const isObj = (x) => x !== null && typeof x === "object" && !Array.isArray(x);
  const str = (x) => (x === null || x === undefined || x === "" ? DASH : String(x));
  const clamp01 = (x) => Math.min(1, Math.max(0, x));

  // An element with attributes and children; strings become text nodes (never markup).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    appendAll(node, children);
    return node;
  }

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    appendAll(node, children);
    return node;
  }

  function setAttrs(node, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.setAttribute("class", v);
      else if (k === "text") node.textContent = String(v);
      else if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, String(v));
    }
  }

  function appendAll(node, children) {
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : visibleBidi(String(c)));
    }
  }

  // Bidi controls in the API's strings shown as their code points, never applied: a data path
  // holding U+202E read backwards on the page ("…😀 vst.d/exe.txt" for "…\u202etxt.exe/d.tsv").
  const BIDI = /[\u202A-\u202E\u2066-\u2069]/g;
  function visibleBidi(text) {
    return text.replace(BIDI, (c) => `<U+${c.codePointAt(0).toString(16).toUpperCase()}>`);
  }

  function fmtInt(x) {
    return isNum(x) ? Math.round(x).toLocaleString("en-US") : DASH;
  }

  function fmtFixed(x, digits) {
    return isNum(x) ? x.toFixed(digits) : DASH;
  }

  function fmtPct(x) {
    return isNum(x) ? `${(100 * x).toFixed(1)}%` : DASH;
  }

  function fmtCompact(x) {
    if (!isNum(x)) return DASH;
    const a = Math.abs(x);
    if (a >= 1e9) return `${(x / 1e9).toFixed(a >= 1e10 ? 0 : 1)}G`;
    if (a >= 1e6) return `${(x / 1e6).toFixed(a >= 1e7 ? 0 : 1)}M`;
    if (a >= 1e4) return `${(x / 1e3).toFixed(a >= 1e5 ? 0 : 1)}k`;
    return a >= 100 || Number.isInteger(x) ? String(Math.round(x)) : x.toPrecision(3);
  }

  // Unix seconds, or an ISO 8601 text (model directories write those); NaN when neither.
  function toUnix(x) {
    if (isNum(x)) return x;
    if (typeof x === "string" && x) return Date.parse(x) / 1000;
    return NaN;
  }

  function fmtTime(t) {
    const unix = toUnix(t);
    if (!isNum(unix) || unix <= 0) return DASH;
    const d = new Date(unix * 1000);
    const now = new Date();
    const hms = d.toLocaleTimeString("en-GB", {hour12: false});
    if (d.toDateString() === now.toDateString()) return hms;
    return `${d.toISOString().slice(0, 10)} ${hms}`;
  }

  function fmtDuration(seconds) {
    if (!isNum(seconds) || seconds < 0) return DASH;
    if (seconds < 10) return `${seconds.toFixed(1)} s`;
    if (seconds < 120) return `${Math.round(seconds)} s`;
    if (seconds < 7200) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
    return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
  }

  function fmtAge(seconds) {
    if (!isNum(seconds)) return DASH;
    const s = Math.max(0, seconds);
    if (s < 60) return `${s.toFixed(1)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    return `${(s / 3600).toFixed(1)} h ago`;
  }

  function fmtValue(x) {  // any JSON value, as short text
    if (x === null || x === undefined || x === "") return DASH;
    if (isNum(x)) return Number.isInteger(x) ? fmtInt(x) : String(+x.toPrecision(6));
    if (typeof x === "string") return x;
    if (typeof x === "boolean") return x ? "yes" : "no";
    return JSON.stringify(x);
  }

  const serverNow = () => Date.now() / 1000 + state.skew;

  function jobFromHash() {
    const m = /^#job=(.+)$/.exec(location.hash);
    if (!m) return null;
    try {
      return decodeURIComponent(m[1]);
    } catch (e) {  // a malformed escape ("#job=%"): no job by that name, not a dead page
      return m[1];
    }
  }

  // ---- the API ---------------------------------------------------------------------------

  // {data} on 2xx, {missing: true} on 404 (an endpoint or job this coordinator lacks); throws otherwise.
  async function getJSON(path) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
    try {
      const r = await fetch(path, {cache: "no-store", headers: {Accept: "application/json"}, signal: ctl.signal});
      noteClock(r.headers.get("Date"));
      if (r.status === 404) return {missing: true};
      if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
      return {data: await r.json()};
    } finally {
      clearTimeout(timer);
    }
  }

  function noteClock(date) {
    const t = date ? Date.parse(date) / 1000 : NaN;
    if (!isNum(t)) return;
    const skew = t - Date.now() / 1000;
    state.skew = Math.abs(skew) > 2 ? skew : 0;  // the header has whole seconds: ignore small skews
  }

  async function poll() {
    const started = Date.now();
    try {
      await refresh();
    } catch (e) {
      console.warn("refresh failed:", e);
    }
    setTimeout(poll, Math.max(200, POLL_MS - (Date.now() - started)));
  }

  async function refresh() {
    try {
      const pinned = state.pinned !== null ? `&job=${encodeURIComponent(state.pinned)}` : "";
      // its jobs are /v1/jobs's (the newest, the running and the pinned one): one request, not two;
      // brief: the other ended jobs' records without their tables (what the list shows of them)
      const status = await getJSON(`/v1/status?jobs=${JOBS_SHOWN}&brief=1${pinned}`);
      if (status.missing) throw new Error("/v1/status: 404");
      state.status = isObj(status.data) ? status.data : {};
      const list = state.status.jobs;
      const fresh = sortJobs(Array.isArray(list) ? list.filter((j) => isObj(j) && j.id !== undefined) : []);
      const before = new Map(state.jobs.map((j) => [j.id, j.state]));
      if (fresh.some((j) => before.has(j.id) && before.get(j.id) !== j.state)) state.modelsAt = 0;
      state.jobs = fresh;
      state.online = true;
      state.error = "";
      state.lastOk = Date.now();
    } catch (e) {
      state.online = false;
      state.error = e.name === "AbortError" ? "no answer in 5 s" : String(e.message || e);
    }
    if (state.online) {
      state.jobs.forEach(observe);
      const tasks = [refreshHistory(selectedJob())];
      if (Date.now() - state.modelsAt >= MODELS_EVERY_MS) tasks.push(refreshModels());
      await Promise.allSettled(tasks);
    }
    render();
  }

  function sortJobs(jobs) {  // newest first, whatever order the API used
    const t = (j) => (isNum(j.submitted) ? j.submitted : isNum(j.started) ? j.started : 0);
    return jobs.map((j, i) => [j, i]).sort((a, b) => t(b[0]) - t(a[0]) || a[1] - b[1]).map((p) => p[0]);
  }

  async function refreshModels() {
    state.modelsAt = Date.now();
    try {
      const r = await getJSON("/v1/models");
      state.models = r.missing ? {missing: true} : (isObj(r.data) ? r.data : {models: []});
    } catch (e) {
      state.models = {error: String(e.message || e)};
    }
  }

  // ---- what the page remembers of each job --------------------------------------------------

  function memOf(id) {
    let m = state.jobMem.get(id);
    if (!m) {
      m = {
        epochRows: {},        // epoch -> most rows seen in it (totals without progress.rows_total)
        summaryPoints: [],    // points built from the summary when there is no history endpoint
        history: null,        // {points, epochs} from /v1/jobs/{id}/history
        historyMissingAt: 0,  // when the history endpoint last answered 404
        historyDone: false,   // the job ended and its whole history is here
      };
      state.jobMem.set(id, m);
    }
    return m;
  }

  function observe(job) {
    const m = memOf(job.id);
    const p = isObj(job.progress) ? job.progress : {};
    if (isNum(p.epoch) && isNum(p.rows)) m.epochRows[p.epoch] = Math.max(m.epochRows[p.epoch] || 0, p.rows);
    if (job.state !== "running") return;
    const last = m.summaryPoints[m.summaryPoints.length - 1];
    const t = serverNow();
    if (last && t - last.t < 0.5) return;
    m.summaryPoints.push({t, epoch: p.epoch, rows_total: rowsTotal(job), rows_per_s: p.rows_per_s,
                          loss: p.loss, auc: null});
  }

  // One load of a job's history at a time: the poll and a click may both ask, and two loads
  // that started before either had points each added every point (300 where there were 150).
  function refreshHistory(job) {
    if (!job) return Promise.resolve();
    const m = memOf(job.id);
    if (!m.historyLoading) m.historyLoading = loadHistory(job, m).finally(() => { m.historyLoading = null; });
    return m.historyLoading;
  }

  async function loadHistory(job, m) {
    if (m.historyDone) return;
    if (!m.history && m.historyMissingAt && Date.now() - m.historyMissingAt < HISTORY_RETRY_MS) return;
    const ended = !["queued", "running"].includes(job.state);
    const since = m.history && m.history.points.length ? m.history.points[m.history.points.length - 1].t : null;
    const q = since === null ? "" : `?since=${encodeURIComponent(since)}`;
    const r = await getJSON(`/v1/jobs/${encodeURIComponent(job.id)}/history${q}`);
    if (r.missing || !isObj(r.data)) {
      m.historyMissingAt = Date.now();
      return;
    }
    const points = Array.isArray(r.data.points) ? r.data.points.filter((p) => isObj(p) && isNum(p.t)) : [];
    if (!m.history) m.history = {points: [], epochs: []};
    const have = m.history.points;
    const after = have.length ? have[have.length - 1].t : null;  // what is there now, not when asked
    for (const p of points) if (after === null || p.t > after) have.push(p);
    if (Array.isArray(r.data.epochs)) m.history.epochs = r.data.epochs.filter(isObj);
    m.historyDone = ended;
  }

  // ---- derived numbers ------------------------------------------------------------------------

  function selectedJob() {
    if (state.pinned !== null) {
      const j = state.jobs.find((x) => String(x.id) === state.pinned);
      if (j) return j;
    }
    return state.jobs.find((j) => j.state === "running") || state.jobs[0] || null;
  }

  function progressOf(job) {
    return isObj(job.progress) ? job.progress : {};
  }

  // Share of this epoch done, once the source has been read (ready + leased steps remain).
  function epochFraction(p) {
    if (!p.source_done || !isNum(p.batches) || p.batches <= 0) return null;
    return clamp01(1 - ((isNum(p.ready) ? p.ready : 0) + (isNum(p.leased) ? p.leased : 0)) / p.batches);
  }

  function fractionOf(job) {
    const p = progressOf(job);
    if (isNum(p.fraction)) return clamp01(p.fraction);
    if (job.state === "done") return 1;
    if (!isNum(p.epoch) || !isNum(p.epochs) || p.epochs <= 0) return null;
    const within = epochFraction(p);
    if (within === null) return p.epoch > 1 ? clamp01((p.epoch - 1) / p.epochs) : null;
    return clamp01((p.epoch - 1 + within) / p.epochs);
  }

  // Rows done over all epochs: the API's count, else this epoch's rows plus what the page saw of earlier ones.
  function rowsTotal(job) {
    const p = progressOf(job);
    if (isNum(p.rows_total)) return p.rows_total;
    if (isObj(job.record) && isNum(job.record.rows_applied)) return job.record.rows_applied;
    if (!isNum(p.rows)) return null;
    const epoch = isNum(p.epoch) ? p.epoch : 1;
    const seen = memOf(job.id).epochRows;
    const within = epochFraction(p);
    let perEpoch = Math.max(0, ...Object.values(seen));
    if (!perEpoch && within) perEpoch = p.rows / within;
    let total = p.rows;
    for (let e = 1; e < epoch; e++) total += isNum(seen[e]) ? seen[e] : perEpoch;
    return Math.round(total);
  }

  // The jobs table's rows/s: an ended job's own (its record: every epoch's rows over their seconds),
  // a running one's epoch so far (the last epoch's alone made a 2-epoch job read 2.7x its pace).
  function jobRate(job) {
    if (job.state !== "running" && isObj(job.record) && isNum(job.record.rows_per_s)) return job.record.rows_per_s;
    return progressOf(job).rows_per_s;
  }

  // A running job's pace now: its last history point, else its epoch's average.
  function currentRate(job) {
    const h = memOf(job.id).history;
    const last = h && h.points.length ? h.points[h.points.length - 1] : null;
    if (last && isNum(last.rows_per_s)) return last.rows_per_s;
    return progressOf(job).rows_per_s;
  }

  function cacheOf(job) {
    let hits = null, misses = null, rate = null;
    if (isObj(job.cache)) {
      hits = isNum(job.cache.hits) ? job.cache.hits : null;
      misses = isNum(job.cache.misses) ? job.cache.misses : null;
      rate = isNum(job.cache.hit_rate) ? job.cache.hit_rate : null;
    } else if (isObj(job.record) && isNum(job.record.cache_hits)) {
      hits = job.record.cache_hits;
      misses = isNum(job.record.cache_misses) ? job.record.cache_misses : 0;
    }
    if (rate === null && isNum(hits) && isNum(misses) && hits + misses > 0) rate = hits / (hits + misses);
    return {hits, misses, rate};
  }

  function rateOf(service) {
    const r = service.rate;
    if (isObj(r) && isNum(r.value)) return {value: r.value, unit: typeof r.unit === "string" ? r.unit : ""};
    if (isNum(r)) return {value: r, unit: ""};
    return null;
  }

  function servicesOf() {
    const s = state.status && isObj(state.status.services) ? state.status.services : {};
    return Object.entries(s).filter(([, v]) => isObj(v)).sort(([a, x], [b, y]) => roleRank(x) - roleRank(y)
      || String(x.role).localeCompare(String(y.role)) || (x.index || 0) - (y.index || 0) || a.localeCompare(b));
  }

  function roleRank(s) {
    const order = ["coordinator", "loader", "preprocess", "worker", "ps"];
    const i = order.indexOf(s.role);
    return i < 0 ? order.length : i;
  }

  // ---- render: header and stats ---------------------------------------------------------------

  function render() {
    renderHealth();
    renderStats();
    renderJobs();
    renderJob();
    renderServices();
    renderCache();
    renderModels();
  }

  function renderHealth() {
    const box = $("health");
    const services = servicesOf();
    const down = services.filter(([, s]) => s.alive === false).map(([n]) => n);
    let text, level;
    if (state.online === null) {
      [level, text] = ["unknown", "connecting to the coordinator…"];
    } else if (!state.online) {
      const since = state.lastOk ? `, last answer ${fmtAge((Date.now() - state.lastOk) / 1000)}` : "";
      [level, text] = ["down", `coordinator unreachable (${state.error}${since})`];
    } else if (down.length) {
      [level, text] = ["degraded", `${down.length} of ${services.length} services down: ${down.join(", ")}`];
    } else if (redisOf() && redisOf().up === false) {
      [level, text] = ["degraded", `the sample cache's Redis does not answer (${str(redisOf().error)})`];
    } else {
      [level, text] = ["ok", `healthy · ${services.length} services alive`];
    }
    box.dataset.state = level;
    $("health-text").textContent = text;
    $("updated").textContent = state.lastOk ? `updated ${new Date(state.lastOk).toLocaleTimeString("en-GB")}` : DASH;
  }

  function renderStats() {
    const services = servicesOf();
    const alive = services.filter(([, s]) => s.alive !== false).length;
    $("stat-services").textContent = services.length ? `${alive} / ${services.length}` : DASH;
    const running = state.jobs.filter((j) => j.state === "running");
    $("stat-running").textContent = running.length ? running.map((j) => j.id).join(", ") : "none";
    const throughput = running.length ? currentRate(running[0]) : null;
    $("stat-throughput").textContent = isNum(throughput) ? `${fmtCompact(throughput)} rows/s`
      : running.length ? DASH : "idle";
    const job = selectedJob();
    $("stat-cache").textContent = job ? fmtPct(cacheOf(job).rate) : DASH;
    const counts = {};
    for (const j of state.jobs) counts[j.state] = (counts[j.state] || 0) + 1;
    const parts = ["running", "queued", "done", "failed", "cancelled"].filter((s) => counts[s])
      .map((s) => `${counts[s]} ${s}`);
    const total = isNum(state.status && state.status.jobs_total) ? state.status.jobs_total : state.jobs.length;
    $("stat-jobs").textContent = fmtInt(total);
    $("stat-jobs").title = total > state.jobs.length ? `${parts.join(", ")} of the newest ${state.jobs.length}`
      : parts.join(", ");
  }

  // ---- render: jobs table ---------------------------------------------------------------------

  function renderJobs() {
    const sel = selectedJob();
    const focused = document.activeElement && document.activeElement.dataset
      ? document.activeElement.dataset.job : undefined;
    const rows = state.jobs.slice(0, JOBS_SHOWN).map((job) => jobRow(job, sel && sel.id === job.id));
    $("jobs-body").replaceChildren(...rows);
    const again = focused === undefined ? null : rows.find((r) => r.dataset.job === focused);
    if (again) again.focus();  // rows are rebuilt every second: keep the keyboard where it was
    $("jobs-empty").hidden = state.jobs.length > 0 || state.online !== true;
    const total = isNum(state.status && state.status.jobs_total) ? state.status.jobs_total : state.jobs.length;
    $("jobs-more").hidden = total <= rows.length;
    $("jobs-more").textContent = `The newest ${fmtInt(rows.length)} of ${fmtInt(total)} jobs; an older one: `
      + "its id after #job= in this page's address, or GET /v1/jobs?offset=N.";
  }

  function jobRow(job, selected) {
    const p = progressOf(job);
    const cache = cacheOf(job);
    const select = () => pin(String(job.id));
    return el("tr", {"data-testid": "job-row", "data-job": job.id, "data-state": job.state,
                     class: selected ? "selected" : null, "aria-selected": selected ? "true" : "false",
                     tabindex: 0, onclick: select,
                     onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); select(); } }},
      el("td", {class: "job-id", title: job.id}, str(job.id)),
      el("td", {class: "state-cell"}, stateBadge(job.state), phaseNote(job)),
      el("td", {}, str(job.model)),
      el("td", {}, str(job.mode)),
      el("td", {}, progressCell(job)),
      el("td", {title: fmtTimeTitle(job.started)}, fmtTime(job.started)),
      el("td", {title: fmtTimeTitle(job.ended)}, fmtTime(job.ended)),
      el("td", {class: "num", "data-testid": "job-rows"}, fmtInt(rowsTotal(job))),
      el("td", {class: "num", "data-testid": "job-rate"}, isNum(jobRate(job)) ? fmtInt(jobRate(job)) : DASH),
      el("td", {class: "num"}, fmtFixed(p.loss, 4)),
      el("td", {class: "num", "data-testid": "job-cache", title: cacheTitle(cache)}, fmtPct(cache.rate)));
  }

  function fmtTimeTitle(t) {
    const unix = toUnix(t);
    return isNum(unix) && unix > 0 ? new Date(unix * 1000).toString() : null;
  }

  function cacheTitle(c) {
    return isNum(c.hits) ? `${fmtInt(c.hits)} hits, ${fmtInt(c.misses)} misses` : null;
  }

  // What a running job does once its epochs are over (`phase`: "evaluating on test.tsv",
  // "publishing v000003"...); null when the coordinator sends none. A finished job's is ignored.
  function phaseOf(job) {
    if (typeof job.phase !== "string" || !job.phase.trim()) return null;
    return ["done", "failed", "cancelled"].includes(job.state) ? null : job.phase.trim();
  }

  function phaseNote(job) {
    const phase = phaseOf(job);
    return phase ? el("div", {class: "phase", "data-testid": "job-phase", title: phase}, phase) : null;
  }

  function stateBadge(s) {
    const known = ["queued", "running", "done", "failed", "cancelled"].includes(s);
    return el("span", {class: `badge ${known ? s : ""}`, "data-testid": "job-state"}, str(s));
  }

  function progressCell(job) {
    const p = progressOf(job);
    const frac = fractionOf(job);
    const rows = rowsTotal(job);
    const epoch = isNum(p.epoch) && isNum(p.epochs) ? `epoch ${p.epoch}/${p.epochs}` : "epoch —";
    const fill = el("div", {class: "fill"});
    if (frac !== null) fill.style.width = `${(100 * frac).toFixed(1)}%`;
    const phase = phaseOf(job);
    const kind = ["done", "failed", "cancelled"].includes(job.state) ? job.state
      : phase ? "finishing" : frac === null && job.state === "running" ? "unknown" : "";
    return el("div", {class: `progress ${kind}`, "data-testid": "job-progress", "data-rows": isNum(rows) ? rows : "",
                      "data-epoch": isNum(p.epoch) ? p.epoch : "", "data-fraction": frac === null ? "" : frac.toFixed(4),
                      role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100,
                      "aria-valuenow": frac === null ? null : Math.round(100 * frac)},
      el("div", {class: "bar"}, fill),
      el("div", {class: "label"}, el("span", {}, phase ? `${epoch} · finishing` : epoch),
         el("span", {class: "pct"}, fmtPct(frac))));
  }

  function pin(id) {
    state.pinned = id;
    history.replaceState(null, "", `#job=${encodeURIComponent(id)}`);
    render();
    refresh().catch(() => {});  // its whole record now: the poll sends other ended jobs' brief
  }

  function unpin() {
    state.pinned = null;
    history.replaceState(null, "", location.pathname + location.search);
    render();
  }

  // ---- render: the selected job ---------------------------------------------------------------

  function renderJob() {
    const job = selectedJob();
    $("job-none").hidden = !!job;
    $("job-body").hidden = !job;
    const pinned = state.pinned !== null && job && String(job.id) === state.pinned;
    $("job-follow").hidden = !pinned;
    // a #job=ID the coordinator does not know (a typo, a job of another cluster): said, not passed over
    const which = job && job.state === "running" ? "the running job" : "the newest job";
    $("job-follow-hint").textContent = !job || pinned ? ""
      : state.pinned !== null ? `no job ${state.pinned} here; showing ${which}`
      : job.state === "running" ? "following the running job" : which;
    if (!job) {
      $("job-title").textContent = "Job";
      $("job-state-badge").replaceChildren();
      $("job-phase").hidden = true;
      return;
    }
    $("job-title").textContent = `Job ${job.id}`;
    $("job-detail").dataset.job = job.id;
    $("job-state-badge").replaceChildren(stateBadge(job.state));
    const phase = phaseOf(job);
    $("job-phase").hidden = !phase;
    $("job-phase").textContent = phase || "";
    $("job-facts").replaceChildren(...jobFacts(job));
    const err = $("job-error");
    err.hidden = !(job.error && (job.state === "failed" || job.state === "cancelled"));
    err.textContent = job.error ? `${job.state === "failed" ? "Failed" : "Stopped"}: ${job.error}` : "";
    // what services warned of about the job (a shard's tables too big for its machine), each once
    const warnings = Array.isArray(job.warnings) ? job.warnings.filter((w) => typeof w === "string") : [];
    $("job-warnings").hidden = warnings.length === 0;
    $("job-warnings").replaceChildren(...warnings.map((w) => el("p", {"data-testid": "job-warning"}, `Warning: ${w}`)));
    renderCharts(job);
    renderEpochs(job);
    renderRecord(job);
  }

  function jobFacts(job) {
    const p = progressOf(job);
    const end = isNum(job.ended) && job.ended > 0 ? job.ended : job.state === "running" ? serverNow() : null;
    const duration = isNum(job.started) && job.started > 0 && end ? end - job.started : null;
    const data = Array.isArray(job.data) ? job.data.join(", ") : job.data;
    const facts = [
      ["Model", job.model], ["Mode", job.mode],
      ["Epoch", isNum(p.epoch) ? `${p.epoch} of ${str(p.epochs)}` : null],
      ["Progress", fmtPct(fractionOf(job))],
      ["Rows (all epochs)", fmtInt(rowsTotal(job))], ["Rows this epoch", fmtInt(p.rows)],
      ["Rows/s (this epoch)", fmtInt(p.rows_per_s)], ["Train loss (this epoch)", fmtFixed(p.loss, 4)],
      ["Submitted", fmtTime(job.submitted)], ["Started", fmtTime(job.started)], ["Ended", fmtTime(job.ended)],
      ["Duration", fmtDuration(duration)],
      // (a queue of a job that runs: an ended one's last counts read as steps still waiting)
      ["Steps ready / leased", isNum(p.ready) && job.state === "running" ? `${fmtInt(p.ready)} / ${fmtInt(p.leased)}`
        : null],
      ["Cache hit rate", fmtPct(cacheOf(job).rate)],
      ["Coordinator restarts", isNum(job.restarts) ? String(job.restarts) : null],
      ["Data", data],
    ];
    return facts.map(([k, v]) => el("div", {class: k === "Data" ? "wide" : null}, el("dt", {}, k),
                                    el("dd", {class: k === "Data" ? "mono" : null}, str(v))));
  }

  // ---- charts ---------------------------------------------------------------------------------

  function renderCharts(job) {
    const m = memOf(job.id);
    const fromHistory = !!m.history;
    const points = fromHistory ? m.history.points : m.summaryPoints;
    const t0 = isNum(job.started) && job.started > 0 ? job.started : (points[0] ? points[0].t : 0);
    const series = (key) => points.filter((p) => isNum(p[key]))
      .map((p) => ({x: p.t - t0, y: p[key], epoch: p.epoch}));
    const test = testMetrics(job);
    drawChart($("chart-loss"), series("loss"), {fmt: (v) => fmtFixed(v, 4), empty: emptyText(job, fromHistory),
      ref: refLine(test, "logloss")});
    drawChart($("chart-auc"), series("auc"), {fmt: (v) => fmtFixed(v, 4),
      empty: fromHistory ? emptyText(job, true) : "AUC over time needs the history endpoint", ref: refLine(test, "auc")});
    captionRef($("ref-loss"), test, "logloss");
    captionRef($("ref-auc"), test, "auc");
    drawChart($("chart-throughput"), series("rows_per_s"), {fmt: (v) => `${fmtInt(v)} rows/s`, zero: true,
      tick: fmtCompact, empty: emptyText(job, fromHistory)});
    renderValidation(job, fromHistory ? m.history.epochs : []);
    renderReliability(job, test);
    $("chart-source").textContent = fromHistory
      ? `From the job's history (${points.length} point${points.length === 1 ? "" : "s"}, about one a second).`
      : job.state === "running"
        ? "This coordinator keeps no history (GET /v1/jobs/{id}/history: 404): points are the job's progress as this page saw it."
        : "No history kept for this job by this coordinator.";
    $("chart-source").dataset.source = fromHistory ? "history" : "summary";
  }

  // A finished job's metrics on its test data: {auc, logloss, rows}; {none: true} when it had
  // no test data (the record's auc is null); null while it runs or when it has no record.
  function testMetrics(job) {
    const rec = isObj(job.record) ? job.record : null;
    if (job.state !== "done" || !rec || !("auc" in rec)) return null;
    if (!isNum(rec.auc)) return {none: true};
    return {auc: rec.auc, logloss: isNum(rec.logloss) ? rec.logloss : null,
            rows: isNum(rec.test_rows) ? rec.test_rows : null};
  }

  function refLine(test, key) {
    return test && isNum(test[key]) ? {y: test[key], label: `test ${fmtFixed(test[key], 4)}`} : null;
  }

  // The caption's second line: "test AUC 0.8201" (the dashed line's legend) or "no test data".
  function captionRef(box, test, key) {
    const name = key === "auc" ? "AUC" : key;
    box.dataset.value = test && isNum(test[key]) ? test[key].toFixed(4) : "";
    if (!test) {
      box.replaceChildren();
      box.removeAttribute("title");
    } else if (test.none) {
      box.replaceChildren(el("span", {class: "none"}, "no test data"));
      box.title = `This job had no test data: no test ${name} (only the progressive one, on training rows).`;
    } else {
      box.replaceChildren(el("span", {class: "swatch", "aria-hidden": "true"}), `test ${name} `,
                          el("b", {}, fmtFixed(test[key], 4)));
      box.title = `${name} on ${test.rows === null ? "the" : fmtInt(test.rows)} held-out test rows, after training`;
    }
  }

  // ---- validation: each epoch's logloss on the job's valid_data ---------------------------------

  // The history's epochs that were validated: [{x: epoch, y: logloss, auc}]; the best one
  // (lowest logloss) gets the dashed line and the caption.
  function renderValidation(job, epochs) {
    const pts = (epochs || []).filter((e) => isObj(e.valid) && isNum(e.valid.logloss) && isNum(e.epoch))
      .map((e) => ({x: e.epoch, y: e.valid.logloss, auc: e.valid.auc}));
    const best = pts.reduce((b, p) => (b === null || p.y < b.y ? p : b), null);
    const box = $("ref-valid");
    box.dataset.epoch = best ? String(best.x) : "";
    if (best) {
      box.replaceChildren(el("span", {class: "swatch", "aria-hidden": "true"}), `best: epoch ${best.x}, AUC `,
                          el("b", {}, isNum(best.auc) ? fmtFixed(best.auc, 4) : DASH));
      box.title = `the lowest validation logloss, ${fmtFixed(best.y, 4)}, came after epoch ${best.x}`;
    } else {
      box.replaceChildren();
      box.removeAttribute("title");
    }
    const empty = ["queued", "running"].includes(job.state) ? "scored after each epoch (with valid_data)"
      : "no validation data (valid_data) in this job";
    drawChart($("chart-valid"), pts, {fmt: (v) => fmtFixed(v, 4), empty, dots: true, x0: 1,
      xfmt: (v) => `epoch ${v}`, xTicks: pts.map((p) => p.x),
      ref: best ? {y: best.y, label: `best ${fmtFixed(best.y, 4)}`} : null});
  }

  // ---- calibration: the record's reliability table ---------------------------------------------

  // {table, ece, rows} of a finished job with test data, else {why} there is no table to draw.
  // A bucket: {score_min, score_max, rows, clicks, mean_pctr, ctr, ctr_lo, ctr_hi}.
  function reliabilityOf(job, test) {
    if (["queued", "running"].includes(job.state)) return {why: "measured on the test rows once the job is done"};
    if (!test) return {why: job.state === "done" ? "no record" : "the job did not finish"};
    if (test.none) return {why: "no test data"};
    if (job.brief) return {why: "loading the job's record"};
    const rec = job.record;
    const table = Array.isArray(rec.reliability)
      ? rec.reliability.filter((b) => isObj(b) && isNum(b.mean_pctr) && isNum(b.ctr)) : [];
    if (!table.length) return {why: "no reliability table in this job's record"};
    return {table, ece: isNum(rec.ece) ? rec.ece : null, rows: test.rows};
  }

  const fmtRate = (x) => (isNum(x) ? String(+x.toPrecision(3)) : DASH);
  const eceText = (rel) => (rel.table ? `ECE ${fmtRate(rel.ece)}` : DASH);

  function renderReliability(job, test) {
    const rel = reliabilityOf(job, test);
    const ref = $("ref-reliability");
    if (rel.table) {
      const rows = rel.table.reduce((n, b) => n + (isNum(b.rows) ? b.rows : 0), 0);
      ref.replaceChildren(`${fmtInt(rows)} test rows · ${rel.table.length} buckets`);
      ref.title = "buckets of about equal rows by pCTR; hover a point for its numbers";
    } else {
      ref.replaceChildren(rel.why === "no test data" ? el("span", {class: "none"}, "no test data") : "");
      ref.removeAttribute("title");
    }
    drawReliability($("chart-reliability"), rel);
  }

  // Observed CTR (y) against mean pCTR (x) per bucket with its 95% interval, on equal scales
  // from 0 with the diagonal of a calibrated model; a bucket whose interval misses it is "off".
  function drawReliability(box, rel) {
    const width = Math.max(240, Math.round(box.clientWidth || 320));
    const height = 180;
    const table = rel.table || [];
    const nowEl = $("now-reliability");
    if (!box.matches(":hover")) nowEl.textContent = eceText(rel);  // not over a point's numbers
    nowEl.dataset.value = isNum(rel.ece) ? String(rel.ece) : "";
    const sig = `${width}|${JSON.stringify(table)}|${rel.why || ""}`;
    if (box.dataset.sig === sig) return;
    box.dataset.sig = sig;
    box.dataset.points = String(table.length);
    const root = svg("svg", {viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img",
                             "aria-label": `calibration: ${table.length} buckets`});
    if (!table.length) {
      root.append(svg("text", {x: width / 2, y: height / 2, "text-anchor": "middle", class: "placeholder"}, rel.why));
      box.replaceChildren(root);
      return;
    }
    const pad = {l: 54, r: 12, t: 10, b: 22};
    const hi = (b) => (isNum(b.ctr_hi) ? b.ctr_hi : b.ctr);
    const ticks = niceTicks(0, 1.05 * Math.max(1e-6, ...table.map((b) => Math.max(b.mean_pctr, hi(b)))), 4);
    const lim = ticks[ticks.length - 1];
    const sx = (x) => pad.l + (x / lim) * (width - pad.l - pad.r);
    const sy = (y) => height - pad.b - (y / lim) * (height - pad.t - pad.b);
    const grid = svg("g", {class: "grid"});
    const axis = svg("g", {class: "axis"});
    for (const v of ticks) {
      grid.append(svg("line", {x1: pad.l, x2: width - pad.r, y1: sy(v), y2: sy(v)}));
      axis.append(svg("text", {x: pad.l - 6, y: sy(v) + 3.5, "text-anchor": "end"}, formatTick(v, ticks)),
                  svg("text", {x: sx(v), y: height - 6, "text-anchor": "middle"}, formatTick(v, ticks)));
    }
    const d = table.map((b, i) => `${i ? "L" : "M"}${sx(b.mean_pctr).toFixed(1)},${sy(b.ctr).toFixed(1)}`).join("");
    const buckets = table.map((b) => bucketMark(b, sx, sy, () => { nowEl.textContent = bucketText(b); }));
    root.append(grid, svg("line", {class: "diag", x1: sx(0), y1: sy(0), x2: sx(lim), y2: sy(lim)}),
                svg("path", {class: "line", d}), ...buckets, axis);
    root.addEventListener("mouseleave", () => { nowEl.textContent = eceText(rel); });
    box.replaceChildren(root);
  }

  function bucketMark(b, sx, sy, onHover) {
    const ranged = isNum(b.ctr_lo) && isNum(b.ctr_hi);
    const off = ranged && (b.mean_pctr < b.ctr_lo || b.mean_pctr > b.ctr_hi);
    const x = sx(b.mean_pctr);
    return svg("g", {class: off ? "bucket off" : "bucket", "data-pred": b.mean_pctr, "data-obs": b.ctr,
                     onmouseenter: onHover},
      svg("title", {}, `pCTR ${fmtRate(b.score_min)}–${fmtRate(b.score_max)}: ${fmtInt(b.rows)} rows, ` +
                       `${fmtInt(b.clicks)} clicks\nmean pCTR ${fmtRate(b.mean_pctr)}, observed CTR ${fmtRate(b.ctr)}` +
                       (ranged ? ` (95%: ${fmtRate(b.ctr_lo)}–${fmtRate(b.ctr_hi)})` : "")),
      ranged ? svg("line", {class: "whisker", x1: x, x2: x, y1: sy(b.ctr_lo), y2: sy(b.ctr_hi)}) : null,
      svg("circle", {cx: x, cy: sy(b.ctr), r: 3.5}));
  }

  function bucketText(b) {
    return `pCTR ${fmtRate(b.mean_pctr)} → CTR ${fmtRate(b.ctr)}`;
  }

  function emptyText(job, fromHistory) {
    if (job.state === "queued") return "the job has not started";
    if (job.state === "running") return "waiting for data…";
    return fromHistory ? "no points recorded" : "no history for this job";
  }

  // A line chart in inline SVG: points [{x: seconds since the job started, y, epoch}].
  function drawChart(box, points, opts) {
    const width = Math.max(240, Math.round(box.clientWidth || 320));
    const height = 180;
    const last = points[points.length - 1];
    const ref = opts.ref || null;
    const sig = `${points.length}|${width}|${last ? `${last.x},${last.y}` : opts.empty}|${ref ? ref.y : ""}`;
    const nowEl = $(`now-${box.id.slice(6)}`);
    if (nowEl) nowEl.textContent = last ? opts.fmt(last.y) : DASH;
    if (box.dataset.sig === sig) return;
    box.dataset.sig = sig;
    const pts = thin(points, MAX_CHART_POINTS);
    box.dataset.points = String(pts.length);
    box.dataset.ref = ref && pts.length ? String(ref.y) : "";
    const root = svg("svg", {viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none",
                             role: "img", "aria-label": `${box.id}: ${pts.length} points`});
    if (!pts.length) {
      root.append(svg("text", {x: width / 2, y: height / 2, "text-anchor": "middle", class: "placeholder"},
                      opts.empty));
      box.replaceChildren(root);
      return;
    }
    const pad = {l: 54, r: 12, t: 10, b: 22};
    const x0 = isNum(opts.x0) ? Math.min(opts.x0, pts[0].x) : Math.min(0, pts[0].x);
    const x1 = Math.max(x0 + 1, pts[pts.length - 1].x);
    const ys = pts.map((p) => p.y).concat(ref ? [ref.y] : []);
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (opts.zero) y0 = Math.min(0, y0);
    if (y1 - y0 < 1e-12) [y0, y1] = [y0 - (Math.abs(y0) * 0.05 || 1), y1 + (Math.abs(y1) * 0.05 || 1)];
    const yTicks = niceTicks(y0, y1, 4);
    [y0, y1] = [Math.min(y0, yTicks[0]), Math.max(y1, yTicks[yTicks.length - 1])];
    const sx = (x) => pad.l + ((x - x0) / (x1 - x0)) * (width - pad.l - pad.r);
    const sy = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
    const tick = opts.tick || ((v) => formatTick(v, yTicks));

    const grid = svg("g", {class: "grid"});
    const axis = svg("g", {class: "axis"});
    for (const v of yTicks) {
      grid.append(svg("line", {x1: pad.l, x2: width - pad.r, y1: sy(v), y2: sy(v)}));
      axis.append(svg("text", {x: pad.l - 6, y: sy(v) + 3.5, "text-anchor": "end"}, tick(v)));
    }
    const xfmt = opts.xfmt || fmtSeconds;
    for (const v of opts.xTicks || niceTicks(x0, x1, Math.max(2, Math.floor(width / 90)))) {
      if (v < x0 || v > x1) continue;
      axis.append(svg("text", {x: sx(v), y: height - 6, "text-anchor": "middle"}, xfmt(v)));
    }
    const epochs = svg("g", {class: "epoch"});
    for (let i = 1; i < pts.length; i++) {
      if (isNum(pts[i].epoch) && isNum(pts[i - 1].epoch) && pts[i].epoch !== pts[i - 1].epoch) {
        const x = sx(pts[i].x);
        epochs.append(svg("line", {x1: x, x2: x, y1: pad.t, y2: height - pad.b}),
                      svg("text", {x: x + 3, y: pad.t + 9}, `epoch ${pts[i].epoch}`));
      }
    }
    const d = pts.map((p, i) => `${i ? "L" : "M"}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join("");
    const base = sy(Math.max(y0, Math.min(y1, opts.zero ? 0 : y0)));
    const area = `${d}L${sx(pts[pts.length - 1].x).toFixed(1)},${base}L${sx(pts[0].x).toFixed(1)},${base}Z`;
    const end = pts[pts.length - 1];
    const cursor = svg("g", {class: "cursor", visibility: "hidden"},
                       svg("line", {y1: pad.t, y2: height - pad.b}), svg("circle", {r: 3.5, class: "dot"}));
    const refs = svg("g", {class: "ref"});
    if (ref) {
      refs.append(svg("line", {x1: pad.l, x2: width - pad.r, y1: sy(ref.y), y2: sy(ref.y)}),
                  svg("text", {x: pad.l + 6, y: sy(ref.y) + (sy(ref.y) < pad.t + 14 ? 12 : -4)}, ref.label));
    }
    const dots = opts.dots ? pts.map((p) => svg("circle", {class: "dot", cx: sx(p.x), cy: sy(p.y), r: 3})) : [];
    root.append(grid, epochs, svg("path", {class: "area", d: area}), svg("path", {class: "line", d}), refs,
                ...dots, svg("circle", {class: "dot", cx: sx(end.x), cy: sy(end.y), r: 3}), axis, cursor);
    hover(root, box, pts, sx, sy, opts, cursor);
    box.replaceChildren(root);
  }

  // Hovering a chart shows the nearest point's value in the caption.
  function hover(root, box, pts, sx, sy, opts, cursor) {
    const nowEl = $(`now-${box.id.slice(6)}`);
    const show = (clientX) => {
      const r = root.getBoundingClientRect();
      const x = ((clientX - r.left) / r.width) * root.viewBox.baseVal.width;
      let best = pts[0];
      for (const p of pts) if (Math.abs(sx(p.x) - x) < Math.abs(sx(best.x) - x)) best = p;
      cursor.setAttribute("visibility", "visible");
      cursor.firstChild.setAttribute("x1", sx(best.x));
      cursor.firstChild.setAttribute("x2", sx(best.x));
      cursor.lastChild.setAttribute("cx", sx(best.x));
      cursor.lastChild.setAttribute("cy", sy(best.y));
      if (nowEl) nowEl.textContent = `${opts.fmt(best.y)} at ${(opts.xfmt || fmtSeconds)(best.x)}`;
    };
    root.addEventListener("mousemove", (e) => show(e.clientX));
    root.addEventListener("mouseleave", () => {
      cursor.setAttribute("visibility", "hidden");
      const end = pts[pts.length - 1];
      if (nowEl) nowEl.textContent = opts.fmt(end.y);
    });
  }

  function thin(points, max) {  // every k-th point, always keeping the last
    if (points.length <= max) return points;
    const k = Math.ceil(points.length / max);
    const out = points.filter((_, i) => i % k === 0);
    if (out[out.length - 1] !== points[points.length - 1]) out.push(points[points.length - 1]);
    return out;
  }

  function niceTicks(lo, hi, n) {
    const span = hi - lo;
    if (!(span > 0)) return [lo];
    const raw = span / Math.max(1, n);
    const mag = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
    const out = [];
    for (let v = Math.floor(lo / step) * step; v <= hi + step * 0.999; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function formatTick(v, ticks) {
    const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : Math.abs(v) || 1;
    const digits = Math.max(0, Math.min(6, -Math.floor(Math.log10(step)) + 1));
    return Math.abs(v) >= 1e4 ? fmtCompact(v) : v.toFixed(digits);
  }

  function fmtSeconds(s) {
    if (s < 120) return `${Math.round(s)}s`;
    if (s < 7200) return `${+(s / 60).toFixed(1)}m`;
    return `${+(s / 3600).toFixed(1)}h`;
  }

  // ---- epochs and record ------------------------------------------------------------------------

  function renderEpochs(job) {
    const m = memOf(job.id);
    let rows = [];
    const valid = (e) => (isObj(e.valid) ? e.valid : {});
    if (m.history && m.history.epochs.length) {
      rows = m.history.epochs.map((e) => [e.epoch, e.seconds, e.rows, e.loss, e.auc, valid(e).logloss,
                                          valid(e).auc]);
    } else if (isObj(job.record) && Array.isArray(job.record.epoch_seconds)) {
      const r = job.record;
      rows = r.epoch_seconds.map((s, i) => [i + 1, s, Array.isArray(r.rows_per_epoch) ? r.rows_per_epoch[i] : null,
                                            null, null, null, null]);
    }
    const validated = rows.some((r) => isNum(r[5]));
    const box = $("job-epochs");
    if (!rows.length) {
      box.replaceChildren();
      return;
    }
    const sig = JSON.stringify(rows);
    if (box.dataset.sig === sig) return;
    box.dataset.sig = sig;
    box.replaceChildren(el("h3", {}, "Finished epochs"), el("div", {class: "table-wrap"},
      el("table", {class: "table", "data-testid": "job-epochs"},
        el("thead", {}, el("tr", {}, ["Epoch", "Seconds", "Rows", "Rows/s", "Train loss", "Progressive AUC"]
          .concat(validated ? ["Valid logloss", "Valid AUC"] : [])
          .map((h, i) => el("th", {class: i ? "num" : null, title: i === 4 || i === 5 ? PROGRESSIVE_HINT : null},
                            h)))),
        el("tbody", {}, rows.map(([e, s, n, loss, auc, vloss, vauc]) => el("tr", {},
          el("td", {}, str(e)), el("td", {class: "num"}, fmtFixed(s, 2)), el("td", {class: "num"}, fmtInt(n)),
          el("td", {class: "num"}, isNum(s) && isNum(n) && s > 0 ? fmtInt(n / s) : DASH),
          el("td", {class: "num"}, fmtFixed(loss, 4)), el("td", {class: "num"}, fmtFixed(auc, 4)),
          ...(validated ? [el("td", {class: "num"}, fmtFixed(vloss, 4)),
                           el("td", {class: "num"}, fmtFixed(vauc, 4))] : []),
        ))))));
  }

  const PROGRESSIVE_HINT = "on training rows, each batch scored before the model trained on it";
  const testValue = (v) => (isNum(v) ? v.toFixed(4) : "no test data");
  const RECORD_HIGHLIGHTS = [
    ["auc", "Test AUC", testValue], ["logloss", "Test logloss", testValue],
    ["ece", "Test ECE", (v) => (isNum(v) ? fmtRate(v) : "no test data")],
    ["train_loss", "Train loss", (v) => fmtFixed(v, 4)], ["rows_applied", "Rows applied", fmtInt],
    ["rows_per_s", "Rows/s", fmtInt], ["train_seconds", "Train time", fmtDuration],
    ["model_version", "Version", str], ["promoted", "Promoted", fmtValue],
  ];

  function renderRecord(job) {
    const box = $("job-record");
    const rec = isObj(job.record) ? job.record : null;
    box.hidden = !rec;
    if (!rec) {
      box.replaceChildren();
      delete box.dataset.sig;
      return;
    }
    const sig = `${job.id}|${JSON.stringify(rec)}`;
    if (box.dataset.sig === sig) return;
    box.dataset.sig = sig;
    const wasOpen = (name) => !!box.querySelector(`details[data-name=${name}]`)?.open;
    const metrics = RECORD_HIGHLIGHTS.filter(([k]) => k in rec).map(([k, label, f]) =>
      el("div", {class: "metric", "data-key": k}, el("div", {class: "k"}, label),
         el("div", {class: rec[k] === null ? "v none" : "v"}, f(rec[k]))));
    const buckets = Array.isArray(rec.reliability) ? rec.reliability.filter(isObj) : [];
    const text = (k) => (k === "reliability" && buckets.length ? `${buckets.length} buckets (the table above)`
      : fmtValue(rec[k]));
    const rows = Object.keys(rec).sort().map((k) => el("tr", {}, el("td", {}, k), el("td", {}, text(k))));
    box.replaceChildren(
      el("h3", {}, "Record"),
      el("div", {class: "metrics"}, metrics),
      rec.model_dir ? el("p", {class: "muted"}, "Model written to ", el("code", {}, String(rec.model_dir)),
                         rec.model_version ? ` as ${rec.model_version}` : "") : null,
      buckets.length ? el("details", {"data-name": "reliability", open: wasOpen("reliability") ? "" : null},
        el("summary", {}, `Reliability on the test rows (${buckets.length} buckets)`), reliabilityTable(buckets))
        : null,
      el("details", {"data-name": "fields", open: wasOpen("fields") ? "" : null},
         el("summary", {}, `All ${rows.length} fields`), el("table", {class: "table kv"}, el("tbody", {}, rows))));
  }

  function reliabilityTable(buckets) {
    const heads = ["pCTR range", "Rows", "Clicks", "Mean pCTR", "Observed CTR", "95% interval"];
    return el("div", {class: "table-wrap reliability-wrap"},
      el("table", {class: "table compact", "data-testid": "reliability-table"},
        el("thead", {}, el("tr", {}, heads.map((h, i) => el("th", {class: i ? "num" : null}, h)))),
        el("tbody", {}, buckets.map((b) => el("tr", {},
          el("td", {}, `${fmtRate(b.score_min)}–${fmtRate(b.score_max)}`), el("td", {class: "num"}, fmtInt(b.rows)),
          el("td", {class: "num"}, fmtInt(b.clicks)), el("td", {class: "num"}, fmtRate(b.mean_pctr)),
          el("td", {class: "num"}, fmtRate(b.ctr)),
          el("td", {class: "num"}, `${fmtRate(b.ctr_lo)}–${fmtRate(b.ctr_hi)}`))))));
  }

  // ---- render: services -----------------------------------------------------------------------

  function renderServices() {
    const services = servicesOf();
    const now = serverNow();
    $("services-body").replaceChildren(...services.map(([name, s]) => {
      const rate = rateOf(s);
      const alive = s.alive !== false;
      return el("tr", {"data-testid": "service-row", "data-service": name, "data-alive": String(alive)},
        el("td", {class: "mono"}, name),
        el("td", {}, str(s.role)),
        el("td", {class: "num"}, str(s.index)),
        el("td", {class: "mono", "data-testid": "service-host"}, str(s.host)),
        el("td", {class: "num"}, str(s.pid)),
        el("td", {class: "num", "data-testid": "service-restarts",
                  title: "times it registered again after a restart"}, isNum(s.restarts) ? fmtInt(s.restarts) : DASH),
        el("td", {}, el("span", {class: `alive ${alive ? "yes" : "no"}`, "data-testid": "service-alive"},
                        el("span", {class: "dot"}), alive ? "alive" : s.stopped === true ? "stopped" : "down")),
        el("td", {class: "num", title: fmtTimeTitle(s.last_seen)}, isNum(s.last_seen) && s.last_seen > 0
          ? fmtAge(now - s.last_seen) : DASH),
        el("td", {class: "num", "data-testid": "service-rate"}, rate ? `${fmtCompact(rate.value)} ${rate.unit}`.trim()
          : DASH),
        el("td", {class: "wrap"}, counterChips(s.status)));
    }));
    $("services-empty").hidden = services.length > 0 || state.online !== true;
    // services the coordinator refused at their Hello: a config that differs from its own, ...
    const refused = state.status && isObj(state.status.refused) ? Object.entries(state.status.refused) : [];
    $("services-refused").replaceChildren(...refused.map(([name, why]) =>
      el("li", {"data-testid": "refused-service", "data-service": name},
         el("strong", {}, `refused ${name}: `), str(why))));
    $("services-refused").hidden = refused.length === 0;
  }

  function counterChips(status) {
    if (!isObj(status)) return DASH;
    const entries = Object.entries(status).filter(([, v]) => isNum(v) || Array.isArray(v) || typeof v === "boolean");
    if (!entries.length) return DASH;
    const chip = ([k, v]) => el("span", {class: "chip", title: `${k}: ${fmtValue(v)}`},
                                el("b", {}, k), Array.isArray(v) ? String(v.length) : fmtValue(v));
    const shown = entries.slice(0, 8).map(chip);
    if (entries.length > 8) {
      shown.push(el("span", {class: "chip muted", title: entries.slice(8).map(([k, v]) => `${k}: ${fmtValue(v)}`)
        .join("\n")}, `+${entries.length - 8}`));
    }
    return el("div", {class: "chips"}, shown);
  }

  // ---- render: cache ----------------------------------------------------------------------------

  function renderCache() {
    const job = selectedJob();
    const parts = [];
    if (job) {
      const c = cacheOf(job);
      const fill = el("div", {class: "fill"});
      if (isNum(c.rate)) fill.style.width = `${(100 * c.rate).toFixed(1)}%`;
      parts.push(
        el("div", {class: "muted"}, "Job ", el("span", {class: "mono"}, String(job.id))),
        el("div", {class: "big-rate", "data-testid": "cache-hit-rate", "data-rate": isNum(c.rate) ? c.rate : ""},
           fmtPct(c.rate)),
        el("div", {class: "bar cache-bar"}, fill),
        el("div", {class: "muted"}, isNum(c.hits) ? `${fmtInt(c.hits)} hits · ${fmtInt(c.misses)} misses (batches)`
          : "hits and misses: — (reported once the coordinator counts them, or when the job is done)"));
    } else {
      parts.push(el("p", {class: "empty"}, "No job yet."));
    }
    const redis = redisOf();
    if (redis) parts.push(el("h3", {}, "Redis server"), redisFacts(redis));
    const counters = cacheCounters();
    if (counters.length) {
      parts.push(el("h3", {}, "Service counters"), el("table", {class: "table"}, el("tbody", {},
        counters.map(([svc, k, v]) => el("tr", {}, el("td", {class: "mono"}, svc), el("td", {}, k),
                                         el("td", {class: "num"}, fmtValue(v)))))));
    }
    $("cache-body").replaceChildren(...parts);
  }

  function redisOf() {  // /v1/status "redis": the cache server's INFO (newer coordinators)
    return state.status && isObj(state.status.redis) ? state.status.redis : null;
  }

  function redisFacts(r) {
    const facts = r.up === false
      ? [["State", "down"], ["Error", r.error]]
      : [["State", r.up ? "up" : null], ["Read hit rate", fmtPct(r.hit_rate)],
         ["Hits / misses", isNum(r.hits) ? `${fmtInt(r.hits)} / ${fmtInt(r.misses)}` : null],
         ["Memory", fmtBytes(r.used_memory)], ["Keys", fmtInt(r.keys)]];
    return el("dl", {class: "facts", "data-testid": "redis", "data-up": String(r.up)},
              facts.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", {}, str(v)))));
  }

  function fmtBytes(n) {
    if (!isNum(n)) return DASH;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) [n, i] = [n / 1024, i + 1];
    return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
  }

  function cacheCounters() {  // [service, counter, value] for counters about the cache
    const out = [];
    const look = (svc, obj) => {
      if (!isObj(obj)) return;
      for (const [k, v] of Object.entries(obj)) {
        if (isNum(v) && /cache|hit|miss/i.test(k)) out.push([svc, k, v]);
      }
    };
    for (const [name, s] of servicesOf()) look(name, s.status);
    if (state.status) look("coordinator", state.status.counters);
    return out;
  }

  // ---- render: models -----------------------------------------------------------------------------

  function renderModels() {
    const box = $("models-body");
    const m = state.models;
    const sig = JSON.stringify(m) + state.jobs.filter((j) => j.record).length;
    if (box.dataset.sig === sig) return;
    box.dataset.sig = sig;
    let parts;
    if (m === null) {
      parts = [el("p", {class: "empty"}, "Loading…")];
    } else if (m.missing || m.error) {
      parts = [el("p", {class: "notice"}, m.missing
        ? "This coordinator does not list model versions yet (GET /v1/models: 404). Versions written by jobs:"
        : `Could not read /v1/models (${m.error}). Versions written by jobs:`), jobVersions()];
    } else {
      const models = Array.isArray(m.models) ? m.models.filter(isObj) : [];
      parts = models.length ? models.map(modelBlock)
        : [el("p", {class: "empty"}, "No model directories (coordinator.model_dirs) have versions yet.")];
    }
    box.replaceChildren(...parts);
  }

  function jobVersions() {  // without /v1/models: the versions this coordinator's jobs wrote
    const done = state.jobs.filter((j) => isObj(j.record) && j.record.model_version);
    if (!done.length) return el("p", {class: "empty"}, "None yet.");
    return el("div", {class: "table-wrap"}, el("table", {class: "table", "data-testid": "job-versions"},
      el("thead", {}, el("tr", {}, ["Directory", "Version", "Job", "Promoted", "Test AUC", "Test logloss"].map((h) =>
        el("th", {}, h)))),
      el("tbody", {}, done.map((j) => el("tr", {},
        el("td", {class: "mono"}, str(j.record.model_dir)), el("td", {class: "mono"}, str(j.record.model_version)),
        jobCell(j.id), el("td", {}, fmtValue(j.record.promoted)), el("td", {}, fmtFixed(j.record.auc, 4)),
        el("td", {}, fmtFixed(j.record.logloss, 4)))))));
  }

  function modelBlock(model) {
    const versions = Array.isArray(model.versions) ? model.versions.filter(isObj) : [];
    const decisions = Array.isArray(model.decisions) ? model.decisions.filter(isObj) : [];
    const promotions = Array.isArray(model.promotions) ? model.promotions.filter(isObj) : [];
    const kinds = [...new Set(versions.map((v) => v.model).filter((k) => k !== null && k !== undefined))];
    return el("div", {class: "model", "data-testid": "model", "data-dir": model.dir},
      el("div", {class: "model-head"}, el("span", {class: "path"}, str(model.dir)),
         kinds.length === 1 ? el("span", {class: "chip", title: "the model kind of every version"}, String(kinds[0]))
           : null,
         el("span", {class: "muted"}, "serving "), el("span", {class: "badge current"}, str(model.current))),
      el("div", {class: "model-cols"},
        el("div", {}, el("h3", {}, versionsHead(versions.length, model.versions_total)),
           versionsTable(versions, kinds.length > 1)),
        el("div", {},
          el("h3", {}, "Retrain decisions"), eventList(decisions.slice(0, 10), decisionItem, "No retrain decision yet."),
          el("h3", {}, "Promotions"), eventList(promotions.slice(0, 10), promotionItem, "No promotion recorded."))));
  }

  // "Versions (12)", or "Versions (the newest 50 of 210)": /v1/models lists the newest 50 (it said 50 of 210).
  function versionsHead(shown, total) {
    return isNum(total) && total > shown ? `Versions (the newest ${fmtInt(shown)} of ${fmtInt(total)})`
      : `Versions (${shown})`;
  }

  // Manifest metric names as column heads (the metrics are the test set's).
  const METRIC_HEADS = {auc: "AUC", logloss: "Logloss", calibration: "Calib.", ne: "NE"};

  // Narrow enough for a laptop beside the decisions: the job as a short link (full id in its
  // title), a compact creation time, the model kind only when the versions differ in it.
  function versionsTable(versions, showModel) {
    if (!versions.length) return el("p", {class: "empty"}, "No versions.");
    // AUC and logloss first, then other metrics some version has a number for (at most four columns)
    const keys = ["auc", "logloss"];
    for (const v of versions) {
      if (!isObj(v.metrics)) continue;
      for (const [k, x] of Object.entries(v.metrics)) {
        if (!keys.includes(k) && keys.length < 4 && isNum(x) && !/rows$/.test(k)) keys.push(k);
      }
    }
    return el("div", {class: "table-wrap"}, el("table", {class: "table compact", "data-testid": "model-versions"},
      el("thead", {}, el("tr", {}, el("th", {}, "Version"), el("th", {}, "Job"), el("th", {}, "Created"),
         showModel ? el("th", {}, "Model") : null,
         keys.map((k) => el("th", {class: "num", title: `${k} on the version's test data`}, METRIC_HEADS[k] || k)),
         el("th", {class: "num", title: "rows trained"}, "Rows"))),
      el("tbody", {}, versions.slice(0, 50).map((v) => el("tr", {"data-version": v.version},
        el("td", {class: "mono"}, str(v.version), v.current ? el("span", {class: "badge current small"}, "current")
          : null),
        jobCell(v.job),
        el("td", {title: fmtTimeTitle(v.created)}, fmtShortTime(v.created)),
        showModel ? el("td", {}, str(v.model)) : null,
        keys.map((k) => el("td", {class: "num"}, isObj(v.metrics) ? metricText(v.metrics[k]) : DASH)),
        el("td", {class: "num", title: isNum(v.rows) ? fmtInt(v.rows) : null}, fmtCompact(v.rows)))))));
  }

  // A job id in a narrow cell: the coordinator's "j20250312-101500-4f9c2a" as "…4f9c2a" (its
  // time is in the Created column), a link that selects the job; the full id in the title.
  function jobCell(id) {
    if (id === null || id === undefined || id === "") return el("td", {}, DASH);
    const full = String(id);
    const tail = /-([0-9a-f]{4,12})$/i.exec(full);
    const short = tail ? `…${tail[1]}` : full.length > 14 ? `${full.slice(0, 6)}…${full.slice(-6)}` : full;
    const known = state.jobs.some((j) => String(j.id) === full);
    return el("td", {class: "mono", title: full, "data-testid": "version-job", "data-job": full},
      known ? el("a", {href: `#job=${encodeURIComponent(full)}`, onclick: showJobDetail}, short) : short);
  }

  function showJobDetail() {  // after the link's hash change has selected the job
    requestAnimationFrame(() => $("job-detail").scrollIntoView({behavior: "smooth", block: "start"}));
  }

  // Today "13:18", this year "12 Mar 13:18", before "12 Mar 2024".
  function fmtShortTime(t) {
    const unix = toUnix(t);
    if (!isNum(unix) || unix <= 0) return DASH;
    const d = new Date(unix * 1000);
    const now = new Date();
    const hm = d.toLocaleTimeString("en-GB", {hour: "2-digit", minute: "2-digit", hour12: false});
    if (d.toDateString() === now.toDateString()) return hm;
    const day = d.toLocaleDateString("en-GB", {day: "numeric", month: "short"});
    return d.getFullYear() === now.getFullYear() ? `${day} ${hm}` : `${day} ${d.getFullYear()}`;
  }

  function metricText(x) {
    return isNum(x) ? (Number.isInteger(x) ? fmtInt(x) : x.toFixed(4)) : fmtValue(x);
  }

  function eventList(items, render, empty) {
    if (!items.length) return el("p", {class: "empty"}, empty);
    return el("ul", {class: "events"}, items.map(render));
  }

  function decisionItem(d) {
    // a line of decisions.jsonl as serving/retrain.py writes it: new_version, served_version,
    // metrics.new and metrics.served (a "failed" line has no metrics)
    const verdict = str(d.verdict);
    const metrics = isObj(d.metrics) ? d.metrics : {};
    const cm = isObj(metrics.new) ? metrics.new : {};
    const sm = isObj(metrics.served) ? metrics.served : {};
    return el("li", {"data-testid": "decision"},
      el("span", {class: "when"}, fmtTime(d.time)),
      el("span", {class: `badge ${verdict.toLowerCase().replace(/[^a-z]/g, "")}`}, verdict), " ",
      d.new_version == null && d.served_version != null  // "skipped": nothing trained
        ? el("span", {class: "mono"}, str(d.served_version))
        : [el("span", {class: "mono"}, str(d.new_version)), " vs ", el("span", {class: "mono"}, str(d.served_version))],
      isNum(cm.auc) || isNum(sm.auc) ? el("span", {class: "muted"}, ` · AUC ${fmtFixed(cm.auc, 4)} vs ${fmtFixed(sm.auc, 4)}`)
        : null,
      d.reason ? el("div", {class: "muted"}, String(d.reason)) : null);
  }

  function promotionItem(p) {
    return el("li", {"data-testid": "promotion"},
      el("span", {class: "when"}, fmtTime(p.time)),
      el("span", {class: "mono"}, str(p.previous)), " → ", el("span", {class: "mono"}, str(p.version)),
      p.reason ? el("span", {class: "muted"}, ` · ${p.reason}`) : null);
  }

  // ---- start ------------------------------------------------------------------------------------

  $("job-follow").addEventListener("click", unpin);
  window.addEventListener("hashchange", () => {
    state.pinned = jobFromHash();
    render();
  });
  window.addEventListener("resize", () => render());
  poll();
})();
