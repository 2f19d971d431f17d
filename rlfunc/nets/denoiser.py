"""DiffusionMLP: the small fully-connected denoiser DPPO uses on low-dimensional tasks.

Reference: Ren et al. (2024), "Diffusion Policy Policy Optimization", Appendix (MLP diffusion
policy for state inputs; ``model/diffusion/mlp_diffusion.py`` in the authors' code).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlfunc.errors import ConfigError
from rlfunc.nets.activations import Mish
from rlfunc.nets.unet1d import SinusoidalStepEmbedding, _check_positive, encode_steps, flatten_denoiser_inputs


class _ResidualBlock(nn.Module):
    """Pre-activation two-layer residual block: ``h + Linear(Mish(Linear(Mish(h))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(Mish(), nn.Linear(width, width), Mish(), nn.Linear(width, width))

    def forward(self, h: Tensor) -> Tensor:
        return h + self.net(h)


class DiffusionMLP(nn.Module):
    """Noise-prediction MLP ``eps_theta(x, t, cond)`` over a flattened action chunk.

    ``input = concat(flatten(x) [H*A], step_mlp(embed(t)) [step_embed_dim], cond [cond_dim])``, then
    ``Linear -> Mish -> ... -> Linear(H*A)`` reshaped to ``[H, A]``. The step MLP is
    ``Linear(d, 2d) -> Mish -> Linear(2d, d)`` on the sinusoidal embedding (:class:`SinusoidalStepEmbedding`,
    float32 even under autocast). All layers keep PyTorch's default initialisation: the output must be
    able to predict unit-variance noise from the start, so the last layer is not scaled down.

    ``forward(x [*B, H, A] float, t [*B] or 0-d int64, cond [*B, cond_dim] float) -> [*B, H, A]``,
    same conventions as :class:`rlfunc.nets.unet1d.ConditionalUnet1D` (x and cond are cast to the
    parameters' dtype; the output is in that dtype, or autocast's; ``cond`` may be None only when
    ``cond_dim == 0``).

    Args:
        action_dim: A.
        horizon: H, the number of actions per chunk (fixed: the input layer has H*A inputs).
        cond_dim: size of ``cond`` (0 for an unconditional net).
        hidden: widths of the hidden layers.
        step_embed_dim: size of the step embedding (even, >= 4).
        residual: False (default): a plain MLP. True: ``Linear(in, w)``, then ``(len(hidden) - 1) // 2``
            pre-activation residual blocks of two ``Linear(w, w)`` each, then ``Mish -> Linear(w, H*A)``;
            ``hidden`` must then be ``2k + 1`` equal widths ``w`` (DPPO's ``residual_style``).

    Raises:
        ConfigError: (constructor) a non-positive size, or ``residual`` with unequal widths / an even
            number of hidden layers.
        ShapeError: (forward) x is not [*B, horizon, action_dim] float, t is neither 0-d nor [*B],
            cond is not [*B, cond_dim].
    """

    def __init__(
        self,
        action_dim: int,
        horizon: int,
        cond_dim: int,
        hidden: Sequence[int] = (256, 256, 256),
        step_embed_dim: int = 32,
        residual: bool = False,
    ) -> None:
        super().__init__()
        hidden = tuple(hidden)
        _check_positive("DiffusionMLP", action_dim=action_dim, horizon=horizon)
        if not isinstance(cond_dim, int) or cond_dim < 0:
            raise ConfigError(f"DiffusionMLP: cond_dim must be an int >= 0, got {cond_dim!r}")
        if not hidden or not all(isinstance(w, int) and w > 0 for w in hidden):
            raise ConfigError(f"DiffusionMLP: hidden must be a non-empty sequence of positive ints, got {hidden!r}")
        if residual and (len(set(hidden)) != 1 or len(hidden) % 2 == 0):
            raise ConfigError(f"DiffusionMLP: residual=True needs an odd number of equal hidden widths (1 + 2 per block), got {hidden!r}")
        self.action_dim, self.horizon, self.cond_dim = action_dim, horizon, cond_dim
        d = step_embed_dim
        self.step_encoder = nn.Sequential(SinusoidalStepEmbedding(d), nn.Linear(d, 2 * d), Mish(), nn.Linear(2 * d, d))
        in_features = horizon * action_dim + d + cond_dim
        out_features = horizon * action_dim
        layers: list[nn.Module] = []
        if residual:
            width = hidden[0]
            layers.append(nn.Linear(in_features, width))
            layers += [_ResidualBlock(width) for _ in range((len(hidden) - 1) // 2)]
            layers += [Mish(), nn.Linear(width, out_features)]
        else:
            sizes = (in_features, *hidden)
            for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
                layers += [nn.Linear(fan_in, fan_out), Mish()]
            layers.append(nn.Linear(sizes[-1], out_features))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: Tensor, t: Tensor | int, cond: Tensor | None = None) -> Tensor:
        dtype = self.mlp[-1].weight.dtype
        x, t, cond, batch_shape = flatten_denoiser_inputs(
            "DiffusionMLP", x, t, cond, action_dim=self.action_dim, cond_dim=self.cond_dim,
            dtype=dtype, horizon=self.horizon)
        parts = [x.flatten(1), encode_steps(self.step_encoder, t, dtype)]
        if cond is not None:
            parts.append(cond)
        out = self.mlp(torch.cat(parts, dim=-1))
        return out.reshape(*batch_shape, self.horizon, self.action_dim)
