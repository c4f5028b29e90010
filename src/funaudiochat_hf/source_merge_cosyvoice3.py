"""HiFT's excitation from its sample-rate pieces (`CosyVoice3HiFTGenerator.merge_source`): voiced / unvoiced mixing of
the harmonic sines and the fixed noise table, then the harmonics' Linear (before its tanh).

Two implementations of `Linear(sines * voiced + amp(voiced) * noise)`:

- `merge_reference`: every device, dtype and autograd; the reference's expression (bit-identical source on CPU);
- `funaudiochat::hift_source_merge`, one Triton kernel (CUDA, float32, inference). Eagerly it is about ten small
  kernels (the voiced mask, its cast, the amplitudes, the mixing, the Linear), launched one by one on every streamed
  chunk (the excitation is computed outside the vocoder's CUDA graph).

`merge_linear` picks the kernel where it applies (`_kernel_applies`: float32 CUDA tensors, no gradient to keep, not
while torch.compile traces). Arithmetic: float32, the torch path's element-wise expression and order; the Linear's sum
over the harmonics in order (cuBLAS picks its own order: a few ulp apart).
"""

import torch
import torch.nn.functional as F

from .istft_cosyvoice3 import float32_kernel_applies
from .triton_support import triton


BLOCK = 256  # samples per program
NUM_WARPS = 4


def merge_reference(
    sines: torch.Tensor,
    f0_up: torch.Tensor,
    noise: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    voiced_threshold: float,
    noise_std: float,
    sine_amp: float,
) -> torch.Tensor:
    """sines (batch, samples, harmonics), f0_up (batch, samples, 1) in Hz, noise (1 or batch, samples, harmonics),
    the Linear's weight (1, harmonics) and bias (1,) -> (batch, samples, 1), before the tanh."""
    voiced = (f0_up > voiced_threshold).to(torch.float32)
    noise_amp = voiced * noise_std + (1 - voiced) * sine_amp / 3
    sines = sines * voiced + noise_amp * noise.to(torch.float32)
    return F.linear(sines, weight.float(), bias.float())


def merge_linear(
    sines: torch.Tensor,
    f0_up: torch.Tensor,
    noise: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    voiced_threshold: float,
    noise_std: float,
    sine_amp: float,
) -> torch.Tensor:
    """[`merge_reference`], one kernel on CUDA at inference."""
    if _kernel_applies(sines, f0_up, noise, weight, bias):
        merged = torch.ops.funaudiochat.hift_source_merge(
            sines, f0_up, noise, weight, bias, float(voiced_threshold), float(noise_std), float(sine_amp)
        )
        return merged.unsqueeze(-1)
    return merge_reference(sines, f0_up, noise, weight, bias, voiced_threshold, noise_std, sine_amp)


_kernel_applies = float32_kernel_applies  # the name `merge_linear` reads (tests replace it)


if triton is not None:
    import triton.language as tl

    # Sample counts and strides vary with the window: no divisibility specialisation (unit strides still specialise).
    @triton.jit(
        do_not_specialize=["samples"],
        do_not_specialize_on_alignment=[
            "sines_ptr", "f0_ptr", "noise_ptr", "weight_ptr", "bias_ptr", "out_ptr", "stride_sb", "stride_ss",
            "stride_sh", "stride_fb", "stride_fs", "stride_nb", "stride_ns", "stride_nh",
        ],
    )  # fmt: skip
    def _source_merge_kernel(
        sines_ptr, f0_ptr, noise_ptr, weight_ptr, bias_ptr, out_ptr, samples,
        stride_sb, stride_ss, stride_sh, stride_fb, stride_fs, stride_nb, stride_ns, stride_nh,
        voiced_threshold, noise_std, sine_amp, HARMONICS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Grid `(cdiv(samples, BLOCK), batch)`: BLOCK samples of one row -> out `(batch, samples)` contiguous."""
        b = tl.program_id(1).to(tl.int64)
        n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = n < samples
        h = tl.arange(0, BLOCK_H)
        both = ok[:, None] & (h < HARMONICS)[None, :]
        f0 = tl.load(f0_ptr + b * stride_fb + n * stride_fs, mask=ok, other=0.0)
        voiced = (f0 > voiced_threshold).to(tl.float32)
        # the torch path's order: voiced * std + ((1 - voiced) * amp) / 3, a rounded division
        noise_amp = voiced * noise_std + tl.math.div_rn((1.0 - voiced) * sine_amp, 3.0)
        sines = sines_ptr + b * stride_sb + n[:, None] * stride_ss + h[None, :] * stride_sh
        sines = tl.load(sines, mask=both, other=0.0)
        noise = noise_ptr + b * stride_nb + n[:, None] * stride_ns + h[None, :] * stride_nh
        noise = tl.load(noise, mask=both, other=0.0)
        mixed = sines * voiced[:, None] + noise_amp[:, None] * noise
        weight = tl.load(weight_ptr + h, mask=h < HARMONICS, other=0.0)
        merged = tl.sum(mixed * weight[None, :], axis=1) + tl.load(bias_ptr)
        tl.store(out_ptr + b * samples + n, merged, mask=ok)


# An opaque operator (its host code depends on shapes and strides only).
@torch.library.custom_op("funaudiochat::hift_source_merge", mutates_args=())
def hift_source_merge_op(
    sines: torch.Tensor,
    f0_up: torch.Tensor,
    noise: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    voiced_threshold: float,
    noise_std: float,
    sine_amp: float,
) -> torch.Tensor:
    """[`merge_reference`] as one Triton kernel (float32): -> (batch, samples), before the tanh. sines, f0_up and
    noise may have any strides (noise's batch stride 0 for a shared table)."""
    batch, samples, harmonics = sines.shape
    if f0_up.shape != (batch, samples, 1) or noise.shape[1:] != (samples, harmonics) or weight.shape != (1, harmonics):
        raise ValueError(
            f"hift_source_merge: sines {tuple(sines.shape)}, f0_up {tuple(f0_up.shape)}, noise "
            f"{tuple(noise.shape)} and weight {tuple(weight.shape)} do not fit together"
        )
    noise = noise.expand(batch, samples, harmonics)
    out = sines.new_empty(batch, samples)
    if out.numel():
        _source_merge_kernel[(triton.cdiv(samples, BLOCK), batch)](
            sines, f0_up, noise, weight.contiguous(), bias.contiguous(), out, samples, *sines.stride(),
            f0_up.stride(0), f0_up.stride(1), *noise.stride(), voiced_threshold, noise_std, sine_amp,
            HARMONICS=harmonics, BLOCK_H=triton.next_power_of_2(harmonics), BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


@hift_source_merge_op.register_fake
def _(sines, f0_up, noise, weight, bias, voiced_threshold, noise_std, sine_amp):
    return sines.new_empty(sines.shape[0], sines.shape[1])


__all__ = ["hift_source_merge_op", "merge_linear", "merge_reference"]
