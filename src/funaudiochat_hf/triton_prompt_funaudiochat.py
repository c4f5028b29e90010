"""The prompt pass's element-wise work as four Triton kernels per decoder layer.

Over a prompt, an eager Qwen3 decoder layer launches ~45 small PyTorch kernels besides its GEMMs and its attention:
each RMSNorm 7-8 (its float32 cast, square, mean, eps, rsqrt, product, cast back, weight), the q and k norms and the
rotary embedding ~25, the SiLU and its product 2, the residual adds. Recorded in the prompt's CUDA graph
(`DecodePlan.prefill_graph`) they cost the host nothing, but each is a round trip through memory and a kernel's fixed
cost on the GPU: ~2,900 kernels for the two stacks of a speech prompt (36 LLM layers over the prompt, 28 CRQ layers
over five times as many positions), ~30 % of the prompt pass's GPU time (H100). Here a layer's element-wise work is:

- `rms_norm_rows`: the input norm, one kernel;
- `normed_rotated_query_and_key`: the q and k norms and the rotary embedding of every position, one kernel;
- `add_rms_norm_rows`: o_proj's residual add and the post-attention norm, one kernel (it returns both);
- `silu_mul`: the MLP's activation and its product with the up projection, one kernel;

the last residual add stays one PyTorch add. `PROMPT_KERNEL_HALVES` are the layer halves of `decoder_stack_funaudiochat`
built on them (the plan part `prompt_kernels` of the "cuda_graphs" backend); off CUDA or without Triton they run the
eager halves.

Rounding follows the eager layer, as the decode kernels do: a norm's float32 result is rounded to the input's dtype,
then multiplied by its weight (in float32, rounded once, as PyTorch multiplies two bfloat16 tensors); a residual sum is
rounded before its norm reads it; SiLU's output is rounded before the product. Float32 results equal the eager ones up
to the order of the norms' sums; in bfloat16 on a GPU the norms and MLP output do too, while the rotated queries and
keys are one unit apart in ~13-17 % of their entries (`_normed_and_rotated`, shared with the decode kernels).
"""

import torch
from torch import nn

from .decoder_stack_funaudiochat import EAGER_HALVES, DecoderLayerHalves, gate_and_up, qkv_of_normed
from .triton_linear_funaudiochat import kernel_readable
from .triton_support import kernels_run_on, triton


