"""Memory measurements shared by the benchmarks: peak bytes allocated while a function runs, and the
bytes autograd saves for backward."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from rlfunc.device import synchronize


def peak_allocated(run: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated while ``run()`` executes, above those allocated before it.

    On an accelerator: the device allocator's peak (torch.cuda / torch.npu share the API). On the
    CPU: the running sum of torch.profiler's memory events (allocations and frees), in time order.
    """
    if device.type != "cpu":
        accel = getattr(torch, device.type)
        synchronize(device)
        accel.reset_peak_memory_stats(device)
        before = accel.memory_allocated(device)
        run()
        synchronize(device)
        return accel.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def saved_tensor_hooks(exclude: Iterable[torch.Tensor] = ()) -> tuple[tuple, dict[int, int]]:
    """(hooks for ``torch.autograd.graph.saved_tensors_hooks``, the dict they fill): bytes of each
    distinct storage autograd saves for backward, leaving out the storages of ``exclude`` (weights)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    return (pack, lambda t: t), storages
