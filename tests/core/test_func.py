"""rlfunc.core.func: params as TensorDicts, apply, stacking, and vmap (torch.func path == loop path)."""

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import rlfunc.core.func as F
from rlfunc.core import func
from rlfunc.core.func import all_finite, apply, init_stacked, leaves, params_from_module, stack_params, vmap
from rlfunc.errors import ShapeError
from rlfunc.nets.actor_critic import sequential_apply


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def stacked_mlp_params(seeds=(0, 1, 2)) -> tuple[nn.Module, TensorDict]:
    return mlp(), init_stacked(lambda s: params_from_module(mlp(s)), seeds)


# --------------------------------------------------------------------------------------------
# params_from_module / apply / stack_params
# --------------------------------------------------------------------------------------------


def test_params_from_module_are_leaves_that_do_not_alias_the_module():
    module = mlp()
    params = params_from_module(module)
    assert set(params.keys(include_nested=True, leaves_only=True)) == {("0", "weight"), ("0", "bias"), ("2", "weight"), ("2", "bias")}
    for (name, p), key in zip(module.named_parameters(), [("0", "weight"), ("0", "bias"), ("2", "weight"), ("2", "bias")]):
        leaf = params.get(key)
        assert leaf.is_leaf and leaf.requires_grad and leaf.grad_fn is None
        assert torch.equal(leaf, p.detach())
        assert leaf.data_ptr() != p.data_ptr()
    # Writing into the copy leaves the module untouched, and vice versa.
    before = module[0].weight.detach().clone()
    with torch.no_grad():
        params.get(("0", "weight")).add_(1.0)
    assert torch.equal(module[0].weight.detach(), before)
    bias_before = params.get(("2", "bias")).detach().clone()
    with torch.no_grad():
        module[2].bias.fill_(7.0)
    assert torch.equal(params.get(("2", "bias")), bias_before)


def test_params_from_module_of_a_tensordict_is_named():
    # found by a new user: a TensorDict of parameters raised AttributeError '_parameters' from tensordict
    with pytest.raises(ShapeError, match="params_from_module: module: expected a torch.nn.Module, got TensorDict"):
        params_from_module(TensorDict({"w": torch.zeros(2)}, batch_size=[]))


def test_params_from_module_keeps_integer_buffers_without_grad():
    module = nn.BatchNorm1d(4)
    params = params_from_module(module)
    assert params.get("weight").requires_grad
    assert not params.get("running_mean").requires_grad  # buffers are state, not trained
    count = params.get("num_batches_tracked")
    assert count.dtype == torch.long and not count.requires_grad


def test_apply_equals_module_forward():
    module = mlp(3)
    params = params_from_module(module)
    x = torch.randn(5, 3)
    torch.testing.assert_close(apply(module, params, x), module(x), rtol=0, atol=0)
    # Other params give other outputs: the substitution really happens.
    other = params_from_module(mlp(4))
    torch.testing.assert_close(apply(module, other, x), mlp(4)(x), rtol=0, atol=0)
    assert not torch.allclose(apply(module, other, x), module(x))