if triton is not None:
    import triton.language as tl

    from .triton_attention_funaudiochat import _norm_and_rotate

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, sum_ptr, out_ptr, stride_x, stride_residual, stride_sum, stride_out,
        WIDTH: tl.constexpr, BLOCK: tl.constexpr, EPS: tl.constexpr, ADD: tl.constexpr,
    ):  # fmt: skip
        """One program per row: `out = norm(x)` (`ADD`: `sum = residual + x` stored, then `out = norm(sum)`), each row
        `(WIDTH,)` contiguous; `weight` `(WIDTH,)`."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < WIDTH
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        dtype = x.dtype
        if ADD:
            residual = tl.load(residual_ptr + row * stride_residual + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
            tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
        x = x.to(tl.float32)
        inverse_rms = tl.rsqrt(tl.sum(x * x, axis=0) / WIDTH + EPS)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        out = (x * inverse_rms).to(dtype).to(tl.float32) * weight
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotated_kernel(
        q_ptr, k_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, query_ptr, key_ptr, n,
        stride_qb, stride_qn, stride_kb, stride_kn, stride_cb, stride_cn, stride_sb, stride_sn,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, Q_EPS: tl.constexpr, K_EPS: tl.constexpr,
    ):  # fmt: skip
        """One program per position `(b, i)`: its q `(HEADS * HEAD_DIM,)` and k `(KV_HEADS * HEAD_DIM,)` projections
        (each row contiguous), cos / sin `(HEAD_DIM,)` -> query `(batch, HEADS, n, HEAD_DIM)` and key
        `(batch, KV_HEADS, n, HEAD_DIM)`, both contiguous."""
        position = tl.program_id(0)
        b = (position // n).to(tl.int64)
        i = (position % n).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        partner = (d + HEAD_DIM // 2) % HEAD_DIM
        first_half = d < HEAD_DIM // 2
        cos = tl.load(cos_ptr + b * stride_cb + i * stride_cn + d, mask=d_ok, other=0.0)
        sin = tl.load(sin_ptr + b * stride_sb + i * stride_sn + d, mask=d_ok, other=0.0)
        _store_rotated_heads(
            q_ptr + b * stride_qb + i * stride_qn, q_norm_ptr, query_ptr, b, i, n, cos, sin, d, d_ok, partner,
            first_half, HEADS, BLOCK_H, HEAD_DIM, Q_EPS,
        )  # fmt: skip
        _store_rotated_heads(
            k_ptr + b * stride_kb + i * stride_kn, k_norm_ptr, key_ptr, b, i, n, cos, sin, d, d_ok, partner,
            first_half, KV_HEADS, BLOCK_KV, HEAD_DIM, K_EPS,
        )  # fmt: skip

    @triton.jit
    def _store_rotated_heads(
        row_ptr, norm_ptr, out_ptr, b, i, n, cos, sin, d, d_ok, partner, first_half, NUM_HEADS: tl.constexpr,
        BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, EPS: tl.constexpr,
    ):  # fmt: skip
        """The normed, rotated heads of one position's projections (`row_ptr`) stored at position `i` of row `b` of
        out `(batch, NUM_HEADS, n, HEAD_DIM)`."""
        heads = tl.arange(0, BLOCK_H)
        weight = tl.load(norm_ptr + d, mask=d_ok, other=0.0)
        partner_weight = tl.load(norm_ptr + partner, mask=d_ok, other=0.0)
        rotated = _norm_and_rotate(
            row_ptr, heads, NUM_HEADS, d, d_ok, partner, first_half, weight, partner_weight, cos, sin, HEAD_DIM, EPS
        )
        offsets = ((b * NUM_HEADS + heads[:, None]) * n + i) * HEAD_DIM + d[None, :]
        tl.store(out_ptr + offsets, rotated, mask=(heads < NUM_HEADS)[:, None] & d_ok[None, :])

    @triton.jit
    def _silu_mul_kernel(
        gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program `(row, block)`: `silu(gate) * up` over a block of a row, each row `(WIDTH,)` contiguous; out
        `(rows, WIDTH)` contiguous."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < WIDTH
        gate = tl.load(gate_ptr + row * stride_gate + cols, mask=ok, other=0.0)
        up = tl.load(up_ptr + row * stride_up + cols, mask=ok, other=0.0)
        dtype = gate.dtype
        gate = gate.to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = (activated.to(tl.float32) * up.to(tl.float32)).to(dtype)
        tl.store(out_ptr + row * WIDTH + cols, out, mask=ok)


SILU_BLOCK = 1024  # features per `_silu_mul_kernel` program


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` `(..., width)` as `(rows, width)` with contiguous rows (a view where the layout allows, else a copy)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm_launch(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
    """Run `_rms_norm_kernel` of the RMSNorm module `norm`; returns `(sum or None, out)`, shaped as `x`."""
    x_rows = _rows(x)
    width = x_rows.shape[1]
    weight = norm.weight
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out_rows = out.view(-1, width)
    if residual is None:
        residual_rows, sum_rows, total = x_rows, x_rows, None
    else:
        residual_rows = _rows(residual)
        total = torch.empty_like(x, memory_format=torch.contiguous_format)
        sum_rows = total.view(-1, width)
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows, residual_rows, weight, sum_rows, out_rows, x_rows.stride(0), residual_rows.stride(0),
        sum_rows.stride(0), out_rows.stride(0), WIDTH=width, BLOCK=block, EPS=norm.variance_epsilon,
        ADD=residual is not None, num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return total, out


def rms_norm_rows(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` of a Qwen3 RMSNorm module (`weight`, `variance_epsilon`) over `x` `(..., width)`, one kernel."""
    return _norm_launch(norm, x, None)[1]


