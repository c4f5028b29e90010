"""HiFT's excitation side: the F0 predictor (mel -> F0 in Hz) and the harmonic source module's fixed tables, and
the replay of the reference's RNG draws that fill those tables.

The source itself is computed by `CosyVoice3HiFTGenerator.source_from_f0`; the modules here hold its parameters and
tables under the official `hift.pt` key names (`f0_predictor.*`, `m_source.l_linear.*`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_cosyvoice3_hift_convs import WeightNormCausalConv1d, _inference_cached


# The reference draws its source-noise table for 300 s of 24 kHz audio, independently of the configured sampling rate.
REFERENCE_SOURCE_TABLE_SAMPLES = 300 * 24000


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


__all__ = [
    "REFERENCE_SOURCE_TABLE_SAMPLES",
    "CausalConvF0Predictor",
    "SineGenerator",
    "SourceModuleHnNSF",
    "reference_rng_after_flow",
]
