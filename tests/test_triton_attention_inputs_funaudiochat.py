"""Tests of the decode step's attention-inputs kernel (`triton_attention_inputs_funaudiochat`): q/k norms, rotary
embedding and static cache write in one kernel, against the eager Qwen3 layer and `StaticCache.update`. On CPU through
Triton's interpreter (in a subprocess, see conftest), on a GPU for real (marked `gpu`); the whole tiny model through
this path is checked against the golden tokens in test_triton_linear_funaudiochat.py.
"""

import json

import pytest
import torch

from funaudiochat_hf import triton_attention_inputs_funaudiochat as attention_inputs

from conftest import assert_waits_before_reading, hopper_ptx, run_in_triton_interpreter


# (batch, heads, kv_heads, head_dim, used cache positions), float32 (the interpreter's bfloat16 is not faithful;
# bfloat16 runs on the GPU)
CASES = [
    (1, 16, 8, 128, 5),  # the CRQ's head layout
    (2, 4, 2, 16, 0),  # two rows, an empty cache
    (1, 6, 2, 24, 7),  # head_dim not a power of two, 3 query heads per KV head
]

_SCRIPT = """
import copy, json, sys, torch
from transformers import Qwen3Config, StaticCache
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding, apply_rotary_pos_emb
from funaudiochat_hf.compat import cache_kwargs
from funaudiochat_hf.triton_attention_inputs_funaudiochat import decode_attention_inputs, writable_static_layer
from test_triton_attention_inputs_funaudiochat import CASES

torch.manual_seed(0)
results = []
dtype = torch.float32
for batch, heads, kv_heads, head_dim, used in CASES:
    config = Qwen3Config(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         num_hidden_layers=1, max_position_embeddings=64, rms_norm_eps=1e-6)
    attention = Qwen3Attention(config, layer_idx=0).to(dtype)
    for norm in (attention.q_norm, attention.k_norm):
        norm.weight.data.uniform_(0.5, 1.5)
    cache = StaticCache(config=config, max_cache_len=16)
    # The cache as a prefill leaves it: `used` positions written, then one decode position per row.
    prefill = [torch.randn(batch, kv_heads, used, head_dim, dtype=dtype) for _ in range(2)]
    cache.update(*prefill, 0) if used else cache.early_initialization(batch, kv_heads, head_dim, dtype, "cpu")
    expected_cache = copy.deepcopy(cache)
    query = torch.randn(batch, 1, heads * head_dim, dtype=dtype) * 3
    key, value = (torch.randn(batch, 1, kv_heads * head_dim, dtype=dtype) * 3 for _ in range(2))
    positions = torch.arange(batch)[:, None] + used  # rows at different rotary positions
    cos, sin = Qwen3RotaryEmbedding(config)(query, positions)

    shape = (batch, 1, -1, head_dim)
    q = attention.q_norm(query.view(shape)).transpose(1, 2)
    k = attention.k_norm(key.view(shape)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    expected_keys, expected_values = expected_cache.update(k, value.view(shape).transpose(1, 2), 0)

    layer = writable_static_layer(cache, 0)
    got_query, got_keys, got_values = decode_attention_inputs(attention, query, key, value, cos, sin, layer)
    error = lambda a, b: (a.float() - b.float()).abs().max().item()
    results.append({
        "query": error(got_query, q), "keys": error(got_keys, expected_keys),
        "values": error(got_values, expected_values), "shape": list(got_query.shape) == list(q.shape),
        "length": [int(layer.cumulative_length), int(expected_cache.layers[0].cumulative_length)],
    })
print(json.dumps(results))
"""


def test_kernel_matches_eager_norms_rotary_and_cache_update_in_the_triton_interpreter():
    """To 1e-5 (only the norms' summation order differs); the length advances by one like `StaticLayer.update`'s."""
    results = json.loads(run_in_triton_interpreter(_SCRIPT))
    assert len(results) == len(CASES)
    for case, result in zip(CASES, results):
        assert result["shape"] and result["length"][0] == result["length"][1] == case[4] + 1, (case, result)
        assert all(result[name] < 1e-5 for name in ("query", "keys", "values")), (case, result)


# (batch, heads, kv_heads, head_dim, max_cache_len, used positions): several splits with the new position in a later
# split's block, two left-padded rows with head_dim not a power of two, an empty one-block cache.
FOLDED_CASES = [(1, 16, 8, 128, 640, 200), (2, 4, 2, 24, 200, 70), (1, 6, 2, 32, 64, 0)]

