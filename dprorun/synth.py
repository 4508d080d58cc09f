"""Synthetic runs in the trace model, for scale benchmarks and tests with a known answer.

`synthetic_ring_run` simulates a data-parallel job on one true clock: per iteration each rank computes
forward, then backward layer by layer; every bucket becomes ready after its layers and is all-reduced by a
ring (2(N-1) steps of SEND/RECV with latency + bytes/bandwidth + noise); then the update. Every timestamp a
rank records is then shifted by that rank's clock offset, exactly as `DPRO_TEST_CLOCK_SKEW_US` does in real
runs, and clock probes are generated with random one-way delays. The true offsets are returned with the run.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from dprorun.graph.local import OpProfile, PhaseProfile, ProfiledOp
from dprorun.graph.topology import ring_schedule, transaction_id
from dprorun.layout import CommRecord, P2PRecord
from dprorun.replay.template import BucketInfo, CommModel, JobModel, RankTemplate
from dprorun.trace.model import Bucket, Op, OpKind, RankTrace, RunTrace


@dataclass
class _RingSpec:
    """The synthetic job's shape: ranks, buckets and the link they share."""

    world: int
    buckets: int
    bucket_bytes: int
    transfer_us: float  # one chunk over one link: latency + chunk bytes / bandwidth
    noise_us: float


