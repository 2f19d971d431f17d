"""DACER's entropy estimate: the torch EM Gaussian mixture against closed-form Gaussian entropies (float64 references)."""

from __future__ import annotations

import math

import pytest
import torch

from rlfunc.diffusion.entropy import fit_gmm, gmm_entropy, gmm_log_prob, gmm_sample
from rlfunc.errors import ConfigError, ShapeError

A = 3
M = 2000
ITERS = 20  # EM iterations in these tests (the default 50 is slower on a loaded CPU)
# sd of the entropy of M samples' ML Gaussian: 1/2 sd(log det S) ~ 1/2 sqrt(2 A / M) = 0.019; 5 sd
TOL = 5 * 0.5 * math.sqrt(2 * A / M)


def _gaussian(seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(batch, A, A, generator=g, dtype=torch.float64) * 0.5
    cov = b @ b.transpose(-1, -2) + 0.2 * torch.eye(A, dtype=torch.float64)
    h = 0.5 * torch.logdet(2 * math.pi * math.e * cov)  # [batch]
    x = torch.randn(batch, M, A, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(cov).transpose(-1, -2)
    return x, h, g


def test_one_gaussian_exactly_and_against_its_closed_form():
    x, h, g = _gaussian(0)
    x = x + torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    x32 = x.float()
    # K = 1: the ML Gaussian of the samples, whose entropy is 1/2 log det(2 pi e S) (float64 reference)
    s = torch.stack([torch.cov(xi.T, correction=0) for xi in x]) + 1e-5 * torch.eye(A, dtype=torch.float64)
    h_ml = 0.5 * torch.logdet(2 * math.pi * math.e * s)
    for est in ("samples", "mixture", "bound"):
        got = gmm_entropy(x32, 1, iters=5, estimate=est, mc_samples=5000, generator=g)
        assert got.shape == (2, 1) and got.dtype == torch.float32
        tol = 1e-3 if est != "mixture" else 5 * math.sqrt(A / 2 / 5000)  # Var[log N] = A / 2
        torch.testing.assert_close(got.squeeze(-1).double(), h_ml, atol=tol, rtol=0)
        torch.testing.assert_close(got.squeeze(-1).double(), h, atol=TOL + tol, rtol=0)
    # DACER's K = 3 on one Gaussian: the extra components do not change the density estimate much
    got = gmm_entropy(x32, 3, iters=ITERS, generator=g)
    torch.testing.assert_close(got.squeeze(-1).double(), h, atol=TOL + 0.02, rtol=0)  # + overfit ~ 29 / (2 M)
    got = gmm_entropy(x32, 3, iters=ITERS, estimate="mixture", generator=g)
    torch.testing.assert_close(got.squeeze(-1).double(), h, atol=TOL + 0.1, rtol=0)
    assert (gmm_entropy(x32, 3, iters=ITERS, estimate="bound", generator=g) >= got - 0.1).all()  # an upper bound


@pytest.mark.parametrize("k", [2, 3])
def test_two_separated_equal_gaussians_add_log_2(k):
    x, h, g = _gaussian(1, batch=1)
    shift = torch.zeros(A, dtype=torch.float64)
    shift[0] = 20.0
    side = torch.arange(M) % 2 == 0
    x = torch.where(side[None, :, None], x + shift, x - shift).float()
    want = h + math.log(2)
    for est in ("samples", "mixture"):
        got = gmm_entropy(x, k, iters=ITERS, estimate=est, generator=g)
        torch.testing.assert_close(got.squeeze(-1).double(), want, atol=TOL + 0.1, rtol=0)
    bound = gmm_entropy(x, k, iters=ITERS, estimate="bound", generator=g).squeeze(-1).double()
    if k == 2:  # one component per cluster, no overlap: the bound is exact
        torch.testing.assert_close(bound, want, atol=TOL + 0.02, rtol=0)
    else:  # a cluster split in two overlapping components: only an upper bound
        assert (bound >= want - TOL).all()
    mixture = fit_gmm(x, k, iters=ITERS, generator=g)
    assert mixture.weights.shape == (1, k)
    torch.testing.assert_close(mixture.weights.sum(-1), torch.ones(1))
    # the k components split the two clusters: each cluster holds about half the weight
    right = mixture.means[0, :, 0] > 0
    assert abs(float(mixture.weights[0, right].sum()) - 0.5) < 0.02


def test_degenerate_cluster_stays_finite():
    g = torch.Generator().manual_seed(2)
    # all samples equal: every component collapses onto the point, with the covariance floor reg I
    x = torch.full((2, 200, 6), 0.3)
    # the fitted mixture is N(0.3, 1e-4 I): its entropy is 1/2 log det(2 pi e 1e-4 I); the given samples
    # all sit at its mode, where -log p = 1/2 log det(2 pi 1e-4 I), A/2 nats lower (resubstitution's bias)
    h = 0.5 * 6 * math.log(2 * math.pi * math.e * 1e-4)
    got = gmm_entropy(x, 3, reg_covar=1e-4, generator=g)
    torch.testing.assert_close(got, torch.full((2, 1), h - 3.0), atol=1e-3, rtol=0)
    got = gmm_entropy(x, 3, reg_covar=1e-4, estimate="mixture", mc_samples=4000, generator=g)
    torch.testing.assert_close(got, torch.full((2, 1), h), atol=5 * math.sqrt(3 / 4000), rtol=0)
    # a cluster of one repeated point next to a spread one; a dimension with no spread at all
    x = torch.randn(3, 200, 6, generator=g)
    x[:, :60] = torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    x[..., 5] = 1.0  # e.g. an action clipped at its bound
    for est in ("samples", "mixture", "bound"):
        got = gmm_entropy(x, 3, iters=ITERS, generator=g, estimate=est)
        assert torch.isfinite(got).all()
    mixture = fit_gmm(x, 3, generator=g)
    assert all(torch.isfinite(t).all() for t in mixture)
    # more components than distinct points
    assert torch.isfinite(gmm_entropy(torch.zeros(1, 4, 2).index_fill_(1, torch.tensor([0]), 1.0), 3, generator=g)).all()


def test_batch_dims_generator_and_helpers():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 50, 2, generator=g)
    a = gmm_entropy(x, 3, generator=torch.Generator().manual_seed(0))
    b = gmm_entropy(x, 3, generator=torch.Generator().manual_seed(0))
    assert a.shape == (2, 3, 1) and torch.equal(a, b)
    # batched = one state at a time
    one = gmm_entropy(x[1, 2], 3, generator=torch.Generator().manual_seed(0))
    assert one.shape == (1,)
    mixture = fit_gmm(x, 2, generator=g)
    y = gmm_sample(mixture, 7, g)
    assert y.shape == (2, 3, 7, 2)
    lp = gmm_log_prob(y, mixture)
    assert lp.shape == (2, 3, 7) and torch.isfinite(lp).all()
    # gmm_log_prob against torch.distributions' mixture in float64
    ref = torch.distributions.MixtureSameFamily(
        torch.distributions.Categorical(probs=mixture.weights.double()),
        torch.distributions.MultivariateNormal(mixture.means.double(), scale_tril=mixture.scale_tril.double()),
    )
    torch.testing.assert_close(lp.double(), ref.log_prob(y.double().movedim(-2, 0)).movedim(0, -1), atol=1e-4, rtol=1e-4)


def test_errors_name_the_argument():
    x = torch.randn(2, 5, 2)
    with pytest.raises(ConfigError, match="num_components"):
        gmm_entropy(x, 6)
    with pytest.raises(ShapeError, match="samples"):
        gmm_entropy(torch.randn(5), 1)
    with pytest.raises(ConfigError, match="estimate"):
        gmm_entropy(x, 2, estimate="kde")
    with pytest.raises(ConfigError, match="reg_covar"):
        fit_gmm(x, 2, reg_covar=0.0)
    with pytest.raises(ConfigError, match="iters"):
        fit_gmm(x, 2, iters=-1)
    with pytest.raises(ShapeError, match="x"):
        gmm_log_prob(torch.randn(2, 5, 3), fit_gmm(x, 2))


def test_non_finite_samples_are_named():
    # the bug: a NaN sample failed deep in linalg.cholesky, an inf one in multinomial
    x = torch.randn(2, 50, 2, generator=torch.Generator().manual_seed(4))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 7, 0] = bad
        with pytest.raises(ShapeError, match=r"^samples: 1 of 200 values are NaN or inf; expected finite values$"):
            gmm_entropy(y, 3)
        with pytest.raises(ShapeError, match="^samples: "):
            fit_gmm(y, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_samples_are_fitted_in_float32(dtype):
    # the bug: float16 samples raised NotImplementedError in linalg.cholesky
    x = torch.randn(2, 200, 3, generator=torch.Generator().manual_seed(5)).to(dtype)
    mixture = fit_gmm(x, 2, iters=ITERS, generator=torch.Generator().manual_seed(0))
    want = fit_gmm(x.float(), 2, iters=ITERS, generator=torch.Generator().manual_seed(0))
    assert all(t.dtype == torch.float32 for t in mixture)
    for got, ref in zip(mixture, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    lp = gmm_log_prob(x, mixture)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, gmm_log_prob(x.float(), want), rtol=0, atol=0)
    for est in ("samples", "mixture", "bound"):
        h = gmm_entropy(x, 2, iters=ITERS, estimate=est, generator=torch.Generator().manual_seed(0))
        ref = gmm_entropy(x.float(), 2, iters=ITERS, estimate=est, generator=torch.Generator().manual_seed(0))
        assert h.dtype == dtype and h.shape == (2, 1)
        torch.testing.assert_close(h, ref.to(dtype), rtol=0, atol=0)


def test_samples_too_large_to_fit_are_one_line_and_sac_diffusion_bounds_its_noise():
    """New-user pass: sac-diffusion --init-alpha 1e5 (or --noise-scale 1e6) was a Cholesky traceback in
    the entropy fit, 1e20 multinomial's "probability tensor contains inf"; both now refused up front,
    and samples the fit cannot take are one ShapeError line."""
    from rlfunc.algos.sac_diffusion import SACDiffusionConfig
    from rlfunc.errors import ConfigError

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 200, 3, generator=g)
    for scale in (1e20, 1e25):  # squared distances beyond float32
        with pytest.raises(ShapeError, match=r"^samples: squared distances overflow .* expected samples of moderate scale"):
            gmm_entropy(x * scale, 3, generator=g)
    for kw in (dict(init_alpha=1e5), dict(noise_scale=1e6), dict(init_alpha=100.0, noise_scale=0.15)):
        with pytest.raises(ConfigError, match=r"expected noise_scale \* init_alpha <= 10"):
            SACDiffusionConfig(**kw)
    assert SACDiffusionConfig(init_alpha=3.0, noise_scale=0.15).init_alpha == 3.0


