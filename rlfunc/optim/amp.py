"""Mixed precision and gradient accumulation for the update step.

``precision(device, mode)`` picks the autocast dtype (bf16 on CPU and bf16-capable GPUs; fp16 with a
``torch.amp.GradScaler`` elsewhere, e.g. NPUs and older GPUs). Parameters, optimizer state, losses,
normalisation statistics and the diffusion step embedding stay float32; only the matmuls and convs
inside ``autocast`` run in the reduced dtype.

``step`` (a torch.optim optimizer, with ``torch.amp.GradScaler``) and ``transform_step`` (a gradient
transform of :mod:`rlfunc.optim`, whose state the learner owns) take the step after it: unscaled first
(fp16), skipped when the gradients are not finite. For a transform the fp16 loss scale is a link of the
chain, :func:`dynamic_loss_scale` (:func:`with_loss_scale` adds it where the precision needs it): its
scale and growth tracker are tensors of the learner state, so a snapshot holds them and a resumed fp16
run scales as the uninterrupted one (a GradScaler object outside the state did not).

``accumulate_gradients`` splits a batch into micro-batches and backpropagates each one's loss scaled
by its share of the batch, so the summed gradient equals that of the batch-mean loss computed in one
pass (exactly for losses that are means of per-sample terms; a loss that normalises over its whole
batch, such as per-minibatch advantage normalisation, sees micro-batch statistics instead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from typing import Literal, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.core.normalize import merge_moments
from rlfunc.device import autocast_dtype
from rlfunc.errors import ConfigError
from rlfunc.optim.base import GradientTransform, from_leaves, node, tree_leaves, update_leaves_of

PrecisionMode = Literal["off", "auto", "bf16", "fp16"]


class Precision(NamedTuple):
    """How the update runs: ``dtype`` None means full float32; ``scaler`` is set for fp16 only (the
    GradScaler of the torch.optim path, :func:`step`; a transform chain keeps its scale in its state,
    :func:`dynamic_loss_scale`)."""

    device: torch.device
    dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None

    def autocast(self):
        """A context that autocasts to ``dtype`` on ``device`` (a no-op when ``dtype`` is None)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    @property
    def loss_scaled(self) -> bool:
        """Whether the loss is scaled before backward (fp16)."""
        return self.dtype == torch.float16


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
    scale: Tensor | None = None,
    maxima: Collection[str] = (),
    moments: Collection[tuple[str, str]] = (),
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
        scale: the loss scale of a :func:`dynamic_loss_scale` link (``loss_scale_of(opt_state)``), 0-dim
            float32; None: ``prec``'s GradScaler (fp16) or no scaling.
        maxima: the metrics that are maxima over the samples (dppo's "ratio_max"): the max over the
            micro-batches, not their mean.
        moments: (mean, population variance) pairs of metrics over the samples (the explained
            variance's parts, ``rlfunc.losses.ppo.EV_MOMENTS``): merged by
            :func:`rlfunc.core.normalize.merge_moments`'s pairwise update, not averaged.

    Returns:
        (loss, metrics): the batch-mean loss (detached) and the batch-mean metrics (``maxima``: batch maxima).

    Raises:
        ConfigError: ``micro_batch_size < 1``.
    """
    n = batch.batch_size[batch_dim]
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size={micro_batch_size}: expected >= 1 or None")
    size = n if micro_batch_size is None else min(micro_batch_size, n)
    total_loss, total_metrics, done = None, None, 0.0
    for start in range(0, n, size):
        micro = batch.narrow(batch_dim, start, min(size, n - start)) if size < n else batch
        weight = micro.batch_size[batch_dim] / n
        with prec.autocast() if prec is not None else contextlib.nullcontext():
            loss, metrics = loss_fn(micro)
        scaled = loss.float() * weight
        backward(scaled, prec, scale)
        total_loss = scaled.detach() if total_loss is None else total_loss + scaled.detach()
        total_metrics = merge_metrics(total_metrics, done, metrics.detach(), weight, maxima=maxima, moments=moments)
        done += weight
    return total_loss, total_metrics


def merge_metrics(total: TensorDictBase | None, done: float, metrics: TensorDictBase, weight: float, *,
                  maxima: Collection[str] = (), moments: Collection[tuple[str, str]] = ()) -> TensorDictBase:
    """The metrics of parts of a batch merged, one part at a time: ``total`` (the parts so far, of
    weight ``done``; None before the first) with ``metrics`` (a part of weight ``weight``, its share
    of the batch). Means over the samples are summed times their weights; ``maxima`` are maxed;
    ``moments`` (mean, variance) pairs merged by :func:`rlfunc.core.normalize.merge_moments`. What
    :func:`accumulate_gradients` and an unrolled (compiled) micro-batch loop share."""
    kept = {k: metrics[k] for k in (*maxima, *(k for pair in moments for k in pair)) if k in metrics.keys()}
    merged = metrics * weight
    if total is not None:
        for k in maxima:
            if k in kept:
                kept[k] = torch.maximum(total[k], kept[k])
        for mk, vk in moments:
            if mk in kept:
                kept[mk], kept[vk] = merge_moments(total[mk], total[vk], done, kept[mk], kept[vk], weight)
        merged = total + merged
    for k, v in kept.items():
        merged[k] = v
    return merged


def backward(loss: Tensor, prec: Precision | None = None, scale: Tensor | None = None) -> None:
    """``loss.backward()``, with the loss multiplied by ``scale`` first (a :func:`dynamic_loss_scale`
    link's, :func:`loss_scale_of`) or, without one, by ``prec``'s GradScaler's (fp16, the torch.optim path)."""
    if scale is not None:
        loss = loss * scale
    elif prec is not None and prec.scaler is not None:
        loss = prec.scaler.scale(loss)
    loss.backward()


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
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])) if grads else torch.zeros(())
    finite = bool(norm.isfinite())
    if max_grad_norm is not None and finite:
        torch.nn.utils.clip_grad_norm_(leaves, max_grad_norm, foreach=True)
    if scaler is not None:
        scaler.step(optimizer)  # skips itself on inf/nan and lowers the scale
        scaler.update()
    elif finite:
        optimizer.step()
    return norm, finite


