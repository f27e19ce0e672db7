#include "client/profile_html.h"

#include "absl/strings/str_cat.h"

namespace tessera::internal {
namespace {

constexpr char kHead[] = R"html(<!doctype html>
<html><head><meta charset="utf-8"><title>Tessera timeline</title>
<style>
body{font:12px sans-serif;margin:0;background:#f6f6f6;color:#222}
#top{padding:6px 10px;border-bottom:1px solid #bbb;background:#fff;position:sticky;top:0;z-index:3}
#legend span{display:inline-block;margin-right:12px}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle;border:1px solid #0003}
#view{overflow-x:auto;position:relative}
#rows{position:relative}
.row{display:flex;border-bottom:1px solid #ddd;background:#fff}
.label{width:230px;flex:none;padding:3px 6px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;
  border-right:1px solid #bbb;position:sticky;left:0;background:#fff;z-index:2}
.track{position:relative;flex:none}
.ev{position:absolute;height:14px;box-sizing:border-box;border:1px solid #0004;overflow:hidden;font-size:10px;
  line-height:12px;white-space:nowrap;min-width:1px;cursor:default}
#flows{position:absolute;left:0;top:0;pointer-events:none;z-index:1}
.axis .track{height:18px}
.tick{position:absolute;top:0;height:18px;border-left:1px solid #888;padding-left:2px;font-size:10px;
  line-height:18px;white-space:nowrap}
#tip{position:fixed;display:none;background:#ffffe8;border:1px solid #888;padding:4px 6px;pointer-events:none;
  z-index:4;white-space:pre;font:11px monospace}
</style></head><body>
<div id="top"><b>Tessera timeline</b> <span id="summary"></span><br>
<span id="legend"></span>
<button id="zin">zoom in</button> <button id="zout">zoom out</button>
<label><input type="checkbox" id="showflows" checked> messages</label></div>
<div id="view"><div id="rows"></div><svg id="flows"></svg></div>
<div id="tip"></div>
<script id="trace" type="application/json">
)html";

constexpr char kTail[] = R"html(
</script>
<script>
"use strict";
const trace = JSON.parse(document.getElementById("trace").textContent);
const colors = {kernel: "#7aa6d8", collective: "#e8726f", transfer: "#6cbf6a", plan: "#d9d4cf",
                compile: "#f2a65a", dispatch: "#efd25c", client: "#c49bd6", message: "#5fb8b0"};
const procs = new Map();
function proc(pid) {
  if (!procs.has(pid)) procs.set(pid, {pid: pid, name: "pid " + pid, sort: pid, lanes: new Map(), count: 0});
  return procs.get(pid);
}
let end = 1;
const flows = new Map();
for (const e of trace.traceEvents) {
  if (e.ph === "M") {
    if (e.name === "process_name") proc(e.pid).name = e.args.name;
    if (e.name === "process_sort_index") proc(e.pid).sort = e.args.sort_index;
    continue;
  }
  if (e.ph === "X") {
    const p = proc(e.pid);
    if (!p.lanes.has(e.tid)) p.lanes.set(e.tid, []);
    p.lanes.get(e.tid).push(e);
    p.count++;
    end = Math.max(end, e.ts + e.dur);
  } else if (e.ph === "s" || e.ph === "f") {
    end = Math.max(end, e.ts);
    if (!flows.has(e.id)) flows.set(e.id, {});
    flows.get(e.id)[e.ph] = e;
  }
}
const meta = trace.metadata || {};
const LABEL = 230, ROW = 16;
let zoom = 1;
const legend = document.getElementById("legend");
for (const [cat, color] of Object.entries(colors)) {
  legend.insertAdjacentHTML("beforeend", '<span><i class="sw" style="background:' + color + '"></i>' + cat + "</span>");
}
function details(e) {
  let text = e.name + "  [" + e.cat + "]\nstart " + fmt(e.ts) + "  duration " + fmt(e.dur);
  for (const [k, v] of Object.entries(e.args || {})) text += "\n" + k + ": " + v;
  return text;
}
function fmt(us) { return us >= 1000 ? (us / 1000).toFixed(3) + " ms" : us.toFixed(1) + " us"; }
function render() {
  const width = Math.max(400, (window.innerWidth - LABEL - 20)) * zoom;
  const x = ts => ts / end * width;
  const rows = document.getElementById("rows");
  rows.textContent = "";
  const placed = new Map();  // "pid/tid/ts" of a flow's end -> y in #rows
  let y = 0;
  const sorted = [...procs.values()].sort((a, b) => a.sort - b.sort);
  for (const p of sorted) {
    const row = document.createElement("div");
    row.className = "row";
    row.dataset.name = p.name;
    row.dataset.pid = p.pid;
    row.dataset.events = p.count;
    const label = document.createElement("div");
    label.className = "label";
    label.textContent = p.name;
    label.title = p.name;
    const track = document.createElement("div");
    track.className = "track";
    track.style.width = width + "px";
    let lane = 0;
    for (const tid of [...p.lanes.keys()].sort((a, b) => a - b)) {
      const events = p.lanes.get(tid).slice().sort((a, b) => a.ts - b.ts || b.dur - a.dur);
      const stack = [];
      let depth = 0;
      for (const e of events) {
        while (stack.length && stack[stack.length - 1] <= e.ts) stack.pop();
        const d = lane + stack.length;
        depth = Math.max(depth, stack.length + 1);
        stack.push(e.ts + e.dur);
        const div = document.createElement("div");
        div.className = "ev";
        div.dataset.cat = e.cat;
        div.style.left = x(e.ts) + "px";
        div.style.width = Math.max(1, x(e.dur)) + "px";
        div.style.top = (2 + d * ROW) + "px";
        div.style.background = colors[e.cat] || "#ccc";
        if (x(e.dur) > 30) div.textContent = e.name;
        div.dataset.tip = details(e);  // what the tooltip shows on hover
        track.appendChild(div);
        e.y = y + 2 + d * ROW + 7;
      }
      lane += Math.max(depth, 1);
    }
    const height = 4 + Math.max(lane, 1) * ROW;
    track.style.height = height + "px";
    row.style.height = height + "px";
    row.appendChild(label);
    row.appendChild(track);
    rows.appendChild(row);
    y += height + 1;
  }
  // The time axis, under the rows: a tick every 1, 2 or 5 x 10^k us, at least 100 px apart.
  const axis = document.createElement("div");
  axis.className = "row axis";
  const axisLabel = document.createElement("div");
  axisLabel.className = "label";
  axisLabel.textContent = "time since the window opened";
  const ticks = document.createElement("div");
  ticks.className = "track";
  ticks.style.width = width + "px";
  const least = end * 100 / width;
  const power = Math.pow(10, Math.floor(Math.log10(least)));
  const step = [1, 2, 5, 10].map(m => m * power).find(s => s >= least);
  for (let i = 0; i * step <= end; ++i) {
    const tick = document.createElement("div");
    tick.className = "tick";
    tick.dataset.us = i * step;
    tick.style.left = x(i * step) + "px";
    tick.textContent = fmt(i * step);
    ticks.appendChild(tick);
  }
  axis.appendChild(axisLabel);
  axis.appendChild(ticks);
  rows.appendChild(axis);
  // A flow's ends sit on the spans that enclose them (the collectives sending and taking).
  function enclosing(f) {
    const p = procs.get(f.pid);
    const lane = p && p.lanes.get(f.tid);
    let best = null;
    for (const e of lane || []) if (e.ts <= f.ts && f.ts <= e.ts + e.dur && (!best || e.dur < best.dur)) best = e;
    return best ? best.y : null;
  }
  const svg = document.getElementById("flows");
  svg.setAttribute("width", LABEL + width);
  svg.setAttribute("height", y);
  svg.textContent = "";
  let drawn = 0;
  if (document.getElementById("showflows").checked) {
    const ns = "http://www.w3.org/2000/svg";
    for (const f of flows.values()) {
      if (!f.s || !f.f) continue;
      const y0 = enclosing(f.s), y1 = enclosing(f.f);
      if (y0 === null || y1 === null) continue;
      const line = document.createElementNS(ns, "line");
      line.setAttribute("x1", LABEL + x(f.s.ts));
      line.setAttribute("y1", y0);
      line.setAttribute("x2", LABEL + x(f.f.ts));
      line.setAttribute("y2", y1);
      line.setAttribute("stroke", "#2a7f78");
      line.setAttribute("stroke-width", "1");
      line.setAttribute("opacity", "0.6");
      svg.appendChild(line);
      drawn++;
    }
  }
  document.getElementById("summary").textContent =
      sorted.length + " rows, window " + fmt(meta.window_us || end) + ", " + flows.size + " messages (" + drawn +
      " drawn), " + (meta.dropped_events || 0) + " events dropped";
  document.body.dataset.rendered = "true";
  document.body.dataset.rows = sorted.length;
}
const tip = document.getElementById("tip");
document.getElementById("rows").addEventListener("mousemove", ev => {
  const text = ev.target.dataset && ev.target.dataset.tip;
  if (!text) { tip.style.display = "none"; return; }
  tip.textContent = text;
  tip.style.left = (ev.clientX + 12) + "px";
  tip.style.top = (ev.clientY + 12) + "px";
  tip.style.display = "block";
});
document.getElementById("rows").addEventListener("mouseleave", () => { tip.style.display = "none"; });
document.getElementById("zin").onclick = () => { zoom *= 2; render(); };
document.getElementById("zout").onclick = () => { zoom = Math.max(1, zoom / 2); render(); };
document.getElementById("showflows").onchange = render;
render();
</script>
</body></html>
)html";

}  // namespace

std::string timeline_html(const std::string& trace_json) { return absl::StrCat(kHead, trace_json, kTail); }

}  // namespace tessera::internal
