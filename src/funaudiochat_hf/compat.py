"""Small shims over transformers-5 API differences between the releases we support (>=5.17)."""

import inspect

from transformers.models.qwen3.modeling_qwen3 import Qwen3Model


# transformers 5.24 renamed the `past_key_values` forward argument to `cache` (the old name is deprecated until
# 5.40). Every call that hands a cache to a transformers model goes through `cache_kwargs` so one line decides.
CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen3Model.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{"cache": cache}` on transformers >= 5.24, `{"past_key_values": cache}` before."""
    return {CACHE_KWARG: cache}


def output_cache(outputs):
    """The cache returned by a transformers model output, whatever the release calls it."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)
