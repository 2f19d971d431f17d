"""Does the DDIM sampler cost only its denoiser calls, grow linearly in steps, and does checkpointing
cut the activation memory of back-propagating through the chain?

Run from the repository root: ``python -m bench.ddim`` (or ``python bench/ddim.py``). One intra-op
thread unless ``--threads N``; the device is ``rlfunc.device.resolve_device("auto")``.

Denoiser: ``ConditionalUnet1D(action_dim=3, cond_dim=32, down_dims=(64, 128, 256), kernel_size=5)``
applied functionally; batch 256, horizon 16, cosine schedule with T = 100, eta = 1.

(a) step scaling: time of ``sample`` with 20 steps over 10 steps (target 1.8-2.2), under
    ``torch.no_grad()`` and with the graph recorded (no backward).
(b) sampler overhead: ``sample`` with 20 steps against 20 bare denoiser forwards on the same inputs,
    (sample - forwards) / forwards (target <= 10%).
(c) memory of forward + backward through 20 steps, ``checkpoint=False`` vs ``True`` (target >= 2x cut):
    - peak allocated: on CPU the peak of the running sum of tensor allocations and frees recorded by
      ``torch.profiler`` (``profile_memory``), on an accelerator ``max_memory_allocated``; the precise
      measure, from the start of the forward to the end of the backward;
    - saved for backward: bytes of the distinct storages autograd keeps after the forward
      (``saved_tensors_hooks``); with checkpointing the steps' internals are not saved (that is the
      point) and only what lies outside the checkpointed steps is counted;
    - RSS (CPU, Linux only): the rise of the peak resident set (VmHWM) over the resident set before
      the forward, each variant in a fresh subprocess; includes allocator slack.
Timings interleave the variants over ``--repeats`` rounds and report medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from bench.memory import peak_allocated, saved_tensor_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # python bench/ddim.py
    sys.path.insert(0, ROOT)

from rlfunc.core import func  # noqa: E402
from rlfunc.device import resolve_device, synchronize  # noqa: E402
from rlfunc.diffusion.ddim import sample  # noqa: E402
from rlfunc.diffusion.schedule import ddim_timesteps, make_schedule  # noqa: E402
from rlfunc.nets.unet1d import ConditionalUnet1D  # noqa: E402

BATCH, HORIZON, ACTION_DIM, COND = 256, 16, 3, 32
T, ETA = 100, 1.0
STEPS = (20, 10)
REPEATS = 4
MB = 2**20


def setup(device: torch.device):
    torch.manual_seed(0)
    module = ConditionalUnet1D(action_dim=ACTION_DIM, cond_dim=COND, down_dims=(64, 128, 256), kernel_size=5).to(device)
    params = func.params_from_module(module)

    def apply(p, x, t, cond):
        return func.apply(module, p, x, t, cond)

    g = torch.Generator(device=device).manual_seed(0)
    cond = torch.randn(BATCH, COND, generator=g, device=device)
    noise = {k: torch.randn(k + 1, BATCH, HORIZON, ACTION_DIM, generator=g, device=device) for k in STEPS}
    return apply, params, cond, noise, make_schedule("cosine", T, device=device)


def run_sample(ctx, k: int, checkpoint: bool = False) -> torch.Tensor:
    apply, params, cond, noise, schedule = ctx
    return sample(apply, params, cond, noise[k], schedule, k, ETA, checkpoint=checkpoint)


def run_forwards(ctx, k: int) -> torch.Tensor:
    """k bare denoiser calls on the sampler's inputs, chained so each call sees a new x."""
    apply, params, cond, noise, schedule = ctx
    timesteps, _ = ddim_timesteps(T, k, device=cond.device)
    x = noise[k][0]
    for i in range(k):
        x = apply(params, x, timesteps[i].expand(BATCH), cond)
    return x


def timings(ctx, device: torch.device, repeats: int) -> dict[str, float]:
    variants = {}
    for grad in (False, True):
        mode = "grad" if grad else "no_grad"
        for k in STEPS:
            variants[f"sample {k} steps ({mode})"] = (grad, lambda k=k: run_sample(ctx, k))
        variants[f"{STEPS[0]} forwards ({mode})"] = (grad, lambda: run_forwards(ctx, STEPS[0]))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats + 1):  # round 0 warms up
        for name, (grad, fn) in variants.items():
            with torch.set_grad_enabled(grad):
                synchronize(device)
                start = time.perf_counter()
                out = fn()
                synchronize(device)
                elapsed = time.perf_counter() - start
            del out
            if r:
                times[name].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items()}


