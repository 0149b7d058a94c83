// openclaw-pipeline dashboard: overview and versions (live over server-sent events), conversation browser.
// Every value from the server is put into the page with textContent, never parsed as HTML.
"use strict";

const S = { key: sessionStorage.getItem("pipelineDashboardKey") || "", cfg: null, overview: null,
  charts: {}, built: false, lastRefresh: 0, refreshTimer: null };

// ---------------------------------------------------------------- helpers
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "onclick" || k === "oninput" || k === "onsubmit") el[k] = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.appendChild(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}
const $ = (id) => document.getElementById(id);
function setText(id, v) { const el = $(id); if (el) el.textContent = v; }
function num(x, d = 2) {
  if (x === null || x === undefined || Number.isNaN(x)) return "n/a";  // a figure without data: never 0
  if (Number.isInteger(x)) return String(x);
  if (x !== 0 && Math.abs(x) < 10 ** -d) return x.toExponential(1);  // e.g. a log-prob mismatch of 2e-6 nats
  return Math.abs(x) >= 100 ? x.toFixed(0) : x.toFixed(d);
}
function pct(a, b) { return b ? `${(100 * a / b).toFixed(0)}%` : "n/a"; }
function when(ms) { return ms ? new Date(ms).toLocaleTimeString() : "–"; }
function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }
function headers() { return S.key ? { Authorization: `Bearer ${S.key}` } : {}; }
function status(text) { setText("status", text); }

async function api(path) {
  const r = await fetch(path, { headers: headers() });
  if (r.status === 401) { showAuth("the key was refused"); throw new Error("unauthorized"); }
  if (!r.ok) { const b = await r.json().catch(() => ({})); throw new Error((b.error && b.error.message) || r.statusText); }
  return r.json();
}

function showAuth(message) {
  $("auth").hidden = false;
  setText("auth-error", message || "");
}

// ---------------------------------------------------------------- charts (uPlot)
function chart(id, title, labels, opts) {
  opts = opts || {};
  const box = h("div", { class: "chart", id: `chart-${id}` }, h("h3", {}, title), h("div", { class: "plot" }));
  S.charts[id] = { box, labels, opts, plot: null };
  return box;
}
const COLORS = ["#2f5fd0", "#c62828", "#1a7f37", "#8a6d00", "#7b3fb6"];
function tick(v) {  // axis labels that stay readable for tiny values (KL, mismatch in nats)
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1000) return v.toFixed(0);
  if (a >= 1) return String(+v.toFixed(2));
  if (a >= 0.01) return String(+v.toFixed(3));
  return v.toExponential(0);
}
function clock(sec) {  // time-axis labels with hours and minutes, never bare seconds
  return new Date(sec * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
}
function updateChart(id, data) {
  const c = S.charts[id];
  if (!c) return;
  const target = c.box.querySelector(".plot");
  const width = Math.max(260, (c.box.clientWidth || 300) - 4);
  if (!data[0].length) {
    if (!c.plot) target.textContent = "no data yet";
    return;
  }
  if (!c.plot) {
    target.textContent = "";
    const pad = c.opts.time ? 60 : 1;  // a single point still gets an x range
    c.plot = new uPlot({
      width, height: c.opts.height || 140, legend: { show: c.labels.length > 1, live: false },
      scales: { x: { time: !!c.opts.time, range: (u) => {
        const xs = u.data[0].filter((x) => x !== null), lo = Math.min(...xs), hi = Math.max(...xs);
        return lo === hi ? [lo - pad, hi + pad] : [lo, hi];
      } } },
      axes: [c.opts.time ? { size: 30, values: (u, splits) => splits.map(clock) } : { size: 30, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] },
        { size: 52, values: (u, splits) => splits.map(tick) }],
      series: [{ label: c.opts.time ? "time" : (c.opts.x || "step") },
        ...c.labels.map((l, i) => ({ label: l, stroke: COLORS[i % COLORS.length], width: 1.5,
          points: { show: data[0].length < 60 }, spanGaps: true }))],
    }, data, target);
  } else {
    if (Math.abs(c.plot.width - width) > 8) c.plot.setSize({ width, height: c.opts.height || 140 });
    c.plot.setData(data);
  }
}

// ---------------------------------------------------------------- overview
function card(title, what, body, wide) {
  return h("section", { class: `card${wide ? " wide" : ""}` }, h("h2", {}, title), h("p", { class: "what" }, what), body);
}
function tile(id, label) { return h("div", { class: "tile" }, h("div", { class: "v", id }, "–"), h("div", { class: "l" }, label)); }

