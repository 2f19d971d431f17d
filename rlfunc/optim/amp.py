"""Mixed precision and gradient accumulation for the update step.

``precision(device, mode)`` picks the autocast dtype (bf16 on CPU and bf16-capable GPUs; fp16 with a
``torch.amp.GradScaler`` elsewhere, e.g. NPUs and older GPUs). Parameters, optimizer state, losses,
normalisation statistics and the diffusion step embedding stay float32; only the matmuls and convs
inside ``autocast`` run in the reduced dtype.

``step`` (a torch.optim optimizer) and ``transform_step`` (a gradient transform of :mod:`rlfunc.optim`,
whose state the learner owns) take the step after it: unscaled first (fp16), skipped when the
gradients are not finite.

``accumulate_gradients`` splits a batch into micro-batches and backpropagates each one's loss scaled
by its share of the batch, so the summed gradient equals that of the batch-mean loss computed in one
pass (exactly for losses that are means of per-sample terms; a loss that normalises over its whole
batch, such as per-minibatch advantage normalisation, sees micro-batch statistics instead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.device import autocast_dtype
from rlfunc.errors import ConfigError

PrecisionMode = Literal["off", "auto", "bf16", "fp16"]


class Precision(NamedTuple):
    """How the update runs: ``dtype`` None means full float32; ``scaler`` is set for fp16 only."""

    device: torch.device
    dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None

    def autocast(self):
        """A context that autocasts to ``dtype`` on ``device`` (a no-op when ``dtype`` is None)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def precision(device: torch.device, mode: PrecisionMode = "off") -> Precision:
    """The precision policy for ``mode`` on ``device``.

    Args:
        mode: "off" (float32), "auto" (:func:`rlfunc.device.autocast_dtype`), "bf16" or "fp16".
            fp16 comes with a GradScaler (dynamic loss scaling, Micikevicius et al. 2018).

    Raises:
        ConfigError: an unknown ``mode``.
    """
    if mode not in ("off", "auto", "bf16", "fp16"):
        raise ConfigError(f"precision={mode!r}: expected off, auto, bf16 or fp16")
    if mode == "off":
        return Precision(device, None, None)
    dtype = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode] or autocast_dtype(device)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    return Precision(device, dtype, scaler)


def accumulate_gradients(
    loss_fn: Callable[[TensorDictBase], tuple[Tensor, TensorDictBase]],
    batch: TensorDictBase,
    micro_batch_size: int | None,
    *,
    prec: Precision | None = None,
    batch_dim: int = 0,
) -> tuple[Tensor, TensorDictBase]:
    """Backpropagate ``loss_fn`` over ``batch`` in micro-batches; gradients accumulate in ``.grad``.

    Each micro-batch ``b`` of size n_b out of N contributes ``(n_b / N) * loss_fn(b)``, so for a loss
    that is a mean over samples the accumulated gradient is that of ``loss_fn(batch)``. Call
    ``optimizer.zero_grad()`` before and step after (:func:`step`).

    Args:
        loss_fn: micro-batch -> (scalar loss, metrics TensorDict of per-batch means).
        batch: a TensorDict whose dim ``batch_dim`` is the sample dim (size N).
        micro_batch_size: samples per backward pass; None or >= N does one pass.
        prec: autocast/loss scaling policy (:func:`precision`); None is float32.

    Returns:
        (loss, metrics): the batch-mean loss (detached) and the batch-mean metrics.

    Raises:
        ConfigError: ``micro_batch_size < 1``.
    """
    n = batch.batch_size[batch_dim]
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size={micro_batch_size}: expected >= 1 or None")
    size = n if micro_batch_size is None else min(micro_batch_size, n)
    total_loss, total_metrics = None, None
    for start in range(0, n, size):
        micro = batch.narrow(batch_dim, start, min(size, n - start)) if size < n else batch
        weight = micro.batch_size[batch_dim] / n
        with prec.autocast() if prec is not None else contextlib.nullcontext():
            loss, metrics = loss_fn(micro)
        scaled = loss.float() * weight
        backward(scaled, prec)
        metrics = metrics.detach() * weight
        total_loss = scaled.detach() if total_loss is None else total_loss + scaled.detach()
        total_metrics = metrics if total_metrics is None else total_metrics + metrics
    return total_loss, total_metrics


