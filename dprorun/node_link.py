"""What the dprorun processes of a multi-host job say to each other when the ranks themselves cannot (a parameter-
server job's roles run MXNet's own Python, without torch): one TCPStore on node 0 (master address, master port +
1, or DPRO_AGENT_PORT), through which
  - every other node measures its clock against node 0's before the roles start (`probe_clock`: round trips, the
    offset from the fastest; node 0 answers on a thread), written to node 0's run directory as `node_clocks.json`;
  - a node whose roles failed says so at once (`fail`), and every node's launch loop stops its own roles when a
    peer failed (`peer_failure`): a parameter-server job cannot go on without any of its roles;
  - at the end every other node sends its run directory's role folders and logs (`send_run_dir`), and node 0
    unpacks them into its own (`receive_run_dirs`): no shared filesystem needed.
"""
from __future__ import annotations

import io
import json
import os
import socket
import tarfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from dprorun.fsutil import atomic_write_json
from dprorun.layout import GATHERED_MARK, NODE_CLOCKS_FILE

AGENT_PORT_ENV = "DPRO_AGENT_PORT"
PROBE_ROUNDS = 20


@dataclass
class NodeClock:
    node: int
    host: str
    offset_us: float  # node 0's clock minus this node's, from the fastest round trip
    rtt_us: float  # that round trip: the offset is known within +- rtt / 2

    def to_json(self) -> dict:
        return {"node": self.node, "host": self.host, "offset_us": round(self.offset_us, 1),
                "uncertainty_us": round(self.rtt_us / 2, 1)}


def link_port(master_port: int) -> int:
    """The port node 0's link store listens on: $DPRO_AGENT_PORT, or the master port + 1."""
    return int(os.environ.get(AGENT_PORT_ENV) or master_port + 1)