def synthetic_ring_run(world: int = 4, iterations: int = 10, buckets: int = 4, bucket_bytes: int = 4 << 20,
                       skew_us: Optional[list[float]] = None, seed: int = 0, bandwidth_gbps: float = 10.0,
                       latency_us: float = 30.0, noise_us: float = 20.0, probes: int = 20,
                       hosts: Optional[list[str]] = None) -> tuple[RunTrace, dict[int, float]]:
    """A DDP-like job whose buckets are all-reduced by a chunked ring (every SEND and RECV with its transaction id),
    clock probes after the iterations, and each rank's clock shifted by its skew: the run and the true offsets."""
    rng = np.random.default_rng(seed)
    skew = list(skew_us) if skew_us is not None else [float(x) for x in rng.uniform(-5000, 5000, world)]
    skew[0] = 0.0
    hosts = hosts or [f"host{r}" for r in range(world)]
    traces = {r: RankTrace(rank=r, host=hosts[r]) for r in range(world)}
    for r in range(world):
        traces[r].buckets = [Bucket(index=b, nbytes=bucket_bytes, params=[f"p{b}"]) for b in range(buckets)]
        traces[r].meta["kineto_iterations"] = []
    spec = _RingSpec(world, buckets, bucket_bytes, latency_us + (bucket_bytes // world) * 8 / (bandwidth_gbps * 1e3),
                     noise_us)
    t = 1.7e15
    for it in range(iterations):
        t = _synthetic_iteration(traces, spec, it, t, rng)
    _synthetic_probes(traces, world, probes, t, rng)
    for r in range(world):  # what each rank's clock would have recorded
        _shift_clock(traces[r], skew[r])
    manifest = {"schema": "dprorun-run", "job_id": f"synthetic-{world}x{iterations}", "world_size": world}
    true_offsets = {r: skew[0] - skew[r] for r in range(world)}
    return RunTrace(run_dir="<synthetic>", manifest=manifest, ranks=traces), true_offsets


def _synthetic_iteration(traces: dict[int, RankTrace], spec: _RingSpec, it: int, t: float,
                         rng: np.random.Generator) -> float:
    """One iteration from time t: forward, backward with a bucket ready every 1.5 ms, each bucket's ring, update.
    Returns when the next iteration starts."""
    world = spec.world
    start = {r: t + rng.uniform(0, 50) for r in range(world)}
    fw_end = {r: start[r] + 2000 + rng.normal(0, 30) for r in range(world)}
    ready = {r: [] for r in range(world)}
    clock = dict(fw_end)
    for b in range(spec.buckets):
        for r in range(world):
            clock[r] += 1500 + rng.normal(0, 30)
            ready[r].append(clock[r])
    link_free = {r: 0.0 for r in range(world)}
    bucket_done = {r: [] for r in range(world)}
    ring_free = dict.fromkeys(range(world), 0.0)
    for b in range(spec.buckets):
        step_ready = {r: max(ready[r][b], ring_free[r]) for r in range(world)}
        first_send = _synthetic_ring(traces, spec, f"bucket{b}", it, step_ready, link_free, rng)
        for r in range(world):
            ring_free[r] = step_ready[r]
            bucket_done[r].append(step_ready[r])
            traces[r].ops.append(Op(name=f"queue.bucket{b}", kind=OpKind.QUEUE, rank=r, start_us=ready[r][b],
                                    end_us=first_send[r], iteration=it, stream="comm", tensor=f"bucket{b}",
                                    nbytes=spec.bucket_bytes, phase="queue", source="synth"))
            traces[r].ops.append(Op(name=f"allreduce.bucket{b}", kind=OpKind.COMM, rank=r,
                                    start_us=first_send[r], end_us=step_ready[r], iteration=it, stream="comm",
                                    tensor=f"bucket{b}", nbytes=spec.bucket_bytes, phase="transmit",
                                    granularity="chunk", source="synth"))
    ends = {}
    for r in range(world):
        update_start = max(clock[r], max(bucket_done[r]))
        ends[r] = update_start + 800
        traces[r].ops += [
            Op(name="forward0", kind=OpKind.FW, rank=r, start_us=start[r], end_us=fw_end[r], iteration=it,
               stream="phase", source="synth"),
            Op(name="backward0", kind=OpKind.BW, rank=r, start_us=fw_end[r], end_us=clock[r], iteration=it,
               stream="phase", source="synth"),
            Op(name="update", kind=OpKind.UPDATE, rank=r, start_us=update_start, end_us=ends[r], iteration=it,
               stream="phase", source="synth")]
        traces[r].grad_ready += [(it, f"p{b}", ready[r][b]) for b in range(spec.buckets)]
    t = max(ends.values()) + 100
    for r in range(world):
        traces[r].iterations.append((it, start[r], t))
        traces[r].profiled_iterations.append(it)
    return t


def _synthetic_ring(traces: dict[int, RankTrace], spec: _RingSpec, key: str, it: int, step_ready: dict[int, float],
                    link_free: dict[int, float], rng: np.random.Generator) -> dict[int, float]:
    """The 2(N-1) steps of one bucket's ring: a SEND on the left rank and a RECV on the right one per step and rank,
    each link busy one chunk at a time. step_ready is advanced to each rank's end of the ring; returns each rank's
    first send."""
    world = spec.world
    chunk_bytes = spec.bucket_bytes // world
    first_send = {}
    for step in range(2 * (world - 1)):
        sends = {}
        for r in range(world):
            stage, _, send_c, recv_c = ring_schedule(r, world)[step]
            s0 = step_ready[r] + rng.uniform(0, 10)
            first_send.setdefault(r, s0)
            sends[r] = (s0, send_c)
        new_ready = {}
        for r in range(world):
            left = (r - 1) % world
            s0, chunk = sends[left]
            arrive = max(s0, link_free[left]) + spec.transfer_us + abs(rng.normal(0, spec.noise_us))
            link_free[left] = arrive
            posted = step_ready[r] + rng.uniform(0, 5)
            recv_end = max(arrive, posted + 1.0)
            send_end = arrive + rng.uniform(0, 5)
            txn = transaction_id(key, it, step, chunk, left, r)
            traces[left].ops.append(Op(name=f"send.{key}.s{step}.c{chunk}", kind=OpKind.COMM, rank=left,
                                       start_us=s0, end_us=send_end, iteration=it, stream="comm",
                                       tensor=key, nbytes=chunk_bytes, peer=r, chunk=chunk, step=step,
                                       txn_id=txn, phase="send", source="synth", granularity="chunk"))
            traces[r].ops.append(Op(name=f"recv.{key}.s{step}.c{chunk}", kind=OpKind.COMM, rank=r,
                                    start_us=posted, end_us=recv_end, iteration=it, stream="comm",
                                    tensor=key, nbytes=chunk_bytes, peer=left, chunk=chunk, step=step,
                                    txn_id=txn, phase="recv", source="synth", granularity="chunk",
                                    args={"posted_us": posted}))
            new_ready[r] = recv_end
        for r in range(world):
            step_ready[r] = max(new_ready[r], sends[r][0])
    return first_send


def _synthetic_probes(traces: dict[int, RankTrace], world: int, probes: int, t: float,
                      rng: np.random.Generator) -> None:
    """Clock probes between rank 0 and every other rank after the iterations (round trips of 40-70 µs)."""
    for r in range(1, world):
        rows_origin, rows_echo = [], []
        for k in range(probes):
            t0 = t + 1000 * (r * probes + k)
            t1 = t0 + 20 + abs(rng.normal(0, 15))
            t2 = t1 + 2
            t3 = t2 + 20 + abs(rng.normal(0, 15))
            rows_origin.append([r, k, "origin", t0, t3])
            rows_echo.append([0, k, "echo", t1, t2])
        traces[0].clock.setdefault("probes", []).extend(rows_origin)
        traces[r].clock.setdefault("probes", []).extend(rows_echo)


def _shift_clock(trace: RankTrace, shift: float) -> None:
    """Every timestamp of one rank moved by its clock's skew."""
    for op in trace.ops:
        op.start_us += shift
        op.end_us += shift
        if "posted_us" in op.args:
            op.args["posted_us"] += shift
    trace.iterations = [(i, s + shift, e + shift) for i, s, e in trace.iterations]
    trace.grad_ready = [(i, n, x + shift) for i, n, x in trace.grad_ready]
    trace.clock["probes"] = [[p, k, role, a + shift, b + shift] for p, k, role, a, b in trace.clock.get("probes", [])]
    trace.ops.sort(key=lambda op: op.start_us)


def resnet50_params() -> dict[str, int]:
    """161 tensors of ResNet-50 (conv weights, batch-norm weight/bias, fc), sizes in bytes (fp32)."""
    sizes = {"conv1.weight": 64 * 3 * 7 * 7, "bn1.weight": 64, "bn1.bias": 64}
    cin = 64
    for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
        for b in range(blocks):
            prefix = f"layer{stage + 1}.{b}"
            shapes = [(width, cin, 1), (width, width, 3), (4 * width, width, 1)]
            for k, (cout, ci, ks) in enumerate(shapes, start=1):
                sizes[f"{prefix}.conv{k}.weight"] = cout * ci * ks * ks
                sizes[f"{prefix}.bn{k}.weight"] = cout
                sizes[f"{prefix}.bn{k}.bias"] = cout
            if b == 0:
                sizes[f"{prefix}.downsample.0.weight"] = 4 * width * cin
                sizes[f"{prefix}.downsample.1.weight"] = 4 * width
                sizes[f"{prefix}.downsample.1.bias"] = 4 * width
            cin = 4 * width
    sizes["fc.weight"], sizes["fc.bias"] = 1000 * 2048, 1000
    return {name: 4 * n for name, n in sizes.items()}


def resnet50_job_model(world: int, bandwidth_gbit: float = 10.0) -> JobModel:
    """A ResNet-50-shaped job model (30 ms forward, 60 ms backward, gradients ready in reverse layer order,
    one measured bucket) for replay and optimizer benchmarks and tests."""
    params = resnet50_params()
    names = list(params)
    fractions = {name: 1.0 - (k + 1) / len(names) for k, name in enumerate(names)}  # last layer ready first
    template = RankTemplate(rank=0, forward_us=30000, loss_us=200, backward_segments_us=[60000],
                            bucket_ready_order=[], update_us=5000, tail_us=2000, enqueue_cost_us=50,
                            backward_us=60000, iterations_used=10, measured_iteration_us=0)
    comm = CommModel(alpha_us=20.0, bandwidth_bytes_per_us=bandwidth_gbit * 125.0,
                     source=f"synthetic {bandwidth_gbit:g} Gbit/s")
    model = JobModel(world, {0: template}, [BucketInfo("bucket0", sum(params.values()), names, 0.0)], params,
                     fractions, comm, 25.0)
    model.op_profiles = {0: resnet50_op_profile(names)}
    return model


def resnet50_op_profile(param_names: list[str]) -> OpProfile:
    """A ResNet-50-shaped op-level profile (equal ops): forward conv2d / batch_norm (+ relu) per module, backward
    the module's backward op and one AccumulateGrad per parameter in reverse order, update one add_ per
    parameter."""
    modules = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in param_names))

    def phase(name: str, ops: list[tuple[str, str, str]]) -> PhaseProfile:
        n = len(ops)
        return PhaseProfile(name, 1.0, [ProfiledOp(op, kind, scope, k / n, (k + 1) / n)
                                        for k, (op, kind, scope) in enumerate(ops)])

    forward, backward = [], []
    for module in modules:
        conv = "conv" in module or "downsample.0" in module
        forward.append(("aten::conv2d" if conv else "aten::batch_norm", "FW", module))
        if not conv:
            forward.append(("aten::relu", "FW", module))
    for module in reversed(modules):
        conv = "conv" in module or "downsample.0" in module
        backward.append(("ConvolutionBackward0" if conv else "NativeBatchNormBackward0", "BW", module))
        backward += [("AccumulateGrad", "BW", module) for p in param_names if p.rsplit(".", 1)[0] == module]
    update = [("aten::add_", "UPDATE", name.rsplit(".", 1)[0]) for name in param_names]
    return OpProfile(0, 0, {"forward": phase("forward", forward), "backward": phase("backward", backward),
                            "update": phase("update", update)})


