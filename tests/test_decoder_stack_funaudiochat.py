"""Tests of `decoder_stack_forward` (a transformers Qwen3 stack run layer by layer in two halves per layer), eager and
with the halves compiled (the prefill of `generate_speech(backend="compiled")`, plan field `compile_prefill`)."""

import json

import pytest
import torch
from transformers import Qwen3Config, StaticCache
from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

from funaudiochat_hf.compat import cache_kwargs
from funaudiochat_hf.decoder_stack_funaudiochat import EAGER_HALVES, DecoderLayerHalves, decoder_stack_forward


def _stack(layers: int = 3, hidden: int = 32) -> Qwen3Model:
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=16,
    )
    return Qwen3Model(config).eval()


def _reference_and_ours(stack, halves, batch: int, length: int, max_len: int = 24):
    """The stack's own forward and `decoder_stack_forward` on a left-padded prompt (row 1 padded by 3), each into
    its own static cache; returns both outputs and both caches' keys of layer 0."""
    generator = torch.Generator().manual_seed(length)
    embeds = torch.randn(batch, length, stack.config.hidden_size, generator=generator)
    padding = torch.tensor([0] + [3] * (batch - 1))
    mask = torch.ones(batch, max_len, dtype=torch.bool)
    mask[1:, :3] = False
    positions = (torch.arange(length)[None] - padding[:, None]).clamp(min=0)
    caches = [StaticCache(config=stack.config, max_cache_len=max_len) for _ in range(2)]
    with torch.no_grad():
        reference = stack(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True,
            **cache_kwargs(caches[0]),
        ).last_hidden_state
        ours = decoder_stack_forward(stack, None, embeds, mask, positions, caches[1], halves)
    return reference, ours, [cache.layers[0].keys for cache in caches]


@pytest.mark.parametrize("batch", [1, 2])
def test_eager_halves_equal_the_stack_forward(batch):
    reference, ours, (reference_keys, our_keys) = _reference_and_ours(_stack(), EAGER_HALVES, batch, 9)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_keys, reference_keys, atol=1e-6, rtol=1e-6)  # the cache is filled the same way


def test_final_norm_false_returns_the_last_layer_output_before_the_norm():
    """`final_norm=False` (the CRQ's decode sub-step folding the norm into output_matching's kernel): the stack's
    output is the norm of what it returns."""
    stack = _stack()
    embeds = torch.randn(2, 5, stack.config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5)[None].expand(2, -1)
    with torch.no_grad():
        normed = decoder_stack_forward(stack, None, embeds, None, positions)
        raw = decoder_stack_forward(stack, None, embeds, None, positions, final_norm=False)
        assert not torch.allclose(raw, normed)
        torch.testing.assert_close(stack.norm(raw), normed, atol=0, rtol=0)


def test_compiled_halves_serve_every_layer_and_length_with_two_graphs():
    """Regional compilation: one graph per half for all layers and prompt lengths (a whole compiled layer would be
    one graph per layer: `Cache.update` indexes the cache's layers by `layer_idx`)."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    options = {"backend": counting_backend, "fullgraph": True, "dynamic": True}
    halves = DecoderLayerHalves(*(torch.compile(half, **options) for half in EAGER_HALVES))
    stack = _stack(layers=4)
    for length in (7, 11, 16):
        reference, ours, _ = _reference_and_ours(stack, halves, 2, length)
        torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    assert len(graphs) == 2


def test_projection_layer_count_mismatch_raises():
    stack = _stack(layers=2)

    class Projections:
        layers = [None]

    with pytest.raises(ValueError, match="1 layers but the stack has 2"):
        decoder_stack_forward(stack, Projections(), torch.zeros(1, 3, 32), None, torch.arange(3)[None])


_FOLDED_BATCH_SCRIPT = """
import json, torch
from transformers import StaticCache
from funaudiochat_hf import decoder_stack_funaudiochat as stack_module
from funaudiochat_hf.compat import cache_kwargs
from funaudiochat_hf.fused_crq_funaudiochat import fused_crq_projections, with_decode_kernels
from funaudiochat_hf.triton_attention_funaudiochat import register_triton_decode_attention
from funaudiochat_hf.triton_linear_funaudiochat import split_k_counters_for
from test_decoder_stack_funaudiochat import _stack

