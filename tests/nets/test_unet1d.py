"""rlfunc.nets.unet1d (ConditionalUnet1D, FiLM, step embedding) and rlfunc.nets.denoiser (DiffusionMLP)."""

import math

import pytest
import torch

from rlfunc.core import func
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.nets.denoiser import DiffusionMLP
from rlfunc.nets.unet1d import ConditionalResidualBlock1D, ConditionalUnet1D, SinusoidalStepEmbedding

SMALL = dict(down_dims=(16, 32, 64), kernel_size=5, n_groups=8, step_embed_dim=16)


def unet(seed: int = 0, action_dim: int = 3, cond_dim: int = 6, **kwargs) -> ConditionalUnet1D:
    torch.manual_seed(seed)
    return ConditionalUnet1D(action_dim, cond_dim, **{**SMALL, **kwargs})


def mlp(seed: int = 0, action_dim: int = 2, horizon: int = 4, cond_dim: int = 5, **kwargs) -> DiffusionMLP:
    torch.manual_seed(seed)
    return DiffusionMLP(action_dim, horizon, cond_dim, **{"hidden": (32, 32, 32), "step_embed_dim": 8, **kwargs})


def inputs(batch=(4,), horizon=5, action_dim=3, cond_dim=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, horizon, action_dim, generator=g)
    t = torch.randint(0, 100, batch, generator=g)
    cond = torch.randn(*batch, cond_dim, generator=g)
    return x, t, cond


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("horizon", [1, 3, 5, 7, 10, 16])
@pytest.mark.parametrize("widths", [dict(down_dims=(16, 32, 64)), dict(down_dims=(8, 16), n_groups=4), dict(down_dims=(8,), n_groups=2)])
def test_unet_output_shape_for_any_horizon(horizon, widths):
    net = unet(**widths)
    x, t, cond = inputs(horizon=horizon)
    out = net(x, t, cond)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_unet_default_widths_and_leading_batch_dims_and_scalar_step():
    torch.manual_seed(0)
    net = ConditionalUnet1D(3, 6)  # (64, 128, 256), kernel 5, 8 groups
    x, _, cond = inputs(batch=(2, 3), horizon=16)
    t = torch.tensor(7)
    out = net(x, t, cond)
    assert out.shape == (2, 3, 16, 3)
    flat = net(x.reshape(6, 16, 3), t.expand(6), cond.reshape(6, 6))
    torch.testing.assert_close(out.reshape(6, 16, 3), flat)
    assert torch.equal(net(x, 7, cond), out)  # a Python int step broadcasts like a 0-d tensor


def test_unet_pads_the_horizon_by_replicating_the_last_step():
    net = unet()  # horizon multiple 4
    x, t, cond = inputs(horizon=5)
    padded = torch.cat((x, x[:, -1:].expand(-1, 3, -1)), dim=1)  # 5 -> 8 with the last step repeated
    torch.testing.assert_close(net(x, t, cond), net(padded, t, cond)[:, :5])


def test_unet_accepts_any_float_dtype_and_unconditional_nets():
    net = unet()
    x, t, cond = inputs()
    ref = net(x, t, cond)
    out64 = net(x.double(), t, cond.double())
    assert out64.dtype == torch.float32
    torch.testing.assert_close(out64, ref)
    assert net(x.half(), t, cond).dtype == torch.float32
    free = unet(cond_dim=0)
    assert free(x, t).shape == x.shape
    assert free(x, t, torch.zeros(4, 0)).shape == x.shape


# --------------------------------------------------------------------------------------------
# Step embedding and autocast
# --------------------------------------------------------------------------------------------


