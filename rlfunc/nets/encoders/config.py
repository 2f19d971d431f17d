"""The options of the multimodal encoder (:class:`EncoderConfig`), checked on construction; the one
module both ``vision`` (which reads them) and ``fusion`` (which builds the encoder) import."""

from __future__ import annotations

from dataclasses import dataclass

from rlfunc.config import check_fields
from rlfunc.errors import ConfigError
from rlfunc.nets.encoders._checks import _check_int, _check_widths
from rlfunc.nets.encoders.text import TextTokenizer

__all__ = ["EncoderConfig", "RESERVED_KEYS", "TEXT_MODES"]

TEXT_MODES = ("none", "learned", "minilm")
RESERVED_KEYS = ("proprio", "instruction", "instruction_tokens", "instruction_padding_mask", "instruction_embedding")


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
        check_fields(self)
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
