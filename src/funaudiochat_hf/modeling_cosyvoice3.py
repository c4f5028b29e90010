"""CosyVoice3 token2wav in plain PyTorch: speech tokens (25 Hz, vocab 6561) -> 80-bin log-mel (flow) -> 24 kHz
audio (HiFT).

The flow (`modeling_cosyvoice3_flow.py`) embeds the tokens, adds a 3-token look-ahead conv, repeats every token twice
(50 Hz mel rate) and integrates a conditional flow-matching ODE with a DiT velocity estimator
(`modeling_cosyvoice3_dit.py`; 10 Euler steps on a cosine time grid, classifier-free guidance with a packed
[conditional, unconditional] batch), starting from a fixed noise tensor. HiFT (`modeling_cosyvoice3_hift.py`) turns
the mel into a waveform. Module paths mirror the official `flow.pt` / `hift.pt` keys (`flow.input_embedding`,
`flow.decoder.estimator.transformer_blocks.0.attn.to_q`, `hift.conv_pre`, ...).

This file holds the model, `CosyVoice3Token2Wav`; its speed settings and its offline CUDA graphs are mixins
(`modeling_cosyvoice3_performance.py`, `modeling_cosyvoice3_offline_graphs.py`).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_cosyvoice3 import CosyVoice3Config
from .cuda_graph_cosyvoice3 import CUDAGraphRunner
from .modeling_cosyvoice3_dit import (  # noqa: F401  (re-exported: importable from here as before)
    CosyVoice3AdaLayerNormFinal,
    CosyVoice3AdaLayerNormZero,
    CosyVoice3Attention,
    CosyVoice3CausalConvPositionEmbedding,
    CosyVoice3DiT,
    CosyVoice3DiTBlock,
    CosyVoice3FeedForward,
    CosyVoice3InputEmbedding,
    CosyVoice3RotaryEmbedding,
    CosyVoice3TimestepEmbedding,
    linear_gelu_tanh,
)
from .modeling_cosyvoice3_flow import (  # noqa: F401  (re-exported)
    CosyVoice3ConditionalFlowMatching,
    CosyVoice3Flow,
    CosyVoice3PreLookaheadLayer,
    additive_attention_mask,
    build_attention_mask,
)
from .modeling_cosyvoice3_hift import CosyVoice3HiFTGenerator, reference_rng_after_flow
from .modeling_cosyvoice3_offline_graphs import (  # noqa: F401  (re-exported)
    OFFLINE_GRAPH_BUCKET_TOKENS,
    OFFLINE_MAX_GRAPHS,
    CosyVoice3OfflineGraphsMixin,
    flow_graph_settings,
)
from .modeling_cosyvoice3_performance import CosyVoice3PerformanceMixin
from .streaming_cosyvoice3 import CosyVoice3StreamingDecoder
from .weights_files_funaudiochat import naming_unreadable_weights


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

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        # The DiT calls its own attention (`dit_attention`), not transformers' attention interface: there is no
        # implementation to switch, so `set_attn_implementation` (also a chat model's, on its bundled decoder) warns
        # and leaves this model as it is.
        return False

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


def _check_finite_float(value, name: str) -> torch.Tensor:
    """A floating-point tensor without NaN/Inf (one host synchronisation for an accelerator tensor): a non-finite
    speaker embedding or mel would otherwise come out as NaN audio."""
    value = torch.as_tensor(value)
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    return value


def _check_lengths(lengths, batch: int, max_tokens: int) -> torch.Tensor:
    """`speech_token_lengths`: (batch,) integers in [0, max_tokens] -> int64 on the CPU."""
    lengths = torch.as_tensor(lengths)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"speech_token_lengths must be integers, got {lengths.dtype}")
    lengths = lengths.long().cpu()
    if lengths.shape != (batch,) or (lengths < 0).any() or (lengths > max_tokens).any():
        raise ValueError(f"speech_token_lengths must be {batch} values in [0, {max_tokens}], got {lengths.tolist()}")
    return lengths


class CosyVoice3Token2Wav(CosyVoice3PerformanceMixin, CosyVoice3OfflineGraphsMixin, CosyVoice3PreTrainedModel):
    """CosyVoice3 speech-token decoder: `flow` (tokens -> mel) + `hift` (mel -> waveform) + stored speakers.

    Loads in float32. On its first call on a CUDA device the DiT estimator switches to bfloat16 and keeps fused
    q/k/v and tap-major position-conv weight copies (`apply_device_defaults`; `config.estimator_precision="float32"`
    keeps the reference's float32). The Euler loop has fixed shapes and no host syncs; see `compile_estimator`.
    """

    def __init__(self, config: CosyVoice3Config):
        super().__init__(config)
        self.flow = CosyVoice3Flow(config)
        self.hift = CosyVoice3HiFTGenerator(**config.hift_config)
        self.register_buffer(
            "speaker_embeddings", torch.zeros(len(config.speaker_names), config.spk_embed_dim), persistent=True
        )
        # The device type `apply_device_defaults` last ran for (None: not yet).
        self._device_defaults_applied: Optional[str] = None
        self._offline_flow_graphs: Optional[CUDAGraphRunner] = None  # see `offline_flow_graphs`
        # Streamed chunks' {"flow", "hift"} graph runners, shared by this model's streaming decoders, made on their first
        # CUDA-graphed chunk (`streaming_cosyvoice3`); `clear_streaming_graphs()` frees them.
        self.streaming_graph_runners: Optional[dict[str, CUDAGraphRunner]] = None
        self.post_init()

    def clear_streaming_graphs(self) -> None:
        """Free the streamed chunks' CUDA graphs (a later stream records them again)."""
        self.streaming_graph_runners = None

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
            requested = [speaker] if isinstance(speaker, str) else speaker
            if not isinstance(requested, (list, tuple)) or not all(isinstance(name, str) for name in requested):
                raise ValueError(
                    f"`speaker` must be a stored speaker's name or a list of names (one per row), got "
                    f"{type(speaker).__name__}; pass an x-vector as `speaker_embedding` "
                    f"({self.config.spk_embed_dim},)."
                )
            requested = list(requested)
            unknown = [name for name in requested if name not in names]
            if unknown:
                raise ValueError(f"Unknown speaker(s) {unknown}; stored speakers: {names}")
            speaker_embedding = self.speaker_embeddings[[names.index(name) for name in requested]]
        else:
            speaker_embedding = _check_finite_float(speaker_embedding, "speaker_embedding")
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
        if tokens.shape[0] == 0:
            raise ValueError(f"{name} has 0 rows: pass at least one sequence, shape (batch >= 1, tokens)")
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
        self.apply_device_defaults()
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
            prompt_mel = _check_finite_float(prompt_mel, "prompt_mel").to(self.device, torch.float32)
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
            lengths = _check_lengths(speech_token_lengths, batch, tokens.shape[1] - num_prompt).to(self.device)
            lengths = lengths + num_prompt
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
        mel = _check_finite_float(mel, "mel")
        if mel.dim() != 3 or mel.shape[1] != self.config.mel_bins:
            raise ValueError(f"mel must have shape (batch, {self.config.mel_bins}, frames), got {tuple(mel.shape)}")
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
        cuda_graphs: Union[bool, str] = "auto",
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
            cuda_graphs: "auto" (on when the model is on a CUDA device, unless its flow was compiled with CUDA graphs
                of its own): run the flow (token embedding, look-ahead conv, Euler solver) as a CUDA graph replay,
                its tokens right-padded to a bucket of `OFFLINE_GRAPH_BUCKET_TOKENS` (pieces up to 768 tokens; the
                mel equals the unpadded call's up to float rounding). Graphs are recorded on the first call of each
                bucket and batch size and kept by the model (`offline_flow_graphs`). HiFT runs as ordinary calls.

        Returns:
            `CosyVoice3Token2WavOutput`: `waveform` (batch, samples) zero-padded on the right and `waveform_lengths`
            (batch,) = samples_per_token x tokens (an empty row gives 0 samples). `return_dict=False`: the tuple.
        """
        self.apply_device_defaults()
        use_graphs = self._resolve_cuda_graphs(cuda_graphs)
        tokens = self._check_tokens(speech_tokens)
        batch, max_tokens = tokens.shape
        if speech_token_lengths is None:
            lengths = torch.full((batch,), max_tokens, dtype=torch.long)
        else:
            lengths = _check_lengths(speech_token_lengths, batch, max_tokens)
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
            piece_speakers = spk[[row for row, _, _ in pieces]]
            bucket = self.offline_graph_bucket(used) if use_graphs else None
            if bucket is not None:
                mel = self._bucketed_flow(piece_tokens, piece_speakers, piece_lengths, bucket, self.offline_flow_graphs)
            else:
                padded = len(set(piece_lengths)) > 1
                mel = self.tokens_to_mel(
                    piece_tokens,
                    piece_speakers,
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
        self.apply_device_defaults()
        return CosyVoice3StreamingDecoder(
            self,
            self.get_speaker_embedding(speaker, speaker_embedding, 1),
            token_hop_len=token_hop_len,
            pre_lookahead_len=self.config.pre_lookahead_len if pre_lookahead_len is None else pre_lookahead_len,
            **kwargs,
        )

    # -- loading --------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "CosyVoice3Token2Wav":
        """`PreTrainedModel.from_pretrained`; an unreadable `.safetensors` file raises an `OSError` naming it."""
        with naming_unreadable_weights(pretrained_model_name_or_path, kwargs):
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

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