def memory(ctx, device: torch.device, checkpoint: bool) -> tuple[int, int]:
    """(peak tensor bytes allocated during forward + backward above those allocated before,
    bytes of the distinct storages autograd saves for backward during the forward)."""
    hooks, storages = saved_tensor_hooks()

    def run() -> None:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            x0 = run_sample(ctx, STEPS[0], checkpoint)
        torch.autograd.grad(x0.square().mean(), func.leaves(ctx[1]))

    return peak_allocated(run, device), sum(storages.values())


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now; VmHWM: peak resident) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child_rss(checkpoint: bool) -> None:
    """In a fresh process: rise of the peak RSS over the RSS before forward + backward (printed as JSON).

    Reads VmHWM rather than ``ru_maxrss``: Linux carries ``ru_maxrss`` across exec from the forked
    parent, so a child of a big parent would report the parent's size."""
    device = torch.device("cpu")
    ctx = setup(device)
    apply, params, cond, noise, _ = ctx
    with torch.no_grad():  # warm up kernels and the allocator outside the measurement
        apply(params, noise[STEPS[0]][0], torch.zeros(BATCH, dtype=torch.int64), cond)
    try:  # reset VmHWM to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = _status_bytes("VmRSS")
    x0 = run_sample(ctx, STEPS[0], checkpoint)
    torch.autograd.grad(x0.square().mean(), func.leaves(params))
    print(json.dumps({"rss_delta": _status_bytes("VmHWM") - before}))


def rss_in_subprocess(checkpoint: bool, threads: int) -> int | None:
    if not os.path.exists("/proc/self/status"):
        return None
    cmd = [sys.executable, "-m", "bench.ddim", "--threads", str(threads), "--child-rss", str(int(checkpoint))]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["rss_delta"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed rounds after one warm-up round")
    parser.add_argument("--child-rss", type=int, choices=(0, 1), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_rss is not None:
        child_rss(bool(args.child_rss))
        return

    device = resolve_device("auto")
    ctx = setup(device)
    n_params = sum(p.numel() for p in func.leaves(ctx[1]))
    print(
        f"DDIM sampler on {device.type}, ConditionalUnet1D({ACTION_DIM}, {COND}, (64, 128, 256), 5) with "
        f"{n_params / 1e6:.2f}M parameters, batch {BATCH}, horizon {HORIZON}, T={T}, eta={ETA}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()} of {os.cpu_count()} cores, "
        f"{platform.processor() or platform.machine()}"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"load average before: {load}; {args.repeats} interleaved repeats, medians\n")

    med = timings(ctx, device, args.repeats)
    print("| variant | median ms |")
    print("|---------|----------:|")
    for name, seconds in med.items():
        print(f"| {name} | {seconds * 1e3:.1f} |")
    print("\n| measure | no_grad | grad | target |")
    print("|---------|--------:|-----:|--------|")
    ratio = [med[f"sample {STEPS[0]} steps ({m})"] / med[f"sample {STEPS[1]} steps ({m})"] for m in ("no_grad", "grad")]
    print(f"| (a) time(sample {STEPS[0]}) / time(sample {STEPS[1]}) | {ratio[0]:.2f} | {ratio[1]:.2f} | 1.8-2.2 |")
    over = [
        (med[f"sample {STEPS[0]} steps ({m})"] - med[f"{STEPS[0]} forwards ({m})"]) / med[f"{STEPS[0]} forwards ({m})"]
        for m in ("no_grad", "grad")
    ]
    print(f"| (b) (sample {STEPS[0]} - {STEPS[0]} forwards) / forwards | {over[0]:+.1%} | {over[1]:+.1%} | <= 10% |")

    rows = {}
    for ckpt in (False, True):
        rows[ckpt] = (
            *memory(ctx, device, ckpt),
            rss_in_subprocess(ckpt, args.threads) if device.type == "cpu" else None,
        )
    peak_name = "peak allocated (profiler)" if device.type == "cpu" else "max_memory_allocated"
    print(f"\n(c) forward + backward through {STEPS[0]} steps, MiB")
    print(f"| checkpoint | {peak_name} | saved for backward | RSS rise (subprocess) |")
    print("|------------|------:|------:|------:|")
    for ckpt, (peak, saved, rss) in rows.items():
        rss_s = f"{rss / MB:.0f}" if rss is not None else "n/a"
        print(f"| {ckpt} | {peak / MB:.0f} | {saved / MB:.1f} | {rss_s} |")
    (p0, s0, r0), (p1, s1, r1) = rows[False], rows[True]
    rss_cut = f"{r0 / r1:.1f}x" if r0 and r1 else "n/a"
    print(f"| cut (False / True) | {p0 / p1:.1f}x | {s0 / max(s1, 1):.0f}x | {rss_cut} |")
    print("target: peak cut >= 2x")


if __name__ == "__main__":
    main()
