"""rlfunc.optim's gradient transforms: chain(clip, adam) against torch.optim.Adam + clip_grads_, a
float64 reference loop, the per-member skip mask, frozen leaves, and the state through a snapshot."""

import pytest
import torch
from tensordict import TensorDict

from rlfunc.core.func import as_leaves, leaves
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.run.checkpoint import load_snapshot, save_snapshot
from rlfunc.optim import (
    GradientTransform,
    adam,
    apply_updates,
    chain,
    clip_by_global_norm,
    clip_grads_,
    flatten,
    global_norm,
    linear_lr,
    masked_step,
    set_lr,
    tree_leaves,
    tree_like,
)

LR, EPS, BETAS, MAX_NORM = 0.01, 1e-5, (0.9, 0.999), 2.0


def stacked_params(members: int = 3, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    td = TensorDict(
        {
            "net": {"0": {"weight": torch.randn(members, 4, 3, generator=g), "bias": torch.randn(members, 4, generator=g)},
                    "2": {"weight": torch.randn(members, 2, 4, generator=g), "bias": torch.randn(members, 2, generator=g)}},
            "log_std": torch.randn(members, 2, generator=g),
        },
        batch_size=[members],
    )
    return as_leaves(td)


def random_grads(params: TensorDict, step: int) -> list[torch.Tensor]:
    """Gradients in func.leaves order, of varied sizes so that some steps clip and some do not."""
    g = torch.Generator().manual_seed(100 + step)
    scale = 0.2 + 3.0 * (step % 3)
    return [torch.randn(p.shape, generator=g) * scale for p in leaves(params)]


def as_td(params: TensorDict, grads: list[torch.Tensor]) -> TensorDict:
    keys = sorted(params.keys(include_nested=True, leaves_only=True), key=str)  # func.leaves order
    return TensorDict(dict(zip(keys, grads)), batch_size=[])


def reference_float64(params: TensorDict, steps: int, lrs: list[float]) -> list[torch.Tensor]:
    """Clip per member then Adam, written out in float64 for clarity."""
    p = [x.detach().double().clone() for x in leaves(params)]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    b1, b2 = BETAS
    for t in range(1, steps + 1):
        g = [x.double() for x in random_grads(params, t - 1)]
        for s in range(p[0].shape[0]):
            norm = torch.cat([x[s].flatten() for x in g]).norm()
            scale = min(1.0, MAX_NORM / (float(norm) + 1e-6))
            for x in g:
                x[s] *= scale
        for i in range(len(p)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            p[i] = p[i] - lrs[t - 1] * m_hat / (v_hat.sqrt() + EPS)
    return p


def test_chain_clip_adam_equals_torch_optim_adam_and_clip_grads_over_20_steps():
    steps = 20
    lrs = [linear_lr(LR, t, steps) for t in range(steps)]  # an annealed lr, set per step
    ours = stacked_params()
    theirs = stacked_params()
    opt = torch.optim.Adam(leaves(theirs), lr=LR, eps=EPS, betas=BETAS, foreach=True)
    update = chain(clip_by_global_norm(MAX_NORM, stacked=True), adam(LR, BETAS, EPS))
    state = update.init(ours)
    seen = []
    for t in range(steps):
        grads = random_grads(ours, t)
        for p, g in zip(leaves(theirs), grads):
            p.grad = g.clone()
        norms = clip_grads_([p.grad for p in leaves(theirs)], MAX_NORM, stacked=True)
        set_lr(opt, lrs[t])
        opt.step()
        updates, state = update.update(as_td(ours, grads), state, ours, lr=lrs[t])
        apply_updates(ours, updates)
        torch.testing.assert_close(state["0", "norm"], norms, rtol=0, atol=0)  # the pre-clip norms, for metrics
        seen.append(norms)
    assert bool((torch.cat(seen) > MAX_NORM).any()) and bool((torch.cat(seen) < MAX_NORM).any())  # clipped and not
    for p, q in zip(leaves(ours), leaves(theirs)):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
        assert p.dtype == torch.float32
    # the moments and steps are torch.optim's, leaf for leaf
    keys = sorted(ours.keys(include_nested=True, leaves_only=True), key=str)
    for key, q in zip(keys, leaves(theirs)):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(state["1", name].get(key), opt.state[q][name], rtol=0, atol=1e-7)
    # both float32 paths agree with the float64 reference
    for p, r in zip(leaves(ours), reference_float64(stacked_params(), steps, lrs)):
        torch.testing.assert_close(p.detach().double(), r, rtol=0, atol=1e-5)


def test_skip_mask_leaves_a_member_bit_identical_and_matches_masked_step():
    ours, theirs = stacked_params(), stacked_params()
    opt = torch.optim.Adam(leaves(theirs), lr=LR, eps=EPS, betas=BETAS, foreach=True)
    update = chain(clip_by_global_norm(MAX_NORM, stacked=True), adam(LR, BETAS, EPS))
    state = update.init(ours)
    for t in range(6):
        grads = random_grads(ours, t)
        ok = torch.tensor([True, True, True])
        if t in (0, 3):  # member 1 non-finite (on the first step too: its moments are still zeros)
            ok = torch.tensor([True, False, True])
            for g in grads:
                g[1] = float("nan")
                g[1].view(-1)[0] = float("inf")
        norms = global_norm(as_td(ours, grads), stacked=True)
        assert bool(norms.isfinite().eq(ok).all())
        before = ours.detach().clone()
        moments = state.clone()
        # reference: torch.optim.Adam under masked_step, on sanitised gradients as PPO gives them
        for p, g in zip(leaves(theirs), grads):
            p.grad = g.nan_to_num(0.0, 0.0, 0.0)
        clip_grads_([p.grad for p in leaves(theirs)], MAX_NORM, stacked=True, norms=norms)
        masked_step(opt, leaves(theirs), ok)
        updates, state = update.update(as_td(ours, grads), state, ours, mask=ok, grad_norm=norms)
        apply_updates(ours, updates)
        if not ok[1]:
            for a, b in zip(tree_leaves(ours), tree_leaves(before)):
                assert torch.equal(a.detach()[1], b[1])
            for name in ("exp_avg", "exp_avg_sq"):
                for a, b in zip(tree_leaves(state["1", name]), tree_leaves(moments["1", name])):
                    assert torch.equal(a[1], b[1]), name
        for a, b in zip(tree_leaves(ours), tree_leaves(before)):
            assert not torch.equal(a.detach()[0], b[0]) and not torch.equal(a.detach()[2], b[2])
        for p, q in zip(leaves(ours), leaves(theirs)):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    assert all(torch.isfinite(x).all() for x in tree_leaves(state["1"]))


def test_a_single_member_skipped_changes_nothing_not_even_the_step():
    params = stacked_params(members=1)
    update = chain(clip_by_global_norm(MAX_NORM, stacked=True), adam(LR, BETAS, EPS))
    state = update.init(params)
    updates, state = update.update(as_td(params, random_grads(params, 0)), state, params)
    apply_updates(params, updates)
    before, saved = params.detach().clone(), state.clone()
    grads = [g.fill_(float("nan")) for g in random_grads(params, 1)]
    updates, state = update.update(as_td(params, grads), state, params, mask=torch.tensor([False]))
    apply_updates(params, updates)
    for a, b in zip(tree_leaves(params), tree_leaves(before)):
        assert torch.equal(a.detach(), b)
    for a, b in zip(tree_leaves(state["1"]), tree_leaves(saved["1"])):
        assert torch.equal(a, b)


def test_frozen_leaves_left_out_of_the_gradients_keep_their_state_as_torch_optim_does():
    ours, theirs = stacked_params(), stacked_params()
    opt = torch.optim.Adam(leaves(theirs), lr=LR, eps=EPS, betas=BETAS, foreach=True)
    update = adam(LR, BETAS, EPS)
    state = update.init(ours)
    keys = sorted(ours.keys(include_nested=True, leaves_only=True), key=str)
    frozen = keys.index(("net", "2", "weight"))
    for t in range(4):
        grads = random_grads(ours, t)
        for i, (p, g) in enumerate(zip(leaves(theirs), grads)):
            p.grad = None if (t >= 2 and i == frozen) else g.clone()
        opt.step()
        td = as_td(ours, grads)
        if t >= 2:
            td = td.exclude(("net", "2", "weight"))
        updates, state = update.update(td, state, ours)
        apply_updates(ours, updates)
    for key, p, q in zip(keys, leaves(ours), leaves(theirs)):
        assert torch.equal(p.detach(), q.detach()), key
        assert float(state["step"].get(key)) == float(opt.state[q]["step"]), key
    assert float(state["step", "net", "2", "weight"]) == 2.0 and float(state["step", "log_std"]) == 4.0


def test_state_round_trips_through_a_snapshot(tmp_path):
    params = stacked_params()
    update = chain(clip_by_global_norm(MAX_NORM, stacked=True), adam(LR, BETAS, EPS))
    state = update.init(params)
    for t in range(3):
        updates, state = update.update(as_td(params, random_grads(params, t)), state, params)
        apply_updates(params, updates)
    save_snapshot(tmp_path / "snap", TensorDict({"params": params.detach(), "optim": state}, batch_size=[]), {"note": "t"})
    like = TensorDict({"params": stacked_params().detach(), "optim": update.init(stacked_params())}, batch_size=[])
    loaded, _ = load_snapshot(tmp_path / "snap", like=like)
    restored = as_leaves(loaded["params"].clone())
    restored_state = loaded["optim"]
    for t in range(3, 6):
        grads = random_grads(params, t)
        updates, state = update.update(as_td(params, grads), state, params)
        apply_updates(params, updates)
        updates, restored_state = update.update(as_td(restored, grads), restored_state, restored)
        apply_updates(restored, updates)
    for a, b in zip(tree_leaves(params), tree_leaves(restored)):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(tree_leaves(state), tree_leaves(restored_state)):
        assert torch.equal(a, b)
    assert float(state["1", "step", "log_std"]) == 6.0


def test_unstacked_clip_is_the_global_norm():
    # one member over two tensors: norm sqrt(1 + 4 + 4 + 16) = 5; max_norm 1 scales by 1/5
    grads = TensorDict({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[2.0], [4.0]])}, batch_size=[])
    clip = clip_by_global_norm(1.0, stacked=False)
    out, state = clip.update(grads, clip.init(grads))
    torch.testing.assert_close(state["norm"], torch.tensor([5.0]))
    torch.testing.assert_close(out["a"], torch.tensor([0.2, 0.4]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["b"], torch.tensor([[0.4], [0.8]]), rtol=1e-5, atol=1e-6)
    assert torch.equal(grads["a"], torch.tensor([1.0, 2.0]))  # the input is not scaled in place


def test_tree_leaves_ignores_insertion_order_and_tree_like_rebuilds():
    a = TensorDict({"x": torch.zeros(1), "n": {"b": torch.ones(2), "a": torch.ones(3)}}, batch_size=[])
    b = TensorDict({"n": {"a": torch.ones(3), "b": torch.ones(2)}, "x": torch.zeros(1)}, batch_size=[])
    assert [t.shape for t in tree_leaves(a)] == [t.shape for t in tree_leaves(b)] == [(3,), (2,), (1,)]
    params = stacked_params()
    assert [id(t) for t in tree_leaves(params)] == [id(t) for t in leaves(params)]  # func.leaves' order
    rebuilt = tree_like(b, [torch.full((3,), 7.0), torch.full((2,), 8.0), torch.full((1,), 9.0)])
    assert float(rebuilt["n", "a"][0]) == 7.0 and float(rebuilt["x"][0]) == 9.0
    with pytest.raises(ShapeError, match="1 tensors for the template.s 3 leaves"):
        tree_like(a, [torch.zeros(3)])


@pytest.mark.parametrize("make", [lambda: adam(0.0), lambda: adam(1e-3, betas=(1.0, 0.9)), lambda: adam(1e-3, eps=-1.0),
                                  lambda: clip_by_global_norm(0.0)])
def test_bad_hyperparameters_raise(make):
    with pytest.raises(ConfigError):
        make()


def test_hyperparameters_of_the_wrong_type_and_an_empty_params_are_named():
    # found by a new user: adam("1e-3") raised TypeError from a comparison inside adam, and
    # clip_by_global_norm's init of an empty TensorDict an IndexError
    with pytest.raises(ConfigError, match=r"^lr='1e-3': expected a positive learning rate$"):
        adam("1e-3")
    with pytest.raises(ConfigError, match=r"^betas=0.9: expected two values in \[0, 1\)$"):
        adam(1e-3, betas=0.9)
    with pytest.raises(ConfigError, match=r"^max_norm='1': expected > 0$"):
        clip_by_global_norm("1")
    with pytest.raises(ShapeError, match="clip_by_global_norm: params has no tensors to clip"):
        clip_by_global_norm(1.0).init(TensorDict({}, batch_size=[]))


def test_gradients_of_another_shape_are_named():
    params = stacked_params()
    update = adam(LR)
    state = update.init(params)
    grads = as_td(params, random_grads(params, 0))
    grads["log_std"] = torch.zeros(3, 5)
    with pytest.raises(ShapeError, match="log_std"):
        update.update(grads, state, params)
    with pytest.raises(ShapeError, match="nope"):
        update.update(TensorDict({"nope": torch.zeros(3)}, batch_size=[]), state, params)
    # the bug: float64 (or integer) gradients for float32 state were a RuntimeError from inside torch's adam
    grads = as_td(params, random_grads(params, 0))
    grads["log_std"] = grads["log_std"].double()
    with pytest.raises(ShapeError, match=r"^adam: \('log_std',\) has dtype torch.float64 in the gradients, torch.float32 in the state$"):
        update.update(grads, state, params)


def test_a_mask_that_is_not_bool_of_the_members_is_named():
    """Found by a new user: an int mask [1, 0, 1] skipped every member (~ of ints is -2, -1, -2), a
    mask of the wrong length skipped other members, a [True, False] mask on unstacked params froze
    rows of every weight, and a float mask was a TypeError from inside. A ShapeError now."""
    params = stacked_params()  # S = 3
    update = adam(LR)
    state = update.init(params)
    grads = as_td(params, random_grads(params, 0))
    for mask, match in [(torch.tensor([1, 0, 1]), r"^adam.update: mask has dtype torch.int64, expected torch.bool"),
                        (torch.tensor([1.0, 0.0, 1.0]), r"^adam.update: mask has dtype torch.float32, expected torch.bool"),
                        ([True, False, True], r"^adam.update: mask is a list, expected a bool tensor"),
                        (torch.tensor([True, False]), r"^adam.update: mask has shape \[2\], but leaf .* has shape \[3, 4\]: expected \[S\]"),
                        (torch.ones(3, 1, dtype=torch.bool), r"^adam.update: mask has shape \[3, 1\], expected \[S\]")]:
        with pytest.raises(ShapeError, match=match):
            update.update(grads, state, params, mask=mask)
    assert all(not t.any() for t in tree_leaves(state))  # nothing moved before the error
    unstacked = TensorDict({"0": {"weight": torch.randn(8, 4), "bias": torch.randn(8)},
                            "1": {"weight": torch.randn(2, 8), "bias": torch.randn(2)}}, batch_size=[])
    ustate = update.init(unstacked)
    with pytest.raises(ShapeError, match=r"mask has shape \[2\], but leaf \('0', 'bias'\) has shape \[8\].*\[1\] for unstacked params"):
        update.update(unstacked.clone(), ustate, unstacked, mask=torch.tensor([True, False]))
    for flag in (torch.tensor([False]), torch.tensor(False)):  # one flag: the whole step skipped
        updates, ustate = update.update(unstacked.clone(), ustate, unstacked, mask=flag)
        assert all(not u.any() for u in tree_leaves(updates)) and all(not t.any() for t in tree_leaves(ustate))
    updates, state = update.update(grads, state, params, mask=torch.tensor([True, False, True]))  # the valid form
    assert all(not u[1].any() and u[0].all() for u in tree_leaves(updates))


def test_a_per_step_lr_that_is_not_finite_and_non_negative_is_named():
    """Found by a new user: update(..., lr=nan) made every parameter NaN and lr=-1e-2 ran gradient
    ascent (the constructor checked its lr, the per-step one was not). lr=0 (a schedule's end) is a
    zero step; a tensor lr is checked for dtype and size only (no host read)."""
    params = stacked_params()
    update = adam(LR)
    state = update.init(params)
    grads = as_td(params, random_grads(params, 0))
    for lr in (float("nan"), float("inf"), -1e-2):
        with pytest.raises(ConfigError, match=rf"^adam.update: lr={lr!r}: expected a finite learning rate >= 0$"):
            update.update(grads, state, params, lr=lr)
    with pytest.raises(ConfigError, match=r"^adam.update: lr='1e-3': expected a finite number >= 0"):
        update.update(grads, state, params, lr="1e-3")
    with pytest.raises(ShapeError, match=r"^adam.update: lr is a torch.int64 tensor of shape \[\], expected a floating tensor"):
        update.update(grads, state, params, lr=torch.tensor(1))
    with pytest.raises(ShapeError, match=r"lr is a torch.float32 tensor of shape \[3\]"):
        update.update(grads, state, params, lr=torch.full((3,), LR))
    assert all(not t.any() for t in tree_leaves(state))  # nothing moved before the errors
    updates, _ = update.update(grads, state, params, lr=0.0)
    assert all(not u.any() for u in tree_leaves(updates))
    updates, _ = adam(LR).update(grads, adam(LR).init(params), params, lr=torch.tensor(LR))
    expected, _ = adam(LR).update(grads, adam(LR).init(params), params)
    for a, b in zip(tree_leaves(updates), tree_leaves(expected)):
        assert torch.equal(a, b)


def test_torch_optim_state_converts_and_continues_identically():
    from rlfunc.optim import adam_state_from_torch, optimizer_state

    ours, theirs = stacked_params(), stacked_params()
    opt = torch.optim.Adam(leaves(theirs), lr=LR, eps=EPS, betas=BETAS, foreach=True)
    for t in range(3):
        for p, g in zip(leaves(theirs), random_grads(theirs, t)):
            p.grad = g
        opt.step()
    with torch.no_grad():
        for p, q in zip(leaves(ours), leaves(theirs)):
            p.copy_(q)
    update = chain(clip_by_global_norm(MAX_NORM, stacked=True), adam(LR, BETAS, EPS))
    state = adam_state_from_torch(optimizer_state(opt), update.init(ours), ours)
    for t in range(3, 6):
        grads = random_grads(ours, t)
        for p, g in zip(leaves(theirs), grads):
            p.grad = g.clone()
        clip_grads_([p.grad for p in leaves(theirs)], MAX_NORM, stacked=True)
        opt.step()
        updates, state = update.update(as_td(ours, grads), state, ours)
        apply_updates(ours, updates)
    for p, q in zip(leaves(ours), leaves(theirs)):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    assert float(state["1", "step", "log_std"]) == 6.0
    with pytest.raises(ValueError, match="4 torch.optim entries for 5 parameter leaves"):
        adam_state_from_torch(optimizer_state(opt).exclude("4"), update.init(ours), ours)


def test_torch_optim_state_of_some_leaves_converts_the_rest_kept_fresh():
    # torch.optim holds no state for a leaf that never had a gradient; indices name those it holds
    from rlfunc.optim import adam_state_from_torch, optimizer_state

    params = stacked_params()
    opt = torch.optim.Adam(leaves(params), lr=LR, eps=EPS, betas=BETAS, foreach=True)
    for p, g in zip(leaves(params)[:2], random_grads(params, 0)[:2]):
        p.grad = g
    opt.step()
    update = chain(clip_by_global_norm(MAX_NORM, stacked=True), adam(LR, BETAS, EPS))
    fresh = update.init(params)
    state = adam_state_from_torch(optimizer_state(opt), fresh, params, indices=[0, 1])
    keys = sorted(params.keys(include_nested=True, leaves_only=True), key=str)
    for i, key in enumerate(keys):
        want = opt.state.get(leaves(params)[i], {})  # .get: the state is a defaultdict
        if i < 2:
            assert torch.equal(state["1", "exp_avg"].get(key), want["exp_avg"]) and float(state["1", "step"].get(key)) == 1.0
        else:
            assert not want and float(state["1", "step"].get(key)) == 0.0 and not state["1", "exp_avg_sq"].get(key).any()
    with pytest.raises(ValueError, match="2 torch.optim entries for 3 parameter leaves"):
        adam_state_from_torch(optimizer_state(opt), fresh, params, indices=[0, 1, 2])
    with pytest.raises(ValueError, match="outside the 5 parameter leaves"):
        adam_state_from_torch(optimizer_state(opt), fresh, params, indices=[0, 5])


def test_clip_by_global_norm_defaults_to_one_parameter_set_as_optax():
    # found by a fresh-user pass: the default used to be stacked=True, so a plain nn.Linear's params
    # raised IndexError (its bias) or, without a bias, were clipped row by row
    import torch.nn as nn

    from rlfunc.core.func import params_from_module
    from rlfunc.errors import ShapeError

    for net in (nn.Linear(3, 2), nn.Linear(3, 4, bias=False)):
        params = params_from_module(net)
        grads = params.apply(lambda p: torch.full_like(p, 10.0))
        update = clip_by_global_norm(0.5)
        updates, state = update.update(grads, update.init(params), params)
        norm = torch.cat([g.flatten() for g in leaves(grads)]).norm()  # one norm over every leaf
        reference = [g * min(1.0, 0.5 / (float(norm) + 1e-6)) for g in leaves(grads)]
        assert state["norm"].shape == (1,) and torch.allclose(state["norm"], norm.reshape(1))
        for ours, theirs in zip(leaves(updates), reference):
            torch.testing.assert_close(ours, theirs)
    with pytest.raises(ShapeError, match="share no leading seed dim"):
        clip_by_global_norm(0.5, stacked=True).init(TensorDict({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, []))


def test_adam_weight_decay_steps_as_torch_optim_adamw_and_skips_a_member_as_adam_does():
    """adam(weight_decay=wd) (torch's functional AdamW on a copy of the params) moves them as
    torch.optim.AdamW over 20 steps with clipping, to the rounding of the update's difference; a
    member masked out keeps its parameters bit for bit; without params it refuses to step."""
    steps, wd = 20, 0.1
    ours, theirs = stacked_params(), stacked_params()
    opt = torch.optim.AdamW(leaves(theirs), lr=LR, eps=EPS, betas=BETAS, weight_decay=wd, foreach=True)
    update = chain(clip_by_global_norm(MAX_NORM, stacked=True), adam(LR, BETAS, EPS, weight_decay=wd))
    state = update.init(ours)
    for t in range(steps):
        grads = random_grads(ours, t)
        for p, g in zip(leaves(theirs), grads):
            p.grad = g.clone()
        clip_grads_([p.grad for p in leaves(theirs)], MAX_NORM, stacked=True)
        opt.step()
        updates, state = update.update(as_td(ours, grads), state, ours)
        apply_updates(ours, updates)
    for p, q in zip(leaves(ours), leaves(theirs)):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    plain = stacked_params()
    plain_state = adam(LR, BETAS, EPS).init(plain)
    for t in range(steps):  # the decay moved them: not Adam's path
        u, plain_state = adam(LR, BETAS, EPS).update(as_td(plain, random_grads(plain, t)), plain_state, plain)
        apply_updates(plain, u)
    assert any(not torch.allclose(p, q) for p, q in zip(leaves(ours), leaves(plain)))
    before = [p.detach().clone() for p in leaves(ours)]
    grads = [g.clone() for g in random_grads(ours, 0)]
    grads[0][1] = float("nan")
    updates, state = update.update(as_td(ours, grads), state, ours, mask=torch.tensor([True, False, True]))
    apply_updates(ours, updates)
    for p, b in zip(leaves(ours), before):
        assert torch.equal(p[1], b[1]) and not torch.equal(p[0], b[0])
    with pytest.raises(ConfigError, match="expected the params"):
        adam(LR, weight_decay=wd).update(as_td(ours, grads), state["1"])
    with pytest.raises(ConfigError, match="weight_decay=-1"):
        adam(LR, weight_decay=-1.0)


def test_partition_steps_each_group_as_a_torch_optim_parameter_group():
    """chain(clip, partition({"a": adam(lr_a), "b": adam(lr_b)})) moves the params as one
    torch.optim.Adam with two parameter groups after a joint clip, bit for bit; its state is one Adam
    state per group; a group without gradients keeps its state."""
    from rlfunc.optim import partition

    def two_groups(seed: int = 0) -> TensorDict:
        g = torch.Generator().manual_seed(seed)
        return as_leaves(TensorDict({"a": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)},
                                     "b": {"w": torch.randn(2, 4, generator=g)}}, batch_size=[]))

    ours, theirs = two_groups(), two_groups()
    opt = torch.optim.Adam([{"params": leaves(theirs["a"]), "lr": 0.01}, {"params": leaves(theirs["b"]), "lr": 0.1}],
                           eps=EPS, foreach=True)
    update = chain(clip_by_global_norm(MAX_NORM, stacked=False), partition({"a": adam(0.01, eps=EPS), "b": adam(0.1, eps=EPS)}))
    state = update.init(ours)
    assert set(state["1"].keys()) == {"a", "b"} and set(state["1", "a"].keys()) == {"step", "exp_avg", "exp_avg_sq"}
    for t in range(10):
        g = torch.Generator().manual_seed(t)
        grads = [torch.randn(p.shape, generator=g) * (0.5 + 3 * (t % 2)) for p in leaves(ours)]
        for p, x in zip(leaves(theirs), grads):
            p.grad = x.clone()
        clip_grads_([p.grad for p in leaves(theirs)], MAX_NORM, stacked=False)
        opt.step()
        updates, state = update.update(as_td(ours, grads), state, ours)
        apply_updates(ours, updates)
    for p, q in zip(leaves(ours), leaves(theirs)):
        assert torch.equal(p.detach(), q.detach())
    before = state["1", "b"].clone()
    updates, state = update.update(TensorDict({"a": {"w": torch.ones(4, 3), "b": torch.ones(4)}}, batch_size=[]), state, ours)
    assert set(updates.keys()) == {"a"} and (state["1", "b"] == before).all()
    with pytest.raises(ShapeError, match="expected the groups"):
        partition({"a": adam(0.01)}).init(ours)


