"""HiFT's Snake activation, `x + sin(alpha * x)^2 / alpha` with a per-channel alpha, optionally written with the
left (causal) zero padding of the conv that reads it.

Two implementations of `F.pad(snake(hidden), (left_padding, 0))`:

- `snake_reference` (+ `F.pad`): every device, dtype and autograd; the reference's expression and evaluation order;
- `funaudiochat::snake`, one Triton kernel (CUDA, inference). Eagerly the expression is eight element-wise kernels
  (`1.0 / t` is a reciprocal and a multiply) and the conv's padding two more (a fill and a copy), for each of the 72
  Snakes of a full-size HiFT call; the kernel reads the input once and writes the padded output, zeros included.

`snake` picks the kernel where it applies (`_kernel_applies`: a CUDA tensor, float32 / bfloat16 / float16 like its
alpha, no gradient to keep, not while torch.compile traces: compiled (`compile_vocoder`), Inductor fuses the
expression together with the sums and layout switches around it, which an opaque operator would prevent).
Arithmetic: each element in float32 from the input and alpha as stored, the reference's expression, rounded once to
the input dtype. In float32 that is the torch path's arithmetic (a few ulp apart: `sin` and a fused multiply-add);
16-bit inputs are more accurate than the torch path, which rounds after each of its element-wise ops.
"""

import torch
import torch.nn.functional as F

from .triton_attention_funaudiochat import triton


# Tiles of the kernel: (channels, frames) per program, frames-major inputs, then channels-major (channels-last) ones:
# the contiguous dimension gets the long side, so that each warp reads whole 128-byte lines.
FRAMES_MAJOR_TILE = (8, 256)
CHANNELS_MAJOR_TILE = (64, 32)
NUM_WARPS = 4


def snake_reference(hidden: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The torch expression: hidden (batch, channels, frames) or (batch, channels, 1, frames), alpha (channels,)."""
    alpha = alpha.reshape((-1,) + (1,) * (hidden.dim() - 2))
    # Same expression and evaluation order as the reference (the 1e-9 guards alpha == 0).
    return hidden + (1.0 / (alpha + 1e-9)) * torch.pow(torch.sin(hidden * alpha), 2)


def snake(hidden: torch.Tensor, alpha: torch.Tensor, left_padding: int = 0) -> torch.Tensor:
    """Snake of `hidden` with `left_padding` zero frames before it.

    Args:
        hidden: `(batch, channels, frames)` or `(batch, channels, 1, frames)`, any strides.
        alpha: `(channels,)`.
        left_padding: zero frames written before the activation (the causal padding of the conv that reads it).
    Returns:
        `(batch, channels, left_padding + frames)` (or `(batch, channels, 1, left_padding + frames)`); from the
        kernel, channels-last if a 4-D input is, otherwise contiguous.
    """
    if left_padding < 0:
        raise ValueError(f"left_padding must be >= 0, got {left_padding}")
    if _kernel_applies(hidden, alpha):
        return torch.ops.funaudiochat.snake(hidden, alpha, left_padding)
    out = snake_reference(hidden, alpha)
    return F.pad(out, (left_padding, 0)) if left_padding else out


def _kernel_applies(hidden: torch.Tensor, alpha: torch.Tensor) -> bool:
    """Whether `snake` runs the Triton kernel: a CUDA input of a floating dtype the kernel takes, alpha of the same
    dtype (the torch path would promote a mixed pair), a 3-D or (batch, channels, 1, frames) shape, no gradient to
    keep, and not inside torch.compile (see the module docstring). Shapes and flags only."""
    if triton is None or not hidden.is_cuda or torch.compiler.is_compiling():
        return False
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16) or alpha.dtype != hidden.dtype:
        return False
    if not (hidden.dim() == 3 or (hidden.dim() == 4 and hidden.shape[2] == 1)):
        return False
    return not (torch.is_grad_enabled() and (hidden.requires_grad or alpha.requires_grad))


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _snake_kernel(
        x_ptr, alpha_ptr, out_ptr, channels, frames, left_padding,
        stride_xb, stride_xc, stride_xt, stride_ob, stride_oc, stride_ot,
        BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        """Grid `(cdiv(left_padding + frames, BLOCK_T), cdiv(channels, BLOCK_C), batch)`: a (BLOCK_C, BLOCK_T) tile of
        the output `(batch, channels, left_padding + frames)`; output frame t is the Snake of input frame
        t - left_padding, zero before the first. (The padding is a runtime argument: HiFT's convs have nine.)"""
        b = tl.program_id(2).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c_ok = c < channels
        source = t - left_padding
        read = c_ok[:, None] & ((source >= 0) & (source < frames))[None, :]
        x = tl.load(
            x_ptr + b * stride_xb + c[:, None] * stride_xc + source[None, :] * stride_xt, mask=read, other=0.0
        ).to(tl.float32)
        alpha = tl.load(alpha_ptr + c, mask=c_ok, other=1.0).to(tl.float32)
        inverse = tl.math.div_rn(1.0, alpha + 1e-9)  # IEEE division, as torch's reciprocal
        sine = tl.sin(x * alpha[:, None])
        y = x + inverse[:, None] * (sine * sine)
        y = tl.where(read, y, 0.0)  # the padding: exact zeros whatever alpha is
        write = c_ok[:, None] & (t < left_padding + frames)[None, :]
        out = out_ptr + b * stride_ob + c[:, None] * stride_oc + t[None, :] * stride_ot
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=write)


def _output_like(hidden: torch.Tensor, left_padding: int) -> torch.Tensor:
    """The operator's empty output: `hidden`'s shape with `left_padding` more frames; channels-last for a
    channels-last 4-D input (the layout its conv reads without a conversion), otherwise contiguous."""
    shape = (*hidden.shape[:-1], hidden.shape[-1] + left_padding)
    channels_last = hidden.dim() == 4 and hidden.stride(1) == 1 and hidden.shape[1] > 1
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=hidden.dtype, device=hidden.device, memory_format=memory_format)


