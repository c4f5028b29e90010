"""CosyVoice3's flow: speech tokens -> 80-bin log-mel.

`CosyVoice3Flow` embeds the tokens, adds a 3-token look-ahead conv and repeats every token twice (50 Hz mel rate);
`CosyVoice3ConditionalFlowMatching` integrates the conditional flow-matching ODE with the DiT velocity estimator
(10 Euler steps on a cosine time grid, classifier-free guidance with a packed [conditional, unconditional] batch),
starting from a fixed noise tensor. Module paths mirror the official `flow.pt` keys.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_cosyvoice3 import CosyVoice3Config
from .modeling_cosyvoice3_dit import CosyVoice3DiT


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
        (n_steps, 2 * batch, 2 * dim)), in the estimator's precision. Every row of a step has the same t, so the
        modulations are computed for one row and expanded (stride 0) to the 2 * batch rows: a CUDA graph of the
        flow keeps one row of them as its input, not one per row (`CUDAGraphRunner` copies broadcast inputs
        compactly). The same for every call with the same batch size, precision and weights:
        [`cached_time_conditioning`] keeps it, which takes the time MLP and 23 modulation GEMMs per Euler step (2.8
        GB of bfloat16 weight reads per chunk at full size) out of every streamed chunk and offline call.
        """
        self._check_estimator_dtype(dtype)
        times, deltas = self.time_grid(device, dtype)
        blocks, finals = [], []
        for step in range(self.config.n_timesteps):
            with self._estimator_autocast(device):
                block_modulations, final_modulation = self.estimator.time_conditioning(times[step].expand(1))
            blocks.append(block_modulations)
            finals.append(final_modulation)
        rows = 2 * batch
        return deltas, torch.stack(blocks).expand(-1, -1, rows, -1), torch.stack(finals).expand(-1, rows, -1)

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
            # a few batch sizes / devices at most (batched streaming: 1, 2, 4, 8, 16)
            if cached is None and len(self._time_conditioning_cache) >= 8:
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


__all__ = [
    "CosyVoice3ConditionalFlowMatching",
    "CosyVoice3Flow",
    "CosyVoice3PreLookaheadLayer",
    "additive_attention_mask",
    "build_attention_mask",
]
