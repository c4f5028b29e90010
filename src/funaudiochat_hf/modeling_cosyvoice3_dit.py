"""CosyVoice3's DiT velocity estimator: the Transformer that predicts the flow-matching velocity of a mel.

`CosyVoice3DiT` embeds (x, mu, speaker, cond) per frame with a causal conv position embedding, runs
`dit_depth` blocks of adaptive-LayerNorm attention (rotary on head 0) and feed-forward, and projects back to the mel
bins. Module paths mirror the official `flow.pt` keys under `flow.decoder.estimator`.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .adaln_cosyvoice3 import residual_adaln
from .attention_cosyvoice3 import dit_attention
from .configuration_cosyvoice3 import CosyVoice3Config
from .position_conv_cosyvoice3 import causal_conv_mish, tap_major_weight


# Every LayerNorm of the DiT (no affine weights): a block's last residual update is fused with the norm that follows
# it, which belongs to the next block or to the final norm.
NORM_EPS = 1e-6


class CosyVoice3TimestepEmbedding(nn.Module):
    """Flow time t (batch,) -> (batch, dim): sinusoid (sin first, scale 1000) -> Linear -> SiLU -> Linear."""

    def __init__(self, dim: int, freq_embed_dim: int = 256):
        super().__init__()
        self.freq_embed_dim = freq_embed_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_embed_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        half_dim = self.freq_embed_dim // 2
        exponent = math.log(10000) / (half_dim - 1)
        freqs = torch.exp(torch.arange(half_dim, device=timestep.device).float() * -exponent)
        angles = 1000 * timestep.unsqueeze(1) * freqs.unsqueeze(0)
        sinusoid = torch.cat((angles.sin(), angles.cos()), dim=-1).to(timestep.dtype)
        return self.time_mlp(sinusoid)


class CosyVoice3CausalConvPositionEmbedding(nn.Module):
    """Two left-padded grouped convs with Mish; (batch, frames, dim) -> (batch, frames, dim). Looks only left.

    On CUDA in 16-bit inference each conv + Mish is one Triton kernel ([`position_conv_cosyvoice3.causal_conv_mish`]),
    which reads the weights tap-major: `store_tap_major_weights()` keeps that copy (non-persistent buffers,
    checkpoints unchanged; taken at call time: call it again after changing the weights), otherwise each call
    transposes them. `CosyVoice3Token2Wav.compile_estimator()` stores them.
    """

    def __init__(self, dim: int, kernel_size: int = 31, groups: int = 16):
        super().__init__()
        self.kernel_size = kernel_size
        # nn.Sequential(conv, Mish) keeps the official state-dict keys (`conv1.0.weight`).
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.register_buffer("conv1_tap_major", None, persistent=False)
        self.register_buffer("conv2_tap_major", None, persistent=False)

    @torch.no_grad()
    def store_tap_major_weights(self) -> None:
        for name, conv in (("conv1_tap_major", self.conv1[0]), ("conv2_tap_major", self.conv2[0])):
            setattr(self, name, tap_major_weight(conv.weight, conv.groups).contiguous())

    def drop_tap_major_weights(self) -> None:
        self.conv1_tap_major = self.conv2_tap_major = None

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden (batch, frames, dim) -> the position embedding (batch, frames, dim), plus `residual` if given."""
        hidden = causal_conv_mish(hidden, self.conv1[0], None, self.conv1_tap_major)
        return causal_conv_mish(hidden, self.conv2[0], residual, self.conv2_tap_major)


class CosyVoice3InputEmbedding(nn.Module):
    """concat[noisy mel, prompt mel, token condition, speaker] (batch, frames, 2 * mel_dim + mu_dim + spk_dim)
    -> (batch, frames, dim), plus the causal conv position embedding."""

    def __init__(self, mel_dim: int, mu_dim: int, spk_dim: int, dim: int, kernel_size: int, groups: int):
        super().__init__()
        self.proj = nn.Linear(mel_dim * 2 + mu_dim + spk_dim, dim)
        self.conv_pos_embed = CosyVoice3CausalConvPositionEmbedding(dim, kernel_size, groups)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        hidden = self.proj(torch.cat([x, cond, mu, spks], dim=-1))
        return self.conv_pos_embed(hidden, residual=hidden)


