"""Where tensors live: device resolution, autocast dtype, distributed backend and profiler per device.

Everything in rlfunc that needs a device asks this module, so the same code runs on Ascend NPUs
(torch_npu), NVIDIA GPUs and CPUs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import torch

from rlfunc.errors import ConfigError

_KNOWN = ("auto", "cpu", "cuda", "npu")


def npu_available() -> bool:
    """True when torch_npu is importable and reports at least one NPU."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Resolve a device name; ``"auto"`` picks npu > cuda > cpu.

    Args:
        device: "auto", "cpu", "cuda", "npu", optionally with an index ("cuda:1"), or a torch.device.

    Returns:
        A concrete ``torch.device``.

    Raises:
        ConfigError: the name is not one of the above, or names a device this machine lacks.
    """
    if isinstance(device, torch.device):
        return device
    kind = str(device).split(":")[0]
    if kind not in _KNOWN:
        raise ConfigError(f"device={device!r}: expected one of {', '.join(_KNOWN)} (optionally ':index')")
    if kind == "auto":
        if npu_available():
            return torch.device("npu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if kind == "npu" and not npu_available():
        raise ConfigError(f"device={device!r}: torch_npu is not installed or sees no NPU (pip install .[npu])")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: this machine has no CUDA device")
    try:
        return torch.device(device)
    except RuntimeError:  # a known kind with a bad index, e.g. "cpu:x" or "cpu:-1"
        raise ConfigError(f"device={device!r}: expected one of {', '.join(_KNOWN)} (optionally ':index')") from None


def autocast_dtype(device: torch.device) -> torch.dtype:
    """The reduced-precision dtype to autocast to on ``device``.

    bfloat16 on CPU and on CUDA devices that support it; float16 elsewhere (older GPUs, and NPUs,
    where fp16 is the well-supported mixed-precision type and a GradScaler is needed).
    """
    if device.type == "cpu":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float16


def distributed_backend(device: torch.device) -> str:
    """torch.distributed backend for ``device``: hccl (npu), nccl (cuda), gloo (cpu)."""
    return {"npu": "hccl", "cuda": "nccl"}.get(device.type, "gloo")


def supports_vmap(device: torch.device) -> bool:
    """False where torch.func.vmap is unavailable (torch_npu); callers then use a loop."""
    return device.type != "npu"


def set_threads(threads: int) -> int:
    """Set torch's intra-op CPU threads to ``threads`` (``RunConfig.torch_threads``; 0: leave torch's
    default), at most the cores this process may run on: more only oversubscribes them, and a huge
    count made torch's thread pool crash the process (``--torch-threads 100000``: a segfault). A run
    configured on a larger machine and resumed on this one gets this one's cores. Warns when it caps.

    Returns:
        the threads torch uses now."""
    if threads:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if threads > cores:
            warnings.warn(f"torch_threads={threads}: this process may run on {cores} cores; using {cores}", stacklevel=2)
            threads = cores
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device``; call only at rollout/update boundaries (for timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def profiler(device: torch.device, trace_dir: str, *, wait: int, warmup: int, active: int, worker: str):
    """The profiler of ``device``'s kind, as a context manager with ``.step()``: torch_npu.profiler
    on NPUs, torch.profiler elsewhere (CPU activity, plus CUDA on CUDA devices). After ``wait`` and
    ``warmup`` steps it records ``active`` steps and writes one TensorBoard trace
    (``worker.*.pt.trace.json``) into ``trace_dir``; ``record_function`` ranges show in it.

    Raises:
        ConfigError: ``device`` is an NPU and torch_npu is not installed.
    """
    if device.type == "npu":
        try:
            import torch_npu
        except ImportError:
            raise ConfigError("profile: device npu needs torch_npu (pip install .[npu])") from None
        prof = torch_npu.profiler
        activities = [prof.ProfilerActivity.CPU, prof.ProfilerActivity.NPU]
    else:
        prof = torch.profiler
        activities = [prof.ProfilerActivity.CPU] + ([prof.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return prof.profile(
        activities=activities,
        schedule=prof.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=prof.tensorboard_trace_handler(trace_dir, worker_name=worker),
        record_shapes=False,
        with_stack=False,
    )


_NO_RANGE = contextlib.nullcontext()


def span(name: str):
    """A named range in the profiler's trace (``torch.profiler.record_function``) while a profiler
    records, else a no-op: about 0.4 us when none records, against some 10-30 us for a
    ``record_function`` that nothing reads (it dispatches an op either way), so ranges can sit
    inside the env-step loop. (A profiler that does not turn on torch's autograd-profiler flag would
    see none of them.)"""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_RANGE


def local_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of data-parallel rank ``local_rank`` on its host: index ``local_rank`` of
    ``device``'s kind (cuda, npu), made the current device; ``device`` itself on CPU.

    Raises:
        ConfigError: the host has fewer devices of that kind than ``local_rank + 1``.
    """
    if device.type not in ("cuda", "npu"):
        return device
    backend = torch.cuda if device.type == "cuda" else torch.npu
    count = backend.device_count()
    if not 0 <= local_rank < count:
        raise ConfigError(f"LOCAL_RANK={local_rank}: this host has {count} {device.type} device(s)")
    local = torch.device(device.type, local_rank)
    backend.set_device(local)
    return local


def compile_backend(device: torch.device) -> str | None:
    """The torch.compile backend for ``device``, or None where rlfunc runs eager: inductor on CUDA,
    and on CPU where a C++ compiler is on PATH (inductor builds its CPU kernels with one); None on
    NPUs (torchair is untested here) and other devices."""
    import shutil

    if device.type == "cuda":
        return "inductor"
    if device.type == "cpu" and any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "inductor"
    return None


