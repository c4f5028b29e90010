"""CosyVoice3 token2wav in plain PyTorch: speech tokens (25 Hz, vocab 6561) -> 80-bin log-mel (flow) -> 24 kHz
audio (HiFT).

The flow embeds the tokens, adds a 3-token look-ahead conv, repeats every token twice (50 Hz mel rate) and integrates a
conditional flow-matching ODE with a DiT velocity estimator (10 Euler steps on a cosine time grid, classifier-free
guidance with a packed [conditional, unconditional] batch), starting from a fixed noise tensor. HiFT
(`modeling_cosyvoice3_hift.py`) turns the mel into a waveform. Module paths mirror the official `flow.pt` / `hift.pt`
keys (`flow.input_embedding`, `flow.decoder.estimator.transformer_blocks.0.attn.to_q`, `hift.conv_pre`, ...).
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput, logging

from .attention_cosyvoice3 import dit_attention
from .configuration_cosyvoice3 import CosyVoice3Config
from .modeling_cosyvoice3_hift import CosyVoice3HiFTGenerator, reference_rng_after_flow
from .position_conv_cosyvoice3 import causal_conv_mish, tap_major_weight
from .streaming_cosyvoice3 import CosyVoice3StreamingDecoder


logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# DiT velocity estimator
# ---------------------------------------------------------------------------------------------------------------------


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
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, hidden: torch.Tensor, modulation: torch.Tensor):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(modulation, 6, dim=1)
        normed = self.norm(hidden) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return normed, gate_msa, shift_mlp, scale_mlp, gate_mlp


class CosyVoice3AdaLayerNormFinal(nn.Module):
    """Final AdaLN: 2 modulation vectors in the order (scale, shift); `modulation` = `self.linear(silu(temb))`."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, hidden: torch.Tensor, modulation: torch.Tensor) -> torch.Tensor:
        scale, shift = torch.chunk(modulation, 2, dim=1)
        return self.norm(hidden) * (1 + scale)[:, None, :] + shift[:, None, :]


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
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = CosyVoice3FeedForward(dim, ff_mult)

    def forward(self, hidden, modulation, rotary, attention_mask=None):
        """hidden (batch, frames, dim); modulation (batch, 6 * dim), this block's `attn_norm.linear(silu(temb))`."""
        normed, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(hidden, modulation)
        hidden = hidden + gate_msa.unsqueeze(1) * self.attn(normed, rotary, attention_mask)
        normed = self.ff_norm(hidden) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return hidden + gate_mlp.unsqueeze(1) * self.ff(normed)


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
        for block, modulation in zip(self.transformer_blocks, block_modulations):
            hidden = block(hidden, modulation, rotary, attention_mask)
        return self.proj_out(self.norm_out(hidden, final_modulation)).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Flow: tokens -> mel
# ---------------------------------------------------------------------------------------------------------------------


