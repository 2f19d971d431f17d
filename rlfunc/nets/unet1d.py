"""Diffusion Policy's ConditionalUnet1D (Chi et al. 2023): a 1-D temporal U-Net with FiLM conditioning.

The network predicts the noise (or the clean sample) of an action chunk ``x [*B, H, A]`` at
diffusion step ``t``, conditioned on an observation feature ``cond [*B, cond_dim]``. Convolutions run
over the horizon H with the action dims as channels. The layout follows the reference implementation
(``diffusion_policy/model/diffusion/conditional_unet1d.py``, ``cond_predict_scale=True``), including
its skip pattern: the up path concatenates the skips of the deepest ``len(down_dims) - 1`` levels, so
the first level's skip is not used.

Reference: Chi et al. (2023), "Diffusion Policy: Visuomotor Policy Learning via Action Diffusion",
Sec. 3.2 and Fig. 2; FiLM: Perez et al. (2018).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.nets.activations import Mish


class SinusoidalStepEmbedding(nn.Module):
    """Transformer sinusoidal embedding of diffusion steps, ``[sin(t w_k), cos(t w_k)]``.

    ``w_k = 10000^(-k / (dim/2 - 1))`` for ``k = 0 .. dim/2 - 1`` (the Diffusion Policy / DDPM form).

    ``forward(t [*B] int64) -> [*B, dim] float32``. Always computed in float32 with autocast disabled,
    so bf16/fp16 autocast cannot round large step indices (bf16 holds integers exactly only up to 256).
    Integer and float steps are accepted (converted to float32). No parameters.

    Raises:
        ConfigError: ``dim`` is odd or below 4.
        ShapeError: ``t`` is bool or complex.

    Reference: Vaswani et al. (2017), Sec. 3.5; Ho et al. (2020), Appendix B.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim < 4 or dim % 2:
            raise ConfigError(f"SinusoidalStepEmbedding: dim must be an even int >= 4, got {dim!r}")
        self.dim = dim

    def forward(self, t: Tensor) -> Tensor:
        if t.dtype == torch.bool or t.is_complex():
            raise ShapeError(f"SinusoidalStepEmbedding: t must be an integer (int64) tensor, got dtype {t.dtype}")
        half = self.dim // 2
        with torch.autocast(device_type=t.device.type, enabled=False):
            scale = math.log(10000.0) / (half - 1)
            freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -scale)
            angle = t.to(torch.float32).unsqueeze(-1) * freqs
            return torch.cat((angle.sin(), angle.cos()), dim=-1)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


def encode_steps(encoder: nn.Sequential, t: Tensor, dtype: torch.dtype) -> Tensor:
    """``encoder`` (a :class:`SinusoidalStepEmbedding` then layers) of ``t``, the float32 embedding cast
    to ``dtype`` (the parameters') before the layers: double-precision or bf16 parameters without autocast
    failed in the first Linear ("mat1 and mat2 must have the same dtype")."""
    h = t
    for i, layer in enumerate(encoder):
        h = layer(h) if i else layer(h).to(dtype)
    return h.to(dtype)  # (under autocast the layers' output is the autocast dtype)


class Conv1dBlock(nn.Sequential):
    """``Conv1d(kernel_size, same padding) -> GroupNorm(n_groups) -> Mish`` on ``[N, C_in, L] -> [N, C_out, L]``.

    ``kernel_size`` must be odd so the length is kept.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, n_groups: int = 8) -> None:
        super().__init__(
            nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2),
            nn.GroupNorm(n_groups, out_channels),
            Mish(),
        )


class ConditionalResidualBlock1D(nn.Module):
    """Two :class:`Conv1dBlock` with FiLM between them and a residual connection.

    ``h = block1(x)``; ``(scale, shift) = Linear(Mish(cond))`` split per output channel;
    ``out = block2(scale * h + shift) + residual(x)``, where ``residual`` is a 1x1 conv when the channel
    count changes and the identity otherwise. ``forward(x [N, C_in, L], cond [N, cond_dim]) -> [N, C_out, L]``.
    """

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, kernel_size: int = 5, n_groups: int = 8) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.blocks = nn.ModuleList([
            Conv1dBlock(in_channels, out_channels, kernel_size, n_groups),
            Conv1dBlock(out_channels, out_channels, kernel_size, n_groups),
        ])
        self.cond_encoder = nn.Sequential(Mish(), nn.Linear(cond_dim, 2 * out_channels))
        self.residual_conv = nn.Conv1d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def film(self, cond: Tensor) -> tuple[Tensor, Tensor]:
        """FiLM parameters of ``cond [N, cond_dim]``: ``(scale [N, C_out, 1], shift [N, C_out, 1])``."""
        embed = self.cond_encoder(cond).unflatten(-1, (2, self.out_channels)).unsqueeze(-1)
        return embed[:, 0], embed[:, 1]

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        scale, shift = self.film(cond)
        h = scale * self.blocks[0](x) + shift
        return self.blocks[1](h) + self.residual_conv(x)


class Downsample1d(nn.Conv1d):
    """Halve the length: ``Conv1d(C, C, 3, stride=2, padding=1)``, ``[N, C, L] -> [N, C, ceil(L/2)]``."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 3, stride=2, padding=1)


