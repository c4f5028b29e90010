"""The CosyVoice3 DiT's self-attention after its q/k/v projections: head-0 rotary, key mask, softmax attention.

Two implementations of the same arithmetic:

- `apply_partial_rotary` + `F.scaled_dot_product_attention`: every device and dtype, with autograd;
- `funaudiochat::dit_attention`, one Triton kernel (CUDA, 16-bit inputs, inference). In the compiled estimator the
  attention is otherwise three kernels per block and Euler step (the rotary fused with its cast and the head
  transpose, a memset, cuDNN's attention), 220 calls per flow call at full size, bound by launch latency at a
  streamed chunk's shapes (2 CFG rows x 16 heads x ~136 frames). The kernel reads q, k and v where the projection
  wrote them (`(batch, frames, heads * head_dim)`, strided views of the fused projection), rotates head 0 as it loads
  it, adds the additive key mask and writes the output in the layout the output projection reads.

`dit_attention` picks the kernel where it applies (CUDA, bfloat16 / float16, no gradient).
Rounding follows the torch path under autocast: the rotary in float32 from the 16-bit projections, rounded once to the
input dtype; scores and softmax in float32; the probabilities rounded to the value dtype for the second product (as
SDPA's flash kernels do).
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .triton_support import kernels_run_on, triton
from .triton_config_funaudiochat import supports_programmatic_launch


# The kernel for windows up to this many frames: the longest measured against the torch path (partial rotary +
# SDPA), where it still took 0.58 of its time (0.26 at a streamed chunk's default window of 436 frames, 0.37 at the
# 606 of a grown hop of 100; `scripts/bench_dit_attention.py`); the gap closes as windows grow. Longer windows
# (offline calls) go to cuDNN's attention.
KERNEL_MAX_FRAMES = 1206
# Tiles and launch options, `(BLOCK_M query frames per program, BLOCK_N key frames per inner step, warps, stages)`,
# from `scripts/bench_dit_attention.py --sweep` (H100, CUDA-graph replays of the kernel alone, side by side).
# `TILES`: no tile set is faster for one stream's 2 CFG rows at a streamed chunk's windows (136, 436 frames).
# `MANY_ROWS_TILES`, on a Hopper, for a flow call of `MANY_ROWS` rows or more (a serving round of 2 streams or more),
# in us against `TILES` at the steady window (436 frames) and the grown hop's (606): 4 rows 23.9 / 25.7 and 39.1 /
# 41.7, 8 rows 37.6 / 44.7, 16 rows 76.2 / 91.1 and 126 / 170, 32 rows 146 / 177 and 241 / 330 (measured on a Hopper
# only: other GPUs keep `TILES`).
TILES = (64, 64, 4, 2)
MANY_ROWS = 4
MANY_ROWS_TILES = (128, 64, 4, 2)


def dit_attention_tiles(rows: int, hopper: bool) -> tuple[int, int, int, int]:
    """`(BLOCK_M, BLOCK_N, num_warps, num_stages)` of the kernel for a call of `rows` (the CFG rows of all its
    streams); `hopper`: a GPU of compute capability 9.x."""
    return MANY_ROWS_TILES if hopper and rows >= MANY_ROWS else TILES


def _rotate_pairs(hidden: torch.Tensor) -> torch.Tensor:
    """GPT-J style: (a, b) pairs -> (-b, a)."""
    pairs = hidden.unflatten(-1, (-1, 2))
    first, second = pairs.unbind(-1)
    return torch.stack((-second, first), dim=-1).flatten(-2)


def apply_partial_rotary(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of the UN-split projection (batch, frames, heads*dim_head).

    As in x-transformers (which the reference DiT uses), the table is applied before the head split, so only head 0
    gets rotary positions; the other heads pass unchanged.
    """
    rot_dim = cos.shape[-1]
    rotated, passthrough = hidden[..., :rot_dim], hidden[..., rot_dim:]
    rotated = rotated * cos + _rotate_pairs(rotated) * sin
    # The table may be float32 under 16-bit projections: round back, as x-transformers does (`out.type(orig_dtype)`).
    return torch.cat((rotated.to(hidden.dtype), passthrough), dim=-1)


