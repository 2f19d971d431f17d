"""Entropy of a diffusion policy from its samples: a Gaussian mixture fitted by EM, in torch (DACER).

A diffusion policy has no closed-form density, so DACER estimates H[pi(.|s)] by drawing M actions
per state, fitting a K-component Gaussian mixture (full covariances) to them and taking the entropy
of the mixture; the estimate drives the temperature alpha (:func:`rlfunc.losses.sac.temperature_loss`
with ``log_prob = -entropy``), which scales the noise added to the actions. The fit here is a small
batched EM over every state at once, on the samples' device, with a fixed number of iterations (no
data-dependent stopping; the one host synchronisation is the check that the samples are finite): a
k-means++ draw of K centres, a hard assignment, then ``iters`` EM steps. No gradient flows through
it. float16 and bfloat16 samples are fitted in float32 (half precision has no Cholesky
factorisation on the CPU, and its resolution near 1, ~1e-3, is coarser than the ``reg_covar`` floor).

Shapes: samples [*B, M, A] (batch dims, samples per state, action dim); a mixture is
``GaussianMixture(weights [*B, K], means [*B, K, A], scale_tril [*B, K, A, A])`` with
``scale_tril`` the lower Cholesky factor of each covariance.

References: Wang et al. (2024), "Diffusion Actor-Critic with Entropy Regulator" (DACER,
arXiv:2405.15177), sec. 4.2; Dempster, Laird & Rubin (1977) (EM); Bishop (2006), "Pattern Recognition
and Machine Learning", sec. 9.2.2 (the EM updates); Arthur & Vassilvitskii (2007) (k-means++);
Huber et al. (2008), "On entropy approximation for Gaussian mixture random vectors" (the bound).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlfunc.core.func import reads_values
from rlfunc.errors import ConfigError, ShapeError

__all__ = ["GaussianMixture", "fit_gmm", "gmm_entropy", "gmm_log_prob", "gmm_sample"]

_LOG_2PI = math.log(2.0 * math.pi)
_ESTIMATES = ("samples", "mixture", "bound")


class GaussianMixture(NamedTuple):
    """A batch of K-component Gaussian mixtures with full covariances Sigma_k = L_k L_k^T."""

    weights: Tensor  # [*B, K] float, mixing weights w_k > 0 summing to 1
    means: Tensor  # [*B, K, A] float, component means mu_k
    scale_tril: Tensor  # [*B, K, A, A] float, lower Cholesky factors L_k


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the fit computes in: float32 for float16 / bfloat16, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_samples(samples: Tensor, num_components: int) -> None:
    if not isinstance(samples, Tensor) or samples.ndim < 2 or not samples.is_floating_point():
        raise ShapeError(f"samples: expected a float tensor [*B, M, A], got "
                         f"{getattr(samples, 'shape', type(samples).__name__)} {getattr(samples, 'dtype', '')}")
    bad = int((~torch.isfinite(samples)).sum())  # one host sync; NaN/inf failed deep in cholesky or multinomial
    if bad:
        raise ShapeError(f"samples: {bad} of {samples.numel()} values are NaN or inf; expected finite values")
    if isinstance(num_components, bool) or not isinstance(num_components, int) or num_components < 1:
        raise ConfigError(f"num_components={num_components!r}: expected an int >= 1")
    if samples.shape[-2] < num_components:
        raise ConfigError(f"num_components={num_components}: more than the {samples.shape[-2]} samples per state")
    if samples.shape[-1] == 0:  # was a reshape RuntimeError
        raise ShapeError(f"samples: shape {tuple(samples.shape)} has actions of 0 dims; expected [*B, M, A] with A >= 1")


def _component_log_pdf(x: Tensor, means: Tensor, scale_tril: Tensor) -> Tensor:
    """log N(x_m; mu_k, L_k L_k^T) for x [N, M, A], means [N, K, A], scale_tril [N, K, A, A] -> [N, K, M]."""
    diff = x.unsqueeze(1) - means.unsqueeze(2)  # [N, K, M, A]
    # z = L^-1 (x - mu) through the small A x A inverse: a batched solve against the [A, M] right-hand
    # side was ~170x slower on CPU (torch 2.13, 256 x 3 systems of 6 x 200)
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device).expand_as(scale_tril)
    inv_tril = torch.linalg.solve_triangular(scale_tril, eye, upper=False)
    maha = (diff @ inv_tril.transpose(-1, -2)).square().sum(-1)
    log_det = 2.0 * scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)  # [N, K]
    return -0.5 * (x.shape[-1] * _LOG_2PI + log_det.unsqueeze(-1) + maha)


def _joint_log_pdf(x: Tensor, mixture: GaussianMixture) -> Tensor:
    """log w_k + log N_k(x_m) -> [N, K, M]."""
    return mixture.weights.log().unsqueeze(-1) + _component_log_pdf(x, mixture.means, mixture.scale_tril)


def _m_step(x: Tensor, resp: Tensor, reg_covar: float) -> GaussianMixture:
    """Weights, means and Cholesky factors from responsibilities resp [N, M, K] (Bishop 2006, eq. 9.24-9.26)."""
    nk = resp.sum(1) + 10 * torch.finfo(x.dtype).eps  # [N, K]; an empty component keeps finite numbers
    means = torch.einsum("nmk,nma->nka", resp, x) / nk.unsqueeze(-1)
    diff = x.unsqueeze(1) - means.unsqueeze(2)  # [N, K, M, A]
    cov = (diff * resp.transpose(1, 2).unsqueeze(-1)).transpose(-1, -2) @ diff / nk[..., None, None]
    cov = 0.5 * (cov + cov.transpose(-1, -2))
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    try:
        scale_tril = torch.linalg.cholesky(cov + reg_covar * eye)
    except torch.linalg.LinAlgError:  # was the traceback of a run whose noise grew huge: one line naming the input
        raise ShapeError(f"samples: a fitted covariance is not positive definite at reg_covar={reg_covar} (samples up to "
                         f"{float(x.abs().max()):.3g} in size); expected samples of moderate scale or a larger reg_covar") from None
    return GaussianMixture(nk / nk.sum(-1, keepdim=True), means, scale_tril)


def _kmeans_pp_labels(x: Tensor, k: int, generator: torch.Generator | None) -> Tensor:
    """Nearest of K centres drawn by k-means++ (D^2 sampling) for x [N, M, A] -> int64 [N, M]."""
    n, m, _ = x.shape
    rows = torch.arange(n, device=x.device)
    first = torch.randint(m, (n,), generator=generator, device=x.device)
    centres = [x[rows, first]]
    d2 = (x - centres[0].unsqueeze(1)).square().sum(-1)  # [N, M]
    for _ in range(1, k):
        weights = torch.where(d2.sum(-1, keepdim=True) > 0, d2, torch.ones_like(d2))
        try:
            pick = torch.multinomial(weights, 1, generator=generator).squeeze(-1)
        except RuntimeError:  # squared distances beyond the dtype's range (samples ~1e20 in float32)
            raise ShapeError(f"samples: squared distances overflow {x.dtype} (samples up to {float(x.abs().max()):.3g} in "
                             "size); expected samples of moderate scale") from None
        centres.append(x[rows, pick])
        d2 = torch.minimum(d2, (x - centres[-1].unsqueeze(1)).square().sum(-1))
    c = torch.stack(centres, 1)  # [N, K, A]
    return (x.unsqueeze(2) - c.unsqueeze(1)).square().sum(-1).argmin(-1)


@torch.no_grad()
def fit_gmm(
    samples: Tensor,
    num_components: int = 3,
    *,
    iters: int = 50,
    reg_covar: float = 1e-5,
    generator: torch.Generator | None = None,
) -> GaussianMixture:
    """Maximum-likelihood K-component Gaussian mixture of each state's samples, by EM with full covariances.

    Args:
        samples: [*B, M, A] float, M samples (actions) per batch element; M >= ``num_components``.
        num_components: K >= 1 (DACER: 3).
        iters: EM iterations after the k-means++ initialisation, >= 0 (fixed: no convergence test).
        reg_covar: added to every covariance's diagonal, > 0, in squared units of the samples: a floor
            that keeps a degenerate component (all its points equal, or no points) finite.
        generator: the random stream of the k-means++ draw (on ``samples``' device); None uses the
            device's default generator.

    Returns:
        ``GaussianMixture`` with batch shape *B, without gradient, in ``samples``' dtype; in float32
        for float16 / bfloat16 samples, which are fitted in float32.

    Raises:
        ShapeError: ``samples`` is not a float tensor with at least two dims, or holds NaN or inf.
        ConfigError: ``num_components`` < 1 or > M, ``iters`` < 0, ``reg_covar`` <= 0.
    """
    _check_samples(samples, num_components)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ConfigError(f"iters={iters!r}: expected an int >= 0")
    if not (reg_covar > 0 and math.isfinite(reg_covar)):  # inf was blamed on the samples (a covariance "not positive definite")
        raise ConfigError(f"reg_covar={reg_covar}: expected a finite value > 0")
    batch, (m, a) = samples.shape[:-2], samples.shape[-2:]
    x = samples.detach().reshape(-1, m, a).to(_work_dtype(samples.dtype))
    labels = _kmeans_pp_labels(x, num_components, generator)
    resp = torch.nn.functional.one_hot(labels, num_components).to(x.dtype)
    mixture = _m_step(x, resp, reg_covar)
    for _ in range(iters):
        joint = _joint_log_pdf(x, mixture)  # E-step: resp_mk = w_k N_k(x_m) / sum_j w_j N_j(x_m)
        resp = torch.softmax(joint, 1).transpose(1, 2)
        mixture = _m_step(x, resp, reg_covar)
    k = num_components
    return GaussianMixture(
        mixture.weights.reshape(*batch, k), mixture.means.reshape(*batch, k, a), mixture.scale_tril.reshape(*batch, k, a, a)
    )


def gmm_log_prob(x: Tensor, mixture: GaussianMixture) -> Tensor:
    """log p(x) = logsumexp_k [log w_k + log N(x; mu_k, Sigma_k)].

    Args:
        x: [*B, N, A] float, N points per batch element.
        mixture: batch shape *B, K components over A dims.

    Returns:
        [*B, N] float, in the promoted dtype of ``x`` and the mixture; float32 where that is float16
        or bfloat16 (computed in float32, as :func:`fit_gmm`).

    Raises:
        ShapeError: ``x``'s batch or action dims differ from the mixture's.
    """
    if not isinstance(x, Tensor) or x.ndim < 2 or x.shape[:-2] != mixture.means.shape[:-2] or x.shape[-1] != mixture.means.shape[-1]:
        raise ShapeError(f"x: shape {getattr(x, 'shape', type(x).__name__)}, expected [*B, N, A] with "
                         f"*B, A = {tuple(mixture.means.shape[:-2])}, {mixture.means.shape[-1]} (the mixture's)")
    batch, (n, a), k = x.shape[:-2], x.shape[-2:], mixture.weights.shape[-1]
    dtype = _work_dtype(torch.promote_types(x.dtype, mixture.means.dtype))
    flat = GaussianMixture(mixture.weights.reshape(-1, k).to(dtype), mixture.means.reshape(-1, k, a).to(dtype),
                           mixture.scale_tril.reshape(-1, k, a, a).to(dtype))
    return _joint_log_pdf(x.reshape(-1, n, a).to(dtype), flat).logsumexp(1).reshape(*batch, n)


def gmm_sample(mixture: GaussianMixture, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
    """num_samples draws x = mu_c + L_c eps per batch element, c ~ Categorical(w), eps ~ N(0, I).

    Returns:
        [*B, num_samples, A] float, without gradient.

    Raises:
        ConfigError: ``num_samples`` not an int >= 1. ShapeError: the mixture's weights [*B, K], means
            [*B, K, A] and scale_tril [*B, K, A, A] disagree, or a weight is negative or not finite
            (these were torch.multinomial's or a reshape's errors).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ConfigError(f"gmm_sample: num_samples={num_samples!r}: expected an int >= 1")
    means, weights, tril = mixture.means, mixture.weights, mixture.scale_tril
    if (means.dim() < 2 or weights.shape != means.shape[:-1] or tril.shape != (*means.shape, means.shape[-1])):
        raise ShapeError(f"gmm_sample: weights {tuple(weights.shape)}, means {tuple(means.shape)}, scale_tril "
                         f"{tuple(tril.shape)}: expected [*B, K], [*B, K, A] and [*B, K, A, A]")
    if reads_values(weights) and not bool(((weights >= 0) & weights.isfinite()).all() & (weights.sum(-1) > 0).all()):
        raise ShapeError("gmm_sample: weights: expected finite values >= 0 with a positive sum per mixture (mixing weights)")
    batch, (k, a) = mixture.means.shape[:-2], mixture.means.shape[-2:]
    w = mixture.weights.reshape(-1, k)
    c = torch.multinomial(w, num_samples, replacement=True, generator=generator)  # [N, S]
    eps = torch.randn(w.shape[0], num_samples, a, 1, generator=generator, device=w.device, dtype=mixture.means.dtype)
    mu = mixture.means.reshape(-1, k, a).gather(1, c[..., None].expand(-1, -1, a))
    tril = mixture.scale_tril.reshape(-1, k, a, a).gather(1, c[..., None, None].expand(-1, -1, a, a))
    return (mu + (tril @ eps).squeeze(-1)).reshape(*batch, num_samples, a)


@torch.no_grad()
def gmm_entropy(
    samples: Tensor,
    num_components: int = 3,
    *,
    iters: int = 50,
    reg_covar: float = 1e-5,
    estimate: Literal["samples", "mixture", "bound"] = "samples",
    mc_samples: int = 1000,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Entropy H = -E_p[log p(x)] of the Gaussian mixture p fitted to each state's samples (DACER, sec. 4.2).

    Estimates of H[p] for the fitted mixture p (:func:`fit_gmm`):

    - ``"samples"``: -mean_m log p(x_m) over the given samples (resubstitution; no more draws). For
      one Gaussian (K = 1) it equals H[p] exactly; with more components it is biased low by the
      overfit, about (free parameters) / (2 M) nats, and by up to A/2 nats where a component
      collapses onto its points (then its covariance is the ``reg_covar`` floor).
    - ``"mixture"``: -mean log p(y) over ``mc_samples`` fresh draws y ~ p (Monte Carlo; variance
      ~ Var[log p] / mc_samples).
    - ``"bound"``: sum_k w_k (1/2 log det(2 pi e Sigma_k) - log w_k), the upper bound of Huber et al.
      (2008), exact when the components do not overlap; no sampling.

    Args:
        samples: [*B, M, A] float, M actions of the policy at each of *B states.
        num_components, iters, reg_covar, generator: as :func:`fit_gmm` (``generator`` also draws the
            ``"mixture"`` estimate's samples).
        estimate: which estimate, above.
        mc_samples: draws per state of the ``"mixture"`` estimate, >= 1.

    Returns:
        [*B, 1] float in ``samples``' dtype, in nats, without gradient (float16 / bfloat16 samples
        are fitted and evaluated in float32, the result rounded to their dtype).

    Raises:
        ShapeError / ConfigError: as :func:`fit_gmm` (NaN or inf in ``samples`` included);
            ``estimate`` unknown; ``mc_samples`` < 1.
    """
    if estimate not in _ESTIMATES:
        raise ConfigError(f"estimate={estimate!r}: expected one of {_ESTIMATES}")
    if estimate == "mixture" and (isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1):
        raise ConfigError(f"mc_samples={mc_samples!r}: expected an int >= 1")
    mixture = fit_gmm(samples, num_components, iters=iters, reg_covar=reg_covar, generator=generator)
    if estimate == "bound":
        a = samples.shape[-1]
        log_det = 2.0 * mixture.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)  # [*B, K]
        h_k = 0.5 * (a * (1.0 + _LOG_2PI) + log_det)
        return (mixture.weights * (h_k - mixture.weights.log())).sum(-1, keepdim=True).to(samples.dtype)
    points = samples if estimate == "samples" else gmm_sample(mixture, mc_samples, generator)
    return -gmm_log_prob(points.detach(), mixture).mean(-1, keepdim=True).to(samples.dtype)