class CosyVoice3PreLookaheadLayer(nn.Module):
    """conv(k=lookahead+1) over `lookahead` right frames -> leaky ReLU -> causal conv(k=3) -> + input.

    (batch, tokens, dim) -> (batch, tokens, dim). `context` (batch, lookahead, dim) replaces the zero right padding
    when more tokens follow (streaming, not final).
    """

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)

    def forward(self, inputs: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = inputs.transpose(1, 2)
        if context is None:
            hidden = F.pad(hidden, (0, self.pre_lookahead_len))
        else:
            hidden = torch.cat([hidden, context.transpose(1, 2)], dim=2)
        hidden = F.leaky_relu(self.conv1(hidden))  # default slope 0.01, as the reference
        hidden = self.conv2(F.pad(hidden, (self.conv2.kernel_size[0] - 1, 0)))
        return hidden.transpose(1, 2) + inputs


class CosyVoice3ConditionalFlowMatching(nn.Module):
    """Euler solver of the flow-matching ODE with classifier-free guidance, starting from fixed noise.

    The noise (`rand_noise`, (1, mel_bins, noise_frames)) is not in the checkpoint: the reference draws it at
    construction right after re-seeding the global RNG; `init_noise` regenerates it from a private generator.
    """

    def __init__(self, config: CosyVoice3Config):
        super().__init__()
        self.config = config
        self.estimator = CosyVoice3DiT(config)
        self.register_buffer("rand_noise", torch.zeros(1, config.mel_bins, config.noise_frames), persistent=False)
        self._time_conditioning_cache: dict = {}

    @torch.no_grad()
    def init_noise(self) -> None:
        generator = torch.Generator(device="cpu").manual_seed(self.config.noise_seed)
        noise = torch.randn(self.rand_noise.shape, generator=generator, dtype=torch.float32, device="cpu")
        self.rand_noise.copy_(noise.to(self.rand_noise.device, self.rand_noise.dtype))

    def time_grid(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step (t, dt), each (n_timesteps,), with `dt` re-derived from the accumulated `t` like the reference."""
        steps = self.config.n_timesteps
        t_span = torch.linspace(0, 1, steps + 1, device=device, dtype=dtype)
        if self.config.t_scheduler == "cosine":
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        times, deltas = [], []
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, steps + 1):
            times.append(t)
            deltas.append(dt)
            t = t + dt
            if step < steps:
                dt = t_span[step + 1] - t
        return torch.stack(times), torch.stack(deltas)

    def start_noise(self, batch: int, frames: int, offset: int = 0) -> torch.Tensor:
        """The fixed ODE start point for frames [offset, offset + frames), (batch, mel_bins, frames).

        Frames past the end of the table wrap around (the reference stops at 300 s per flow call).
        """
        total = self.rand_noise.shape[-1]
        if offset + frames <= total:
            noise = self.rand_noise[:, :, offset : offset + frames]
        else:
            index = torch.arange(offset, offset + frames, device=self.rand_noise.device) % total
            noise = self.rand_noise.index_select(2, index)
        return noise.expand(batch, -1, -1)

    def forward(
        self,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        noise_offset: int = 0,
    ) -> torch.Tensor:
        """mu, cond (batch, mel_bins, frames); spks (batch, mel_bins) -> mel (batch, mel_bins, frames) float32."""
        batch, _, frames = mu.shape
        noise = self.start_noise(batch, frames, noise_offset).to(mu.dtype)
        conditioning = self.cached_time_conditioning(batch, mu.device, mu.dtype)
        return self.solve(noise, mu, spks, cond, attention_mask, *conditioning)

    def _estimator_autocast(self, device: torch.device):
        """The estimator's precision context (`config.estimator_autocast_dtype`; disabled for float32).

        No autocast weight cache: it only lives for one call here anyway, and a cached cast captured in a CUDA graph
        would be freed when the context exits.
        """
        autocast_dtype = self.config.estimator_autocast_dtype
        return torch.autocast(
            device.type,
            dtype=getattr(torch, autocast_dtype or "bfloat16"),
            enabled=autocast_dtype is not None,
            cache_enabled=False,
        )

    def _check_estimator_dtype(self, dtype: torch.dtype) -> None:
        weight_dtype = self.estimator.proj_out.weight.dtype
        if self.config.estimator_autocast_dtype is None and weight_dtype != dtype:
            raise ValueError(
                f"The DiT estimator's weights are {weight_dtype} (`use_low_precision_estimator`) but "
                "config.estimator_autocast_dtype is None: set it back, or reload the model for float32."
            )

    def time_conditioning(
        self, batch: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything `solve` derives from the time grid alone, for `batch` rows (2 * batch with CFG):

        (dt (n_steps,), block modulations (n_steps, n_blocks, 2 * batch, 6 * dim), final-norm modulations
        (n_steps, 2 * batch, 2 * dim)), computed exactly as each Euler step would (same shapes, same precision).
        The same for every call with the same batch size, precision and weights: [`cached_time_conditioning`] keeps
        it, which takes the time MLP and 23 modulation GEMMs per Euler step (2.8 GB of bfloat16 weight reads per
        chunk at full size) out of every streamed chunk and offline call.
        """
        self._check_estimator_dtype(dtype)
        times, deltas = self.time_grid(device, dtype)
        blocks, finals = [], []
        for step in range(self.config.n_timesteps):
            with self._estimator_autocast(device):
                block_modulations, final_modulation = self.estimator.time_conditioning(times[step].expand(2 * batch))
            blocks.append(block_modulations)
            finals.append(final_modulation)
        return deltas, torch.stack(blocks), torch.stack(finals)

    def cached_time_conditioning(
        self, batch: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`time_conditioning(batch, device, dtype)`, kept from one call to the next while the weights it reads and
        the precision stay the same (an in-place update bumps a weight's `_version`, a re-allocation changes its
        address: either recomputes it; with autograd enabled it is never cached). It is ~250 small kernels at full
        size, which every offline call and the first chunk of every streamed reply would otherwise pay for."""
        if torch.is_grad_enabled():
            return self.time_conditioning(batch, device, dtype)
        estimator = self.estimator
        modules = [estimator.time_embed, estimator.norm_out.linear]
        modules += [block.attn_norm.linear for block in estimator.transformer_blocks]
        weights_key = (
            self.config.estimator_autocast_dtype,
            self.config.n_timesteps,
            tuple((p.data_ptr(), p._version) for module in modules for p in module.parameters()),
        )
        key = (batch, str(device), dtype)
        cached = self._time_conditioning_cache.get(key)
        if cached is None or cached[0] != weights_key:
            if cached is None and len(self._time_conditioning_cache) >= 4:  # a few batch sizes / devices at most
                self._time_conditioning_cache.clear()
            cached = (weights_key, self.time_conditioning(batch, device, dtype))
            self._time_conditioning_cache[key] = cached
        return cached[1]

    def solve(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        deltas: Optional[torch.Tensor] = None,
        block_modulations: Optional[torch.Tensor] = None,
        final_modulations: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Integrate from the start point x (batch, mel_bins, frames) at t=0 to t=1 -> float32 mel.

        `deltas`, `block_modulations`, `final_modulations`: `self.time_conditioning(batch, ...)` computed beforehand
        (all three or none; None = computed here). Fixed shapes, no host synchronisation and no data-dependent
        branching: the whole 10-step loop can be compiled (fullgraph) and CUDA-graphed
        (`CosyVoice3Token2Wav.compile_estimator(whole_solver=True)`).
        """
        batch = mu.shape[0]
        self._check_estimator_dtype(mu.dtype)
        if deltas is None:
            deltas, block_modulations, final_modulations = self.time_conditioning(batch, mu.device, mu.dtype)
        cfg = self.config.inference_cfg_rate
        # Packed CFG batch: rows [0, batch) conditional, [batch, 2 batch) unconditional (mu, spks, cond zeroed).
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spks_in = torch.cat([spks, torch.zeros_like(spks)]).to(mu.dtype)
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
        mask_in = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
        if mask_in is not None and mask_in.dtype == torch.bool:
            # SDPA would turn a boolean mask into an additive one in each of the n_steps x n_blocks attention calls.
            autocast_dtype = self.config.estimator_autocast_dtype
            mask_in = additive_attention_mask(mask_in, getattr(torch, autocast_dtype) if autocast_dtype else mu.dtype)
        rotary = self.estimator.rotary_embed(mu.shape[2], mu.device)  # the same for every step
        for step in range(self.config.n_timesteps):
            conditioning = (block_modulations[step], final_modulations[step])
            with self._estimator_autocast(mu.device):
                # t is not used when the conditioning is given
                velocity = self.estimator(
                    torch.cat([x, x]), mu_in, None, spks_in, cond_in, mask_in, conditioning, rotary
                )
            velocity = velocity.to(x.dtype)
            v_cond, v_uncond = velocity[:batch], velocity[batch:]
            # x + dt * ((1 + cfg) * v_cond - cfg * v_uncond), in two kernels instead of five (the guided velocity
            # as lerp(v_uncond, v_cond, 1 + cfg); equal up to float rounding)
            x = torch.addcmul(x, torch.lerp(v_uncond, v_cond, 1.0 + cfg), deltas[step])
        return x.float()


def additive_attention_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (..., queries, keys) mask, True = may attend -> additive `dtype` mask: 0, or the dtype's minimum.

    The minimum rather than -inf: a row with no visible key then averages all values instead of giving NaN. Rows are
    stored with their stride rounded up to 16 elements (a view of a wider buffer): SDPA's memory-efficient kernel
    copies a bias with unaligned rows into a padded buffer on every call.
    """
    *leading, keys = mask.shape
    aligned_keys = -(-keys // 16) * 16
    additive = torch.zeros(*leading, aligned_keys, dtype=dtype, device=mask.device)[..., :keys]
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


def build_attention_mask(
    lengths: Optional[torch.Tensor], frames: int, chunk_size: Optional[int], device: torch.device, batch: int
) -> Optional[torch.Tensor]:
    """Boolean mask, True = may attend, or None when every key is visible.

    `lengths` (batch,) valid frames per row (keys past it are hidden): a key-padding mask `(batch, 1, 1, frames)`,
    the same for every query (SDPA broadcasts it; the DiT's Triton attention reads one row); `chunk_size` enables
    the block-causal streaming mask (query i sees keys j < (i // chunk + 1) * chunk, chunks counted from frame 0):
    `(batch, 1, frames, frames)`.
    """
    if lengths is None and not chunk_size:
        return None
    positions = torch.arange(frames, device=device)
    mask = torch.ones(batch, 1, 1, frames, dtype=torch.bool, device=device)
    if lengths is not None:
        mask = mask & (positions[None, None, None, :] < lengths.to(device)[:, None, None, None])
    if chunk_size:
        visible_until = (positions // chunk_size + 1) * chunk_size
        mask = mask & (positions[None, :] < visible_until[:, None])[None, None]
    return mask


class CosyVoice3Flow(nn.Module):
    """Token embedding, speaker affine, pre-lookahead and the CFM decoder (official `flow.pt` layout)."""

    def __init__(self, config: CosyVoice3Config):
        super().__init__()
        self.config = config
        self.input_embedding = nn.Embedding(config.vocab_size, config.token_embedding_dim)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.mel_bins)
        self.pre_lookahead_layer = CosyVoice3PreLookaheadLayer(
            config.token_embedding_dim, config.pre_lookahead_channels, config.pre_lookahead_len
        )
        self.decoder = CosyVoice3ConditionalFlowMatching(config)

    def speaker_condition(self, speaker_embedding: torch.Tensor) -> torch.Tensor:
        """(batch, spk_embed_dim) x-vector -> (batch, mel_bins); only the direction matters (L2-normalised)."""
        weight = self.spk_embed_affine_layer.weight
        return self.spk_embed_affine_layer(F.normalize(speaker_embedding.to(weight.device, weight.dtype), dim=1))

    def encode_tokens(
        self, tokens: torch.Tensor, token_lengths: Optional[torch.Tensor] = None, finalize: bool = True
    ) -> torch.Tensor:
        """(batch, tokens) ids -> pre-lookahead output (batch, tokens or tokens - lookahead, token_embedding_dim).

        finalize=False keeps the last `pre_lookahead_len` tokens as right context only (more tokens will follow).
        Padded positions (past `token_lengths`) are zeroed first, which equals the zero right padding of a final
        call, so padded rows match the unpadded ones.
        """
        embedded = self.input_embedding(tokens)
        if token_lengths is not None:
            valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < token_lengths[:, None]
            embedded = embedded * valid.unsqueeze(-1).to(embedded.dtype)
        if finalize:
            return self.pre_lookahead_layer(embedded)
        lookahead = self.config.pre_lookahead_len
        return self.pre_lookahead_layer(embedded[:, :-lookahead], context=embedded[:, -lookahead:])

    def frame_condition(
        self, tokens: torch.Tensor, token_lengths: Optional[torch.Tensor] = None, finalize: bool = True
    ) -> torch.Tensor:
        """(batch, tokens) ids -> the solver's condition mu (batch, token_embedding_dim, token_mel_ratio * tokens'):
        `encode_tokens` with each token repeated over its mel frames, channels first."""
        hidden = self.encode_tokens(tokens, token_lengths, finalize)
        return hidden.repeat_interleave(self.config.token_mel_ratio, dim=1).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class CosyVoice3Token2WavOutput(ModelOutput):
    """
    waveform (`torch.FloatTensor` of shape `(batch, samples)`): 24 kHz audio in [-0.99, 0.99]; rows shorter than the
        longest are zero-padded on the right.
    waveform_lengths (`torch.LongTensor` of shape `(batch,)`): valid samples per row (`samples_per_token` x tokens).
    """

    waveform: Optional[torch.FloatTensor] = None
    waveform_lengths: Optional[torch.LongTensor] = None


class CosyVoice3PreTrainedModel(PreTrainedModel):
    config_class = CosyVoice3Config
    config: CosyVoice3Config
    base_model_prefix = "token2wav"
    main_input_name = "speech_tokens"
    _no_split_modules = ["CosyVoice3DiTBlock"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Fixed "random" tables are part of the model definition, not initialisation noise: always regenerate them
        # (transformers leaves non-persistent buffers uninitialised when loading on the meta device).
        # The hooks sit on the modules that own the buffers: a module whose own tensors are all loaded is skipped.
        if isinstance(module, CosyVoice3ConditionalFlowMatching):
            module.init_noise()
        elif isinstance(module, CosyVoice3RotaryEmbedding):
            if not getattr(module.inv_freq, "_is_hf_initialized", False):  # keep the checkpoint's table if loaded
                module.inv_freq.copy_(module.compute_inv_freq(self.config.dit_dim_head, self.config.rope_theta))
        elif module is getattr(getattr(getattr(self, "hift", None), "m_source", None), "l_sin_gen", None):
            config = self.config
            generator = reference_rng_after_flow(
                config.noise_seed,
                config.mel_bins,
                config.noise_frames,
                config.vocab_size,
                config.token_embedding_dim,
                config.spk_embed_dim,
            )
            self.hift.init_source_tables(generator=generator)


class CosyVoice3Token2Wav(CosyVoice3PreTrainedModel):
    """CosyVoice3 speech-token decoder: `flow` (tokens -> mel) + `hift` (mel -> waveform) + stored speakers.

    Runs in float32 (the flow overflows in float16). The Euler loop has fixed shapes and no host syncs; see
    `compile_estimator`.
    """

    def __init__(self, config: CosyVoice3Config):
        super().__init__(config)
        self.flow = CosyVoice3Flow(config)
        self.hift = CosyVoice3HiFTGenerator(**config.hift_config)
        self.register_buffer(
            "speaker_embeddings", torch.zeros(len(config.speaker_names), config.spk_embed_dim), persistent=True
        )
        self.post_init()

    # -- conditioning ---------------------------------------------------------------------------------------------

    def get_speaker_embedding(
        self,
        speaker: Optional[Union[str, list[str]]] = None,
        speaker_embedding: Optional[torch.Tensor] = None,
        batch_size: int = 1,
    ) -> torch.Tensor:
        """Resolve a stored speaker name (or a list, one per row) or a raw x-vector to (batch, spk_embed_dim).

        With neither given, the first stored speaker is used.
        """
        if speaker is not None and speaker_embedding is not None:
            raise ValueError("Pass either `speaker` (a stored name) or `speaker_embedding`, not both.")
        if speaker_embedding is None:
            names = self.config.speaker_names
            if speaker is None:
                if not names:
                    raise ValueError("This model stores no speaker embeddings; pass `speaker_embedding` (192,).")
                speaker = names[0]
            requested = [speaker] if isinstance(speaker, str) else list(speaker)
            unknown = [name for name in requested if name not in names]
            if unknown:
                raise ValueError(f"Unknown speaker(s) {unknown}; stored speakers: {names}")
            speaker_embedding = self.speaker_embeddings[[names.index(name) for name in requested]]
        speaker_embedding = torch.as_tensor(speaker_embedding)
        if speaker_embedding.dim() == 1:
            speaker_embedding = speaker_embedding.unsqueeze(0)
        if speaker_embedding.dim() != 2 or speaker_embedding.shape[-1] != self.config.spk_embed_dim:
            raise ValueError(
                f"speaker_embedding must have shape ({self.config.spk_embed_dim},) or (batch, "
                f"{self.config.spk_embed_dim}), got {tuple(speaker_embedding.shape)}"
            )
        if speaker_embedding.shape[0] == 1 and batch_size > 1:
            speaker_embedding = speaker_embedding.expand(batch_size, -1)
        if speaker_embedding.shape[0] != batch_size:
            raise ValueError(f"Got {speaker_embedding.shape[0]} speaker embeddings for a batch of {batch_size}.")
        return speaker_embedding.to(self.device, torch.float32)

    def _check_tokens(self, tokens: torch.Tensor, name: str = "speech_tokens") -> torch.Tensor:
        """(batch, tokens) or (tokens,) integer ids, all in the codebook -> (batch, tokens) int64 on the model's
        device."""
        tokens = self._check_token_layout(tokens, name)
        self._check_token_range(tokens, name)
        return tokens.to(self.device, torch.long)

    @staticmethod
    def _check_token_layout(tokens: torch.Tensor, name: str = "speech_tokens") -> torch.Tensor:
        """An integer tensor of shape (batch, tokens) ((tokens,) becomes (1, tokens)); the ids are not read."""
        tokens = torch.as_tensor(tokens)
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {tokens.dtype}")
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2:
            raise ValueError(f"{name} must have shape (batch, tokens), got {tuple(tokens.shape)}")
        return tokens

    def _check_token_range(self, tokens: torch.Tensor, name: str = "speech_tokens") -> None:
        """Raise if an id is outside [0, vocab_size). One host synchronisation for a CUDA tensor."""
        low, high = torch.stack(torch.aminmax(tokens)).tolist() if tokens.numel() else (0, 0)
        if low < 0 or high >= self.config.vocab_size:
            bad = tokens[(tokens < 0) | (tokens >= self.config.vocab_size)].unique().tolist()[:10]
            raise ValueError(
                f"{name} contains ids outside [0, {self.config.vocab_size}): {bad} (filter special/stop tokens "
                "before decoding)"
            )

    # -- flow -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def tokens_to_mel(
        self,
        speech_tokens: torch.Tensor,
        speaker_embedding: torch.Tensor,
        prompt_tokens: Optional[torch.Tensor] = None,
        prompt_mel: Optional[torch.Tensor] = None,
        streaming: bool = False,
        finalize: bool = True,
        speech_token_lengths: Optional[torch.Tensor] = None,
        noise_offset: int = 0,
    ) -> torch.Tensor:
        """Run the flow.

        Args:
            speech_tokens: (batch, tokens) ids in [0, vocab_size).
            speaker_embedding: (batch, spk_embed_dim) or (spk_embed_dim,) x-vector.
            prompt_tokens / prompt_mel: optional voice prompt, (batch, prompt_tokens) and (batch, mel_bins,
                token_mel_ratio * prompt_tokens) log-mel (channel-first like the output); not part of the output.
            streaming: block-causal attention with `config.static_chunk_size` frames (the reference's stream=True).
            finalize: False when more tokens will follow: the last `pre_lookahead_len` tokens are then used only as
                look-ahead context and produce no frames.
            speech_token_lengths: (batch,) valid tokens per row (right padding); finalize=True only.
            noise_offset: first frame of the fixed start noise to use (0 = the reference).

        Returns:
            mel (batch, mel_bins, token_mel_ratio * tokens') float32, tokens' = tokens (finalize) or tokens -
            pre_lookahead_len. With `speech_token_lengths`, frames past a row's length are padding.
        """
        config = self.config
        tokens = self._check_tokens(speech_tokens)
        batch = tokens.shape[0]
        speaker_embedding = self.get_speaker_embedding(speaker_embedding=speaker_embedding, batch_size=batch)
        spks = self.flow.speaker_condition(speaker_embedding)
        if tokens.shape[1] == 0 and finalize:
            return torch.zeros(batch, config.mel_bins, 0, device=self.device)
        num_prompt = 0
        if prompt_tokens is not None or prompt_mel is not None:
            if prompt_tokens is None or prompt_mel is None:
                raise ValueError("prompt_tokens and prompt_mel must be given together")
            prompt_tokens = self._check_tokens(prompt_tokens, "prompt_tokens")
            prompt_mel = torch.as_tensor(prompt_mel).to(self.device, torch.float32)
            num_prompt = prompt_tokens.shape[1]
            expected = (batch, config.mel_bins, config.token_mel_ratio * num_prompt)
            if prompt_tokens.shape[0] != batch or tuple(prompt_mel.shape) != expected:
                raise ValueError(
                    f"prompt_mel must have shape {expected} for prompt_tokens of shape {tuple(prompt_tokens.shape)}, "
                    f"got {tuple(prompt_mel.shape)}"
                )
            tokens = torch.cat([prompt_tokens, tokens], dim=1)
        lengths = None
        if speech_token_lengths is not None:
            if not finalize:
                raise ValueError("speech_token_lengths (padded batches) requires finalize=True")
            lengths = torch.as_tensor(speech_token_lengths, device=self.device).long() + num_prompt
        if not finalize and tokens.shape[1] <= config.pre_lookahead_len:
            raise ValueError(
                f"finalize=False needs more than pre_lookahead_len={config.pre_lookahead_len} tokens, "
                f"got {tokens.shape[1]}"
            )
        mu = self.flow.frame_condition(tokens, lengths, finalize)
        frames = mu.shape[2]
        prompt_frames = config.token_mel_ratio * num_prompt
        cond = torch.zeros_like(mu)
        if prompt_frames:
            cond[:, :, :prompt_frames] = prompt_mel.to(cond.dtype)
        frame_lengths = None if lengths is None else lengths * config.token_mel_ratio
        mask = build_attention_mask(
            frame_lengths, frames, config.static_chunk_size if streaming else None, mu.device, batch
        )
        mel = self.flow.decoder(mu, spks, cond, mask, noise_offset)
        return mel[:, :, prompt_frames:]

    # -- vocoder --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def mel_to_wav(
        self, mel: torch.Tensor, source: Optional[torch.Tensor] = None, finalize: bool = True
    ) -> torch.Tensor:
        """HiFT: mel (batch, mel_bins, frames) -> waveform (batch, samples) in [-audio_limit, audio_limit].

        finalize=True: samples = samples_per_mel_frame * frames; False: the last frames (8 with the default HiFT:
        3 F0 + 4 conv_pre look-ahead + 1) are held back.
        """
        wav, _ = self.hift(mel.to(self.device, torch.float32), finalize=finalize, source=source)
        return wav

    # -- end to end -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        speech_tokens: torch.Tensor,
        speaker_embedding: Optional[torch.Tensor] = None,
        speaker: Optional[Union[str, list[str]]] = None,
        speech_token_lengths: Optional[torch.Tensor] = None,
        segment_tokens: Optional[int] = None,
        return_dict: bool = True,
    ) -> Union[CosyVoice3Token2WavOutput, tuple]:
        """Decode whole token sequences offline (one final flow call and one HiFT call per row or segment).

        Args:
            speech_tokens: (batch, tokens) or (tokens,) ids in [0, vocab_size); rows right-padded if
                `speech_token_lengths` is given. Out-of-range ids raise ValueError (filter stop/special ids first).
            speaker_embedding: (spk_embed_dim,) or (batch, spk_embed_dim) x-vector; or
            speaker: a stored speaker name (e.g. "中文女") or one name per row. Neither: the first stored speaker.
            speech_token_lengths: (batch,) valid tokens per row. Every row decodes to what it gives alone (up to
                float rounding of the batched matmuls).
            segment_tokens: if set, decode each row as independent segments of this many tokens, concatenated
                without cross-fade, exactly like Fun-Audio-Chat's offline `token2wav` (750 = 30 s; a last segment
                shorter than 50 tokens is merged with the previous one and the two are split in halves). All segments
                of all rows run as one batch. None: one flow call per row (the flow's attention then spans the whole
                row; its fixed start noise covers 300 s and is reused cyclically beyond).

        Returns:
            `CosyVoice3Token2WavOutput`: `waveform` (batch, samples) zero-padded on the right and `waveform_lengths`
            (batch,) = samples_per_token x tokens (an empty row gives 0 samples). `return_dict=False`: the tuple.
        """
        tokens = self._check_tokens(speech_tokens)
        batch, max_tokens = tokens.shape
        if speech_token_lengths is None:
            lengths = torch.full((batch,), max_tokens, dtype=torch.long)
        else:
            lengths = torch.as_tensor(speech_token_lengths).long().cpu()
            if lengths.shape != (batch,) or (lengths < 0).any() or (lengths > max_tokens).any():
                raise ValueError(
                    f"speech_token_lengths must be {batch} values in [0, {max_tokens}], got {lengths.tolist()}"
                )
        spk = self.get_speaker_embedding(speaker, speaker_embedding, batch)
        # Pieces: (row, first token, end token); each is decoded independently as one row of a flow batch.
        pieces = []
        for row in range(batch):
            bounds = (
                self.segment_bounds(int(lengths[row]), segment_tokens)
                if segment_tokens is not None
                else [(0, lengths[row])]
            )
            pieces += [(row, int(first), int(end)) for first, end in bounds if end > first]
        per_token = self.config.samples_per_token
        waveform = torch.zeros(batch, per_token * int(lengths.max()) if batch else 0, device=self.device)
        if pieces:
            piece_lengths = [end - first for _, first, end in pieces]
            used = max(piece_lengths)
            piece_tokens = torch.zeros(len(pieces), used, dtype=torch.long, device=self.device)
            for index, (row, first, end) in enumerate(pieces):
                piece_tokens[index, : end - first] = tokens[row, first:end]
            padded = len(set(piece_lengths)) > 1
            mel = self.tokens_to_mel(
                piece_tokens,
                spk[[row for row, _, _ in pieces]],
                speech_token_lengths=torch.tensor(piece_lengths, device=self.device) if padded else None,
            )
            # HiFT looks ahead (f0 predictor, conv_pre, iSTFT), so pieces of different lengths are vocoded in groups
            # of equal length instead of being padded.
            for length in sorted(set(piece_lengths)):
                group = [index for index, piece_length in enumerate(piece_lengths) if piece_length == length]
                wav = self.mel_to_wav(mel[group, :, : length * self.config.token_mel_ratio])
                for wav_row, index in enumerate(group):
                    row, first, end = pieces[index]
                    waveform[row, first * per_token : end * per_token] = wav[wav_row]
        waveform_lengths = (lengths * per_token).to(self.device)
        if not return_dict:
            return waveform, waveform_lengths
        return CosyVoice3Token2WavOutput(waveform=waveform, waveform_lengths=waveform_lengths)

    @staticmethod
    def segment_bounds(num_tokens: int, segment_tokens: int = 750, min_last_tokens: int = 50) -> list[tuple[int, int]]:
        """Fun-Audio-Chat's offline split: consecutive `segment_tokens` segments; when there is more than one and the
        last is shorter than `min_last_tokens`, the last two are merged and cut in halves (first half floor(n/2))."""
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
        bounds = [(first, min(first + segment_tokens, num_tokens)) for first in range(0, num_tokens, segment_tokens)]
        if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < min_last_tokens:
            first, end = bounds[-2][0], bounds[-1][1]
            middle = first + (end - first) // 2
            bounds[-2:] = [(first, middle), (middle, end)]
        return bounds

    # -- performance ----------------------------------------------------------------------------------------------

    def compile_estimator(
        self, whole_solver: bool = False, fuse_qkv_projections: bool = True, **compile_kwargs
    ) -> None:
        """`torch.compile` the DiT estimator in place (the 10-step Euler loop calls it with fixed shapes).

        whole_solver=True compiles the whole Euler loop (`flow.decoder.solve`: 10 steps x CFG batch) as one graph
        instead, which with `mode="reduce-overhead"` replays as one CUDA graph per input length. `compile_kwargs`
        go to `torch.compile`; `dynamic` defaults to True (streaming chunk lengths vary). On CUDA in float32, inputs
        on either side of ~10 s of tokens (`MAX_UNFOLD_ELEMENTS`) are two graphs (a 16-bit estimator runs its
        position convs as a Triton kernel at every length). Offline calls of a few seconds are bound by
        kernel launches: `mode="reduce-overhead"` replays each input length as a CUDA graph (recorded on its first
        call), which halved a 10 s call on an H200 (BENCHMARKS.md). `fuse_qkv_projections` (default True): first
        run each DiT block's q/k/v projections as one GEMM ([`fuse_qkv_projections`]). The position embedding's conv
        weights are stored tap-major for its Triton kernel (`store_tap_major_weights`).
        """
        if fuse_qkv_projections:
            self.fuse_qkv_projections()
        self.flow.decoder.estimator.input_embed.conv_pos_embed.store_tap_major_weights()
        compile_kwargs.setdefault("dynamic", True)
        self._flow_compile_kwargs = dict(compile_kwargs)
        logger.warning("compile_estimator: the decoder's next call compiles its DiT estimator (a minute or more).")
        if whole_solver:
            decoder = self.flow.decoder
            decoder.solve = torch.compile(decoder.solve, **compile_kwargs)
        else:
            self.flow.decoder.estimator.compile(**compile_kwargs)

    def compile_vocoder(self, channels_last_convolutions: Optional[bool] = None, **compile_kwargs) -> None:
        """`torch.compile` HiFT's upsampling stack (`hift.filter_body`: its convs and Snake residual blocks) in place.

        The STFT / iSTFT around it stay eager (complex tensors). Inductor fuses each Snake activation (~6 element-wise
        kernels eagerly, ~70 of them per call) and the residual sums; streaming decoders replay the compiled stack
        inside their CUDA graph. `compile_kwargs` go to `torch.compile`; `dynamic` defaults to True (the vocoder
        windows of a stream and offline lengths vary). Measured on an H200 (BENCHMARKS.md): a streamed chunk's vocoder
        stage goes from 5.4 to 3.8 ms; no offline gain; the first call compiles ~55 s longer.

        `channels_last_convolutions` (None = True when the model is on a CUDA device) first calls
        `hift.use_channels_last_convolutions()`: the filter's convs and the element-wise ops between them run
        channels-last, so that cuDNN's NHWC kernels need no layout conversions (convs with channel counts that are
        not multiples of 8, such as the 18-channel source_downs and conv_post, keep the default layout). Side by side
        on an H200, a streamed chunk took 12.91 against 13.25 ms (BENCHMARKS.md).
        """
        if channels_last_convolutions is None:
            channels_last_convolutions = self.device.type == "cuda"
        if channels_last_convolutions:
            self.hift.use_channels_last_convolutions()
        compile_kwargs.setdefault("dynamic", True)
        logger.warning("compile_vocoder: the decoder's next call compiles its vocoder (about a minute).")
        self.hift.filter_body = torch.compile(self.hift.filter_body, **compile_kwargs)

    @torch.no_grad()
    def use_low_precision_estimator(self, dtype: str = "bfloat16") -> None:
        """Run the DiT estimator in `dtype` ("bfloat16" or "float16"), storing its weights in that dtype.

        Sets `config.estimator_autocast_dtype` and casts the estimator's parameters (not its buffers: the rotary
        table stays float32) once, in place. Under autocast every Linear / Conv casts its float32 weights to `dtype`
        on each call (7 casts per DiT block, 10 Euler steps per flow call); weights already in `dtype` give the
        same values without those casts, so the output is unchanged (tested bit-exact against autocast over
        float32 weights) and the estimator's weight memory halves. In place and one-way: reload the model to go
        back to float32.
        """
        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {dtype!r}")
        self.config.estimator_autocast_dtype = dtype
        for parameter in self.flow.decoder.estimator.parameters():
            parameter.data = parameter.data.to(getattr(torch, dtype))
        # The derived weight copies (fused q/k/v, tap-major position convs) follow the weights' new dtype.
        if self.qkv_projections_fused:
            self.fuse_qkv_projections()
        position_embedding = self.flow.decoder.estimator.input_embed.conv_pos_embed
        if position_embedding.conv1_tap_major is not None:
            position_embedding.store_tap_major_weights()

    def fuse_qkv_projections(self) -> None:
        """Run each DiT block's q/k/v projections as one GEMM: 22 x 10 fewer GEMMs per flow call at full size, which
        matter where the flow is bound by kernel latency (streaming chunks, short offline calls). Equal up to float
        rounding. The fused weights are non-persistent copies (checkpoints are unchanged), taken now: call it again,
        or `unfuse_qkv_projections()`, after changing the estimator's weights (`use_low_precision_estimator` does).
        `compile_estimator()` calls it by default."""
        for block in self.flow.decoder.estimator.transformer_blocks:
            block.attn.fuse_qkv_projections()

    def unfuse_qkv_projections(self) -> None:
        for block in self.flow.decoder.estimator.transformer_blocks:
            block.attn.unfuse_qkv_projections()

    @property
    def qkv_projections_fused(self) -> bool:
        blocks = self.flow.decoder.estimator.transformer_blocks
        return len(blocks) > 0 and blocks[0].attn.qkv_weight is not None

    @property
    def flow_is_compiled(self) -> bool:
        """Whether `compile_estimator` was called (streaming decoders then give the flow one fixed shape)."""
        return getattr(self, "_flow_compile_kwargs", None) is not None

    @property
    def flow_compiles_cuda_graphs(self) -> bool:
        """Whether the compiled flow records its own CUDA graphs (`mode="reduce-overhead"` / `"max-autotune"`)."""
        mode = (getattr(self, "_flow_compile_kwargs", None) or {}).get("mode")
        return mode in ("reduce-overhead", "max-autotune")

    # -- streaming ------------------------------------------------------------------------------------------------

    def streaming_decoder(
        self,
        speaker: Optional[str] = None,
        speaker_embedding: Optional[torch.Tensor] = None,
        token_hop_len: int = 15,
        pre_lookahead_len: Optional[int] = None,
        **kwargs,
    ) -> CosyVoice3StreamingDecoder:
        """A `CosyVoice3StreamingDecoder` for one reply (see its docstring for the chunking and the defaults of
        `flow_left_context_tokens` / `hift_left_context_frames`, passed through `kwargs`)."""
        return CosyVoice3StreamingDecoder(
            self,
            self.get_speaker_embedding(speaker, speaker_embedding, 1),
            token_hop_len=token_hop_len,
            pre_lookahead_len=self.config.pre_lookahead_len if pre_lookahead_len is None else pre_lookahead_len,
            **kwargs,
        )

    # -- loading the official files -------------------------------------------------------------------------------

    @classmethod
    def from_original(
        cls,
        model_dir: Union[str, Path],
        speakers_file: Optional[Union[str, Path]] = None,
        speaker_names: Optional[list[str]] = None,
    ) -> "CosyVoice3Token2Wav":
        """Build from an official CosyVoice3 folder (`cosyvoice3.yaml`, `flow.pt`, `hift.pt`, optionally
        `spk2info.pt` / `new_spk2info.pt`, or `speakers_file`). `speaker_names` selects/orders the stored speakers.
        """
        from .conversion_cosyvoice3 import load_original_checkpoint

        return load_original_checkpoint(cls, model_dir, speakers_file, speaker_names)


__all__ = [
    "CosyVoice3PreTrainedModel",
    "CosyVoice3StreamingDecoder",
    "CosyVoice3Token2Wav",
    "CosyVoice3Token2WavOutput",
]