def test_adam_refuses_an_infinite_lr_and_steps_params_without_leaves():
    """New-user pass: adam(float("inf")) was accepted and one step made every parameter -inf; an update
    of params without leaves was an IndexError from inside the step."""
    with pytest.raises(ConfigError, match=r"^lr=inf: expected a finite positive learning rate$"):
        adam(float("inf"))
    for lr in (float("nan"), 0.0):
        with pytest.raises(ConfigError, match=r"^lr=.*: expected a positive learning rate$"):
            adam(lr)
    update = adam(LR, BETAS, EPS)
    empty = TensorDict({}, batch_size=[])
    state = update.init(empty)
    updates, new_state = update.update(empty, state, empty)
    assert len(list(updates.keys(True, True))) == 0 and new_state is state


def test_a_chain_with_a_link_of_only_update_has_update_leaves():
    """New-user pass: a link written as the docs define one (init and update only) left the chain's
    update_leaves None, and PPO's update, which calls it, raised "'NoneType' object is not callable"."""
    half = GradientTransform(lambda p: TensorDict({}, []), lambda g, s, p=None, **kw: (g.apply(lambda x: 0.5 * x), s))
    params = TensorDict({"w": torch.ones(2, 3), "b": torch.zeros(2)}, [])
    grads = TensorDict({"w": torch.full((2, 3), 2.0), "b": torch.tensor([1.0, -1.0])}, [])
    opt = chain(half, adam(0.1))
    assert opt.update_leaves is not None
    g, treedef = flatten(grads)
    updates, _ = opt.update_leaves(g, treedef, opt.init(params), params)
    reference, _ = opt.update(grads, opt.init(params), params)
    # Adam's first step is -lr * sign(g) (|m_hat| = sqrt(v_hat)), whatever the halving
    expected = {"b": torch.tensor([-0.1, 0.1]), "w": torch.full((2, 3), -0.1)}
    for key, u in zip(("b", "w"), updates):
        torch.testing.assert_close(u, expected[key])
        torch.testing.assert_close(reference[key], expected[key])


