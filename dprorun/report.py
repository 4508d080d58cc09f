"""The run report: one self-contained HTML page (no network needed to open it), a rich terminal summary, and the
same data as JSON.

`build_report(analysis) -> dict` collects, from the run's one analysis (dprorun/analysis.py: read and aligned once): the job and per-rank breakdown, one measured
iteration of every rank on the reference clock, the replayed iteration with its critical path, the top
critical-path ops, what-if curves (iteration time vs world size, bandwidth, bucket size; each a replay of the
median iteration, bounded in time), the optimizer's strategy and autotune's measured before/after when the run
directory has them, peak memory per rank, and the host/GPU samples. `render_html(data)` draws it with inline
SVG and script (zoom: mouse wheel / drag on the timelines). `write_report(analysis)` writes RUN_DIR/report.html.
"""
from __future__ import annotations

import html
import json
import os
import time
from typing import TYPE_CHECKING, Optional

from dprorun.fsutil import atomic_write_bytes, read_json
from dprorun.trace.model import OpKind, RunTrace

if TYPE_CHECKING:
    from dprorun.analysis import RunAnalysis

WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128)
BANDWIDTHS_GBIT = (1, 2.5, 10, 25, 100)
BUCKETS_MB = (0.25, 1, 5, 25, 100)
MAX_WHATIF_OPS = 2_000_000  # a curve point whose replay graph would be larger is skipped (and said so)


def _measured_timeline(run: RunTrace) -> dict:
    """One profiled iteration per rank (the last one without torch.profiler where possible), times in ms from
    the earliest start, lanes per rank: phases, comm, GPU streams."""
    rows = []
    common = None
    for trace in run.ranks.values():
        clean = set(trace.unprofiled_window_iterations()) or set(trace.profiled_iterations)
        common = clean if common is None else common & clean
    iteration = max(common) if common else None
    if iteration is None:
        return {"iteration": None, "ops": []}
    for rank, trace in sorted(run.ranks.items())[:SHOWN_RANKS]:
        for op in trace.ops:
            if op.iteration != iteration or op.kind is OpKind.VIRTUAL:
                continue
            if op.stream == "phase":
                lane = "phases"
            elif op.kind in (OpKind.COMM, OpKind.QUEUE):
                lane = "comm"
            elif op.stream.startswith("cuda:"):
                lane = op.stream
            else:
                continue  # profiler CPU ops are in the Perfetto export (dpro timeline); too many for a page
            rows.append([rank, lane, op.kind.value, op.name, op.start_us, op.end_us])
    if not rows:
        return {"iteration": iteration, "ops": []}
    origin = min(r[4] for r in rows)
    ops = [[r[0], r[1], r[2], r[3], round((r[4] - origin) / 1000, 4), round((r[5] - origin) / 1000, 4)]
           for r in rows]
    return {"iteration": iteration, "ops": ops}


FOLD_FROM_RANKS = 16  # what-if curves of runs this large replay one representative rank
SHOWN_RANKS = 16  # timelines on the page show the first ranks of a large run


def _uncertainty_kpi(alignment: dict) -> str:
    widths = [w for w in (alignment.get("uncertainty_us") or {}).values()]
    if not widths or all(w == 0.0 for w in widths):
        return ""
    worst = None if any(w is None for w in widths) else max(widths)
    return " (±unbounded)" if worst is None else f" (±{worst / 2:.0f} µs)"


def _replayed_timeline(model) -> dict:
    from dprorun.replay.engine import KIND_NAMES, critical_path_report, replay
    from dprorun.replay.whatif import WhatIf, synthesize

    graph = synthesize(model, WhatIf(), [])
    result = replay(graph)
    critical = set(result.critical_path)
    ops = []
    for k in range(graph.size):
        kind = KIND_NAMES[graph.kinds[k]]
        if kind == "VIRTUAL" or result.end_us[k] <= result.start_us[k] or graph.ranks[k] >= SHOWN_RANKS:
            continue
        device = graph.device_names[graph.devices[k]] if graph.devices[k] >= 0 else "-"
        ops.append([int(graph.ranks[k]), device, kind, graph.names[k], round(float(result.start_us[k]) / 1000, 4),
                    round(float(result.end_us[k]) / 1000, 4), k in critical])
    path = critical_path_report(graph, result, top=15)
    return {"iteration_ms": round(result.iteration_time_us / 1000, 4), "ops": ops,
            "critical_path": {k: v for k, v in path.items() if k != "path"}}