function buildOverview() {
  const view = $("view");
  view.textContent = "";
  S.charts = {};
  const grid = h("div", { class: "grid" },
    card("Traffic", "Turns the proxy recorded on the turns topic, sessions, and main turns still waiting for their next state (the user's reply or tool result the judge needs).",
      [h("div", { class: "tiles" }, tile("n-rps", "requests/s (proxy, live)"), tile("n-sessions", "sessions"),
        tile("n-sessions-open", "open"), tile("n-main-turns", "main turns"), tile("n-side-turns", "side turns"),
        tile("n-housekeeping", "agent housekeeping (side, never trained)"),
        tile("n-next-states", "next states"), tile("n-session-ends", "session ends"),
        tile("n-waiting", "waiting for next state"), tile("n-judge-waiting", "judge: sessions waiting")),
       chart("traffic", "turns and samples per second", ["turns/s", "samples/s"], { time: true })], true),
    card("Held-out evaluation", "Success on fixed held-out prompts per policy version (written by pipeline demo), with n.",
      [h("div", { id: "evals" }), chart("evals", "held-out success by policy version", ["success", "accuracy"], { x: "version", height: 120 })]),
    card("Judge votes", "PRM votes on the samples (+1 good, 0 unsure, −1 bad, failed = no valid answer); the majority is the Binary-RL reward. Hint acceptance: OPD hint votes that produced a usable hint.",
      [h("div", { id: "votes" }), h("div", { class: "tiles" }, tile("n-hint-votes", "hint votes accepted"),
        tile("n-hint-samples", "distillation samples with a hint"), tile("n-judge-dropped", "turns dropped by the judge"),
        tile("n-judge-unjudged", "turns ended without a judgement, by reason"),
        tile("n-reward-sources", "rewards by source (judge, feedback, outcome)"),
        tile("n-late-feedback", "feedback and outcomes not used: their turn was already decided, by reason"))]),
    card("Samples", "Scored training samples on the samples topic, by kind; masked samples (loss mask 0) are kept for accounting but not trained.",
      h("div", { class: "tiles" }, tile("n-samples", "samples"), tile("n-kind-rl", "rl"), tile("n-kind-opd", "opd"),
        tile("n-kind-opdrl", "opd+rl"), tile("n-masked-share", "masked share"), tile("n-trained", "trained"),
        tile("n-reward-mean", "reward mean (unmasked)"), tile("n-duplicates", "duplicate deliveries"))),
    card("Trainer health", "Per trainer step, from the metrics topic: loss; KL to the reference (kl) and between old and new policy (ppo_kl); entropy; PPO clip fraction; mean |train − rollout| log-prob of the sampled tokens (nats: mismatch between trainer and inference engine); step and sync time.",
      [h("div", { class: "tiles" }, tile("n-steps", "steps"), tile("n-next-step", "next step needs (samples)"),
        tile("n-version", "policy version"),
        tile("n-last-loss", "last loss"), tile("n-last-mismatch", "last mismatch (nats)")),
       h("div", { class: "charts" }, chart("loss", "loss", ["loss"]), chart("kl", "KL", ["kl", "ppo_kl"]),
         chart("entropy", "entropy (nats/token)", ["entropy"]), chart("clip", "clip fraction", ["pg_clipfrac"]),
         chart("mismatch", "train − rollout |Δ log-prob| (nats)", ["logprob_abs_diff"]),
         chart("reward", "batch reward mean", ["reward_mean"]), chart("steptime", "seconds per step (step; sync; waiting for the batch, consume_s)", ["step_s", "sync_s", "consume_s"]))], true),
    card("Policy versions and weight syncs", "Each sync on the control topic: pause → weights → applied by every engine → resume. Paused = resume − pause; the proxy holds requests meanwhile (hold count and mean from its metrics).",
      [chart("versions", "policy version over time", ["version"], { time: true, height: 110 }),
        h("div", { class: "tiles" }, tile("n-hold-count", "requests held"), tile("n-hold-mean", "mean hold (s)"),
          tile("n-engine-version", "engine serves")),
        h("div", { id: "syncs" })]),
    card("Consumer lag", "Records each consumer group has not committed yet, per topic (the broker's committed offsets against the high watermark).", h("div", { id: "lag" })),
    card("Dead letters", "Records a stage could not decode or process, per dead-letter topic, with the latest errors.", h("div", { id: "dlq" })),
    card("Stages and topics", "Prometheus endpoints scraped, and records read from each topic by this dashboard (assign mode: no consumer group, nothing committed).", h("div", { id: "stages" })),
  );
  view.appendChild(grid);
  S.built = true;
}

function table(headersRow, rows) {
  return h("table", {}, h("tr", {}, headersRow.map((x) => h("th", {}, x))), rows.map((r) => h("tr", {}, r.map((x) => h("td", {}, x)))));
}
function replace(id, node) { const el = $(id); if (el) { el.textContent = ""; el.appendChild(node); } }