def backward(loss: Tensor, prec: Precision | None = None) -> None:
    """``loss.backward()``, with the loss scaled first when ``prec`` has a GradScaler (fp16)."""
    scaler = prec.scaler if prec is not None else None
    (scaler.scale(loss) if scaler is not None else loss).backward()


def step(
    optimizer: torch.optim.Optimizer, leaves: Sequence[Tensor], max_grad_norm: float | None, prec: Precision | None = None
) -> tuple[Tensor, bool]:
    """Unscale (fp16), clip to ``max_grad_norm`` and step, skipping steps with non-finite gradients.

    Returns:
        (grad_norm before clipping, whether the step was taken).
    """
    scaler = prec.scaler if prec is not None else None
    if scaler is not None:
        scaler.unscale_(optimizer)
    grads = [p.grad for p in leaves if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else torch.zeros(())
    finite = bool(norm.isfinite())
    if max_grad_norm is not None and finite:
        torch.nn.utils.clip_grad_norm_(leaves, max_grad_norm, foreach=True)
    if scaler is not None:
        scaler.step(optimizer)  # skips itself on inf/nan and lowers the scale
        scaler.update()
    elif finite:
        optimizer.step()
    return norm, finite


class _Leaves(torch.optim.Optimizer):
    """``leaves`` as the torch.optim.Optimizer a GradScaler unscales and steps through: it holds no
    state, and its ``step`` runs ``fn`` (the GradScaler calls it only when the gradients are finite)."""

    def __init__(self, leaves: Sequence[Tensor], fn: Callable[[], None]) -> None:
        super().__init__(list(leaves), {})
        self._fn = fn

    def step(self, closure=None) -> None:
        self._fn()


def transform_step(transform, opt_state: TensorDictBase, params: TensorDictBase, prec: Precision | None = None,
                   **extra) -> tuple[Tensor, bool, TensorDictBase]:
    """One step of the gradient transform ``transform`` (:class:`rlfunc.optim.GradientTransform`, e.g.
    ``chain(clip_by_global_norm(c, stacked=False), adam(lr))``) on the gradients :func:`accumulate_gradients`
    left in the ``.grad`` of ``params``' leaves, applied to them in place; unscaled first (fp16) and
    skipped when not finite, as :func:`step` does for a torch.optim optimizer (same arithmetic).

    Args:
        opt_state: ``transform``'s state (``transform.init(params)``, part of the learner state).
        params: the leaves to step; those whose ``.grad`` is None are left out of the update.
        prec: the precision policy whose GradScaler (fp16) scaled the loss; None is float32.
        extra: the links' per-step arguments (``lr=``); ``grad_norm=`` is given here ([1], the norm
            below), so a clipping link does not compute it again.

    Returns:
        (the global L2 norm of the (unscaled) gradients before any clipping, 0-dim; whether the step was
        taken; the transform's new state, ``opt_state`` itself when skipped).
    """
    from rlfunc.optim import apply_updates

    keys = [k for k in sorted(params.keys(include_nested=True, leaves_only=True), key=str) if params.get(k).grad is not None]
    leaves = [params.get(k) for k in keys]
    if not leaves:
        return torch.zeros(()), True, opt_state
    scaler = prec.scaler if prec is not None else None
    out = {"state": opt_state}

    def apply() -> None:
        grads = TensorDict({}, batch_size=[], device=params.device)
        for key, leaf in zip(keys, leaves):
            grads.set(key, leaf.grad)
        updates, out["state"] = transform.update(grads, opt_state, params, grad_norm=norm.reshape(1), **extra)
        apply_updates(params, updates)

    holder = _Leaves(leaves, apply) if scaler is not None else None
    if scaler is not None:
        scaler.unscale_(holder)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in leaves]))
    finite = bool(norm.isfinite())
    if scaler is not None:
        scaler.step(holder)  # runs apply() unless the unscale found inf/nan; lowers the scale then
        scaler.update()
    elif finite:
        apply()
    return norm, finite, out["state"]
