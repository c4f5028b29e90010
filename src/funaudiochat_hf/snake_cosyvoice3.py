"""HiFT's Snake activation, `x + sin(alpha * x)^2 / alpha` with a per-channel alpha, and the element-wise work around
it in a residual block: the bias of the conv before it, the causal padding of the conv after it, the residual sum.

Two implementations of `F.pad(snake(hidden + bias), (left_padding, 0))` and of `hidden + bias + residual`:

- `snake_reference` and torch ops: every device, dtype and autograd; the reference's expression and evaluation order;
- `funaudiochat::conv_epilogue`, one Triton kernel (CUDA, inference). Eagerly a Snake is eight element-wise kernels
  (`1.0 / t` is a reciprocal and a multiply), the causal padding two more (a fill and a copy) and a conv's bias one
  more (ATen adds it after cuDNN's conv), for each of the 72 Snakes of a full-size HiFT call; the kernel reads its
  inputs once and writes the padded output, zeros included.

`snake` and `add_bias_and_residual` pick the kernel where it applies (`_kernel_applies`: CUDA tensors of one dtype,
float32 / bfloat16 / float16, no gradient to keep, not while torch.compile traces: compiled (`compile_vocoder`),
Inductor fuses the expression together with the sums and layout switches around it, which an opaque operator would
prevent). Arithmetic: each element in float32 from the inputs as stored, in the torch path's order, rounded once to
the input dtype. In float32 that is the torch path's arithmetic (the sums are bit-identical; the Snake is a few ulp
apart: `sin` and a fused multiply-add); 16-bit inputs are more accurate than the torch path, which rounds after each
of its element-wise ops.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .triton_support import kernels_run_on, triton


# Tiles of the kernel: (channels, frames) per program, frames-major inputs, then channels-major (channels-last) ones:
# the contiguous dimension gets the long side, so that each warp reads whole 128-byte lines.
FRAMES_MAJOR_TILE = (8, 256)
CHANNELS_MAJOR_TILE = (64, 32)
NUM_WARPS = 4


def snake_reference(hidden: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The torch expression: hidden (batch, channels, frames) or (batch, channels, 1, frames), alpha (channels,)."""
    alpha = _per_channel(alpha, hidden)
    # Same expression and evaluation order as the reference (the 1e-9 guards alpha == 0).
    return hidden + (1.0 / (alpha + 1e-9)) * torch.pow(torch.sin(hidden * alpha), 2)


