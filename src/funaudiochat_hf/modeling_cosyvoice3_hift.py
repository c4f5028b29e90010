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

This file holds the generator; its conv layers are in `modeling_cosyvoice3_hift_convs.py`, the F0 predictor and the
source module's tables in `modeling_cosyvoice3_hift_source.py`. On CUDA at inference its element-wise work runs as
Triton kernels, each next to the torch ops it replaces (which run everywhere else): `snake_cosyvoice3.py` (the
residual blocks' Snakes, conv biases, causal paddings and residual sums), `istft_cosyvoice3.py` (around the inverse
FFT) and `source_merge_cosyvoice3.py` (the excitation's mixing and Linear).
"""

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .cuda_graph_capture import capture_branches, run_beside
from .istft_cosyvoice3 import hift_overlap_add, hift_spectrum
from .modeling_cosyvoice3_hift_convs import (  # noqa: F401  (re-exported)
    CausalConv1d,
    CausalConv1dDownsample,
    CausalConv1dUpsample,
    CausalResBlock,
    Snake,
    WeightNormCausalConv1d,
    _channels_last_1d,
    _channels_last_eligible,
    _hold,
    conv1d_as_matmul,
)
from .modeling_cosyvoice3_hift_source import (  # noqa: F401  (re-exported)
    REFERENCE_SOURCE_TABLE_SAMPLES,
    CausalConvF0Predictor,
    SineGenerator,
    SourceModuleHnNSF,
    _skip_default_init,
    reference_rng_after_flow,
)
from .source_merge_cosyvoice3 import merge_linear


_WEIGHT_NORM_SUFFIXES = (
    # (magnitude g, direction v): torch >= 2.1 parametrisation names, then the legacy `weight_norm` names
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    (".weight_g", ".weight_v"),
)


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

        Two kinds of conv are rewritten for it (cuDNN has no fast NHWC kernel for them as they are; rewritten, a
        streamed chunk's vocoder measured faster, docs/performance.md): the
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
        linear = self.m_source.l_linear
        # one kernel (before the tanh) on CUDA at inference (`source_merge_cosyvoice3`)
        merged = merge_linear(
            sines, f0_up, noise, linear.weight, linear.bias, self.voiced_threshold, self.noise_std, self.sine_amp
        )
        return torch.tanh(merged).transpose(1, 2)

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
        # The iSTFT: one kernel each before and after the inverse FFT on CUDA (`istft_cosyvoice3`).
        spectrum = hift_spectrum(hidden, self.n_fft // 2 + 1)  # (batch, n_fft // 2 + 1, stft_frames) complex
        frames = torch.fft.irfft(spectrum, n=self.n_fft, dim=1)  # (batch, n_fft, stft_frames)
        drop_last = 0 if finalize else self.upsample_scale
        return hift_overlap_add(frames, window, self.hop_length, drop_last, self.audio_limit)

    def filter_body(self, hidden: torch.Tensor, source_stft: torch.Tensor) -> torch.Tensor:
        """The upsampling stack: conv_pre output (batch, base_channels, frames) + the source's STFT
        (batch, n_fft + 2, stft_frames) -> conv_post output (batch, n_fft + 2, stft_frames).

        Convolutions, Snake residual blocks and element-wise ops only (no complex tensors), so it can be compiled on
        its own (`CosyVoice3Token2Wav.compile_vocoder`), fusing the element-wise ops between the convs (eagerly on
        CUDA, each Snake is one Triton kernel already, `snake_cosyvoice3`).
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
        stages = range(len(self.ups))
        # Recorded into a CUDA graph, the independent parts run as parallel branches: the source's term of every
        # stage (it depends on the source alone) from the start, and each stage's resblocks but the first. Their
        # kernels are small, and one stream would run them one after the other. The same arithmetic either way.
        branches = capture_branches(hidden, self.num_kernels)
        if branches is None:
            source_terms = None
        else:
            source_stream, block_streams = branches[0], branches[1:]
            source_terms = [
                run_beside(source_stream, functools.partial(self._source_term, i), source_stft) for i in stages
            ]
        for i, upsample in enumerate(self.ups):
            hidden = F.leaky_relu(hidden, self.lrelu_slope)
            hidden = upsample(hidden)
            if i == len(self.ups) - 1:
                # One sample of reflection on the left makes the length match the STFT frame count (120 * Q + 1):
                # F.pad(mode="reflect") for 1 sample, written as a cat so that it works in 3-D and 4-D.
                hidden = torch.cat([hidden[..., 1:2], hidden], dim=-1)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            if branches is None:
                hidden = hidden + self._source_term(i, source_stft)
                summed = blocks[0](hidden)
                for block in blocks[1:]:
                    summed = summed + block(hidden)
            else:
                hidden = hidden + source_terms[i].result()
                others = [run_beside(stream, block, hidden) for stream, block in zip(block_streams, blocks[1:])]
                summed = blocks[0](hidden)
                for other in others:
                    summed = summed + other.result()
            hidden = summed / self.num_kernels

        hidden = F.leaky_relu(hidden)  # default slope 0.01, as in the reference
        hidden = self.conv_post(hidden)
        return hidden.squeeze(2) if channels_last else hidden

    def _source_term(self, stage: int, source_stft: torch.Tensor) -> torch.Tensor:
        """What stage `stage` of `filter_body` adds from the source's STFT: its downsampling conv and resblock."""
        return self.source_resblocks[stage](self.source_downs[stage](source_stft))

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
