"""Fun-Audio-Chat's audio encoders: the continuous one (Whisper-large-v3-style Transformer on 128-bin log-mels,
`continuous_audio_tower`) and the discrete one (speech-token embeddings pooled to 5 Hz, `audio_tower`).

Module names follow the official checkpoint so the released safetensors load unchanged.
"""

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioAttention,
    Qwen2_5OmniAudioEncoderLayer,
    eager_attention_forward,
)

from .configuration_funaudiochat import FunAudioChatAudioEncoderConfig
from .modeling_funaudiochat_pretrained import FunAudioChatPreTrainedModel


def sinusoid_position_table(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal position table `(length, channels)`: `[sin(t * inv_j) || cos(t * inv_j)]` with
    `inv_j = exp(-j * ln(max_timescale) / (channels / 2 - 1))`, j < channels / 2."""
    if channels % 2 != 0:
        raise ValueError(f"The sinusoidal position table needs an even number of channels, got {channels}.")
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2, dtype=torch.float32))
    scaled_time = torch.arange(length, dtype=torch.float32)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


def chunk_lengths(clip_lens: list[int], chunk_size: int) -> list[int]:
    """Lengths of the consecutive `chunk_size`-frame chunks of every clip, clip-major (a clip's last chunk may be
    shorter). `clip_lens`: frame counts, all > 0."""
    lengths = []
    for length in clip_lens:
        full, tail = divmod(length, chunk_size)
        lengths += [chunk_size] * full + ([tail] if tail else [])
    return lengths


class FunAudioChatUnusedTable(nn.Module):
    """A `(num_rows, dim)` table the official checkpoint stores (`<prefix>.weight`) but the model never reads: a
    persistent buffer, so it round-trips through checkpoints without being a parameter that never gets a gradient."""

    def __init__(self, num_rows: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_rows, dim))


class FunAudioChatAudioAttention(Qwen2_5OmniAudioAttention):
    """Qwen2.5-Omni's audio attention (same parameters) that can also run on equal-length padded chunks.

    transformers' version takes the chunks packed back to back and, unless flash attention's varlen kernel is used,
    splits them with `cu_seqlens.tolist()` (a host sync in every layer) and makes one attention call per chunk. Given
    `attention_mask` (num_chunks, 1, 1, chunk_frames), an additive key-padding mask, the input is instead the chunks
    padded to `chunk_frames` rows each, `(num_chunks * chunk_frames, d_model)`, and one batched call covers them all.
    """

    def forward(self, hidden_states, cu_seqlens, attention_mask=None, attention_weights: list | None = None, **kwargs):
        """`attention_weights`: a list that gets this layer's `(num_chunks, heads, chunk_frames, chunk_frames)`
        weights appended (padded-chunk path with eager attention; other kernels give None)."""
        if attention_mask is None:
            if attention_weights is not None:
                raise ValueError("Attention weights are only returned for the padded-chunk path (eager attention).")
            return super().forward(hidden_states, cu_seqlens, **kwargs)
        num_chunks, chunk_frames = attention_mask.shape[0], attention_mask.shape[-1]

        def heads(projection: nn.Linear) -> torch.Tensor:  # (num_chunks, heads, chunk_frames, head_dim)
            return projection(hidden_states).view(num_chunks, chunk_frames, self.num_heads, -1).transpose(1, 2)

        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        attn_output, weights = attention(
            self,
            heads(self.q_proj),
            heads(self.k_proj),
            heads(self.v_proj),
            attention_mask=attention_mask,
            scaling=self.scaling,
            dropout=0.0 if not self.training else self.attention_dropout,
            is_causal=False,
            **kwargs,
        )
        if attention_weights is not None:
            attention_weights.append(weights)
        return self.out_proj(attn_output.reshape(num_chunks * chunk_frames, -1))


class FunAudioChatAudioEncoder(FunAudioChatPreTrainedModel):
    """Continuous audio encoder: Whisper-large-v3-style Transformer on 128-bin log-mels (Qwen2.5-Omni layout).

    Every clip is cut into chunks of `2 * n_window` mel frames (2 s) that are encoded independently (block-diagonal
    attention; positions restart in every chunk), then average-pooled to 25 Hz and projected to the LLM width.
    The layers are transformers' `Qwen2_5OmniAudioEncoderLayer` (same math and parameter names), so attention goes
    through the transformers attention interface (sdpa / flash / eager all give the same, correct, result).
    """

    config_class = FunAudioChatAudioEncoderConfig
    config: FunAudioChatAudioEncoderConfig
    main_input_name = "input_features"
    # Attention other than flash: run the 2-s chunks padded to one length, one attention call per layer (False:
    # transformers' packed path, one call per chunk after a host sync in every layer).
    pad_chunks = True
    input_modalities = ("audio",)
    _no_split_modules = ["Qwen2_5OmniAudioEncoderLayer"]

    def __init__(self, config: FunAudioChatAudioEncoderConfig):
        super().__init__(config)
        embed_dim = config.d_model
        self.n_window = config.n_window
        self.conv1 = nn.Conv1d(config.num_mel_bins, embed_dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(embed_dim, embed_dim, kernel_size=3, stride=2, padding=1)
        # Not in the checkpoint: recomputed from `sinusoid_position_table` (also by `_init_weights` after loading).
        self.register_buffer(
            "positional_embedding",
            sinusoid_position_table(config.max_source_positions, embed_dim),
            persistent=False,
        )
        # Present in the official checkpoint (Qwen2.5-Omni heritage) but never used by the model: kept as a buffer
        # under the same key, so checkpoints load and save unchanged and no trained parameter goes without gradient.
        self.audio_bos_eos_token = FunAudioChatUnusedTable(2, config.output_dim)
        self.layers = nn.ModuleList([Qwen2_5OmniAudioEncoderLayer(config) for _ in range(config.encoder_layers)])
        for layer in self.layers:
            layer.self_attn = FunAudioChatAudioAttention(config)
        self.ln_post = nn.LayerNorm(embed_dim)
        self.proj = nn.Linear(embed_dim, config.output_dim)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # transformers hands every module under this encoder to its own `_init_weights`, also inside the chat model.
        super()._init_weights(module)
        if isinstance(module, FunAudioChatAudioEncoder):
            table = sinusoid_position_table(module.positional_embedding.shape[0], module.positional_embedding.shape[1])
            init.copy_(module.positional_embedding, table)
        elif isinstance(module, FunAudioChatUnusedTable):
            init.zeros_(module.weight)

    def get_input_embeddings(self) -> nn.Module:
        """The first conv plays the role of the input embedding (e.g. for `enable_input_require_grads`)."""
        return self.conv1

    @staticmethod
    def output_lengths(feature_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(after_conv_lens, output_lens)` for mel lengths `feature_lens`: stride-2 conv, then stride-2 pooling."""
        after_conv = (feature_lens - 1) // 2 + 1
        return after_conv, (after_conv - 2) // 2 + 1

    def _conv_front(self, chunks: torch.Tensor, chunk_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(num_chunks, num_mel_bins, frames)` padded chunks -> `(num_chunks, ceil(frames / 2), d_model)`: both convs
        (the padding frames zeroed in between) and the positions; and `(num_chunks, ceil(frames / 2))` which frames are
        valid."""
        dtype, device = self.conv1.weight.dtype, self.conv1.weight.device
        chunks = chunks.to(device, dtype)
        frame_mask = torch.arange(chunks.shape[-1], device=device) < chunk_lengths[:, None]
        hidden = F.gelu(self.conv1(chunks)) * frame_mask[:, None, :].to(dtype)
        hidden = F.gelu(self.conv2(hidden)).transpose(1, 2)
        hidden = hidden + self.positional_embedding[: hidden.shape[1]].to(hidden.device, hidden.dtype)
        valid = torch.arange(hidden.shape[1], device=device) < ((chunk_lengths - 1) // 2 + 1)[:, None]
        return hidden, valid

    def encode_chunks(
        self,
        chunks: torch.Tensor,
        chunk_lengths: torch.Tensor,
        all_hidden_states: list | None = None,
        all_attentions: list | None = None,
    ) -> torch.Tensor:
        """The padded-chunk path's layers: conv front end, positions, every layer with the padded keys masked. Fixed
        shapes and no host sync, so that a recorded CUDA graph can replay it (`generation_audio_graph_funaudiochat`).

        Args:
            chunks: `(num_chunks, num_mel_bins, frames)` mel chunks right-padded to `frames` (<= `2 * n_window`).
            chunk_lengths: `(num_chunks,)` valid frames of every chunk, on the encoder's device.
            all_hidden_states: a list that gets every layer's input and the last layer's output, each
                `(num_chunks, ceil(frames / 2), d_model)`; `all_attentions`: one that gets every layer's weights.
        Returns:
            `(num_chunks, ceil(frames / 2), d_model)`: the last layer's output, frame t of a chunk valid for
            `t < (chunk_length - 1) // 2 + 1` (padding rows never touch valid ones: every op but attention is per frame).
        """
        hidden, valid = self._conv_front(chunks, chunk_lengths)
        num_chunks, frames, _ = hidden.shape
        key_mask = torch.zeros(num_chunks, 1, 1, frames, dtype=hidden.dtype, device=hidden.device)
        key_mask = key_mask.masked_fill(~valid[:, None, None, :], torch.finfo(hidden.dtype).min)
        hidden = hidden.reshape(num_chunks * frames, -1)
        for layer in self.layers:  # the chunk layout is in the mask's shape: no cu_seqlens
            if all_hidden_states is not None:
                all_hidden_states.append(hidden.view(num_chunks, frames, -1))
            hidden = layer(hidden, cu_seqlens=None, attention_mask=key_mask, attention_weights=all_attentions)[0]
        hidden = hidden.view(num_chunks, frames, -1)
        if all_hidden_states is not None:
            all_hidden_states.append(hidden)
        return hidden

    def forward(
        self,
        input_features: torch.Tensor,
        feature_lens: torch.Tensor,
        speech_maxlen: int,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        chunk_encoder: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> BaseModelOutput:
        """
        Args:
            input_features: `(num_mel_bins, total_frames)` the valid mel frames of all clips, concatenated clip-major.
            feature_lens: `(num_clips,)` mel frames per clip (0 for a clip without audio); read on the host once.
            speech_maxlen: output length per clip (`S`, the padded speech-id length).
            output_hidden_states: also return the input of every layer and the last layer's output (default: config).
            output_attentions: also return every layer's attention weights (default: config; eager attention).
            chunk_encoder: runs the padded-chunk path in place of `encode_chunks` (same arguments; it may pad the
                chunks to `2 * n_window` frames), e.g. a recorded CUDA graph of it; unused when hidden states or
                attentions are asked for, or with flash attention.
        Returns:
            `last_hidden_state` `(num_clips, speech_maxlen, output_dim)`: 25 Hz features, zero past each clip's length
            (and for empty clips), truncated to `speech_maxlen`. `hidden_states`: `encoder_layers + 1` tensors,
            `(num_chunks, chunk_frames, d_model)` chunks padded to one length (flash attention: the packed valid
            frames `(frames, d_model)`). `attentions`: `encoder_layers` tensors `(num_chunks, heads, chunk_frames,
            chunk_frames)`.
        """
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        all_hidden_states = [] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        dtype, device = self.conv1.weight.dtype, self.conv1.weight.device
        # Every length on the host (one read): the chunk layout and the clips' rows are plain slices, no host syncs.
        feature_lens = [int(length) for length in feature_lens.tolist()]
        num_clips = len(feature_lens)
        clip_lens = [length for length in feature_lens if length > 0]
        if not clip_lens:
            output = torch.zeros(num_clips, speech_maxlen, self.proj.out_features, dtype=dtype, device=device)
            return BaseModelOutput(last_hidden_state=output, hidden_states=None, attentions=None)
        if sum(clip_lens) != input_features.shape[-1]:
            raise ValueError(
                f"feature_lens sum to {sum(clip_lens)} frames but input_features has {input_features.shape[-1]}."
            )

        # Chunk every clip into 2-s windows and right-pad them to a batch: (num_chunks, mel_bins, max_chunk_len).
        lengths = chunk_lengths(clip_lens, 2 * self.n_window)
        chunks = input_features.to(device).T.split(lengths, dim=0)
        padded = nn.utils.rnn.pad_sequence(chunks, batch_first=True).transpose(1, 2).to(dtype)
        lengths_on_device = torch.tensor(lengths, device=device)
        clip_lens_after_conv = [(length - 1) // 2 + 1 for length in clip_lens]
        if not self.pad_chunks or "flash" in (self.config._attn_implementation or ""):
            # The valid frames packed, (total_frames_after_conv, d_model), chunk boundaries in cu_seqlens: flash
            # attention's varlen kernel, or transformers' per-chunk attention calls.
            if output_attentions:
                raise ValueError("output_attentions needs the padded-chunk path: eager attention and pad_chunks.")
            hidden, valid = self._conv_front(padded, lengths_on_device)
            hidden = hidden[valid]
            cu_seqlens = F.pad(((lengths_on_device - 1) // 2 + 1).cumsum(0), (1, 0)).to(torch.int32)
            for layer in self.layers:
                if output_hidden_states:
                    all_hidden_states.append(hidden)
                hidden = layer(hidden, cu_seqlens=cu_seqlens)[0]
            if output_hidden_states:
                all_hidden_states.append(hidden)
            clips = hidden.split(clip_lens_after_conv, dim=0)
        else:
            # The chunks padded to one length, one attention call per layer for every chunk (`encode_chunks`).
            if chunk_encoder is None or output_hidden_states or output_attentions:
                hidden = self.encode_chunks(padded, lengths_on_device, all_hidden_states, all_attentions)
            else:
                hidden = chunk_encoder(padded, lengths_on_device)
            # A clip's frames are consecutive rows of its chunks: all but its last chunk are full (`2 * n_window`
            # frames, n_window rows after the conv), and the rows hold full chunks unless every clip has one chunk.
            rows = hidden.shape[1]
            flat = hidden.reshape(-1, hidden.shape[-1])
            clips, first_chunk = [], 0
            for clip_len, length_after_conv in zip(clip_lens, clip_lens_after_conv):
                clips.append(flat[first_chunk * rows : first_chunk * rows + length_after_conv])
                first_chunk += -(-clip_len // (2 * self.n_window))

        pooled = []
        for clip_hidden in clips:
            if clip_hidden.shape[0] >= 2:  # average-pool 2:1 to 25 Hz (floor); a 1-frame clip stays as is
                clip_hidden = F.avg_pool1d(clip_hidden.T, kernel_size=2, stride=2).T
            pooled.append(clip_hidden)
        projected = self.proj(self.ln_post(torch.cat(pooled, dim=0))).split([p.shape[0] for p in pooled], dim=0)

        output = projected[0].new_zeros(num_clips, speech_maxlen, projected[0].shape[-1])
        clip_indices = [index for index, length in enumerate(feature_lens) if length > 0]
        for clip_index, clip_features in zip(clip_indices, projected):
            length = min(clip_features.shape[0], speech_maxlen)
            output[clip_index, :length] = clip_features[:length]
        return BaseModelOutput(
            last_hidden_state=output,
            hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
            attentions=tuple(all_attentions) if output_attentions else None,
        )


class FunAudioChatDiscreteEncoder(nn.Module):
    """Discrete speech encoder: speech-token embeddings averaged per group of `group_size` (25 Hz -> 5 Hz), then
    `output_matching`. Continuous encoder features, when given, are grouped the same way, projected by
    `continual_output_matching` and replace (or are added to) the rows of the clips that have a waveform.

    `embed_tokens` is also the CRQ speech decoder's output head (tied weights)."""

    def __init__(self, config: FunAudioChatAudioEncoderConfig):
        super().__init__()
        self.group_size = config.group_size
        self.continuous_features_mode = config.continuous_features_mode
        self.embed_tokens = nn.Embedding(config.codebook_size, config.output_dim, padding_idx=config.pad_token_id)
        self.output_matching = nn.Linear(config.output_dim, config.output_dim, bias=False)
        self.continual_output_matching = nn.Linear(config.output_dim, config.output_dim, bias=False)

    def _group_mean(self, frames: torch.Tensor) -> torch.Tensor:
        """`(N, S, H)` -> `(N, S // K, H)`: mean over each group of K consecutive frames."""
        num, length, hidden = frames.shape
        if length % self.group_size != 0:
            raise ValueError(f"Sequence length {length} is not a multiple of group_size {self.group_size}.")
        return frames.reshape(num, length // self.group_size, self.group_size, hidden).mean(dim=2)

    def encode_groups(self, speech_ids: torch.Tensor) -> torch.Tensor:
        """LLM input vectors of speech tokens: `(N, S)` ids -> `(N, S // K, H)` (feeds generated speech back)."""
        return self.output_matching(self._group_mean(self.embed_tokens(speech_ids)))

    def forward(
        self,
        speech_ids: torch.Tensor,
        continuous_features: torch.Tensor | None = None,
        clips_with_audio: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """
        Args:
            speech_ids: `(N, S)` speech-token ids, S a multiple of `group_size`.
            continuous_features: `(N_w, S, H)` continuous encoder output of the clips that have a waveform.
            clips_with_audio: `(N_w,)` indices of the clips that have a waveform, ascending (default: all N).
        Returns:
            `(N, S // K, H)` one LLM input vector per group.
        """
        hidden = self.encode_groups(speech_ids)
        if continuous_features is None:
            return hidden
        with_audio = hidden.shape[0] if clips_with_audio is None else clips_with_audio.shape[0]
        if with_audio != continuous_features.shape[0]:
            raise ValueError(
                f"feature_exist_mask marks {with_audio} clips with a waveform but {continuous_features.shape[0]} "
                "continuous feature rows were given."
            )
        continuous_features = continuous_features.to(hidden.device, hidden.dtype)
        continuous = self.continual_output_matching(self._group_mean(continuous_features))
        if clips_with_audio is None:
            clips_with_audio = torch.arange(hidden.shape[0], device=hidden.device)
        clips_with_audio = clips_with_audio.to(hidden.device)
        if self.continuous_features_mode == "replace":
            return hidden.index_copy(0, clips_with_audio, continuous)
        return hidden.index_add(0, clips_with_audio, continuous)


__all__ = [
    "FunAudioChatAudioAttention",
    "FunAudioChatAudioEncoder",
    "FunAudioChatDiscreteEncoder",
    "chunk_lengths",
    "sinusoid_position_table",
]
