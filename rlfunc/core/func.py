"""Parameters as TensorDicts, applied through torch.func; stacking and vmap for seeds and ensembles.

A network is an ``nn.Module`` used only as a skeleton: its weights live in a TensorDict made by
:func:`params_from_module` and are applied with :func:`apply` (``torch.func.functional_call``).
A set of seeds or an ensemble is the same TensorDict with a leading member dim (:func:`stack_params`)
applied with :func:`vmap`, which uses ``torch.func.vmap`` where the device supports it and an
equivalent loop + ``torch.stack`` elsewhere (torch_npu has no vmap); both give the same numbers.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.utils import _pytree as pytree

from rlfunc.device import supports_vmap
from rlfunc.errors import ConfigError, ShapeError


def params_from_module(module: nn.Module) -> TensorDict:
    """A detached copy of ``module``'s parameters and buffers as a nested TensorDict.

    The copy owns its storage so the module stays a skeleton and never aliases the learner's
    parameters. Parameters require grad; buffers (e.g. BatchNorm running statistics) do not. A tensor
    the module holds under several names (tied weights) is kept once, under its first name, as
    ``named_parameters`` lists it; :func:`apply` ties it to the others again (``functional_call``'s
    ``tie_weights``), so its gradient sums every use.

    Raises:
        ShapeError: ``module`` is not a ``torch.nn.Module`` (a TensorDict of parameters is one already).
    """
    if not isinstance(module, nn.Module):
        raise ShapeError(f"params_from_module: module: expected a torch.nn.Module, got {type(module).__name__}")
    params = TensorDict.from_module(module, as_module=False)
    trainable = {tuple(name.split(".")) for name, _ in module.named_parameters()}
    kept = trainable | {tuple(name.split(".")) for name, _ in module.named_buffers()}  # each tensor once
    tied = [k for k in params.keys(include_nested=True, leaves_only=True) if (k if isinstance(k, tuple) else (k,)) not in kept]
    if tied:  # a second name of a tied tensor: two copies were a ValueError in apply (functional_call's tie check)
        params = params.exclude(*tied)
    return as_leaves(params.clone(), trainable)


def as_leaves(params: TensorDictBase, trainable: set[tuple[str, ...]] | None = None) -> TensorDictBase:
    """``params`` detached into autograd leaves (in place); ``requires_grad`` on the floating tensors
    whose key is in ``trainable`` (all floating tensors when None)."""
    for key, value in params.items(include_nested=True, leaves_only=True):
        value = value.detach()
        key_t = key if isinstance(key, tuple) else (key,)
        grad = value.is_floating_point() and (trainable is None or key_t in trainable)
        params.set(key, value.requires_grad_(True) if grad else value)
    return params


def apply(module: nn.Module, params: TensorDictBase | Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` with ``params`` substituted for its weights (``torch.func.functional_call``).

    ``params``: a TensorDict as :func:`params_from_module` makes, or a (nested) dict of tensors with
    the same keys (wrapped in a TensorDict; "0.weight"-style flat keys work too).

    Raises:
        ShapeError: ``params`` is neither a TensorDict nor a dict, misses or adds a key of the
            module's parameters and buffers (the keys named), or, when the call fails, holds a tensor
            of another shape than the module's (stacked params outside vmap).
    """
    if not isinstance(params, TensorDictBase):
        if not isinstance(params, Mapping):
            raise ShapeError(f"apply: params: expected a TensorDict or a dict of tensors, got {type(params).__name__}")
        params = TensorDict(params, batch_size=[])
    flat = dict(params.flatten_keys(".").items())
    try:
        return torch.func.functional_call(module, flat, args, kwargs, strict=True)
    except RuntimeError as e:  # strict's key check, in one line (it was torch's multi-line RuntimeError)
        if str(e).startswith("Error(s) in reparametrizing"):
            raise ShapeError(f"apply: params do not fit {type(module).__name__}: " + " ".join(str(e).split("\n")[1:]).strip()) from None
        own = dict(module.named_parameters())
        for key, value in flat.items():  # stacked params outside vmap were a deep "t() expects <= 2 dims"
            if key in own and tuple(value.shape) != tuple(own[key].shape):
                hint = " (stacked params: apply them under rlfunc.core.func.vmap)" if tuple(value.shape[1:]) == tuple(own[key].shape) else ""
                raise ShapeError(f"apply: params {key!r} has shape {list(value.shape)}, the module's is "
                                 f"{list(own[key].shape)}{hint}") from e
        raise


def stack_params(params: Sequence[TensorDictBase]) -> TensorDict:
    """Stack parameter TensorDicts along a new leading member dim: ``[M, *leaf_shape]`` leaves."""
    if not params:
        raise ShapeError("stack_params: params must be a non-empty sequence")
    trainable = {k if isinstance(k, tuple) else (k,) for k, v in params[0].items(True, True) if v.requires_grad}
    with torch.no_grad():
        stacked = torch.stack(list(params), dim=0).contiguous()
    return as_leaves(stacked, trainable)


