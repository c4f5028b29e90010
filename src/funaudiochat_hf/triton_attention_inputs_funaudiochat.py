"""A decode step's attention inputs as one Triton kernel: q/k norms, rotary embedding and the static cache write.

Between the q/k/v projection of a Qwen3 layer and its attention, a decode step runs `q_norm` and `k_norm`, the rotary
embedding and `StaticLayer.update` (keys and values written at the cache's `cumulative_length`, which then advances):
four small compiled kernels per layer, each a launch gap, for every CRQ layer of every sub-step and every LLM layer.
Here they are one kernel with one program (the work is a few KB), launched as a programmatic dependent launch after
the projection, like the projections and the attention around it.

Rounding follows the eager layer: each norm's output is rounded to the model dtype, then multiplied by its weight; the
rotary's two products and their sum are each rounded (`(q * cos) + (rotate_half(q) * sin)` in the model dtype).
Float32 results equal the eager ones up to the order of the norms' sums.

`generate_speech` takes this path wherever it runs the projections through `triton_linear_funaudiochat` (one-row
decode steps on CUDA) over a static cache with an attention other than the Triton one. With the Triton attention
(plan part `triton_attention`, on by default in the fast backends on CUDA), the same work runs inside the attention's
kernels instead (`decode_attention_with_inputs`; see `triton_attention_funaudiochat`): one kernel fewer per layer, also
in decode steps whose projections stay on cuBLAS.
"""

import torch
from torch import nn
from transformers.cache_utils import StaticLayer

from .triton_attention_funaudiochat import (
    TRITON_DECODE_ATTENTION,
    AttentionInputs,
    AttentionLaunch,
    _flat_bool_mask,
    launch_decode_attention,
)
from .triton_config_funaudiochat import DecodeKernelConfig
from .triton_support import triton


