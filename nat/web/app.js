// The live page: reads /api/status every few seconds and draws it (no library, nothing fetched elsewhere).
"use strict";
const REFRESH_MS = 3000;
const COLORS = ["#3a7bd5", "#d5933a", "#888", "#2e9e5b"];

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = String(text);
  return e;
}
function short(id) { return id.length > 16 ? id.slice(0, 8) + "…" + id.slice(-6) : id; }
function num(x, digits) {
  if (x === null || x === undefined) return "–";
  return typeof x === "number" ? x.toLocaleString("en-US", { maximumFractionDigits: digits ?? 2 }) : String(x);
}
// a count as a person reads it: bytes in MiB/GiB, anything else as a plain number
function amount(x, unit) { return unit === "bytes" ? mib(x) : num(x, 0); }
function mib(bytes) {
  if (bytes >= 1 << 30) return num(bytes / (1 << 30), 2) + " GiB";
  return num(bytes / (1 << 20), 1) + " MiB";
}
function facts(target, pairs) {
  const box = document.getElementById(target);
  box.replaceChildren(...pairs.map(([k, v, key]) => {
    const s = el("span");
    s.append(k + ": ");
    s.append(el("b", key ? { "data-key": key } : {}, v));
    return s;
  }));
}
function fillTable(id, rows) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows.map((cells) => {
    const tr = el("tr");
    for (const c of cells) tr.append(c instanceof Node ? c : el("td", {}, c));
    return tr;
  }));
}
function idCell(id) { return el("td", { class: "id", title: id, "data-peer": id }, short(id)); }

// A line chart of several series [{points: [[x, y]...], color}] into an <svg>.
// fit: the y axis spans the data (a loss falling from 4.3 to 3.7 fills the chart); else it starts at 0
function chart(svgId, series, xLabel, fit) {
  const svg = document.getElementById(svgId);
  const W = 600, H = 220, L = 48, B = 24, T = 8, R = 8;
  const all = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[1]));
  svg.replaceChildren();
  if (all.length === 0) { svg.append(svgText(L, H / 2, "no data yet")); return; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (fit) { const pad = 0.05 * (y1 - y0); y0 -= pad; y1 += pad; } else { y0 = Math.min(0, y0); }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const py = (y) => H - B - (y - y0) / (y1 - y0) * (H - B - T);
  const ns = "http://www.w3.org/2000/svg";
  const line = (a, b, c, d) => { const l = document.createElementNS(ns, "line");
    l.setAttribute("x1", a); l.setAttribute("y1", b); l.setAttribute("x2", c); l.setAttribute("y2", d);
    l.setAttribute("class", "axis"); return l; };
  svg.append(line(L, H - B, W - R, H - B), line(L, T, L, H - B));
  svg.append(svgText(2, py(y1) + 10, num(y1, 3)), svgText(2, H - B, num(y0, 3)));
  svg.append(svgText(L, H - 6, xLabel + " " + num(x0, 1)), svgText(W - 90, H - 6, num(x1, 1)));
  for (const s of series) {
    const pts = s.points.filter((p) => Number.isFinite(p[1]));
    if (!pts.length) continue;
    const p = document.createElementNS(ns, "polyline");
    p.setAttribute("points", pts.map((q) => px(q[0]).toFixed(1) + "," + py(q[1]).toFixed(1)).join(" "));
    p.setAttribute("fill", "none"); p.setAttribute("stroke", s.color); p.setAttribute("stroke-width", "2");
    svg.append(p);
  }
}
function svgText(x, y, text) {
  const t = document.createElementNS("http://www.w3.org/2000/svg", "text");
  t.setAttribute("x", x); t.setAttribute("y", y); t.textContent = text; return t;
}
function bar(used, limit) {
  const td = el("td");
  if (!limit) return td;
  const frac = Math.min(1, used / limit);
  const b = el("div", { class: "bar" + (frac > 0.8 ? " hot" : "") });
  b.append(el("div", { style: "width:" + (100 * frac).toFixed(1) + "%" }));
  td.append(b);
  return td;
}

