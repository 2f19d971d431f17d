"""What does a training step of the multimodal encoder cost, and does vision checkpointing cut its
activation memory?

Run from the repository root: ``python -m bench.encoders`` (or ``python bench/encoders.py``). One
intra-op thread unless ``--threads N``; the device is ``rlfunc.device.resolve_device("auto")``.

Encoder: ``MultimodalEncoder(EncoderConfig(...))`` with its defaults (d_model 256, ResNet-18 widths
(64, 128, 256, 512) with GroupNorm, one trunk shared by the cameras "top" and "side", 4 tokens per
camera, proprio 16, 2-layer fusion) and learned text (max_len 16), applied functionally
(``rlfunc.core.func.apply``). Batch ``--batch`` (64) of two uint8 128x128 cameras, proprioception and
tokenised instructions, all on the device.

Measured for ``checkpoint_vision`` False and True:
- time of forward + backward (``torch.autograd.grad`` of ``mean(feature^2)`` w.r.t. every leaf),
  interleaved over ``--repeats`` rounds after one warm-up round, medians;
- peak allocated: on CPU the peak of the running sum of tensor allocations and frees recorded by
  ``torch.profiler`` (``profile_memory``), on an accelerator ``max_memory_allocated``; from the start of
  the forward to the end of the backward, above what was allocated before (params, inputs);
- saved for backward: bytes of the distinct storages autograd keeps after the forward
  (``saved_tensors_hooks``), parameters excluded; with checkpointing, what the trunk's blocks keep
  inside is not counted (that is the point), only the blocks' inputs and what lies outside.
Target: checkpointing cuts the peak activation memory.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from bench.memory import peak_allocated, saved_tensor_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # python bench/encoders.py
    sys.path.insert(0, ROOT)

from rlfunc.core import func  # noqa: E402
from rlfunc.device import resolve_device, synchronize  # noqa: E402
from rlfunc.nets.encoders import EncoderConfig, MultimodalEncoder  # noqa: E402

INSTRUCTIONS = ("pick up the red cube", "open the top drawer", "push the blue block to the left",
                "put the cube in the drawer", "close the drawer")
MB = 2**20


def setup(device: torch.device, batch: int, checkpoint: bool):
    torch.manual_seed(0)
    net = MultimodalEncoder(EncoderConfig(text="learned", instructions=INSTRUCTIONS, checkpoint_vision=checkpoint)).to(device)
    params = func.params_from_module(net)
    g = torch.Generator().manual_seed(0)
    obs = {cam: torch.randint(0, 256, (batch, 128, 128, 3), generator=g, dtype=torch.uint8).to(device)
           for cam in net.config.cameras}
    obs["proprio"] = torch.randn(batch, 16, generator=g).to(device)
    tokens, padding = net.tokenizer([INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(batch)], device=device)
    obs["instruction_tokens"], obs["instruction_padding_mask"] = tokens, padding
    return net, params, obs


def step(ctx, hooks=None) -> None:
    net, params, obs = ctx
    if hooks is None:
        feature = func.apply(net, params, obs)
    else:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            feature = func.apply(net, params, obs)
    torch.autograd.grad(feature.square().mean(), func.leaves(params))


def timings(ctxs: dict[bool, tuple], device: torch.device, repeats: int) -> dict[bool, float]:
    times: dict[bool, list[float]] = {k: [] for k in ctxs}
    for r in range(repeats + 1):  # round 0 warms up
        for ckpt, ctx in ctxs.items():
            synchronize(device)
            start = time.perf_counter()
            step(ctx)
            synchronize(device)
            if r:
                times[ckpt].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def memory(ctx, device: torch.device) -> tuple[int, int]:
    """(peak bytes allocated during forward + backward above those allocated before, bytes saved for backward)."""
    hooks, storages = saved_tensor_hooks(exclude=func.leaves(ctx[1]))
    return peak_allocated(lambda: step(ctx, hooks), device), sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--batch", type=int, default=64, help="observations per step")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, npu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    ctxs = {ckpt: setup(device, args.batch, ckpt) for ckpt in (False, True)}
    n_params = sum(p.numel() for p in func.leaves(ctxs[False][1]))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    print(
        f"MultimodalEncoder (defaults: d_model 256, ResNet-18-GN shared by 2 cameras, learned text) with "
        f"{n_params / 1e6:.2f}M parameters, batch {args.batch} x 2 cameras 128x128 uint8, on {device.type} ({name}), "
        f"torch {torch.__version__}, threads {torch.get_num_threads()} of {os.cpu_count()} cores"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"load average before: {load}; {args.repeats} interleaved repeats, medians\n")

    med = timings(ctxs, device, args.repeats)
    mem = {ckpt: memory(ctx, device) for ckpt, ctx in ctxs.items()}
    peak_name = "peak allocated (profiler)" if device.type == "cpu" else "max_memory_allocated"
    print(f"| checkpoint_vision | forward+backward ms | {peak_name} MiB | saved for backward MiB |")
    print("|-------------------|--------------------:|------:|------:|")
    for ckpt in (False, True):
        peak, saved = mem[ckpt]
        print(f"| {ckpt} | {med[ckpt] * 1e3:.0f} | {peak / MB:.0f} | {saved / MB:.1f} |")
    (p0, s0), (p1, s1) = mem[False], mem[True]
    print(f"| ratio False / True | {med[False] / med[True]:.2f} | {p0 / p1:.2f}x | {s0 / max(s1, 1):.1f}x |")
    print("target: checkpointing cuts the peak activation memory")


if __name__ == "__main__":
    main()