def add_rms_norm_rows(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(residual + x, norm(residual + x))` over `(..., width)` tensors, one kernel."""
    return _norm_launch(norm, x, residual)


def normed_rotated_query_and_key(
    attention: nn.Module, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Qwen3Attention`'s q/k norms and rotary embedding over a prompt, one kernel.

    Args:
        attention: a `Qwen3Attention` (its `q_norm`, `k_norm`, `head_dim`).
        query: `(batch, n, heads * head_dim)` projections; key `(batch, n, kv_heads * head_dim)`; each position's
            features contiguous (views of a fused q/k/v output are fine).
        cos, sin: `(batch, n, head_dim)` rotary tables.
    Returns:
        query `(batch, heads, n, head_dim)` and key `(batch, kv_heads, n, head_dim)`, contiguous.
    """
    batch, n, _ = query.shape
    head_dim = attention.head_dim
    heads, kv_heads = query.shape[-1] // head_dim, key.shape[-1] // head_dim
    for name, tensor in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"`{name}` must have contiguous features, got strides {tensor.stride()}.")
    query_out = torch.empty(batch, heads, n, head_dim, dtype=query.dtype, device=query.device)
    key_out = torch.empty(batch, kv_heads, n, head_dim, dtype=key.dtype, device=key.device)
    cos, sin = cos.expand(batch, n, head_dim), sin.expand(batch, n, head_dim)
    _rotated_kernel[(batch * n,)](
        query, key, attention.q_norm.weight, attention.k_norm.weight, cos, sin, query_out, key_out, n,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0), cos.stride(1), sin.stride(0),
        sin.stride(1), HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KV=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        Q_EPS=attention.q_norm.variance_epsilon, K_EPS=attention.k_norm.variance_epsilon, num_warps=4,
    )  # fmt: skip
    return query_out, key_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` over `(..., width)` tensors (rows may be strided, e.g. the halves of a fused gate/up
    output), one kernel; returns a contiguous tensor shaped as `gate`."""
    gate_rows, up_rows = _rows(gate), _rows(up)
    width = gate_rows.shape[1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(width))
    _silu_mul_kernel[(gate_rows.shape[0], triton.cdiv(width, block))](
        gate_rows, up_rows, out, gate_rows.stride(0), up_rows.stride(0), WIDTH=width, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


def prompt_kernels_supported(stack: nn.Module) -> bool:
    """Whether the layers of a Qwen3 stack can run their prompt pass on the kernels: a SiLU MLP (its gate and up
    projections called as they are) and RMSNorms with a weight and `variance_epsilon` (also the q / k norms)."""
    if getattr(stack.config, "hidden_act", None) != "silu":
        return False
    for layer in stack.layers[: stack.config.num_hidden_layers]:
        attention = layer.self_attn
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm)
        if not kernel_readable((), norms):
            return False
    return True


def prompt_kernels_take(hidden_states: torch.Tensor) -> bool:
    """Whether a `(batch, n, features)` layer input runs the kernels: a tensor the Triton kernels may take (Triton, a
    capable CUDA GPU) of more than one position per row (one position is a decode step's shape, whose own kernels the
    eager halves dispatch to)."""
    return hidden_states.shape[-2] > 1 and kernels_run_on(hidden_states)


def attention_inputs(
    layer: nn.Module, projections, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decoder_stack_funaudiochat.attention_inputs` with the input norm and the q/k norms and rotary as two kernels:
    `(batch, n, hidden)` -> query `(batch, heads, n, head_dim)`, key and value `(batch, kv_heads, n, head_dim)`."""
    if not prompt_kernels_take(hidden_states):
        return EAGER_HALVES.attention_inputs(layer, projections, hidden_states, cos, sin)
    attention = layer.self_attn
    query, key, value = qkv_of_normed(attention, projections, rms_norm_rows(layer.input_layernorm, hidden_states))
    query, key = normed_rotated_query_and_key(attention, query, key, cos, sin)
    value = value.view(*value.shape[:-1], -1, attention.head_dim).transpose(1, 2)
    return query, key, value


def attention_output_and_mlp(
    layer: nn.Module,
    projections,
    attn_output: torch.Tensor,
    residual: torch.Tensor,
    split_k_counters: torch.Tensor | None = None,
    kernel_config=None,
) -> torch.Tensor:
    """`decoder_stack_funaudiochat.attention_output_and_mlp` with o_proj's residual add and the post-attention norm
    as one kernel and the SiLU product as one: `(batch, n, heads * head_dim)`, `(batch, n, hidden)` ->
    `(batch, n, hidden)`. `split_k_counters`, `kernel_config`: for the eager half it falls back to."""
    if not prompt_kernels_take(attn_output):
        return EAGER_HALVES.attention_output_and_mlp(
            layer, projections, attn_output, residual, split_k_counters, kernel_config
        )
    hidden_states, normed = add_rms_norm_rows(
        layer.post_attention_layernorm, layer.self_attn.o_proj(attn_output), residual
    )
    gate, up = gate_and_up(layer.mlp, projections, normed)
    return hidden_states + layer.mlp.down_proj(silu_mul(gate, up))


# The prompt pass's layer halves on the kernels (the plan part `prompt_kernels`).
PROMPT_KERNEL_HALVES = DecoderLayerHalves(attention_inputs, attention_output_and_mlp)


__all__ = [
    "PROMPT_KERNEL_HALVES",
    "add_rms_norm_rows",
    "normed_rotated_query_and_key",
    "prompt_kernels_supported",
    "rms_norm_rows",
    "silu_mul",
]