def test_stacked_clipping_under_a_loss_scale_and_transform_step_clips_each_member():
    """New-user pass: transform_step and dynamic_loss_scale hand the inner chain one global norm [1]; a
    stacked clip then scaled every member by all members' norm (member 1, norm 0.1, came out 10x
    smaller, beside member 0's norm 10) and its state's norm became [1] instead of [S]."""
    from rlfunc.optim.amp import dynamic_loss_scale, transform_step

    g = torch.tensor([[6.0, 8.0], [0.06, 0.08]])  # member norms 10 and 0.1
    want = torch.stack([g[0] / (10 + 1e-6), g[1]])  # member 0 clipped to norm 1, member 1 left
    clip = clip_by_global_norm(1.0, stacked=True)
    params = TensorDict({"w": torch.zeros(2, 2).requires_grad_()}, batch_size=[])
    params["w"].grad = g.clone()
    _, taken, state = transform_step(clip, clip.init(params), params)
    assert taken and state["norm"].shape == (2,)
    torch.testing.assert_close(params["w"].detach(), want)
    scaled = dynamic_loss_scale(clip, init_scale=1.0)
    updates, state = scaled.update(TensorDict({"w": g.clone()}, batch_size=[]), scaled.init(params), params)
    torch.testing.assert_close(updates["w"], want)
    assert state["inner", "norm"].shape == (2,)


