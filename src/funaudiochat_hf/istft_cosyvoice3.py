"""HiFT's iSTFT around its inverse FFT: the spectrum from conv_post's output, and the windowed overlap-add to the
clamped waveform.

Two implementations of each:

- `spectrum_reference` and `overlap_add_reference`: every device, dtype and autograd; the arithmetic of
  `torch.istft(center=True)` (bit-identical on CPU, see `overlap_add_reference`);
- `funaudiochat::hift_spectrum` and `funaudiochat::hift_overlap_add`, one Triton kernel each (CUDA, float32,
  inference). Eagerly the spectrum is eight element-wise kernels (exp, sin, clip, cos, sin, two products, complex)
  and the overlap-add about ten (window product, two overlap-adds of a zero-filled buffer, the squared window, the
  division, the clamp): small kernels on a streamed chunk's ~12,000 STFT frames.

`hift_spectrum` and `hift_overlap_add` pick the kernels where they apply (`_kernel_applies`: float32 CUDA tensors, no
gradient to keep, not while torch.compile traces). Arithmetic: float32, the torch path's expression and order, a few
ulp apart (the kernel's `exp` is `ex2.approx` of x log2(e); the sums use fused multiply-adds).
"""

import torch

from .triton_support import kernels_run_on, triton


# Frames (spectrum) and samples (overlap-add) per program.
BLOCK = 512
NUM_WARPS = 4
# Magnitudes are clipped to this before the inverse FFT (the reference's `torch.clip(magnitude, max=1e2)`).
MAX_MAGNITUDE = 1e2


def spectrum_reference(hidden: torch.Tensor, num_bins: int) -> torch.Tensor:
    """conv_post's output (batch, 2 * num_bins, frames) -> complex spectrum (batch, num_bins, frames): magnitude
    `min(exp(hidden[:, :num_bins]), 100)`, phase `sin(hidden[:, num_bins:])` (the extra sin is part of the trained
    model)."""
    magnitude = torch.clip(torch.exp(hidden[:, :num_bins]), max=MAX_MAGNITUDE)
    phase = torch.sin(hidden[:, num_bins:])
    return torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))


