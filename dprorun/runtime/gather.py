"""Gather every rank's trace files into the run directory of rank 0's node, over the job's own process group.

No shared filesystem is assumed. Ranks whose host is rank 0's host have already written into the run directory
(it is on their disk); the others send a bundle (see packing.py: JSON header + bytes, no pickle) over a
dedicated gloo group that only this job's ranks are members of, and rank 0 writes it atomically.
"""
from __future__ import annotations

import os
from datetime import timedelta

from dprorun.fsutil import atomic_write_bytes, make_private_dir
from dprorun.runtime.packing import BundleError, pack_files, unpack_files
from dprorun.runtime.session import RankSession, warn

HOST_BYTES = 256


def _host_tensor(host: str):
    import torch

    raw = host.encode()[:HOST_BYTES]
    buf = torch.zeros(HOST_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return buf


def _host_from_tensor(buf) -> str:
    raw = bytes(buf.tolist())
    return raw.rstrip(b"\0").decode(errors="replace")


def gather_to_rank0(session: RankSession, timeout_s: float = 120.0) -> None:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    rank = dist.get_rank()
    hosts = [torch.zeros(HOST_BYTES, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(hosts, _host_tensor(session.host), group=group)
    host_names = [_host_from_tensor(h) for h in hosts]
    remote = host_names[rank] != host_names[0]
    payload = b""
    if remote:
        files = {}
        for name in sorted(os.listdir(session.rank_dir)):
            path = os.path.join(session.rank_dir, name)
            if os.path.isfile(path) and not name.startswith("."):
                with open(path, "rb") as handle:
                    files[name] = handle.read()
        payload = pack_files(files)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    if rank == 0:
        for src in range(1, world):
            size = int(sizes[src].item())
            if size <= 0:
                continue
            buf = torch.empty(size, dtype=torch.uint8)
            dist.recv(buf, src=src, group=group)
            _write_bundle(session, src, host_names[src], buf.numpy().tobytes())
    elif remote:
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=group)
    dist.barrier(group=group)
    session.gathered_hosts = host_names
    dist.destroy_process_group(group)


def _write_bundle(session: RankSession, src: int, host: str, blob: bytes) -> None:
    try:
        files = unpack_files(blob)
    except BundleError as exc:
        warn(f"trace bundle from rank {src} ({host}) rejected: {exc}")
        return
    target = make_private_dir(os.path.join(session.cfg.run_dir, f"rank_{src}"))
    for name, data in files.items():
        atomic_write_bytes(os.path.join(target, name), data)
    atomic_write_bytes(os.path.join(target, "GATHERED_FROM"), host.encode())