// "3 more (13 of 16)": from the trainer's own count when it serves metrics, else from the topics
function nextStep(tr, live) {
  const size = live.trainer_batch_size || tr.batch_size;
  const have = live.trainer_batch_counted !== null && live.trainer_batch_counted !== undefined && live.trainer_batch_size
    ? live.trainer_batch_counted : Math.min(tr.waiting, size);
  return `${num(Math.max(0, size - have))} more (${num(have)} of ${num(size)})`;
}

function renderOverview(o) {
  if (!S.built || !$("n-sessions")) buildOverview();
  const t = o.traffic, live = o.live || {}, j = o.judge, s = o.samples;
  setText("n-rps", num(live.requests_per_s, 2));
  setText("n-sessions", num(t.sessions)); setText("n-sessions-open", num(t.sessions_open));
  setText("n-main-turns", num(t.main_turns)); setText("n-side-turns", num(t.side_turns));
  const hk = t.housekeeping || {};
  setText("n-housekeeping", Object.keys(hk).length ? Object.entries(hk).map(([k, v]) => `${k.split(":").pop()} ${num(v)}`).join(", ") : "0");
  setText("n-next-states", num(t.next_states)); setText("n-session-ends", num(t.session_ends));
  setText("n-waiting", num(t.waiting)); setText("n-judge-waiting", num(live.judge_sessions_waiting));
  const bs = t.bucket_s || 10;
  const tl = new Map(t.turns_timeline.map(([k, v]) => [k, v])), sl = new Map(t.samples_timeline.map(([k, v]) => [k, v]));
  const xs = [...new Set([...tl.keys(), ...sl.keys()])].sort((a, b) => a - b);
  updateChart("traffic", [xs, xs.map((x) => (tl.get(x) || 0) / bs), xs.map((x) => (sl.get(x) || 0) / bs)]);

  const votes = j.prm_votes, vmax = Math.max(1, ...Object.values(votes));
  replace("votes", h("div", {}, [["1", "+1"], ["0", "0"], ["-1", "−1"], ["failed", "failed"]].map(([k, label]) =>
    h("div", { class: "bar" }, h("span", { class: "name" }, label),
      h("span", { class: "fill", style: `width:${Math.round(180 * votes[k] / vmax)}px;background:${k === "1" ? "#1a7f37" : k === "-1" ? "#c62828" : k === "0" ? "#8a6d00" : "#6b7385"}` }),
      h("span", { id: `votes-${k === "-1" ? "m1" : k}` }, num(votes[k]))))));
  const hv = j.hint_votes, hvTotal = hv.accepted + hv.rejected + hv.failed;
  setText("n-hint-votes", hvTotal ? `${hv.accepted}/${hvTotal} (${pct(hv.accepted, hvTotal)})` : "–");
  setText("n-hint-samples", j.hint_samples ? `${j.hint_samples_with_hint}/${j.hint_samples}` : "–");
  for (const [id, key] of [["n-reward-sources", "judge_reward_sources"], ["n-late-feedback", "judge_late_feedback"]]) {
    const m = live[key] || {};
    setText(id, Object.keys(m).length ? Object.entries(m).map(([k, v]) => `${k} ${num(v)}`).join(", ") : "–");
  }
  const dropped = live.judge_dropped || {};
  setText("n-judge-dropped", Object.keys(dropped).length ? Object.entries(dropped).map(([k, v]) => `${k} ${num(v)}`).join(", ") : "–");
  const unjudged = live.judge_unjudged || {};
  setText("n-judge-unjudged", Object.keys(unjudged).length ? Object.entries(unjudged).map(([k, v]) => `${k} ${num(v)}`).join(", ") : "–");

  setText("n-samples", num(s.total)); setText("n-kind-rl", num(s.by_kind.rl || 0));
  setText("n-kind-opd", num(s.by_kind.opd || 0)); setText("n-kind-opdrl", num(s.by_kind["opd+rl"] || 0));
  setText("n-masked-share", s.masked_share === null ? "n/a" : `${(100 * s.masked_share).toFixed(0)}% (${s.masked})`);
  setText("n-trained", num(s.trained)); setText("n-reward-mean", num(s.reward_mean, 3));
  setText("n-duplicates", num(s.duplicates));

  const steps = o.trainer.steps, sx = steps.map((r) => r.step), col = (k) => steps.map((r) => (r[k] === undefined ? null : r[k]));
  setText("n-steps", num(steps.length));
  setText("n-next-step", nextStep(o.trainer, live));
  const last = steps[steps.length - 1];
  setText("n-version", num(last ? last.policy_version : live.trainer_policy_version));
  setText("n-last-loss", num(last && last.loss, 4)); setText("n-last-mismatch", num(last && last.logprob_abs_diff, 4));
  updateChart("loss", [sx, col("loss")]); updateChart("kl", [sx, col("kl"), col("ppo_kl")]);
  updateChart("entropy", [sx, col("entropy")]); updateChart("clip", [sx, col("pg_clipfrac")]);
  updateChart("mismatch", [sx, col("logprob_abs_diff")]); updateChart("reward", [sx, col("reward_mean")]);
  updateChart("steptime", [sx, col("step_s"), col("sync_s"), col("consume_s")]);

  const syncs = o.syncs.filter((x) => x.resume_ms || x.pause_ms);
  const vx = [], vy = [];
  // the policy-version chart follows the full weights; a tenant's adapter sync counts its own updates
  for (const x of syncs) if (x.resume_ms && !x.tenant) { vx.push(x.resume_ms / 1000); vy.push(x.policy_version); }
  updateChart("versions", [vx, vy]);
  setText("n-hold-count", num(live.sync_hold_count));
  setText("n-hold-mean", live.sync_hold_count ? num(live.sync_hold_sum_s / live.sync_hold_count, 3) : "n/a");
  setText("n-engine-version", num(live.engine_weight_version));
  replace("syncs", syncs.length ? table(["version", "paused at", "paused (s)", "applied by", "failed"],
    syncs.slice(-12).reverse().map((x) => [x.tenant ? `${x.tenant}: ${x.adapter || "adapter"} (#${x.policy_version})`
      : num(x.policy_version), when(x.pause_ms), num(x.pause_s, 2),
      Object.keys(x.applied).join(", ") || "–", Object.entries(x.failed).map(([k, v]) => `${k}: ${v}`).join("; ") || "–"]))
    : h("p", { class: "muted" }, "no weight sync yet"));

  replace("lag", o.lag && o.lag.length ? table(["group", "topic", "lag"], o.lag.map((x) => [x.group, x.topic, num(x.lag)]))
    : h("p", { class: "muted" }, "no consumer group has committed offsets on these topics yet"));

  const dq = o.dlq;
  replace("dlq", h("div", {}, table(["topic", "dead letters"], Object.entries(dq.counts).map(([k, v]) => [k, h("span", { id: `dlq-${k}` }, num(v))])),
    dq.latest.length ? table(["at", "stage", "source", "error"], dq.latest.slice(0, 8).map((e) =>
      [when(e.created_at), e.stage || "–", `${e.source_topic || "?"}[${e.partition}]@${e.offset}`, e.error]))
      : h("p", { class: "muted" }, "no dead letters")));

  const ev = o.evaluations;
  replace("evals", ev.length ? table(["version", "n", "success", "accuracy", "words/reply"], ev.map((e) =>
    [num(e.policy_version), num(e.n), num(e.success_rate, 2), num(e.accuracy, 2), num(e.words_per_reply, 1)]))
    : h("p", { class: "muted" }, "no held-out evaluation on the metrics topic (pipeline demo writes them)"));
  updateChart("evals", [ev.map((e) => e.policy_version), ev.map((e) => e.success_rate ?? null), ev.map((e) => e.accuracy ?? null)]);

  const stages = Object.entries(o.stages || {});
  replace("stages", h("div", {},
    stages.length ? table(["stage", "metrics", "endpoint"], stages.map(([k, v]) =>
      [k, h("span", { class: `pill ${v.busy ? "busy" : v.up ? "ok" : "no"}`, title: v.error || "" }, v.busy ? "busy" : v.up ? "up" : "down"), v.url])) : h("p", { class: "muted" }, "no Prometheus endpoint configured (--metrics STAGE=URL)"),
    table(["topic", "records read", "undecodable"], Object.entries(o.topics.records).sort().map(([k, v]) =>
      [k, h("span", { id: `records-${k}` }, num(v)), num(o.topics.undecodable[k] || 0)]))));
}

