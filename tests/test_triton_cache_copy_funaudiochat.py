"""Tests of the admission's cache copy (`triton_cache_copy_funaudiochat`): one launch copies a prompt's columns of every
layer of a static cache into a batch slot, as the per-layer slice copies do; the engine admits requests through it with
their single-run tokens. On CPU through Triton's interpreter (in a subprocess, see conftest), on a GPU for real (marked
`gpu`).
"""

import json

import pytest
import torch

from funaudiochat_hf.triton_cache_copy_funaudiochat import CachePointers, copy_cache_columns

from conftest import run_in_triton_interpreter


def static_cache(layers, rows, heads, columns, head_dim, dtype=torch.float32, device="cpu", seed=0):
    """A `StaticCache` of random values, its layers initialized."""
    from transformers import Qwen3Config, StaticCache

    config = Qwen3Config(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=head_dim, hidden_size=heads * head_dim)  # fmt: skip
    cache = StaticCache(config=config, max_cache_len=columns)
    generator = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        empty = torch.zeros(rows, heads, 0, head_dim, dtype=dtype, device=device)
        layer.lazy_initialization(empty, empty)
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=generator))
        layer.values.copy_(torch.randn(layer.values.shape, generator=generator))
    return cache


def copy_errors(dtype=torch.float32, device="cpu") -> dict:
    """Copies into row 2 of a 3-row batch cache from row 0 of a 1-row cache (columns and lengths not multiples of
    anything; one copy longer than a program's block): {case: whether every layer equals the slice copies' result}."""
    results = {}
    for length, src_start, dst_start in ((5, 3, 11), (1, 0, 0), (700, 4, 30)):
        batch = static_cache(3, 3, 2, 736, 24, dtype, device, seed=1)
        prompt = static_cache(3, 1, 2, 720, 24, dtype, device, seed=2)
        expected = [(layer.keys.clone(), layer.values.clone()) for layer in batch.layers]
        for (keys, values), own in zip(expected, prompt.layers):
            keys[2, :, dst_start : dst_start + length] = own.keys[0, :, src_start : src_start + length]
            values[2, :, dst_start : dst_start + length] = own.values[0, :, src_start : src_start + length]
        copy_cache_columns(CachePointers.of(batch), 2, dst_start, CachePointers.of(prompt), 0, src_start, length)
        results[length] = all(
            torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
            for layer, (keys, values) in zip(batch.layers, expected)
        )
    return results


_SCRIPT = """
import json, torch
from test_triton_cache_copy_funaudiochat import copy_errors
print(json.dumps({str(dtype): copy_errors(dtype) for dtype in (torch.float32, torch.bfloat16)}))
"""


def test_one_launch_copies_every_layers_columns_in_the_interpreter():
    results = json.loads(run_in_triton_interpreter(_SCRIPT))
    assert results == {dtype: {"5": True, "1": True, "700": True} for dtype in ("torch.float32", "torch.bfloat16")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_copies_every_layers_columns_on_cuda(dtype):
    pytest.importorskip("triton")
    assert all(copy_errors(dtype, "cuda").values())


def test_tables_refuse_what_the_kernel_cannot_copy():
    pytest.importorskip("triton")
    from transformers import DynamicCache, Qwen3Config

    assert CachePointers.of(DynamicCache(config=Qwen3Config(num_hidden_layers=2))) is None  # tensors that grow
    cache = static_cache(2, 1, 2, 8, 4)
    cache.layers[1].keys = cache.layers[1].keys.transpose(2, 3)  # not one contiguous layout
    assert CachePointers.of(cache) is None
    cache = static_cache(2, 1, 2, 8, 4)
    pointers = CachePointers.of(cache)
    assert pointers.current(cache) and pointers.table.tolist() == [
        tensor.data_ptr() for layer in cache.layers for tensor in (layer.keys, layer.values)
    ]
    cache.layers[0].keys = cache.layers[0].keys.clone()
    assert not pointers.current(cache)


def test_bad_copies_are_refused_before_the_launch():
    table = torch.zeros(4, dtype=torch.int64)
    batch = CachePointers(table, rows=3, heads=2, columns=16, head_dim=8, dtype=torch.bfloat16, first_address=0)
    prompt = CachePointers(table, rows=1, heads=2, columns=10, head_dim=8, dtype=torch.bfloat16, first_address=0)
    with pytest.raises(ValueError, match="Columns out of range"):
        copy_cache_columns(batch, 0, 8, prompt, 0, 0, 9)  # past the batch's last column
    with pytest.raises(ValueError, match="Columns out of range"):
        copy_cache_columns(batch, 0, 0, prompt, 0, 4, 7)  # past the prompt's
    with pytest.raises(ValueError, match="Rows out of range"):
        copy_cache_columns(batch, 3, 0, prompt, 0, 0, 4)
    other = CachePointers(table, rows=1, heads=4, columns=10, head_dim=8, dtype=torch.bfloat16, first_address=0)
    with pytest.raises(ValueError, match="differ in layout"):
        copy_cache_columns(batch, 0, 0, other, 0, 0, 4)


_ENGINE_SCRIPT = """
import dataclasses, json, torch
from funaudiochat_hf import serving_batch_funaudiochat as serving_batch, triton_cache_copy_funaudiochat as cache_copy
from funaudiochat_hf.generation_state_funaudiochat import SpeechGenerator
from funaudiochat_hf.serving_engine_funaudiochat import SpeechEngine
from funaudiochat_hf.serving_requests_funaudiochat import SpeechRequest
from conftest import FUNAUDIOCHAT_TINY
from funaudiochat_hf import FunAudioChatForConditionalGeneration

torch.manual_seed(0)
model = FunAudioChatForConditionalGeneration.from_pretrained(FUNAUDIOCHAT_TINY).eval()
# As on a GPU: the request's prefill in static caches (the recorded prompt pass, here without the recording), the
# kernel taking the admission's copies.
plan = SpeechGenerator.plan
SpeechGenerator.plan = lambda *a, **k: dataclasses.replace(plan(*a, **k), prefill_graph=True, static_cache=True)
serving_batch.kernels_run_on = lambda tensor: True
launches, copy = [], serving_batch.copy_cache_columns
serving_batch.copy_cache_columns = lambda *a: launches.append(a[-1]) or copy(*a)
prompts = [torch.arange(30, 70)[None], torch.arange(100, 125)[None]]
engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=72, max_new_tokens=6, cache_length=160,
                      generation_options={"do_sample": False})
try:
    handles = [engine.submit(SpeechRequest({"input_ids": ids}, max_new_tokens=6)) for ids in prompts]
    replies = [[t for event in handle.events(timeout=120) for t in event.text_ids] for handle in handles]
finally:
    engine.close()
single = [model.generate_speech(input_ids=ids, max_new_tokens=6, do_sample=False, return_audio=False)
          .sequences[0, ids.shape[1]:].tolist() for ids in prompts]
print(json.dumps({"equal": replies == single, "launches": launches}))
"""


def test_the_engine_admits_requests_through_the_kernel_with_their_single_run_tokens():
    result = json.loads(run_in_triton_interpreter(_ENGINE_SCRIPT))
    # Two requests, each two launches (the LLM's columns, the CRQ's five times as many), none per layer.
    assert sorted(result["launches"]) == [25, 40, 125, 200], result
    assert result["equal"], result
