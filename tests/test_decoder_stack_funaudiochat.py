"""Tests of `decoder_stack_forward` (a transformers Qwen3 stack run layer by layer in two halves per layer), eager and
with the halves compiled (`generate_speech(compile_prefill=True)`)."""

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
