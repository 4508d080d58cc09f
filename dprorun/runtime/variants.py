"""Compute variants measured on the job's own model and batch: eager vs torch.compile of the whole model vs
torch.compile of each block separately (op fusion per region) vs bf16 autocast, forward and backward timed
separately. The optimizer's op-fusion and mixed-precision
passes scale the replay's forward/backward by these ratios instead of guessing a cost model.

Runs on rank 0 only, after the profiling window's traces are gathered, when the profile config asks for it
(`dprorun --measure-variants`, and --autotune's profiling phase). The model is called directly (not through
DDP, so nothing is all-reduced) on the last batch the window saw, with a stand-in loss (the mean of the first
floating output), through `torch.func.functional_call` with the parameters as new leaves on the same storage
(`detached_parameters`): the backward fills those leaves' gradients, never the live parameters', whose gradient
accumulators carry DDP's reducer hooks (and any of the script's own). Run on the live parameters, a measurement
marked them as used in DDP's unused-parameter accounting (which counts hooks that fire outside an iteration, for
no_sync): with find_unused_parameters=True the next iteration failed ("Encountered gradient which is undefined,
but still allreduced by DDP reducer"). Buffers and RNG states are restored afterwards, so training continues as
if nothing happened. Writes variants.json into the rank's directory:

  {"schema": "dprorun-variants", "version": 1, "reps": 10, "device": "cpu" | "cuda",
   "variants": {"eager": {"forward_us": .., "backward_us": ..},
                "compiled": {"forward_us": .., "backward_us": .., "first_call_s": ..} | {"error": ".."},
                "compiled_blocks": {..., "blocks": ["encoder.layers.0", ...]} | {"error": ".."},
                "bf16": {...} | {"error": ".."}}}

Blocks (`fusion_blocks`): the children of the model's largest container (itself, or an nn.Sequential /
nn.ModuleList up to two levels down) that have parameters and submodules of their own - a Transformer's layers,
a ResNet's residual blocks. A whole compiled model has one backward graph, so all its gradients are ready at
the end and no all-reduce overlaps the backward; compiled blocks keep one backward graph per block, so their
gradients become ready block by block and communication still overlaps (the replay models both).
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, Callable, Optional

from dprorun.runtime.outputs import tensors_requiring_grad
from dprorun.runtime.watch import RanksNeededError

VARIANTS_FILE = "variants.json"


def _first_float_tensor(obj: Any):
    """The first floating tensor of a forward's output that autograd runs back through (`outputs`: dataclass outputs
    included: a model returning one had no variant measured, "no floating tensor that requires grad")."""
    found: list = []
    tensors_requiring_grad(obj, found)
    return next((t for t in found if t.is_floating_point()), None)


def _call_once(call: Callable, args: tuple, kwargs: dict, params: list, sync: Callable) -> tuple[float, float]:
    """One forward and backward: (forward µs, backward µs); gradients dropped afterwards."""
    sync()
    t0 = time.perf_counter()
    output = call(*args, **kwargs)
    sync()
    t1 = time.perf_counter()
    loss = _first_float_tensor(output)
    if loss is None:
        raise ValueError("the model's output has no floating tensor that requires grad")
    loss.float().mean().backward()
    sync()
    t2 = time.perf_counter()
    for p in params:
        p.grad = None
    return (t1 - t0) * 1e6, (t2 - t1) * 1e6


def fusion_blocks(module) -> list[str]:
    """Names of the model's blocks (see the module docstring); [] when it has fewer than two."""
    import torch.nn as nn

    def composite(child) -> bool:
        return any(True for _ in child.children()) and any(True for _ in child.parameters())

    best: list[str] = []
    containers = [("", module)] + [(name, m) for name, m in module.named_modules()
                                   if name and name.count(".") <= 1 and isinstance(m, (nn.Sequential, nn.ModuleList))]
    for prefix, container in containers:
        blocks = [f"{prefix}.{name}" if prefix else name for name, child in container.named_children()
                  if composite(child)]
        if len(blocks) > len(best):
            best = blocks
    return best if len(best) >= 2 else []


