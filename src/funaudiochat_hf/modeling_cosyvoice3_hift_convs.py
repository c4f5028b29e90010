"""HiFT's convolution layers: one-sided (causal / look-ahead) convs, the weight-norm conv of the F0 predictor,
nearest-neighbour upsampling and strided downsampling convs, Snake and the residual blocks, plus the layout helpers
that run them channels-last (`CosyVoice3HiFTGenerator.use_channels_last_convolutions`).

Inputs are (batch, channels, frames), or (batch, channels, 1, frames) for the channels-last filter.
"""

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .snake_cosyvoice3 import add_bias_and_residual, snake


def _hold(values: torch.Tensor, factor: int) -> torch.Tensor:
    """Nearest-neighbour upsampling of the last dim by an integer factor: (..., n) -> (..., n * factor).
    Equals `repeat_interleave` / `interpolate(mode="nearest")`, written as expand + reshape so that it never needs the
    output size from the device."""
    return values.unsqueeze(-1).expand(*values.shape, factor).flatten(-2)


def _pad_one_side(
    hidden: torch.Tensor, padding: int, causal_type: str, context: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Pad `padding` frames on the left (causal) or right (look-ahead): zeros, or the given `context` frames."""
    if context is None:
        return F.pad(hidden, (padding, 0) if causal_type == "left" else (0, padding))
    if context.shape[-1] != padding:
        raise ValueError(f"context must have {padding} frames, got {context.shape[-1]}")
    return torch.cat([context, hidden] if causal_type == "left" else [hidden, context], dim=-1)


# Channel counts (in and out) a conv needs to run channels-last under `use_channels_last_convolutions`.
_CHANNELS_LAST_ALIGNMENT = 8


def _channels_last_eligible(conv: nn.Conv1d) -> bool:
    """Whether `use_channels_last_convolutions` runs `conv` channels-last: both channel counts multiples of 8.

    cuDNN's NHWC tensor-core kernels need the channels in 16-byte vectors (C and K multiples of 4 in TF32 / float32:
    `..._nhwc_align4`; of 8 in half precision). Otherwise it falls back to slow kernels: HiFT's
    18-channel convs (the source STFT into `source_downs`, `conv_post` out to n_fft + 2) ran as
    `sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_..._nhwc`, an order of magnitude slower than in the default layout.
    Multiples of 8 cover both precisions; every other conv of the released HiFT has 64 to 512 channels."""
    return conv.in_channels % _CHANNELS_LAST_ALIGNMENT == 0 and conv.out_channels % _CHANNELS_LAST_ALIGNMENT == 0


def _conv(conv: nn.Conv1d, hidden: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """`conv(hidden)` (no padding) for (batch, in, frames) or for the (batch, in, 1, frames) layout that
    `CosyVoice3HiFTGenerator.use_channels_last_convolutions` runs the filter in; `bias=False` leaves out the bias
    (for a caller that adds it in its next element-wise op).

    The 4-D case calls conv2d with the weight viewed as (out, in, 1, kernel): ATen's conv1d makes every 3-D input
    contiguous before viewing it as 4-D, so only a 4-D call lets a channels-last input reach cuDNN unconverted.
    A conv that is not `_channels_last_eligible` runs as a plain conv1d on the 3-D view (input made contiguous,
    which Inductor writes in the element-wise kernel before it) and returns a contiguous (batch, out, 1, frames)."""
    bias = conv.bias if bias else None
    if hidden.dim() == 3:
        return conv._conv_forward(hidden, conv.weight, bias)
    if not _channels_last_eligible(conv):
        return conv._conv_forward(hidden.squeeze(2), conv.weight, bias).unsqueeze(2)
    if conv.dilation[0] > 1 and conv.stride[0] == 1 and conv.groups == 1:
        return _dilated_conv_channels_last(conv, hidden, bias)
    return F.conv2d(hidden, conv.weight.unsqueeze(2), bias, (1, conv.stride[0]), 0, (1, conv.dilation[0]), conv.groups)


def _frames_major(hidden: torch.Tensor, columns: int) -> torch.Tensor:
    """A channels-last (batch, channels, 1, frames) tensor viewed as the channels-last (batch, channels,
    frames / columns, columns) tensor with the same memory: frame `h * columns + w` at row h, column w."""
    batch, channels, _, frames = hidden.shape
    return hidden.permute(0, 2, 3, 1).reshape(batch, frames // columns, columns, channels).permute(0, 3, 1, 2)


def _as_frames(hidden: torch.Tensor, channels: int) -> torch.Tensor:
    """A channels-last (batch, c, h, w) tensor as the channels-last (batch, channels, 1, h * w * c / channels)
    tensor with the same memory. With `channels` = c, the inverse of `_frames_major`; with c = phases * channels
    (h = 1), each frame's phases in order become consecutive frames (polyphase upsampling)."""
    return hidden.permute(0, 2, 3, 1).reshape(hidden.shape[0], 1, -1, channels).permute(0, 3, 1, 2)


