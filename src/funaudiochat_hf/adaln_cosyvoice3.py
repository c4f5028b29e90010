"""The CosyVoice3 DiT's residual update and adaptive LayerNorm, as one Triton kernel on CUDA.

Each DiT block adds a gated update to its residual stream and normalises the result with a per-row shift and scale
(adaLN-Zero), twice per block:

    hidden = hidden + gate * update
    normed = layer_norm(hidden) * (1 + scale) + shift

In PyTorch that is six kernels (a LayerNorm and five broadcasting element-wise ops) over `(batch, frames, dim)`,
12 per block and Euler step: at a streamed chunk's shapes the flow spends most of its time in them, each bound by
its launch and a pass over a ~1 MB tensor. [`residual_adaln`] does both lines in one pass (one kernel), reading the
stream, the update and the three modulation rows once. The DiT chains the second norm of each block into the next
block's first (`CosyVoice3DiT.forward`), so a block costs two of these kernels.

Rounding follows the torch path under autocast, where LayerNorm runs in float32: the product `gate * update` and the
sum are rounded to the stream's dtype as the two torch ops round them, `1 + scale` is rounded to the modulation's
dtype, the LayerNorm and the modulation are computed in float32 and the result is rounded once to the stream's dtype
(which the next projection, under autocast, would cast it to). Only the LayerNorm's summation order differs.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .triton_support import kernels_run_on, triton


# Compile and launch options: one program per row of `dim` elements (1024 at full size); no fused multiply-add, so
# that each product and sum rounds as the torch ops round it.
KERNEL_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def torch_residual_adaln(
    hidden: torch.Tensor,
    update: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of [`residual_adaln`] (same arguments and results): the reference's ops."""
    if update is not None:
        hidden = hidden + gate.unsqueeze(1) * update
    normed = F.layer_norm(hidden, hidden.shape[-1:], eps=eps) * (1 + scale[:, None]) + shift[:, None]
    return hidden, normed


def residual_adaln(
    hidden: torch.Tensor,
    update: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hidden + gate * update` and its modulated LayerNorm (no affine weights).

    Args:
        hidden: the residual stream `(batch, frames, dim)`.
        update: `(batch, frames, dim)` to add, gated; None: nothing is added (`gate` is then not read).
        gate, shift, scale: `(batch, dim)` rows, one per batch row (views of a block's modulation are fine).
        eps: the LayerNorm's epsilon.
    Returns:
        `(hidden', normed)`: the updated stream and `layer_norm(hidden') * (1 + scale) + shift`, both
        `(batch, frames, dim)`; `hidden'` is `hidden` itself when `update` is None.
    """
    if _kernel_applies(hidden, update, gate, shift, scale):
        if update is None:
            return hidden, torch.ops.funaudiochat.dit_adaln(hidden, shift, scale, eps)
        return torch.ops.funaudiochat.dit_residual_adaln(hidden, update, gate, shift, scale, eps)
    return torch_residual_adaln(hidden, update, gate, shift, scale, eps)


def _kernel_applies(hidden, update, gate, shift, scale) -> bool:
    """Whether [`residual_adaln`] runs the Triton kernel: a GPU the kernels run on (`kernels_run_on`), one floating
    dtype for every input, no gradient to keep, 3-d rows of at most `MAX_DIM` elements. Shapes and flags only, so
    torch.compile decides it while tracing."""
    if not kernels_run_on(hidden) or hidden.dim() != 3 or hidden.shape[-1] > MAX_DIM:
        return False
    tensors = [t for t in (hidden, update, gate, shift, scale) if t is not None]
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if any(t.dtype != hidden.dtype for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return update is None or (update.shape == hidden.shape and gate is not None)


# Rows wider than this take the torch path (one program holds a whole row in registers).
MAX_DIM = 8192


if triton is not None:
    import triton.language as tl

    # Window lengths vary from chunk to chunk: one compiled variant for all (a row index divided by `frames` gains
    # nothing from Triton's specialisation of integers divisible by 16, which would compile a second).
    @triton.jit(do_not_specialize=["frames"])
    def _residual_adaln_kernel(
        hidden_ptr, update_ptr, gate_ptr, shift_ptr, scale_ptr, hidden_out_ptr, normed_ptr,
        frames, dim, eps,
        stride_hb, stride_ht, stride_ub, stride_ut, stride_gate, stride_shift, stride_scale,
        HAS_UPDATE: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Grid `(batch * frames,)`: one row each. hidden / update rows at the given batch and frame strides (last
        dimension contiguous); gate / shift / scale `(batch, dim)` rows at their batch strides; the outputs
        contiguous `(batch, frames, dim)`."""
        row = tl.program_id(0)
        b = row // frames
        t = row % frames
        d = tl.arange(0, BLOCK_D)
        ok = d < dim
        dtype = hidden_out_ptr.dtype.element_ty
        x = tl.load(hidden_ptr + b * stride_hb + t * stride_ht + d, mask=ok, other=0.0)
        if HAS_UPDATE:
            update = tl.load(update_ptr + b * stride_ub + t * stride_ut + d, mask=ok, other=0.0)
            gate = tl.load(gate_ptr + b * stride_gate + d, mask=ok, other=0.0)
            # rounded as the torch ops round: the product, then the sum
            gated = (gate.to(tl.float32) * update.to(tl.float32)).to(dtype)
            x = (x.to(tl.float32) + gated.to(tl.float32)).to(dtype)
            tl.store(hidden_out_ptr + row * dim + d, x, mask=ok)
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=0) / dim
        centered = tl.where(ok, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / dim + eps)
        scale = tl.load(scale_ptr + b * stride_scale + d, mask=ok, other=0.0)
        shift = tl.load(shift_ptr + b * stride_shift + d, mask=ok, other=0.0)
        one_plus_scale = (scale.to(tl.float32) + 1.0).to(scale.dtype).to(tl.float32)
        normed = centered * rstd * one_plus_scale + shift.to(tl.float32)
        tl.store(normed_ptr + row * dim + d, normed.to(dtype), mask=ok)


