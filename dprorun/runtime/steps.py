"""Which torch optimizer steps mark the job's iterations. A loop that steps several optimizers (a GAN's critic every
step and its generator every 5th, per-module optimizers, an embedding's SparseAdam beside a dense Adam) takes one
iteration per step of its most-stepped optimizer, the leader; the others' steps are inside those iterations. An
optimizer the script stops stepping (replaced by a new one: a learning-rate finder's, a phase of fine-tuning) loses
the lead once another one stepped STALE_LEADER_STEPS times since the leader's latest step, or at once where the
job trains another DDP model (`new_lead`: the model after a learning-rate finder's, the next fold)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

STALE_LEADER_STEPS = 2


@dataclass
class LeadingOptimizerSteps:
    counts: dict[int, int] = field(default_factory=dict)  # id(optimizer) -> its steps since the lead was (re)taken
    others_since_leader: dict[int, int] = field(default_factory=dict)  # id -> its steps since the leader's latest
    leader: Optional[int] = None  # id of the optimizer whose steps are the iterations
    leading_steps: int = 0  # the leader's steps (the iterations' steps), every leader's together
    total: int = 0  # every optimizer's steps

    def new_lead(self) -> None:
        """The next optimizer to step leads (the job went on to train another model)."""
        self.counts.clear()
        self.others_since_leader.clear()
        self.leader = None

    def step(self, optimizer_id: int) -> bool:
        """Count one step of this optimizer; True where it is a leading step (one iteration's)."""
        self.total += 1
        if self.leader is not None and optimizer_id != self.leader:
            since = self.others_since_leader.get(optimizer_id, 0) + 1
            self.others_since_leader[optimizer_id] = since
            if since >= STALE_LEADER_STEPS:  # the leader no longer steps: counting starts again from this one
                self.new_lead()
        count = self.counts.get(optimizer_id, 0) + 1
        self.counts[optimizer_id] = count
        if self.leader is None or optimizer_id == self.leader or count > self.counts[self.leader]:
            self.leader = optimizer_id
            self.others_since_leader.clear()
            self.leading_steps += 1
            return True
        return False