class CosyVoice3RotaryEmbedding(nn.Module):
    """x-transformers rotary table: angles duplicated in adjacent pairs, (frames,) -> cos, sin (frames, dim_head)."""

    def __init__(self, dim_head: int, theta: float = 10000.0):
        super().__init__()
        # Persistent because the official flow.pt stores it (`decoder.estimator.rotary_embed.inv_freq`).
        self.register_buffer("inv_freq", self.compute_inv_freq(dim_head, theta), persistent=True)

    @staticmethod
    def compute_inv_freq(dim_head: int, theta: float) -> torch.Tensor:
        return 1.0 / (theta ** (torch.arange(0, dim_head, 2).float() / dim_head))

    def forward(self, num_frames: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(num_frames, device=device).type_as(self.inv_freq)
        angles = positions[:, None] * self.inv_freq[None, :]
        angles = torch.stack((angles, angles), dim=-1).flatten(-2)  # [t0, t0, t1, t1, ...]
        return angles.cos(), angles.sin()


class CosyVoice3AdaLayerNormZero(nn.Module):
    """AdaLN-Zero: 6 modulation vectors (shift/scale/gate for attention and feed-forward) from the time embedding.

    `self.linear(silu(temb))` (batch, 6 * dim) depends on the timestep only; the DiT computes it up front
    ([`CosyVoice3DiT.time_conditioning`]) and `forward` takes the result.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 6)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=NORM_EPS)

    def forward(self, hidden: torch.Tensor, modulation: torch.Tensor):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(modulation, 6, dim=1)
        _, normed = residual_adaln(hidden, None, None, shift_msa, scale_msa, self.norm.eps)
        return normed, gate_msa, shift_mlp, scale_mlp, gate_mlp


class CosyVoice3AdaLayerNormFinal(nn.Module):
    """Final AdaLN: 2 modulation vectors in the order (scale, shift); `modulation` = `self.linear(silu(temb))`."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=NORM_EPS)

    def forward(self, hidden: torch.Tensor, modulation: torch.Tensor) -> torch.Tensor:
        scale, shift = torch.chunk(modulation, 2, dim=1)
        return residual_adaln(hidden, None, None, shift, scale, self.norm.eps)[1]


class CosyVoice3Attention(nn.Module):
    """Multi-head self-attention with biased projections and partial (head-0) rotary positions
    ([`attention_cosyvoice3.dit_attention`]: one Triton kernel on CUDA in 16-bit inference, else SDPA).

    `fuse_qkv_projections()` concatenates the q/k/v weights into one (3 * inner_dim, dim) matrix (non-persistent
    buffers: checkpoints keep `to_q` / `to_k` / `to_v`), one GEMM instead of three per block; equal up to float
    rounding. The copies are taken at fusing time: fuse again (or unfuse) after changing the weights.
    """

    def __init__(self, dim: int, heads: int, dim_head: int, dropout: float = 0.0):
        super().__init__()
        inner_dim = heads * dim_head
        self.heads = heads
        self.dim_head = dim_head
        self.to_q = nn.Linear(dim, inner_dim)
        self.to_k = nn.Linear(dim, inner_dim)
        self.to_v = nn.Linear(dim, inner_dim)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, dim), nn.Dropout(dropout)])
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    @torch.no_grad()
    def fuse_qkv_projections(self) -> None:
        projections = (self.to_q, self.to_k, self.to_v)
        self.qkv_weight = torch.cat([projection.weight for projection in projections])
        self.qkv_bias = torch.cat([projection.bias for projection in projections])

    def unfuse_qkv_projections(self) -> None:
        self.qkv_weight = self.qkv_bias = None

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if self.qkv_weight is None:
            query, key, value = self.to_q(hidden), self.to_k(hidden), self.to_v(hidden)
        else:
            query, key, value = F.linear(hidden, self.qkv_weight, self.qkv_bias).chunk(3, dim=-1)
        # attention_mask (batch, 1, frames or 1, frames): boolean, True = may attend, or additive (`solve` converts a
        # boolean mask once per call); None = full attention.
        attended = dit_attention(query, key, value, *rotary, self.heads, attention_mask)
        return self.to_out[1](self.to_out[0](attended))


