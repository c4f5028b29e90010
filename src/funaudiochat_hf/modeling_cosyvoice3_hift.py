"""CosyVoice3 HiFT vocoder (`CausalHiFTGenerator` of Fun-CosyVoice3-0.5B): 80-bin log-mel -> 24 kHz waveform.

Neural source filter + iSTFT vocoder, fully causal so it can run on a growing mel history:

    mel (batch, 80, frames)
      -> F0 predictor (float64, 3 frames of look-ahead)             f0 (batch, frames) in Hz
      -> harmonic source (9 sample-and-hold sines + fixed noise)   source (batch, 1, 480 * frames)
      -> STFT of the source, fused into a conv upsampling stack (x8, x5, x3) with Snake residual blocks
      -> 9 log-magnitudes + 9 phases -> iSTFT (n_fft 16, hop 4) -> clamp to +-0.99   wav (batch, 480 * frames)

Everything reproduces the reference (FunAudioLLM/CosyVoice `cosyvoice/hifigan/generator.py`), including the quirks the
model was trained with: the F0 predictor runs in float64, the "sine" phase is a 50 Hz staircase, the source noise comes
from a fixed table of uniform random numbers indexed from sample 0, the phase channels pass through an extra `sin`,
the last activation uses slope 0.01 and the output is hard-clamped.

Weight norm is folded into plain conv weights when an original checkpoint is loaded
(`CosyVoice3HiFTGenerator.load_original_state_dict`), so the filter pays nothing for it. Only the small F0 predictor
keeps `weight_g`/`weight_v`, because the reference evaluates its weight norm in float64.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


# The reference draws its source-noise table for 300 s of 24 kHz audio, independently of the configured sampling rate.
REFERENCE_SOURCE_TABLE_SAMPLES = 300 * 24000

_WEIGHT_NORM_SUFFIXES = (
    # (magnitude g, direction v): torch >= 2.1 parametrisation names, then the legacy `weight_norm` names
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    (".weight_g", ".weight_v"),
)


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
    `..._nhwc_align4`; of 8 in half precision). Otherwise it falls back to slow kernels: on an H200, HiFT's
    18-channel convs (the source STFT into `source_downs`, `conv_post` out to n_fft + 2) ran as
    `sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_..._nhwc` (one call ~218 us vs ~15 us for the default layout).
    Multiples of 8 cover both precisions; every other conv of the released HiFT has 64 to 512 channels."""
    return conv.in_channels % _CHANNELS_LAST_ALIGNMENT == 0 and conv.out_channels % _CHANNELS_LAST_ALIGNMENT == 0


def _conv(conv: nn.Conv1d, hidden: torch.Tensor) -> torch.Tensor:
    """`conv(hidden)` (no padding) for (batch, in, frames) or for the (batch, in, 1, frames) layout that
    `CosyVoice3HiFTGenerator.use_channels_last_convolutions` runs the filter in.

    The 4-D case calls conv2d with the weight viewed as (out, in, 1, kernel): ATen's conv1d makes every 3-D input
    contiguous before viewing it as 4-D, so only a 4-D call lets a channels-last input reach cuDNN unconverted.
    A conv that is not `_channels_last_eligible` runs as a plain conv1d on the 3-D view (input made contiguous,
    which Inductor writes in the element-wise kernel before it) and returns a contiguous (batch, out, 1, frames)."""
    if hidden.dim() == 3:
        return nn.Conv1d.forward(conv, hidden)
    if not _channels_last_eligible(conv):
        return nn.Conv1d.forward(conv, hidden.squeeze(2)).unsqueeze(2)
    if conv.dilation[0] > 1 and conv.stride[0] == 1 and conv.groups == 1:
        return _dilated_conv_channels_last(conv, hidden)
    return F.conv2d(
        hidden, conv.weight.unsqueeze(2), conv.bias, (1, conv.stride[0]), 0, (1, conv.dilation[0]), conv.groups
    )


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


