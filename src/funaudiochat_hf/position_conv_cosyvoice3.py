"""The CosyVoice3 DiT's convolutional position embedding: a causal (left-padded) grouped conv over time, then Mish.

Two implementations of `mish(conv(hidden)) [+ residual]`:

- `causal_grouped_conv1d` + `F.mish`: every device, dtype and autograd (on CUDA the conv runs as unfold + matmul up to
  `MAX_UNFOLD_ELEMENTS`, see there);
- `funaudiochat::causal_conv_mish`, one Triton kernel (CUDA, 16-bit inputs, inference): an implicit GEMM that reads the
  input rows where they are (no unfolded copy) and applies the bias, Mish and the residual in its epilogue. It
  measured several times faster than unfold + matmul and than cuDNN at a streamed chunk's 136-frame window, and
  still faster than both at 1,500 frames (docs/performance.md).

`causal_conv_mish` picks the kernel where it applies (CUDA, bfloat16 / float16, no gradient).
The kernel wants the conv weight tap-major, `(groups, kernel, in / groups, out / groups)` (`tap_major_weight`); a
caller that keeps that copy (the DiT's position embedding does, see `store_tap_major_weights`) saves a 4 MB
transposing copy per call. Rounding follows the torch path under autocast: the conv accumulates in float32 and rounds
to the input dtype, then the bias, Mish and the residual are each computed in float32 and rounded once.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .triton_support import kernels_run_on, triton
from .triton_config_funaudiochat import supports_programmatic_launch


# Tiles and launch options of the kernel (`BLOCK_M` output frames per program).
BLOCK_M = 64
NUM_WARPS = 4
NUM_STAGES = 3

# Largest unfolded conv input (elements) built for the matmul path: 128 MB in float32, about 10 s of CFG-batched
# frames; longer inputs use cuDNN, whose algorithms are fine at those lengths. The choice is a shape guard in a
# compiled estimator: the first input past it compiles once more (slow at full size).
MAX_UNFOLD_ELEMENTS = 2**25



def causal_grouped_conv1d(
    hidden: torch.Tensor, conv: nn.Conv1d, max_unfold_elements: int = MAX_UNFOLD_ELEMENTS
) -> torch.Tensor:
    """`conv` over time, left-padded by kernel_size - 1: (batch, frames, channels) -> (batch, frames, out_channels).

    Up to `max_unfold_elements` unfolded input elements (batch * frames * channels * kernel_size), computed as
    unfold + one batched matmul per group instead of the convolution: for the DiT's kernel-31, 16-group conv,
    cuDNN's float32 heuristics pick, at some short lengths (such as the 136-frame window of a 50-token streaming
    flow call), an FFT algorithm that is orders of magnitude slower, and even its good algorithms are slower than
    the matmul at short lengths (float32 and bfloat16). Equal to the convolution up to float rounding (a different
    summation order). Longer inputs, where cuDNN is fast, run the convolution itself, so memory stays bounded; the
    size test is a shape guard, so `torch.compile(dynamic=True)` keeps one graph per side of the threshold.
    """
    batch, frames, channels = hidden.shape
    kernel = conv.kernel_size[0]
    if batch * frames * channels * kernel > max_unfold_elements:
        return conv(F.pad(hidden.transpose(1, 2), (kernel - 1, 0))).transpose(1, 2)
    groups, out_channels = conv.groups, conv.out_channels
    in_per_group = channels // groups
    # Columns in (tap, input channel) order: the copy that materialises them moves runs of in/g contiguous channels
    # (coalesced). The (channel, tap) order of `unfold(1, ...)` on (batch, frames, channels) made it read with a
    # stride of `channels`, which made that copy slower than the matmul itself.
    padded = F.pad(hidden, (0, 0, kernel - 1, 0)).view(batch, frames + kernel - 1, groups, in_per_group)
    columns = padded.transpose(1, 2).unfold(2, kernel, 1).transpose(-1, -2)  # (batch, groups, frames, kernel, in/g)
    columns = columns.reshape(batch, groups, frames, kernel * in_per_group)
    # The columns' row order: (groups, kernel, in / groups, out / groups) flattened over (kernel, in / groups).
    weight = tap_major_weight(conv.weight, groups).flatten(1, 2)
    out = torch.matmul(columns, weight)  # (batch, groups, frames, out/g)
    out = out.transpose(1, 2).reshape(batch, frames, out_channels)
    return out if conv.bias is None else out + conv.bias.to(out.dtype)


def tap_major_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A grouped Conv1d weight `(out, in / groups, kernel)` -> `(groups, kernel, in / groups, out / groups)` (a view;
    `.contiguous()` it for the kernel)."""
    out_channels, in_per_group, kernel = weight.shape
    return weight.reshape(groups, out_channels // groups, in_per_group, kernel).permute(0, 3, 2, 1)


def causal_conv_mish(
    hidden: torch.Tensor,
    conv: nn.Conv1d,
    residual: Optional[torch.Tensor] = None,
    tap_major: Optional[torch.Tensor] = None,
    max_unfold_elements: Optional[int] = None,
) -> torch.Tensor:
    """`mish(conv(hidden))` over time, left-padded (causal), plus `residual` if given.

    Args:
        hidden: `(batch, frames, in_channels)`.
        conv: a grouped `nn.Conv1d(in_channels, out_channels, kernel, groups=...)` (no padding of its own).
        residual: None or `(batch, frames, out_channels)`, added after the Mish.
        tap_major: None, or `tap_major_weight(conv.weight, conv.groups).contiguous()` kept by the caller (used when
            its dtype is the kernel's compute dtype; saves the kernel path a transposing copy per call).
        max_unfold_elements: the torch path's unfold limit (`causal_grouped_conv1d`); 0 runs the convolution.
            None: `MAX_UNFOLD_ELEMENTS` on CUDA (cuDNN's algorithm choice is the problem there), 0 elsewhere (the
            convolution, the reference's exact arithmetic: the 1e-4 waveform parity on CPU).
    Returns:
        `(batch, frames, out_channels)`.
    """
    if _kernel_applies(hidden, conv, residual):
        if tap_major is None or tap_major.dtype != hidden.dtype:
            tap_major = tap_major_weight(conv.weight.to(hidden.dtype), conv.groups).contiguous()
        bias = None if conv.bias is None else conv.bias.to(hidden.dtype)
        return torch.ops.funaudiochat.causal_conv_mish(hidden, tap_major, bias, residual)
    if max_unfold_elements is None:
        max_unfold_elements = MAX_UNFOLD_ELEMENTS if hidden.is_cuda else 0
    out = F.mish(causal_grouped_conv1d(hidden, conv, max_unfold_elements))
    return out if residual is None else out + residual


def _kernel_applies(hidden: torch.Tensor, conv: nn.Conv1d, residual: Optional[torch.Tensor]) -> bool:
    """Whether `causal_conv_mish` runs the Triton kernel: 16-bit activations on a GPU that has them (the weight is
    cast to them, as autocast casts a conv's weight), no gradient to keep. Shapes and flags only, so torch.compile
    decides it while tracing."""
    if not kernels_run_on(hidden):
        return False
    if hidden.dtype not in (torch.bfloat16, torch.float16) or (residual is not None and residual.dtype != hidden.dtype):
        return False
    return not torch.is_grad_enabled() or not (
        hidden.requires_grad or conv.weight.requires_grad or (residual is not None and residual.requires_grad)
    )


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _causal_conv_mish_kernel(
        x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr,
        frames, stride_xb, stride_xt, stride_rb, stride_rt, stride_ob, stride_ot,
        IN_PER_GROUP: tl.constexpr, OUT_PER_GROUP: tl.constexpr, KERNEL: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_O: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid `(cdiv(frames, BLOCK_M), groups, batch)`: BLOCK_M output frames of one group, summed over the KERNEL
        taps as KERNEL products of `(BLOCK_M, in/g)` input rows (shifted by the tap, zero before the first frame) and
        the tap's `(in/g, out/g)` weight. x / residual / out: `(batch, frames, channels)` with the given batch and
        frame strides, channels contiguous; w: tap-major `(groups, KERNEL, in/g, out/g)`, contiguous."""
        if PDL:  # a programmatic dependent launch: x (and the residual) are the previous kernel's output
            tl.extra.cuda.gdc_wait()
        group = tl.program_id(1)
        b = tl.program_id(2)
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < frames
        c = tl.arange(0, BLOCK_C)
        c_ok = c < IN_PER_GROUP
        o = tl.arange(0, BLOCK_O)
        o_ok = o < OUT_PER_GROUP
        x_rows = x_ptr + b * stride_xb + group * IN_PER_GROUP + c[None, :]
        w_tap = w_ptr + group * KERNEL * IN_PER_GROUP * OUT_PER_GROUP + c[:, None] * OUT_PER_GROUP + o[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        for tap in tl.range(0, KERNEL, num_stages=NUM_STAGES):
            source = m - (KERNEL - 1) + tap  # the left padding: frames before 0 read as zeros
            x = tl.load(
                x_rows + source[:, None] * stride_xt, mask=((source >= 0) & m_ok)[:, None] & c_ok[None, :], other=0.0
            )
            w = tl.load(w_tap + tap * IN_PER_GROUP * OUT_PER_GROUP, mask=c_ok[:, None] & o_ok[None, :], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if PDL:  # the next kernel (the second conv) may launch and wait for this one's output
            tl.extra.cuda.gdc_launch_dependents()
        dtype = out_ptr.dtype.element_ty
        y = acc.to(dtype).to(tl.float32)  # the conv's output, rounded as the conv rounds it
        if HAS_BIAS:
            bias = tl.load(bias_ptr + group * OUT_PER_GROUP + o, mask=o_ok, other=0.0)
            y = (y + bias.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        # mish(y) = y * tanh(softplus(y)) = y * n / (n + 2) with n = e^y (e^y + 2); past y = 20 the factor is 1.0 in
        # float32 (the clamp keeps n finite)
        e = tl.exp(tl.minimum(y, 20.0))
        n = e * (e + 2.0)
        y = y * (n / (n + 2.0))
        channels = group * OUT_PER_GROUP + o[None, :]
        mask = m_ok[:, None] & o_ok[None, :]
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + b * stride_rb + m[:, None] * stride_rt + channels, mask=mask, other=0.0)
            y = y.to(dtype).to(tl.float32) + residual.to(tl.float32)
        tl.store(out_ptr + b * stride_ob + m[:, None] * stride_ot + channels, y.to(dtype), mask=mask)


# An opaque operator (torch.compile keeps it in its graph, CUDA graphs replay it; its host code depends on shapes only).
@torch.library.custom_op("funaudiochat::causal_conv_mish", mutates_args=())
def causal_conv_mish_op(
    hidden: torch.Tensor, tap_major: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor]
) -> torch.Tensor:
    """[`causal_conv_mish`] as one Triton kernel. hidden `(batch, frames, in_channels)`; tap_major `(groups, kernel,
    in/g, out/g)` contiguous, in hidden's dtype; bias None or `(out_channels,)`; residual None or `(batch, frames,
    out_channels)`. Any dtype the kernel's `tl.dot` takes (float32 is computed in full precision, for tests)."""
    return launch_causal_conv_mish(hidden, tap_major, bias, residual)


def launch_causal_conv_mish(
    hidden, tap_major, bias, residual, block_m=BLOCK_M, num_warps=NUM_WARPS, num_stages=NUM_STAGES
) -> torch.Tensor:
    """The operator's launcher (the tile size and launch options are keywords for benchmarks)."""
    batch, frames, in_channels = hidden.shape
    groups, kernel, in_per_group, out_per_group = tap_major.shape
    if in_channels != groups * in_per_group:
        raise ValueError(f"hidden has {in_channels} channels, the weight expects {groups} x {in_per_group}")
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    tap_major = tap_major.contiguous()
    out = hidden.new_empty(batch, frames, groups * out_per_group)
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    residual_strides = (0, 0) if residual is None else (residual.stride(0), residual.stride(1))
    pdl = supports_programmatic_launch(hidden.device)
    grid = (triton.cdiv(frames, block_m), groups, batch)
    _causal_conv_mish_kernel[grid](
        hidden, tap_major, out if bias is None else bias, out if residual is None else residual, out,
        frames, hidden.stride(0), hidden.stride(1), *residual_strides, out.stride(0), out.stride(1),
        IN_PER_GROUP=in_per_group, OUT_PER_GROUP=out_per_group, KERNEL=kernel, BLOCK_M=block_m,
        BLOCK_C=max(16, triton.next_power_of_2(in_per_group)), BLOCK_O=max(16, triton.next_power_of_2(out_per_group)),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", NUM_STAGES=num_stages, PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out


@causal_conv_mish_op.register_fake
def _(hidden, tap_major, bias, residual):
    return hidden.new_empty(hidden.shape[0], hidden.shape[1], tap_major.shape[0] * tap_major.shape[3])


__all__ = [
    "MAX_UNFOLD_ELEMENTS",
    "causal_conv_mish",
    "causal_conv_mish_op",
    "causal_grouped_conv1d",
    "launch_causal_conv_mish",
    "tap_major_weight",
]
