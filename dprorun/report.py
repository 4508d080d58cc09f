"""The run report's rendering: one self-contained HTML page (no network needed to open it) and a rich terminal
summary, of the data dprorun/report_data.py computes (`build_report(analysis) -> dict`, also printed as JSON).

`render_html(data)` draws it with inline SVG and script (zoom: mouse wheel / drag on the timelines);
`write_report(analysis)` builds the data and writes RUN_DIR/report.html; `format_report(data)` is the terminal
version.
"""
from __future__ import annotations

import html
import json
import os
from typing import TYPE_CHECKING, Optional

from dprorun.fsutil import atomic_write_bytes
from dprorun.report_data import MAX_WHATIF_OPS, build_report

if TYPE_CHECKING:
    from dprorun.analysis import RunAnalysis


def _uncertainty_kpi(alignment: dict) -> str:
    widths = [w for w in (alignment.get("uncertainty_us") or {}).values()]
    if not widths or all(w == 0.0 for w in widths):
        return ""
    worst = None if any(w is None for w in widths) else max(widths)
    return " (±unbounded)" if worst is None else f" (±{worst / 2:.0f} µs)"


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
const lane=o=>(typeof o[0]==='string'?o[0]:(D.backend==='mxnet'?'worker ':'rank ')+o[0])+' '+o[1];
drawn.measured=timeline('tl-measured',(D.measured_timeline||{}).ops||[],lane,false);
drawn.replayed=timeline('tl-replayed',(D.replayed_timeline||{}).ops||[],lane,true);
const W=D.whatif||{};
drawn.world=chart('ch-world','iteration time vs world size',W.world_size||[],'ranks',true);
drawn.bw=chart('ch-bw','iteration time vs bandwidth',W.bandwidth_gbit||[],'Gbit/s',true);
const has=id=>document.getElementById(id)!==null;
if(has('ch-bucket'))drawn.bucket=chart('ch-bucket','iteration time vs bucket size',W.bucket_mb||[],'MB',true);
if(has('ch-servers'))drawn.servers=chart('ch-servers','iteration time vs servers',W.servers||[],'servers',false);
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


REPLAYED_LABEL = "replayed (median of the per-iteration replays)"


def render_html(data: dict) -> str:
    """The self-contained page: sections in HTML, the report's data as JSON, the drawing in the page's script."""
    parts = (_header_section(data) + _breakdown_section(data) + _timeline_sections(data)
             + _critical_path_section(data) + _whatif_section(data) + _strategy_section(data)
             + _variants_section(data) + _autotune_section(data) + _memory_section(data))
    if data.get("samples"):
        parts.append("<h2>Host and GPU samples</h2><div id=samples class=charts></div>")
    parts.append("<p class=note>rendered: <span id=render-status>script did not run</span> "
                 "<span id=render-errors></span></p>")
    payload = json.dumps(data, default=float).replace("</", "<\\/")
    return ("<!doctype html><html><head><meta charset=utf-8><title>dprorun report</title>"
            f"<style>{_STYLE}</style><script>{_ERRORS}</script></head><body>{''.join(parts)}"
            f"<script type='application/json' id=report-data>{payload}</script>"
            f"<script>{_SCRIPT}</script></body></html>")


def _header_section(data: dict) -> list[str]:
    s = data["summary"]
    pred = data.get("prediction") or {}
    parts = [f"<h1>dprorun report: job {html.escape(str(s.get('job_id')))}</h1>",
             f"<p class=note>{html.escape(' '.join(s.get('command') or []))}<br>{html.escape(data['run_dir'])}, "
             f"generated {data['generated']}</p>",
             "<div>"
             f"<span class=kpi>world size<b>{s.get('world_size')}</b></span>"
             f"<span class=kpi>iteration (measured)<b>{_fmt(s.get('iteration_time_ms'))} ms</b></span>"
             f"<span class=kpi>without profiler<b>{_fmt(s.get('clean_iteration_time_ms'))} ms</b></span>"
             f"<span class=kpi>{html.escape(data.get('replayed_label', REPLAYED_LABEL))}"
             f"<b>{_fmt(pred.get('predicted_iteration_time_ms'))} ms</b></span>"
             f"<span class=kpi>clock alignment<b>{html.escape(data['alignment']['method'])}"
             f"{_uncertainty_kpi(data['alignment'])}</b></span></div>"]
    check = pred.get("self_check") or {}
    if check.get("message") and check.get("status") in ("agrees", "fitted"):
        parts.append(f"<p class=note>{html.escape(check['message'])}</p>")
    for note in data.get("notes", []) + (s.get("problems") or []):
        parts.append(f"<p class=note>{html.escape(str(note))}</p>")
    return parts


def _breakdown_section(data: dict) -> list[str]:
    if data.get("breakdown"):  # a layout of its own (parameter-server runs)
        table = data["breakdown"]
        return [f"<h2>{html.escape(table['title'])}</h2>", _table(table["headers"], table["rows"])]
    keys = ["iteration_time_ms", "forward_ms", "backward_ms", "update_ms", "comm_ms", "exposed_comm_ms",
            "queue_ms", "idle_ms"]
    return ["<h2>Breakdown per rank (ms, medians over the profiled window)</h2>",
            _table(["rank", "iteration", "forward", "backward", "update", "communication", "exposed comm",
                    "queueing", "idle/other"],
                   [[r["rank"]] + [r.get(k) for k in keys] for r in data["summary"].get("ranks", [])])]