def test_gmm_sample_and_fit_refuse_bad_input_in_one_line():
    """New-user pass: gmm_sample(num_samples=0) was torch.multinomial's RuntimeError, a mixture whose weights
    and means disagree in K a reshape error, negative weights multinomial's; fit_gmm(reg_covar=inf) blamed the
    samples ("a fitted covariance is not positive definite"); samples of 0-dim actions a reshape error."""
    g = torch.Generator().manual_seed(0)
    mixture = fit_gmm(torch.randn(2, 40, 2, generator=g), 3, generator=g)
    assert gmm_sample(mixture, 5, generator=g).shape == (2, 5, 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match=rf"^gmm_sample: num_samples={bad!r}: expected an int >= 1$"):
            gmm_sample(mixture, bad)
    with pytest.raises(ShapeError, match=r"^gmm_sample: weights \(2, 2\), means \(2, 3, 2\)"):
        gmm_sample(mixture._replace(weights=mixture.weights[:, :2]), 5)
    for bad in (-mixture.weights, torch.zeros_like(mixture.weights)):  # all-zero: multinomial's "invalid distribution"
        with pytest.raises(ShapeError, match=r"^gmm_sample: weights: expected finite values >= 0"):
            gmm_sample(mixture._replace(weights=bad), 5)
    with pytest.raises(ConfigError, match=r"^reg_covar=inf: expected a finite value > 0$"):
        fit_gmm(torch.randn(40, 2, generator=g), 2, reg_covar=math.inf)
    with pytest.raises(ShapeError, match=r"^samples: shape \(40, 0\) has actions of 0 dims"):
        fit_gmm(torch.randn(40, 0), 2)