def snake(
    hidden: torch.Tensor, alpha: torch.Tensor, left_padding: int = 0, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Snake of `hidden + bias` with `left_padding` zero frames before it.

    Args:
        hidden: `(batch, channels, frames)` or `(batch, channels, 1, frames)`, any strides.
        alpha: `(channels,)`.
        left_padding: zero frames written before the activation (the causal padding of the conv that reads it).
        bias: None or `(channels,)`, added first (the bias of the conv that wrote `hidden`).
    Returns:
        `(batch, channels, left_padding + frames)` (or `(batch, channels, 1, left_padding + frames)`); from the
        kernel, contiguous (3-D) or channels-last (4-D).
    """
    if left_padding < 0:
        raise ValueError(f"left_padding must be >= 0, got {left_padding}")
    if _kernel_applies(hidden, alpha, bias):
        return torch.ops.funaudiochat.conv_epilogue(hidden, bias, None, alpha, left_padding)
    out = snake_reference(_with_bias(hidden, bias), alpha)
    return F.pad(out, (left_padding, 0)) if left_padding else out


def add_bias_and_residual(
    hidden: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor
) -> torch.Tensor:
    """`(hidden + bias) + residual`: a conv's output (batch, channels, frames) (or (batch, channels, 1, frames)),
    its bias `(channels,)` or None, and a residual of hidden's shape; one kernel on CUDA at inference."""
    if _kernel_applies(hidden, bias, residual):
        return torch.ops.funaudiochat.conv_epilogue(hidden, bias, residual, None, 0)
    return _with_bias(hidden, bias) + residual


def _with_bias(hidden: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return hidden if bias is None else hidden + _per_channel(bias, hidden)


def _per_channel(values: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return values.reshape((-1,) + (1,) * (hidden.dim() - 2))


def _kernel_applies(hidden: torch.Tensor, *others: Optional[torch.Tensor]) -> bool:
    """Whether the Triton kernel runs: an input on a GPU the kernels run on (`kernels_run_on`) of a floating dtype
    the kernel takes, the other tensors (alpha, bias, residual; None where absent) of the same dtype (the torch path
    would promote a mixed set), a 3-D or (batch, channels, 1, frames) shape, no gradient to keep, and not inside
    torch.compile (see the module docstring). Shapes and flags only."""
    if not kernels_run_on(hidden) or torch.compiler.is_compiling():
        return False
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if any(other is not None and other.dtype != hidden.dtype for other in others):
        return False
    if not (hidden.dim() == 3 or (hidden.dim() == 4 and hidden.shape[2] == 1)):
        return False
    tensors = (hidden, *(other for other in others if other is not None))
    return not (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors))


if triton is not None:
    import triton.language as tl

    # Sizes, paddings and strides vary with the window (and the pointers' alignment with slicing): specialising on
    # them (Triton's divisibility by 16) would compile a new variant on many a streamed window. Unit strides still
    # specialise (the contiguous axis of the tile).
    @triton.jit(
        do_not_specialize=["channels", "frames", "left_padding"],
        do_not_specialize_on_alignment=[
            "x_ptr", "bias_ptr", "residual_ptr", "alpha_ptr", "out_ptr", "stride_xb", "stride_xc", "stride_xt",
            "stride_rb", "stride_rc", "stride_rt", "stride_ob", "stride_oc", "stride_ot",
        ],
    )  # fmt: skip
    def _conv_epilogue_kernel(
        x_ptr, bias_ptr, residual_ptr, alpha_ptr, out_ptr, channels, frames, left_padding,
        stride_xb, stride_xc, stride_xt, stride_rb, stride_rc, stride_rt, stride_ob, stride_oc, stride_ot,
        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SNAKE: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        """Grid `(cdiv(left_padding + frames, BLOCK_T), cdiv(channels, BLOCK_C), batch)`: a (BLOCK_C, BLOCK_T) tile of
        the output `(batch, channels, left_padding + frames)`; output frame t is `(x + bias) + residual`, through the
        Snake if SNAKE, of input frame t - left_padding, zero before the first. (The padding is a runtime argument:
        HiFT's convs have nine.)"""
        b = tl.program_id(2).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c_ok = c < channels
        source = t - left_padding
        read = c_ok[:, None] & ((source >= 0) & (source < frames))[None, :]
        x = tl.load(
            x_ptr + b * stride_xb + c[:, None] * stride_xc + source[None, :] * stride_xt, mask=read, other=0.0
        ).to(tl.float32)
        if HAS_BIAS:
            x = x + tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
        if HAS_RESIDUAL:
            residual = residual_ptr + b * stride_rb + c[:, None] * stride_rc + source[None, :] * stride_rt
            x = x + tl.load(residual, mask=read, other=0.0).to(tl.float32)
        if SNAKE:
            alpha = tl.load(alpha_ptr + c, mask=c_ok, other=1.0).to(tl.float32)
            inverse = tl.math.div_rn(1.0, alpha + 1e-9)  # IEEE division, as torch's reciprocal
            sine = tl.sin(x * alpha[:, None])
            x = x + inverse[:, None] * (sine * sine)
        y = tl.where(read, x, 0.0)  # the padding: exact zeros whatever the bias and alpha are
        write = c_ok[:, None] & (t < left_padding + frames)[None, :]
        out = out_ptr + b * stride_ob + c[:, None] * stride_oc + t[None, :] * stride_ot
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=write)


def _output_like(hidden: torch.Tensor, left_padding: int) -> torch.Tensor:
    """The operator's empty output: `hidden`'s shape with `left_padding` more frames; channels-last for a 4-D input
    (the layout of `use_channels_last_convolutions`, whose resblock convs read it without a conversion: the first
    Snake of a source resblock switches the contiguous source_downs output to it), otherwise contiguous."""
    shape = (*hidden.shape[:-1], hidden.shape[-1] + left_padding)
    memory_format = torch.channels_last if hidden.dim() == 4 else torch.contiguous_format
    return torch.empty(shape, dtype=hidden.dtype, device=hidden.device, memory_format=memory_format)


# An opaque operator (CUDA graphs replay it; its host code depends on shapes and strides only).
@torch.library.custom_op("funaudiochat::conv_epilogue", mutates_args=())
def conv_epilogue_op(
    hidden: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    alpha: Optional[torch.Tensor],
    left_padding: int,
) -> torch.Tensor:
    """One Triton kernel: `F.pad(snake((hidden + bias) + residual), (left_padding, 0))`, each part where given.
    hidden and residual `(batch, channels, frames)` or `(batch, channels, 1, frames)` (any strides); bias and alpha
    `(channels,)` -> `(..., left_padding + frames)` in hidden's dtype."""
    return launch_conv_epilogue(hidden, bias, residual, alpha, left_padding)


def launch_conv_epilogue(hidden, bias, residual, alpha, left_padding, tile=None) -> torch.Tensor:
    """The operator's launcher (`tile`: `(BLOCK_C, BLOCK_T)`, a keyword for benchmarks)."""
    channels = hidden.shape[1]
    for name, values in (("bias", bias), ("alpha", alpha)):
        if values is not None and values.shape != (channels,):
            raise ValueError(f"{name} must be ({channels},) for {channels} channels, got {tuple(values.shape)}")
    if residual is not None and residual.shape != hidden.shape:
        raise ValueError(f"residual must have hidden's shape {tuple(hidden.shape)}, got {tuple(residual.shape)}")
    result = _output_like(hidden, left_padding)
    out = result
    if hidden.dim() == 4:  # (batch, channels, 1, frames): the kernel sees the 3-D views
        hidden, out = hidden.squeeze(2), out.squeeze(2)
        residual = None if residual is None else residual.squeeze(2)
    batch, _, frames = hidden.shape
    if tile is None:
        tile = CHANNELS_MAJOR_TILE if out.stride(1) == 1 and channels > 1 else FRAMES_MAJOR_TILE
    block_c, block_t = tile
    grid = (triton.cdiv(left_padding + frames, block_t), triton.cdiv(channels, block_c), batch)
    if out.numel():
        _conv_epilogue_kernel[grid](
            hidden, out if bias is None else bias.contiguous(), out if residual is None else residual,
            out if alpha is None else alpha.contiguous(), out, channels, frames, left_padding, *hidden.stride(),
            *(residual.stride() if residual is not None else (0, 0, 0)), *out.stride(),
            HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, SNAKE=alpha is not None,
            BLOCK_C=block_c, BLOCK_T=block_t, num_warps=NUM_WARPS,
        )  # fmt: skip
    return result


@conv_epilogue_op.register_fake
def _(hidden, bias, residual, alpha, left_padding):
    return _output_like(hidden, left_padding)


__all__ = ["add_bias_and_residual", "conv_epilogue_op", "launch_conv_epilogue", "snake", "snake_reference"]
