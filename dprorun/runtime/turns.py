"""Calls of several kinds taking turns within one training step (runtime/tf.py, runtime/horovod.py): which of
them begin or end an iteration."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

MAX_TURN_CALLS = 16  # calls in one step, at most, where they take turns


@dataclass
class StepTurns:
    """Training calls of several kinds (keys) taking turns within the script's step: a GAN's discriminator (n calls,
    as a WGAN's critic takes) and then its generator, each trained and synchronised on its own (TensorFlow: a step
    function each, runtime/tf.py; Horovod: a DistributedOptimizer each, runtime/horovod.py). Each call was an
    iteration (a figure half the script's step: 18.3 ms of 34.3 for a TF GAN). Once a call of the key the job
    called first follows calls of others, no more than MAX_TURN_CALLS calls after that key's previous run began
    (two models fitted an epoch each in turn are no step), they take turns: an iteration begins only at the first
    call of a run of the first key (`begins`), or ends only with a call of the key that closed the turn before it
    (`ends_with`, where a call's end is the boundary). A call of a key not seen before (the script trains another
    model now), or MAX_TURN_CALLS calls with no new step, ends the turns: every call is its own iteration again.
    TensorFlow's tracing calls count as calls here (a GAN's first step traces both functions), not as iterations."""

    first: Optional[int] = None  # the first key called
    members: set = field(default_factory=set)  # the keys seen before the turns were found
    taking_turns: bool = False
    last: Optional[int] = None  # the previous call's key
    closer: Optional[int] = None  # taking turns: the key whose call came just before the first key's run began
    calls_in_step: int = 0  # calls since the iteration began (taking turns), or since `first`'s last run began
    ended: bool = True  # (ends_with) the previous call ended an iteration

    def begins(self, key: int) -> bool:
        """Whether a call of `key`, where an iteration boundary is due before it, begins one."""
        if not self.taking_turns:
            return True
        if key not in self.members or self.calls_in_step >= MAX_TURN_CALLS:
            self.taking_turns = False
            return True
        return self._new_run(key)

    def called(self, key: int, began: bool) -> None:
        """A call of `key` returned (`began`: it began an iteration)."""
        if self.first is None:
            self.first = key
        if self.taking_turns:
            self.calls_in_step = 1 if began else self.calls_in_step + 1
        else:
            self.members.add(key)
            if self._new_run(key):
                self.taking_turns, self.closer = self.calls_in_step <= MAX_TURN_CALLS, self.last
                self.calls_in_step = 0
            self.calls_in_step += 1
        self.last = key

    def ends_with(self, key: int) -> bool:
        """Where a call's end is the iteration boundary (Horovod: an iteration ends with an optimizer's step): whether
        the call of `key` that just returned ends the iteration."""
        if self.taking_turns and (key not in self.members or self.calls_in_step >= MAX_TURN_CALLS):
            self.taking_turns = False
        self.called(key, self.ended)
        self.ended = not self.taking_turns or key == self.closer
        return self.ended

    def _new_run(self, key: int) -> bool:
        """A call of the first key after another's."""
        return key == self.first and self.last is not None and self.last != self.first