def _whatif_curves(model, time_budget_s: float, max_ops: int = MAX_WHATIF_OPS) -> dict:
    from dprorun.replay.whatif import WhatIf, replay_once, representative

    started = time.monotonic()
    buckets = max(1, len(model.buckets))
    curves: dict = {"world_size": [], "bandwidth_gbit": [], "bucket_mb": [], "skipped": [], "folded": False}
    if len(model.templates) >= FOLD_FROM_RANKS:  # every rank alike: one built rank answers each point
        model = representative(model)
        curves["folded"] = True

    def point(curve: str, x: float, whatif: WhatIf, ops_estimate: int) -> None:
        if curves["folded"]:
            ops_estimate //= max(1, whatif.world_size or model.world_size)
        if ops_estimate > max_ops or time.monotonic() - started > time_budget_s:
            curves["skipped"].append(f"{curve}={x:g}")
            return
        try:
            t, _ = replay_once(model, whatif)
        except ValueError as exc:  # e.g. re-bucketing without gradient-ready times
            curves["skipped"].append(f"{curve}={x:g} ({exc})")
            return
        curves[curve].append([x, round(t / 1000, 4)])

    for n in WORLD_SIZES:
        point("world_size", n, WhatIf(world_size=n), n * buckets * 2 * 2 * (n - 1) + 10 * n)
    world = model.world_size
    for bw in BANDWIDTHS_GBIT:
        point("bandwidth_gbit", bw, WhatIf(bandwidth_gbit=bw), world * buckets * 4 * max(world - 1, 1))
    total = sum(model.param_bytes.values())
    for mb in BUCKETS_MB:
        n_buckets = max(1, int(total / (mb * (1 << 20))) + 1)
        point("bucket_mb", mb, WhatIf(bucket_mb=mb), world * n_buckets * 4 * max(world - 1, 1))
    return curves


def _samples(run: RunTrace) -> list[dict]:
    series = []
    for rank, trace in sorted(run.ranks.items()):
        for source in sorted({s.source for s in trace.samples}):
            points = [s for s in trace.samples if s.source == source]
            if not points:
                continue
            origin = points[0].time_us
            keys = sorted({k for s in points for k in s.values})
            for key in keys:
                values = [[round((s.time_us - origin) / 1e6, 3), s.values[key]] for s in points if key in s.values]
                series.append({"rank": rank, "source": source, "metric": key, "points": values})
    return series