if triton is not None:
    import triton.language as tl

    from .triton_attention_funaudiochat import _norm_and_rotate

    @triton.jit
    def _attention_inputs_kernel(
        q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, length_ptr, out_ptr,
        stride_q, stride_k, stride_v, stride_cos, stride_sin,
        stride_keys_b, stride_keys_h, stride_keys_n, stride_values_b, stride_values_h, stride_values_n,
        BATCH: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, Q_EPS: tl.constexpr, K_EPS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One program. Per row: q `(HEADS * HEAD_DIM,)`, k and v `(KV_HEADS * HEAD_DIM,)`, cos / sin `(HEAD_DIM,)`;
        keys / values `(BATCH, KV_HEADS, max_cache_len, HEAD_DIM)` written at `*length_ptr`, which then advances by
        one; out `(BATCH, HEADS, 1, HEAD_DIM)` contiguous."""
        if PDL:  # q, k and v are the previous kernel's output
            tl.extra.cuda.gdc_wait()
        position = tl.load(length_ptr)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        partner = (d + HEAD_DIM // 2) % HEAD_DIM
        first_half = d < HEAD_DIM // 2
        q_weight = tl.load(q_norm_ptr + d, mask=d_ok, other=0.0)
        q_partner_weight = tl.load(q_norm_ptr + partner, mask=d_ok, other=0.0)
        k_weight = tl.load(k_norm_ptr + d, mask=d_ok, other=0.0)
        k_partner_weight = tl.load(k_norm_ptr + partner, mask=d_ok, other=0.0)
        heads = tl.arange(0, BLOCK_H)
        kv_heads = tl.arange(0, BLOCK_KV)
        kv_mask = (kv_heads < KV_HEADS)[:, None] & d_ok[None, :]
        for b in tl.static_range(BATCH):  # the decode kernels' few rows (`MAX_ROWS`)
            cos = tl.load(cos_ptr + b * stride_cos + d, mask=d_ok, other=0.0)
            sin = tl.load(sin_ptr + b * stride_sin + d, mask=d_ok, other=0.0)
            query = _norm_and_rotate(
                q_ptr + b * stride_q, heads, HEADS, d, d_ok, partner, first_half, q_weight, q_partner_weight, cos,
                sin, HEAD_DIM, Q_EPS,
            )  # fmt: skip
            out_offsets = (b * HEADS + heads[:, None]) * HEAD_DIM + d[None, :]
            tl.store(out_ptr + out_offsets, query, mask=(heads < HEADS)[:, None] & d_ok[None, :])
            key = _norm_and_rotate(
                k_ptr + b * stride_k, kv_heads, KV_HEADS, d, d_ok, partner, first_half, k_weight, k_partner_weight,
                cos, sin, HEAD_DIM, K_EPS,
            )  # fmt: skip
            key_slot = b * stride_keys_b + kv_heads[:, None] * stride_keys_h + position * stride_keys_n + d[None, :]
            tl.store(keys_ptr + key_slot, key, mask=kv_mask)
            value = tl.load(v_ptr + b * stride_v + kv_heads[:, None] * HEAD_DIM + d[None, :], mask=kv_mask)
            value_slot = b * stride_values_b + kv_heads[:, None] * stride_values_h + position * stride_values_n
            tl.store(values_ptr + value_slot + d[None, :], value, mask=kv_mask)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(length_ptr, position + 1)


# An opaque operator, as `funaudiochat::decode_linear` (torch.compile's launches of traced kernels have no PDL).
@torch.library.custom_op("funaudiochat::decode_attention_inputs", mutates_args=("keys", "values", "length"))
def decode_attention_inputs_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: torch.Tensor,
    launch: list[int],
) -> torch.Tensor:
    """The normed, rotated queries and the cache write of one query position per row, as one kernel.

    Args:
        query: `(batch, heads * head_dim)` projected queries; key, value: `(batch, kv_heads * head_dim)`; rows may
            be strided (views of a fused q/k/v output), each row contiguous.
        q_norm_weight, k_norm_weight: `(head_dim,)` weights of the layer's q and k RMSNorms (epsilons `q_eps`,
            `k_eps`).
        cos, sin: `(batch, head_dim)` rotary tables at the rows' positions.
        keys, values: a `StaticLayer`'s `(batch, kv_heads, max_cache_len, head_dim)` caches (last dimension
            contiguous); the new key and value are written at `length`, the layer's 0-d `cumulative_length`, which
            then advances by one (`StaticLayer.update`).
        launch: `[programmatic]` (1: a programmatic dependent launch), or empty: as `DecodeKernelConfig.for_device`.
    Returns:
        `(batch, heads, 1, head_dim)`: the normed, rotated queries.
    """
    batch, kv_heads, _, head_dim = keys.shape
    heads = query.shape[-1] // head_dim
    query, key, value, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, cos, sin))
    out = torch.empty(batch, heads, 1, head_dim, dtype=query.dtype, device=query.device)
    programmatic = launch[0] if launch else DecodeKernelConfig.for_device(query.device).programmatic_launch
    pdl = bool(programmatic)
    _attention_inputs_kernel[(1,)](
        query, key, value, q_norm_weight, k_norm_weight, cos, sin, keys, values, length, out,
        query.stride(0), key.stride(0), value.stride(0), cos.stride(0), sin.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        BATCH=batch, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KV=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), Q_EPS=float(q_eps),
        K_EPS=float(k_eps), PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out


@decode_attention_inputs_op.register_fake
def _(query, key, value, q_norm_weight, k_norm_weight, q_eps, k_eps, cos, sin, keys, values, length, launch):
    batch, _, _, head_dim = keys.shape
    return query.new_empty(batch, query.shape[-1] // head_dim, 1, head_dim)


# The attention itself with the same work folded into its kernels (no kernel of its own): see
# `triton_attention_funaudiochat.AttentionInputs`.
@torch.library.custom_op("funaudiochat::decode_attention_with_inputs", mutates_args=("keys", "values", "length"))
def decode_attention_with_inputs_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    counters: torch.Tensor | None,
    launch: list[int],
) -> torch.Tensor:
    """`decode_attention_inputs_op` then `funaudiochat::decode_attention` in two kernels instead of three (one with
    `counters`, see `launch_decode_attention`): arguments as theirs (`mask`: None or boolean `(batch or 1,
    max_cache_len)`; `launch`: an [`AttentionLaunch`] as ints, or empty); returns `(batch, 1, heads, head_dim)`."""
    query, key, value, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, cos, sin))
    inputs = AttentionInputs(key, value, q_norm_weight, k_norm_weight, q_eps, k_eps, cos, sin, length)
    config = AttentionLaunch.from_ints(launch, query.device, query.shape[0])
    return launch_decode_attention(query, keys, values, mask, scaling, inputs, counters, config)


@decode_attention_with_inputs_op.register_fake
def _(
    query, key, value, q_norm_weight, k_norm_weight, q_eps, k_eps, cos, sin, keys, values, length, mask, scaling,
    counters, launch,
):  # fmt: skip
    head_dim = keys.shape[-1]
    return query.new_empty(keys.shape[0], 1, query.shape[-1] // head_dim, head_dim)


# What every layer of a decode step reads, computed once before its layers run: the attention masks and the rotary
# tables. A static cache's mask is computed from the cache's `cumulative_length`, which these operators advance (their
# `length`): compiled, Inductor may recompute a mask that was not stored in a buffer at each later use, after a layer
# advanced the length, and the layers after the first then see one position too many (a two-row decode step off by
# up to 0.09). The rotary tables are right either way, but Inductor recomputes them (from the float32 angles) every
# few layers. An opaque operator that is declared to write its tensor (and does nothing, `store`) makes Inductor
# store each once: later uses read the written buffer, which it cannot recompute (a CPU test reproduces the
# recomputation without it), and no copy kernel runs.
@torch.library.custom_op("funaudiochat::store", mutates_args=("tensor",))
def store(tensor: torch.Tensor) -> None:
    """Nothing; declared to write `tensor`, so torch.compile stores it in a buffer before this point and reads that
    buffer afterwards, never recomputing it from its inputs."""


@store.register_fake
def _(tensor):
    return None


def stored_once(value):
    """`value` (a tensor, None, a `{layer type: mask}` mapping or a tuple such as `(cos, sin)`) with every tensor
    stored once for a compiled graph (`store`)."""
    if isinstance(value, dict):
        return {name: stored_once(item) for name, item in value.items()}
    if isinstance(value, tuple):
        return tuple(stored_once(item) for item in value)
    if not isinstance(value, torch.Tensor):
        return value
    torch.ops.funaudiochat.store(value)
    return value


def writable_static_layer(cache, layer_idx: int):
    """The `StaticLayer` of `cache` for layer `layer_idx` when the kernel can update it (allocated: `StaticLayer`
    allocates contiguous keys and values), else None (dynamic and sliding-window layers update themselves)."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    return layer if type(layer) is StaticLayer and layer.is_initialized else None


