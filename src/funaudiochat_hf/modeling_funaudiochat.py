"""Fun-Audio-Chat: `FunAudioChatForConditionalGeneration`, the chat model (forward, losses, prompt embedding, loading).

Its audio encoders are in `modeling_funaudiochat_audio.py`, the CRQ speech decoder in `modeling_funaudiochat_crq.py`,
the shared `FunAudioChatPreTrainedModel` in `modeling_funaudiochat_pretrained.py`. Module names follow the official
checkpoint (`continuous_audio_tower`, `audio_tower`, `audio_invert_tower`, `language_model`) so the released
safetensors load unchanged.

Data flow (spec §4-5):
  mel (A_w, 128, F) -> `continuous_audio_tower` -> (A_w, S, H) at 25 Hz
  speech ids (A, S) + continuous features -> `audio_tower` -> (A, S // K, H) at 5 Hz -> into the `<|AUDIO|>` slots
  LLM (Qwen3) -> text logits; final hidden state + text embedding -> `audio_invert_tower` (CRQ) -> K speech logits
  per LLM position.
"""

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPooling, CausalLMOutputWithPast

from .compat import CACHE_KWARG, OUTPUT_CACHE_FIELD, cache_kwargs
from .configuration_funaudiochat import FunAudioChatConfig
from .generation_funaudiochat import FunAudioChatSpeechGenerationMixin
from .modeling_cosyvoice3 import CosyVoice3Token2Wav
from .modeling_funaudiochat_audio import (  # noqa: F401  (re-exported: importable from here as before)
    FunAudioChatAudioAttention,
    FunAudioChatAudioEncoder,
    FunAudioChatDiscreteEncoder,
    FunAudioChatUnusedTable,
    sinusoid_position_table,
)
from .modeling_funaudiochat_crq import FunAudioChatCRQDecoder
from .modeling_funaudiochat_pretrained import FunAudioChatPreTrainedModel
from .weights_files_funaudiochat import naming_unreadable_weights


@dataclass
class FunAudioChatCausalLMOutputWithPast(CausalLMOutputWithPast):
    r"""
    Output of [`FunAudioChatForConditionalGeneration`].

    loss (`torch.FloatTensor` of shape `()`): `text_loss + speech_loss` (only `text_loss` with `disable_speech`).
    logits (`torch.FloatTensor` of shape `(batch, seq, vocab)`): text logits.
    text_loss (`torch.FloatTensor` of shape `()`): causal-LM cross-entropy of the text head.
    speech_loss (`torch.FloatTensor` of shape `()`): cross-entropy of the CRQ speech head.
    speech_logits (`torch.FloatTensor` of shape `(batch, seq * group_size, codebook_size)`): the CRQ logits of the
        teacher-forced pass; sub-position `t * K + k` predicts speech token `k` of the group of LLM position `t + 1`.
    last_hidden_state (`torch.FloatTensor` of shape `(batch, seq, hidden)`): the LLM's final (post-norm) hidden state.
    """

    text_loss: torch.FloatTensor | None = None
    speech_loss: torch.FloatTensor | None = None
    speech_logits: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None


@dataclass
class FunAudioChatAudioFeaturesOutput(BaseModelOutputWithPooling):
    r"""
    Output of [`FunAudioChatForConditionalGeneration.get_audio_features`].

    last_hidden_state (`torch.FloatTensor` of shape `(clips, speech_maxlen, output_dim)`): 25 Hz continuous features,
        already projected to the LLM width inside the encoder (official layout); zero past each clip's length.
    pooler_output: always None. The continuous features reach the LLM pooled to 5 Hz together with the speech ids, by
        the discrete encoder (`audio_tower`), not on their own.
    hidden_states, attentions: the encoder layers', see [`FunAudioChatAudioEncoder.forward`].
    audio_output_lengths (`torch.LongTensor` of shape `(clips,)`): valid frames of each clip in `last_hidden_state`
        (before truncation to `speech_maxlen`).
    """

    audio_output_lengths: torch.LongTensor | None = None


