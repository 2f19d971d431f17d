"""Vision: RGB cameras -> tokens.

:class:`ResNetGN`, a ResNet-18-style CNN with GroupNorm instead of BatchNorm (no running statistics,
so it runs under ``torch.func.functional_call`` and ``torch.func.vmap``), on uint8 images converted on
the device (:func:`preprocess_images`); :class:`AttentionPool2d` pools its feature map into
``num_vision_tokens`` tokens with learned queries over the flattened map + a 2-D sin-cos position
(:func:`sincos_2d`); :class:`VisionEncoder` runs every camera through a shared or per-camera trunk and pool.

References: He et al. (2016), "Deep Residual Learning for Image Recognition" (ResNet-18);
Wu & He (2018), "Group Normalization"; Radford et al. (2021), CLIP (AttentionPool2d); Chi et al.
(2023), Diffusion Policy (ResNet-18 with GroupNorm as the vision encoder).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from rlfunc.errors import CheckpointError, ShapeError
from rlfunc.nets.encoders._checks import _check_int, _check_widths
from rlfunc.nets.encoders.attention import QueryPool, _no_autocast

if TYPE_CHECKING:  # annotation only
    from rlfunc.nets.encoders.config import EncoderConfig

__all__ = ["AttentionPool2d", "BasicBlockGN", "ResNetGN", "VisionEncoder", "preprocess_images", "sincos_2d"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def preprocess_images(images: Tensor, *, name: str = "images") -> tuple[Tensor, torch.Size]:
    """uint8 RGB ``[*B, H, W, 3]`` -> ImageNet-normalised float32 ``[N, 3, H, W]``, N = prod(*B).

    ``y = (x / 255 - mean) / std`` with ImageNet's mean (0.485, 0.456, 0.406) and std (0.229, 0.224,
    0.225), computed where ``images`` lives: move the uint8 tensor to the device first (4x fewer
    bytes than float). Float images are taken as already in [0, 1] (not divided by 255).

    Returns:
        ``(x [N, 3, H, W] float32, batch_shape *B)``.

    Raises:
        ShapeError: ``images`` is not a uint8/float tensor ``[*B, H, W, 3]``.
    """
    if not isinstance(images, Tensor) or images.ndim < 3 or images.shape[-1] != 3:
        got = list(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ShapeError(f"{name}: expected an RGB image tensor [*B, H, W, 3], got {got}")
    if images.dtype != torch.uint8 and not images.is_floating_point():
        raise ShapeError(f"{name}: expected dtype uint8 (or float in [0, 1]), got {images.dtype}")
    batch_shape = images.shape[:-3]
    with _no_autocast(images.device):
        # contiguous NCHW: a channels-last input would make GroupNorm fail under torch.func.vmap
        x = images.reshape(-1, *images.shape[-3:]).permute(0, 3, 1, 2).to(torch.float32).contiguous()
        if images.dtype == torch.uint8:
            x = x / 255.0
        mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=images.device).view(3, 1, 1)
        std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=images.device).view(3, 1, 1)
        return (x - mean) / std, batch_shape


def sincos_2d(height: int, width: int, dim: int, device: torch.device | str | None = None) -> Tensor:
    """Fixed 2-D sin-cos position embedding ``[height * width, dim]`` float32 (row-major positions).

    The first half of the channels encode the row, the second the column, each as
    ``[sin(p w_k), cos(p w_k)]`` with ``w_k = 10000^(-k / (dim/4))``, k = 0 .. dim/4 - 1.
    ``dim`` must be a multiple of 4 (checked by the callers' configs).

    Reference: He et al. (2022), MAE, ``get_2d_sincos_pos_embed``; Vaswani et al. (2017), Sec. 3.5.
    """
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32, device=device) / quarter)
    rows = torch.arange(height, dtype=torch.float32, device=device).repeat_interleave(width)
    cols = torch.arange(width, dtype=torch.float32, device=device).repeat(height)
    a, b = rows[:, None] * omega, cols[:, None] * omega
    return torch.cat((a.sin(), a.cos(), b.sin(), b.cos()), dim=-1)


def _group_norm(channels: int, group_size: int) -> nn.GroupNorm:
    return nn.GroupNorm(channels // group_size, channels)


class BasicBlockGN(nn.Module):
    """ResNet BasicBlock with GroupNorm: ``relu(gn(conv(relu(gn(conv(x))))) + shortcut(x))``.

    ``[N, C_in, H, W] -> [N, C_out, ceil(H / stride), ceil(W / stride)]``; the shortcut is a strided
    1x1 conv + GroupNorm when the shape changes. Submodules are named as in torchvision
    (``conv1, bn1, conv2, bn2, downsample``; the ``bn*`` are GroupNorms) so its checkpoints load.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, group_size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = _group_norm(out_channels, group_size)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = _group_norm(out_channels, group_size)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), _group_norm(out_channels, group_size))

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        h = F.relu(self.bn1(self.conv1(x)), inplace=True)  # in place, as torchvision: one activation fewer kept
        return F.relu(self.bn2(self.conv2(h)) + shortcut, inplace=True)