def launch_residual_adaln(hidden, update, gate, shift, scale, eps):
    """The operators' launcher: `(hidden' or None, normed)` (None when `update` is None)."""
    batch, frames, dim = hidden.shape
    has_update = update is not None
    hidden, update, gate, shift, scale = (
        t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (hidden, update, gate, shift, scale)
    )
    normed = torch.empty((batch, frames, dim), dtype=hidden.dtype, device=hidden.device)
    hidden_out = torch.empty_like(normed) if has_update else normed  # not written without an update
    if not has_update:
        update, gate, update_strides = hidden, shift, (0, 0)  # not read
    else:
        update_strides = (update.stride(0), update.stride(1))
    _residual_adaln_kernel[(batch * frames,)](
        hidden, update, gate, shift, scale, hidden_out, normed, frames, dim, eps,
        hidden.stride(0), hidden.stride(1), *update_strides, gate.stride(0), shift.stride(0), scale.stride(0),
        HAS_UPDATE=has_update, BLOCK_D=triton.next_power_of_2(dim), **KERNEL_OPTIONS,
    )  # fmt: skip
    return (hidden_out if has_update else None), normed


# Opaque operators: torch.compile keeps them in its graph, CUDA graphs replay them.
@torch.library.custom_op("funaudiochat::dit_residual_adaln", mutates_args=())
def dit_residual_adaln_op(
    hidden: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[`residual_adaln`] with an update, as one Triton kernel."""
    return launch_residual_adaln(hidden, update, gate, shift, scale, eps)


@dit_residual_adaln_op.register_fake
def _(hidden, update, gate, shift, scale, eps):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format), torch.empty_like(
        hidden, memory_format=torch.contiguous_format
    )


@torch.library.custom_op("funaudiochat::dit_adaln", mutates_args=())
def dit_adaln_op(hidden: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """[`residual_adaln`] without an update (the normed stream only), as one Triton kernel."""
    return launch_residual_adaln(hidden, None, None, shift, scale, eps)[1]


@dit_adaln_op.register_fake
def _(hidden, shift, scale, eps):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


__all__ = ["dit_adaln_op", "dit_residual_adaln_op", "launch_residual_adaln", "residual_adaln", "torch_residual_adaln"]