def sdpa_dit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The torch path of [`dit_attention`] (same arguments and result)."""
    batch, frames, _ = query.shape
    query = apply_partial_rotary(query, cos, sin)
    key = apply_partial_rotary(key, cos, sin)
    query, key, value = (tensor.view(batch, frames, heads, -1).transpose(1, 2) for tensor in (query, key, value))
    attended = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
    return attended.transpose(1, 2).reshape(batch, frames, -1)


def dit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Softmax attention of the DiT's projections, with the rotary table applied to head 0 of queries and keys.

    Args:
        query, key, value: `(batch, frames, heads * head_dim)` projections (views of a fused projection are fine).
        cos, sin: `(frames, rot_dim)` rotary tables (x-transformers pairs layout), rot_dim = head_dim.
        heads: number of heads.
        attention_mask: None (every key visible), or `(batch, 1, frames, frames)` boolean (True = may attend) or
            additive; `(batch, 1, 1, frames)` for a key-padding mask (the same keys hidden from every query).
    Returns:
        `(batch, frames, heads * head_dim)`, in the projections' dtype.
    """
    if _kernel_applies(query, key, value, cos, heads, attention_mask):
        return torch.ops.funaudiochat.dit_attention(query, key, value, cos, sin, attention_mask, heads)
    return sdpa_dit_attention(query, key, value, cos, sin, heads, attention_mask)