def test_apply_takes_a_plain_dict_of_tensors():
    # found by a new user: apply(net, dict) was AttributeError: 'dict' object has no attribute 'flatten_keys'
    module = mlp(3)
    x = torch.randn(5, 3)
    nested = {"0": {"weight": module[0].weight.detach() * 2, "bias": module[0].bias.detach()},
              "2": {"weight": module[2].weight.detach(), "bias": module[2].bias.detach()}}
    expected = apply(module, TensorDict(nested, batch_size=[]), x)
    torch.testing.assert_close(apply(module, nested, x), expected, rtol=0, atol=0)
    assert not torch.allclose(expected, module(x))  # the doubled weight was used
    torch.testing.assert_close(apply(module, module.state_dict(), x), module(x), rtol=0, atol=0)  # flat "0.weight" keys
    w = module[2].bias.detach().clone().requires_grad_(True)
    apply(module, {**module.state_dict(), "2.bias": w}, x).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.full_like(w, 5.0))
    with pytest.raises(ShapeError, match=r"^apply: params: expected a TensorDict or a dict of tensors, got list$"):
        apply(module, [module[0].weight], x)
    # new-user pass: a missing or extra key was torch's multi-line RuntimeError
    with pytest.raises(ShapeError, match=r"^apply: params do not fit Sequential: Missing key\(s\): '2.bias'.$"):
        apply(module, {k: v for k, v in module.state_dict().items() if k != "2.bias"}, x)
    with pytest.raises(ShapeError, match=r"^apply: params do not fit Sequential: Unexpected key\(s\): 'extra'.$"):
        apply(module, {**module.state_dict(), "extra": torch.zeros(1)}, x)
    # TorchRL pass: stacked params without vmap were torch's "t() expects a tensor with <= 2 dimensions"
    stacked = {k: v.unsqueeze(0).expand(2, *v.shape) for k, v in module.state_dict().items()}
    with pytest.raises(ShapeError, match=r"^apply: params '0.weight' has shape \[2, .*stacked params: apply them under"):
        apply(module, stacked, x)


def test_apply_gradient_reaches_params_not_module():
    module = mlp()
    params = params_from_module(module)
    apply(module, params, torch.randn(4, 3)).sum().backward()
    assert params.get(("2", "bias")).grad is not None
    # d(sum of outputs)/d(last bias) = batch size for each output.
    torch.testing.assert_close(params.get(("2", "bias")).grad, torch.full((2,), 4.0))
    assert all(p.grad is None for p in module.parameters())


def test_stack_params_shapes_values_and_leafness():
    members = [params_from_module(mlp(s)) for s in (0, 1, 2)]
    stacked = stack_params(members)
    assert stacked.batch_size == torch.Size([3])
    assert stacked.get(("0", "weight")).shape == (3, 8, 3)
    assert stacked.get(("2", "bias")).shape == (3, 2)
    for m, p in enumerate(members):
        assert torch.equal(stacked.get(("0", "weight"))[m], p.get(("0", "weight")))
    for leaf in leaves(stacked):
        assert leaf.is_leaf and leaf.requires_grad and leaf.is_contiguous()
    # Usable by torch.optim: one SGD step moves every leaf by -lr * grad.
    before = [t.detach().clone() for t in leaves(stacked)]
    opt = torch.optim.SGD(leaves(stacked), lr=0.1)
    sum(t.sum() for t in leaves(stacked)).backward()
    opt.step()
    for b, t in zip(before, leaves(stacked)):
        torch.testing.assert_close(t.detach(), b - 0.1)
    # The members were not stepped: the stack does not alias them.
    for m, p in enumerate(members):
        torch.testing.assert_close(stacked.get(("2", "bias"))[m].detach(), p.get(("2", "bias")).detach() - 0.1)


def test_stack_params_empty_raises():
    with pytest.raises(ShapeError):
        stack_params([])


def test_leaves_order_is_sorted_and_complete():
    params = params_from_module(mlp())
    got = leaves(params)
    assert len(got) == 4
    assert got[0] is params.get(("0", "bias")) and got[1] is params.get(("0", "weight"))
    assert got[2] is params.get(("2", "bias")) and got[3] is params.get(("2", "weight"))


# --------------------------------------------------------------------------------------------
# vmap: torch.func path vs loop path
# --------------------------------------------------------------------------------------------


def test_vmap_mlp_forward_both_paths_match_per_member_apply():
    module, params = stacked_mlp_params()
    x = torch.randn(3, 5, 3)
    fwd = lambda p, xi: apply(module, p, xi)  # noqa: E731
    out_vmap = vmap(fwd, use_loop=False)(params, x)
    out_loop = vmap(fwd, use_loop=True)(params, x)
    assert out_vmap.shape == out_loop.shape == (3, 5, 2)
    torch.testing.assert_close(out_vmap, out_loop, rtol=0, atol=1e-6)
    for m in range(3):
        torch.testing.assert_close(out_loop[m], mlp(m)(x[m]), rtol=0, atol=1e-6)


