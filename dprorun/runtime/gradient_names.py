"""The parameters whose gradients a script's own collective carries (runtime/collectives.py), named in each step:
by a gradient's address, by a run of the step's gradients (model order) whose bytes add up to a flat buffer's, or, for
a buffer sent from inside the backward before its gradients reached .grad, by the backward's order of the parameters
not yet named."""
from __future__ import annotations

from typing import Callable, Iterable

from dprorun.runtime.gradient_calls import COVERED
from dprorun.runtime.watch import call_tensors


class StepGradientNames:
    """One step's naming state; `reset` at each step. `named_parameters` yields the trained models' (name,
    parameter) pairs, in model order."""

    def __init__(self, named_parameters: Callable[[], Iterable]):
        self.named_parameters = named_parameters
        self.grad_names: dict[int, str] = {}  # data_ptr of a parameter's gradient -> the parameter's name
        self.param_bytes: dict[str, int] = {}  # the trained parameters' gradient bytes, in model order
        self.unnamed: list[str] = []  # the trained parameters (model order) not yet named by a bucket of the step

    def reset(self) -> None:
        self.grad_names, self.param_bytes, self.unnamed = {}, {}, []

    def read(self) -> None:
        """The trained parameters' gradients by address (those that exist yet: inside the backward, the later
        ones come as it goes, `names_sent` reads again) and their bytes; none named yet."""
        for name, param in self.named_parameters():
            if param.grad is not None:
                self.grad_names[param.grad.data_ptr()] = name
                if name not in self.param_bytes:
                    self.param_bytes[name] = param.grad.numel() * param.grad.element_size()
                    self.unnamed.append(name)

    def names_of(self, name: str, args: tuple, kwargs: dict, tensor, nbytes: int, inside: bool) -> list[str]:
        """The parameters a gradient call carries: horovod.torch's grouped calls, each tensor of theirs named on its
        own; any other call's tensor as `names_sent` names it. [] where some tensor has no name."""
        if not name.startswith("grouped_"):
            return self.names_sent(tensor, nbytes, inside)
        names, unnamed = [], list(self.unnamed)
        for each in call_tensors(args, kwargs, *COVERED[name]):
            found = self.names_sent(each, each.numel() * each.element_size(), inside)
            if not found:
                self.unnamed[:] = unnamed  # the ones named so far stay for the step's later calls
                return []
            names += found
        return names

    def names_sent(self, tensor, nbytes: int, inside: bool) -> list[str]:
        """The parameters whose gradients `tensor` carries: the one it is (by address), or, for a flat buffer, the
        run of the step's not yet named parameters (model order) whose bytes add up to its own (the whole model;
        a chunk of it). [] where neither fits."""
        if tensor is None:
            return []
        name = self.grad_names.get(tensor.data_ptr())
        if name is None and inside:
            self.read()
            name = self.grad_names.get(tensor.data_ptr())
        if name is not None:
            if name in self.unnamed:
                self.unnamed.remove(name)
            return [name]
        run, total = [], 0
        for name in self.unnamed:
            if total >= nbytes:
                break
            run.append(name)
            total += self.param_bytes[name]
        if total != nbytes or not run:
            return self._ahead_of_accumulation(nbytes) if inside else []
        del self.unnamed[:len(run)]
        return run

    def _ahead_of_accumulation(self, nbytes: int) -> list[str]:
        """A flat buffer sent from inside the backward before its gradients reached .grad (a hook on the gradients
        themselves: register_multi_grad_hook, one call per layer): the run of trained parameters not yet named in
        the step, in the backward's order (the model's, reversed), whose sizes add up to its bytes. [] where none
        does (the buffer keeps its call's name)."""
        run, total = [], 0
        for name, param in reversed(list(self.named_parameters())):
            if not param.requires_grad or (name in self.param_bytes and name not in self.unnamed):  # named already
                continue
            if total >= nbytes:
                break
            run.append((name, param.numel() * param.element_size()))
            total += run[-1][1]
        if total != nbytes or not run:
            return []
        self.param_bytes.update(run)  # named now: a later read of the gradients leaves them out of `unnamed`
        names = [name for name, _ in run]
        self.unnamed[:] = [name for name in self.unnamed if name not in names]
        return names