def _inside_torch_func() -> bool:
    """True inside a torch.func transform (vmap, grad, ...)."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _checkpointed(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)`` whose activations are recomputed in backward (non-reentrant checkpoint).

    The module's current tensors are passed to the checkpointed function explicitly, so the
    recomputation uses the same weights even when it runs after an enclosing
    ``torch.func.functional_call`` has restored the skeleton's own parameters.
    """
    named = dict(module.named_parameters())
    names, tensors = list(named), list(named.values())

    def run(inp: Tensor, *weights: Tensor) -> Tensor:
        return torch.func.functional_call(module, dict(zip(names, weights)), (inp,))

    return torch.utils.checkpoint.checkpoint(run, x, *tensors, use_reentrant=False)


class ResNetGN(nn.Module):
    """ResNet-18-style CNN with GroupNorm: ``[N, 3, H, W] float -> [N, widths[-1], H/2^(k+1), W/2^(k+1)]``.

    Stem ``conv 7x7/2 -> GroupNorm -> ReLU -> maxpool 3x3/2``, then ``len(widths)`` stages of
    ``blocks[i]`` :class:`BasicBlockGN` (the first stage at stride 1, the others at stride 2), k =
    ``len(widths)``; no global pooling and no classifier. A 128x128 image gives a 4x4 map with the
    default widths. Random init (Kaiming normal, fan_out) unless :meth:`load_pretrained` is called.
    GroupNorm has no running statistics, so the network behaves the same in train and eval mode,
    per sample, under ``functional_call`` and ``vmap``.

    ``forward(x, *, checkpoint=False)``: with ``checkpoint`` and grad enabled, each segment (the stem
    and every block) is recomputed in the backward pass instead of keeping its activations
    (``torch.utils.checkpoint``, non-reentrant); outputs and gradients are unchanged. Inside a
    ``torch.func`` transform (vmap, grad), which cannot run saved-tensor hooks, it warns and runs
    without checkpointing; the loop path of ``rlfunc.core.func.vmap`` keeps it.

    Raises:
        ConfigError: (constructor) widths/blocks not positive ints of equal length, or ``group_size``
            not dividing every width.

    Reference: He et al. (2016), Sec. 4.1 and Table 1 (18-layer); Wu & He (2018) (GroupNorm);
    Chi et al. (2023), visual encoder (a ResNet-18 with BatchNorm replaced by GroupNorm).
    """

    def __init__(self, widths: Sequence[int] = (64, 128, 256, 512), blocks: Sequence[int] = (2, 2, 2, 2),
                 group_size: int = 16, in_channels: int = 3) -> None:
        super().__init__()
        widths, blocks = tuple(widths), tuple(blocks)
        _check_int("ResNetGN", "group_size", group_size)
        _check_int("ResNetGN", "in_channels", in_channels)
        _check_widths("ResNetGN", widths, blocks, group_size)
        self.widths, self.blocks = widths, blocks
        self.out_channels = widths[-1]
        self.stem = nn.Sequential()
        self.stem.add_module("conv1", nn.Conv2d(in_channels, widths[0], 7, 2, 3, bias=False))
        self.stem.add_module("bn1", _group_norm(widths[0], group_size))
        self.stem.add_module("relu", nn.ReLU(inplace=True))
        self.stem.add_module("maxpool", nn.MaxPool2d(3, 2, 1))
        c_in = widths[0]
        for i, (c_out, n) in enumerate(zip(widths, blocks)):
            stage = [BasicBlockGN(c_in if j == 0 else c_out, c_out, (1 if i == 0 else 2) if j == 0 else 1, group_size)
                     for j in range(n)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
            c_in = c_out
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def segments(self) -> list[nn.Module]:
        """The checkpointing units in order: the stem, then every block."""
        return [self.stem, *(block for i in range(len(self.widths)) for block in getattr(self, f"layer{i + 1}"))]

    def forward(self, x: Tensor, *, checkpoint: bool = False) -> Tensor:
        recompute = checkpoint and torch.is_grad_enabled()
        if recompute and _inside_torch_func():
            warnings.warn(
                "ResNetGN: activation checkpointing is skipped inside torch.func transforms (vmap/grad), which do "
                "not support saved-tensor hooks; rlfunc.core.func.vmap(..., use_loop=True) keeps it", stacklevel=2)
            recompute = False
        for segment in self.segments():
            x = _checkpointed(segment, x) if recompute else segment(x)
        return x

    def load_pretrained(self, path: str | os.PathLike, *, prefix: str = "") -> ResNetGN:
        """Load weights in place from a local ``.safetensors`` file or a torch file (``weights_only``).

        Accepts this module's own state dict and torchvision-style ResNet keys (``conv1.*``/``bn1.*``
        map to ``stem.conv1.*``/``stem.bn1.*``); BatchNorm running statistics (``running_mean``,
        ``running_var``, ``num_batches_tracked``) and the classifier (``fc.*``) are dropped. BatchNorm
        affine weights loaded into GroupNorm do not reproduce the BatchNorm network's function; they
        are a starting point for fine-tuning (as in Diffusion Policy). Make the parameter TensorDict
        (``rlfunc.core.func.params_from_module``) after loading.

        Args:
            path: the file; a torch file may hold the state dict itself or under "state_dict".
            prefix: only keys starting with it are used, with it removed (e.g. "backbone.").

        Returns:
            ``self``.

        Raises:
            CheckpointError: the file is missing or unreadable, or its keys or shapes do not match
                this network's (the message lists the missing, unexpected and mis-shaped keys).
        """
        state = _read_state_dict(path)
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        drop = ("running_mean", "running_var", "num_batches_tracked")
        state = {k: v for k, v in state.items() if not k.endswith(drop) and not k.startswith("fc.")}
        state = {("stem." + k if k.startswith(("conv1.", "bn1.")) else k): v for k, v in state.items()}
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        shapes = sorted(f"{k}: file {list(state[k].shape)} vs net {list(own[k].shape)}"
                        for k in set(own) & set(state) if state[k].shape != own[k].shape)
        if missing or unexpected or shapes:
            show = lambda xs: f"{len(xs)} {xs[:6]}{' ...' if len(xs) > 6 else ''}"  # noqa: E731
            raise CheckpointError(
                f"ResNetGN.load_pretrained({os.fspath(path)!r}, prefix={prefix!r}): keys do not match "
                f"(widths={self.widths}, blocks={self.blocks}); missing {show(missing)}; unexpected "
                f"{show(unexpected)}; shape mismatches {show(shapes)}")
        self.load_state_dict(state, strict=True)
        return self


def _read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"load_pretrained: no file at {path!r}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path, device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt file, pickle refused by weights_only, ...
        raise CheckpointError(f"load_pretrained: cannot read {path!r}: {type(exc).__name__}: {exc}") from exc
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"load_pretrained: {path!r} does not hold a state dict of tensors")
    return dict(state)


