"""The Kineto reader on real recorded GPU/NCCL and gloo traces (../shared/fixtures) and on a fresh CPU trace."""
import collections

import pytest

from conftest import fixture_path
from dprorun.fsutil import TraceError
from dprorun.trace.kineto import read_kineto
from dprorun.trace.model import OpKind


def test_gpu_ddp_trace_with_nccl():
    trace = read_kineto(fixture_path("kineto-gpu", "nccl_parser_config_nccl_data.json.gz"))
    assert trace.distributed["backend"] == "nccl" and trace.distributed["world_size"] == 2
    assert trace.base_us > 1.7e15  # epoch microseconds
    streams = collections.Counter(op.stream for op in trace.gpu)
    assert len(streams) >= 2 and all(s.startswith("cuda:0/s") for s in streams)
    nccl = [op for op in trace.gpu if op.kind is OpKind.COMM]
    assert nccl and all("nccl" in op.name.lower() for op in nccl)
    kinds = collections.Counter(op.kind for op in trace.gpu)
    assert kinds[OpKind.BW] > 0 and kinds[OpKind.FW] > 0  # kernels attributed to their launching CPU op
    assert any(op.stream.startswith("autograd:") and op.kind is OpKind.BW for op in trace.compute)
    assert [s for s, _, _ in trace.steps][:2] == [4, 5]
    assert {op.name for op in trace.collectives} >= {"nccl:all_reduce", "nccl:broadcast"}


def test_sampled_trace_without_base_time_uses_absolute_timestamps():
    trace = read_kineto(fixture_path("kineto-gpu", "trace_filter_sampled_rank-1.json.gz"))
    assert trace.base_us == 0.0 and trace.distributed["rank"] == 1
    assert trace.gpu[0].start_us > 1.6e15
    allreduce = [op for op in trace.collectives if op.name == "nccl:all_reduce"]
    assert allreduce and allreduce[0].nbytes == 19618307 * 4  # from Input Dims / Input type


def test_gloo_cpu_only_trace():
    trace = read_kineto(fixture_path("kineto-gpu", "cpu_only_rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"))
    assert trace.distributed["backend"] == "gloo" and trace.distributed["rank"] == 34
    gloo = [op for op in trace.collectives if op.name == "gloo:all_reduce"]
    assert len(gloo) == 10 and all(op.stream.startswith("comm:") for op in gloo)
    assert gloo[0].nbytes == 321271 * 4
    assert trace.gpu == []


def test_not_a_trace(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="no traceEvents"):
        read_kineto(str(path))
    path.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": "soon", "dur": 1}]}')
    with pytest.raises(TraceError, match="non-numeric"):
        read_kineto(str(path))