@dataclass
class NodeLink:
    node: int
    nnodes: int
    store: object  # torch.distributed.TCPStore
    address: tuple = ()  # (host, port, timeout s): for the responder threads' own connections
    responders: list = field(default_factory=list)

    @classmethod
    def connect(cls, node: int, nnodes: int, master_addr: str, master_port: int,
                timeout_s: float = 300.0) -> "NodeLink":
        from datetime import timedelta

        from torch.distributed import TCPStore

        port = link_port(master_port)
        store = TCPStore(master_addr, port, nnodes, node == 0, timedelta(seconds=timeout_s),
                         wait_for_workers=False)
        link = cls(node, nnodes, store, (master_addr, port, timeout_s))
        if node == 0:
            for peer in range(1, nnodes):
                thread = threading.Thread(target=link._answer_probes, args=(peer,), daemon=True)
                thread.start()
                link.responders.append(thread)
        return link

    # ---- clocks --------------------------------------------------------------------------------------------------
    def _answer_probes(self, peer: int) -> None:
        """Node 0, one thread per peer, on a connection of its own (a store client serves one call at a time: the
        main thread's wait for the peers would otherwise hold back the answers they wait for)."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        try:
            host, port, timeout_s = self.address
            store = TCPStore(host, port, self.nnodes, False, timedelta(seconds=timeout_s), wait_for_workers=False)
            for i in range(PROBE_ROUNDS):
                store.get(f"ping/{peer}/{i}")
                store.set(f"pong/{peer}/{i}", str(time.time_ns()))
        except Exception:  # the peer never came or left: nothing to answer
            pass

    def probe_clock(self) -> Optional[NodeClock]:
        """This node's clock against node 0's (node 0: None)."""
        if self.node == 0:
            return None
        best = None
        for i in range(PROBE_ROUNDS):
            t0 = time.time_ns()
            self.store.set(f"ping/{self.node}/{i}", "1")
            remote = int(self.store.get(f"pong/{self.node}/{i}"))
            t3 = time.time_ns()
            rtt = (t3 - t0) / 1000.0
            offset = (remote - (t0 + t3) / 2) / 1000.0
            if best is None or rtt < best.rtt_us:
                best = NodeClock(self.node, socket.gethostname(), offset, rtt)
        self.store.set(f"clock/{self.node}", json.dumps(best.to_json()))
        return best

    def missing_nodes(self, timeout_s: float) -> list[int]:
        """Node 0: the nodes that had not measured their clocks (so had not joined) within timeout_s."""
        from datetime import timedelta

        keys = [f"clock/{peer}" for peer in range(1, self.nnodes)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
            return []
        except Exception:  # timed out: say which
            return [peer for peer in range(1, self.nnodes) if not self.store.check([f"clock/{peer}"])]

    def release_responders(self, peers: list[int], timeout_s: float = 5.0) -> None:
        """Node 0 giving up on `peers`: their responder threads, blocked in a store get, are let through (their pings
        set here) and joined, so that none is inside the store's C++ call when the process exits: its timeout firing
        during the interpreter's shutdown aborted dprorun ("terminate called without an active exception", exit -6
        after the right message; the suite on a clean clone, once)."""
        for peer in peers:
            for i in range(PROBE_ROUNDS):
                try:
                    self.store.set(f"ping/{peer}/{i}", "0")
                except Exception:  # the store is gone: the responder's own get fails and it returns
                    break
        deadline = time.monotonic() + timeout_s
        for thread in self.responders:
            thread.join(max(0.0, deadline - time.monotonic()))

    def write_clocks(self, run_dir: str, timeout_s: float = 60.0) -> dict:
        """Node 0: every node's clock offset, as measured by that node, in run_dir/node_clocks.json."""
        nodes = {"0": {"node": 0, "host": socket.gethostname(), "offset_us": 0.0, "uncertainty_us": 0.0}}
        for peer in range(1, self.nnodes):
            value = self._get(f"clock/{peer}", timeout_s)
            if value is not None:
                nodes[str(peer)] = json.loads(value)
        atomic_write_json(os.path.join(run_dir, NODE_CLOCKS_FILE), {"nodes": nodes}, indent=2)
        return nodes

    # ---- failures ------------------------------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        try:
            self.store.set(f"failed/{self.node}", message)
        except Exception:
            pass

    def peer_failure(self) -> Optional[str]:
        """'node K: why' for the first peer that said its roles failed, else None (never blocks)."""
        try:
            for peer in range(self.nnodes):
                if peer != self.node and self.store.check([f"failed/{peer}"]):
                    return f"node {peer}: {self.store.get(f'failed/{peer}').decode(errors='replace')}"
        except Exception:
            return None
        return None

    # ---- the run directory ---------------------------------------------------------------------------------------
    def send_run_dir(self, run_dir: str, exit_code: int, message: str) -> None:
        """The role folders (rank_*, server_*) and logs of this node's run directory, to node 0."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name in sorted(os.listdir(run_dir)):
                if name.startswith(("rank_", "server_")):
                    tar.add(os.path.join(run_dir, name), arcname=name)
                elif name == "logs":
                    tar.add(os.path.join(run_dir, name), arcname=f"logs/node{self.node}")
        meta = {"host": socket.gethostname(), "exit_code": exit_code, "message": message}
        self.store.set(f"bundle/{self.node}", buffer.getvalue())
        self.store.set(f"bundle_meta/{self.node}", json.dumps(meta))

    def receive_run_dirs(self, run_dir: str, timeout_s: float) -> dict[int, dict]:
        """Node 0: every other node's folders unpacked into run_dir (each role folder marked with the host it came
        from); per node what it said of its roles, or {"missing": reason}."""
        out: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        for peer in range(1, self.nnodes):
            meta = self._get(f"bundle_meta/{peer}", max(1.0, deadline - time.monotonic()))
            if meta is None:
                out[peer] = {"missing": f"node {peer} sent no traces within {timeout_s:g} s"}
                continue
            out[peer] = json.loads(meta)
            blob = self.store.get(f"bundle/{peer}")
            with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
                tar.extractall(run_dir, filter="data")
                roles = {m.name.split("/")[0] for m in tar.getmembers() if m.name.startswith(("rank_", "server_"))}
            for role in roles:
                with open(os.path.join(run_dir, role, GATHERED_MARK), "w") as handle:
                    handle.write(out[peer]["host"])
        return out

    def _get(self, key: str, timeout_s: float) -> Optional[bytes]:
        from datetime import timedelta

        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
            return self.store.get(key)
        except Exception:
            return None