def test_vmap_tuple_of_tensor_and_tensordict():
    module, params = stacked_mlp_params()
    x = torch.randn(3, 4, 3)

    def fn(p, xi):
        y = apply(module, p, xi)
        loss = y.pow(2).mean()
        return loss, TensorDict({"loss": loss.detach(), "y_max": y.max().detach(), "y": y.detach()}, batch_size=[])

    loss_v, td_v = vmap(fn, use_loop=False)(params, x)
    loss_l, td_l = vmap(fn, use_loop=True)(params, x)
    assert loss_v.shape == loss_l.shape == (3,)
    assert isinstance(td_v, TensorDict) and isinstance(td_l, TensorDict)
    assert td_v.batch_size == td_l.batch_size == torch.Size([3])
    torch.testing.assert_close(loss_v, loss_l, rtol=0, atol=1e-6)
    for key in ("loss", "y_max", "y"):
        torch.testing.assert_close(td_v.get(key), td_l.get(key), rtol=0, atol=1e-6)
    assert td_l.get("y").shape == td_v.get("y").shape == (3, 4, 2)
    for m in range(3):
        torch.testing.assert_close(loss_l[m], mlp(m)(x[m]).pow(2).mean(), rtol=0, atol=1e-6)


def test_vmap_in_dims_none_broadcasts_unmapped_args():
    module, params = stacked_mlp_params()
    x = torch.randn(5, 3)  # shared by all members
    scale = torch.tensor(2.5)

    def fn(p, xi, s):
        return apply(module, p, xi) * s

    out_v = vmap(fn, in_dims=(0, None, None), use_loop=False)(params, x, scale)
    out_l = vmap(fn, in_dims=(0, None, None), use_loop=True)(params, x, scale)
    assert out_v.shape == out_l.shape == (3, 5, 2)
    torch.testing.assert_close(out_v, out_l, rtol=0, atol=1e-6)
    for m in range(3):
        torch.testing.assert_close(out_l[m], 2.5 * mlp(m)(x), rtol=0, atol=1e-6)


def test_vmap_tensor_in_dim_1_and_out_dims():
    a = torch.randn(4, 3)  # member dim is 1
    b = torch.randn(3)
    fn = lambda u, v: u * v  # noqa: E731
    out_v = vmap(fn, in_dims=(1, 0), out_dims=1, use_loop=False)(a, b)
    out_l = vmap(fn, in_dims=(1, 0), out_dims=1, use_loop=True)(a, b)
    torch.testing.assert_close(out_v, a * b, rtol=0, atol=0)
    torch.testing.assert_close(out_l, a * b, rtol=0, atol=0)


def test_vmap_default_uses_loop_where_device_has_no_vmap(monkeypatch):
    calls = []
    monkeypatch.setattr(F, "supports_vmap", lambda device: calls.append(device) or False)

    def fail(*args, **kwargs):
        raise AssertionError("torch.func.vmap must not be called when supports_vmap is False")

    monkeypatch.setattr(torch.func, "vmap", fail)
    seen = []

    def fn(x):
        seen.append(x.shape)  # the loop path sees one member at a time
        return x * 2

    x = torch.arange(6.0).reshape(3, 2)
    out = vmap(fn)(x)
    torch.testing.assert_close(out, x * 2)
    assert seen == [torch.Size([2])] * 3
    assert calls == [torch.device("cpu")]