RANKS_PER_HOST = 8


def _load(path: str):
    with open(path) as handle:
        return json.load(handle)


def _text(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _dump(doc, path: str) -> None:
    _write_text(path, json.dumps(doc))


def _shifted_comm(record: CommRecord, shift) -> CommRecord:
    return replace(record, enqueue_us=shift(record.enqueue_us), enqueued_us=shift(record.enqueued_us),
                   done_us=shift(record.done_us))


def _shifted_p2p(record: P2PRecord, shift) -> P2PRecord:
    return replace(record, start_us=shift(record.start_us), end_us=shift(record.end_us))


def _shift_events(doc: dict, rank: int, world: int, host: str, offset: float, jitter: list[float]) -> dict:
    doc = json.loads(json.dumps(doc))
    doc.update(rank=rank, world_size=world, host=host, local_rank=rank % RANKS_PER_HOST)
    for tracker in doc.get("trackers", []):  # one DDP across the new world, as the seed's spanned its own
        if tracker.get("group_ranks"):
            tracker["group_ranks"] = list(range(world))

    def shift(t):
        return t + offset if isinstance(t, (int, float)) else t
    doc["iteration_starts_us"] = [t + offset + jitter[i % len(jitter)] for i, t in enumerate(doc["iteration_starts_us"])]
    doc["spans"] = [[i, n, shift(a), shift(b)] for i, n, a, b in doc["spans"]]
    doc["comm"] = [_shifted_comm(CommRecord.from_row(row), shift).row() for row in doc["comm"]]
    doc["grad_ready"] = [[i, n, shift(t)] for i, n, t in doc["grad_ready"]]
    doc["p2p"] = [_shifted_p2p(P2PRecord.from_row(row), shift).row() for row in doc.get("p2p", [])]
    for key in ("start_us", "end_us"):
        if doc["window"].get(key) is not None:
            doc["window"][key] += offset
    return doc


def replicate_run_dir(seed: str, world: int, target: str, rng: random.Random) -> dict[int, float]:
    """An N-rank run directory from a real 2-rank one (for scale benchmarks and tests): rank r is a copy of seed
    rank r mod 2 with its rank fields renumbered, eight ranks to a host ("node<r // 8>"), every timestamp (events,
    clean.json, clock probes, the profiler's base time) shifted by its host's clock offset (uniform in +-3 ms,
    node 0 at 0) plus a per-rank jitter of up to 200 us on iteration starts; rank 0's clock probes extended to
    every rank. Returns the injected offsets (alignment should find offset[0] - offset[r])."""
    os.makedirs(target)
    manifest = _load(os.path.join(seed, "manifest.json"))
    manifest["world_size"] = world
    _dump(manifest, os.path.join(target, "manifest.json"))
    events = {r: _load(os.path.join(seed, f"rank_{r}", "events.json")) for r in (0, 1)}
    kineto = {r: _text(os.path.join(seed, f"rank_{r}", "kineto_trace.json")) for r in (0, 1)}
    clean = {r: _load(os.path.join(seed, f"rank_{r}", "clean.json"))
             for r in (0, 1) if os.path.exists(os.path.join(seed, f"rank_{r}", "clean.json"))}
    host_offset = {0: 0.0}
    offsets = {}
    origin = [p for p in events[0]["clock_probes"] if p[2] == "origin" and p[0] == 1]
    echo = [p for p in events[1]["clock_probes"] if p[2] == "echo"]
    for rank in range(world):
        node = rank // RANKS_PER_HOST
        offset = host_offset.setdefault(node, rng.uniform(-3000.0, 3000.0))
        offsets[rank] = offset
        jitter = [rng.uniform(0.0, 200.0) for _ in range(8)]
        doc = _shift_events(events[rank % 2], rank, world, f"node{node}", offset, jitter)
        if rank == 0:
            doc["clock_probes"] = [[peer, k, "origin", a, b] for peer in range(1, world) for _, k, _, a, b in origin]
        else:
            doc["clock_probes"] = [[0, k, "echo", a + offset, b + offset] for _, k, _, a, b in echo]
        folder = os.path.join(target, f"rank_{rank}")
        os.makedirs(folder)
        _dump(doc, os.path.join(folder, "events.json"))
        text = re.sub(r'"baseTimeNanoseconds"\s*:\s*(\d+)',
                      lambda m: f'"baseTimeNanoseconds": {int(m.group(1)) + int(offset * 1000)}', kineto[rank % 2],
                      count=1)
        text = re.sub(r'"rank"\s*:\s*\d+', f'"rank": {rank}', text, count=1)
        _write_text(os.path.join(folder, "kineto_trace.json"), text)
        if rank % 2 in clean:
            doc_clean = dict(clean[rank % 2], rank=rank,
                             iteration_starts_us=[t + offset for t in clean[rank % 2]["iteration_starts_us"]])
            _dump(doc_clean, os.path.join(folder, "clean.json"))
        for name in ("samples.json",):
            src = os.path.join(seed, f"rank_{rank % 2}", name)
            if os.path.exists(src):
                shutil.copy(src, folder)
    return offsets