@dataclass
class FunAudioChatPromptEmbeddings:
    """What building the LLM input (spec §5.1) produces besides the embeddings, for the losses of §5.2-5.4.

    inputs_embeds: `(batch, seq, hidden)` LLM input with the audio groups scattered into the `<|AUDIO|>` slots.
    text_embeds: `(batch, seq, hidden)` text-token embeddings of the same positions, where `<|AUDIO|>` rows hold the
        transcript embeddings when `text_ids` are given (the CRQ's text conditioning).
    audio_token_mask: `(batch, seq)` bool, the `<|AUDIO|>` positions.
    group_speech_labels: `(num_groups, group_size)` speech-token labels of every scattered group (-100 on padding).
    group_text_labels: `(num_groups,)` transcript labels of every scattered group (-100 where none), or None.
    """

    inputs_embeds: torch.Tensor
    text_embeds: torch.Tensor
    audio_token_mask: torch.Tensor
    group_speech_labels: torch.Tensor | None = None
    group_text_labels: torch.Tensor | None = None


def _check_token_ids(name: str, ids: torch.Tensor, num_embeddings: int) -> None:
    """A clear error for ids outside an embedding table (instead of an index error deep inside, or a device assert on
    CUDA). One host sync, at the prompt only."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_embeddings:
        raise ValueError(f"{name} must lie in [0, {num_embeddings}), got ids from {low} to {high}.")


class FunAudioChatForConditionalGeneration(
    FunAudioChatSpeechGenerationMixin, FunAudioChatPreTrainedModel, GenerationMixin
):
    """Fun-Audio-Chat-8B: spoken (and text) input; text output through `generate`, text + speech tokens through the
    speech generation mixin. `forward` is the official training/eval pass (text + CRQ logits and losses)."""

    output_modalities = ("audio", "text")
    # The losses are per-batch means (like the reference; `num_items_in_batch` is ignored), so `Trainer` must average
    # them over gradient-accumulation steps itself instead of assuming the model normalised them.
    accepts_loss_kwargs = False
    # A leftover CRQ token embedding (never used: the CRQ only gets `inputs_embeds`) is dropped at load time.
    _keys_to_ignore_on_load_unexpected = [r"audio_invert_tower\.crq_transformer\.embed_tokens\."]

    def __init__(self, config: FunAudioChatConfig):
        super().__init__(config)
        audio_config = config.audio_config
        if audio_config.output_dim != config.text_config.hidden_size:
            raise ValueError(
                f"audio_config.output_dim ({audio_config.output_dim}) must equal the LLM hidden size "
                f"({config.text_config.hidden_size})."
            )
        self.group_size = audio_config.group_size
        self.continuous_audio_tower = FunAudioChatAudioEncoder(audio_config)
        self.audio_tower = FunAudioChatDiscreteEncoder(audio_config)
        if audio_config.enable_audio_invert_tower:
            self.audio_invert_tower = FunAudioChatCRQDecoder(audio_config)
            # The speech output head is the speech embedding (official `tie_weights`); checkpoints omit it.
            self._tied_weights_keys = {"audio_invert_tower.lm_head.weight": "audio_tower.embed_tokens.weight"}
        else:
            self.audio_invert_tower = None
        self.language_model = AutoModelForCausalLM.from_config(config.text_config)
        # Optional bundled speech-token decoder (one-folder Hub repos); `generate_speech` uses it for audio.
        self.token2wav = CosyVoice3Token2Wav(config.token2wav_config) if config.token2wav_config is not None else None
        # A bundled speech decoder runs in float32 whatever the chat model's dtype (its flow overflows in half
        # precision). Set per instance: a model without one must not name a module it lacks.
        self._keep_in_fp32_modules_strict = ["token2wav"] if self.token2wav is not None else []
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # `~/models/...` means the expanded local path (transformers alone would read it as an invalid Hub id).
        if isinstance(pretrained_model_name_or_path, str) and pretrained_model_name_or_path.startswith("~"):
            pretrained_model_name_or_path = os.path.expanduser(pretrained_model_name_or_path)
        with naming_unreadable_weights(pretrained_model_name_or_path, kwargs):
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    # ----------------------------------------------------------------------------------------------------------
    # Embedding accessors (the LLM's)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.language_model.set_output_embeddings(new_embeddings)

    def get_decoder(self) -> nn.Module:
        return self.language_model.get_decoder()

    # ----------------------------------------------------------------------------------------------------------
    # Audio -> LLM input

    def get_audio_features(
        self,
        input_features: torch.Tensor,
        feature_attention_mask: torch.Tensor | None = None,
        speech_maxlen: int | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        chunk_encoder: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> FunAudioChatAudioFeaturesOutput | tuple:
        """Continuous audio features of every clip with a waveform (the `continuous_audio_tower`).

        Args:
            input_features: `(A_w, num_mel_bins, frames)` log-mels (right-padded).
            feature_attention_mask: `(A_w, frames)` 1 on valid mel frames (default: all valid).
            speech_maxlen: output length `S` (the padded speech-id length; default: the longest clip's output length).
            output_hidden_states, output_attentions: the encoder layers' states / weights (default: the audio config).
            return_dict: a [`FunAudioChatAudioFeaturesOutput`] (default: `config.return_dict`), else its tuple.
            chunk_encoder: runs the encoder's layers in place of `FunAudioChatAudioEncoder.encode_chunks` (e.g. its
                recorded CUDA graph, `generation_audio_graph_funaudiochat`).
        Returns:
            `last_hidden_state` `(A_w, S, output_dim)` 25 Hz features, zero past each clip's length;
            `audio_output_lengths` `(A_w,)`; `hidden_states` / `attentions` of the encoder when asked for.

        Raises:
            ValueError: features of the wrong shape (e.g. 80 mel bins) or with NaN/Inf values.
        """
        num_mel_bins = self.config.audio_config.num_mel_bins
        if input_features.dim() != 3 or input_features.shape[1] != num_mel_bins:
            raise ValueError(
                f"input_features must have shape (clips, {num_mel_bins}, frames) ({num_mel_bins}-bin log-mels from the "
                f"model's processor), got {tuple(input_features.shape)}."
            )
        if not input_features.dtype.is_floating_point:
            raise TypeError(f"input_features must be a floating-point tensor, got {input_features.dtype}.")
        # NaN features would encode to NaN hidden states and silently decode to all-zero speech tokens.
        if not bool(torch.isfinite(input_features).all()):
            raise ValueError("input_features contain NaN or infinite values.")
        if feature_attention_mask is None:
            feature_attention_mask = torch.ones(
                input_features.shape[0], input_features.shape[-1], dtype=torch.long, device=input_features.device
            )
        if feature_attention_mask.shape != (input_features.shape[0], input_features.shape[-1]):
            raise ValueError(
                f"feature_attention_mask {tuple(feature_attention_mask.shape)} does not match input_features "
                f"{tuple(input_features.shape)} (expected (clips, frames))."
            )
        # The mask on the host (one read, before any work is queued): lengths and slices need no more host syncs.
        frame_mask = feature_attention_mask.detach().to("cpu", torch.bool)
        feature_lens = frame_mask.sum(-1)
        _, audio_output_lengths = self.continuous_audio_tower.output_lengths(feature_lens)
        if speech_maxlen is None:
            speech_maxlen = int(audio_output_lengths.max()) if audio_output_lengths.numel() else 0
        if torch.equal(frame_mask, torch.arange(frame_mask.shape[-1]) < feature_lens[:, None]):
            # Right-padded clips (the feature extractor's): each clip's valid frames are a slice.
            clips = [input_features[index, :, :length] for index, length in enumerate(feature_lens.tolist())]
            packed = torch.cat(clips, dim=1) if len(clips) != 1 else clips[0]
        else:
            packed = input_features.transpose(1, 2)[frame_mask.to(input_features.device)].T
        encoder_output = self.continuous_audio_tower(  # packed: (num_mel_bins, total_valid_frames), clip-major
            packed,
            feature_lens,
            speech_maxlen,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            chunk_encoder=chunk_encoder,
        )
        output = FunAudioChatAudioFeaturesOutput(
            last_hidden_state=encoder_output.last_hidden_state,
            hidden_states=encoder_output.hidden_states,
            attentions=encoder_output.attentions,
            audio_output_lengths=audio_output_lengths.to(input_features.device),
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()

    def _embed_prompt(
        self,
        input_ids: torch.Tensor,
        speech_ids: torch.Tensor | None = None,
        speech_attention_mask: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        feature_exist_mask: torch.Tensor | None = None,
        text_ids: torch.Tensor | None = None,
        text_attention_mask: torch.Tensor | None = None,
        chunk_encoder: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> FunAudioChatPromptEmbeddings:
        """Spec §5.1; see `embed_prompt`. Also returns what the losses need. `chunk_encoder`: see
        `get_audio_features`."""
        embed_tokens = self.get_input_embeddings()
        _check_token_ids("input_ids", input_ids, embed_tokens.num_embeddings)
        if speech_ids is not None:
            _check_token_ids("speech_ids", speech_ids, self.audio_tower.embed_tokens.num_embeddings)
        text_embeds = embed_tokens(input_ids)
        audio_token_mask = input_ids == self.config.audio_token_index
        if speech_ids is None:
            if bool(audio_token_mask.any()):
                raise ValueError(
                    f"input_ids contain {int(audio_token_mask.sum())} <|AUDIO|> placeholders but no speech_ids were "
                    "given."
                )
            return FunAudioChatPromptEmbeddings(text_embeds, text_embeds, audio_token_mask)

        audio_config = self.config.audio_config
        group_size = self.group_size
        speech_ids = speech_ids.to(text_embeds.device)
        if speech_attention_mask is None:
            speech_attention_mask = torch.ones_like(speech_ids)
        speech_attention_mask = speech_attention_mask.to(speech_ids.device)
        speech_labels = speech_ids.masked_fill(speech_attention_mask == 0, self.config.ignore_index)
        # Pad the speech ids to a whole number of groups.
        pad = (-speech_ids.shape[1]) % group_size
        speech_ids = F.pad(speech_ids, (0, pad), value=audio_config.pad_token_id)
        speech_labels = F.pad(speech_labels, (0, pad), value=self.config.ignore_index)
        speech_attention_mask = F.pad(speech_attention_mask, (0, pad), value=0)
        num_clips, speech_len = speech_ids.shape
        num_groups = speech_len // group_size
        audio_output_lengths = (speech_attention_mask.sum(-1) + group_size - 1) // group_size
        # Counted on the host before the encoders' work is queued (these reads then wait for nothing).
        groups_per_clip = [min(int(groups), num_groups) for groups in audio_output_lengths.tolist()]
        num_placeholders = int(audio_token_mask.sum())
        if num_placeholders != sum(groups_per_clip):
            raise ValueError(
                f"The prompt has {num_placeholders} <|AUDIO|> placeholders but the audio gives {sum(groups_per_clip)} "
                f"groups (speech_attention_mask lengths / group_size {group_size}, rounded up, over {num_clips} "
                "clips)."
            )

        clips_with_audio = None  # all
        if feature_exist_mask is not None:
            clips_with_audio = feature_exist_mask.to("cpu", torch.bool).nonzero().squeeze(1)
        continuous = None
        if input_features is not None:
            if feature_attention_mask is None:
                raise ValueError("input_features were given without feature_attention_mask.")
            continuous = self.get_audio_features(
                input_features, feature_attention_mask, speech_len, return_dict=True, chunk_encoder=chunk_encoder
            ).last_hidden_state.to(text_embeds.dtype)
        audio_embeds = self.audio_tower(speech_ids, continuous, clips_with_audio).to(text_embeds.device)

        transcript_embeds = None
        group_text_labels = None
        if text_ids is not None:
            text_config = self.config.text_config
            text_ids = text_ids.to(speech_ids.device)
            eos_ids = text_config.eos_token_id
            eos_ids = list(eos_ids) if isinstance(eos_ids, (list, tuple)) else [eos_ids]
            pad_id = text_config.pad_token_id if text_config.pad_token_id is not None else eos_ids[0]
            # One transcript token per speech group: cut, or pad (the padding then becomes <|sil|> filler).
            text_ids = text_ids[:, :num_groups]
            text_ids = F.pad(text_ids, (0, num_groups - text_ids.shape[1]), value=pad_id)
            filler = torch.isin(text_ids, torch.tensor(eos_ids + [pad_id], device=text_ids.device))
            text_ids = text_ids.masked_fill(filler, text_config.sil_index)
            if text_attention_mask is None:
                has_text = torch.ones(num_clips, dtype=torch.bool, device=text_ids.device)
            else:
                has_text = text_attention_mask.to(text_ids.device).bool()
                has_text = has_text.any(-1) if has_text.dim() == 2 else has_text
            group_has_speech = speech_attention_mask[:, ::group_size] == 1
            group_text_labels = text_ids.masked_fill(~group_has_speech, self.config.ignore_index)
            group_text_labels = group_text_labels.masked_fill(~has_text[:, None], self.config.ignore_index)
            transcript_embeds = embed_tokens(text_ids) * has_text[:, None, None].to(text_embeds.dtype)
            # As the reference training path: every clip is averaged with its transcript (user audio with zeros).
            audio_embeds = (transcript_embeds + audio_embeds) / 2

        def valid_groups(per_group: torch.Tensor) -> torch.Tensor:  # (clips, groups, ...) -> (valid groups, ...)
            if not groups_per_clip:
                return per_group.flatten(0, 1)
            return torch.cat([per_group[clip, :groups] for clip, groups in enumerate(groups_per_clip)])

        # Keep each clip's valid groups, clip-major, and scatter them into the <|AUDIO|> slots (row-major).
        scatter_mask = audio_token_mask[..., None].expand_as(text_embeds)
        inputs_embeds = text_embeds.masked_scatter(scatter_mask, valid_groups(audio_embeds))
        crq_text_embeds = text_embeds
        if transcript_embeds is not None:
            crq_text_embeds = text_embeds.masked_scatter(scatter_mask, valid_groups(transcript_embeds))
            group_text_labels = valid_groups(group_text_labels)
        group_speech_labels = valid_groups(speech_labels.reshape(num_clips, num_groups, group_size))
        return FunAudioChatPromptEmbeddings(
            inputs_embeds=inputs_embeds,
            text_embeds=crq_text_embeds,
            audio_token_mask=audio_token_mask,
            group_speech_labels=group_speech_labels,
            group_text_labels=group_text_labels,
        )

    def embed_prompt(
        self,
        input_ids: torch.Tensor,
        speech_ids: torch.Tensor | None = None,
        speech_attention_mask: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        feature_exist_mask: torch.Tensor | None = None,
        text_ids: torch.Tensor | None = None,
        text_attention_mask: torch.Tensor | None = None,
        chunk_encoder: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """LLM input embeddings of a prompt with its audio (spec §5.1).

        Args:
            input_ids: `(batch, seq)` with one `<|AUDIO|>` per audio group.
            speech_ids: `(A, S)` speech-token ids of every clip (user audio: all pad ids), clips in prompt order.
            speech_attention_mask: `(A, S)` 1 on real speech frames; clip i fills `ceil(len_i / group_size)` slots.
            input_features: `(A_w, num_mel_bins, frames)` log-mels of the clips that have a waveform.
            feature_attention_mask: `(A_w, frames)`.
            feature_exist_mask: `(A,)` bool, which clips have a waveform (default: all).
            text_ids: `(A, T)` transcripts of the clips (training only); `text_attention_mask` `(A,)` which have one.
            chunk_encoder: runs the continuous encoder's layers (see `get_audio_features`; `generate_speech` passes
                its recorded graph on CUDA).
        Returns:
            `(batch, seq, hidden)` text embeddings with the audio group vectors in the `<|AUDIO|>` slots.
        Raises:
            ValueError: when the number of `<|AUDIO|>` placeholders differs from the number of audio groups.
        """
        return self._embed_prompt(
            input_ids,
            speech_ids=speech_ids,
            speech_attention_mask=speech_attention_mask,
            input_features=input_features,
            feature_attention_mask=feature_attention_mask,
            feature_exist_mask=feature_exist_mask,
            text_ids=text_ids,
            text_attention_mask=text_attention_mask,
            chunk_encoder=chunk_encoder,
        ).inputs_embeds

    # ----------------------------------------------------------------------------------------------------------
    # Training / eval forward

    def _speech_labels(self, labels: torch.Tensor, prompt: FunAudioChatPromptEmbeddings) -> torch.Tensor:
        """`(B, L)` text labels -> `(B, L * K)` flat speech labels (spec §5.2): each assistant `<|AUDIO|>` position
        carries its group's K tokens, `<|audio_eos|>` carries K speech-eos ids, everything else -100."""
        batch, length = labels.shape
        ignore = self.config.ignore_index
        speech_labels = torch.full((batch, length, self.group_size), ignore, dtype=labels.dtype, device=labels.device)
        if prompt.group_speech_labels is not None:
            group_labels = prompt.group_speech_labels.to(labels.device, labels.dtype)
            speech_labels[prompt.audio_token_mask.to(labels.device)] = group_labels
        speech_labels = speech_labels.masked_fill((labels == ignore)[..., None], ignore)
        is_audio_eos = (labels == self.config.text_config.audio_eos_index)[..., None]
        speech_labels = speech_labels.masked_fill(is_audio_eos, self.config.audio_config.eos_token_id)
        return speech_labels.reshape(batch, length * self.group_size)

    def _text_labels(self, labels: torch.Tensor, prompt: FunAudioChatPromptEmbeddings) -> torch.Tensor:
        """Text labels with `<|AUDIO|>` targets replaced by the transcript tokens (or ignored without transcripts)."""
        ignore = self.config.ignore_index
        text_labels = labels.masked_fill(labels == self.config.audio_token_index, ignore)
        if prompt.group_text_labels is not None:
            text_labels = text_labels.masked_scatter(
                prompt.audio_token_mask.to(labels.device), prompt.group_text_labels.to(labels.device, labels.dtype)
            )
        return text_labels.masked_fill(labels == ignore, ignore)

    def _speech_loss(self, speech_logits: torch.Tensor, speech_labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of sub-position j against label j + K (the same k of the next LLM position), mean over
        non-ignored targets."""
        ignore = self.config.ignore_index
        targets = F.pad(speech_labels, (0, self.group_size), value=ignore)[:, self.group_size :]
        targets = targets.to(speech_logits.device)
        losses = F.cross_entropy(
            speech_logits.float().flatten(0, 1), targets.flatten(), ignore_index=ignore, reduction="sum"
        )
        # Same as the mean over targets, but 0 (not NaN) for a batch without any speech target.
        return losses / (targets != ignore).sum().clamp(min=1)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.FloatTensor | None = None,
        speech_ids: torch.LongTensor | None = None,
        speech_attention_mask: torch.Tensor | None = None,
        input_features: torch.FloatTensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        feature_exist_mask: torch.Tensor | None = None,
        text_ids: torch.LongTensor | None = None,
        text_attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        disable_speech: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        past_key_values=None,
        **kwargs,
    ) -> FunAudioChatCausalLMOutputWithPast | tuple:
        r"""
        The official training / evaluation pass (spec §5).

        Args:
            input_ids: `(batch, seq)` prompt ids with `<|AUDIO|>` placeholders.
            speech_ids, speech_attention_mask, input_features, feature_attention_mask, feature_exist_mask, text_ids,
                text_attention_mask: the audio inputs, see [`~FunAudioChatForConditionalGeneration.embed_prompt`].
                Only used when `inputs_embeds` is not given.
            cache: LLM cache. `past_key_values` is its name before transformers 5.24 (deprecated from then on, as in
                transformers' own models). Both are named parameters, so `generate(..., <name>=cache)` passes
                generate's check of the model kwargs on every supported release.
            labels: `(batch, seq)` un-shifted labels, -100 outside the assistant turns. Adds `text_loss`,
                `speech_loss` (CRQ teacher forcing) and `loss = text_loss + speech_loss`.
            disable_speech: skip the CRQ (no `speech_logits` / `speech_loss`), e.g. for text-only generation.
            logits_to_keep: compute text logits only for the last `logits_to_keep` positions (0 = all).
            return_dict: the output dataclass (default: `config.return_dict`), else its tuple (None fields left out).
        """
        if past_key_values is not None:
            if CACHE_KWARG == "cache":
                warnings.warn(
                    "`past_key_values` is deprecated in favour of `cache` (as in transformers >= 5.24).", FutureWarning
                )
            if cache is None:
                cache = past_key_values
        kwargs.pop("num_items_in_batch", None)  # the reference losses are plain means
        if input_ids is None and inputs_embeds is None:
            raise ValueError("Pass input_ids or inputs_embeds.")

        prompt = None
        if inputs_embeds is None:
            prompt = self._embed_prompt(
                input_ids,
                speech_ids=speech_ids,
                speech_attention_mask=speech_attention_mask,
                input_features=input_features,
                feature_attention_mask=feature_attention_mask,
                feature_exist_mask=feature_exist_mask,
                text_ids=text_ids,
                text_attention_mask=text_attention_mask,
            )
            inputs_embeds = prompt.inputs_embeds
        elif input_ids is not None:
            # Precomputed LLM inputs: the speech head still needs the text embeddings of the input ids.
            text_embeds = self.get_input_embeddings()(input_ids)
            audio_token_mask = input_ids == self.config.audio_token_index
            prompt = FunAudioChatPromptEmbeddings(inputs_embeds, text_embeds, audio_token_mask)

        text_labels = None
        if labels is not None:
            if prompt is None:
                labels = labels.masked_fill(labels == self.config.audio_token_index, self.config.ignore_index)
            text_labels = labels if prompt is None else self._text_labels(labels, prompt)

        for name, value in (("output_hidden_states", output_hidden_states), ("output_attentions", output_attentions)):
            if value is not None:
                kwargs[name] = value
        decoder_outputs = self.language_model.get_decoder()(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **cache_kwargs(cache),
            **kwargs,
        )
        last_hidden_state = decoder_outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.language_model.get_output_embeddings()(last_hidden_state[:, slice_indices, :])

        text_loss = None
        if text_labels is not None:
            text_loss = self.language_model.loss_function(
                logits=logits, labels=text_labels.to(logits.device), vocab_size=self.config.text_config.vocab_size
            )

        speech_logits = speech_loss = None
        run_speech = not disable_speech and self.audio_invert_tower is not None
        if run_speech and prompt is None and labels is not None:
            raise ValueError("The speech loss needs input_ids (the CRQ is conditioned on the input-token embeddings).")
        if run_speech and prompt is not None:
            crq = self.audio_invert_tower
            crq_device = crq.pre_matching.weight.device
            # The text embedding is added detached: the speech loss reaches the LLM only through its hidden state.
            conditioning = last_hidden_state.to(crq_device) + prompt.text_embeds.detach().to(crq_device)
            speech_labels = speech_label_embeds = None
            if labels is not None:
                speech_labels = self._speech_labels(labels, prompt)
                embed_ids = speech_labels.masked_fill(
                    speech_labels == self.config.ignore_index, self.config.audio_config.pad_token_id
                )
                speech_embedding = self.audio_tower.embed_tokens
                speech_label_embeds = speech_embedding(embed_ids.to(speech_embedding.weight.device))
            speech_logits = crq(
                conditioning,
                speech_label_embeds=speech_label_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
            )
            if speech_labels is not None:
                speech_loss = self._speech_loss(speech_logits, speech_labels)

        loss = None
        if text_loss is not None:
            loss = text_loss if speech_loss is None else text_loss + speech_loss.to(text_loss.device)

        output = FunAudioChatCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=decoder_outputs.hidden_states,
            attentions=decoder_outputs.attentions,
            text_loss=text_loss,
            speech_loss=speech_loss,
            speech_logits=speech_logits,
            last_hidden_state=last_hidden_state,
            **{OUTPUT_CACHE_FIELD: getattr(decoder_outputs, OUTPUT_CACHE_FIELD, None)},
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()

    # ----------------------------------------------------------------------------------------------------------
    # Text-only generation through the standard `generate`

    _AUDIO_INPUT_NAMES = (
        "speech_ids",
        "speech_attention_mask",
        "input_features",
        "feature_attention_mask",
        "feature_exist_mask",
        "text_ids",
        "text_attention_mask",
    )

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False, input_ids=None,
                                      **model_kwargs):
        """Beam search / `num_return_sequences`: rows are repeated `expand_size` times; the per-clip audio inputs
        (first dim = clips, not rows) are repeated per row, so each copy of a row keeps exactly its own clips in
        order (the default `repeat_interleave` would interleave the clips of a row with several clips)."""
        clip_inputs = {name: model_kwargs.pop(name) for name in self._AUDIO_INPUT_NAMES if name in model_kwargs}
        expanded_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size=expand_size, is_encoder_decoder=is_encoder_decoder, input_ids=input_ids, **model_kwargs
        )
        if expand_size > 1 and input_ids is not None and clip_inputs.get("speech_ids") is not None:
            clip_inputs = self._expand_clip_inputs(input_ids, clip_inputs, expand_size)
        model_kwargs.update(clip_inputs)
        return expanded_ids, model_kwargs

    def _expand_clip_inputs(self, input_ids: torch.Tensor, clip_inputs: dict, expand_size: int) -> dict:
        """Reorder the clip-level inputs for rows repeated `expand_size` times (see `_expand_inputs_for_generation`).

        Clip i fills `ceil(len_i / group_size)` `<|AUDIO|>` slots in prompt order (row-major), which assigns clips
        to rows. Inputs that do not add up are left alone (`embed_prompt` then raises its mismatch error)."""
        speech_ids = clip_inputs["speech_ids"]
        mask = clip_inputs.get("speech_attention_mask")
        lengths = mask.sum(-1) if mask is not None else torch.full((speech_ids.shape[0],), speech_ids.shape[1])
        slots_per_clip = ((lengths + self.group_size - 1) // self.group_size).tolist()
        slots_per_row = (input_ids == self.config.audio_token_index).sum(-1).tolist()
        clips_of_row, clip = [], 0
        for slots in slots_per_row:
            first = clip
            while slots > 0 and clip < len(slots_per_clip):
                slots -= slots_per_clip[clip]
                clip += 1
            if slots != 0:
                return clip_inputs
            clips_of_row.append(list(range(first, clip)))
        if clip != len(slots_per_clip):
            return clip_inputs
        order = [i for clips in clips_of_row for _ in range(expand_size) for i in clips]
        exist = clip_inputs.get("feature_exist_mask")
        exist = [True] * len(slots_per_clip) if exist is None else exist.bool().tolist()
        waveform_index = {clip: index for index, clip in enumerate(i for i, has in enumerate(exist) if has)}
        waveform_order = [waveform_index[i] for i in order if exist[i]]
        expanded = {}
        for name, value in clip_inputs.items():
            if not isinstance(value, torch.Tensor):
                expanded[name] = value
                continue
            index = waveform_order if name in ("input_features", "feature_attention_mask") else order
            expanded[name] = value.index_select(0, torch.tensor(index, dtype=torch.long, device=value.device))
        return expanded

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs) -> dict:
        """The prefill embeds the prompt with its audio; later steps only feed the new token ids. The CRQ never runs
        inside `generate` (text-only answers); speech answers come from the speech generation loop.

        Continuing from a cache (`generate(..., cache=...)`), the prefill feeds only the uncached ids: the audio goes
        with them only when they hold `<|AUDIO|>` slots (the cached prefix already holds its audio)."""
        audio_inputs = {name: kwargs.pop(name, None) for name in self._AUDIO_INPUT_NAMES}
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        is_prefill = kwargs.get("is_first_iteration", False)
        if not is_prefill:
            cache = model_inputs.get(CACHE_KWARG)
            is_prefill = cache is None or cache.get_seq_length() == 0
        new_ids = model_inputs.get("input_ids")
        if (
            is_prefill
            and audio_inputs["speech_ids"] is not None
            and new_ids is not None
            and new_ids.shape[-1] < input_ids.shape[-1]
        ):
            is_prefill = bool((new_ids == self.config.audio_token_index).any())
        if is_prefill and model_inputs.get("inputs_embeds") is None:
            model_inputs.update({k: v for k, v in audio_inputs.items() if v is not None})
        model_inputs["disable_speech"] = True
        return model_inputs


__all__ = [
    "FunAudioChatAudioEncoder",
    "FunAudioChatCRQDecoder",
    "FunAudioChatDiscreteEncoder",
    "FunAudioChatForConditionalGeneration",
    "FunAudioChatPreTrainedModel",
    "sinusoid_position_table",
]