# An opaque operator (CUDA graphs replay it; its host code depends on shapes and strides only).
@torch.library.custom_op("funaudiochat::snake", mutates_args=())
def snake_op(hidden: torch.Tensor, alpha: torch.Tensor, left_padding: int) -> torch.Tensor:
    """[`snake`] as one Triton kernel: hidden `(batch, channels, frames)` or `(batch, channels, 1, frames)` (any
    strides), alpha `(channels,)` -> `(..., left_padding + frames)` in hidden's dtype."""
    return launch_snake(hidden, alpha, left_padding)


def launch_snake(hidden: torch.Tensor, alpha: torch.Tensor, left_padding: int, tile=None) -> torch.Tensor:
    """The operator's launcher (`tile`: `(BLOCK_C, BLOCK_T)`, a keyword for benchmarks)."""
    channels = hidden.shape[1]
    if alpha.shape != (channels,):
        raise ValueError(f"alpha must be ({channels},) for {channels} channels, got {tuple(alpha.shape)}")
    out = _output_like(hidden, left_padding)
    x3, out3 = (hidden.squeeze(2), out.squeeze(2)) if hidden.dim() == 4 else (hidden, out)
    batch, _, frames = x3.shape
    if tile is None:
        tile = CHANNELS_MAJOR_TILE if out3.stride(1) == 1 and channels > 1 else FRAMES_MAJOR_TILE
    block_c, block_t = tile
    grid = (triton.cdiv(left_padding + frames, block_t), triton.cdiv(channels, block_c), batch)
    if out.numel():
        _snake_kernel[grid](
            x3, alpha.contiguous(), out3, channels, frames, left_padding, *x3.stride(), *out3.stride(),
            BLOCK_C=block_c, BLOCK_T=block_t, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


@snake_op.register_fake
def _(hidden, alpha, left_padding):
    return _output_like(hidden, left_padding)


__all__ = ["snake", "snake_op", "snake_reference", "launch_snake"]
