"""Module scopes in the profiler's trace: while torch.profiler records (the window's first iterations), every
submodule's forward is wrapped in a `record_function("module:<qualified name>")` annotation, so each op of the
local DFG can be named with the layer it ran in (`trace/rundir.py` gives every profiled op its innermost
module). Removed with the per-parameter hooks at the end of the detailed tier: nothing of this runs in the
iterations the replay is built from."""
from __future__ import annotations

from dprorun.layout import SCOPE_PREFIX
from dprorun.runtime.copies import own_hook


def outside_compiled(hook):
    """A hook of the hooks' on a wrapper, run eagerly where the wrapper is compiled (torch.compile of the DDP
    wrapper): dynamo traced into it, warned of each builtin it could not trace (time.time_ns, os.getpid,
    sys._getframe: lines on every rank a plain launch does not print) and broke the graph there anyway.
    torch.compiler.disable skips it cleanly (a break at the graph's start and end, as before)."""
    try:
        import torch.compiler

        return torch.compiler.disable(hook, recursive=True)
    except (ImportError, AttributeError):  # a torch without torch.compiler: nothing compiles the module either
        return hook


def add_module_scopes(root) -> list:
    """Forward pre/post hooks on every submodule of `root` (not `root` itself) that open and close a profiler
    annotation named after the submodule; returns the handles (`handle.remove()`). TorchScript modules take no
    hooks (torch.jit.script'ed layers: "register_forward_pre_hook is not supported on ScriptModules", which
    disabled the whole profile): their ops keep the scope of the module around them, or none. While the script
    traces the module (torch.jit.trace), the hooks open nothing: the annotations had gone into its traced graph."""
    import torch
    from torch.autograd.profiler import record_function

    open_scopes: list = []
    handles = []
    for name, module in root.named_modules():
        if not name or isinstance(module, torch.jit.ScriptModule):
            continue

        def enter(mod, inputs, name=name):
            if torch.jit.is_tracing():  # the script's torch.jit.trace: the annotation would be in its graph
                return
            scope = record_function(SCOPE_PREFIX + name)
            scope.__enter__()
            open_scopes.append(scope)

        def leave(mod, inputs, output):
            if open_scopes and not torch.jit.is_tracing():
                open_scopes.pop().__exit__(None, None, None)

        # traced where the model is compiled (dynamo ignores record_function there, the graph unbroken): run
        # eagerly, they broke it at every module boundary of the iterations profiled
        handles.append(module.register_forward_pre_hook(own_hook(enter)))
        handles.append(module.register_forward_hook(own_hook(leave), always_call=True))
    return handles