# The interpreter runs on CPU: let CPU decode steps take the path of CUDA ones.
stack_module._one_position_on_gpu = lambda hidden_states: hidden_states.shape[1] == 1
stack_module.use_rows_kernel = lambda hidden_states: hidden_states.shape[1] == 1 and hidden_states.shape[0] > 1
reference_stack = _stack(hidden=64)
ours_stack = _stack(hidden=64)
ours_stack.config._attn_implementation = register_triton_decode_attention()
batch, prompt, steps, max_len = 3, 6, 3, 16
generator = torch.Generator().manual_seed(1)
embeds = torch.randn(batch, prompt + steps, 64, generator=generator)
padding = torch.tensor([0, 3, 1])
mask = torch.ones(batch, max_len, dtype=torch.bool)
for row, pad in enumerate(padding.tolist()):
    mask[row, :pad] = False
positions = (torch.arange(prompt + steps)[None] - padding[:, None]).clamp(min=0)
updates = []


def run(decode_step, projections=None, counters=None, config=None):
    # Prefill then `steps` decode steps, ours (decode steps through `decode_step`) against the stack's own forward:
    # per call its largest error and the number of `cache.update` calls; the largest key error.
    caches = [StaticCache(config=stack.config, max_cache_len=max_len) for stack in (reference_stack, ours_stack)]
    original_update = caches[1].update
    caches[1].update = lambda *args, **kwargs: updates.append(1) or original_update(*args, **kwargs)
    errors = []
    with torch.no_grad():
        for start, end in [(0, prompt)] + [(prompt + i, prompt + i + 1) for i in range(steps)]:
            reference = reference_stack(
                inputs_embeds=embeds[:, start:end], attention_mask=mask, position_ids=positions[:, start:end],
                use_cache=True, **cache_kwargs(caches[0]),
            ).last_hidden_state
            updates.clear()
            step = stack_module.decoder_stack_forward if start == 0 else decode_step
            inputs = embeds[:, start:end].clone(), mask, positions[:, start:end].clone()
            if start == 0 or counters is None:
                ours = step(ours_stack, None, *inputs, caches[1])
            else:
                ours = step(ours_stack, projections, *inputs, caches[1], split_k_counters=counters,
                            kernel_config=config)
            errors.append({"error": (ours - reference).abs().max().item(), "cache_updates": len(updates)})
    # torch's max propagates a NaN; Python's max() of floats may pass over one, so the cache errors stay a list.
    keys = [(a.keys - b.keys).abs().max().item() for a, b in zip(caches[0].layers, caches[1].layers)]
    return errors, keys


errors, keys = run(stack_module.decoder_stack_forward)
# The decode steps' projections through the several-row kernel (fused weights; the counters given), split in two.
from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig
config = DecodeKernelConfig().replace(rows_tiles={
    (64, 64, False): (16, 16, 2, 4, 3, False), (64, 32, False): (32, 16, 2, 4, 3, False),
    (128, 64, True): (16, 32, 2, 4, 3, False), (64, 128, False): (16, 32, 4, 4, 3, False),
})
counters = split_k_counters_for(ours_stack.config, "cpu", batch)
launches, merge_kernels = [], []
rows_kernel = triton_linear.launch_rows
# Each launch: (whether it reads its norm's sums of squares, whether it stores its output's).
triton_linear.launch_rows = lambda *args: launches.append([a is not None for a in args[12:14]]) or rows_kernel(*args)
from funaudiochat_hf import triton_attention_funaudiochat as triton_attention
combine_kernel = triton_attention._combine_kernel


class CountedLaunches:  # `_combine_kernel[grid](...)`, counted
    def __getitem__(self, grid):
        merge_kernels.append(1)
        return combine_kernel[grid]


triton_attention._combine_kernel = CountedLaunches()
rows_steps, rows_keys = run(stack_module.decoder_stack_forward, with_decode_kernels(fused_crq_projections(ours_stack)),
                            counters, config)
rows_launches, rows_merge_kernels, rows_squares = len(launches), len(merge_kernels), [sum(x) for x in zip(*launches)]
rows_counters = counters.abs().sum().item()
# The same over the layers' own weights (the LLM: q, k and v as the parts of one launch, gate and up two weights).
launches.clear()
own_steps, own_keys = run(stack_module.decoder_stack_forward, triton_linear.own_weight_kernels(ours_stack), counters,
                          config)