def init_stacked(make_params: Callable[[int], TensorDict], seeds: Sequence[int]) -> TensorDict:
    """Build one parameter set per seed with ``make_params(seed)`` and stack them: batch_size [M]."""
    return stack_params([make_params(int(seed)) for seed in seeds])


def _member(x: Any, dim: int | None, index: int, size: int) -> Any:
    """Member ``index`` of ``x`` along ``dim``. One member of one: a squeeze, whose backward is a view
    (a select's allocates zeros of the whole input and copies the gradient in, per leaf and step)."""
    if dim is None:
        return x
    if isinstance(x, TensorDictBase):
        if dim != 0:
            raise ShapeError(f"vmap loop path: TensorDict inputs must be mapped over dim 0, got {dim}")
        return _squeeze0(x) if size == 1 and type(x) is TensorDict else x[index]
    if isinstance(x, torch.Tensor):
        return x.squeeze(dim) if size == 1 else x.select(dim, index)
    if isinstance(x, (dict, list, tuple)):  # a pytree (torch.func.stack_module_state's dict): each leaf's member
        return pytree.tree_map(lambda leaf: _member(leaf, dim, index, size), x, is_leaf=_is_leaf)
    raise ShapeError(f"vmap: cannot map over an input of type {type(x).__name__}")


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (TensorDictBase, torch.Tensor))


def _squeeze0(td: TensorDict) -> TensorDict:
    """``td[0]`` of a TensorDict of batch size [1, ...], its tensors squeezed (views), nested ones alike."""
    source = {k: _squeeze0(v) if type(v) is TensorDict else v.squeeze(0) for k, v in td.items()}
    new = getattr(TensorDict, "_new_unsafe", TensorDict)  # unchecked where tensordict has it: these came from a TensorDict
    return new(source, batch_size=td.batch_size[1:], device=td.device)


def _size(x: Any, dim: int | None) -> int | None:
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ShapeError(f"vmap: in_dims entry {dim!r}: expected an int or None per argument (for per-leaf in_dims "
                         "call torch.func.vmap itself)")
    if isinstance(x, (dict, list, tuple)):  # a pytree: every leaf maps over ``dim``, with one member count
        leaves = pytree.tree_flatten(x, is_leaf=_is_leaf)[0]
        sizes = {_size(leaf, dim) for leaf in leaves}
        if len(sizes) > 1:
            raise ShapeError(f"vmap: the leaves of a {type(x).__name__} input have member counts {sorted(sizes)} along dim "
                             f"{dim}: expected one")
        return sizes.pop() if sizes else None  # no tensors (stack_module_state's buffers of a module without any): as is
    shape = x.batch_size if isinstance(x, TensorDictBase) else getattr(x, "shape", None)
    if shape is None or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):  # was "tuple index out of range"
        raise ShapeError(f"vmap: in_dims {dim!r} is not a dim of an input of shape {None if shape is None else tuple(shape)}")
    return shape[dim]


def _stack_outputs(outputs: list[Any], out_dims: int) -> Any:
    is_leaf = lambda x: isinstance(x, (TensorDictBase, torch.Tensor))  # noqa: E731
    flat = [pytree.tree_flatten(o, is_leaf=is_leaf) for o in outputs]
    spec = flat[0][1]
    if len(outputs) == 1:  # torch.stack of one: the same values, as a view (its backward a view too)
        return pytree.tree_unflatten([x.unsqueeze(out_dims) for x in flat[0][0]], spec)
    columns = zip(*(leaves for leaves, _ in flat))
    stacked = [torch.stack(list(col), dim=out_dims) for col in columns]
    return pytree.tree_unflatten(stacked, spec)