def test_vmap_default_uses_torch_func_where_supported(monkeypatch):
    used = []
    real = torch.func.vmap
    monkeypatch.setattr(torch.func, "vmap", lambda *a, **k: used.append(True) or real(*a, **k))
    x = torch.arange(6.0).reshape(3, 2)
    torch.testing.assert_close(vmap(lambda t: t + 1)(x), x + 1)
    assert used == [True]
    # A single member takes the loop even where vmap exists.
    used.clear()
    torch.testing.assert_close(vmap(lambda t: t + 1)(x[:1]), x[:1] + 1)
    assert used == []


@pytest.mark.parametrize("use_loop", [True, False, None])
def test_vmap_mismatched_member_counts_raise(use_loop):
    _, params = stacked_mlp_params()  # 3 members
    with pytest.raises(ShapeError, match=r"\[2, 3\]"):
        vmap(lambda p, x: x, use_loop=use_loop)(params, torch.randn(2, 3))


def test_vmap_in_dims_length_mismatch_raises():
    with pytest.raises(ShapeError, match="in_dims"):
        vmap(lambda a, b: a, in_dims=(0,))(torch.ones(2), torch.ones(2))


def test_vmap_gradients_agree_between_paths():
    module, _ = stacked_mlp_params()
    x = torch.randn(3, 6, 3)
    target = torch.randn(3, 6, 2)

    def loss_fn(p, xi, ti):
        return (apply(module, p, xi) - ti).pow(2).mean()

    grads = {}
    for use_loop in (False, True):
        params = init_stacked(lambda s: params_from_module(mlp(s)), (0, 1, 2))
        vmap(loss_fn, use_loop=use_loop)(params, x, target).sum().backward()
        grads[use_loop] = [t.grad.clone() for t in leaves(params)]
    for gv, gl in zip(grads[False], grads[True]):
        assert gv.abs().sum() > 0
        torch.testing.assert_close(gv, gl, rtol=0, atol=1e-6)
    # And equal to the gradient of each member on its own.
    for m in range(3):
        p = params_from_module(mlp(m))
        loss_fn(p, x[m], target[m]).backward()
        for g_own, g_stacked in zip([t.grad for t in leaves(p)], grads[True]):
            torch.testing.assert_close(g_own, g_stacked[m], rtol=0, atol=1e-6)


def test_vmap_loop_of_one_member_squeezes_and_equals_the_member_alone():
    """One member (a single seed, the common case): the loop path squeezes the member dim (a view,
    whose backward is a view too; a select's allocated the whole input's zeros per leaf and step) and
    stacks the outputs as an unsqueeze; values and gradients bit-equal to the member on its own."""
    module = mlp()
    x, target = torch.randn(1, 6, 3), torch.randn(1, 6, 2)

    def loss_fn(p, batch):
        err = apply(module, p, batch["x"]) - batch["target"]
        return err.pow(2).mean(), TensorDict({"abs": err.abs().mean(), "nested": {"max": err.max()}}, batch_size=[])

    params = init_stacked(lambda s: params_from_module(mlp(s)), (0,))
    batch = TensorDict({"x": x, "target": target}, batch_size=[1, 6])
    seen = []
    loss, metrics = vmap(lambda p, b: (seen.append(p["0", "weight"].grad_fn), loss_fn(p, b))[1], use_loop=True)(params, batch)
    assert loss.shape == (1,) and metrics.batch_size == (1,) and metrics["nested", "max"].shape == (1,)
    assert type(seen[0]).__name__.startswith("Squeeze")  # a view of the stacked leaf, not a select
    loss.sum().backward()

    own = params_from_module(mlp(0))
    own_loss, own_metrics = loss_fn(own, TensorDict({"x": x[0], "target": target[0]}, batch_size=[6]))
    own_loss.backward()
    assert torch.equal(loss[0], own_loss) and torch.equal(metrics["nested", "max"][0], own_metrics["nested", "max"])
    assert torch.equal(metrics["abs"][0], own_metrics["abs"])
    for g_stacked, g_own in zip([t.grad for t in leaves(params)], [t.grad for t in leaves(own)]):
        assert g_stacked.shape == (1, *g_own.shape) and torch.equal(g_stacked[0], g_own)