// ---------------------------------------------------------------- versions (live metrics per version)
// From the overview's `versions` (pipeline/rollout/live.py): per scope (full weights, each tenant) every
// version with its role, its live rates (95% Wilson intervals) and eval-set results, and the decision's
// evidence. Side by side: the candidate and the incumbent, or else the last decided version and the
// incumbent it was compared with.
const RATES = [["reward", "judged reward rate"], ["feedback", "explicit feedback: positive"],
  ["unfinished", "unfinished generations"], ["refusals", "refusals (heuristic)"]];
function fmtRate(r) { return r.n ? `${num(r.rate, 2)} [${num(r.low, 2)}, ${num(r.high, 2)}] n=${r.n}` : "n/a"; }
function intervalBar(lo, hi, x, min = 0, max = 1) {  // a range on [min, max] with its point estimate
  const pos = (v) => `${(100 * (v - min) / (max - min)).toFixed(1)}%`;
  return h("div", { class: "ival" }, h("div", { class: "range", style: `left:${pos(lo)};width:calc(${pos(hi)} - ${pos(lo)})` }),
    x === null || x === undefined ? null : h("div", { class: "point", style: `left:${pos(x)}` }),
    min < 0 ? h("div", { class: "zero", style: `left:${pos(0)}` }) : null);
}
function rateCell(metric, r) {
  return h("div", { class: "rate", dataset: { metric, k: r.k, n: r.n, low: num(r.low, 2), high: num(r.high, 2) } },
    h("span", {}, fmtRate(r)), r.n ? intervalBar(r.low, r.high, r.rate) : null);
}
function evalCells(v) {
  if (!v.evals.length) return h("span", { class: "muted" }, "–");
  return h("div", {}, v.evals.map((e) => h("div", { class: "eval", dataset: { name: e.name } }, h("span", { class: "muted" }, `${e.name}: `),
    e.metrics.map((m) => h("div", { class: "rate", dataset: { metric: `eval:${m.metric}`, n: m.n, low: m.low === null ? "" : num(m.low, 2), high: m.high === null ? "" : num(m.high, 2) } },
      `${m.metric} ${num(m.value, 2)}${m.low === null ? "" : ` [${num(m.low, 2)}, ${num(m.high, 2)}] n=${m.n}`}`,
      m.low === null ? null : intervalBar(m.low, m.high, m.value))))));
}
function roleText(v) { return (v.role || "–") + (v.live ? " (live)" : ""); }
function rolePill(v) {
  const cls = v.role === "incumbent" ? "ok" : v.role === "rolled back" ? "no" : v.role === "candidate" ? "busy" : "";
  return h("span", { class: `pill role ${cls}` }, roleText(v));
}
function decisionBox(d) {
  if (!d) return h("span", { class: "muted" }, "no decision");
  const arms = Object.entries(d.arms || {}).map(([arm, ms]) => h("div", {}, h("span", { class: "muted" }, `${arm}: `),
    Object.entries(ms).map(([m, [k, n]]) => `${m} ${k}/${n}`).join(" · ")));
  return h("div", { class: "decision", dataset: { action: d.action, reason: d.reason || "" } },
    h("div", {}, h("b", {}, d.action), ` · ${d.reason || "?"} · ${d.rule || ""}`),
    Object.entries(d.bounds || {}).map(([m, [lo, hi]]) => h("div", { class: "bound", dataset: { metric: m } },
      `${m}: candidate − incumbent in [${num(lo, 2)}, ${num(hi, 2)}]`, intervalBar(lo, hi, null, -1, 1))), arms);
}
function comparePair(s) {
  const rows = s.versions, by = (label) => rows.find((v) => v.label === label);
  if (s.candidate !== null) return [by(s.incumbent), by(s.candidate), s.incumbent];
  const decided = rows.filter((v) => v.decision).sort((a, b) => (a.decision.created_at || 0) - (b.decision.created_at || 0)).pop();
  if (!decided) return null;
  const was = decided.decision.incumbent;  // the version it was compared with (null: the base model)
  const inc = rows.find((v) => v.version === was && v !== decided);
  return [inc, decided, inc ? inc.label : was === null ? "base" : typeof was === "number" ? `v${was}` : String(was).slice(0, 16)];
}
function compareCard(s) {
  const pair = comparePair(s);
  if (!pair) return null;
  const [inc, cand, incLabel] = pair;
  const side = (name, v) => (v ? h("div", { class: "side", dataset: { side: name, version: v.label, role: v.role } },
    h("h3", {}, h("span", { class: "vlabel" }, v.label), " ", rolePill(v)),
    kv([["turns served", `${num(v.turns)}${v.canary_turns ? ` (${num(v.canary_turns)} in a canary)` : ""}`],
      ...RATES.map(([m, label]) => [label, rateCell(m, v[m])]),
      ["words per reply", num(v.words_per_reply, 1)], ["eval set", evalCells(v)]]))
    : h("div", { class: "side muted", dataset: { side: name } }, `${name === "incumbent" ? incLabel : "?"}: no records of this version yet`));
  return h("div", { class: "compare" }, side("incumbent", inc), side("candidate", cand),
    h("div", { class: "side evidence" }, h("h3", {}, "decision"), decisionBox(cand && cand.decision)));
}
function renderVersions(o) {
  S.charts = {}; S.built = false;
  const view = $("view");
  view.textContent = "";
  const scopes = (o && o.versions) || [];
  if (!scopes.length || scopes.every((s) => !s.versions.length)) {
    view.appendChild(card("Versions", "no version has served a turn or been named on the control topic yet", h("div"), true));
    return;
  }
  for (const s of scopes) {
    if (!s.versions.length) continue;
    const title = s.scope === null ? "Full weights" : `Tenant ${s.scope}`;
    const what = `incumbent ${s.incumbent}${s.candidate !== null ? ` · candidate ${s.candidate} (${s.live ? "live" : "loading"})` : ""} · rates with 95% Wilson intervals; refusals are a heuristic on the reply's first words`;
    view.appendChild(h("section", { class: "card wide versions", dataset: { scope: s.scope === null ? "" : s.scope } },
      h("h2", {}, title), h("p", { class: "what" }, what), compareCard(s),
      table(["version", "role", "turns", "judged reward", "feedback", "unfinished", "refusals", "words/reply", "eval", "decision"],
        s.versions.map((v) => [h("span", { class: "vlabel" }, v.label), rolePill(v), num(v.turns), rateCell("reward", v.reward),
          rateCell("feedback", v.feedback), rateCell("unfinished", v.unfinished), rateCell("refusals", v.refusals),
          num(v.words_per_reply, 1), evalCells(v),
          v.decision ? `${v.decision.action} ${v.decision.reason || ""}` : "–"]))));
  }
}