def vmap(
    fn: Callable[..., Any],
    in_dims: int | None | tuple[int | None, ...] = 0,
    *,
    out_dims: int = 0,
    randomness: str = "error",
    use_loop: bool | None = None,
    device: torch.device | None = None,
) -> Callable[..., Any]:
    """Map ``fn`` over a member dim of its inputs, like ``torch.func.vmap``, with a loop fallback.

    Args:
        fn: a function of tensors / TensorDicts returning a pytree of tensors / TensorDicts.
        in_dims: per positional argument, the mapped dim or None (not mapped); an int maps all. An
            argument may be a dict / list / tuple of tensors (e.g. ``torch.func.stack_module_state``'s
            params), every leaf mapped over that dim.
            TensorDict arguments can only be mapped over dim 0 on the loop path.
        out_dims: where the member dim goes in every output.
        randomness: passed to ``torch.func.vmap`` ("error", "different", "same").
        use_loop: True forces the loop path, False forces torch.func.vmap; None (default) picks the
            loop on devices without vmap (``rlfunc.device.supports_vmap``) and when there is one member.
        device: the device the inputs live on, a torch.device or its name (used only to choose the path
            when use_loop is None).

    Returns:
        A function with ``fn``'s arguments whose outputs carry the member dim at ``out_dims``;
        keyword arguments are passed to every call unmapped. Both paths give the same numbers
        (tested); the loop path is what runs on NPUs. The loop path cannot detect random ops, so
        ``randomness="error"`` is only enforced on the vmap path.

    Raises:
        ShapeError: mapped inputs disagree on the number of members, have none, or lack the dim ``in_dims`` names.
    """
    def mapped(*args: Any, **kwargs: Any) -> Any:
        dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
        if len(dims) != len(args):
            raise ShapeError(f"vmap: in_dims has {len(dims)} entries for {len(args)} arguments")
        sizes = {s for s in (_size(a, d) for a, d in zip(args, dims)) if s is not None}
        if len(sizes) != 1:
            raise ShapeError(f"vmap: mapped inputs must share one member count, got {sorted(sizes)}")
        (size,) = sizes
        if size == 0:  # the loop path failed on its empty output list, the vmap path returned an empty result
            raise ShapeError("vmap: the mapped dim has size 0: no members to map over")
        loop = use_loop
        if loop is None:
            dev = torch.device(device) if device is not None else _first_device(args)  # "cpu" was an AttributeError
            loop = size == 1 or (dev is not None and not supports_vmap(dev))
        if not loop:
            return torch.func.vmap(fn, in_dims=dims, out_dims=out_dims, randomness=randomness)(*args, **kwargs)
        outputs = [fn(*(_member(a, d, i, size) for a, d in zip(args, dims)), **kwargs) for i in range(size)]
        return _stack_outputs(outputs, out_dims)

    return mapped


def _first_device(args: Sequence[Any]) -> torch.device | None:
    for a in pytree.tree_flatten(list(args), is_leaf=_is_leaf)[0]:  # (a dict of params: its tensors' device)
        if isinstance(a, (torch.Tensor, TensorDictBase)) and a.device is not None:
            return a.device
    return None


def leaves(params: TensorDictBase) -> list[torch.Tensor]:
    """The tensors of ``params`` in a fixed (sorted key) order: what the optimizer steps."""
    return [params.get(k) for k in sorted(params.keys(include_nested=True, leaves_only=True), key=str)]


def polyak_update_(target: TensorDictBase, online: TensorDictBase, tau: float) -> None:
    """Polyak averaging ``target <- (1 - tau) target + tau online``, in place, leaf by leaf (``func.leaves`` order).

    Args:
        target: the averaged parameters (target networks, an EMA), updated in place.
        online: parameters of the same structure (read, detached).
        tau: the rate in [0, 1]; 1 copies ``online``, 0 leaves ``target`` as it is.

    Raises:
        ConfigError: ``tau`` is not a number in [0, 1] (2.0 extrapolated: target = 2 online - target).
        ShapeError: ``target`` and ``online`` differ in their leaves' count or shapes.

    Reference: Lillicrap et al. (2016) (DDPG), the "soft" target update; one ``torch._foreach_lerp_``.
    """
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not 0 <= tau <= 1:
        raise ConfigError(f"tau={tau!r}: expected a number in [0, 1]")
    dst, src = leaves(target), leaves(online)
    if len(dst) != len(src) or any(a.shape != b.shape for a, b in zip(dst, src)):
        raise ShapeError(f"target ({len(dst)} leaves) and online ({len(src)} leaves): expected the same structure "
                         f"and shapes, got {[tuple(a.shape) for a in dst][:4]} and {[tuple(b.shape) for b in src][:4]}")
    with torch.no_grad():
        torch._foreach_lerp_(dst, [p.detach() for p in src], tau)


