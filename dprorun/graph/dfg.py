"""GlobalDFG: ops as nodes (trace-model Op records), dependency edges as predecessor lists."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dprorun.trace.model import Op, OpKind


@dataclass
class GlobalDFG:
    nodes: list[Op] = field(default_factory=list)
    preds: list[list[int]] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def node_key(op: Op) -> str:
        return f"r{op.rank}/{op.name}"

    def add(self, op: Op) -> int:
        key = self.node_key(op)
        if key in self.index:
            raise ValueError(f"duplicate node {key}")
        self.index[key] = len(self.nodes)
        self.nodes.append(op)
        self.preds.append([])
        return self.index[key]

    def edge(self, u: int, v: int) -> None:
        if u != v and u not in self.preds[v]:
            self.preds[v].append(u)

    def chain(self, ids: list[int]) -> None:
        for a, b in zip(ids, ids[1:]):
            self.edge(a, b)

    def succs(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for v, ps in enumerate(self.preds):
            for u in ps:
                out[u].append(v)
        return out

    @property
    def edge_count(self) -> int:
        return sum(len(p) for p in self.preds)

    def to_networkx(self):
        import networkx as nx

        graph = nx.DiGraph()
        for i, op in enumerate(self.nodes):
            graph.add_node(i, name=self.node_key(op), kind=op.kind.value, rank=op.rank)
        for v, ps in enumerate(self.preds):
            for u in ps:
                graph.add_edge(u, v)
        return graph

    def topological_order(self) -> list[int]:
        """Kahn's algorithm; raises ValueError naming a node on a cycle."""
        indegree = [len(p) for p in self.preds]
        succs = self.succs()
        ready = [i for i, d in enumerate(indegree) if d == 0]
        order = []
        while ready:
            u = ready.pop()
            order.append(u)
            for v in succs[u]:
                indegree[v] -= 1
                if indegree[v] == 0:
                    ready.append(v)
        if len(order) != len(self.nodes):
            stuck = next(i for i, d in enumerate(indegree) if d > 0)
            raise ValueError(f"the graph has a cycle through {self.node_key(self.nodes[stuck])}")
        return order

    def check(self) -> list[str]:
        """Structural invariants of a global DFG; returns the problems found (empty when sound)."""
        problems = []
        try:
            self.topological_order()
        except ValueError as exc:
            problems.append(str(exc))
        sends = Counter(op.txn_id for op in self.nodes if op.phase == "send")
        recvs = Counter(op.txn_id for op in self.nodes if op.phase == "recv")
        for txn, count in sends.items():
            if recvs.get(txn, 0) != 1 or count != 1:
                problems.append(f"transaction {txn}: {count} SEND, {recvs.get(txn, 0)} RECV")
        for txn in recvs:
            if txn not in sends:
                problems.append(f"transaction {txn}: RECV without SEND")
        return problems

    def stats(self) -> dict:
        kinds = Counter(op.kind.value for op in self.nodes)
        return {"nodes": len(self.nodes), "edges": self.edge_count, "kinds": dict(kinds),
                "ranks": len({op.rank for op in self.nodes}),
                "send_recv_pairs": sum(1 for op in self.nodes if op.phase == "send"),
                "estimated_comm": sum(1 for op in self.nodes if op.kind is OpKind.COMM and op.args.get("estimated"))}
