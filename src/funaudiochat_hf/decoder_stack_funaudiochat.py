"""A transformers Qwen3 decoder stack run layer by layer, each layer in two halves around its attention.

`decoder_stack_forward(stack, ...)` returns what `stack(inputs_embeds=..., attention_mask=..., position_ids=...,
use_cache=True, cache).last_hidden_state` returns. It mirrors `Qwen3Model.forward` and `Qwen3DecoderLayer.forward`
line by line and calls the model's own norms, rotary embedding, mask builders, cache object, attention function
(`config._attn_implementation`, or the one passed as `attention_implementation`) and projections. Two things are
added:

- `projections`: the CRQ's concatenated q/k/v and gate/up weights ([`fused_crq_projections`]), used instead of the
  separate projections (4 GEMMs per layer instead of 7 in the latency-bound decode step); with their `decode_kernels`
  set, a one-row decode step on CUDA runs the four projections, the two norms, the activation and the residual adds as
  4 Triton kernels (`triton_linear_funaudiochat`), and so does a decode step of 2 to 16 rows given `split_k_counters`
  (the several-row kernel; its residual projections hand their outputs' sums of squares to the next norm,
  `_output_and_mlp_kernels`); `own_weight_kernels(stack)` asks for the same kernels over the layers' own projections
  (the LLM: 4 kernels per layer too, one reading its q, k and v weights). Over a static cache the q/k norms, rotary
  embedding and cache write of those steps are one more kernel, or part of the Triton attention's kernels when that
  is the attention (`triton_attention_inputs_funaudiochat`). The Triton attention takes that work in every decode
  step on CUDA, also where the projections stay on cuBLAS; the step's masks are then stored once before the first
  layer (`stored_once`), as the kernels advance the cache length they are computed from, and so are the rotary
  tables. Every kernel launch takes its tiles and launch kind from `kernel_config` ([`DecodeKernelConfig`]);
- `halves`: the two halves of a layer, `attention_inputs` (input norm, q/k/v, q/k norms, rotary) and
  `attention_output_and_mlp` (o_proj, residual, post-attention norm, MLP, residual), as plain functions of the layer
  module. The cache update and the attention call stay between them, outside. Compiled, they serve every layer and
  prompt length with one graph each ("regional" compilation: `generate_speech`'s compiled prefill). Compiling
  a whole layer would not work: transformers' `Cache.update` indexes `cache.layers[layer_idx]`, which gives every
  layer its own graph.
"""

from typing import NamedTuple

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, eager_attention_forward

from .compat import attention_passes_kwargs_to_cache, rotary_tables
from .triton_attention_inputs_funaudiochat import (
    decode_attention_inputs,
    decode_attention_with_inputs,
    stored_once,
    writable_static_layer,
)
from .triton_config_funaudiochat import DecodeKernelConfig
from .triton_linear_funaudiochat import decode_linear, use_decode_kernels, use_rows_kernel


_CACHE_UPDATE_GETS_KWARGS = attention_passes_kwargs_to_cache()