def folded_case_results(device: str = "cpu", dtype: torch.dtype = torch.float32, counters: bool = False) -> list[dict]:
    """Each of `FOLDED_CASES` through `decode_attention_with_inputs` and through the attention-inputs kernel followed
    by the attention's kernels: how far apart their outputs, caches and lengths are. `counters`: the folded call
    gets arrival counters and a config that lets the last split of each head merge at every split count (they must
    come back zero)."""
    from funaudiochat_hf.triton_attention_funaudiochat import AttentionLaunch, launch_decode_attention
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    config = DecodeKernelConfig.for_device(device)
    if counters:
        config = config.replace(attention_max_merge_parts=1 << 20)

    generator = torch.Generator().manual_seed(0)
    results = []
    for batch, heads, kv_heads, head_dim, cache_len, used in FOLDED_CASES:
        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

        query = rand(batch, heads * head_dim, scale=3)
        key, value = (rand(batch, kv_heads * head_dim, scale=3) for _ in range(2))
        norms = [(torch.rand(head_dim, generator=generator) + 0.5).to(device, dtype) for _ in range(2)]
        angles = torch.rand(batch, head_dim // 2, generator=generator) * 6
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(device, dtype) for f in (torch.cos, torch.sin))
        caches = [rand(batch, kv_heads, cache_len, head_dim) for _ in range(2)]
        mask = torch.zeros(batch, cache_len, dtype=torch.bool, device=device)
        mask[:, : used + 1] = True
        mask[1:, :5] = False  # left padding
        norm_args = (*norms, 1e-6, 1e-5, cos, sin)

        # Reference: the attention-inputs kernel, then the attention's kernels.
        keys, values = (c.clone() for c in caches)
        length = torch.tensor(used, device=device)
        states = attention_inputs.decode_attention_inputs_op(query, key, value, *norm_args, keys, values, length, [])
        expected = launch_decode_attention(states, keys, values, mask, 0.125)

        folded_keys, folded_values = (c.clone() for c in caches)
        folded_length = torch.tensor(used, device=device)
        arrivals = torch.zeros(batch * kv_heads + 1, dtype=torch.int32, device=device) if counters else None
        got = torch.ops.funaudiochat.decode_attention_with_inputs(
            query, key, value, *norm_args, folded_keys, folded_values, folded_length, mask, 0.125, arrivals,
            list(AttentionLaunch.of(config, batch)),
        )
        results.append({
            "counters_zero": arrivals is None or not arrivals.any().item(),
            "output": (got.float() - expected.float()).abs().max().item(),
            "shape": list(got.shape) == list(expected.shape),
            "cache": max((a.float() - b.float()).abs().max().item() for a, b in ((folded_keys, keys),
                                                                                   (folded_values, values))),
            "written": not torch.equal(keys[:, :, used], caches[0][:, :, used]),
            "length": [int(folded_length), int(length)],
        })  # fmt: skip
    return results


def _assert_folded_results(results: list[dict], tolerance: float) -> None:
    assert len(results) == len(FOLDED_CASES)
    for case, result in zip(FOLDED_CASES, results):
        assert result["shape"] and result["written"] and result["counters_zero"], (case, result)
        assert result["length"] == [case[5] + 1] * 2, (case, result)
        assert result["output"] < tolerance and result["cache"] < tolerance, (case, result)


_FOLDED_SCRIPT = """
import json
from funaudiochat_hf import triton_attention_funaudiochat
from test_triton_attention_inputs_funaudiochat import folded_case_results
results = []
# A merge kernel, or the last split merging.
for counters in (False, True):
    triton_attention_funaudiochat.MAX_SPLITS = 64
    results.append(folded_case_results(counters=counters))
    triton_attention_funaudiochat.MAX_SPLITS = 2  # several blocks per split: the new position in a later one
    results.append(folded_case_results(counters=counters))
print(json.dumps(results))
"""


def test_attention_with_inputs_matches_the_inputs_kernel_then_the_attention_in_the_triton_interpreter():
    """`decode_attention_with_inputs`: the attention's split kernel norms and rotates the queries itself, the split
    that reads the new position's block writes the new key and value first, the merge kernel advances the length.
    Same output (to 1e-6) and the same cache and length as the attention-inputs kernel followed by the attention,
    with one block per split and with several (the new position then in a split's later block), and with arrival
    counters: the last split of each head merges the splits and the last head advances the length, the counters left
    at zero."""
    for results in json.loads(run_in_triton_interpreter(_FOLDED_SCRIPT)):
        _assert_folded_results(results, tolerance=1e-6)