# --------------------------------------------------------------------------------------------
# all_finite
# --------------------------------------------------------------------------------------------


def test_all_finite():
    ok = all_finite([torch.ones(3), torch.zeros(2, 2)])
    assert ok.dim() == 0 and ok.dtype == torch.bool and bool(ok)
    assert not bool(all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])]))
    assert not bool(all_finite([torch.tensor([float("inf")])]))
    assert not bool(all_finite([torch.tensor([-float("inf")]), torch.ones(1)]))
    assert bool(all_finite([None, torch.ones(2)]))  # missing grads are skipped
    assert bool(all_finite([]))


def test_buffers_are_not_trainable_and_batchnorm_applies():
    # Regression: float buffers (BatchNorm running stats) used to get requires_grad, and
    # functional_call then failed ("native_batch_norm is not differentiable w.r.t. running_mean").
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).eval()
    params = func.params_from_module(net)
    assert params["1", "weight"].requires_grad and not params["1", "running_mean"].requires_grad
    x = torch.randn(5, 3)
    torch.testing.assert_close(func.apply(net, params, x), net(x))
    stacked = func.stack_params([params, func.params_from_module(net)])
    assert stacked["0", "weight"].requires_grad and not stacked["1", "running_var"].requires_grad
    out = func.vmap(lambda p, x: func.apply(net, p, x), (0, None))(stacked, x)
    torch.testing.assert_close(out[1], net(x))


def test_vmap_passes_keyword_arguments_to_both_paths():
    f = lambda x, *, scale: x * scale  # noqa: E731
    x = torch.randn(3, 4)
    for loop in (False, True):
        torch.testing.assert_close(func.vmap(f, use_loop=loop)(x, scale=2.0), x * 2.0)


@pytest.mark.parametrize("activation", [nn.Tanh(), nn.ReLU(inplace=True), nn.Sigmoid(), nn.ELU(alpha=0.5), nn.SiLU()])
def test_sequential_forward_and_apply_equal_func_apply_for_every_activation(activation):
    # Tanh/ReLU/Sigmoid run as torch functions (no module call), the rest as their module; the one
    # activation instance used twice must run twice (named_children() lists it once: that dropped it)
    net = nn.Sequential(nn.Linear(3, 8), activation, nn.Linear(8, 8), activation, nn.Linear(8, 2))
    params = func.params_from_module(net)
    x = torch.randn(5, 3) * 3.0
    torch.testing.assert_close(func.sequential_forward(net, params, stacked=False)(x), func.apply(net, params, x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sequential_apply(net, params, x), func.apply(net, params, x))


def test_sequential_forward_and_apply_take_a_linear_without_bias():
    """Found by a new user: nn.Linear(4, 8, bias=False) was KeyError 'key "bias" not found'. Each
    member's output equals the module's own forward, stacked and unstacked, through the fast
    forward, its (weights_of, apply) pair and the differentiable sequential_apply."""
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    stacked = func.stack_params([func.params_from_module(n) for n in nets])
    x = torch.randn(3, 5, 4)
    with torch.no_grad():
        expected = torch.stack([n(x[m]) for m, n in enumerate(nets)])
    torch.testing.assert_close(func.sequential_forward(nets[0], stacked, stacked=True)(x), expected, atol=1e-6, rtol=1e-5)
    weights_of, apply = func.sequential_apply(nets[0], stacked=True)
    assert len(weights_of(stacked)) == 3  # W0^T, W2^T, b2
    torch.testing.assert_close(apply(weights_of(stacked), x), expected, atol=1e-6, rtol=1e-5)
    for m, n in enumerate(nets):
        params = func.params_from_module(n)
        torch.testing.assert_close(func.sequential_forward(n, params, stacked=False)(x[m]), expected[m], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sequential_apply(n, params, x[m]), expected[m])
    last_no_bias = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2, bias=False))
    params = func.params_from_module(last_no_bias)
    with torch.no_grad():
        torch.testing.assert_close(func.sequential_forward(last_no_bias, params, stacked=False)(x[0]), last_no_bias(x[0]),
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sequential_apply(last_no_bias, params, x[0]), last_no_bias(x[0]))