def _timeline_sections(data: dict) -> list[str]:
    legend = "".join(f"<span><i style='background:{c}'></i>{k}</span>" for k, c in
                     (("FW", "#4e79a7"), ("BW", "#f28e2b"), ("UPDATE", "#59a14f"), ("COMM", "#e15759"),
                      ("QUEUE", "#edc948")))
    mt = data.get("measured_timeline") or {}
    rt = data.get("replayed_timeline") or {}
    clocks = "one host's clock" if data.get("backend") == "mxnet" else "aligned clocks"
    return [f"<h2>Global timeline, measured (iteration {mt.get('iteration')}, {clocks})</h2>"
            f"<div class=legend>{legend}</div><div id=tl-measured></div>"
            "<p class=note>mouse wheel: zoom, drag: pan; hover an op for its name and times</p>",
            f"<h2>Replayed iteration of the median durations ({_fmt(rt.get('iteration_ms'))} ms"
            + ("" if data.get("backend") == "mxnet" else "; the prediction above is the median of the per-iteration "
               "replays") + "), critical path outlined</h2>"
            f"<div class=legend>{legend}</div><div id=tl-replayed></div>"]


def _critical_path_section(data: dict) -> list[str]:
    cp = (data.get("prediction") or {}).get("critical_path") or {}
    if not cp:
        return []
    share = cp.get("share_pct", {})
    return [f"<h2>Critical path ({cp.get('length')} ops): compute {share.get('compute')} %, "
            f"communication {share.get('communication')} %, queueing {share.get('queueing')} %</h2>",
            _table(["op", "rank", "kind", "device", "time on path ms"],
                   [[r["op"], r["rank"], r["kind"], r["device"], r["time_on_path_ms"]]
                    for r in cp.get("top", [])[:15]])]


def _whatif_section(data: dict) -> list[str]:
    curves = "<div id=ch-servers></div>" if (data.get("whatif") or {}).get("servers") else "<div id=ch-bucket></div>"
    parts = [f"<h2>What if</h2><div class=charts><div id=ch-world></div><div id=ch-bw></div>{curves}</div>"]
    skipped = (data.get("whatif") or {}).get("skipped")
    if skipped:
        parts.append(f"<p class=note>not replayed (graph too large or time budget spent): "
                     f"{html.escape(', '.join(skipped))}</p>")
    return parts


def _strategy_section(data: dict) -> list[str]:
    strategy = data.get("strategy")
    if not strategy:
        return []
    parts = [f"<h2>Optimizer strategy: {_fmt(strategy.get('baseline_ms'))} ms -> "
             f"{_fmt(strategy.get('predicted_ms'))} ms predicted</h2>",
             _table(["pass", "decision", "before ms", "after ms", "predicted gain ms"],
                    [[d["pass_name"], d["choice"], d["before_ms"], d["after_ms"], d.get("gain_ms")]
                     for d in strategy.get("decisions", [])] or [["-", "nothing to change", None, None, None]])]
    for note in strategy.get("search", {}).get("recommendations", []):
        parts.append(f"<p class=note>not applied: {html.escape(note)}</p>")
    return parts


def _variants_section(data: dict) -> list[str]:
    variants = data.get("compute_variants")
    if not variants:
        return []
    return ["<h2>Compute variants (rank 0's model and batch, timed after the window)</h2>",
            _table(["variant", "forward ms", "backward ms", "x eager forward", "x eager backward",
                    "first call s / error"], _variant_rows(variants))]


def _autotune_section(data: dict) -> list[str]:
    autotune = data.get("autotune")
    if not autotune:
        return []
    phases = {p["phase"]: p for p in autotune.get("phases", [])}
    decide = phases.get("deciding", {})
    trials = [p for p in autotune.get("phases", []) if p["phase"] == "trial"]
    return ["<h2>Autotune: measured before / after</h2>",
            _table(["profile (job's settings) ms", "trials ms", "judged trial ms", "kept", "reason"],
                   [[decide.get("baseline_ms"),
                     ", ".join(f"{t['measured_ms']:.2f}" for t in trials if t.get("measured_ms")) or "-",
                     decide.get("trial_ms"), decide.get("keep"), decide.get("reason")]])]


def _memory_section(data: dict) -> list[str]:
    if not data["summary"].get("memory"):
        return []
    return ["<h2>Peak memory per rank</h2>",
            _table(["rank", "device", "estimated MiB", "measured MiB", "error %"],
                   [[m["rank"], m["device"], (m["estimated_peak_bytes"] or 0) / 2 ** 20,
                     (m["measured_peak_bytes"] or 0) / 2 ** 20, m["error_pct"]]
                    for m in data["summary"].get("memory", [])])]


def write_ps_report(run_dir: str, output: Optional[str] = None, model=None) -> tuple[str, dict]:
    """report.html of a parameter-server run (report_ps.py builds its data)."""
    from dprorun.report_ps import build_ps_report

    data = build_ps_report(run_dir, model)
    path = output or os.path.join(run_dir, "report.html")
    atomic_write_bytes(path, render_html(data).encode())
    return path, data


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