def test_only_allocated_static_layers_are_written_by_the_kernel():
    from transformers import DynamicCache, Qwen3Config, StaticCache

    config = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=2)
    cache = StaticCache(config=config, max_cache_len=8)
    assert attention_inputs.writable_static_layer(cache, 0) is None  # not allocated yet
    cache.early_initialization(1, 1, 16, torch.float32, "cpu")
    assert attention_inputs.writable_static_layer(cache, 1) is cache.layers[1]
    assert attention_inputs.writable_static_layer(DynamicCache(config=config), 0) is None
    assert attention_inputs.writable_static_layer(None, 0) is None


@pytest.mark.parametrize("pdl", [True, False])
def test_programmatic_launch_waits_before_reading(pdl):
    pytest.importorskip("triton")
    kernel = attention_inputs._attention_inputs_kernel
    types = {name: "*bf16" for name in kernel.arg_names if name.endswith("_ptr")}
    types["length_ptr"] = "*i64"
    constexprs = dict(BATCH=1, HEADS=16, KV_HEADS=8, HEAD_DIM=128, BLOCK_H=16, BLOCK_KV=8, BLOCK_D=128, Q_EPS=1e-6,
                      K_EPS=1e-6, PDL=pdl)
    assert_waits_before_reading(hopper_ptx(kernel, constexprs, types), pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_eager(dtype):
    from transformers import Qwen3Config, StaticCache
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    config = Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         num_hidden_layers=1, max_position_embeddings=4096)
    attention = qwen3.Qwen3Attention(config, layer_idx=0).to("cuda", dtype)
    expected_cache, cache = (StaticCache(config=config, max_cache_len=64) for _ in range(2))
    for c in (expected_cache, cache):
        c.early_initialization(1, 8, 128, dtype, "cuda")
    query = torch.randn(1, 1, 2048, device="cuda", dtype=dtype)
    key, value = (torch.randn(1, 1, 1024, device="cuda", dtype=dtype) for _ in range(2))
    cos, sin = qwen3.Qwen3RotaryEmbedding(config, device="cuda")(query, torch.tensor([[0]], device="cuda"))
    q = attention.q_norm(query.view(1, 1, -1, 128)).transpose(1, 2)
    k = attention.k_norm(key.view(1, 1, -1, 128)).transpose(1, 2)
    q, k = qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    keys, values = expected_cache.update(k, value.view(1, 1, -1, 128).transpose(1, 2), 0)
    layer = attention_inputs.writable_static_layer(cache, 0)
    got = attention_inputs.decode_attention_inputs(attention, query, key, value, cos, sin, layer)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, (q, keys, values)):
        assert (a.float() - b.float()).abs().max().item() < tolerance
    assert int(layer.cumulative_length) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("counters", [False, True])