own_launches, own_counters = len(launches), counters.abs().sum().item()
# The same decode steps compiled by Inductor (its CPU backend here): the kernels advance the cache length the mask
# was computed from, and without `stored_once` Inductor recomputed the mask for the later layers after that.
compiled, _ = run(torch.compile(stack_module.decoder_stack_forward, fullgraph=True))
compiled_errors = [step["error"] for step in compiled]
print(json.dumps({"steps": errors, "keys": keys, "compiled": compiled_errors, "rows_steps": rows_steps,
                  "rows_keys": rows_keys, "rows_counters": rows_counters, "rows_launches": rows_launches,
                  "rows_merge_kernels": rows_merge_kernels, "rows_squares": rows_squares,
                  "own_steps": own_steps, "own_keys": own_keys, "own_counters": own_counters,
                  "own_launches": own_launches}))
"""


def test_batched_decode_steps_fold_the_attention_inputs_into_the_triton_attention():
    """A decode step of several left-padded rows over a static cache with the Triton attention: the q/k norms, rotary
    and cache write run inside its kernels (the cache's `update` is not called), with the stack's own outputs, eager
    and compiled by Inductor."""
    from conftest import run_in_triton_interpreter

    result = json.loads(run_in_triton_interpreter(_FOLDED_BATCH_SCRIPT))
    prefill, *decode_steps = result["steps"]
    assert prefill["cache_updates"] == 3 and prefill["error"] < 1e-5  # a prompt (3 layers): cache.update
    for step in decode_steps:
        assert step["cache_updates"] == 0, result
        assert step["error"] < 1e-5, result
    assert all(error < 1e-5 for error in result["keys"]), result
    # Compiled: the mask is computed once, before the first layer.
    assert all(error < 1e-5 for error in result["compiled"]), result
    # With fused projections and split-K counters, the decode steps' projections take the several-row kernel (tiles
    # forced to split the reduction) and the attention's last split merges (2 query heads x 1 split: no merge
    # kernel): the same outputs and cache, and the counters are left at zero.
    for step in result["rows_steps"][1:]:
        assert step["cache_updates"] == 0 and step["error"] < 1e-5, result
    assert all(error < 1e-5 for error in result["rows_keys"]) and result["rows_counters"] == 0, result
    assert result["rows_launches"] == 3 * 4 * (len(result["rows_steps"]) - 1), result  # layers x projections x steps
    assert result["rows_merge_kernels"] == 0, result
    # And over the layers' own weights (the LLM's decode steps at batch 2-16): also 4 launches per layer.
    for step in result["own_steps"][1:]:
        assert step["cache_updates"] == 0 and step["error"] < 1e-5, result
    assert all(error < 1e-5 for error in result["own_keys"]) and result["own_counters"] == 0, result
    assert result["own_launches"] == 3 * 4 * (len(result["own_steps"]) - 1), result
    # Per step, o_proj and down_proj store their outputs' sums of squares and the norms after them read those (each
    # layer's gate/up; the q/k/v of every layer but the first, whose input is the step's embedding).
    decode_steps = len(result["rows_steps"]) - 1
    assert result["rows_squares"] == [(3 + 2) * decode_steps, 3 * 2 * decode_steps], result


@pytest.mark.parametrize("rope", [None, {"rope_type": "dynamic", "factor": 2.0}])
def test_rotary_tables_equal_the_rotary_module(rope):
    """`compat.rotary_tables`: the default rope's tables computed elementwise are the module's, exactly (bfloat16 out,
    positions past 2,048); another rope type is left to the module (here dynamic scaling, whose forward recomputes
    `inv_freq` for positions past `max_position_embeddings`: the default formula would use the stale one)."""
    from funaudiochat_hf.compat import rotary_tables

    config = Qwen3Config(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=1024, rope_parameters=rope
    )
    rotary = Qwen3Model(config).rotary_emb
    positions = torch.tensor([[0, 1, 7, 2049], [3, 500, 4095, 12]])
    x = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    ours = rotary_tables(rotary, x, positions)  # first: a dynamic rope's module call changes its `inv_freq`
    reference = rotary(x, positions)
    for table, expected in zip(ours, reference, strict=True):
        assert table.dtype == torch.bfloat16 and table.shape == (2, 4, 16)
        torch.testing.assert_close(table, expected, atol=0, rtol=0)