def _compiled_blocks_call(module, blocks: list[str], aliases: dict) -> Callable:
    """Calls the model with each block's forward compiled separately (installed for the call only, so the
    model is left as it was between calls)."""
    import torch
    from torch.func import functional_call

    modules = dict(module.named_modules())
    compiled = {name: torch.compile(modules[name].forward) for name in blocks}

    def call(*a, **kw):
        previous = {name: modules[name].__dict__.get("forward") for name in compiled}
        for name, fn in compiled.items():
            modules[name].forward = fn
        try:
            return functional_call(module, aliases, a, kw)
        finally:
            for name, before in previous.items():
                if before is None:
                    del modules[name].forward  # back to the class's forward
                else:
                    modules[name].forward = before

    return call


def detached_parameters(module) -> dict:
    """{name: the parameter as a new leaf on its storage}: what a variant's call reads, and whose gradients its
    backward fills, leaving the live parameters' gradient accumulators (DDP's hooks) out of it."""
    return {name: param.detach().requires_grad_(param.requires_grad) for name, param in module.named_parameters()}


def _variant_call(name: str, module, device_type: str, aliases: dict) -> Callable:
    import torch
    from torch.func import functional_call

    if name == "eager":
        return lambda *a, **kw: functional_call(module, aliases, a, kw)
    if name == "compiled":
        compiled = torch.compile(module)  # its parameters are its _orig_mod's
        renamed = {f"_orig_mod.{key}": value for key, value in aliases.items()}
        return lambda *a, **kw: functional_call(compiled, renamed, a, kw)
    if name == "compiled_blocks":
        blocks = fusion_blocks(module)
        if not blocks:
            raise ValueError("the model has no blocks to compile separately (fewer than two)")
        return _compiled_blocks_call(module, blocks, aliases)
    if name == "bf16":
        if device_type == "cuda" and not torch.cuda.is_bf16_supported():
            raise RuntimeError("this GPU has no bf16")

        def autocast_call(*a, **kw):
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
                return functional_call(module, aliases, a, kw)

        return autocast_call
    raise ValueError(f"unknown variant {name}")


def _error(exc: Exception) -> dict:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return {"error": f"{type(exc).__name__}: {text}"[:300]}


REDIRECTED_FORWARD = ("not measured: the training framework redirects the model's forward for this call (an instance "
                      "attribute, as Lightning routes DDP's forward to training_step); calling the model again would "
                      "undo that and fail the job's own step")
SCRIPTED_MODULE = ("not measured: a TorchScript module (torch.jit.script or trace), which torch.func's functional_call "
                   "and torch.compile take no Python forward of")