def build_report(analysis: "RunAnalysis", whatif_time_budget_s: float = 60.0,
                 max_whatif_ops: int = MAX_WHATIF_OPS) -> dict:
    run_dir = analysis.run_dir
    summary = analysis.summary
    alignment = analysis.alignment
    run = analysis.aligned_run
    data: dict = {"run_dir": os.path.abspath(run_dir), "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "summary": summary, "alignment": {"method": alignment.method,
                                                    "approximate": alignment.approximate,
                                                    "offsets_us": alignment.offsets_us,
                                                    "uncertainty_us": alignment.to_json()["uncertainty_us"],
                                                    "warnings": alignment.warnings},
                  "measured_timeline": _measured_timeline(run), "samples": _samples(run), "notes": []}
    try:
        model = analysis.model
        prediction = analysis.prediction
        data["prediction"] = {"predicted_iteration_time_ms": prediction.predicted_iteration_time_ms,
                              "measured_iteration_time_ms": prediction.measured_iteration_time_ms,
                              "spread_ms": prediction.spread_ms, "self_check": prediction.self_check,
                              "critical_path": prediction.critical_path, "comm_model": prediction.comm_model}
        if prediction.self_check and prediction.self_check["status"] != "agrees":
            data["notes"].append(prediction.self_check["message"])
        data["replayed_timeline"] = _replayed_timeline(model)
        data["whatif"] = _whatif_curves(model, whatif_time_budget_s, max_whatif_ops)
        if data["whatif"]["folded"]:
            data["notes"].append(f"what-if curves of this {model.world_size}-rank run replay one representative rank "
                                 "(the slowest measured one; every rank alike): exact for a symmetric job")
        if len(run.ranks) > SHOWN_RANKS:
            data["notes"].append(f"timelines show ranks 0-{SHOWN_RANKS - 1} of {len(run.ranks)} "
                                 "(dpro timeline exports every rank)")
        data["notes"] += [p for p in run.problems if p.startswith("large run")]
        if model.transport and model.transport.get("shares_cores"):
            data["notes"].append(
                "the what-if curves assume communication runs beside compute; this job's transport is CPU work "
                f"on the cores its ranks compute on (busy {100 * model.transport['transport_cpu_share']:.0f} % of "
                "its all-reduces' time), so curves that add collectives or overlap are optimistic here")
    except ValueError as exc:  # nothing replayable (e.g. no complete profiled iteration): say so on the page
        data["notes"].append(f"no replay: {exc}")
    for name in ("strategy.json", "autotune.json"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            data[name.split(".")[0]] = read_json(path)
    variants = next((t.meta.get("compute_variants") for t in run.ranks.values() if t.meta.get("compute_variants")),
                    None)
    profiled = os.path.join(run_dir, "autotune", "profile", "rank_0", "variants.json")
    if not variants and os.path.exists(profiled):  # --autotune: timed in its profiling phase
        variants = (read_json(profiled) or {}).get("variants")
    if variants:
        data["compute_variants"] = variants
    return data


def _variant_rows(variants: dict) -> list[list]:
    """variant, forward ms, backward ms, x eager forward/backward, first call s (or the error)."""
    eager = variants.get("eager", {})
    rows = []
    for name, v in variants.items():
        if "error" in v:
            rows.append([name, None, None, None, None, v["error"]])
            continue
        def ratio(key: str, v: dict = v) -> Optional[float]:
            return round(v[key] / eager[key], 3) if eager.get(key) else None
        rows.append([name, v["forward_us"] / 1000, v["backward_us"] / 1000, ratio("forward_us"),
                     ratio("backward_us"), v.get("first_call_s")])
    return rows


_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f4f4f4}td.l,th.l{text-align:left}.kpi{display:inline-block;margin-right:28px}
.kpi b{font-size:20px;display:block}.note{color:#666;font-size:12px}svg{background:#fff;border:1px solid #eee}
.legend span{display:inline-block;margin-right:12px;font-size:12px}.legend i{display:inline-block;width:12px;
height:12px;margin-right:4px;vertical-align:middle}.charts{display:flex;flex-wrap:wrap;gap:16px}
"""

_ERRORS = r"""
window.__reportErrors = [];
window.addEventListener('error', e => { window.__reportErrors.push(String(e.message)); });
const __consoleError = console.error;
console.error = function(...args) { window.__reportErrors.push(args.join(' ')); __consoleError.apply(console, args); };
window.addEventListener('load', () => { document.getElementById('render-errors').textContent =
  window.__reportErrors.length ? ('errors: ' + JSON.stringify(window.__reportErrors)) : 'no errors'; });
"""

_SCRIPT = r"""
(function(){
const D = JSON.parse(document.getElementById('report-data').textContent);
const COLORS = {FW:'#4e79a7',BW:'#f28e2b',UPDATE:'#59a14f',COMM:'#e15759',QUEUE:'#edc948',IO:'#bab0ac',
  OTHER:'#9c755f'};
const NS = 'http://www.w3.org/2000/svg';
function el(tag, attrs, parent){const e=document.createElementNS(NS,tag);for(const k in attrs)e.setAttribute(k,attrs[k]);
  if(parent)parent.appendChild(e);return e;}
function timeline(id, ops, laneOf, critical){
  const host=document.getElementById(id); if(!ops.length){host.textContent='(nothing recorded)';return 0;}
  const lanes=[...new Set(ops.map(laneOf))].sort((a,b)=>a.localeCompare(b,undefined,{numeric:true}));
  const end=Math.max(...ops.map(o=>o[5])); const W=1300,L=170,H=18*lanes.length+30;
  const svg=el('svg',{width:W,height:H,viewBox:`0 0 ${W} ${H}`},host);
  const g=el('g',{},svg); let scale=(W-L-10)/end, offset=0;
  function draw(){g.innerHTML='';lanes.forEach((lane,i)=>{const t=el('text',{x:4,y:18*i+14,'font-size':11},g);
      t.textContent=lane;});
    for(const o of ops){const x=L+(o[4]-offset)*scale,w=Math.max(0.5,(o[5]-o[4])*scale);
      if(x+w<L||x>W)continue; const i=lanes.indexOf(laneOf(o));
      const r=el('rect',{x:Math.max(L,x),y:18*i+3,width:w,height:14,fill:COLORS[o[2]]||'#999',
        stroke:(critical&&o[6])?'#000':'none','stroke-width':(critical&&o[6])?2:0},g);
      const tt=el('title',{},r); tt.textContent=`${o[3]} (${o[2]}) ${o[4].toFixed(3)}-${o[5].toFixed(3)} ms`;}
    const ax=el('text',{x:L,y:H-4,'font-size':11},g); ax.textContent=`${offset.toFixed(2)} ms`;
    const ax2=el('text',{x:W-80,y:H-4,'font-size':11},g); ax2.textContent=`${(offset+(W-L-10)/scale).toFixed(2)} ms`;}
  svg.addEventListener('wheel',ev=>{ev.preventDefault();const at=offset+(ev.offsetX-L)/scale;
    scale*=ev.deltaY<0?1.25:0.8;offset=Math.max(0,at-(ev.offsetX-L)/scale);draw();});
  let drag=null; svg.addEventListener('mousedown',ev=>{drag=[ev.offsetX,offset];});
  svg.addEventListener('mousemove',ev=>{if(drag){offset=Math.max(0,drag[1]-(ev.offsetX-drag[0])/scale);draw();}});
  window.addEventListener('mouseup',()=>{drag=null;});
  draw(); return ops.length;}
function chart(id, title, points, xlabel, logx, unit){
  const host=document.getElementById(id); const W=420,H=260,P=48;
  const svg=el('svg',{width:W,height:H},host); const t=el('text',{x:P,y:16,'font-size':13,'font-weight':'bold'},svg);
  t.textContent=title; if(!points.length){const n=el('text',{x:P,y:H/2,'font-size':12},svg);n.textContent='(no data)';return 0;}
  const fx=v=>logx?Math.log(v):v; const xs=points.map(p=>fx(p[0])),ys=points.map(p=>p[1]);
  const x0=Math.min(...xs),x1=Math.max(...xs),y1=Math.max(...ys)*1.1,y0=0;
  const X=v=>P+(W-2*P)*(x1>x0?(fx(v)-x0)/(x1-x0):0.5),Y=v=>H-P+(-(H-2*P))*(v-y0)/(y1-y0||1);
  el('line',{x1:P,y1:H-P,x2:W-P,y2:H-P,stroke:'#888'},svg);el('line',{x1:P,y1:P-10,x2:P,y2:H-P,stroke:'#888'},svg);
  el('polyline',{points:points.map(p=>`${X(p[0])},${Y(p[1])}`).join(' '),fill:'none',stroke:'#4e79a7','stroke-width':2},svg);
  const every=Math.ceil(points.length/8);
  points.forEach((p,i)=>{const c=el('circle',{cx:X(p[0]),cy:Y(p[1]),r:3,fill:'#4e79a7'},svg);
    const tt=el('title',{},c);tt.textContent=`${p[0]}: ${p[1].toFixed(2)}`;
    if(i%every===0){const lx=el('text',{x:X(p[0])-8,y:H-P+14,'font-size':10},svg);lx.textContent=p[0];}});
  const yl=el('text',{x:4,y:P-14,'font-size':10},svg);yl.textContent=`${y1.toFixed(1)}${unit||' ms'}`;
  const xl=el('text',{x:W/2-30,y:H-10,'font-size':11},svg);xl.textContent=xlabel; return points.length;}
const drawn={};
drawn.measured=timeline('tl-measured',(D.measured_timeline||{}).ops||[],o=>`rank ${o[0]} ${o[1]}`,false);
drawn.replayed=timeline('tl-replayed',(D.replayed_timeline||{}).ops||[],o=>`rank ${o[0]} ${o[1]}`,true);
const W=D.whatif||{};
drawn.world=chart('ch-world','iteration time vs world size',W.world_size||[],'ranks',true);
drawn.bw=chart('ch-bw','iteration time vs bandwidth',W.bandwidth_gbit||[],'Gbit/s',true);
drawn.bucket=chart('ch-bucket','iteration time vs bucket size',W.bucket_mb||[],'MB',true);
const S=D.samples||[]; const cpu=S.filter(s=>s.metric==='proc_cpu_pct'||s.metric==='gpu_util_pct');
drawn.samples=0; cpu.slice(0,4).forEach((s,i)=>{const d=document.createElement('div');d.id='ch-s'+i;
  document.getElementById('samples').appendChild(d);
  drawn.samples+=chart(d.id,`rank ${s.rank} ${s.source} ${s.metric}`,s.points,'seconds',false,' %');});
document.getElementById('render-status').textContent=JSON.stringify(drawn);
})();
"""


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th{' class=l' if k == 0 else ''}>{html.escape(str(h))}</th>" for k, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td{' class=l' if k == 0 else ''}>{html.escape(_fmt(c))}</td>"
                                    for k, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def render_html(data: dict) -> str:
    s = data["summary"]
    pred = data.get("prediction") or {}
    parts = [f"<h1>dprorun report: job {html.escape(str(s.get('job_id')))}</h1>",
             f"<p class=note>{html.escape(' '.join(s.get('command') or []))}<br>{html.escape(data['run_dir'])}, "
             f"generated {data['generated']}</p>",
             "<div>"
             f"<span class=kpi>world size<b>{s.get('world_size')}</b></span>"
             f"<span class=kpi>iteration (measured)<b>{_fmt(s.get('iteration_time_ms'))} ms</b></span>"
             f"<span class=kpi>without profiler<b>{_fmt(s.get('clean_iteration_time_ms'))} ms</b></span>"
             f"<span class=kpi>replayed (median of the per-iteration replays)"
             f"<b>{_fmt(pred.get('predicted_iteration_time_ms'))} ms</b></span>"
             f"<span class=kpi>clock alignment<b>{html.escape(data['alignment']['method'])}"
             f"{_uncertainty_kpi(data['alignment'])}</b></span></div>"]
    check = pred.get("self_check") or {}
    if check.get("message") and check.get("status") == "agrees":
        parts.append(f"<p class=note>{html.escape(check['message'])}</p>")
    for note in data.get("notes", []) + (s.get("problems") or []):
        parts.append(f"<p class=note>{html.escape(str(note))}</p>")
    parts.append("<h2>Breakdown per rank (ms, medians over the profiled window)</h2>")
    keys = ["iteration_time_ms", "forward_ms", "backward_ms", "update_ms", "comm_ms", "exposed_comm_ms",
            "queue_ms", "idle_ms"]
    parts.append(_table(["rank", "iteration", "forward", "backward", "update", "communication", "exposed comm",
                         "queueing", "idle/other"],
                        [[r["rank"]] + [r.get(k) for k in keys] for r in s.get("ranks", [])]))
    legend = "".join(f"<span><i style='background:{c}'></i>{k}</span>" for k, c in
                     (("FW", "#4e79a7"), ("BW", "#f28e2b"), ("UPDATE", "#59a14f"), ("COMM", "#e15759"),
                      ("QUEUE", "#edc948")))
    mt = data.get("measured_timeline") or {}
    parts.append(f"<h2>Global timeline, measured (iteration {mt.get('iteration')}, aligned clocks)</h2>"
                 f"<div class=legend>{legend}</div><div id=tl-measured></div>"
                 "<p class=note>mouse wheel: zoom, drag: pan; hover an op for its name and times</p>")
    rt = data.get("replayed_timeline") or {}
    parts.append(f"<h2>Replayed iteration of the median durations ({_fmt(rt.get('iteration_ms'))} ms; the "
                 f"prediction above is the median of the per-iteration replays), critical path outlined</h2>"
                 f"<div class=legend>{legend}</div><div id=tl-replayed></div>")
    cp = pred.get("critical_path") or {}
    if cp:
        share = cp.get("share_pct", {})
        parts.append(f"<h2>Critical path ({cp.get('length')} ops): compute {share.get('compute')} %, "
                     f"communication {share.get('communication')} %, queueing {share.get('queueing')} %</h2>")
        parts.append(_table(["op", "rank", "kind", "device", "time on path ms"],
                            [[r["op"], r["rank"], r["kind"], r["device"], r["time_on_path_ms"]]
                             for r in cp.get("top", [])[:15]]))
    parts.append("<h2>What if</h2><div class=charts><div id=ch-world></div><div id=ch-bw></div>"
                 "<div id=ch-bucket></div></div>")
    skipped = (data.get("whatif") or {}).get("skipped")
    if skipped:
        parts.append(f"<p class=note>not replayed (graph too large or time budget spent): "
                     f"{html.escape(', '.join(skipped))}</p>")
    strategy = data.get("strategy")
    if strategy:
        parts.append(f"<h2>Optimizer strategy: {_fmt(strategy.get('baseline_ms'))} ms -> "
                     f"{_fmt(strategy.get('predicted_ms'))} ms predicted</h2>")
        parts.append(_table(["pass", "decision", "before ms", "after ms", "predicted gain ms"],
                            [[d["pass_name"], d["choice"], d["before_ms"], d["after_ms"], d.get("gain_ms")]
                             for d in strategy.get("decisions", [])] or [["-", "nothing to change", None,
                                                                          None, None]]))
        for note in strategy.get("search", {}).get("recommendations", []):
            parts.append(f"<p class=note>not applied: {html.escape(note)}</p>")
    variants = data.get("compute_variants")
    if variants:
        parts.append("<h2>Compute variants (rank 0's model and batch, timed after the window)</h2>")
        parts.append(_table(["variant", "forward ms", "backward ms", "x eager forward", "x eager backward",
                             "first call s / error"], _variant_rows(variants)))
    autotune = data.get("autotune")
    if autotune:
        phases = {p["phase"]: p for p in autotune.get("phases", [])}
        decide = phases.get("deciding", {})
        parts.append("<h2>Autotune: measured before / after</h2>")
        trials = [p for p in autotune.get("phases", []) if p["phase"] == "trial"]
        parts.append(_table(["profile (job's settings) ms", "trials ms", "judged trial ms", "kept", "reason"],
                            [[decide.get("baseline_ms"),
                              ", ".join(f"{t['measured_ms']:.2f}" for t in trials if t.get("measured_ms")) or "-",
                              decide.get("trial_ms"), decide.get("keep"), decide.get("reason")]]))
    parts.append("<h2>Peak memory per rank</h2>")
    parts.append(_table(["rank", "device", "estimated MiB", "measured MiB", "error %"],
                        [[m["rank"], m["device"], (m["estimated_peak_bytes"] or 0) / 2 ** 20,
                          (m["measured_peak_bytes"] or 0) / 2 ** 20, m["error_pct"]] for m in s.get("memory", [])]))
    parts.append("<h2>Host and GPU samples</h2><div id=samples class=charts></div>")
    parts.append("<p class=note>rendered: <span id=render-status>script did not run</span> "
                 "<span id=render-errors></span></p>")
    payload = json.dumps(data, default=float).replace("</", "<\\/")
    return ("<!doctype html><html><head><meta charset=utf-8><title>dprorun report</title>"
            f"<style>{_STYLE}</style><script>{_ERRORS}</script></head><body>{''.join(parts)}"
            f"<script type='application/json' id=report-data>{payload}</script>"
            f"<script>{_SCRIPT}</script></body></html>")


def write_report(analysis: "RunAnalysis", output: Optional[str] = None, whatif_time_budget_s: float = 60.0,
                 max_whatif_ops: int = MAX_WHATIF_OPS) -> tuple[str, dict]:
    data = build_report(analysis, whatif_time_budget_s, max_whatif_ops)
    path = output or os.path.join(analysis.run_dir, "report.html")
    atomic_write_bytes(path, render_html(data).encode())
    return path, data


def format_report(data: dict) -> str:
    """The terminal version: the run summary plus the critical path and the what-if curves as rich tables."""
    import io

    from rich.console import Console
    from rich.table import Table

    from dprorun.summary import format_summary

    out = io.StringIO()
    console = Console(file=out, width=140)
    cp = (data.get("prediction") or {}).get("critical_path") or {}
    if cp:
        table = Table(title=f"critical path of the replayed iteration "
                            f"({data['prediction']['predicted_iteration_time_ms']:.2f} ms)")
        for col in ("op", "rank", "kind", "time on path ms"):
            table.add_column(col, justify="left" if col == "op" else "right")
        for row in cp.get("top", [])[:10]:
            table.add_row(row["op"], str(row["rank"]), row["kind"], f"{row['time_on_path_ms']:.3f}")
        console.print(table)
    variants = data.get("compute_variants")
    if variants:
        table = Table(title="compute variants (rank 0, after the window)")
        for col in ("variant", "forward ms", "backward ms", "x eager fw", "x eager bw", "first call s / error"):
            table.add_column(col, justify="left" if col == "variant" else "right")
        for row in _variant_rows(variants):
            table.add_row(*[_fmt(c) for c in row])
        console.print(table)
    whatif = data.get("whatif") or {}
    for curve, label in (("world_size", "ranks"), ("bandwidth_gbit", "Gbit/s"), ("bucket_mb", "bucket MB")):
        points = whatif.get(curve) or []
        if points:
            table = Table(title=f"what if: {label}")
            table.add_column(label, justify="right")
            table.add_column("iteration ms", justify="right")
            for x, y in points:
                table.add_row(f"{x:g}", f"{y:.2f}")
            console.print(table)
    return format_summary(data["summary"]) + "\n" + out.getvalue()
