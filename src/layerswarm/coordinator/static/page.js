// The swarm page: renders the coordinator's /v1/events snapshots. Plain DOM, no dependencies.
// Everything from the swarm is inserted with textContent (node reasons come from peers).
"use strict";

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)} %`);
const ms = (x) => (x === null || x === undefined ? "–" : `${x < 10 ? x.toFixed(2) : x.toFixed(1)} ms`);
const short = (id) => (id ? id.replace(/^mdl-/, "").slice(-8) : "–");

function renderHeader(snap) {
  const s = snap.swarm;
  $("model").textContent = `${s.model_name} · ${s.variant} · family ${short(s.family_id)}`;
  const ready = $("ready");
  ready.textContent = s.ready ? "ready" : "not ready";
  ready.className = `pill ${s.ready ? "good" : "bad"}`;
  $("reason").textContent = s.reason;
  const insecure = $("insecure");  // served beyond loopback without a token or TLS (--insecure)
  insecure.hidden = !s.insecure;
  insecure.textContent = s.insecure || "";
  $("depth").textContent = `${s.reachable_depth} / ${s.depth}`;
  $("inflight").textContent = s.in_flight;
  renderTopology(snap.topology);
  const st = snap.stats;
  $("rate").textContent = st.requests_per_s.toFixed(2);
  $("errors").textContent = st.error_rate === null ? st.errors : `${st.errors} (${pct(st.error_rate)})`;
  $("accuracy").textContent = st.accuracy === null ? "–" : `${pct(st.accuracy)} of ${st.labelled}`;
  // blocks run per answered request, of the model's depth, and how many the exit rule stopped early
  $("blocks-used").textContent = st.mean_blocks === null
    ? "–"
    : `${st.mean_blocks.toFixed(2)} of ${s.depth} · ${st.exited_early} exited early`;
}

// star or relay (and under auto each one's measured time per hop); a decoder family has none.
function renderTopology(t) {
  const card = $("topology-card");
  card.hidden = !t;
  if (!t) return;
  const m = t.measured;
  const perHop = m
    ? ` · star ${ms(m.star.ms_per_hop)}/hop, relay ${ms(m.relay.ms_per_hop)}/hop`
    : "";
  $("topology").textContent = t.setting;
  $("topology").title = `${t.why}${perHop}`;
}

function renderBlocks(snap) {
  const byBlock = new Map();
  for (let b = 0; b < snap.swarm.depth; b++) byBlock.set(b, []);
  for (const n of snap.nodes) if (byBlock.has(n.block)) byBlock.get(n.block).push(n);
  const row = $("blocks");
  row.replaceChildren();
  for (const [b, nodes] of byBlock) {
    const healthy = nodes.filter((n) => n.state === "healthy").length;
    const cell = el("div", `block${healthy ? "" : " empty"}`);
    cell.dataset.block = b;
    cell.append(el("div", "idx", `block ${b}`), el("div", "muted", `${healthy} of ${nodes.length} up`));
    const dots = el("div", "dots");
    for (const n of nodes) {
      const dot = el("span", `dot ${n.state}`);
      dot.title = `${n.address} ${n.state}`;
      dots.append(dot);
    }
    cell.append(dots);
    row.append(cell);
  }
}

function linkBar(quality) {
  const wrap = el("span", "");
  if (quality === null) return el("span", "muted", "–");
  const bar = el("span", `bar${quality < 0.9 ? (quality < 0.5 ? " poor" : " low") : ""}`);
  const fill = el("span");
  fill.style.width = `${Math.round(quality * 100)}%`;
  bar.append(fill);
  wrap.append(bar, document.createTextNode(` ${pct(quality)}`));
  return wrap;
}

// The reason for the node's state, and whether its address was caught lying: a conviction outlives
// the node's restarts (a new boot id), so an operator sees why a node that looks fine stays out.
function whyText(n) {
  if (!n.convictions) return n.reason;
  const until = n.barred_until ? `, barred until ${new Date(n.barred_until * 1000).toLocaleTimeString()}` : "";
  const caught = `convicted ${n.convictions}×${until}`;
  return n.reason ? `${n.reason} (${caught})` : caught;
}

function renderNodes(snap) {
  const body = $("nodes").tBodies[0];
  body.replaceChildren();
  const states = {};
  for (const n of snap.nodes) {
    states[n.state] = (states[n.state] || 0) + 1;
    const tr = el("tr", n.state);
    tr.dataset.address = n.address;
    tr.dataset.state = n.state;
    const state = el("span", "state");
    state.append(el("span", `dot ${n.state}`), document.createTextNode(n.state));
    const stateCell = el("td");
    stateCell.append(state);
    stateCell.title = `for ${n.state_for_s} s`;
    const why = el("td", "why", whyText(n));
    why.title = whyText(n);  // the full reason; the cell shows one line
    const link = el("td");
    link.append(linkBar(n.link_quality));
    tr.append(
      stateCell,
      why,
      el("td", "", n.address),
      el("td", "", short(n.model_id)),
      el("td", "", n.block === null ? "–" : n.block),
      el("td", "", n.device || "–"),
      el("td", "num", ms(n.ewma_latency_ms)),
      el("td", "num", n.in_flight),
      link,
      el("td", "num", `${n.served} / ${n.failed}`),
    );
    body.append(tr);
  }
  $("node-count").textContent = Object.entries(states).map(([k, v]) => `${v} ${k}`).join(" · ");
}

function renderRoute(req) {
  const li = el("li", req.status >= 400 ? "failed" : "");
  li.dataset.seq = req.seq;
  const when = new Date(req.at * 1000).toLocaleTimeString();
  const via = req.topology ? ` · ${req.topology}` : "";
  li.append(el("span", "meta", `${when} · ${req.api}${req.batch > 1 ? ` · ×${req.batch}` : ""}${via}`));
  const path = el("span", "path");
  if (req.status >= 400) {
    path.textContent = `${req.status} ${req.error}`;
  }
  req.route.forEach((hop, i) => {
    if (i > 0) path.append(el("span", "arrow", "→"));
    const text = hop.block === null ? hop.planned_block : hop.block;
    const chip = el("span", `hop ${hop.outcome}`, text);
    chip.title = hop.block === null
      ? `planned block ${hop.planned_block} skipped`
      : `block ${hop.block} @ ${hop.node} [${short(hop.model_id)}] ${hop.outcome}, ${ms(hop.latency_ms)}`
        + (hop.outcome === "substituted" ? ` (planned block ${hop.planned_block})` : "");
    path.append(chip);
  });
  if (req.exited_early) path.append(el("span", "arrow", "→"), el("span", "hop exit", "exit"));
  li.append(path);
  const result = el("span", "result");
  if (req.status < 400) {
    const shown = req.predictions.slice(0, 2).join(", ") + (req.predictions.length > 2 ? ", …" : "");
    const blocks = `${req.depth} block${req.depth === 1 ? "" : "s"}${req.exited_early ? " (exit)" : ""}`;
    result.append(document.createTextNode(`${shown} · ${blocks} · ${ms(req.elapsed_ms)} `));
    if (req.labelled) {
      const right = req.correct === req.labelled;
      result.append(el("span", right ? "right" : "wrong", `${req.correct}/${req.labelled} ${right ? "✓" : "✗"}`));
    }
  }
  li.append(result);
  return li;
}

function renderRoutes(snap) {
  const list = $("routes");
  list.replaceChildren(...snap.requests.map(renderRoute));
  if (!snap.requests.length) list.append(el("li", "muted", "no requests yet"));
}

function renderStream(stream, live) {
  const li = el("li", stream.error ? "failed" : "");
  const state = live ? "live" : (stream.finish_reason || (stream.error ? "failed" : "abandoned"));
  li.append(el("span", "meta", `${state} · ${stream.id}`));
  const path = el("span", "path");
  stream.route.forEach((slot, i) => {
    if (i > 0) path.append(el("span", "arrow", "→"));
    const chip = el("span", `hop ${slot.state}`, slot.block);
    chip.title = slot.state === "skipped"
      ? `block ${slot.block} skipped for the rest of the stream`
      : `block ${slot.block} @ ${slot.node} [${short(slot.model_id)}]`
        + (slot.rebuilds ? ` rebuilt ${slot.rebuilds}×` : "");
    path.append(chip);
  });
  if (stream.error) path.append(el("span", "arrow", ` ${stream.error}`));
  li.append(path);
  const rate = stream.tokens_per_s === null ? "–" : `${stream.tokens_per_s.toFixed(1)} tok/s`;
  const failovers = `rebuilt ${stream.rebuilt} · skipped ${stream.skipped}`;
  li.append(el("span", "result", `${stream.tokens} tok · ${rate} · ${failovers}${speculation(stream)}${earlyExit(stream)}`));
  return li;
}

function speculation(stream) {
  // Drafted here, verified by the route: what was kept, and the trips each token cost (plain: 1).
  const spec = stream.speculation;
  if (!spec || spec.mode === "off") return "";
  const kept = spec.acceptance === null ? "–" : `${Math.round(spec.acceptance * 100)}%`;
  const trips = spec.trips_per_token === null ? "–" : spec.trips_per_token.toFixed(2);
  return ` · spec k=${spec.mode}${spec.mode === "auto" && spec.k !== null ? ` (${spec.k})` : ""}`
    + ` kept ${spec.accepted}/${spec.drafted} (${kept}) · ${trips} trips/tok`;
}

function earlyExit(stream) {
  // Confident tokens left the route early: how many, and the blocks each token cost (plain: the depth).
  const ex = stream.early_exit;
  if (!ex || ex.mode === "off") return "";
  const hops = ex.block_hops_per_token === null ? "–" : ex.block_hops_per_token.toFixed(2);
  return ` · exit ≥${ex.mode}: ${ex.exits} early · ${hops} blocks/tok`;
}

function renderStreams(snap) {
  if (!snap.streams) return;  // a classifier family: no streams
  $("streams-section").hidden = false;
  const list = $("streams");
  list.replaceChildren(
    ...snap.streams.live.map((s) => renderStream(s, true)),
    ...snap.streams.recent.map((s) => renderStream(s, false)),
  );
  if (!list.children.length) list.append(el("li", "muted", "no streams yet"));
}

let seq = 0;
function render(snap) {
  renderHeader(snap);
  renderBlocks(snap);
  renderNodes(snap);
  renderRoutes(snap);
  renderStreams(snap);
  seq += 1;
  const updated = $("updated");
  updated.dataset.seq = seq;
  updated.textContent = `updated ${new Date(snap.time * 1000).toLocaleTimeString()}`;
}

function connect() {
  const source = new EventSource("/v1/events");
  source.addEventListener("swarm", (event) => {
    const live = $("live");
    live.textContent = "live";
    live.className = "pill good";
    render(JSON.parse(event.data));
  });
  source.onerror = () => {  // EventSource reconnects by itself (retry: 2000)
    const live = $("live");
    live.textContent = "reconnecting";
    live.className = "pill bad";
  };
}

connect();