// ---------------------------------------------------------------- sessions
async function renderSessions(query) {
  S.charts = {}; S.built = false;
  const view = $("view");
  let input = $("session-search");
  if (!input) {
    view.textContent = "";
    input = h("input", { type: "search", id: "session-search", placeholder: "search by session id", value: query || "" });
    input.oninput = () => { history.replaceState(null, "", `#/sessions?q=${encodeURIComponent(input.value)}`); refreshSessions(); };
    view.appendChild(card("Sessions", "Most recently active first; open one to see each turn, what the judge said about it and what the trainer did with it.",
      [input, h("div", { id: "session-list" })], true));
  }
  await refreshSessions();
}
async function refreshSessions() {
  const input = $("session-search");
  if (!input) return;
  const data = await api(`/api/sessions?limit=200&q=${encodeURIComponent(input.value)}`);
  replace("session-list", data.sessions.length ? table(["session", "main turns", "side turns", "samples", "trained", "rewards", "last activity", "state"],
    data.sessions.map((x) => [h("a", { href: `#/session/${encodeURIComponent(x.session_id)}${x.tenant === null ? "" : `?tenant=${encodeURIComponent(x.tenant)}`}`, class: "session-link" }, x.tenant === null ? x.session_id : `${x.tenant} · ${x.session_id}`),
      num(x.turns), num(x.side_turns), num(x.samples), num(x.trained), x.rewards.map((r) => num(r, 0)).join(" ") || "–",
      when(x.last_ms), x.ended ? "ended" : "open"]))
    : h("p", { class: "muted" }, `no session${input.value ? " matches" : " yet"} (${data.total} read)`));
}