def test_step_embedding_matches_the_formula_and_stays_float32_under_autocast():
    emb = SinusoidalStepEmbedding(8)
    t = torch.tensor([0, 1, 37, 999])
    freqs = [10000.0 ** (-k / 3) for k in range(4)]
    ref = torch.tensor([[math.sin(s * w) for w in freqs] + [math.cos(s * w) for w in freqs] for s in t.tolist()], dtype=torch.float64)
    out = emb(t)
    assert out.shape == (4, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-4, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = emb(t)
    assert under.dtype == torch.float32
    assert torch.equal(under, out)
    assert emb(torch.zeros(2, 3, dtype=torch.long)).shape == (2, 3, 8)


def test_unet_under_bf16_autocast_keeps_the_embedding_float32_and_is_close_to_fp32():
    net = unet()
    seen = []
    net.step_encoder[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    x, t, cond = inputs(horizon=8)
    t = t + 900  # large steps: bf16 would round them (it holds integers exactly only up to 256)
    ref = net(x, t, cond)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = net(x, t, cond)
    assert seen == [torch.float32, torch.float32]
    assert torch.isfinite(low).all()
    err = (low.float() - ref).norm() / ref.norm()
    assert err < 0.1, err


def test_diffusion_mlp_under_bf16_autocast():
    net = mlp()
    seen = []
    net.step_encoder[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    x, t, cond = inputs(horizon=4, action_dim=2, cond_dim=5)
    ref = net(x, t, cond)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = net(x, t, cond)
    assert seen == [torch.float32, torch.float32]
    assert (low.float() - ref).norm() / ref.norm() < 0.1


# --------------------------------------------------------------------------------------------
# FiLM conditioning
# --------------------------------------------------------------------------------------------


def test_film_gives_a_scale_and_shift_per_channel_and_conditions_the_output():
    block = ConditionalResidualBlock1D(4, 16, cond_dim=6, kernel_size=3, n_groups=8)
    cond = torch.randn(5, 6)
    scale, shift = block.film(cond)
    assert scale.shape == (5, 16, 1) and shift.shape == (5, 16, 1)
    assert not torch.allclose(scale, shift)
    h = torch.randn(5, 4, 7)
    manual = block.blocks[1](scale * block.blocks[0](h) + shift) + block.residual_conv(h)
    torch.testing.assert_close(block(h, cond), manual)

    net = unet()
    for res in [m for m in net.modules() if isinstance(m, ConditionalResidualBlock1D)]:
        s, b = res.film(torch.randn(4, 16 + 6))
        assert s.shape == b.shape == (4, res.out_channels, 1)
    x, t, cond = inputs()
    out = net(x, t, cond)
    assert (net(x, t, cond + 1.0) - out).abs().amax() > 1e-3  # cond reaches the output
    assert (net(x, t + 50, cond) - out).abs().amax() > 1e-3  # so does the step
    other = cond.clone()
    other[0] += 1.0
    changed = (net(x, t, other) - out).abs().amax(dim=(1, 2))
    assert changed[0] > 1e-3 and torch.all(changed[1:] == 0)  # per-sample: no leak across the batch


# --------------------------------------------------------------------------------------------
# Functional use: gradients, vmap over an ensemble
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,dims", [(unet, (3, 6)), (mlp, (2, 5)), (lambda: mlp(residual=True), (2, 5))])
def test_gradients_reach_every_parameter(make, dims):
    net = make()
    params = func.params_from_module(net)
    horizon = 5 if isinstance(net, ConditionalUnet1D) else net.horizon
    x, t, cond = inputs(horizon=horizon, action_dim=dims[0], cond_dim=dims[1])
    out = func.apply(net, params, x, t, cond)
    out.square().mean().backward()
    names = list(params.keys(include_nested=True, leaves_only=True))
    assert len(names) == len(list(net.parameters()))
    for key in names:
        grad = params.get(key).grad
        assert grad is not None, key
        assert torch.isfinite(grad).all(), key
        assert grad.abs().sum() > 0, key


@pytest.mark.parametrize("make,dims,horizon", [(unet, (3, 6), 5), (mlp, (2, 5), 4)])
def test_vmap_over_a_stacked_ensemble_equals_the_loop(make, dims, horizon):
    net = make(0)
    stacked = func.stack_params([func.params_from_module(make(seed)) for seed in (1, 2)])
    x, t, cond = inputs(horizon=horizon, action_dim=dims[0], cond_dim=dims[1])

    def f(params, x, t, cond):
        return func.apply(net, params, x, t, cond)

    # Shared inputs, one parameter set per member.
    shared = dict(in_dims=(0, None, None, None))
    a = func.vmap(f, **shared, use_loop=False)(stacked, x, t, cond)
    b = func.vmap(f, **shared, use_loop=True)(stacked, x, t, cond)
    assert a.shape == (2, *x.shape)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[0], a[1])

    # Gradients through the vmap path equal those through the loop path.
    grads = []
    for loop in (False, True):
        params = func.stack_params([stacked[0], stacked[1]])
        func.vmap(f, **shared, use_loop=loop)(params, x, t, cond).square().mean().backward()
        grads.append({k: params.get(k).grad for k in params.keys(True, True)})
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-6)

    # Per-member inputs too: x [M, B, H, A], cond [M, B, C], one 0-d step per member.
    xs, ts, cs = torch.stack((x, x.flip(0))), torch.tensor([3, 40]), torch.stack((cond, -cond))
    a = func.vmap(f, use_loop=False)(stacked, xs, ts, cs)
    b = func.vmap(f, use_loop=True)(stacked, xs, ts, cs)
    assert a.shape == xs.shape
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# DiffusionMLP
# --------------------------------------------------------------------------------------------


def test_diffusion_mlp_shapes_and_conditioning():
    net = mlp()
    x, t, cond = inputs(batch=(2, 3), horizon=4, action_dim=2, cond_dim=5)
    out = net(x, t, cond)
    assert out.shape == (2, 3, 4, 2)
    torch.testing.assert_close(net(x.reshape(6, 4, 2), t.reshape(6), cond.reshape(6, 5)), out.reshape(6, 4, 2))
    assert (net(x, t, cond + 1) - out).abs().amax() > 1e-4
    assert (net(x, t + 10, cond) - out).abs().amax() > 1e-4
    assert net(x, torch.tensor(3), cond).shape == out.shape
    assert mlp(residual=True)(x, t, cond).shape == out.shape
    assert mlp(cond_dim=0)(x, t).shape == out.shape
    default = DiffusionMLP(2, 4, 8)
    assert default(torch.randn(3, 4, 2), torch.zeros(3, dtype=torch.long), torch.randn(3, 8)).shape == (3, 4, 2)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,horizon", [(lambda: unet(), 5), (lambda: mlp(action_dim=3, horizon=5, cond_dim=6), 5)])
def test_shape_errors_name_the_argument(make, horizon):
    net = make()
    x, t, cond = inputs(horizon=horizon)
    cases = [
        ((x[0], t, cond), "x must be"),  # no batch dim
        ((x[..., :2], t, cond), r"x must be \[\*B, \w+, 3\]"),  # wrong action dim
        ((x.long(), t, cond), "x must be a float"),
        ((x, t, cond[:, :4]), r"cond must be \[\*B, cond_dim\] = \[4, 6\]"),  # wrong cond dim
        ((x, t, cond[:3]), "cond must be"),  # batch mismatch
        ((x, t, None), "cond must be"),
        ((x, t[:3], cond), r"t must be 0-d or match the batch dims of x, \[4\]"),
        ((x, t.bool(), cond), "t must be an int64"),
    ]
    for args, match in cases:
        with pytest.raises(ShapeError, match=match):
            net(*args)
    if isinstance(net, DiffusionMLP):
        with pytest.raises(ShapeError, match=r"x must be \[\*B, 5, 3\]"):
            net(x[:, :4], t, cond)


def test_config_errors():
    with pytest.raises(ConfigError, match="n_groups=8 must divide every width"):
        ConditionalUnet1D(3, 6, down_dims=(16, 20, 64))
    with pytest.raises(ConfigError, match="kernel_size must be odd"):
        ConditionalUnet1D(3, 6, kernel_size=4)
    with pytest.raises(ConfigError, match="down_dims"):
        ConditionalUnet1D(3, 6, down_dims=())
    with pytest.raises(ConfigError, match="action_dim"):
        ConditionalUnet1D(0, 6)
    with pytest.raises(ConfigError, match="dim must be an even int"):
        SinusoidalStepEmbedding(7)
    with pytest.raises(ConfigError, match="residual=True"):
        DiffusionMLP(2, 4, 8, hidden=(32, 64, 32), residual=True)
    with pytest.raises(ConfigError, match="horizon"):
        DiffusionMLP(2, 0, 8)


@pytest.mark.parametrize("make", [lambda: DiffusionMLP(2, 4, 3, hidden=(8,)),
                                  lambda: ConditionalUnet1D(2, 3, down_dims=(8, 16), n_groups=4, step_embed_dim=8)])
def test_denoisers_in_float64_and_bf16_equal_their_float32_values(make):
    """Regression (functional-core pass): parameters of any dtype but float32 failed ("mat1 and mat2 must
    have the same dtype": the float32 step embedding went into the step MLP's Linear uncast), though the
    docstrings cast x and cond to the parameters' dtype. float64 now equals float32 to float32's rounding."""
    torch.manual_seed(0)
    net = make()
    x, t, cond = torch.randn(5, 4, 2), torch.randint(0, 100, (5,)), torch.randn(5, 3)
    want = net(x, t, cond)
    wide = make()
    wide.load_state_dict(net.state_dict())
    got = wide.double()(x.double(), t, cond.double())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want.double(), rtol=1e-4, atol=1e-5)
    narrow = make()
    narrow.load_state_dict(net.state_dict())
    assert narrow.bfloat16()(x, t, cond).dtype == torch.bfloat16