def test_stacked_clipping_keeps_each_leafs_dtype_and_half_norms_do_not_overflow():
    """New-user pass: a float32 per-member scale promoted a bfloat16 leaf's gradient to float32 (adam then
    refused it, blaming the gradients), and float16 gradients of 300 squared in float16 gave a norm of
    inf (600 in float32), so clipping left them unscaled and a chain skipped every finite step."""
    params = TensorDict({"w": torch.randn(2, 3), "h": torch.randn(2, 3).bfloat16()}, batch_size=[])
    tx = chain(clip_by_global_norm(0.1, stacked=True), adam(1e-3))
    updates, _ = tx.update(params.clone(), tx.init(params), params)
    assert updates["h"].dtype == torch.bfloat16 and updates["w"].dtype == torch.float32
    half = TensorDict({"w": torch.full((4,), 300.0, dtype=torch.float16)}, batch_size=[])
    torch.testing.assert_close(global_norm(half, False), torch.tensor([600.0]))
    clipped, _ = clip_by_global_norm(1.0).update(half, clip_by_global_norm(1.0).init(half))
    torch.testing.assert_close(clipped["w"].float(), torch.full((4,), 0.5), atol=1e-3, rtol=1e-3)


def test_no_gradients_are_a_no_op_and_a_foreign_state_is_one_line():
    """New-user pass: with every leaf frozen (no gradients) chain(clip, adam).update and apply_updates were
    RuntimeErrors from torch.stack / _foreach_add_; a state of another transform (a link added, adam given a
    chain's state) a bare KeyError; integer params passed adam.init and failed inside torch's adam; and
    messages named "the state" where the params were missing the key or had the other shape."""
    params = TensorDict({"w": torch.randn(3)}, batch_size=[])
    tx = chain(clip_by_global_norm(1.0), adam(1e-3))
    state = tx.init(params)
    updates, new_state = tx.update(TensorDict({}, batch_size=[]), state, params)
    assert list(updates.keys()) == [] and apply_updates(params, updates) is params
    assert torch.equal(new_state["0", "norm"], state["0", "norm"])
    grads = TensorDict({"w": torch.ones(3)}, batch_size=[])
    with pytest.raises(ShapeError, match=r"^chain: a state with links \['0', '1'\], this chain has 3"):
        chain(clip_by_global_norm(1.0), adam(1e-3), clip_by_global_norm(1.0)).update(grads, state, params)
    with pytest.raises(ShapeError, match=r"^adam: a state with keys \['0', '1'\], expected \['exp_avg', 'exp_avg_sq', 'step'\]"):
        adam(1e-3).update(grads, state, params)
    # integer leaves: a BatchNorm's counter, without a gradient, is left out (its init worked before and must);
    # an integer gradient failed inside torch's adam ("lerp_kernel_scalar" not implemented for 'Long')
    from torch import nn

    from rlfunc.core.func import params_from_module

    norm = params_from_module(nn.BatchNorm1d(4))
    assert adam(1e-3).init(norm)["exp_avg", "num_batches_tracked"].dtype == torch.int64
    counts = TensorDict({"count": torch.arange(3)}, batch_size=[])
    with pytest.raises(ShapeError, match=r"^adam: \('count',\) has dtype torch.int64 in the gradients: Adam steps floating-point"):
        adam(1e-3).update(counts, adam(1e-3).init(counts), counts)
    other = TensorDict({"b": torch.ones(3)}, batch_size=[])
    with pytest.raises(ShapeError, match=r"^adam: key \('b',\) of the gradients is not a leaf of the params$"):
        adam(1e-3, weight_decay=0.1).update(other, adam(1e-3).init(other), params)
    with pytest.raises(ShapeError, match=r"^apply_updates: key \('x',\) of the updates is not a leaf of the params$"):
        apply_updates(params, TensorDict({"x": torch.ones(3)}, batch_size=[]))
    with pytest.raises(ShapeError, match=r"^apply_updates: \('w',\) has shape \[4\] in the updates, \[3\] in the params$"):
        apply_updates(params, TensorDict({"w": torch.ones(4)}, batch_size=[]))