function draw(s) {
  const n = s.node;
  document.getElementById("role").textContent = n.role;
  facts("node", [["peer", short(n.peer_id), "peer_id"], ["reachability", n.reachability, "reachability"],
    ["NAT mode", n.mode], ["mapping", n.mapping], ["up", num(n.uptime_s / 60, 1) + " min"],
    ["addresses", n.addrs.length]]);
  document.getElementById("node").dataset.peerId = n.peer_id;
  document.getElementById("peer-count").textContent = "(" + s.peers.length + ")";
  facts("links", [["direct links", s.links.direct, "direct"], ["relayed links", s.links.relayed, "relayed"]]);
  fillTable("peers", s.peers.map((p) => [idCell(p.peer_id), p.nat, p.path, p.addr]));
  const f = s.funnel;
  const funnel = [["punch attempts", f.punch_attempts, "punch_attempts"], ["successes", f.punch_successes, "punch_successes"],
    ["failures", f.punch_failures], ["reversals", f.reversals], ["relay slots held", f.reservations]];
  if (s.relay) funnel.push(["relay: slots given", s.relay.reservations, "relay_reservations"],
    ["circuits now", s.relay.circuits], ["circuits in all", s.relay.circuits_total, "circuits_total"]);
  facts("funnel", funnel);
  const h = s.history, t0 = h.length ? h[0].time : 0;
  const at = (k) => h.map((x) => [(x.time - t0) / 60, x[k]]);
  chart("funnel-chart", [{ points: at("direct"), color: COLORS[0] }, { points: at("relayed"), color: COLORS[1] },
    { points: at("punch_attempts"), color: COLORS[2] }, { points: at("punch_successes"), color: COLORS[3] }], "minutes");
  fillTable("resources", s.resources.map((r) => [el("td", { "data-resource": r.name }, r.name),
    el("td", { "data-used": r.name }, amount(r.used, r.unit)),
    el("td", { "data-limit": r.name }, r.limit === null ? "" : amount(r.limit, r.unit)),
    bar(r.used, r.limit)]));
  if (s.run) drawRun(s.run);
}

function drawRun(r) {
  document.getElementById("run-section").hidden = false;
  document.getElementById("run-id").textContent = r.run_id;
  facts("run", [["global step", r.step, "step"], ["loss", num(r.loss, 4), "loss"],
    ["samples / s (swarm)", num(r.samples_per_second, 1), "samples_per_second"], ["peers", r.peers, "peers"],
    ["samples toward this step", num(r.samples, 0) + " / " + num(r.target, 0)]]);
  chart("loss-chart", [{ points: r.curve.map((c) => [c.step, c.loss]), color: COLORS[0] }], "step", true);
  chart("rate-chart", [{ points: r.curve.map((c) => [c.step, c.samples_per_second]), color: COLORS[3] }], "step");
  fillTable("volunteers", r.volunteers.map((v) => {
    const who = idCell(v.peer_id);
    if (v.username) who.textContent = v.username + " (" + short(v.peer_id) + ")";
    const credited = el("td", { "data-samples": v.peer_id }, num(v.samples, 0));
    if (v.claimed !== undefined && v.claimed > v.samples) credited.title = "claimed " + num(v.claimed, 0) + ": more than the time watched allows";
    return [who, el("td", { "data-rate": v.peer_id }, num(v.samples_per_second, 1)), credited,
      el("td", {}, v.auxiliary_steps), el("td", { "data-served": v.peer_id }, mib(v.bytes_served || 0)),
      el("td", { "data-shards": v.peer_id }, num(v.shards_added || 0, 0)), el("td", {}, v.step ?? "–")];
  }));
  const c = r.checkpoint;
  document.getElementById("checkpoint").textContent = c ? "last checkpoint: step " + c.step + " (" + c.path + ")" : "no checkpoint yet";
}

async function refresh() {
  const state = document.getElementById("state");
  try {
    const response = await fetch("/api/status", { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const s = await response.json();
    draw(s);
    state.textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString();
    document.body.dataset.loaded = "1";
  } catch (e) {
    state.textContent = "cannot read /api/status: " + e.message;
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