def _skip_tensordict_cache_guards(guard_entries) -> list[bool]:
    """torch.compile's guard filter: drop the guards on tensordict's module globals (memo caches such as
    ``_TENSORCLASS_MEMO`` that grow whenever the rest of a run meets a new type, which would recompile the
    step mid-run although nothing it computes changed); keep every other guard."""
    return [not (entry.is_global and "tensordict" in entry.name) for entry in guard_entries]


def compile_step(fn, device: torch.device, mode: str, what: str, *, static_args: tuple[int, ...] = ()):
    """``fn`` through torch.compile for ``--compile mode`` (off | auto | on), or ``fn`` itself.

    One whole graph (fullgraph=True: a graph break is an error, not a slow path), static shapes
    (dynamic=False: the hot loop's minibatches have one shape). On CUDA the compiled code runs as CUDA
    graphs (inductor's ``triton.cudagraphs``, what mode "reduce-overhead" sets; torch.compile takes a
    mode or options, not both): the tensors of the arguments named by ``static_args`` (positions of
    the arguments that persist across calls and are updated in place: parameters, optimizer state,
    target networks) are marked static addresses, so the graphs read and write them where they are
    instead of skipping CUDA graphs for a mutated input; every call begins a new graph step
    (``torch.compiler.cudagraph_mark_step_begin``) and returns copies of the outputs, which the next
    replay would overwrite. Compilation happens at the first call (inductor caches its kernels on
    disk across runs, ``TORCHINDUCTOR_CACHE_DIR``). The returned function's ``compile_s`` is the
    wall-clock of its first call (None before it).

    Raises:
        ConfigError: ``mode`` "on" and no backend for ``device`` (:func:`compile_backend`), or the
            compiler fails at the first call (a C++ or Triton build error, a broken kernel cache):
            one line naming the backend and ``--compile off``. "auto" then warns once and runs
            ``fn`` eagerly (for the whole run).
    """
    if mode == "off":
        return fn
    backend = compile_backend(device)
    if backend is None:
        msg = f"--compile {mode}: {what} has no torch.compile backend on device {device.type} (inductor needs cuda or a cpu with a C++ compiler)"
        if mode == "on":
            raise ConfigError(msg + "; use --compile off")
        import warnings

        warnings.warn(msg + "; running eager", stacklevel=2)

        def eager(*args):
            return fn(*args)

        eager.compile_s, eager.eager = None, True  # never compiles: callers read compile_s as for a compiled step
        return eager
    from torch.utils._pytree import tree_leaves, tree_map

    graphs = device.type == "cuda"
    options = {"guard_filter_fn": _skip_tensordict_cache_guards}
    if graphs:
        options["triton.cudagraphs"] = True
        # inductor's loop reordering after fusion hit an internal assertion (scheduler
        # reorder_loops_by_dep_pair) on sac's Pendulum-v1 step under torch 2.11 + CUDA; off, it compiles
        # (bench/RESULTS.md "GPU rows", 2026-12-04)
        options["loop_ordering_after_fusion"] = False
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=options)

    def run(*args):
        if not graphs:
            return compiled(*args)
        for i in static_args:  # every call: a step may be handed new tensor objects over the same storage
            for leaf in tree_leaves(args[i]):
                if isinstance(leaf, torch.Tensor):
                    torch._dynamo.mark_static_address(leaf)
        torch.compiler.cudagraph_mark_step_begin()
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, compiled(*args))

    def call(*args):
        if call.compile_s is not None:
            return fn(*args) if call.eager else run(*args)
        import time

        t0 = time.perf_counter()
        # once eager, on copies: bad input fails here in plain Python, and the caches tensordict
        # fills at first use are full before the trace
        fn(*tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, args))
        try:
            out = run(*args)
        except Exception as e:  # noqa: BLE001 - any failure of the compiler (e.g. inductor's C++ build), not of fn
            msg = f"--compile {mode}: torch.compile ({backend}) of {what}'s step failed on device {device.type}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if mode == "on":
                raise ConfigError(msg + "; use --compile off") from e
            import warnings

            warnings.warn(msg + "; running eager", stacklevel=2)
            call.eager = True
            out = fn(*args)
        call.compile_s = time.perf_counter() - t0
        return out

    call.compile_s = None  # seconds of the first call (warm-up, trace, compile and one step); None before it
    call.eager = False  # True once compiling failed under "auto" (warned): every call runs fn
    return call


# The device types on which a rollout policy's forward is compiled. CUDA: CUDA graphs replay the
# forward's kernels in one launch, where a small MLP at rollout batch sizes is all launch overhead
# (a PPO HalfCheetah-v5 iteration on an H200 spent 146 ms of its 528 ms rollout in the policy's
# forward, bench/RESULTS.md "GPU rows"). Not the CPU: there the compiled call took 2.35-2.7x the eager
# one per env step (dynamo's guards and the call wrapper cost more than the forward's ~6 small ops;
# bench/compiled_act.py, bench/RESULTS.md).
POLICY_COMPILE_DEVICES = ("cuda",)


def compile_policy(fn, device: torch.device, mode: str, what: str, *, static_args: tuple[int, ...] = ()):
    """A rollout policy's pure forward ``fn`` through :func:`compile_step` where that pays off, else
    ``fn`` itself.

    Compiled when ``mode`` is not "off" and ``device``'s type is in :data:`POLICY_COMPILE_DEVICES`
    (the caller decides "auto" as for its update); the arguments named by ``static_args`` are the
    weights (static addresses under CUDA graphs). Same numbers as ``fn`` up to float rounding; a
    compiler failure behaves as :func:`compile_step`'s.
    """
    if mode == "off" or device.type not in POLICY_COMPILE_DEVICES:
        return fn
    return compile_step(fn, device, mode, what, static_args=static_args)
