"""The prompt pass's attention over a static cache: only the columns the prompt wrote.

A prompt pass (`generation_step_funaudiochat.prefill_forward`) writes its `n` positions into cache columns `0 .. n-1`
and its queries are those positions, so no query can see a column past `n - 1`. A static cache's update hands the
attention all of its columns, though, and SDPA with a mask computes every one of them, visible or not: the speech
engine's prefill workspace holds 2048 LLM columns and 5 * 2048 CRQ sub-positions, against a 333-token prompt's 333
and 1661 (the CRQ's prompt attention then does about six times the work it needs). `prompt_attention` narrows the
keys, values and mask to the first `n` columns and calls the module's configured attention function with them: the
same result (the columns dropped are masked out for every query), a fraction of the work.

Registered with transformers' attention interface (`register_prompt_attention()`) and passed down as the prompt
pass's `attention_implementation`; the model's config is left as it is (its masks are built as usual).
"""

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward


PROMPT_ATTENTION = "funaudiochat_prompt"


def prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The module's attention (`config._attn_implementation`) over the first `n` key columns, `n` = the query
    positions (`query`: `(batch, heads, n, head_dim)`; `key`, `value`: `(batch, kv_heads, kv_len, head_dim)`;
    `attention_mask`: None or `(batch, 1 or heads, n, kv_len)`). Only for a pass whose queries are cache columns
    `0 .. n-1` (a prompt pass from an empty cache). A sliding-window layer (whose cache may place positions
    otherwise) and keys no longer than the queries are passed on as they are."""
    width = query.shape[-2]
    if key.shape[-2] > width and not getattr(module, "sliding_window", None):
        key, value = key[:, :, :width], value[:, :, :width]
        if attention_mask is not None:
            attention_mask = attention_mask[..., :width]
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_attention_forward)
    return attention(module, query, key, value, attention_mask, **kwargs)


def register_prompt_attention() -> str:
    """Register `prompt_attention` globally; returns its name. Idempotent."""
    AttentionInterface.register(PROMPT_ATTENTION, prompt_attention)
    return PROMPT_ATTENTION


__all__ = ["PROMPT_ATTENTION", "prompt_attention", "register_prompt_attention"]