def dynamic_loss_scale(inner: GradientTransform, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                       backoff_factor: float = 0.5, growth_interval: int = 2000) -> GradientTransform:
    """fp16's dynamic loss scaling around ``inner`` (Micikevicius et al. 2018, "Mixed Precision
    Training"; optax's ``apply_if_finite`` with jmp's ``DynamicLossScale``), with torch.amp.GradScaler's
    defaults and arithmetic.

    The loss was multiplied by ``state["scale"]`` before backward (:func:`backward`). ``update``
    multiplies the gradients by ``1 / scale`` (in float32: exact for a power-of-two scale, which the
    default factors keep, so equal to GradScaler's double-precision reciprocal, which NPUs lack); if
    any is not finite the updates are zero, ``inner``'s state is kept and the scale is multiplied by
    ``backoff_factor``; otherwise ``inner`` updates on the unscaled gradients (with their global norm as
    ``grad_norm=``) and after ``growth_interval`` finite steps in a row the scale is multiplied by
    ``growth_factor``. Deciding "finite" reads one value on the host, as GradScaler's step does.

    State: ``{"scale": 0-dim float32, "growth_tracker": 0-dim int32 (finite steps since the last
    change), "grad_norm": 0-dim float32 (the last unscaled global norm, for metrics), "inner": inner's}``.

    Raises:
        ConfigError: ``init_scale`` or ``growth_factor`` not > 0 (resp. > 1), ``backoff_factor`` not in
            (0, 1), ``growth_interval`` < 1.
    """
    if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
        raise ConfigError(f"dynamic_loss_scale(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                          f"{backoff_factor}, growth_interval={growth_interval}): expected > 0, > 1, in (0, 1) and >= 1")

    def init(params: TensorDictBase) -> TensorDict:
        device = params.device if params.device is not None else tree_leaves(params)[0].device
        return TensorDict({
            "scale": torch.full((), init_scale, dtype=torch.float32, device=device),
            "growth_tracker": torch.zeros((), dtype=torch.int32, device=device),
            "grad_norm": torch.zeros((), dtype=torch.float32, device=device),
            "inner": inner.init(params),
        }, batch_size=[], device=params.device)

    def update_leaves(grads: list[Tensor], treedef: tuple, state: TensorDictBase, params: TensorDictBase | None = None,
                      **extra):
        extra.pop("grad_norm", None)  # of the scaled gradients: this link gives the unscaled one
        inv_scale = state["scale"].reciprocal()
        unscaled = torch._foreach_mul(grads, inv_scale)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in unscaled]))
        finite = bool(norm.isfinite())
        if finite:
            updates, inner_state = update_leaves_of(inner, unscaled, treedef, state["inner"], params,
                                                  grad_norm=norm.reshape(1), **extra)
        else:
            updates, inner_state = [torch.zeros_like(g) for g in grads], state["inner"]
        scale, tracker = state["scale"].clone(), state["growth_tracker"].clone()
        found_inf = torch.full((), 0.0 if finite else 1.0, dtype=torch.float32, device=scale.device)
        torch._amp_update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        return updates, node({"scale": scale, "growth_tracker": tracker, "grad_norm": norm.detach(), "inner": inner_state},
                             state.device)

    return from_leaves(init, update_leaves)