function voteBadges(votes) {
  return votes.map((v) => h("span", { class: "vote", dataset: { vote: v === null ? "failed" : String(v) } },
    v === null ? "✗" : v > 0 ? "+1" : String(v)));
}
function messages(list, showText) {
  if (!list || !list.length) return h("span", { class: "muted" }, "none");
  const asText = (x) => (typeof x === "string" ? x
    : Array.isArray(x) && x.every((p) => p && typeof p.text === "string") ? x.map((p) => p.text).join("\n")
      : JSON.stringify(x, null, 1));
  return h("div", {}, list.map((m) => showText && m.content !== undefined
    ? h("div", {}, h("span", { class: "pill" }, m.role), " ", h("div", { class: "text" }, asText(m.content ?? "")),
      m.tool_calls_full ? h("div", { class: "text" }, asText(m.tool_calls_full)) : null)
    : h("div", {}, h("span", { class: "pill" }, m.role), ` ${m.chars} chars`, m.tool_calls ? ` · tool calls: ${m.tool_calls.join(", ")}` : "")));
}
function kv(pairs) { return h("div", { class: "kv" }, pairs.map(([k, v]) => [h("div", { class: "k" }, k), h("div", {}, v)])); }

async function renderSession(id, tenant, live = false) {
  S.charts = {}; S.built = false;
  const of = tenant === null ? "" : `?tenant=${encodeURIComponent(tenant)}`;
  const data = await api(`/api/sessions/${encodeURIComponent(id)}${of}`).catch((e) => ({ error: e.message }));
  if (live && reviewing()) return;  // a reviewer started typing while it loaded: keep the page as it is
  const view = $("view");
  view.textContent = "";
  if (data.error) { view.appendChild(card(`Session ${id}`, data.error, h("a", { href: "#/sessions" }, "back to sessions"), true)); return; }
  const showText = data.show_text;
  const head = card(`Session ${data.tenant === null ? "" : `${data.tenant} · `}${data.session_id}`, `first ${when(data.first_ms)} · last ${when(data.last_ms)} · ${data.end ? `ended (${data.end.reason})` : "open"} · conversation text ${showText ? "shown" : "hidden (start the dashboard with --show-text to see it)"}`,
    h("a", { href: "#/sessions" }, "← all sessions"), true);
  view.appendChild(head);
  for (const t of data.turns) {
    const resp = t.response;
    const rows = [
      ["request", [h("div", {}, `${t.messages.length} messages · ${t.prompt_tokens} prompt tokens · ${t.tools} tools`), messages(t.messages, showText)]],
      ["response", showText && resp.content !== undefined
        ? h("div", {}, resp.reasoning_content ? h("div", { class: "text muted" }, resp.reasoning_content) : null,
          h("div", { class: "text" }, resp.content || ""),
          resp.tool_calls_full ? h("div", { class: "text" }, JSON.stringify(resp.tool_calls_full, null, 1)) : null)
        : `${resp.chars} chars · ${t.response_tokens} tokens${resp.tool_calls.length ? ` · tool calls: ${resp.tool_calls.join(", ")}` : ""}`],
      ["finish reason", t.finish_reason || "–"],
      ["policy version", num(t.policy_version)],
    ];
    if (data.tenant !== null) rows.push(["adapter", t.adapter ? t.adapter.name : "none (base model)"]);
    if (t.turn_type === "main") {
      if (t.feedback && t.feedback.length) rows.push(["feedback", h("div", {}, ...t.feedback.map((f) => h("div", { class: "feedback" },
        `${num(f.score, 2)} from ${f.source}${f.comment !== undefined && f.comment !== null ? ` · “${f.comment}”` : f.comment_chars ? ` · comment ${f.comment_chars} chars` : ""}`)))]);
      if (S.cfg && S.cfg.review) rows.push(["review", reviewForm(data, t)]);
      rows.push(["next state", t.next_states.length ? t.next_states.map((n) => messages(n.messages, showText)) : h("span", { class: "muted" }, data.end ? "none (session ended)" : "waiting")]);
      for (const s of t.samples) {
        rows.push([`sample ${s.kind}`, h("div", { class: "sample", dataset: { sampleId: s.sample_id, votes: s.prm_votes.map((v) => (v === null ? "failed" : v)).join(","), majority: s.majority ?? "", reward: s.reward ?? "", trainedStep: s.trained_step ?? "" } },
          kv([["PRM votes", s.prm_votes.length ? voteBadges(s.prm_votes) : h("span", { class: "muted" }, "none")],
            ["majority", s.majority === null ? "n/a" : num(s.majority)],
            ["hint", s.has_hint ? (showText && s.hint !== undefined ? h("div", { class: "text" }, s.hint) : `${s.hint_chars} chars`) : "none"],
            ["hint votes", s.hint_votes.length ? voteBadges(s.hint_votes) : "–"],
            ["reward", num(s.reward, 2)],
            ["reward source", s.reward_source ? `${s.reward_source} (${s.reward_rule})${s.feedback_score !== null && s.feedback_score !== undefined ? ` · feedback ${num(s.feedback_score, 2)}` : ""}${s.outcome_reward !== null && s.outcome_reward !== undefined ? ` · outcome ${num(s.outcome_reward, 2)}` : ""}` : "–"],
            ["hint source", s.hint_source || "–"],
            ["loss mask", num(s.loss_mask)],
            ["mean advantage", s.mean_advantage === null ? "n/a" : num(s.mean_advantage, 4)],
            ["trained", s.trained ? h("span", { class: "pill ok" }, `step ${s.trained_step} → policy version ${s.trained_into_version}`)
              : h("span", { class: "pill no" }, s.loss_mask ? "not yet" : "no (masked)")],
            ["sample id", s.sample_id]]))]);
      }
      if (!t.samples.length) rows.push(["sample", h("span", { class: "muted" }, "none yet")]);
    }
    view.appendChild(h("section", { class: "card turn", dataset: { turnIndex: t.turn_index ?? "" } },
      h("div", { class: "head" }, h("b", {}, t.turn_type === "main" ? `Turn ${t.turn_index}` : "Side turn"),
        h("span", { class: "muted" }, `${when(t.created_at)} · request ${t.request_id || "–"} · ${t.model || ""}`)),
      kv(rows)));
  }
}

