"""Fusion: :class:`EncoderConfig`, :class:`ProprioEncoder`, :class:`FusionTransformer` and :class:`MultimodalEncoder`.

Each modality becomes a few ``d_model`` tokens; a learned CLS token and all modality tokens go through
a small pre-norm Transformer encoder and the CLS output is the global state feature ``[*B, d_model]``.
Proprioception: :class:`ProprioEncoder`, an MLP on inputs normalised with running statistics
(:mod:`rlfunc.core.normalize`, float32 state on the device).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlfunc.core.normalize import init_running_stats, normalize
from rlfunc.errors import ConfigError, ShapeError
from rlfunc.nets.activations import Mish
from rlfunc.nets.encoders.attention import _no_autocast, transformer_layer
from rlfunc.nets.encoders.config import EncoderConfig
from rlfunc.nets.encoders.text import SentenceEmbedder, TextEncoder, TextTokenizer
from rlfunc.nets.encoders.vision import VisionEncoder, preprocess_images

__all__ = ["EncoderConfig", "FusionTransformer", "MultimodalEncoder", "ProprioEncoder"]  # EncoderConfig: from .config

# --------------------------------------------------------------------------------------------
# Proprioception and fusion
# --------------------------------------------------------------------------------------------


class ProprioEncoder(nn.Module):
    """Proprioception -> tokens: ``Linear -> Mish -> Linear``, ``[N, P] -> [N, num_tokens, d_model]``.

    ``forward(proprio [N, P] float, stats=None, *, clip=None)``: with ``stats`` (running statistics of
    sample shape [P] from :func:`rlfunc.core.normalize.init_running_stats`, float32 on the same device) the
    input is first normalised, ``clamp((x - mean) / sqrt(var + 1e-8), -clip, clip)``, in float32 with
    autocast disabled; without, ``proprio`` must already be normalised.

    Raises:
        ShapeError: ``proprio`` is not float [N, P], or ``stats`` do not match it (shape or device).
    """

    def __init__(self, proprio_dim: int, d_model: int, hidden: int, num_tokens: int) -> None:
        super().__init__()
        self.proprio_dim, self.num_tokens, self.d_model = proprio_dim, num_tokens, d_model
        self.mlp = nn.Sequential(nn.Linear(proprio_dim, hidden), Mish(), nn.Linear(hidden, num_tokens * d_model))

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
      :func:`rlfunc.core.normalize.update_running_stats`) to normalise it here, clipped to ``proprio_clip``;
    - text="learned": ``"instruction_tokens"`` int64 ``[*B, max_len]`` + ``"instruction_padding_mask"``
      bool ``[*B, max_len]`` (from :attr:`tokenizer`), or ``"instruction"``: the strings, tokenised
      here with the cached :attr:`tokenizer` (CPU work, then a copy to the device);
    - text="minilm": ``"instruction_embedding"`` float ``[*B, sentence_dim]`` or ``"instruction"`` strings
      embedded with the cached :attr:`sentence_embedder`.

    Parameters for ``rlfunc.core.func``: ``params_from_module(encoder)``; it has no buffers, so
    ``rlfunc.core.func.vmap`` over ``stack_params`` works on both paths (tested equal). Under autocast the
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
