"""Small shims over transformers-5 API differences between the releases we support (>=5.17)."""

import inspect

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3Model


# transformers 5.24 renamed the `past_key_values` forward argument to `cache` (the old name is deprecated until
# 5.40). Every call that hands a cache to a transformers model goes through `cache_kwargs` so one line decides.
CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen3Model.forward).parameters else "past_key_values"

# The same rename for the cache field of transformers' output classes.
OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{"cache": cache}` on transformers >= 5.24, `{"past_key_values": cache}` before."""
    return {CACHE_KWARG: cache}


def attention_passes_kwargs_to_cache() -> bool:
    """Whether the installed `Qwen3Attention` hands its kwargs on to `Cache.update(..., kwargs=kwargs)` (5.24 does,
    5.17 does not). The KV layer classes ignore them today; code that mirrors the attention does what it does."""
    try:
        return "kwargs=kwargs" in inspect.getsource(Qwen3Attention.forward)
    except (OSError, TypeError):
        return False


def rotary_tables(rotary_emb, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_emb(x, position_ids)`: the `(batch, n, head_dim)` cos and sin tables of a transformers rotary module.

    For the default rope, the elementwise product of transformers 5.24 (`positions[..., None] * inv_freq`) on every
    release: 5.17 forms the same products as a K=1 batched matmul, which Inductor leaves to a cuBLAS sgemm, one more
    kernel launch per stack call of a decode step. One float32 product per entry either way: equal values.
    Other rope types (their `dynamic_rope_update` may change `inv_freq`) call the module.
    """
    if getattr(rotary_emb, "rope_type", None) != "default":
        return rotary_emb(x, position_ids)
    freqs = position_ids[..., None].float() * rotary_emb.inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = rotary_emb.attention_scaling
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)