// A review form in use (focused, or holding a typed correction or key): the live refresh waits for it.
function reviewing() {
  return S.reviewsInFlight > 0 ||
    [...document.querySelectorAll(".review input")].some((el) => el === document.activeElement || el.value);
}

// A reviewer's thumb on a turn (dashboard.review): posted to /api/feedback, which forwards it to the
// proxy's POST /v1/feedback with the key typed here (the tenant's; default: the dashboard's key).
function reviewForm(data, t) {
  const note = h("input", { type: "text", class: "review-comment", placeholder: "correction (optional)", maxlength: "8000" });
  const key = h("input", { type: "password", class: "review-key", placeholder: "proxy key (default: this page's)" });
  const result = h("span", { class: "review-result muted" });
  const send = async (score) => {
    const hdrs = { "Content-Type": "application/json" };
    const k = key.value.trim() || S.key;
    if (k) hdrs.Authorization = `Bearer ${k}`;
    if (data.tenant !== null) hdrs["X-Tenant-Id"] = data.tenant;
    const body = { session_id: data.session_id, turn_index: t.turn_index, score };
    if (note.value.trim()) body.comment = note.value.trim();
    S.reviewsInFlight = (S.reviewsInFlight || 0) + 1;
    let r, j;
    try {
      r = await fetch("/api/feedback", { method: "POST", headers: hdrs, body: JSON.stringify(body) });
      j = await r.json().catch(() => ({}));
    } catch (e) {
      result.textContent = `not sent: ${e.message}`;
      return;
    } finally { S.reviewsInFlight -= 1; }
    result.textContent = r.ok ? `sent: ${num(j.score, 0)} (${j.id})` : `refused (${r.status}): ${(j.error && j.error.message) || ""}`;
    if (r.ok) { note.value = ""; key.value = ""; }  // the live refresh then shows it among the turn's feedback
  };
  return h("div", { class: "review", dataset: { turnIndex: t.turn_index } },
    h("button", { type: "button", class: "thumb-up", onclick: () => send(1) }, "👍"),
    h("button", { type: "button", class: "thumb-down", onclick: () => send(-1) }, "👎"), note, key, result);
}

