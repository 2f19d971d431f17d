"""Mixed precision and gradient accumulation (rlfunc.optim.amp)."""

import pytest
import torch
from tensordict import TensorDict

from rlfunc.core import func
from rlfunc.errors import ConfigError
from rlfunc.nets.denoiser import DiffusionMLP
from rlfunc.optim.amp import accumulate_gradients, precision, step


def _setup(seed=0):
    torch.manual_seed(seed)
    net = DiffusionMLP(2, 4, 6, hidden=(32, 32))
    params = func.params_from_module(net)
    batch = TensorDict(
        {"x": torch.randn(24, 4, 2), "t": torch.randint(0, 10, (24,)), "cond": torch.randn(24, 6), "y": torch.randn(24, 4, 2)},
        batch_size=[24],
    )

    def loss_fn(mb):
        out = func.apply(net, params, mb["x"], mb["t"], mb["cond"])
        loss = (out.float() - mb["y"]).square().mean()
        return loss, TensorDict({"loss": loss.detach()}, batch_size=[])

    return params, batch, loss_fn


@pytest.mark.parametrize("micro", [1, 5, 8, 24, None])
def test_accumulation_equals_full_batch(micro):
    params, batch, loss_fn = _setup()
    loss_full, _ = accumulate_gradients(loss_fn, batch, None)
    full = [p.grad.clone() for p in func.leaves(params)]
    for p in func.leaves(params):
        p.grad = None
    loss_acc, metrics = accumulate_gradients(loss_fn, batch, micro)
    acc = [p.grad for p in func.leaves(params)]
    for a, b in zip(full, acc):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_full, loss_acc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["loss"], loss_full, rtol=1e-5, atol=1e-6)


def test_accumulated_update_equals_full_batch_update():
    """Same optimizer step (Adam, clipping) from micro-batches x steps as from the full batch."""
    results = []
    for micro in (None, 6):
        params, batch, loss_fn = _setup()
        opt = torch.optim.Adam(func.leaves(params), lr=1e-2)
        opt.zero_grad()
        accumulate_gradients(loss_fn, batch, micro)
        step(opt, func.leaves(params), 0.5)
        results.append([p.detach().clone() for p in func.leaves(params)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_close_to_fp32_and_grads_fp32():
    params, batch, loss_fn = _setup()
    loss32, _ = accumulate_gradients(loss_fn, batch, None)
    g32 = [p.grad.clone() for p in func.leaves(params)]
    for p in func.leaves(params):
        p.grad = None
    prec = precision(torch.device("cpu"), "bf16")
    assert prec.dtype == torch.bfloat16 and prec.scaler is None
    loss16, _ = accumulate_gradients(loss_fn, batch, None, prec=prec)
    assert loss16.dtype == torch.float32
    assert abs(float(loss16) - float(loss32)) < 0.05 * abs(float(loss32))
    for p, g in zip(func.leaves(params), g32):
        assert p.grad.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), g.flatten(), dim=0)
        assert cos > 0.95


def test_fp16_has_a_scaler_and_steps():
    prec = precision(torch.device("cpu"), "fp16")
    assert prec.dtype == torch.float16 and prec.scaler is not None
    params, batch, loss_fn = _setup()
    before = [p.detach().clone() for p in func.leaves(params)]
    opt = torch.optim.Adam(func.leaves(params), lr=1e-2)
    accumulate_gradients(loss_fn, batch, 8, prec=prec)
    norm, ok = step(opt, func.leaves(params), 1.0, prec)
    assert ok and norm.isfinite()
    assert any(not torch.equal(a, p) for a, p in zip(before, func.leaves(params)))


def test_step_skips_nonfinite_gradients():
    params, batch, loss_fn = _setup()
    opt = torch.optim.Adam(func.leaves(params), lr=1e-2)
    accumulate_gradients(loss_fn, batch, None)
    func.leaves(params)[0].grad[0] = float("nan")
    before = [p.detach().clone() for p in func.leaves(params)]
    _, ok = step(opt, func.leaves(params), 1.0)
    assert not ok
    assert all(torch.equal(a, p) for a, p in zip(before, func.leaves(params)))


def test_precision_and_micro_batch_errors():
    with pytest.raises(ConfigError, match="precision="):
        precision(torch.device("cpu"), "fp8")
    assert precision(torch.device("cpu"), "auto").dtype == torch.bfloat16
    params, batch, loss_fn = _setup()
    with pytest.raises(ConfigError, match="micro_batch_size=0"):
        accumulate_gradients(loss_fn, batch, 0)