def under_transform() -> bool:
    """Whether a torch.func transform (grad, vjp, vmap ...) is tracing this call: no host read of a
    tensor's value there (vmap refuses ``.item()``), and torch.utils.checkpoint raises ("don't yet
    support saved tensor hooks")."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def reads_values(*tensors: Any) -> bool:
    """Whether an argument check may read the values of ``tensors`` on the host: not under
    torch.compile (a traced step's arguments are the ones its eager first call checked) and not when
    one of them is batched by torch.func.vmap at some level (vmap refuses the read: a batched gamma,
    clip_epsilon or timestep). Under grad / vjp, and for an unbatched tensor under vmap, the read
    works and the check runs. Where this is False the check is skipped and the result computed."""
    if torch.compiler.is_compiling():
        return False
    if not under_transform():
        return True
    functorch = torch._C._functorch
    for t in tensors:
        while isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t):
            if functorch.is_batchedtensor(t):
                return False
            t = functorch.get_unwrapped(t)
    return True


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor, True when every element of every tensor is finite (no host sync)."""
    flags = [torch.isfinite(t).all() for t in tensors if t is not None]
    return torch.stack(flags).all() if flags else torch.tensor(True)


# Parameter-free layers whose forward is exactly one torch function (no attributes to honour).
_FUNCTIONAL: dict[type, Callable[[torch.Tensor], torch.Tensor]] = {nn.Tanh: torch.tanh, nn.ReLU: torch.relu, nn.Sigmoid: torch.sigmoid}


def sequential_apply(module: nn.Sequential, *, stacked: bool) -> tuple[
        Callable[[TensorDictBase], list[torch.Tensor]], Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]]:
    """The forward of an ``nn.Sequential`` of ``nn.Linear`` and parameter-free layers as a pure function
    of its weights: ``(weights_of, apply)``.

    ``weights_of(params)`` lists each Linear layer's weight^T and its bias (none for
    ``nn.Linear(..., bias=False)``) as detached views, so in-place optimizer steps are seen;
    ``apply(weights, x)`` runs the layers with ``torch.addmm`` (one member) or ``torch.baddbmm``
    (``stacked``: all members in one batched matmul per layer; ``torch.mm`` / ``torch.bmm`` for a
    Linear without bias), Tanh, ReLU and
    Sigmoid as torch functions (module hooks do not run). ``apply`` is one function for the network's
    life, the form torch.compile takes once (the rollout policy's compiled forward).

    Args:
        module: the skeleton; its layers are ``nn.Linear`` (with or without bias) or have no
            parameters (activations).
        stacked: the params carry a leading member dim M.

    Returns:
        ``weights_of``: params -> list of tensors (2 per Linear, 1 per Linear without bias); ``apply``: (weights, x [B, in] or,
        ``stacked``, [M, B, in]) -> y [B, out] / [M, B, out]. Not differentiable.

    Raises:
        ShapeError: a layer with parameters is not ``nn.Linear``.
    """
    # a tensor's key in params: the first name the module holds it under (params_from_module keeps a reused
    # layer's or a tied weight's tensor there only; a later name was a KeyError)
    key_of = {id(p): tuple(n.split(".")) for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    plan: list[Any] = []  # per layer: (the Linear's weight key, its bias key or None), or the parameter-free function
    for name, layer in module._modules.items():  # as nn.Sequential.forward: a layer used twice runs twice
        if isinstance(layer, nn.Linear):
            plan.append((key_of[id(layer.weight)], None if layer.bias is None else key_of[id(layer.bias)]))
        elif next(layer.parameters(), None) is None:
            plan.append(_FUNCTIONAL.get(type(layer), layer))  # a module call costs ~3x the op itself
        else:
            raise ShapeError(f"sequential_forward: layer {name!r} ({type(layer).__name__}) has parameters and is not nn.Linear")
    matmul = torch.baddbmm if stacked else torch.addmm
    matmul_no_bias = torch.bmm if stacked else torch.mm

    def weights_of(params: TensorDictBase) -> list[torch.Tensor]:
        out = []
        for step in plan:
            if isinstance(step, tuple):
                weight_key, bias_key = step
                out.append(params[weight_key].detach().transpose(-1, -2))
                if bias_key is not None:
                    bias = params[bias_key].detach()
                    out.append(bias.unsqueeze(-2) if stacked else bias)
        return out

    def apply(weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        i = 0
        for step in plan:
            if isinstance(step, tuple):
                if step[1] is not None:
                    x = matmul(weights[i + 1], x, weights[i])
                    i += 2
                else:
                    x = matmul_no_bias(x, weights[i])
                    i += 1
            else:
                x = step(x)
        return x

    return weights_of, apply


def sequential_forward(module: nn.Sequential, params: TensorDictBase, *, stacked: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A fast forward of an ``nn.Sequential`` of ``nn.Linear`` and parameter-free layers over ``params``.

    For a small network applied once per env step (a rollout policy), module-call and key-lookup
    overheads dominate; this resolves the layers once (:func:`sequential_apply`) and returns ``x -> y``.
    The weights are read as views, so in-place optimizer steps are seen. Equal to
    ``apply(module, params, x)`` (per member) up to float rounding. Not differentiable.

    Args:
        module: the skeleton; its layers are ``nn.Linear`` (with or without bias) or have no
            parameters (activations).
        params: its parameters, with a leading member dim M when ``stacked``.

    Returns:
        ``f(x)``: x [B, in] -> [B, out], or with ``stacked`` x [M, B, in] -> [M, B, out].

    Raises:
        ShapeError: a layer with parameters is not ``nn.Linear``.
    """
    weights_of, apply = sequential_apply(module, stacked=stacked)
    weights = weights_of(params)
    return lambda x: apply(weights, x)