def _dilated_conv_channels_last(conv: nn.Conv1d, hidden: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A stride-1 conv with dilation d on a channels-last (batch, in, 1, frames) input, as an undilated conv.

    Frame t = h * d + w of the input viewed as a (frames / d, d) grid (the same memory, see `_frames_major`): the
    taps t, t + d, ..., t + (k - 1) d of a dilated conv are the rows h .. h + k - 1 of column w, so the conv is a
    (k, 1) conv over the grid without dilation. cuDNN has no NHWC kernel for dilated convs: it converts the input and
    the weight on every call and runs an NCHW kernel (conversions costing a large fraction of the conv itself, for
    each of the released HiFT's 18 dilated convs). Equal up to float rounding."""
    dilation, kernel = conv.dilation[0], conv.kernel_size[0]
    frames = hidden.shape[-1]
    out_frames = frames - (kernel - 1) * dilation
    extra = -frames % dilation  # zero frames on the right (their outputs are dropped) to fill the last grid row
    if extra:
        hidden = F.pad(hidden, (0, extra))
    out = F.conv2d(_frames_major(hidden, dilation), conv.weight.unsqueeze(3), bias)
    return _as_frames(out, out.shape[1])[..., :out_frames]


def _channels_last_1d(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in, kernel) tensor with the same values stored as (out, kernel, in): strides (in * kernel, 1, in).
    Its view as (out, in, 1, kernel) is channels-last contiguous (NHWC with H = 1)."""
    return weight.transpose(1, 2).contiguous().transpose(1, 2)


class CausalConv1d(nn.Conv1d):
    """Stride-1 Conv1d padded on one side only, so that the output has as many frames as the input.

    `causal_type="left"` pads `(kernel_size - 1) * dilation` zeros on the left (causal); `"right"` pads them on the
    right (look-ahead). A `context` tensor of exactly that many frames replaces the zero padding, which is how
    non-final streaming calls feed real look-ahead frames.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, causal_type: str = "left"
    ):
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation)
        if causal_type not in ("left", "right"):
            raise ValueError(f"causal_type must be 'left' or 'right', got {causal_type!r}")
        self.causal_type = causal_type
        self.causal_padding = (kernel_size - 1) * dilation

    def forward(
        self, hidden: torch.Tensor, context: Optional[torch.Tensor] = None, padded: bool = False, bias: bool = True
    ) -> torch.Tensor:
        """(batch, in_channels, frames) -> (batch, out_channels, frames); also (batch, in_channels, 1, frames).

        padded=True: `hidden` already holds the padding (`causal_padding` more frames, as `Snake(left_padding=...)`
        writes them), so the conv runs on it as it is. bias=False: without the bias (the caller adds it in its next
        element-wise op, as `CausalResBlock` does)."""
        if padded:
            if context is not None:
                raise ValueError("padded=True takes no context: the padding frames are part of the input")
            return _conv(self, hidden, bias)
        return _conv(self, _pad_one_side(hidden, self.causal_padding, self.causal_type, context), bias)