def fresh_inputs(batch: Any) -> Any:
    """The batch's tensors cut from the graphs that made them (leaves asking for a gradient where they did): an
    input made by autograd in the step (PGD's perturbed batch, x + delta) led each timed backward into the step's
    graph, long freed: "Trying to backward through the graph a second time", and no variant was measured."""
    import torch
    from torch.utils._pytree import tree_map

    def fresh(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            return value.detach().requires_grad_(value.requires_grad)
        return value

    try:
        return tree_map(fresh, batch)
    except Exception:  # a container pytree cannot rebuild: the batch as it was (its variants may fail, each saying why)
        return batch


def measure_compute_variants(module, args: tuple, kwargs: dict, reps: int = 10,
                             variants: tuple[str, ...] = ("eager", "compiled", "compiled_blocks", "bf16")) -> dict:
    """{variant: {"forward_us", "backward_us", "first_call_s"} or {"error": why}}: each variant called once
    untimed (torch.compile compiles then), then the variants take turns `reps` times (drift hits all alike);
    medians. Calls run on `detached_parameters` (the live parameters' gradients and hooks untouched); the
    module's parameters, buffers and RNG states are restored whatever happens."""
    import torch

    if isinstance(module, torch.jit.ScriptModule):  # its forward is an attribute too: no framework's redirect
        return {name: {"error": SCRIPTED_MODULE} for name in variants}
    if "forward" in vars(module):  # the call is redirected for this forward only: calling it again undoes that
        return {name: {"error": REDIRECTED_FORWARD} for name in variants}
    args, kwargs = fresh_inputs(args), fresh_inputs(kwargs)
    aliases = detached_parameters(module)
    params = [p for p in aliases.values() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    saved_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    out: dict[str, dict] = {}
    calls: dict[str, Callable] = {}
    try:
        for name in variants:
            try:
                call = _variant_call(name, module, device.type, aliases)
                started = time.perf_counter()
                _call_once(call, args, kwargs, params, sync)
                calls[name] = call
                out[name] = {"first_call_s": round(time.perf_counter() - started, 3)}
                if name == "compiled_blocks":
                    out[name]["blocks"] = fusion_blocks(module)
            except Exception as exc:  # a variant that cannot run is reported, never fatal
                out[name] = _error(exc)
                if isinstance(exc, RanksNeededError):  # no variant runs without the other ranks
                    out.update({other: _error(exc) for other in variants if other not in out})
                    break
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
        for _ in range(reps):
            for name in list(calls):
                try:
                    times[name].append(_call_once(calls[name], args, kwargs, params, sync))
                except Exception as exc:
                    out[name] = _error(exc)
                    calls.pop(name)
                    times.pop(name)
        for name, rows in times.items():
            out[name]["forward_us"] = round(statistics.median(r[0] for r in rows), 3)
            out[name]["backward_us"] = round(statistics.median(r[1] for r in rows), 3)
    finally:
        with torch.no_grad():
            module.load_state_dict(saved_state)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return out


SHARED_BY = {"collectives": "the script's own collectives", "horovod": "horovod.torch's DistributedOptimizer"}


def variants_not_measured(trackers: list) -> str:
    """Why --measure-variants (--autotune's compute passes) measured nothing where no DistributedDataParallel model
    trains: rank 0 times the DDP model it saw called alone; a model whose gradients go through the script's own calls,
    FSDP or Horovod is not timed so (its forward may call the other ranks, and nothing says which module it is)."""
    primary = next((t for t in trackers if getattr(t, "primary", False)), trackers[0] if trackers else None)
    if hasattr(primary, "ddp"):
        return ("compute variants not measured: the script no longer held its DistributedDataParallel model at the "
                "window's end; the optimizer's compute passes (torch.compile, bf16) are off")
    framework = getattr(primary, "framework", "")
    what = "FSDP" if getattr(primary, "fsdp", False) else SHARED_BY.get(framework, "no wrapper dprorun profiles")
    return (f"compute variants not measured: rank 0 times a DistributedDataParallel model's eager, torch.compile and "
            f"bf16 forms alone, and this job's gradients are shared by {what}; the optimizer's compute passes "
            "(torch.compile, bf16) are off")


def measure_and_write(session, tracker, reps: int = 10) -> Optional[str]:
    """Rank 0, end of the window: measure on the tracker's model and last batch and write variants.json."""
    import sys

    from dprorun.fsutil import atomic_write_json

    if getattr(tracker, "_replicated", None) is not None:  # its forward runs DDP's steps: rank 0 alone would hang
        session.records.warnings.append("compute variants not measured: the model is replicate()'d (its own forward "
                                        "runs DDP's synchronisation, which rank 0 cannot run alone)")
        return None
    batch = getattr(tracker, "last_inputs", None)
    if batch is None:
        session.records.warnings.append("compute variants not measured: no training batch was seen in the window")
        return None
    print("[dprorun] measuring compute variants (eager, torch.compile of the model and of each block, bf16) on "
          "rank 0 ...", file=sys.stderr,
          flush=True)
    started = time.perf_counter()
    args, kwargs = batch
    use = session.script_use
    use.alone, use.alone_thread = "rank 0 times the model's compute variants alone", threading.get_ident()
    try:
        results = measure_compute_variants(tracker.model, args, kwargs, reps)
    finally:
        use.alone = ""
    try:
        device = next(tracker.model.parameters()).device.type
    except StopIteration:
        device = "cpu"
    path = os.path.join(session.rank_dir, VARIANTS_FILE)
    atomic_write_json(path, {"schema": "dprorun-variants", "version": 1, "reps": reps, "variants": results,
                             "device": device, "seconds": round(time.perf_counter() - started, 3)})
    return path