def _kernel_applies(query, key, value, cos, heads, attention_mask) -> bool:
    """Whether `dit_attention` runs the Triton kernel: its dtypes on a GPU that has them, no gradient to keep, the
    rotary table one head wide, a mask (if any) additive and shared by the heads. Shapes and flags only (no values),
    so torch.compile decides it while tracing."""
    if not kernels_run_on(query):
        return False
    if query.dtype not in (torch.bfloat16, torch.float16) or not (query.dtype == key.dtype == value.dtype):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return False
    if query.shape[1] > KERNEL_MAX_FRAMES or query.shape[-1] % heads or cos.shape[-1] != query.shape[-1] // heads:
        return False
    return attention_mask is None or (
        attention_mask.dtype != torch.bool and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    )


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _load_rotated(
        rows_ptr, positions, positions_ok, d, d_ok, cos_ptr, sin_ptr, stride_cos, stride_sin, ROTATE,
        BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """`(BLOCK, BLOCK_D)` tile of one head (`rows_ptr`: each position's first element of the head), rotated when
        `ROTATE` (head 0) as `apply_partial_rotary`: `x * cos + rotate_pairs(x) * sin` in float32, then rounded to
        the input dtype."""
        mask = positions_ok[:, None] & d_ok[None, :]
        tile = tl.load(rows_ptr + d[None, :], mask=mask, other=0.0)
        if ROTATE:
            cos = tl.load(cos_ptr + positions[:, None] * stride_cos + d[None, :], mask=mask, other=0.0)
            sin = tl.load(sin_ptr + positions[:, None] * stride_sin + d[None, :], mask=mask, other=0.0)
            first, second = tl.split(tl.reshape(tile.to(tl.float32), (BLOCK, BLOCK_D // 2, 2)))
            partner = tl.reshape(tl.join(-second, first), (BLOCK, BLOCK_D))  # (a, b) -> (-b, a)
            tile = (tile.to(tl.float32) * cos + partner * sin).to(tile.dtype)
        return tile

    @triton.jit
    def _dit_attention_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, mask_ptr, out_ptr,
        frames, scale,
        stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt, stride_cos, stride_sin,
        stride_mb, stride_mq, stride_mk, stride_ob, stride_ot,
        HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, KEY_MASK: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid `(cdiv(frames, BLOCK_M), batch * HEADS)`: BLOCK_M query frames of one head attend to all frames with an
        online softmax over blocks of BLOCK_N keys. q / k / v / out rows: `(batch, frames, HEADS * HEAD_DIM)` with
        the given batch and frame strides, the last dimension contiguous; mask: additive `(batch, frames, frames)`
        (strides given; 0 for a broadcast dimension; KEY_MASK: the query stride is 0, one row is read, each key
        block's part during the previous block: loaded in the block that adds it, its latency stalled every block)."""
        if PDL:  # a programmatic dependent launch: q, k and v are the previous kernel's output
            tl.extra.cuda.gdc_wait()
        batch_head = tl.program_id(1)
        b = batch_head // HEADS
        h = batch_head % HEADS
        rotate = h == 0  # head 0 only (x-transformers rotates before the head split)
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < frames
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        head = h * HEAD_DIM
        q = _load_rotated(
            q_ptr + b * stride_qb + m[:, None] * stride_qt + head, m, m_ok, d, d_ok, cos_ptr, sin_ptr, stride_cos,
            stride_sin, rotate, BLOCK_M, BLOCK_D,
        )  # fmt: skip
        row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        key_mask_row = mask_ptr + b * stride_mb
        if HAS_MASK and KEY_MASK:  # one block ahead: the bias load's latency hides behind a block's dots
            n = tl.arange(0, BLOCK_N)
            next_bias = tl.load(key_mask_row + n * stride_mk, mask=n < frames, other=0.0)
        for start in range(0, frames, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < frames
            if HAS_MASK and KEY_MASK:
                bias = next_bias
                after = n + BLOCK_N
                next_bias = tl.load(key_mask_row + after * stride_mk, mask=after < frames, other=0.0)
            k = _load_rotated(
                k_ptr + b * stride_kb + n[:, None] * stride_kt + head, n, n_ok, d, d_ok, cos_ptr, sin_ptr,
                stride_cos, stride_sin, rotate, BLOCK_N, BLOCK_D,
            )  # fmt: skip
            v = tl.load(
                v_ptr + b * stride_vb + n[:, None] * stride_vt + head + d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0,
            )  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if HAS_MASK and KEY_MASK:  # one row for every query: a key-padding mask
                scores += bias.to(tl.float32)[None, :]
            elif HAS_MASK:
                bias = tl.load(
                    mask_ptr + b * stride_mb + m[:, None] * stride_mq + n[None, :] * stride_mk,
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0,
                )  # fmt: skip
                scores += bias.to(tl.float32)
            scores = tl.where(n_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            # exp(x) as exp2(x * log2(e)); a masked score (the dtype's minimum) underflows to 0
            correction = tl.exp2((row_max - new_max) * 1.4426950408889634)
            probabilities = tl.exp2((scores - new_max[:, None]) * 1.4426950408889634)
            row_sum = row_sum * correction + tl.sum(probabilities, axis=1)
            acc = acc * correction[:, None] + tl.dot(probabilities.to(v.dtype), v, input_precision=PRECISION)
            row_max = new_max
        out = acc / row_sum[:, None]
        out_ptrs = out_ptr + b * stride_ob + m[:, None] * stride_ot + head + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# An opaque operator (torch.compile keeps it in its graph, CUDA graphs replay it; its host code depends on shapes only).
@torch.library.custom_op("funaudiochat::dit_attention", mutates_args=())
def dit_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    heads: int,
) -> torch.Tensor:
    """[`dit_attention`] as one Triton kernel; `attention_mask`: None or additive `(batch or 1, 1, frames or 1,
    frames)` (one row: a key-padding mask, read once per key block).
    Any dtype the kernel's `tl.dot` takes (float32 is computed in full precision, for tests)."""
    return launch_dit_attention(query, key, value, cos, sin, attention_mask, heads)


def launch_dit_attention(
    query, key, value, cos, sin, attention_mask, heads, tiles: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """The operator's launcher. `tiles`: `(BLOCK_M, BLOCK_N, num_warps, num_stages)` (for benchmarks; default
    `dit_attention_tiles` of the shape and GPU)."""
    batch, frames, width = query.shape
    if tiles is None:
        tiles = dit_attention_tiles(batch, query.is_cuda and is_hopper_gpu(query.device.index))
    block_m, block_n, num_warps, num_stages = tiles
    head_dim = width // heads
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    cos, sin = (t.contiguous() for t in (cos, sin))
    out = query.new_empty(batch, frames, width)
    if attention_mask is None:
        mask, mask_strides = out, (0, 0, 0)  # not read
    else:
        mask = attention_mask.expand(batch, 1, frames, frames)
        mask_strides = (mask.stride(0), mask.stride(2), mask.stride(3))
    pdl = supports_programmatic_launch(query.device)
    grid = (triton.cdiv(frames, block_m), batch * heads)
    _dit_attention_kernel[grid](
        query, key, value, cos, sin, mask, out, frames, head_dim**-0.5,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos.stride(0), sin.stride(0), *mask_strides, out.stride(0), out.stride(1),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m,
        BLOCK_N=block_n, HAS_MASK=attention_mask is not None, KEY_MASK=mask_strides[1] == 0,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", PDL=pdl, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out


@functools.cache
def is_hopper_gpu(device_index: int) -> bool:
    """Whether CUDA device `device_index` is a Hopper (capability 9.x): `dit_attention_tiles`'s `hopper`."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


@dit_attention_op.register_fake
def _(query, key, value, cos, sin, attention_mask, heads):
    return query.new_empty(query.shape)


__all__ = [
    "apply_partial_rotary",
    "dit_attention",
    "dit_attention_op",
    "dit_attention_tiles",
    "is_hopper_gpu",
    "launch_dit_attention",
    "sdpa_dit_attention",
]