class WeightNormCausalConv1d(nn.Module):
    """`CausalConv1d` (stride 1, dilation 1) that keeps weight norm: `weight = weight_g * weight_v / ||weight_v||`
    is evaluated at run time in the dtype of the input.

    Used by the F0 predictor, which the reference runs in float64 with the weight norm evaluated in float64: folding
    it once into a float32 weight would shift f0 by ~1e-5 relative, enough to flip voiced/unvoiced decisions near
    the threshold. Parameters: `weight_g` (out, 1, 1), `weight_v` (out, in, kernel), `bias` (out,).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, causal_type: str = "left"):
        super().__init__()
        if causal_type not in ("left", "right"):
            raise ValueError(f"causal_type must be 'left' or 'right', got {causal_type!r}")
        self.causal_type = causal_type
        self.causal_padding = kernel_size - 1
        self.weight_g = nn.Parameter(torch.empty(out_channels, 1, 1))
        self.weight_v = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """PyTorch's default Conv1d init, with g set so that the initial weight equals v (as `weight_norm` does)."""
        nn.init.kaiming_uniform_(self.weight_v, a=math.sqrt(5))
        bound = 1 / math.sqrt(self.weight_v.shape[1] * self.weight_v.shape[2])
        nn.init.uniform_(self.bias, -bound, bound)
        self.weight_g.copy_(torch.linalg.vector_norm(self.weight_v, dim=(1, 2), keepdim=True))

    def forward(self, hidden: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(batch, in_channels, frames) -> (batch, out_channels, frames), computed in hidden.dtype."""
        weight, bias = _inference_cached(self, (self.weight_v, self.weight_g, self.bias), hidden.dtype, self._weights)
        hidden = _pad_one_side(hidden, self.causal_padding, self.causal_type, context)
        return conv1d_as_matmul(hidden, weight, bias)

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return torch._weight_norm(self.weight_v.to(dtype), self.weight_g.to(dtype), 0), self.bias.to(dtype)


def _inference_cached(owner: nn.Module, parameters: tuple, dtype: torch.dtype, compute) -> tuple:
    """`compute(dtype)`, kept on `owner` from one call to the next while `parameters` are unchanged (same storage,
    no in-place update: `_version`) and no gradient is needed.

    For the F0 predictor, which runs in float64 on every streamed chunk: its weights' casts and weight norm are
    ~22 small kernel launches per streamed chunk for values that only change with the weights. The
    cache holds one float64 copy of the predictor's weights (~26 MB at full size)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(p.requires_grad for p in parameters)):
        return compute(dtype)
    if any(p.is_inference() for p in parameters):  # created under inference_mode: no version counter to check
        return compute(dtype)
    key = (dtype, *((p.data_ptr(), p._version) for p in parameters))
    cached = getattr(owner, "_inference_cache", None)
    if cached is None or cached[0] != key:
        cached = (key, compute(dtype))
        owner._inference_cache = cached
    return cached[1]


def conv1d_as_matmul(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`F.conv1d(hidden, weight, bias)` (stride 1, no padding) as one GEMM over the unfolded frames:
    hidden (batch, in, frames), weight (out, in, kernel), bias (out,) -> (batch, out, frames - kernel + 1).

    For the float64 F0 predictor: cuDNN has no fast float64 convolution (a k=3, 512-channel conv over ~40 frames
    measured dozens of times slower than a float64 GEMM of that size). Same sums, in another order.
    """
    out_channels, in_channels, kernel = weight.shape
    batch, _, frames = hidden.shape
    # (batch, frames', in, kernel) -> (batch, frames', in * kernel), matching weight.reshape(out, in * kernel).
    columns = hidden.unfold(2, kernel, 1).transpose(1, 2).reshape(batch, frames - kernel + 1, in_channels * kernel)
    return torch.addmm(bias, columns.flatten(0, 1), weight.reshape(out_channels, -1).t()).view(
        batch, frames - kernel + 1, out_channels
    ).transpose(1, 2)


class CausalConv1dUpsample(nn.Conv1d):
    """Nearest-neighbour upsampling by `stride` followed by a causal (left-padded) conv: the reference's
    replacement for a transposed convolution. (batch, in, frames) -> (batch, out, frames * stride)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.upsample_factor = stride
        # `polyphase_weight()` and the bias repeated per phase, kept by `store_polyphase_weight` (non-persistent).
        self.register_buffer("polyphase", None, persistent=False)
        self.register_buffer("polyphase_bias", None, persistent=False)
        self.register_load_state_dict_post_hook(_refresh_polyphase_weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        needs_gradient = torch.is_grad_enabled() and self.weight.requires_grad  # none reaches `weight` via the copy
        if hidden.dim() == 4 and self.polyphase is not None and not needs_gradient:
            return self._polyphase_forward(hidden)
        hidden = _hold(hidden, self.upsample_factor)
        return _conv(self, F.pad(hidden, (self.kernel_size[0] - 1, 0)))

    @torch.no_grad()
    def store_polyphase_weight(self) -> None:
        """Keep `polyphase_weight()` (stored channels-last) and the bias repeated per phase: from then on a
        channels-last (batch, in, 1, frames) input runs polyphase when no gradient is needed
        (`use_channels_last_convolutions` calls it, `load_state_dict` refreshes it). Taken now: call it again
        after changing the weight in place."""
        self.polyphase = _channels_last_1d(self.polyphase_weight())
        self.polyphase_bias = None if self.bias is None else self.bias.repeat(self.upsample_factor)

    def drop_polyphase_weight(self) -> None:
        self.polyphase = self.polyphase_bias = None

    @torch.no_grad()
    def polyphase_weight(self) -> torch.Tensor:
        """The conv of the held (nearest-neighbour upsampled) signal as `stride` convs of the input signal, one per
        output phase: `(stride * out, in, taps)`, rows phase-major, taps = ceil((kernel - 1) / stride) + 1.

        Output frame n = t * stride + p reads the held frames n - (kernel - 1) + j, j < kernel, i.e. the input frames
        t + floor((p - (kernel - 1) + j) / stride): the taps that read the same input frame are summed."""
        weight, rate = self.weight, self.upsample_factor
        out_channels, in_channels, kernel = weight.shape
        taps = -(-(kernel - 1) // rate) + 1
        phases = weight.new_zeros(rate, out_channels, in_channels, taps)
        for phase in range(rate):
            for j in range(kernel):
                phases[phase, :, :, (phase - (kernel - 1) + j) // rate + taps - 1] += weight[:, :, j]
        return phases.flatten(0, 1)

    def _polyphase_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Channels-last (batch, in, 1, frames) -> (batch, out, 1, frames * stride) without materialising the held
        signal: one conv with `stride` times the output channels at the input rate (stride times fewer
        multiply-adds; cuDNN ran the first upsampling conv of the released HiFT, 512 -> 256 channels with k=16 over
        the held frames, as one slow kernel). Its output (batch, stride * out, 1, frames) holds, frames
        major, each frame's phases in order: the same memory as the interleaved (batch, out, 1, frames * stride).
        Equal up to float rounding (taps summed in the weight)."""
        taps = self.polyphase.shape[-1]
        out = F.conv2d(F.pad(hidden, (taps - 1, 0)), self.polyphase.unsqueeze(2), self.polyphase_bias)
        return _as_frames(out, self.out_channels)


def _refresh_polyphase_weight(module: "CausalConv1dUpsample", incompatible_keys) -> None:
    """`load_state_dict` post-hook: new weights, new polyphase copy (when one is kept)."""
    if module.polyphase is not None:
        module.store_polyphase_weight()


class CausalConv1dDownsample(nn.Conv1d):
    """Strided conv with `stride - 1` zeros of left padding. (batch, in, frames) -> (batch, out, ~frames / stride)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _conv(self, F.pad(hidden, (self.stride[0] - 1, 0)))


class Snake(nn.Module):
    """Snake activation `x + sin(alpha * x)^2 / alpha` with a per-channel alpha on a linear scale (no exp); one
    Triton kernel on CUDA at inference (`snake_cosyvoice3.snake`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(
        self, hidden: torch.Tensor, left_padding: int = 0, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """(batch, channels, frames) -> (batch, channels, left_padding + frames): the activation of `hidden + bias`
        (bias: None or (channels,), the bias of the conv before) after `left_padding` zero frames (the causal padding
        of the conv after); also (batch, channels, 1, frames)."""
        return snake(hidden, self.alpha, left_padding, bias)


class CausalResBlock(nn.Module):
    """HiFi-GAN residual block with Snake activations and causal dilated convs: for each dilation d,
    `x = x + conv_k(snake(conv_{k,d}(snake(x))))`."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]):
        super().__init__()
        self.convs1 = nn.ModuleList(CausalConv1d(channels, channels, kernel_size, dilation=d) for d in dilations)
        self.convs2 = nn.ModuleList(CausalConv1d(channels, channels, kernel_size) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, channels, frames) -> same shape."""
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            # The element-wise kernel after each conv adds its bias (ATen adds a conv's bias in a kernel of its own on
            # CUDA), and each Snake writes the causal padding of the conv after it (no F.pad copy).
            out = conv1(act1(hidden, conv1.causal_padding), padded=True, bias=False)
            out = conv2(act2(out, conv2.causal_padding, conv1.bias), padded=True, bias=False)
            hidden = add_bias_and_residual(out, conv2.bias, hidden)
        return hidden


__all__ = [
    "CausalConv1d",
    "CausalConv1dDownsample",
    "CausalConv1dUpsample",
    "CausalResBlock",
    "Snake",
    "WeightNormCausalConv1d",
    "conv1d_as_matmul",
]
