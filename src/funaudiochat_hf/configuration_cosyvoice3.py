"""Configuration of the CosyVoice3 token2wav decoder (speech tokens -> 24 kHz waveform)."""

import math
from typing import Any, Optional

from transformers import PreTrainedConfig


ESTIMATOR_PRECISIONS = ("auto", "float32", "bfloat16", "float16")


class CosyVoice3Config(PreTrainedConfig):
    r"""
    Configuration of [`CosyVoice3Token2Wav`]: the flow (token embedding, speaker affine, pre-lookahead convs, DiT
    conditional flow matching) and the HiFT vocoder of Fun-CosyVoice3-0.5B-2512. Defaults are the full-size model.

    Args:
        vocab_size (`int`, defaults to 6561): number of speech tokens (3^8 FSQ codes); valid ids are `[0, vocab_size)`.
        token_embedding_dim (`int`, defaults to 80): token embedding width (`flow.input_size`).
        mel_bins (`int`, defaults to 80): mel channels produced by the flow (`flow.output_size`).
        spk_embed_dim (`int`, defaults to 192): speaker x-vector size (CAM++).
        token_mel_ratio (`int`, defaults to 2): mel frames per speech token (25 Hz tokens -> 50 Hz mels).
        pre_lookahead_len (`int`, defaults to 3): right context of the pre-lookahead conv, in tokens.
        pre_lookahead_channels (`int`, defaults to 1024): hidden width of the pre-lookahead convs.
        dit_dim (`int`, defaults to 1024): DiT hidden size.
        dit_depth (`int`, defaults to 22): number of DiT blocks.
        dit_heads (`int`, defaults to 16): attention heads.
        dit_dim_head (`int`, defaults to 64): per-head width; also the rotary width (only head 0 is rotated).
        dit_ff_mult (`int`, defaults to 2): feed-forward expansion.
        dit_conv_pos_kernel_size (`int`, defaults to 31) / dit_conv_pos_groups (`int`, defaults to 16): causal
            convolutional position embedding.
        dit_time_embed_dim (`int`, defaults to 256): sinusoidal time-embedding width.
        rope_theta (`float`, defaults to 10000.0): rotary base.
        static_chunk_size (`int`, defaults to 50): attention chunk (mel frames) of the block-causal mask used when
            the flow runs with `streaming=True`.
        n_timesteps (`int`, defaults to 10): Euler steps of the flow-matching ODE.
        inference_cfg_rate (`float`, defaults to 0.7): classifier-free guidance weight,
            `v = (1 + w) v_cond - w v_uncond`.
        t_scheduler (`str`, defaults to `"cosine"`): `"cosine"` (`t = 1 - cos(pi/2 s)`) or `"linear"`.
        noise_frames (`int`, defaults to 15000): length of the fixed ODE start noise (300 s of mel), the longest flow
            call.
        noise_seed (`int`, defaults to 0): seed of the fixed start noise (the reference draws it right after
            re-seeding the global RNG with 0).
        estimator_precision (`str`, defaults to `"auto"`): the precision the DiT estimator is brought to on its
            first use on a device (`CosyVoice3Token2Wav.apply_device_defaults`): `"auto"` = `"bfloat16"` on CUDA
            and left as it is elsewhere (float32 for a freshly loaded model); `"float32"`, `"bfloat16"` or
            `"float16"` on every device. A 16-bit precision stores the estimator's weights in that dtype and runs it
            under autocast (normalisations, the time embedding, rotary tables and the Euler update stay float32).
            Pass `estimator_precision="float32"` to `from_pretrained` (or set it before the first call) for the
            reference's float32 arithmetic.
        estimator_autocast_dtype (`str`, *optional*): the precision the estimator runs in now: `None` = float32,
            `"bfloat16"` or `"float16"` = under `torch.autocast` with that dtype. Applying `estimator_precision`
            (or `CosyVoice3Token2Wav.use_low_precision_estimator()`) sets it; setting it alone runs autocast over
            float32 weights (the same output, with per-call weight casts).
        hift_config (`dict`, *optional*): keyword arguments of `CosyVoice3HiFTGenerator`, named like the `hift:`
            section of `cosyvoice3.yaml` (`f0_predictor` as a dict); `None` uses the full-size defaults.
        sampling_rate (`int`, defaults to 24000): output sample rate.
        speaker_names (`list[str]`, *optional*): names of the speaker embeddings stored in the weights (buffer
            `speaker_embeddings`, one row per name, same order).
    """

    model_type = "cosyvoice3"

    def __init__(
        self,
        vocab_size: int = 6561,
        token_embedding_dim: int = 80,
        mel_bins: int = 80,
        spk_embed_dim: int = 192,
        token_mel_ratio: int = 2,
        pre_lookahead_len: int = 3,
        pre_lookahead_channels: int = 1024,
        dit_dim: int = 1024,
        dit_depth: int = 22,
        dit_heads: int = 16,
        dit_dim_head: int = 64,
        dit_ff_mult: int = 2,
        dit_conv_pos_kernel_size: int = 31,
        dit_conv_pos_groups: int = 16,
        dit_time_embed_dim: int = 256,
        rope_theta: float = 10000.0,
        static_chunk_size: int = 50,
        n_timesteps: int = 10,
        inference_cfg_rate: float = 0.7,
        t_scheduler: str = "cosine",
        noise_frames: int = 15000,
        noise_seed: int = 0,
        estimator_precision: str = "auto",
        estimator_autocast_dtype: Optional[str] = None,
        hift_config: Optional[dict[str, Any]] = None,
        sampling_rate: int = 24000,
        speaker_names: Optional[list[str]] = None,
        **kwargs,
    ):
        if t_scheduler not in ("cosine", "linear"):
            raise ValueError(f"t_scheduler must be 'cosine' or 'linear', got {t_scheduler!r}")
        if estimator_precision not in ESTIMATOR_PRECISIONS:
            raise ValueError(f"estimator_precision must be one of {ESTIMATOR_PRECISIONS}, got {estimator_precision!r}")
        if estimator_autocast_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(
                f"estimator_autocast_dtype must be None, 'bfloat16' or 'float16', got {estimator_autocast_dtype!r}"
            )
        if dit_dim % dit_conv_pos_groups != 0:
            raise ValueError(f"dit_dim ({dit_dim}) must be divisible by dit_conv_pos_groups ({dit_conv_pos_groups})")
        self.vocab_size = vocab_size
        self.token_embedding_dim = token_embedding_dim
        self.mel_bins = mel_bins
        self.spk_embed_dim = spk_embed_dim
        self.token_mel_ratio = token_mel_ratio
        self.pre_lookahead_len = pre_lookahead_len
        self.pre_lookahead_channels = pre_lookahead_channels
        self.dit_dim = dit_dim
        self.dit_depth = dit_depth
        self.dit_heads = dit_heads
        self.dit_dim_head = dit_dim_head
        self.dit_ff_mult = dit_ff_mult
        self.dit_conv_pos_kernel_size = dit_conv_pos_kernel_size
        self.dit_conv_pos_groups = dit_conv_pos_groups
        self.dit_time_embed_dim = dit_time_embed_dim
        self.rope_theta = rope_theta
        self.static_chunk_size = static_chunk_size
        self.n_timesteps = n_timesteps
        self.inference_cfg_rate = inference_cfg_rate
        self.t_scheduler = t_scheduler
        self.noise_frames = noise_frames
        self.noise_seed = noise_seed
        self.estimator_precision = estimator_precision
        self.estimator_autocast_dtype = estimator_autocast_dtype
        self.hift_config = dict(hift_config) if hift_config is not None else {}
        self.sampling_rate = sampling_rate
        self.speaker_names = list(speaker_names) if speaker_names is not None else []
        super().__init__(**kwargs)

    @property
    def samples_per_token(self) -> int:
        """Output samples per speech token (960 at 24 kHz: 2 mel frames x 480 samples)."""
        return self.token_mel_ratio * self.samples_per_mel_frame

    @property
    def samples_per_mel_frame(self) -> int:
        """Output samples per mel frame: the HiFT upsampling product times the iSTFT hop (8*5*3*4 = 480)."""
        rates = self.hift_config.get("upsample_rates", [8, 5, 3])
        hop = self.hift_config.get("istft_params", {}).get("hop_len", 4)
        return math.prod(rates) * hop


__all__ = ["CosyVoice3Config"]