def test_transform_step_norms_half_gradients_in_float32():
    """Review pass: member_grad_norms summed half precision in float32, but transform_step and
    dynamic_loss_scale still took the norm in float16: 1000 gradients of 3000 gave inf (94868 in float32)
    and the finite step was skipped instead of clipped."""
    from rlfunc.optim.amp import transform_step

    params = TensorDict({"w": torch.zeros(1000, dtype=torch.float16).requires_grad_()}, batch_size=[])
    params["w"].grad = torch.full((1000,), 3000.0, dtype=torch.float16)
    tx = chain(clip_by_global_norm(1.0), adam(1e-3))
    norm, taken, _ = transform_step(tx, tx.init(params), params)
    assert taken and abs(float(norm) - 3000.0 * 1000**0.5) < 1.0
    assert bool((params["w"] != 0).all())


def test_stacked_clipping_refuses_gradients_of_other_members():
    """New-user pass: leaves of different leading dims were torch.stack's RuntimeError naming no key, and a
    state built for 3 members took the gradients of 5 (its norm silently became [5])."""
    clip = clip_by_global_norm(1.0, stacked=True)
    state = clip.init(TensorDict({"w": torch.ones(3, 2)}, batch_size=[]))
    with pytest.raises(ShapeError, match=r"share no leading seed dim"):
        clip.update(TensorDict({"a": torch.ones(2, 3), "b": torch.ones(3, 3)}, batch_size=[]), state)
    with pytest.raises(ShapeError, match=r"^clip_by_global_norm: gradients of 5 member\(s\), a state of 3"):
        clip.update(TensorDict({"w": torch.ones(5, 2)}, batch_size=[]), state)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_with_member_step_counts_steps_each_member_as_its_own_torch_optim_adam(weight_decay):
    # Regression: the step count was one per leaf, shared by the members, so a member skipped by the
    # mask (a seed stopped by target_kl, or one whose gradients were not finite) later stepped with
    # the bias correction of one more step than its own run's. With member_dims=1 each member counts
    # its own steps: every member equals a torch.optim.Adam (AdamW) that saw only that member's steps,
    # bit for bit, through skips, a skip of all, and the counts apart then together again.
    S = 3
    ours = stacked_params(members=S)
    torch_cls = torch.optim.AdamW if weight_decay else torch.optim.Adam
    theirs = [[p[i].detach().clone().requires_grad_() for p in leaves(ours)] for i in range(S)]
    opts = [torch_cls(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=True) for ps in theirs]
    update = adam(LR, BETAS, EPS, weight_decay=weight_decay, member_dims=1)
    state = update.init(ours)
    assert all(s.shape == (S,) for s in tree_leaves(state["step"]))
    masks = [torch.tensor([True, False, True]), None, torch.tensor([False, True, True]), torch.tensor([False]),
             torch.tensor([True, True, False]), torch.tensor([True, True, True])]
    for t, mask in enumerate(masks):
        grads = random_grads(ours, t)
        on = torch.ones(S, dtype=torch.bool) if mask is None else mask.expand(S)
        for g in grads:  # a skipped member's gradients are never read
            g[~on] = float("nan")
        updates, state = update.update(as_td(ours, grads), state, ours, mask=mask)
        apply_updates(ours, updates)
        for i in range(S):
            if on[i]:
                for p, g in zip(theirs[i], grads):
                    p.grad = g[i].clone()
                opts[i].step()
        for i in range(S):
            for p, q in zip(leaves(ours), theirs[i]):
                if weight_decay:  # bit for bit but where a parameter moves by more than half its magnitude (adam's docstring)
                    torch.testing.assert_close(p.detach()[i], q.detach(), rtol=0, atol=2e-7)
                else:
                    assert torch.equal(p.detach()[i], q.detach()), (t, i)
        for s in tree_leaves(state["step"]):  # apart after the first step (1, 0, 1), each its own torch.optim's count
            assert s.tolist() == [float(opt.state[theirs[i][0]].get("step", 0.0)) for i, opt in enumerate(opts)], t
    assert [float(opt.state[theirs[i][0]].get("step", 0.0)) for i, opt in enumerate(opts)] == [4.0, 4.0, 4.0]