@pytest.mark.parametrize("max_splits", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_attention_with_inputs_matches_the_inputs_kernel_then_the_attention(
    dtype, max_splits, counters, monkeypatch
):
    """On the GPU the splits run concurrently: the one that writes the new position must see its write (a barrier)
    and no other split reads that block. The same arithmetic as the two-step path, up to the order of the norms'
    float32 sums (another tile shape): to 1e-6 in both dtypes. On the GPU the folded splits take the pipelined loop
    up to the new position, the two-step path the block loop; with at most 2 splits each split has several blocks,
    the new position in a later one. With arrival counters the last split of each head merges: the splits' partials
    must be visible to it (a barrier and an acquire-release atomic), and the length advance must wait for every
    head."""
    from funaudiochat_hf import triton_attention_funaudiochat

    if max_splits is not None:
        monkeypatch.setattr(triton_attention_funaudiochat, "MAX_SPLITS", max_splits)
    _assert_folded_results(folded_case_results("cuda", dtype, counters), tolerance=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_pipelined_blocks_equal_the_block_loop(dtype, monkeypatch):
    """The folded attention's pipelined loop over the blocks up to the new position gives the block loop's result
    (that of the attention-inputs kernel then the attention without inputs: the same blocks in the same order; the
    blocks it leaves out add nothing), for new positions at the start, end and middle of a block, in a split's first
    or later block, with left padding (NaN in its cache positions, and past the new position)."""
    from funaudiochat_hf import triton_attention_funaudiochat

    generator = torch.Generator().manual_seed(0)
    for batch, cache_len, used, max_splits in [(1, 1280, 700, 64), (16, 1280, 700, 64), (1, 640, 63, 2),
                                               (3, 640, 64, 2), (2, 4096, 3000, 4), (1, 64, 0, 64)]:  # fmt: skip
        monkeypatch.setattr(triton_attention_funaudiochat, "MAX_SPLITS", max_splits)

        def rand(*shape):
            return torch.randn(*shape, generator=generator).to("cuda", dtype)

        query, key, value = rand(batch, 16 * 128), rand(batch, 8 * 128), rand(batch, 8 * 128)
        norms = [(torch.rand(128, generator=generator) + 0.5).to("cuda", dtype) for _ in range(2)]
        cos, sin = rand(batch, 128), rand(batch, 128)
        caches = [rand(batch, 8, cache_len, 128) for _ in range(2)]
        mask = torch.zeros(batch, cache_len, dtype=torch.bool, device="cuda")
        mask[:, : used + 1] = True
        mask[1:, : min(used, 70)] = False  # left padding, a whole block of it
        for cache in caches:  # what the padding holds is never read into the result
            cache.masked_fill_(~mask[:, None, :, None], float("nan"))
        outputs = []
        for pipelined in (True, False):
            keys, values = (c.clone() for c in caches)
            length = torch.tensor(used, device="cuda")
            norm_args = (*norms, 1e-6, 1e-6, cos, sin)
            if pipelined:
                out = torch.ops.funaudiochat.decode_attention_with_inputs(
                    query, key, value, *norm_args, keys, values, length, mask, 0.088, None, []
                )
            else:
                states = attention_inputs.decode_attention_inputs_op(query, key, value, *norm_args, keys, values,
                                                                     length, [])  # fmt: skip
                out = triton_attention_funaudiochat.launch_decode_attention(states, keys, values, mask, 0.088)
            outputs.append((out, keys, values, int(length)))
        (out, keys, values, length), (out_loop, keys_loop, values_loop, length_loop) = outputs
        assert torch.isfinite(out).all(), (batch, cache_len, used)
        # The query normed and rotated in another kernel (the order of the norm's float32 sums), and in bfloat16 the
        # pipelined loop's products may round once differently.
        tolerance = 1e-6 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(out, out_loop, rtol=0, atol=tolerance, msg=f"{(batch, cache_len, used)}")
        # The new key is normed and rotated by another kernel too: its float32 sums may round once differently
        # (relative to the rotated key's size, which the random cos / sin here make up to ~10).
        cache_rtol = 1e-5 if dtype == torch.float32 else 0.0
        for cache, cache_loop in ((keys, keys_loop), (values, values_loop)):  # NaN where both are
            torch.testing.assert_close(cache, cache_loop, rtol=cache_rtol, atol=tolerance, equal_nan=True)
        assert length == length_loop == used + 1


@torch.library.custom_op("funaudiochat_test::read_and_advance", mutates_args=("length",))
def _read_and_advance(x: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Stands in for the attention operators: reads its input, then advances the cache length."""
    out = x.float().sum() + length
    length.add_(1)
    return out.reshape(1)


@_read_and_advance.register_fake
def _(x, length):
    return x.new_empty(1, dtype=torch.float32)


def _layers_after_a_mask(length: torch.Tensor) -> torch.Tensor:
    """A decode step's shape: a mask computed from the cache length and rotary-like values, stored once
    (`stored_once`), then three "layers" that each read both and advance the length."""
    positions = torch.arange(8)
    mask = positions[None, :] <= length
    cos = (positions.float() * 0.1).cos()
    mask, cos = attention_inputs.stored_once((mask, cos))
    return torch.cat([_read_and_advance(mask.float() * cos, length) for _ in range(3)])


def test_stored_tensors_are_not_recomputed_after_the_length_advances():
    """Compiled by Inductor, a mask computed from the cache length is stored before the first layer advances the length
    and every layer reads that mask. Without `stored_once` Inductor (2.13, CPU) recomputes it inside each later
    layer's input kernel, from the advanced length: the second and third outputs here were 8.85 and 9.85 instead of
    7.93 and 8.93. `store` (no kernel) keeps the eager values."""
    expected = _layers_after_a_mask(torch.tensor(3))
    torch._dynamo.reset()
    got = torch.compile(_layers_after_a_mask, fullgraph=True)(torch.tensor(3))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