class CosyVoice3FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int, dropout: float = 0.0):
        super().__init__()
        inner_dim = dim * mult
        # Nested Sequential reproduces the official keys `ff.ff.0.0` / `ff.ff.2`. `forward` applies the GELU through
        # `linear_gelu_tanh` (tanh approximation, as this module), not through the module.
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU(approximate="tanh")),
            nn.Dropout(dropout),
            nn.Linear(inner_dim, dim),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, frames, dim) -> (batch, frames, dim)."""
        up, dropout, down = self.ff[0][0], self.ff[1], self.ff[2]
        return down(dropout(linear_gelu_tanh(hidden, up)))


def linear_gelu_tanh(hidden: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """`F.gelu(linear(hidden), approximate="tanh")`, (..., in_features) -> (..., out_features).

    On CUDA this is one cuBLASLt GEMM with the bias and the GELU in its epilogue (`torch._addmm_activation`), not a
    GEMM followed by an element-wise kernel: one kernel fewer per DiT block and Euler step (220 per flow call). The
    epilogue rounds once, after the GELU, where the two-kernel form also rounds its input: equal up to one rounding
    of the compute dtype. Under autocast the operands are cast as autocast would cast them for `linear`.
    """
    weight, bias = linear.weight, linear.bias
    if not hidden.is_cuda or bias is None:
        return F.gelu(linear(hidden), approximate="tanh")
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
    rows = hidden.reshape(-1, hidden.shape[-1])
    return torch._addmm_activation(bias, rows, weight.t(), use_gelu=True).view(*hidden.shape[:-1], -1)


class CosyVoice3DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int):
        super().__init__()
        self.attn_norm = CosyVoice3AdaLayerNormZero(dim)
        self.attn = CosyVoice3Attention(dim, heads, dim_head)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=NORM_EPS)
        self.ff = CosyVoice3FeedForward(dim, ff_mult)

    def forward(self, hidden, normed, modulation, next_shift, next_scale, rotary, attention_mask=None):
        """One block, its last residual update fused with the next LayerNorm ([`residual_adaln`]).

        hidden (batch, frames, dim): the residual stream; normed: this block's attention input, `attn_norm(hidden,
        modulation)[0]` (the previous block computed it); modulation (batch, 6 * dim): `attn_norm.linear(silu(temb))`;
        next_shift, next_scale (batch, dim): the modulation of the norm that follows (the next block's attention
        norm, or the final norm). Returns `(hidden, normed)` for the next block: the stream after this block and its
        next norm's output.
        """
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(modulation, 6, dim=1)
        attended = self.attn(normed, rotary, attention_mask)
        hidden, normed = residual_adaln(hidden, attended, gate_msa, shift_mlp, scale_mlp, self.ff_norm.eps)
        return residual_adaln(hidden, self.ff(normed), gate_mlp, next_shift, next_scale, NORM_EPS)


class CosyVoice3DiT(nn.Module):
    """Velocity estimator v(x, t | mu, spk, cond).

    Inputs channel-first: x, mu, cond (batch, mel_bins, frames); t (batch,); spks (batch, mel_bins);
    attention_mask (batch, 1, frames, frames), or (batch, 1, 1, frames) for key padding, boolean or additive, or
    None (full attention).
    Output (batch, mel_bins, frames).
    `time_conditioning`: `self.time_conditioning(t)` computed beforehand (t is then not used): it depends on the
    timestep alone, so a caller that runs the same timesteps again (the streaming decoder) computes it once.
    `rotary`: `self.rotary_embed(frames, device)` computed beforehand (the Euler solver computes it once per call,
    not once per step: the compiled estimator otherwise recomputed the table in ~5 small kernels per step).
    """

    def __init__(self, config: CosyVoice3Config):
        super().__init__()
        dim, mel = config.dit_dim, config.mel_bins
        self.time_embed = CosyVoice3TimestepEmbedding(dim, config.dit_time_embed_dim)
        self.input_embed = CosyVoice3InputEmbedding(
            mel, mel, mel, dim, config.dit_conv_pos_kernel_size, config.dit_conv_pos_groups
        )
        self.rotary_embed = CosyVoice3RotaryEmbedding(config.dit_dim_head, config.rope_theta)
        self.transformer_blocks = nn.ModuleList(
            [
                CosyVoice3DiTBlock(dim, config.dit_heads, config.dit_dim_head, config.dit_ff_mult)
                for _ in range(config.dit_depth)
            ]
        )
        self.norm_out = CosyVoice3AdaLayerNormFinal(dim)
        self.proj_out = nn.Linear(dim, mel)

    def time_conditioning(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the DiT derives from the timesteps t (batch,): the adaLN modulations of every block
        (n_blocks, batch, 6 * dim) and of the final norm (batch, 2 * dim)."""
        temb = F.silu(self.time_embed(t))
        blocks = torch.stack([block.attn_norm.linear(temb) for block in self.transformer_blocks])
        return blocks, self.norm_out.linear(temb)

    def forward(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        time_conditioning: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> torch.Tensor:
        block_modulations, final_modulation = (
            self.time_conditioning(t) if time_conditioning is None else time_conditioning
        )
        hidden = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        if rotary is None:
            rotary = self.rotary_embed(hidden.shape[1], hidden.device)
        normed = self.transformer_blocks[0].attn_norm(hidden, block_modulations[0])[0]
        final_scale, final_shift = torch.chunk(final_modulation, 2, dim=1)
        for index, block in enumerate(self.transformer_blocks):
            if index + 1 < len(self.transformer_blocks):  # the next block's attention norm
                next_shift, next_scale = torch.chunk(block_modulations[index + 1], 6, dim=1)[:2]
            else:
                next_shift, next_scale = final_shift, final_scale
            modulation = block_modulations[index]
            hidden, normed = block(hidden, normed, modulation, next_shift, next_scale, rotary, attention_mask)
        return self.proj_out(normed).transpose(1, 2)


__all__ = [
    "CosyVoice3AdaLayerNormFinal",
    "CosyVoice3AdaLayerNormZero",
    "CosyVoice3Attention",
    "CosyVoice3CausalConvPositionEmbedding",
    "CosyVoice3DiT",
    "CosyVoice3DiTBlock",
    "CosyVoice3FeedForward",
    "CosyVoice3InputEmbedding",
    "CosyVoice3RotaryEmbedding",
    "CosyVoice3TimestepEmbedding",
    "linear_gelu_tanh",
]