def attention_inputs(
    layer: nn.Module, projections, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First half of `Qwen3DecoderLayer.forward`: the attention's rotated query, key and value.

    Args:
        layer: a `Qwen3DecoderLayer`.
        projections: its `FusedLayerProjections`, an `OwnWeightLayer` (kernels over its own projections), or None.
        hidden_states: `(batch, n, hidden)`, the layer's input (also its first residual).
        cos, sin: rotary tables, each `(batch, n, head_dim)`.
    Returns:
        query `(batch, heads, n, head_dim)`, key and value `(batch, kv_heads, n, head_dim)`.
    """
    query, key, value = _project_qkv(layer, projections, hidden_states)
    return _rotated_heads(layer.self_attn, query, key, value, cos, sin)


def _rotated_heads(
    attention: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q/k norms and rotary embedding of `Qwen3Attention`: `(batch, n, heads * head_dim)` projections -> query
    `(batch, heads, n, head_dim)`, key and value `(batch, kv_heads, n, head_dim)`."""
    hidden_shape = (*query.shape[:-1], -1, attention.head_dim)
    query_states = attention.q_norm(query.view(hidden_shape)).transpose(1, 2)
    key_states = attention.k_norm(key.view(hidden_shape)).transpose(1, 2)
    value_states = value.view(hidden_shape).transpose(1, 2)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    return query_states, key_states, value_states


def _project_qkv(
    layer: nn.Module,
    projections,
    hidden_states: torch.Tensor,
    split_k_counters: torch.Tensor | None = None,
    norm_squares: torch.Tensor | None = None,
    kernel_config: DecodeKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input norm and the q, k and v projections: `(batch, n, hidden)` -> `(batch, n, heads * head_dim)` query,
    `(batch, n, kv_heads * head_dim)` key and value. `norm_squares`: the input's sums of squares, as the previous
    layer's kernels returned them (`_output_and_mlp_kernels`), or None."""
    attention = layer.self_attn
    own_weights = projections is None or projections.qkv_weight is None
    norm = layer.input_layernorm
    if _takes_kernels(projections, hidden_states, split_k_counters):
        counters = {"split_k_counters": split_k_counters, "norm_squares": norm_squares, "kernel_config": kernel_config}
        if own_weights:
            linears = (attention.q_proj, attention.k_proj, attention.v_proj)
            # One kernel over the three weights, no concatenated copy (an 8B model's would be 1.8 GB).
            qkv = decode_linear(hidden_states, linears[0].weight, linears[0].bias, norm, parts=linears[1:], **counters)
            return qkv.split([p.weight.shape[0] for p in linears], dim=-1)
        qkv = decode_linear(hidden_states, projections.qkv_weight, projections.qkv_bias, norm, **counters)
        return qkv.split(projections.qkv_split, dim=-1)
    return qkv_of_normed(attention, projections, norm(hidden_states))


def qkv_of_normed(
    attention: nn.Module, projections, normed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k and v projections of the normed layer input `(batch, n, hidden)`: the attention's own, or the fused
    copy of `projections` (its outputs split: views of one tensor)."""
    if projections is None or projections.qkv_weight is None:
        return attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)
    qkv = nn.functional.linear(normed, projections.qkv_weight, projections.qkv_bias)
    return qkv.split(projections.qkv_split, dim=-1)


def gate_and_up(mlp: nn.Module, projections, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's gate and up projections of the normed `(batch, n, hidden)`: its own, or the fused copy's halves."""
    if projections is None or projections.gate_up_weight is None:
        return mlp.gate_proj(normed), mlp.up_proj(normed)
    gate_up = nn.functional.linear(normed, projections.gate_up_weight, projections.gate_up_bias)
    return gate_up.split(projections.intermediate_size, dim=-1)


def attention_output_and_mlp(
    layer: nn.Module,
    projections,
    attn_output: torch.Tensor,
    residual: torch.Tensor,
    split_k_counters: torch.Tensor | None = None,
    kernel_config: DecodeKernelConfig | None = None,
) -> torch.Tensor:
    """Second half of `Qwen3DecoderLayer.forward`: `(batch, n, heads * head_dim)` attention output and the layer's
    `(batch, n, hidden)` input -> the layer's `(batch, n, hidden)` output. `split_k_counters`, `kernel_config`: as in
    `decoder_stack_forward`."""
    mlp = layer.mlp
    if _takes_kernels(projections, attn_output, split_k_counters):
        return _output_and_mlp_kernels(
            layer, projections, attn_output, residual, split_k_counters, kernel_config=kernel_config
        )[0]
    hidden_states = residual + layer.self_attn.o_proj(attn_output)
    residual = hidden_states
    hidden_states = layer.post_attention_layernorm(hidden_states)
    if projections is None or projections.gate_up_weight is None:
        return residual + mlp(hidden_states)
    gate, up = gate_and_up(mlp, projections, hidden_states)
    return residual + mlp.down_proj(mlp.act_fn(gate) * up)


def _output_and_mlp_kernels(
    layer: nn.Module,
    projections,
    attn_output: torch.Tensor,
    residual: torch.Tensor,
    split_k_counters: torch.Tensor | None,
    with_squares: bool = False,
    kernel_config: DecodeKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attention_output_and_mlp` through the kernels (o_proj with the residual, the norm and gate/up with SiLU,
    down_proj with the residual): the layer's `(batch, n, hidden)` output, and with `with_squares` (several-row
    steps, `_carries_squares`) its `(batch * n, groups)` sums of squares for the next layer's input norm, else None.
    With `with_squares`, o_proj hands the post-attention norm its output's sums of squares too."""
    mlp = layer.mlp
    o_proj, down_proj = layer.self_attn.o_proj, mlp.down_proj
    counters = {"split_k_counters": split_k_counters, "kernel_config": kernel_config}
    squares = None
    hidden_states = decode_linear(
        attn_output, o_proj.weight, o_proj.bias, residual=residual, with_squares=with_squares, **counters
    )
    if with_squares:
        hidden_states, squares = hidden_states
    norm = layer.post_attention_layernorm
    if projections.gate_up_weight is None:  # the layer's own gate and up projections
        gate = mlp.gate_proj
        activated = decode_linear(
            hidden_states, gate.weight, gate.bias, norm, gated=True, up=mlp.up_proj, norm_squares=squares, **counters
        )
    else:
        gate_up = projections.gate_up_weight, projections.gate_up_bias
        activated = decode_linear(hidden_states, *gate_up, norm, gated=True, norm_squares=squares, **counters)
    out = decode_linear(
        activated, down_proj.weight, down_proj.bias, residual=hidden_states, with_squares=with_squares, **counters
    )
    return out if with_squares else (out, None)


def _carries_squares(hidden_states: torch.Tensor, split_k_counters: torch.Tensor | None) -> bool:
    """Whether a kernel step's residual projections hand their outputs' sums of squares to the next norm: where they
    take the several-row kernel, which stores them (every program of the next norm then adds up a few sums instead of
    reading all of its rows)."""
    return split_k_counters is not None and use_rows_kernel(hidden_states)


def _takes_kernels(projections, hidden_states: torch.Tensor, split_k_counters: torch.Tensor | None = None) -> bool:
    """Whether this layer call runs its projections through `triton_linear_funaudiochat`'s kernels: asked for by the
    projections (`decode_kernels`), and a CUDA input of at most `MAX_ROWS` rows (a batch-1 decode step), or, with
    `split_k_counters`, a decode step of 2 to 16 rows (the several-row kernel)."""
    if projections is None or not projections.decode_kernels:
        return False
    return use_decode_kernels(hidden_states) or (split_k_counters is not None and use_rows_kernel(hidden_states))


def _one_position_on_gpu(hidden_states: torch.Tensor) -> bool:
    """Whether a `(batch, n, hidden)` layer input is a decode step on CUDA (one position per row), where the Triton
    attention takes its kernels at any batch size."""
    return hidden_states.shape[1] == 1 and hidden_states.is_cuda


class DecoderLayerHalves(NamedTuple):
    """The two halves of a decoder layer (eager functions, or their compiled versions)."""

    attention_inputs: object
    attention_output_and_mlp: object


# Compiled with `torch.compile(half, dynamic=True)` each, one graph of each half serves every layer of the same shape
# (with dynamo's default `inline_inbuilt_nn_modules`, a layer's parameters are graph inputs) and every prompt length.
EAGER_HALVES = DecoderLayerHalves(attention_inputs, attention_output_and_mlp)


def _decoder_layer(
    layer: nn.Module,
    projections,
    hidden_states: torch.Tensor,
    attention_mask,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    position_ids: torch.Tensor | None,
    cache,
    halves: DecoderLayerHalves,
    split_k_counters: torch.Tensor | None,
    norm_squares: torch.Tensor | None = None,
    kernel_config: DecodeKernelConfig | None = None,
    attention_implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Qwen3DecoderLayer.forward`: `(batch, n, hidden)` -> `(batch, n, hidden)`, and in a several-row kernel step
    the output's sums of squares (else None), which the next layer's input norm takes as `norm_squares`.
    `attention_implementation`: as in `decoder_stack_forward`."""
    attention = layer.self_attn
    cos, sin = position_embeddings
    # What the decoder layer hands the attention as **kwargs (besides the named arguments).
    kwargs = {"position_ids": position_ids, "use_cache": True}
    if kernel_config is not None:  # for the Triton attention function (`triton_decode_attention`)
        kwargs["kernel_config"] = kernel_config
    kernel_step = _takes_kernels(projections, hidden_states, split_k_counters)
    # Only a kernel step reads the counters (a compiled prefill's layer halves then never take them as an input).
    split_k_counters = split_k_counters if kernel_step else None
    with_squares = kernel_step and _carries_squares(hidden_states, split_k_counters)
    decode_step = kernel_step or _one_position_on_gpu(hidden_states)
    static_layer = writable_static_layer(cache, attention.layer_idx) if decode_step else None
    if static_layer is not None:  # a decode step over a static cache on CUDA
        query, key, value = _project_qkv(layer, projections, hidden_states, split_k_counters, norm_squares, kernel_config)
        # With the Triton attention, the q/k norms, rotary and cache write run inside its kernels (at any batch size:
        # at batch 16 that saves two compiled kernels per layer); else, in a kernel step, as one kernel before the
        # attention function.
        attn_output = decode_attention_with_inputs(
            attention, query, key, value, cos, sin, static_layer, attention_mask, split_k_counters, kernel_config,
            attention_implementation,
        )
        if attn_output is not None:
            attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1)
            return _layer_output(
                layer, projections, attn_output, hidden_states, halves, split_k_counters, with_squares, kernel_config
            )
        if kernel_step:
            query_states, key_states, value_states = decode_attention_inputs(
                attention, query, key, value, cos, sin, static_layer, kernel_config
            )
        else:
            query_states, key_states, value_states = _rotated_heads(attention, query, key, value, cos, sin)
    else:
        query_states, key_states, value_states = halves.attention_inputs(layer, projections, hidden_states, cos, sin)
    if cache is not None and not (kernel_step and static_layer is not None):  # else the kernel wrote the cache
        update_kwargs = {"kwargs": kwargs} if _CACHE_UPDATE_GETS_KWARGS else {}
        key_states, value_states = cache.update(key_states, value_states, attention.layer_idx, **update_kwargs)

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        attention_implementation or attention.config._attn_implementation, eager_attention_forward
    )
    attn_output, _ = attention_interface(
        attention,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not attention.training else attention.attention_dropout,
        scaling=attention.scaling,
        sliding_window=attention.sliding_window,
        **kwargs,
    )
    attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return _layer_output(
        layer, projections, attn_output, hidden_states, halves, split_k_counters, with_squares, kernel_config
    )


def _layer_output(
    layer, projections, attn_output, hidden_states, halves, split_k_counters, with_squares, kernel_config
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The second half of `_decoder_layer`: `halves.attention_output_and_mlp`, or with `with_squares` its kernels
    called directly (they also return the output's sums of squares)."""
    if with_squares:
        return _output_and_mlp_kernels(
            layer, projections, attn_output, hidden_states, split_k_counters, True, kernel_config
        )
    output = halves.attention_output_and_mlp(
        layer, projections, attn_output, hidden_states, split_k_counters, kernel_config
    )
    return output, None


def decoder_stack_forward(
    stack: nn.Module,
    projections,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | dict | None,
    position_ids: torch.Tensor,
    cache=None,
    halves: DecoderLayerHalves = EAGER_HALVES,
    final_norm: bool = True,
    split_k_counters: torch.Tensor | None = None,
    *,
    kernel_config: DecodeKernelConfig | None = None,
    attention_implementation: str | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`stack(inputs_embeds=..., attention_mask=..., position_ids=..., use_cache=True, cache).last_hidden_state`.

    Args:
        stack: a transformers `Qwen3Model` (the LLM's `language_model.model`, the CRQ's `crq_transformer`).
        projections: `FusedCRQProjections` of `stack` (concatenated q/k/v and gate/up weights), `OwnWeightKernels`
            (the kernels over the layers' own weights), or None.
        inputs_embeds: `(batch, n, hidden)`.
        attention_mask: `(batch, kv_len)` 2-D padding mask (True / 1 = attend) as `Qwen3Model` takes it, or a
            prepared `{"full_attention": ..., "sliding_attention": ...}` mapping; None = all positions.
        position_ids: `(batch, n)` rotary positions.
        cache: the `Cache` to update in place (`StaticCache` / `DynamicCache`), or None.
        halves: the layer halves to run ([`EAGER_HALVES`], or those functions compiled).
        final_norm: False returns the last layer's output, before the stack's final norm (for a caller that folds
            the norm into its next projection).
        split_k_counters: None, or int32 zeros that let the decode steps of 2 to 16 rows run `projections` with
            `decode_kernels` (fused, or the layers' own) through the several-row kernel of
            `triton_linear_funaudiochat` (its split-K programs count their arrivals there and leave them zero; one
            tensor per run, not shared with a concurrent one; `split_k_counters_for(configs, device, batch_size)`
            sizes it). A kernel step's Triton attention counts its splits there too (the last split of a head
            merges: one per row and KV head, and one more).
        kernel_config: the [`DecodeKernelConfig`] of every kernel launch (tiles, warps, grids, launch kind), part
            of the caller's compiled-graph / CUDA-graph key; None: that of the inputs' device, resolved when each
            kernel runs.
        attention_implementation: the name of a registered transformers attention function (`ALL_ATTENTION_FUNCTIONS`)
            the layers call instead of `config._attn_implementation` (the decode step's one-query attention); the
            masks are still built for the config's implementation, so it must accept `sdpa` / `eager` masks. None:
            the config's.
        position_embeddings: the rotary `(cos, sin)` tables of `position_ids`, each `(batch, n, head_dim)`, computed
            by the caller (a decode step prepares those of its stack calls together); None: computed here.

    Returns:
        `(batch, n, hidden)` final hidden states (after the final norm, unless `final_norm=False`).
    """
    config = stack.config
    causal_mask_mapping = attention_mask
    if not isinstance(causal_mask_mapping, dict):
        # Positional: the cache argument's name differs between transformers releases.
        mask_args = (config, inputs_embeds, attention_mask, cache, position_ids)
        causal_mask_mapping = {"full_attention": create_causal_mask(*mask_args)}
        if stack.has_sliding_layers:
            causal_mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(*mask_args)
    hidden_states = inputs_embeds
    if position_embeddings is None:
        position_embeddings = rotary_tables(stack.rotary_emb, hidden_states, position_ids)
    if cache is not None and _one_position_on_gpu(inputs_embeds):
        # The layers' kernels advance the cache length the masks were computed from: store them first; and the
        # rotary tables, which the compiled step would otherwise recompute for every few layers.
        causal_mask_mapping, position_embeddings = stored_once((causal_mask_mapping, position_embeddings))
    layers = stack.layers[: config.num_hidden_layers]
    if projections is not None and len(projections.layers) != len(layers):
        raise ValueError(f"`projections` has {len(projections.layers)} layers but the stack has {len(layers)}.")
    squares = None  # in several-row kernel steps, each layer's output's sums of squares, for the next input norm
    for index, layer in enumerate(layers):
        hidden_states, squares = _decoder_layer(
            layer,
            None if projections is None else projections.layers[index],
            hidden_states,
            causal_mask_mapping[config.layer_types[index]],
            position_embeddings,
            position_ids,
            cache,
            halves,
            split_k_counters,
            squares,
            kernel_config,
            attention_implementation,
        )
    return stack.norm(hidden_states) if final_norm else hidden_states


__all__ = ["DecoderLayerHalves", "EAGER_HALVES", "decoder_stack_forward", "gate_and_up", "qkv_of_normed"]
