"""GQA-aware attention for one query position, as a transformers attention function.

During decoding each layer attends one new query position to the whole (static) KV cache. transformers' `sdpa` path
passes a mask, so on CUDA it cannot use SDPA's `enable_gqa` and expands K/V to all query heads with `repeat_kv` first
(a copy of the cache per layer and step once the math backend is chosen, and several prep kernels for cuDNN). With a
single query position the query heads of one KV head can instead be stacked as the rows of one small matrix:

    q (batch, kv_heads, groups, head_dim) @ K^T (batch, kv_heads, head_dim, kv_len) -> scores (batch, kv_heads, groups,
    kv_len) -> + mask, softmax in float32 -> @ V (batch, kv_heads, kv_len, head_dim)

i.e. two batched GEMMs over `batch * kv_heads` with no K/V copy; a compiler (Inductor) fuses the scaling, masking and
softmax between them. Anything else (prefill, dropout, position bias) goes to transformers' `sdpa_attention_forward`
unchanged.

`register_gqa_decode_attention()` makes the function selectable as `config._attn_implementation =
GQA_DECODE_ATTENTION` (it reuses the `sdpa` mask builder, so masks are boolean `(batch, 1, q_len, kv_len)`).
"""

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask


GQA_DECODE_ATTENTION = "funaudiochat_gqa_decode"


def gqa_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention with transformers' attention-interface signature; GQA matmuls when `query` has one position.

    Args:
        module: the attention layer (only read by the `sdpa` fallback).
        query: `(batch, heads, q_len, head_dim)`.
        key, value: `(batch, kv_heads, kv_len, head_dim)`, `heads` a multiple of `kv_heads`.
        attention_mask: None, boolean (True = attend) or additive float, `(batch or 1, 1 or heads, q_len, kv_len)`.
        scaling: softmax scale, default `head_dim ** -0.5`.
        dropout: attention dropout probability; non-zero (training) uses the `sdpa` fallback.

    Returns:
        `(attn_output, None)` with `attn_output` `(batch, q_len, heads, head_dim)`, as `sdpa_attention_forward`.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or dropout != 0.0 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if heads % kv_heads != 0:
        raise ValueError(f"The query has {heads} heads, not a multiple of the {kv_heads} key/value heads.")
    groups = heads // kv_heads
    if scaling is None:
        scaling = head_dim**-0.5

    # One position: the (heads, 1) query rows of a KV head are its `groups` consecutive heads (a view, no copy).
    grouped_query = query.reshape(batch, kv_heads, groups, head_dim)
    # Scale and mask in float32, as SDPA does internally (the bf16 product is the only rounding before softmax).
    scores = torch.matmul(grouped_query, key.transpose(-1, -2)).float() * scaling  # (batch, kv_heads, groups, kv_len)
    if attention_mask is not None:
        scores = _apply_mask(scores, attention_mask, kv_heads, groups)
    probs = scores.softmax(dim=-1).to(value.dtype)
    output = torch.matmul(probs, value)  # (batch, kv_heads, groups, head_dim)
    # (batch, kv_heads, groups) is the head order of (batch, 1, heads): the layout transformers expects, contiguous.
    return output.reshape(output.shape[0], 1, heads, head_dim), None


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """Mask `scores` `(batch, kv_heads, groups, kv_len)` with a `(batch or 1, 1 or heads, 1, kv_len)` attention mask."""
    if mask.ndim != 4 or mask.shape[2] != 1 or mask.shape[1] not in (1, kv_heads * groups):
        raise ValueError(
            f"Expected a (batch, 1 or {kv_heads * groups}, 1, kv_len) attention mask for one query position, got "
            f"shape {tuple(mask.shape)}."
        )
    if mask.shape[1] != 1:  # per-head masks: the same grouping of heads as the query
        mask = mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-1])
    if mask.dtype == torch.bool:
        # The float32 minimum instead of -inf keeps a fully masked row finite (never the case when decoding: a
        # position always sees itself).
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask.to(scores.dtype)


def register_gqa_decode_attention() -> str:
    """Register `gqa_decode_attention` (with the `sdpa` mask builder) globally; returns its name. Idempotent."""
    AttentionInterface.register(GQA_DECODE_ATTENTION, gqa_decode_attention)
    AttentionMaskInterface.register(GQA_DECODE_ATTENTION, sdpa_mask)
    return GQA_DECODE_ATTENTION