def overlap_add_reference(
    frames: torch.Tensor, window: torch.Tensor, hop_length: int, drop_last: int, limit: float
) -> torch.Tensor:
    """Inverse-FFT frames (batch, n_fft, num_frames) -> wav (batch, hop * (num_frames - 1) - drop_last), in
    [-limit, limit].

    Same arithmetic as `torch.istft(center=True)` (bit-identical on CPU) but without its host-synchronising
    window-envelope check, so it can be captured in CUDA graphs: window, overlap-add, divide by the overlap-added
    squared window, drop n_fft // 2 samples at both ends; then the last `drop_last` samples go and the rest is
    clamped."""
    n_fft, num_frames = frames.shape[1], frames.shape[-1]
    frames = frames * window[:, None]
    length = n_fft + hop_length * (num_frames - 1)
    squared_window = (window * window)[None, None, :].expand(1, num_frames, n_fft)
    # unfold_backward is the overlap-add torch.istft itself uses (same summation order).
    overlap_add = torch.ops.aten.unfold_backward
    wav = overlap_add(frames.transpose(1, 2), [frames.shape[0], length], 1, n_fft, hop_length)
    envelope = overlap_add(squared_window, [1, length], 1, n_fft, hop_length)
    trim = slice(n_fft // 2, length - n_fft // 2 - drop_last)
    return torch.clamp(wav[:, trim] / envelope[:, trim], -limit, limit)


def hift_spectrum(hidden: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[`spectrum_reference`], one kernel on CUDA at inference (a complex view of its float32 output)."""
    if _kernel_applies(hidden):
        return torch.view_as_complex(torch.ops.funaudiochat.hift_spectrum(hidden, num_bins))
    return spectrum_reference(hidden, num_bins)


def hift_overlap_add(
    frames: torch.Tensor, window: torch.Tensor, hop_length: int, drop_last: int, limit: float
) -> torch.Tensor:
    """[`overlap_add_reference`], one kernel on CUDA at inference."""
    if _kernel_applies(frames, window):
        return torch.ops.funaudiochat.hift_overlap_add(frames, window, hop_length, drop_last, limit)
    return overlap_add_reference(frames, window, hop_length, drop_last, limit)


def float32_kernel_applies(*tensors: torch.Tensor) -> bool:
    """Whether a float32-only HiFT Triton kernel runs (here and in `source_merge_cosyvoice3`): float32 tensors on a
    GPU the kernels run on (`kernels_run_on`) with no gradient to keep, not inside torch.compile (which fuses the
    torch ops itself). Shapes and flags only."""
    if torch.compiler.is_compiling():
        return False
    if not all(kernels_run_on(tensor) and tensor.dtype == torch.float32 for tensor in tensors):
        return False
    return not (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors))


_kernel_applies = float32_kernel_applies  # the name the dispatchers read (tests replace it)


if triton is not None:
    import triton.language as tl

    # Frame counts and strides vary with the window: no divisibility specialisation, which would compile a new
    # variant on many a streamed window (unit strides still specialise).
    @triton.jit(
        do_not_specialize=["frames"],
        do_not_specialize_on_alignment=["h_ptr", "out_ptr", "stride_hb", "stride_hc", "stride_ht"],
    )
    def _spectrum_kernel(
        h_ptr, out_ptr, frames, stride_hb, stride_hc, stride_ht, NUM_BINS: tl.constexpr, MAX_MAGNITUDE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Grid `(cdiv(frames, BLOCK), NUM_BINS, batch)`: BLOCK frames of one bin; out `(batch, NUM_BINS, frames, 2)`
        contiguous (real, imaginary)."""
        b = tl.program_id(2).to(tl.int64)
        k = tl.program_id(1)
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = t < frames
        rows = h_ptr + b * stride_hb + t * stride_ht
        log_magnitude = tl.load(rows + k * stride_hc, mask=ok, other=0.0)
        magnitude = tl.minimum(tl.exp(log_magnitude), MAX_MAGNITUDE)
        phase = tl.sin(tl.load(rows + (k + NUM_BINS) * stride_hc, mask=ok, other=0.0))
        out = out_ptr + ((b * NUM_BINS + k) * frames + t) * 2
        tl.store(out, magnitude * tl.cos(phase), mask=ok)
        tl.store(out + 1, magnitude * tl.sin(phase), mask=ok)

    @triton.jit(
        do_not_specialize=["num_frames", "samples"],
        do_not_specialize_on_alignment=["f_ptr", "window_ptr", "out_ptr", "stride_fb", "stride_fk", "stride_ft"],
    )
    def _overlap_add_kernel(
        f_ptr, window_ptr, out_ptr, num_frames, samples, limit, stride_fb, stride_fk, stride_ft,
        N_FFT: tl.constexpr, HOP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Grid `(cdiv(samples, BLOCK), batch)`: BLOCK output samples; sample n is position m = n + N_FFT // 2 of
        the overlap-added signal, the sum over the frames f that cover it (tap m - f HOP < N_FFT) of frame f's tap
        times the window, divided by the sum of the squared window over the same taps, clamped."""
        b = tl.program_id(1).to(tl.int64)
        n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = n + N_FFT // 2
        wav = tl.zeros((BLOCK,), dtype=tl.float32)
        envelope = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range((N_FFT + HOP - 1) // HOP):  # the frames that cover a sample, last one first
            f = m // HOP - j
            tap = m - f * HOP
            ok = (n < samples) & (f >= 0) & (f < num_frames) & (tap < N_FFT)
            w = tl.load(window_ptr + tap, mask=ok, other=0.0)
            x = tl.load(f_ptr + b * stride_fb + tap * stride_fk + f * stride_ft, mask=ok, other=0.0)
            wav += x * w
            envelope += w * w
        y = tl.math.div_rn(wav, tl.where(n < samples, envelope, 1.0))
        y = tl.minimum(tl.maximum(y, -limit), limit)
        tl.store(out_ptr + b * samples + n, y, mask=n < samples)


# Opaque operators (CUDA graphs replay them; their host code depends on shapes and strides only).
@torch.library.custom_op("funaudiochat::hift_spectrum", mutates_args=())
def hift_spectrum_op(hidden: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[`spectrum_reference`] as one Triton kernel: hidden float32 (batch, 2 * num_bins, frames), any strides ->
    (batch, num_bins, frames, 2) float32 (real, imaginary; `torch.view_as_complex` takes it)."""
    batch, channels, frames = hidden.shape
    if channels != 2 * num_bins:
        raise ValueError(f"hidden must have 2 * {num_bins} channels, got {channels}")
    out = hidden.new_empty(batch, num_bins, frames, 2)
    if out.numel():
        grid = (triton.cdiv(frames, BLOCK), num_bins, batch)
        _spectrum_kernel[grid](
            hidden, out, frames, *hidden.stride(), NUM_BINS=num_bins, MAX_MAGNITUDE=MAX_MAGNITUDE, BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


@hift_spectrum_op.register_fake
def _(hidden, num_bins):
    return hidden.new_empty(hidden.shape[0], num_bins, hidden.shape[2], 2)


@torch.library.custom_op("funaudiochat::hift_overlap_add", mutates_args=())
def hift_overlap_add_op(
    frames: torch.Tensor, window: torch.Tensor, hop_length: int, drop_last: int, limit: float
) -> torch.Tensor:
    """[`overlap_add_reference`] as one Triton kernel: frames float32 (batch, n_fft, num_frames), any strides;
    window (n_fft,) -> (batch, hop_length * (num_frames - 1) - drop_last)."""
    batch, n_fft, num_frames = frames.shape
    if window.shape != (n_fft,):
        raise ValueError(f"window must be ({n_fft},), got {tuple(window.shape)}")
    samples = _overlap_add_samples(num_frames, hop_length, drop_last)
    out = frames.new_empty(batch, samples)
    if out.numel():
        grid = (triton.cdiv(samples, BLOCK), batch)
        _overlap_add_kernel[grid](
            frames, window.contiguous(), out, num_frames, samples, limit, *frames.stride(), N_FFT=n_fft,
            HOP=hop_length, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


@hift_overlap_add_op.register_fake
def _(frames, window, hop_length, drop_last, limit):
    return frames.new_empty(frames.shape[0], _overlap_add_samples(frames.shape[2], hop_length, drop_last))


def _overlap_add_samples(num_frames: int, hop_length: int, drop_last: int) -> int:
    return max(0, hop_length * (num_frames - 1) - drop_last)


__all__ = [
    "float32_kernel_applies",
    "hift_overlap_add",
    "hift_overlap_add_op",
    "hift_spectrum",
    "hift_spectrum_op",
    "overlap_add_reference",
    "spectrum_reference",
]