def with_loss_scale(transform: GradientTransform, prec: Precision | None) -> GradientTransform:
    """``transform`` inside :func:`dynamic_loss_scale` when ``prec`` scales the loss (fp16), else itself."""
    return dynamic_loss_scale(transform) if prec is not None and prec.loss_scaled else transform


def loss_scale_of(opt_state: TensorDictBase) -> Tensor | None:
    """The loss scale of a :func:`dynamic_loss_scale` state (0-dim), None for any other transform's state."""
    return opt_state.get("scale") if "growth_tracker" in opt_state.keys() else None


def without_loss_scale(opt_state: TensorDictBase) -> TensorDictBase:
    """The wrapped chain's state of a :func:`dynamic_loss_scale` state, ``opt_state`` itself for any other."""
    return opt_state["inner"] if loss_scale_of(opt_state) is not None else opt_state


def transform_step(transform: GradientTransform, opt_state: TensorDictBase, params: TensorDictBase,
                   prec: Precision | None = None, **extra) -> tuple[Tensor, bool, TensorDictBase]:
    """One step of the gradient transform ``transform`` (:class:`rlfunc.optim.GradientTransform`, e.g.
    ``chain(clip_by_global_norm(c, stacked=False), adam(lr))``) on the gradients :func:`accumulate_gradients`
    left in the ``.grad`` of ``params``' leaves, applied to them in place; skipped when not finite, as
    :func:`step` does for a torch.optim optimizer (same arithmetic). Under fp16 ``transform`` is
    :func:`dynamic_loss_scale`'s (:func:`with_loss_scale`), which unscales the gradients first.

    Args:
        opt_state: ``transform``'s state (``transform.init(params)``, part of the learner state).
        params: the leaves to step; those whose ``.grad`` is None are left out of the update.
        prec: the precision policy; None is float32.
        extra: the links' per-step arguments (``lr=``); ``grad_norm=`` is given here ([1], the norm
            below), so a clipping link does not compute it again (a ``stacked=True`` one, whose norms
            are per member, computes its own).

    Returns:
        (the global L2 norm of the (unscaled) gradients before any clipping, 0-dim; whether the step was
        taken; the transform's new state: ``opt_state`` itself when skipped, but for a loss scale's,
        whose scale backs off then).

    Raises:
        ConfigError: ``prec`` scales the loss (fp16) and ``opt_state`` holds no loss scale.
    """
    from rlfunc.optim import apply_updates

    keys = [k for k in sorted(params.keys(include_nested=True, leaves_only=True), key=str) if params.get(k).grad is not None]
    leaves = [params.get(k) for k in keys]
    if not leaves:
        return torch.zeros(()), True, opt_state
    grads = TensorDict({}, batch_size=[], device=params.device)
    for key, leaf in zip(keys, leaves):
        grads.set(key, leaf.grad)
    if loss_scale_of(opt_state) is not None:  # the link unscales, decides and moves its scale
        updates, new_state = transform.update(grads, opt_state, params, **extra)
        norm = new_state["grad_norm"]
        finite = bool(norm.isfinite())
        if finite:
            apply_updates(params, updates)
        return norm, finite, new_state
    if prec is not None and prec.loss_scaled:
        raise ConfigError("transform_step: fp16 scales the loss, but the optimizer state holds no loss scale; "
                          "expected the transform wrapped by rlfunc.optim.amp.with_loss_scale")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in leaves]))  # fp16 overflowed
    if not bool(norm.isfinite()):
        return norm, False, opt_state
    updates, new_state = transform.update(grads, opt_state, params, grad_norm=norm.reshape(1), **extra)
    apply_updates(params, updates)
    return norm, True, new_state