class Upsample1d(nn.ConvTranspose1d):
    """Double the length: ``ConvTranspose1d(C, C, 4, stride=2, padding=1)``, ``[N, C, L] -> [N, C, 2L]``."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 4, stride=2, padding=1)


class ConditionalUnet1D(nn.Module):
    """Noise-prediction network of Diffusion Policy: ``eps_theta(x, t, cond)``.

    ``forward(x, t, cond) -> [*B, H, A]``.

    Args (forward):
        x: [*B, H, A] float, the noisy action chunk (at least one batch dim); any float dtype, cast to
            the parameters' dtype. Any horizon H >= 1: H is padded at the end to a multiple of
            ``2 ** (len(down_dims) - 1)`` by **replicating the last step** (x[..., -1, :]) and the
            output is cropped back to H. A horizon that is already a multiple is not padded, which is
            exactly the reference network. (GroupNorm sees the padded steps, so the output for a
            padded horizon depends a little on this choice.)
        t: [*B] or 0-d (same step for the whole batch) int64 diffusion step; a Python int is accepted.
        cond: [*B, cond_dim] float, the global condition (e.g. encoded observations). May be None
            only when ``cond_dim == 0``.

    Returns:
        [*B, H, A] in the parameters' dtype, or in autocast's dtype under ``torch.autocast``.

    Constructor:
        action_dim: A, the channels of x.
        cond_dim: size of ``cond`` (0 for an unconditional net).
        down_dims: channel widths of the levels; ``len(down_dims) - 1`` halvings of the horizon.
        kernel_size: odd temporal kernel of the convolutions.
        n_groups: GroupNorm groups; must divide every width in ``down_dims``.
        step_embed_dim: size of the sinusoidal step embedding; the step MLP is
            ``Linear(d, 4d) -> Mish -> Linear(4d, d)`` and the FiLM condition is
            ``concat(step_mlp(embed(t)), cond)`` of size ``step_embed_dim + cond_dim``.

    Raises:
        ConfigError: (constructor) a non-positive dimension, an even kernel, or ``n_groups`` not
            dividing a width.
        ShapeError: (forward) ``x`` is not [*B, H, A] float with A == ``action_dim``, ``t`` is neither
            0-d nor [*B], ``cond`` is not [*B, cond_dim].

    Reference: Chi et al. (2023), Sec. 3.2 (CNN-based diffusion policy with FiLM, Perez et al. 2018).
    """

    def __init__(
        self,
        action_dim: int,
        cond_dim: int,
        down_dims: Sequence[int] = (64, 128, 256),
        kernel_size: int = 5,
        n_groups: int = 8,
        step_embed_dim: int = 64,
    ) -> None:
        super().__init__()
        down_dims = tuple(down_dims)
        _check_positive("ConditionalUnet1D", action_dim=action_dim, kernel_size=kernel_size, n_groups=n_groups)
        if not isinstance(cond_dim, int) or cond_dim < 0:
            raise ConfigError(f"ConditionalUnet1D: cond_dim must be an int >= 0, got {cond_dim!r}")
        if not down_dims or not all(isinstance(d, int) and d > 0 for d in down_dims):
            raise ConfigError(f"ConditionalUnet1D: down_dims must be a non-empty sequence of positive ints, got {down_dims!r}")
        if kernel_size % 2 == 0:
            raise ConfigError(f"ConditionalUnet1D: kernel_size must be odd (same-length convolutions), got {kernel_size}")
        bad = [d for d in down_dims if d % n_groups]
        if bad:
            raise ConfigError(f"ConditionalUnet1D: n_groups={n_groups} must divide every width in down_dims={down_dims}; it does not divide {bad}")
        self.action_dim = action_dim
        self.cond_dim = cond_dim
        self.down_dims = down_dims
        self.horizon_multiple = 2 ** (len(down_dims) - 1)

        d = step_embed_dim
        self.step_encoder = nn.Sequential(SinusoidalStepEmbedding(d), nn.Linear(d, 4 * d), Mish(), nn.Linear(4 * d, d))
        film_dim = d + cond_dim

        def block(c_in: int, c_out: int) -> ConditionalResidualBlock1D:
            return ConditionalResidualBlock1D(c_in, c_out, film_dim, kernel_size, n_groups)

        widths = (action_dim, *down_dims)
        levels = list(zip(widths[:-1], widths[1:]))
        self.down_modules = nn.ModuleList()
        for i, (c_in, c_out) in enumerate(levels):
            last = i == len(levels) - 1
            self.down_modules.append(nn.ModuleList([
                block(c_in, c_out), block(c_out, c_out), nn.Identity() if last else Downsample1d(c_out),
            ]))
        mid = down_dims[-1]
        self.mid_modules = nn.ModuleList([block(mid, mid), block(mid, mid)])
        self.up_modules = nn.ModuleList()
        for c_in, c_out in reversed(levels[1:]):
            self.up_modules.append(nn.ModuleList([block(2 * c_out, c_in), block(c_in, c_in), Upsample1d(c_in)]))
        self.final_conv = nn.Sequential(
            Conv1dBlock(down_dims[0], down_dims[0], kernel_size, n_groups),
            nn.Conv1d(down_dims[0], action_dim, 1),
        )

    def forward(self, x: Tensor, t: Tensor | int, cond: Tensor | None = None) -> Tensor:
        dtype = self.final_conv[1].weight.dtype
        x, t, cond, batch_shape = flatten_denoiser_inputs(
            "ConditionalUnet1D", x, t, cond, action_dim=self.action_dim, cond_dim=self.cond_dim, dtype=dtype)
        horizon = x.shape[1]
        pad = -horizon % self.horizon_multiple
        if pad:
            x = torch.cat((x, x[:, -1:].expand(-1, pad, -1)), dim=1)

        step = encode_steps(self.step_encoder, t, dtype)
        feature = step if cond is None else torch.cat((step, cond), dim=-1)

        h = x.transpose(1, 2)  # [N, A, H]: actions are channels, the horizon is the length
        skips = []
        for res1, res2, down in self.down_modules:
            h = res2(res1(h, feature), feature)
            skips.append(h)
            h = down(h)
        for res in self.mid_modules:
            h = res(h, feature)
        for res1, res2, up in self.up_modules:
            h = torch.cat((h, skips.pop()), dim=1)
            h = up(res2(res1(h, feature), feature))
        out = self.final_conv(h).transpose(1, 2)[:, :horizon]
        return out.reshape(*batch_shape, horizon, self.action_dim)


def flatten_denoiser_inputs(
    name: str,
    x: Tensor,
    t: Tensor | int,
    cond: Tensor | None,
    *,
    action_dim: int,
    cond_dim: int,
    dtype: torch.dtype,
    horizon: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, torch.Size]:
    """Check a denoiser's ``(x [*B, H, A], t [*B] or 0-d, cond [*B, C])`` and flatten the batch dims.

    Returns:
        ``(x [N, H, A] in dtype, t [N], cond [N, C] in dtype or None, batch_shape *B)`` with N = prod(*B).

    Raises:
        ShapeError: naming the argument, its shape and the expected shape.
    """
    if not isinstance(x, Tensor) or x.ndim < 3 or not x.is_floating_point():
        got = f"shape {list(x.shape)}, dtype {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ShapeError(f"{name}: x must be a float tensor [*B, H, A] with at least one batch dim and A={action_dim}, got {got}")
    batch_shape, (h, a) = x.shape[:-2], x.shape[-2:]
    want_h = "H" if horizon is None else str(horizon)
    if a != action_dim or (horizon is not None and h != horizon) or h < 1:
        raise ShapeError(f"{name}: x must be [*B, {want_h}, {action_dim}] (action_dim={action_dim}), got {list(x.shape)}")
    if not isinstance(t, Tensor):
        t = torch.as_tensor(t, device=x.device)
    if t.dtype == torch.bool or t.is_complex():
        raise ShapeError(f"{name}: t must be an int64 tensor of diffusion steps, got dtype {t.dtype}")
    if t.ndim != 0 and t.shape != batch_shape:
        raise ShapeError(f"{name}: t must be 0-d or match the batch dims of x, {list(batch_shape)}, got {list(t.shape)}")
    if cond_dim == 0 and cond is None:
        pass
    elif not isinstance(cond, Tensor) or cond.shape != (*batch_shape, cond_dim):
        got = list(cond.shape) if isinstance(cond, Tensor) else type(cond).__name__
        raise ShapeError(f"{name}: cond must be [*B, cond_dim] = {[*batch_shape, cond_dim]} (batch dims of x), got {got}")
    n = batch_shape.numel()
    x = x.reshape(n, h, a).to(dtype)
    t = t.expand(n) if t.ndim == 0 else t.reshape(n)
    if cond is not None:
        cond = cond.reshape(n, cond_dim).to(dtype)
    return x, t, cond, batch_shape


def _check_positive(name: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}: {key} must be a positive int, got {value!r}")
