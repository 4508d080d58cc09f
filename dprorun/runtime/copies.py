"""Copies of the script's modules carry none of the hooks' additions.

The hooks put forward hooks on the script's modules (each DDP wrapper, the model Horovod trains, every submodule
while torch.profiler names their scopes), a comm hook into DDP's list of them and a tracker on each DDP. A script
that copies its model (`copy.deepcopy` for an EMA or a best-model snapshot, `torch.save(model)` of the whole module,
any pickling) copied those too: under dprorun the copy failed ("cannot pickle '_thread.lock' object", "cannot
pickle 'ProcessGroup' object") where torchrun's and horovodrun's copy worked, and a deep copy would have carried a
copy of the whole session. `copy` and `pickle` both take a module's state from `__getstate__`: wrapped here, it
leaves out what the hooks added (marked by `own_hook`), so the copy is the one a plain launch makes (a file
torch.save writes loads where dprorun is not installed) and the original keeps its hooks.

TorchScript compiles every forward hook of a module it scripts: `torch.jit.script(model)` of a model carrying ours
failed ("UnsupportedNodeError: import statements aren't supported") where a plain launch scripted it. Scripting
now sees the module tree without them (`torch.jit._recursive.create_script_module`, which script and trace both
call); they are back on the modules when it returns.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

HOOK_MARK = "_dpro_hook"  # set on every hook of ours that goes into a module's state
USER_HOOK = "_dpro_user_hook"  # on our wrapper of the script's own DDP comm hook: the hook the script gave
TRACKER_ATTRIBUTE = "_dpro_tracker"  # the DDPTracker on a DistributedDataParallel instance
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")  # a module's forward hooks and their flags, each keyed by handle id


def own_hook(hook: Callable) -> Callable:
    """`hook` marked as ours (wrapped in a function where it takes no attribute: a bound method); module copies
    and TorchScript made to leave such hooks out."""
    _patch_module_getstate()
    _patch_scripting()
    try:
        setattr(hook, HOOK_MARK, True)
        return hook
    except (AttributeError, TypeError):
        @functools.wraps(hook)
        def marked(*args, **kwargs):
            return hook(*args, **kwargs)

        setattr(marked, HOOK_MARK, True)
        return marked


def without_our_parts(state: dict[str, Any]) -> dict[str, Any]:
    """A module's state for its copy (`state` is `__getstate__`'s, a shallow copy of the module's __dict__):
    our hooks out of its forward-hook tables (each a new dict, the module's own untouched), DDP's tracker out,
    our comm-hook wrapper in DDP's list replaced by the script's own hook (or dropped where it is ours alone)."""
    state.pop(TRACKER_ATTRIBUTE, None)
    ours = _our_hook_ids(state.get)
    for name in HOOK_TABLES if ours else ():  # the hook tables alone: a dict of the script's keyed by ints stays
        table = state.get(name)
        if isinstance(table, dict) and not ours.isdisjoint(table.keys()):
            state[name] = type(table)((key, item) for key, item in table.items() if key not in ours)
    comm_hooks = state.get("_comm_hooks")
    if isinstance(comm_hooks, list) and any(getattr(pair[0], HOOK_MARK, False) for pair in comm_hooks):
        kept = []
        for hook, hook_state in comm_hooks:
            if getattr(hook, HOOK_MARK, False):
                hook = getattr(hook, USER_HOOK, None)
            if hook is not None:
                kept.append((hook, hook_state))
        state["_comm_hooks"] = kept
    return state


def _our_hook_ids(table_named: Callable[[str, Any], Any]) -> set[int]:
    """The handle ids of our hooks in a module's forward-hook tables (`table_named(name, default)`: a module's
    attribute, or an entry of its state)."""
    tables = [table_named(name, None) for name in HOOK_TABLES[:2]]
    return {key for table in tables if isinstance(table, dict)
            for key, hook in table.items() if getattr(hook, HOOK_MARK, False)}


def patch_getstate(cls: type) -> None:
    """cls.__getstate__ (its own, or the one it inherits) gives the state without our parts; once per class."""
    if cls.__dict__.get("_dpro_copies_patched", False):
        return
    original = cls.__getstate__

    @functools.wraps(original)
    def __getstate__(self):
        return without_our_parts(original(self))

    cls.__getstate__ = __getstate__
    cls._dpro_copies_patched = True


def _patch_module_getstate() -> None:
    """nn.Module's __getstate__ (every module whose class does not define its own) and DDP's, which does."""
    import sys

    import torch.nn

    patch_getstate(torch.nn.Module)
    distributed = sys.modules.get("torch.nn.parallel.distributed")
    if distributed is not None:
        patch_getstate(distributed.DistributedDataParallel)


@contextlib.contextmanager
def without_our_hooks(root) -> Iterator[None]:
    """Our forward hooks out of every module of `root` (each table changed in place: the handles the hooks hold
    keep working) for the time of the block, then back, in their order."""
    import torch.nn

    saved = []
    if isinstance(root, torch.nn.Module):
        for module in root.modules():
            ours = _our_hook_ids(functools.partial(getattr, module))
            for name in HOOK_TABLES if ours else ():
                table = getattr(module, name, None)
                if isinstance(table, dict) and not ours.isdisjoint(table.keys()):
                    saved.append((table, dict(table)))
                    for key in ours.intersection(table.keys()):
                        del table[key]
    try:
        yield
    finally:
        for table, content in saved:
            table.clear()
            table.update(content)


def _patch_scripting() -> None:
    """torch.jit._recursive.create_script_module (torch.jit.script's and trace's way to a ScriptModule) builds it
    from the module without our hooks; once."""
    import torch.jit._recursive as recursive

    original = recursive.create_script_module
    if getattr(original, "_dpro_patched", False):
        return

    @functools.wraps(original)
    def create_script_module(nn_module, *args, **kwargs):
        with without_our_hooks(nn_module):
            return original(nn_module, *args, **kwargs)

    create_script_module._dpro_patched = True
    recursive.create_script_module = create_script_module