@pytest.mark.parametrize("mode", ["off", "fp16"])
def test_transform_step_steps_as_torch_optim_adam_and_skips_as_it_does(mode):
    """transform_step with chain(clip, adam) moves the params as step() with torch.optim.Adam (the same
    loss scaling, clipping and Adam arithmetic), and a non-finite gradient leaves params and state be."""
    from rlfunc.optim import adam, chain, clip_by_global_norm
    from rlfunc.optim.amp import loss_scale_of, transform_step, with_loss_scale

    ref_params, batch, ref_loss = _setup()
    params, _, loss_fn = _setup()
    ref_prec, prec = precision(torch.device("cpu"), mode), precision(torch.device("cpu"), mode)
    opt = torch.optim.Adam(func.leaves(ref_params), lr=1e-2, eps=1e-5, foreach=True)
    update = with_loss_scale(chain(clip_by_global_norm(0.1, stacked=False), adam(1e-2, eps=1e-5)), prec)
    state = update.init(params)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(ref_loss, batch, 8, prec=ref_prec)
        ref_norm, ref_ok = step(opt, func.leaves(ref_params), 0.1, ref_prec)
        for p in func.leaves(params):
            p.grad = None
        accumulate_gradients(loss_fn, batch, 8, prec=prec, scale=loss_scale_of(state))
        norm, ok, state = transform_step(update, state, params, prec, lr=1e-2)
        assert ok == ref_ok and torch.equal(norm, ref_norm)
        if prec.scaler is not None:  # the link's scale moves as the GradScaler's
            assert float(loss_scale_of(state)) == ref_prec.scaler.get_scale()
    for a, b in zip(func.leaves(ref_params), func.leaves(params)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    func.leaves(params)[0].grad[0] = float("nan")
    before, moments = [p.detach().clone() for p in func.leaves(params)], state.clone()
    _, ok, after = transform_step(update, state, params, prec, lr=1e-2)
    assert not ok
    assert all(torch.equal(a, p) for a, p in zip(before, func.leaves(params)))
    inner = (lambda s: s["inner"]) if prec.scaler is not None else (lambda s: s)
    assert all(torch.equal(a, b) for a, b in zip(inner(moments).values(True, True), inner(after).values(True, True)))
    if prec.scaler is None:
        assert after is state
    else:  # lowered after the inf, as torch's own path does
        assert float(loss_scale_of(after)) == ref_prec.scaler.get_scale() / 2
        assert int(after["growth_tracker"]) == 0


def test_dynamic_loss_scale_moves_its_scale_as_grad_scaler_does_over_infs_and_growth():
    """The fp16 loss-scale link against torch.amp.GradScaler (growth_interval 3), 10 steps with an inf
    gradient at steps 2 and 6: the same scale and growth tracker after every step, the same params, and
    the skipped steps move neither the params nor adam's moments."""
    from rlfunc.optim import adam, chain, clip_by_global_norm
    from rlfunc.optim.amp import dynamic_loss_scale, loss_scale_of, transform_step

    ref_params, batch, ref_loss = _setup()
    params, _, loss_fn = _setup()
    ref_prec, prec = precision(torch.device("cpu"), "fp16"), precision(torch.device("cpu"), "fp16")
    ref_prec.scaler._growth_interval = 3
    opt = torch.optim.Adam(func.leaves(ref_params), lr=1e-2, eps=1e-5, foreach=True)
    update = dynamic_loss_scale(chain(clip_by_global_norm(0.1, stacked=False), adam(1e-2, eps=1e-5)), growth_interval=3)
    state = update.init(params)
    assert float(loss_scale_of(state)) == 2.0**16 and state["growth_tracker"].dtype == torch.int32
    scales = []
    for i in range(10):
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(ref_loss, batch, None, prec=ref_prec)
        for p in func.leaves(params):
            p.grad = None
        accumulate_gradients(loss_fn, batch, None, prec=prec, scale=loss_scale_of(state))
        if i in (2, 6):
            func.leaves(ref_params)[1].grad[0] = float("inf")
            func.leaves(params)[1].grad[0] = float("inf")
        moments = state["inner"].clone()
        _, ref_ok = step(opt, func.leaves(ref_params), 0.1, ref_prec)
        _, ok, state = transform_step(update, state, params, prec, lr=1e-2)
        assert ok == ref_ok == (i not in (2, 6))
        if not ok:
            assert all(torch.equal(a, b) for a, b in zip(moments.values(True, True), state["inner"].values(True, True)))
        assert float(loss_scale_of(state)) == ref_prec.scaler.get_scale()
        assert int(state["growth_tracker"]) == int(ref_prec.scaler._growth_tracker)
        scales.append(float(loss_scale_of(state)))
    assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16]
    for a, b in zip(func.leaves(ref_params), func.leaves(params)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="backoff_factor"):
        dynamic_loss_scale(adam(1e-2), backoff_factor=1.5)


@pytest.mark.parametrize("micro", [5, 8])
def test_accumulated_maxima_are_the_batch_maxima(micro):
    # a metric that is a max over the samples (dppo's ratio_max) is the max over the micro-batches, not
    # their size-weighted mean (which was below the batch's max); the means stay means
    params, batch, _ = _setup()

    def loss_fn(mb):
        err = (mb["y"] - mb["x"]).abs().flatten(1).amax(1)
        return err.mean() + 0 * func.leaves(params)[0].sum(), TensorDict({"err_max": err.max(), "err_mean": err.mean()}, batch_size=[])

    _, whole = accumulate_gradients(loss_fn, batch, None, maxima=("err_max",))
    _, parts = accumulate_gradients(loss_fn, batch, micro, maxima=("err_max",))
    assert float(parts["err_max"]) == float(whole["err_max"])
    torch.testing.assert_close(parts["err_mean"], whole["err_mean"], rtol=1e-6, atol=1e-7)
    _, averaged = accumulate_gradients(loss_fn, batch, micro)  # without maxima: the weighted mean, smaller
    assert float(averaged["err_max"]) < float(whole["err_max"])


@pytest.mark.parametrize("micro", [5, 7, 1])
def test_accumulated_moments_are_the_batch_mean_and_variance(micro):
    # (mean, variance) pairs over unequal micro-batches merged pairwise (Chan): the batch's, also far from 0
    params, batch, _ = _setup()

    def loss_fn(mb):
        y = 1e4 + mb["y"].flatten(1).sum(1)
        return 0 * func.leaves(params)[0].sum(), TensorDict({"y_mean": y.mean(), "y_var": y.var(correction=0)}, batch_size=[])

    _, whole = accumulate_gradients(loss_fn, batch, None, moments=(("y_mean", "y_var"),))
    _, parts = accumulate_gradients(loss_fn, batch, micro, moments=(("y_mean", "y_var"),))
    torch.testing.assert_close(parts["y_mean"], whole["y_mean"], rtol=1e-6, atol=0)
    torch.testing.assert_close(parts["y_var"], whole["y_var"], rtol=1e-3, atol=0)