def decode_attention_inputs(
    attention: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_layer,
    kernel_config: DecodeKernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `Qwen3Attention` computes from its projections up to the attention call, for one position per row.

    Args:
        attention: the `Qwen3Attention` module (its `q_norm` and `k_norm`).
        query: `(batch, 1, heads * head_dim)` projected queries; key, value: `(batch, 1, kv_heads * head_dim)`.
        cos, sin: `(batch, 1, head_dim)` rotary tables.
        cache_layer: the layer's `StaticLayer` ([`writable_static_layer`]), updated in place.
        kernel_config: the kernels' [`DecodeKernelConfig`]; None: that of the query's device.
    Returns:
        query `(batch, heads, 1, head_dim)`, and the cache layer's keys and values `(batch, kv_heads, max_cache_len,
        head_dim)`, as `cache.update` returns them.
    """
    arguments = _operator_arguments(attention, query, key, value, cos, sin, cache_layer)
    launch = [] if kernel_config is None else [int(kernel_config.programmatic_launch)]
    query_states = torch.ops.funaudiochat.decode_attention_inputs(*arguments, launch)
    return query_states, cache_layer.keys, cache_layer.values


def _operator_arguments(attention, query, key, value, cos, sin, cache_layer) -> tuple:
    """The operators' first twelve arguments: one row per batch row, the norms, the rotary tables, the cache."""
    batch = query.shape[0]
    return (
        query.reshape(batch, -1),
        key.reshape(batch, -1),
        value.reshape(batch, -1),
        attention.q_norm.weight,
        attention.k_norm.weight,
        float(attention.q_norm.variance_epsilon),
        float(attention.k_norm.variance_epsilon),
        cos.reshape(batch, -1),
        sin.reshape(batch, -1),
        cache_layer.keys,
        cache_layer.values,
        cache_layer.cumulative_length,
    )


def decode_attention_with_inputs(
    attention: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_layer,
    attention_mask: torch.Tensor | None,
    counters: torch.Tensor | None = None,
    kernel_config: DecodeKernelConfig | None = None,
    attention_implementation: str | None = None,
) -> torch.Tensor | None:
    """`decode_attention_inputs` and the attention call after it, for a layer whose attention function is the Triton
    one (`attention_implementation`, else the config's, is `TRITON_DECODE_ATTENTION`), as two kernels (one given `counters`); None where that function would not
    take its kernels (then call `decode_attention_inputs` and the attention function).

    Args as [`decode_attention_inputs`], and attention_mask: the layer's `(batch or 1, 1, 1, max_cache_len)`
    boolean mask, or None; counters: None, or the decode step's int32 arrival counters (see
    `triton_attention_funaudiochat.launch_decode_attention`); kernel_config: the kernels' [`DecodeKernelConfig`]
    (None: the device's). Returns the attention output `(batch, 1, heads,
    head_dim)`.
    """
    supported, mask = _flat_bool_mask(attention_mask, query.shape[0], cache_layer.keys.shape[2])
    usable = (
        (attention_implementation or attention.config._attn_implementation) == TRITON_DECODE_ATTENTION
        and supported
        and not attention.training
        and attention.config.num_attention_heads % attention.config.num_key_value_heads == 0
    )
    if not usable:
        return None
    arguments = _operator_arguments(attention, query, key, value, cos, sin, cache_layer)
    launch = [] if kernel_config is None else list(AttentionLaunch.of(kernel_config, int(query.shape[0])))
    operator = torch.ops.funaudiochat.decode_attention_with_inputs
    return operator(*arguments, mask, float(attention.scaling), counters, launch)


__all__ = [
    "decode_attention_inputs",
    "decode_attention_inputs_op",
    "decode_attention_with_inputs",
    "decode_attention_with_inputs_op",
    "stored_once",
    "writable_static_layer",
]