class AttentionPool2d(nn.Module):
    """Pool a feature map into ``num_tokens`` tokens: learned queries over the flattened map.

    ``forward(feature [N, C, h, w]) -> [N, num_tokens, d_model] float32``:
    ``x = Linear(C -> d_model)(flatten(feature)) + sincos_2d(h, w)``, then :class:`QueryPool`. Any map
    size works (the position embedding is fixed, not learned). Computed in float32.

    Reference: Radford et al. (2021), CLIP's AttentionPool2d (with learned queries instead of the mean).
    """

    def __init__(self, in_channels: int, d_model: int, num_tokens: int, num_heads: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_channels, d_model)
        self.pool = QueryPool(d_model, num_tokens, num_heads)

    def forward(self, feature: Tensor) -> Tensor:
        _, _, h, w = feature.shape
        with _no_autocast(feature.device):
            x = self.proj(feature.float().flatten(2).transpose(1, 2))
            return self.pool(x + sincos_2d(h, w, x.shape[-1], device=x.device))


class VisionEncoder(nn.Module):
    """Cameras -> tokens: ``forward(images: list of [N, 3, H, W] float, one per camera) -> [N, K * T, d_model]``.

    With ``shared_trunk`` all K cameras go through one :class:`ResNetGN` and one
    :class:`AttentionPool2d` as one batch of K*N images and a learned camera embedding is added to
    each camera's T tokens; otherwise each camera has its own trunk and pool. ``freeze_vision`` runs
    the trunks under ``torch.no_grad()`` (their leaves get no gradient; torch.optim skips leaves whose
    grad is None); ``checkpoint_vision`` recomputes their activations in backward.
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        trunk = lambda: ResNetGN(c.widths, c.blocks, c.group_size)  # noqa: E731
        pool = lambda: AttentionPool2d(c.widths[-1], c.d_model, c.num_vision_tokens, c.num_heads)  # noqa: E731
        if c.shared_trunk:
            self.trunk, self.pool = trunk(), pool()
            self.camera_embed = nn.Parameter(torch.randn(len(c.cameras), c.d_model) * 0.02)
        else:
            self.trunks = nn.ModuleDict({cam: trunk() for cam in c.cameras})
            self.pools = nn.ModuleDict({cam: pool() for cam in c.cameras})
        if c.freeze_vision:
            for t in self.trunk_modules():
                t.requires_grad_(False)

    def trunk_modules(self) -> list[ResNetGN]:
        """The ResNet trunk(s): one when shared, else one per camera in ``config.cameras`` order."""
        return [self.trunk] if self.config.shared_trunk else [self.trunks[cam] for cam in self.config.cameras]

    def _features(self, trunk: ResNetGN, x: Tensor) -> Tensor:
        if self.config.freeze_vision:
            with torch.no_grad():
                return trunk(x)
        return trunk(x, checkpoint=self.config.checkpoint_vision)

    def forward(self, images: Sequence[Tensor]) -> Tensor:
        c = self.config
        if c.shared_trunk:
            k, n = len(images), images[0].shape[0]
            tokens = self.pool(self._features(self.trunk, torch.cat(list(images), dim=0)))  # [K*N, T, E]
            tokens = tokens.unflatten(0, (k, n)) + self.camera_embed[:, None, None, :]
            return tokens.transpose(0, 1).flatten(1, 2)
        return torch.cat([self.pools[cam](self._features(self.trunks[cam], x)) for cam, x in zip(c.cameras, images)], 1)