def _dilated_conv_channels_last(conv: nn.Conv1d, hidden: torch.Tensor) -> torch.Tensor:
    """A stride-1 conv with dilation d on a channels-last (batch, in, 1, frames) input, as an undilated conv.

    Frame t = h * d + w of the input viewed as a (frames / d, d) grid (the same memory, see `_frames_major`): the
    taps t, t + d, ..., t + (k - 1) d of a dilated conv are the rows h .. h + k - 1 of column w, so the conv is a
    (k, 1) conv over the grid without dilation. cuDNN has no NHWC kernel for dilated convs: it converts the input and
    the weight on every call and runs an NCHW kernel (on an H200, ~8 us of conversions on top of a 12-21 us conv for
    each of the released HiFT's 18 dilated convs). Equal up to float rounding."""
    dilation, kernel = conv.dilation[0], conv.kernel_size[0]
    frames = hidden.shape[-1]
    out_frames = frames - (kernel - 1) * dilation
    extra = -frames % dilation  # zero frames on the right (their outputs are dropped) to fill the last grid row
    if extra:
        hidden = F.pad(hidden, (0, extra))
    out = F.conv2d(_frames_major(hidden, dilation), conv.weight.unsqueeze(3), conv.bias)
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

    def forward(self, hidden: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(batch, in_channels, frames) -> (batch, out_channels, frames); also (batch, in_channels, 1, frames)."""
        return _conv(self, _pad_one_side(hidden, self.causal_padding, self.causal_type, context))


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
    ~22 small kernels per call (~85 µs of a chunk on an H200) for values that only change with the weights. The
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
    took ~170 us on an H200), while a float64 GEMM of that size is a few us. Same sums, in another order.
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
        multiply-adds; on an H200 cuDNN ran the first upsampling conv of the released HiFT, 512 -> 256 channels with
        k=16 over the held frames, as a 216 us kernel). Its output (batch, stride * out, 1, frames) holds, frames
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
    """Snake activation `x + sin(alpha * x)^2 / alpha` with a per-channel alpha on a linear scale (no exp)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, channels, frames) -> same shape; also (batch, channels, 1, frames)."""
        alpha = self.alpha.reshape((-1,) + (1,) * (hidden.dim() - 2))
        # Same expression and evaluation order as the reference (the 1e-9 guards alpha == 0).
        return hidden + (1.0 / (alpha + 1e-9)) * torch.pow(torch.sin(hidden * alpha), 2)


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
            hidden = conv2(act2(conv1(act1(hidden)))) + hidden
        return hidden


class CausalConvF0Predictor(nn.Module):
    """`CausalConvRNNF0Predictor`: F0 in Hz per mel frame.

    condnet = look-ahead conv (k=4, 3 frames of right context) then 4 causal convs (k=3), ELU after each (ELUs sit at
    the odd Sequential indices, which fixes the checkpoint key names); then Linear -> |.|. The convs keep their
    weight norm (see `WeightNormCausalConv1d`).
    """

    def __init__(self, num_class: int = 1, in_channels: int = 80, cond_channels: int = 512):
        super().__init__()
        layers = [WeightNormCausalConv1d(in_channels, cond_channels, kernel_size=4, causal_type="right"), nn.ELU()]
        for _ in range(4):
            layers += [WeightNormCausalConv1d(cond_channels, cond_channels, kernel_size=3), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    @property
    def lookahead(self) -> int:
        """Mel frames of right context the first conv needs (3)."""
        return self.condnet[0].causal_padding

    @property
    def left_context(self) -> int:
        """Mel frames before a frame that its f0 depends on (8: four k=3 causal convs); with at least that many real
        frames before it, a frame's f0 is the same as in a run over the whole history."""
        convs = [layer for layer in self.condnet if isinstance(layer, WeightNormCausalConv1d)]
        return sum(conv.causal_padding for conv in convs if conv.causal_type == "left")

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel (batch, in_channels, frames) -> f0 (batch, frames) if finalize else (batch, frames - lookahead).

        Runs in the dtype of `mel` (the generator passes float64)."""
        first = self.condnet[0]
        if finalize:
            hidden = first(mel)
        else:
            hidden = first(mel[..., : -self.lookahead], context=mel[..., -self.lookahead :])
        for layer in self.condnet[1:]:
            hidden = layer(hidden)
        hidden = hidden.transpose(1, 2)
        classifier = self.classifier
        weight, bias = _inference_cached(
            classifier,
            (classifier.weight, classifier.bias),
            hidden.dtype,
            lambda dtype: (classifier.weight.to(dtype), classifier.bias.to(dtype)),
        )
        return torch.abs(F.linear(hidden, weight, bias).squeeze(-1))


class SineGenerator(nn.Module):
    """Causal `SineGen2`: harmonic sines with the reference's fixed, construction-time random tables.

    Holds the non-persistent tables `rand_ini` (1, harmonics) and `sine_waves` (1, table_samples, harmonics); both
    are empty until `CosyVoice3HiFTGenerator.init_source_tables` fills them.
    """

    def __init__(self, num_harmonics: int):
        super().__init__()
        # rand_ini is kept for fidelity with the reference tables: in the causal path it is added at sample 0,
        # which the 1/upsample_scale linear downsampling never reads, so it has no effect on the output.
        self.register_buffer("rand_ini", torch.zeros(1, num_harmonics), persistent=False)
        self.register_buffer("sine_waves", torch.zeros(1, 0, num_harmonics), persistent=False)


class SourceModuleHnNSF(nn.Module):
    """Harmonic-plus-noise excitation: sines (fundamental + overtones) merged by Linear -> tanh."""

    def __init__(self, num_harmonics: int):
        super().__init__()
        self.l_sin_gen = SineGenerator(num_harmonics)
        self.l_linear = nn.Linear(num_harmonics, 1)


class CosyVoice3HiFTGenerator(nn.Module):
    """CosyVoice3's causal HiFT vocoder. Constructor arguments are named exactly like the `hift:` section of
    `cosyvoice3.yaml`; every default is the full-size Fun-CosyVoice3-0.5B value.

    After construction (or loading), call `init_source_tables()` once to build the fixed source-noise tables.

    Batch rows are independent: row b of a batch equals that row run alone (up to float32 kernel noise). Rows of
    unequal length: right-pad the mel with zeros (the same zeros the reference's look-ahead convs pad with when
    finalising) and trim each row's wav to `480 * valid_frames` samples (finalize=True). That reproduces a single-row
    run except for roughly the last `n_fft * hop_len` (64) samples of each padded row, where the reference's STFT/iSTFT
    see the true end of the signal; run such rows alone when those samples must match exactly. Padding with anything
    but zeros also changes the last 4 valid frames (look-ahead convs).
    """

    def __init__(
        self,
        in_channels: int = 80,
        base_channels: int = 512,
        nb_harmonics: int = 8,
        sampling_rate: int = 24000,
        nsf_alpha: float = 0.1,
        nsf_sigma: float = 0.003,
        nsf_voiced_threshold: float = 10,
        upsample_rates: Sequence[int] = (8, 5, 3),
        upsample_kernel_sizes: Sequence[int] = (16, 11, 7),
        istft_params: Optional[Mapping[str, int]] = None,
        resblock_kernel_sizes: Sequence[int] = (3, 7, 11),
        resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        source_resblock_kernel_sizes: Sequence[int] = (7, 7, 11),
        source_resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        lrelu_slope: float = 0.1,
        audio_limit: float = 0.99,
        conv_pre_look_right: int = 4,
        f0_predictor: Optional[Mapping[str, int]] = None,
    ):
        super().__init__()
        istft_params = dict(istft_params) if istft_params is not None else {"n_fft": 16, "hop_len": 4}
        f0_predictor = dict(f0_predictor) if f0_predictor is not None else {}
        upsample_rates = [int(rate) for rate in upsample_rates]
        if len(upsample_kernel_sizes) != len(upsample_rates):
            raise ValueError(
                f"upsample_kernel_sizes ({len(upsample_kernel_sizes)}) and upsample_rates ({len(upsample_rates)}) "
                "must have the same length"
            )
        if len(source_resblock_kernel_sizes) != len(upsample_rates) or len(source_resblock_dilation_sizes) != len(
            upsample_rates
        ):
            raise ValueError("source_resblock_kernel_sizes/dilation_sizes need one entry per upsampling stage")
        if len(resblock_kernel_sizes) != len(resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes must have the same length")
        if sampling_rate == 22050:
            raise ValueError("sampling_rate 22050 selects the non-causal SineGen in the reference; not supported")
        if conv_pre_look_right < 1:
            raise ValueError(f"conv_pre_look_right must be >= 1, got {conv_pre_look_right}")

        self.in_channels = in_channels
        self.num_harmonics = nb_harmonics + 1
        self.sampling_rate = sampling_rate
        self.sine_amp = nsf_alpha
        self.noise_std = nsf_sigma
        self.voiced_threshold = nsf_voiced_threshold
        self.upsample_rates = upsample_rates
        self.n_fft = int(istft_params["n_fft"])
        self.hop_length = int(istft_params["hop_len"])
        self.lrelu_slope = lrelu_slope
        self.audio_limit = audio_limit
        self.conv_pre_look_right = conv_pre_look_right
        self.num_kernels = len(resblock_kernel_sizes)
        # Waveform samples per mel frame (480) and STFT frames per mel frame (120).
        self.stft_frames_per_mel_frame = math.prod(upsample_rates)
        self.upsample_scale = self.stft_frames_per_mel_frame * self.hop_length

        self.f0_predictor = CausalConvF0Predictor(**f0_predictor)
        self.m_source = SourceModuleHnNSF(self.num_harmonics)
        self.conv_pre = CausalConv1d(in_channels, base_channels, conv_pre_look_right + 1, causal_type="right")

        self.ups = nn.ModuleList(
            CausalConv1dUpsample(base_channels // 2**i, base_channels // 2 ** (i + 1), kernel, rate)
            for i, (rate, kernel) in enumerate(zip(upsample_rates, upsample_kernel_sizes))
        )

        # The source STFT (hop 4) is brought to the resolution of each stage: strides 15, 3, 1 for rates (8, 5, 3).
        source_channels = self.n_fft + 2
        downsample_cum_rates = []
        rate = 1
        for stage_rate in [1] + upsample_rates[::-1][:-1]:
            rate *= stage_rate
            downsample_cum_rates.append(rate)
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (rate, kernel, dilations) in enumerate(
            zip(downsample_cum_rates[::-1], source_resblock_kernel_sizes, source_resblock_dilation_sizes)
        ):
            channels = base_channels // 2 ** (i + 1)
            if rate == 1:
                self.source_downs.append(CausalConv1d(source_channels, channels, 1))
            else:
                self.source_downs.append(CausalConv1dDownsample(source_channels, channels, rate * 2, rate))
            self.source_resblocks.append(CausalResBlock(channels, kernel, dilations))

        self.resblocks = nn.ModuleList()
        for i in range(len(upsample_rates)):
            channels = base_channels // 2 ** (i + 1)
            for kernel, dilations in zip(resblock_kernel_sizes, resblock_dilation_sizes):
                self.resblocks.append(CausalResBlock(channels, kernel, dilations))
        self.conv_post = CausalConv1d(channels, self.n_fft + 2, 7)
        # See `use_channels_last_convolutions` (off: the plain (batch, channels, frames) layout).
        self.channels_last_convolutions = False

    # ------------------------------------------------------------------------------------------------------------
    # loading and fixed tables

    @staticmethod
    def convert_original_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Original `hift.pt` state dict -> this module's keys: strips an optional `generator.` prefix and folds
        weight norm (`.parametrizations.weight.original0/1` or legacy `.weight_g/.weight_v`) into `.weight`.

        The fold is `torch._weight_norm(v, g, 0)`, the function the reference's parametrisation evaluates, so the
        float32 weights are bit-identical. Exception: the F0 predictor convs keep `weight_g`/`weight_v`, because the
        reference evaluates their weight norm in float64 (see `WeightNormCausalConv1d`)."""
        stripped = {}
        for key, value in state_dict.items():
            stripped[key.removeprefix("generator.")] = value
        converted = {}
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in stripped.items():
            for suffix_g, suffix_v in _WEIGHT_NORM_SUFFIXES:
                if key.endswith(suffix_g):
                    pairs.setdefault(key[: -len(suffix_g)], {})["g"] = value
                    break
                if key.endswith(suffix_v):
                    pairs.setdefault(key[: -len(suffix_v)], {})["v"] = value
                    break
            else:
                converted[key] = value
        for prefix, pair in pairs.items():
            if set(pair) != {"g", "v"}:
                missing = "magnitude (g)" if "g" not in pair else "direction (v)"
                raise ValueError(f"weight-norm pair of {prefix!r} has no {missing} entry")
            magnitude, direction = pair["g"], pair["v"]
            if prefix.startswith("f0_predictor."):
                converted[f"{prefix}.weight_g"], converted[f"{prefix}.weight_v"] = magnitude, direction
            else:
                converted[f"{prefix}.weight"] = torch._weight_norm(direction, magnitude, 0)
        return converted

    def load_original_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load an original CosyVoice3 `hift.pt` state dict (either weight-norm format, plain weights, optional
        `generator.` prefix). Strict: missing or unexpected keys raise a ValueError naming them."""
        converted = self.convert_original_state_dict(state_dict)
        expected = self.state_dict()
        missing = sorted(set(expected) - set(converted))
        unexpected = sorted(set(converted) - set(expected))
        if missing or unexpected:
            raise ValueError(f"HiFT state dict mismatch: missing keys {missing}, unexpected keys {unexpected}")
        wrong_shapes = [
            f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(expected[key].shape)}"
            for key, value in converted.items()
            if value.shape != expected[key].shape
        ]
        if wrong_shapes:
            raise ValueError("HiFT state dict shape mismatch: " + "; ".join(wrong_shapes))
        self.load_state_dict(converted, strict=True)

    @torch.no_grad()
    def init_source_tables(
        self, generator: Optional[torch.Generator] = None, max_samples: int = REFERENCE_SOURCE_TABLE_SAMPLES
    ) -> None:
        """Fill the fixed source tables (`m_source.l_sin_gen.rand_ini`, `.sine_waves`) exactly as the reference
        constructs them.

        The reference draws them from the global torch RNG while `cosyvoice3.yaml` is loaded: the flow's CFM reseeds
        it to 0 and draws its noise, the flow builds its token embedding and speaker projection, then the HiFT F0
        predictor and the source module are built. This replays that sequence on a private CPU generator (global RNG
        untouched).

        Args:
            generator: a CPU generator positioned right after the flow's construction draws. Default:
                `reference_rng_after_flow()` with the full-size CosyVoice3 flow sizes, which every published
                CosyVoice3 config has.
            max_samples: table length in samples (the longest source one call can produce). The reference uses
                300 s at 24 kHz (259 MB in float32); a shorter table is an exact prefix of it.
        """
        # The replay draws on the CPU even when the model is built under `with torch.device("cuda")`.
        with torch.device("cpu"):
            if generator is None:
                generator = reference_rng_after_flow()
            # The F0 predictor is built (default PyTorch inits: weight, then bias of each layer) before the source
            # module.
            for module in self.f0_predictor.modules():
                if isinstance(module, WeightNormCausalConv1d):
                    _skip_default_init(tuple(module.weight_v.shape), generator)
                elif isinstance(module, nn.Linear):
                    _skip_default_init(tuple(module.weight.shape), generator)
            rand_ini = torch.rand(1, self.num_harmonics, generator=generator)
            rand_ini[:, 0] = 0
            sine_waves = torch.rand(1, max_samples, self.num_harmonics, generator=generator)

        sine_gen = self.m_source.l_sin_gen
        device = self.conv_pre.weight.device
        # Kept in float32 whatever the module dtype: the source is computed in float32 like the reference.
        sine_gen.rand_ini = rand_ini.to(device=device, dtype=torch.float32)
        sine_gen.sine_waves = sine_waves.to(device=device, dtype=torch.float32)

    def filter_convolutions(self, channels_last_only: bool = False) -> list[nn.Conv1d]:
        """The convolutions `filter_body` runs (all but conv_pre and the F0 predictor); with `channels_last_only`,
        those that `use_channels_last_convolutions` runs channels-last (both channel counts multiples of 8)."""
        stack = [self.ups, self.source_downs, self.source_resblocks, self.resblocks, self.conv_post]
        convs = [module for part in stack for module in part.modules() if isinstance(module, nn.Conv1d)]
        return [conv for conv in convs if _channels_last_eligible(conv)] if channels_last_only else convs

    @torch.no_grad()
    def use_channels_last_convolutions(self, enabled: bool = True) -> None:
        """Run `filter_body` channels-last: its activations as (batch, channels, 1, frames) tensors stored
        frames-major (NHWC with H = 1) and its convolutions as conv2d over weights stored (out, kernel, in).

        For cuDNN on CUDA: with the default layout it picks NHWC kernels for these convs and converts the input and
        the weight on every call (`nchwToNhwcKernel`, ~2 per conv). With both operands channels-last, ATen passes
        them as they are and allocates a channels-last output; compiled (`CosyVoice3Token2Wav.compile_vocoder`),
        Inductor then writes the element-wise ops between convs (Snake, pads, residual sums) straight in that
        layout. Equal to the default layout up to float rounding.

        The filter's conv weights are re-strided in place (same shapes and values; `state_dict()` then holds
        non-contiguous tensors: `save_pretrained` makes them contiguous, raw `safetensors.save_file` needs
        `.contiguous()`; loading into the model keeps its layout). conv_pre stays as it is: a 3-D conv1d, which
        ATen makes contiguous anyway. `enabled=False` restores the default layout. Recompiles a compiled
        `filter_body`; re-records streaming CUDA graphs (the layout is part of their settings key).

        Two kinds of conv are rewritten for it (cuDNN has no fast NHWC kernel for them as they are; on an H200 the
        released HiFT's took a streamed chunk's vocoder from 1.90 to 1.56 ms of GPU time, BENCHMARKS.md): the
        upsampling convs run at the input rate (`CausalConv1dUpsample.store_polyphase_weight`: one conv per output
        phase, stride x fewer multiply-adds, no held signal), and the dilated resblock convs run undilated over a
        (frames / dilation, dilation) view of their input (`_dilated_conv_channels_last`).

        Exception: convs with an in- or out-channel count that is not a multiple of 8 keep the default layout
        (contiguous weight, (batch, channels, frames) input and output), because cuDNN has no fast NHWC kernel for
        them (see `_channels_last_eligible`). In the released HiFT these are the three `source_downs` (they read the
        18-channel source STFT, which then stays contiguous) and `conv_post` (64 -> 18 channels, so `filter_body`
        returns a contiguous output). Compiled, the layout switches are written by the element-wise kernels next to
        them: the leaky ReLU before conv_post writes its input contiguous, the first Snake of each source resblock
        reads the contiguous source_downs output and writes channels-last."""
        for conv in self.filter_convolutions():
            weight = conv.weight.data
            restride = enabled and _channels_last_eligible(conv)
            conv.weight.data = _channels_last_1d(weight) if restride else weight.contiguous()
        for upsample in self.ups:
            if enabled and _channels_last_eligible(upsample):
                upsample.store_polyphase_weight()
            else:
                upsample.drop_polyphase_weight()
        self.channels_last_convolutions = bool(enabled)

    # ------------------------------------------------------------------------------------------------------------
    # inference

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel (batch, in_channels, frames) -> f0 in Hz, float64, (batch, frames) if finalize else
        (batch, frames - 3): a non-final call uses the last 3 frames only as look-ahead."""
        self._check_mel(mel, finalize)
        return self.f0_predictor(mel.to(torch.float64), finalize=finalize)

    def f0_to_sample_rate(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 (batch, frames) -> (batch, frames * 480, 1): each frame's value held for its 480 samples."""
        return _hold(f0, self.upsample_scale).unsqueeze(-1)

    def source_from_f0(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 (batch, frames) in Hz -> excitation (batch, 1, frames * 480), computed in float32 like the reference.

        Sample n of harmonic h (1..9): the phase is 2*pi * h * sum_{k <= frame(n)} f0_k / sampling_rate * 480, held
        for the whole frame (a staircase, which is what the model was trained with); voiced iff f0 > threshold;
        `sines = 0.1 sin(phase) * voiced + amp(voiced) * table[n]` with the fixed uniform table; tanh(Linear(sines)).
        """
        if f0.dim() != 2:
            raise ValueError(f"f0 must be (batch, frames), got shape {tuple(f0.shape)}")
        scale = self.upsample_scale
        num_samples = f0.shape[1] * scale
        table = self.m_source.l_sin_gen.sine_waves
        if num_samples > table.shape[1]:
            if table.shape[1] == 0:
                raise ValueError("source tables are not initialised: call init_source_tables() first")
            raise ValueError(
                f"{f0.shape[1]} frames need {num_samples} source samples but the noise table holds {table.shape[1]} "
                f"({table.shape[1] // scale} frames); split the input or call init_source_tables(max_samples=...)"
            )
        f0 = f0.to(torch.float32)
        harmonics = torch.arange(1, self.num_harmonics + 1, dtype=torch.float32, device=f0.device)
        # The reference builds rad at the sample rate from the nearest-upsampled f0 and linearly downsamples it by
        # 1/480: every frame reads two equal samples of its own frame, so rad computed per frame has the same values.
        rad = (f0.unsqueeze(-1) * harmonics / self.sampling_rate) % 1  # (batch, frames, harmonics)
        # Accumulated in float64 and rounded, as CPU cumsum does for float32 (the reference's numbers); a float32
        # accumulation (CUDA cumsum) drifts over a long clip, and sin(480 * phase) amplifies the drift.
        phase = torch.cumsum(rad.double(), dim=1).float() * 2 * math.pi
        # Nearest upsampling of phase * 480 back to the sample rate: each frame's phase is held for 480 samples.
        sines = torch.sin(phase * scale) * self.sine_amp
        # Upsampled in (batch, harmonics, samples) memory layout like the reference, so that the Linear below reduces
        # in the same order (bit-identical source on CPU).
        sines = _hold(sines.transpose(1, 2), scale).transpose(1, 2)  # (batch, samples, harmonics)
        return self.merge_source(sines, self.f0_to_sample_rate(f0), table[:, :num_samples])

    def merge_source(self, sines: torch.Tensor, f0_up: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The excitation from its sample-rate pieces, in float32: `sines` (batch, samples, harmonics) = 0.1 sin(phase),
        `f0_up` (batch, samples, 1) the held f0 in Hz, `noise` (1 or batch, samples, harmonics) the fixed uniform table
        at those samples -> tanh(Linear(sines * voiced + amp(voiced) * noise)) (batch, 1, samples)."""
        voiced = (f0_up > self.voiced_threshold).to(torch.float32)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        sines = sines * voiced + noise_amp * noise.to(torch.float32)
        linear = self.m_source.l_linear
        merged = torch.tanh(F.linear(sines, linear.weight.float(), linear.bias.float()))
        return merged.transpose(1, 2)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """The filter: mel (batch, in_channels, frames) + source (batch, 1, frames * 480) -> wav (batch, samples).

        `mel` is what the reference's `decode` receives (already without the F0 look-ahead frames when not
        finalising). finalize=True: samples = frames * 480. finalize=False: conv_pre uses the last 4 frames only as
        look-ahead and the last (not yet final) frame of audio is dropped: samples = (frames - 5) * 480.
        """
        if mel.dim() != 3 or mel.shape[1] != self.in_channels:
            raise ValueError(f"mel must be (batch, {self.in_channels}, frames), got shape {tuple(mel.shape)}")
        batch, _, frames = mel.shape
        min_frames = 1 if finalize else self.conv_pre_look_right + 2
        if frames < min_frames:
            raise ValueError(f"decode needs at least {min_frames} mel frames (finalize={finalize}), got {frames}")
        expected_source = (batch, 1, frames * self.upsample_scale)
        if tuple(source.shape) != expected_source:
            raise ValueError(
                f"source must be (batch, 1, frames * {self.upsample_scale}) = {expected_source} for mel "
                f"{tuple(mel.shape)}, got {tuple(source.shape)}"
            )
        window = self._stft_window(source.device)
        spectrum = torch.stft(
            source.squeeze(1).to(window.dtype),
            self.n_fft,
            self.hop_length,
            self.n_fft,
            window=window,
            return_complex=True,
        )
        spectrum = torch.view_as_real(spectrum)  # (batch, n_fft // 2 + 1, stft_frames, 2)
        real, imag = spectrum[..., 0], spectrum[..., 1]
        if finalize:
            hidden = self.conv_pre(mel)
        else:
            look_right = self.conv_pre_look_right
            hidden = self.conv_pre(mel[..., :-look_right], context=mel[..., -look_right:])
            cut = self.stft_frames_per_mel_frame * look_right
            real, imag = real[..., :-cut], imag[..., :-cut]
        source_stft = torch.cat([real, imag], dim=1).to(hidden.dtype)
        hidden = self.filter_body(hidden, source_stft)
        num_bins = self.n_fft // 2 + 1
        magnitude = torch.exp(hidden[:, :num_bins])
        phase = torch.sin(hidden[:, num_bins:])  # the extra sin is part of the trained model
        wav = self._istft(magnitude, phase, window)
        if not finalize:
            wav = wav[:, : -self.upsample_scale]
        return torch.clamp(wav, -self.audio_limit, self.audio_limit)

    def filter_body(self, hidden: torch.Tensor, source_stft: torch.Tensor) -> torch.Tensor:
        """The upsampling stack: conv_pre output (batch, base_channels, frames) + the source's STFT
        (batch, n_fft + 2, stft_frames) -> conv_post output (batch, n_fft + 2, stft_frames).

        Convolutions, Snake residual blocks and element-wise ops only (no complex tensors), so it can be compiled on
        its own (`CosyVoice3Token2Wav.compile_vocoder`), fusing the ~6 element-wise kernels of each Snake.
        With `use_channels_last_convolutions()`, runs on (batch, channels, 1, frames) views; the output is
        contiguous unless conv_post runs channels-last (then strides (channels * frames, 1, channels)).
        """
        channels_last = self.channels_last_convolutions
        if channels_last:
            hidden = hidden.unsqueeze(2)
            source_stft = source_stft.unsqueeze(2)
            if all(_channels_last_eligible(conv) for conv in self.source_downs):
                # Read by three convs, one of them 1x1 (whose weight has no layout of its own): one copy. Not with
                # the released HiFT, whose 18-channel source stays contiguous (see `_channels_last_eligible`).
                source_stft = source_stft.contiguous(memory_format=torch.channels_last)
        for i, upsample in enumerate(self.ups):
            hidden = F.leaky_relu(hidden, self.lrelu_slope)
            hidden = upsample(hidden)
            if i == len(self.ups) - 1:
                # One sample of reflection on the left makes the length match the STFT frame count (120 * Q + 1):
                # F.pad(mode="reflect") for 1 sample, written as a cat so that it works in 3-D and 4-D.
                hidden = torch.cat([hidden[..., 1:2], hidden], dim=-1)
            hidden = hidden + self.source_resblocks[i](self.source_downs[i](source_stft))
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            summed = blocks[0](hidden)
            for block in blocks[1:]:
                summed = summed + block(hidden)
            hidden = summed / self.num_kernels

        hidden = F.leaky_relu(hidden)  # default slope 0.01, as in the reference
        hidden = self.conv_post(hidden)
        return hidden.squeeze(2) if channels_last else hidden

    def forward(
        self, mel: torch.Tensor, finalize: bool = True, source: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """mel (batch, in_channels, frames) float32 -> (wav (batch, samples), source (batch, 1, source_samples)).

        finalize=True: samples = source_samples = 480 * frames. finalize=False (streaming on a mel history whose end
        is not final; needs frames > 8): F0 uses the last 3 frames as look-ahead (source_samples = 480 * (frames - 3)),
        conv_pre the 4 before them, and the last frame of audio is dropped: samples = 480 * (frames - 8).
        (Numbers for the default sizes: 480 = `upsample_scale`, 3 = `f0_predictor.lookahead`, 4 =
        `conv_pre_look_right`.)
        Re-running on a longer history reproduces these samples exactly.

        A given `source` replaces the internally computed excitation (it must have source_samples samples).
        """
        self._check_mel(mel, finalize)
        lookahead = self.f0_predictor.lookahead
        if source is None:
            f0 = self.predict_f0(mel, finalize=finalize)
            source = self.source_from_f0(f0.to(mel.dtype))
        decode_mel = mel if finalize else mel[..., :-lookahead]
        return self.decode(decode_mel, source, finalize=finalize), source

    # ------------------------------------------------------------------------------------------------------------
    # helpers

    def _check_mel(self, mel: torch.Tensor, finalize: bool) -> None:
        if mel.dim() != 3 or mel.shape[1] != self.in_channels:
            raise ValueError(f"mel must be (batch, {self.in_channels}, frames), got shape {tuple(mel.shape)}")
        min_frames = 1 if finalize else self.f0_predictor.lookahead + self.conv_pre_look_right + 2
        if mel.shape[2] < min_frames:
            raise ValueError(
                f"mel has {mel.shape[2]} frames; a {'final' if finalize else 'non-final'} HiFT call needs at least "
                f"{min_frames}"
            )

    def _stft_window(self, device: torch.device) -> torch.Tensor:
        # Periodic Hann built in float64 and rounded, like the reference's scipy window (float32 hann_window differs).
        return torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64, device=device).to(torch.float32)

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """magnitude, phase (batch, n_fft // 2 + 1, frames) -> (batch, hop * (frames - 1)).

        Same arithmetic as `torch.istft(center=True)` (bit-identical on CPU) but without its host-synchronising
        window-envelope check, so it can be captured in CUDA graphs: inverse rFFT per frame, window, overlap-add,
        divide by the overlap-added squared window, drop n_fft // 2 samples at both ends."""
        magnitude = torch.clip(magnitude, max=1e2)
        spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        frames = torch.fft.irfft(spectrum, n=self.n_fft, dim=1) * window[:, None]  # (batch, n_fft, frames)
        num_frames = frames.shape[-1]
        length = self.n_fft + self.hop_length * (num_frames - 1)
        squared_window = (window * window)[None, None, :].expand(1, num_frames, self.n_fft)
        # unfold_backward is the overlap-add torch.istft itself uses (same summation order).
        overlap_add = torch.ops.aten.unfold_backward
        wav = overlap_add(frames.transpose(1, 2), [frames.shape[0], length], 1, self.n_fft, self.hop_length)
        envelope = overlap_add(squared_window, [1, length], 1, self.n_fft, self.hop_length)
        trim = slice(self.n_fft // 2, length - self.n_fft // 2)
        return wav[:, trim] / envelope[:, trim]


def reference_rng_after_flow(
    noise_seed: int = 0,
    mel_bins: int = 80,
    noise_frames: int = 15000,
    vocab_size: int = 6561,
    token_embedding_dim: int = 80,
    spk_embed_dim: int = 192,
) -> torch.Generator:
    """A CPU generator in the state the reference's global RNG has when HiFT starts drawing (defaults: the full-size
    CosyVoice3 flow).

    Loading cosyvoice3.yaml, the CFM re-seeds the global RNG (to `noise_seed`) and draws its start noise
    (1, mel_bins, noise_frames); the flow then initialises its token embedding (normal) and speaker projection
    (uniform weight, then bias).
    """
    generator = torch.Generator(device="cpu").manual_seed(noise_seed)
    with torch.device("cpu"):  # the replay is on the CPU even under a `with torch.device("cuda")` build
        torch.randn(1, mel_bins, noise_frames, generator=generator)  # CFM rand_noise
        torch.empty(vocab_size, token_embedding_dim).normal_(generator=generator)  # flow.input_embedding
        _skip_default_init((mel_bins, spk_embed_dim), generator)  # flow.spk_embed_affine_layer
    return generator


def _skip_default_init(weight_shape: tuple[int, ...], generator: torch.Generator) -> None:
    """Consume the random numbers PyTorch's default init of a Conv1d/Linear with this weight shape draws
    (kaiming-uniform weight, then uniform bias: one draw per element each)."""
    torch.empty(weight_shape).uniform_(generator=generator)
    torch.empty(weight_shape[0]).uniform_(generator=generator)