// ---------------------------------------------------------------- routing and live updates
function showSessionOf(hash, live = false) {  // "#/session/<id>?tenant=<t>": the session page of (tenant, id)
  const [path, query] = hash.slice("#/session/".length).split("?");
  return renderSession(decodeURIComponent(path), new URLSearchParams(query || "").get("tenant"), live);
}

function route() {
  const hash = location.hash || "#/";
  $("nav-overview").classList.toggle("active", hash === "#/" || hash === "");
  $("nav-sessions").classList.toggle("active", hash.startsWith("#/session"));
  $("nav-versions").classList.toggle("active", hash.startsWith("#/versions"));
  if (hash.startsWith("#/versions")) return renderVersions(S.overview);
  if (hash.startsWith("#/session/")) return showSessionOf(hash);
  if (hash.startsWith("#/sessions")) {
    const q = new URLSearchParams(hash.split("?")[1] || "").get("q") || "";
    return renderSessions(q);
  }
  S.built = false;
  buildOverview();
  if (S.overview) renderOverview(S.overview);
}

function onOverview(o) {
  S.overview = o;
  const hash = location.hash || "#/";
  const r = o.reader || {};
  status(`live · ${r.error ? `reader: ${r.error}` : r.caught_up ? "topics caught up" : "reading topics…"} · text ${o.show_text ? "shown" : "hidden"} · ${new Date().toLocaleTimeString()}`);
  if (hash === "#/" || hash === "") renderOverview(o);
  else if (hash.startsWith("#/versions")) renderVersions(o);  // live, like the overview
  else if (Date.now() - S.lastRefresh > 2000) {  // browser pages refresh on change, at most every 2 s
    S.lastRefresh = Date.now();
    if (hash.startsWith("#/session/")) { if (!reviewing()) showSessionOf(hash, true); }  // keeps the tenant; never under a reviewer's typing
    else refreshSessions().catch(() => {});
  }
}

async function stream() {
  for (;;) {
    try {
      const r = await fetch("/api/stream", { headers: headers() });
      if (r.status === 401) { showAuth("the key was refused"); return; }
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const chunk = buf.slice(0, i); buf = buf.slice(i + 2);
          let ev = "message", data = "";
          for (const line of chunk.split("\n")) {
            if (line.startsWith("event:")) ev = line.slice(6).trim();
            else if (line.startsWith("data:")) data += line.slice(5).trim();
          }
          if (ev === "overview" && data) onOverview(JSON.parse(data));
        }
      }
    } catch (e) { /* reconnect below */ }
    status("reconnecting…");
    await sleep(2000);
  }
}

async function main() {
  S.cfg = await (await fetch("/api/config")).json();
  $("auth-form").onsubmit = (e) => {
    e.preventDefault();
    S.key = $("auth-key").value.trim();
    sessionStorage.setItem("pipelineDashboardKey", S.key);
    $("auth").hidden = true;
    route(); stream();
  };
  window.addEventListener("hashchange", route);
  if (S.cfg.auth && !S.key) { showAuth(""); return; }
  route();
  stream();
}
main();