def test_adam_with_member_step_counts_refuses_params_without_a_member_dim():
    with pytest.raises(ConfigError, match="member_dims"):
        adam(LR, member_dims=2)
    with pytest.raises(ShapeError, match="leading member dim"):
        adam(LR, member_dims=1).init(TensorDict({"a": torch.zeros(3, 2), "b": torch.zeros(2, 2)}, batch_size=[]))
    with pytest.raises(ShapeError, match="leading member dim"):
        adam(LR, member_dims=1).init(TensorDict({"a": torch.zeros(3, 2), "b": torch.zeros(())}, batch_size=[]))


def test_adam_with_member_step_counts_over_leaves_of_two_dtypes_steps_as_torch_optim_adam():
    # The per-row path (an accelerator's, and the CPU's for leaves of several dtypes): each member as its own
    # torch.optim.Adam, bit for bit, through skips that set the counts apart.
    S = 3
    g = torch.Generator().manual_seed(1)
    ours = TensorDict({"w": torch.randn(S, 4, 5, dtype=torch.float64, generator=g), "b": torch.randn(S, 5, generator=g)}, batch_size=[])
    theirs = [[ours[k][i].clone().requires_grad_() for k in ("b", "w")] for i in range(S)]
    opts = [torch.optim.Adam(ps, lr=LR, betas=BETAS, eps=EPS, foreach=True) for ps in theirs]
    update = adam(LR, BETAS, EPS, member_dims=1)
    state = update.init(ours)
    for mask in (torch.tensor([True, False, True]), None, torch.tensor([False, True, True]), torch.tensor([True, True, True])):
        grads = ours.apply(lambda p: torch.randn(p.shape, dtype=p.dtype, generator=g))
        updates, state = update.update(grads, state, ours, mask=mask)
        ours = ours.apply(lambda p, u: p + u, updates)
        for i in range(S):
            if mask is None or mask[i]:
                theirs[i][0].grad, theirs[i][1].grad = grads["b"][i].clone(), grads["w"][i].clone()
                opts[i].step()
            assert torch.equal(ours["b"][i], theirs[i][0].detach()) and torch.equal(ours["w"][i], theirs[i][1].detach())
    assert state["step", "w"].tolist() == [3.0, 3.0, 4.0]


def test_a_shared_torch_optim_count_becomes_a_count_of_each_members_own():
    # Regression (review pass): adam_state_from_torch expanded torch.optim's 0-dim step to [S] without a
    # copy, so the members' counts were one memory location (stride 0), shared with the caller's
    # torch.optim state: a step of every member failed ("more than one element of the written-to tensor
    # refers to a single memory location") and a masked one advanced the skipped member's count too.
    from rlfunc.optim import adam_state_from_torch

    params = TensorDict({"w": torch.randn(2, 3)}, batch_size=[])
    update = adam(LR, member_dims=1)
    torch_state = TensorDict({"0": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)}},
                             batch_size=[])
    state = adam_state_from_torch(torch_state, update.init(params), params)
    assert state["step", "w"].tolist() == [3.0, 3.0] and state["step", "w"].stride() == (1,)
    _, state = update.update(TensorDict({"w": torch.ones(2, 3)}, batch_size=[]), state, params)
    _, state = update.update(TensorDict({"w": torch.ones(2, 3)}, batch_size=[]), state, params, mask=torch.tensor([True, False]))
    assert state["step", "w"].tolist() == [5.0, 4.0] and float(torch_state["0", "step"]) == 3.0