def test_sequential_forward_equals_apply_and_sees_optimizer_steps():
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    stacked = func.stack_params([func.params_from_module(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))) for _ in range(3)])
    x = torch.randn(3, 5, 3)
    batched = func.sequential_forward(net, stacked, stacked=True)
    single = func.sequential_forward(net, stacked[1], stacked=False)
    for m in range(3):
        torch.testing.assert_close(batched(x)[m], func.apply(net, stacked[m], x[m]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(single(x[1]), func.apply(net, stacked[1], x[1]), atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # an in-place step on the leaves, as the optimizer does
        for leaf in func.leaves(stacked):
            leaf.mul_(0.5)
    torch.testing.assert_close(batched(x)[2], func.apply(net, stacked[2], x[2]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(single(x[1]), func.apply(net, stacked[1], x[1]), atol=1e-6, rtol=1e-5)
    with pytest.raises(ShapeError, match="BatchNorm1d"):
        bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        func.sequential_forward(bn, func.stack_params([func.params_from_module(bn)] * 3), stacked=True)


def test_polyak_update_checks_tau_and_the_structures():
    """New-user pass: tau=2.0 extrapolated (target = 2 online - target) though the docstring says [0, 1];
    structures of other leaf counts were torch's "Tensor lists must have the same number of tensors"."""
    from rlfunc.errors import ConfigError

    target = TensorDict({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, batch_size=[])
    online = TensorDict({"w": torch.ones(2, 3), "b": torch.full((3,), 2.0)}, batch_size=[])
    for tau in (2.0, -0.1, float("nan"), True, "0.1"):
        with pytest.raises(ConfigError, match=r"^tau=.*: expected a number in \[0, 1\]$"):
            F.polyak_update_(target, online, tau)
    with pytest.raises(ShapeError, match=r"^target \(2 leaves\) and online \(1 leaves\)"):
        F.polyak_update_(target, online.exclude("b"), 0.5)
    with pytest.raises(ShapeError, match="expected the same structure and shapes"):
        F.polyak_update_(target, TensorDict({"w": torch.ones(3, 2), "b": torch.ones(3)}, batch_size=[]), 0.5)
    F.polyak_update_(target, online, 0.25)  # (1 - tau) * 0 + tau * online
    assert torch.equal(target["w"], torch.full((2, 3), 0.25)) and torch.equal(target["b"], torch.full((3,), 0.5))


def test_vmap_names_an_empty_member_dim_and_a_dim_the_input_lacks_on_both_paths():
    """New-user pass: the loop path failed on zero members with an IndexError inside _stack_outputs
    while the vmap path returned an empty tensor (the docstring says they agree); in_dims=5 was
    "tuple index out of range" on both."""
    fn = lambda x: x.sum(-1)  # noqa: E731
    for use_loop in (True, False):
        with pytest.raises(ShapeError, match="^vmap: the mapped dim has size 0: no members to map over$"):
            vmap(fn, use_loop=use_loop)(torch.zeros(0, 3))
        with pytest.raises(ShapeError, match=r"^vmap: in_dims 5 is not a dim of an input of shape \(2, 3\)$"):
            vmap(fn, in_dims=5, use_loop=use_loop)(torch.zeros(2, 3))
        assert torch.equal(vmap(fn, use_loop=use_loop)(torch.ones(2, 3)), torch.full((2,), 3.0))


@pytest.mark.parametrize("use_loop", [True, False, None])
def test_vmap_maps_a_dict_of_stacked_params_and_takes_a_device_name(use_loop):
    """Regression (functional-core pass): torch.func.stack_module_state's dict of params was "in_dims 0 is not
    a dim of an input of shape None" on the loop path, and device="cpu" an AttributeError; both paths now
    equal each member's own forward."""
    from torch.func import functional_call, stack_module_state

    torch.manual_seed(0)
    members = [nn.Linear(3, 2) for _ in range(4)]
    params, _ = stack_module_state(members)
    obs = torch.randn(5, 3)
    got = vmap(lambda p, o: functional_call(members[0], p, (o,)), (0, None), use_loop=use_loop, device="cpu")(params, obs)
    torch.testing.assert_close(got, torch.stack([m(obs) for m in members]), rtol=0, atol=1e-6)
    buffers = stack_module_state(members)[1]  # {}: Linear has no buffers; mapped as torch.func.vmap maps it (review pass)
    assert buffers == {}
    got = vmap(lambda p, b, o: functional_call(members[0], (p, b), (o,)), (0, 0, None), use_loop=use_loop)(params, buffers, obs)
    torch.testing.assert_close(got, torch.stack([m(obs) for m in members]), rtol=0, atol=1e-6)
    with pytest.raises(ShapeError, match=r"member counts \[3, 4\]"):
        vmap(lambda p: p["a"], 0, use_loop=True)({"a": torch.ones(3), "b": torch.ones(4)})
    with pytest.raises(ShapeError, match=r"in_dims entry \(0, 0\)"):
        vmap(lambda p, o: o, ((0, 0), None), use_loop=use_loop)(params, obs)


def test_params_from_module_keeps_a_tied_weight_once_and_apply_ties_it_again():
    # Regression: a module with tied weights (b.weight is a.weight) gave params holding two copies, the
    # second without grad, and apply() failed in functional_call ("got multiple values for keys ...
    # which are tied"). The tensor is kept once; its gradient sums both uses, as the module's own.
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    module, x = Tied(), torch.randn(4, 3)
    params = params_from_module(module)
    assert sorted(params.keys(include_nested=True, leaves_only=True)) == [("a", "bias"), ("a", "weight"), ("b", "bias")]
    assert all(v.requires_grad for v in params.values(include_nested=True, leaves_only=True))
    out = apply(module, params, x)
    module(x).square().sum().backward()
    torch.testing.assert_close(out, module(x).detach())
    out.square().sum().backward()
    torch.testing.assert_close(params["a", "weight"].grad, module.a.weight.grad)  # both uses
    torch.testing.assert_close(params["b", "bias"].grad, module.b.bias.grad)


def test_the_fast_sequential_forwards_take_a_reused_layer_and_a_tied_weight():
    # Regression (review pass): after params_from_module kept a shared tensor once, func.sequential_forward and
    # nets.actor_critic.sequential_apply looked the second use up under its own name: a raw KeyError.
    from rlfunc.core.func import sequential_forward
    from rlfunc.nets.actor_critic import sequential_apply as differentiable_apply

    torch.manual_seed(0)
    reused = nn.Linear(3, 3)
    tied = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    tied[2].weight = tied[0].weight
    x = torch.randn(5, 3)
    for net in (nn.Sequential(reused, nn.Tanh(), reused), tied):
        params = params_from_module(net)
        want = apply(net, params, x)
        torch.testing.assert_close(sequential_forward(net, params, stacked=False)(x), want.detach())
        got = differentiable_apply(net, params, x)
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got.sum(), list(params.values(include_nested=True, leaves_only=True)))
        want_grads = torch.autograd.grad(want.sum(), list(params.values(include_nested=True, leaves_only=True)))
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w)
        stacked = stack_params([params, params])
        torch.testing.assert_close(sequential_forward(net, stacked, stacked=True)(x.expand(2, 5, 3)), want.detach().expand(2, 5, 3))
