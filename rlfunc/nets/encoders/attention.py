"""Attention with plain ops, in float32: :func:`multi_head_attention`, :class:`QueryPool`, :func:`transformer_layer`.

All attention of the encoders (pools and fusion) is computed in float32 with autocast disabled,
written with plain ops (:func:`multi_head_attention`) over the weights of ``nn.MultiheadAttention`` /
``nn.TransformerEncoderLayer`` skeletons, so state dicts interchange with PyTorch's modules. PyTorch's
own forward is not used because ``scaled_dot_product_attention`` on CPU and the inference fast path
(``_transformer_encoder_layer_fwd``) have no ``torch.func.vmap`` batching rule: vmap falls back to a
slow per-member loop with a warning.

References: Vaswani et al. (2017) (multi-head attention); Jaegle et al. (2021), Perceiver (learned
latent queries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["QueryPool", "multi_head_attention", "transformer_layer"]


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


def transformer_layer(layer: nn.TransformerEncoderLayer, x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """One pre-norm ``nn.TransformerEncoderLayer`` (``norm_first=True``, ``batch_first=True``) in plain ops.

    ``x + SA(norm1(x))`` then ``+ linear2(dropout(act(linear1(norm2(x)))))``: the module's own
    training-mode forward, without its fast path. ``x [N, S, E] -> [N, S, E]``.
    """
    h = layer.norm1(x)
    x = x + layer.dropout1(multi_head_attention(layer.self_attn, h, h, key_padding_mask))
    h = layer.norm2(x)
    return x + layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(h)))))
