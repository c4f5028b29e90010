"""Fun-Audio-Chat's CRQ speech decoder (`audio_invert_tower`): K speech tokens per LLM position from the LLM state.

Module names follow the official checkpoint so the released safetensors load unchanged.
"""

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

from .configuration_funaudiochat import FunAudioChatAudioEncoderConfig


class FunAudioChatCRQDecoder(nn.Module):
    """CRQ speech decoder ("Speech Refined Head"): from the LLM state of every position it predicts the K speech
    tokens of the next position, autoregressively over K sub-positions with a small Qwen3 Transformer.

    `pre_matching` splits each LLM position into K sub-positions (H -> K * H); `input_matching` maps to the
    Transformer width; `output_matching` + `lm_head` (tied to the discrete encoder's `embed_tokens`) give the logits.
    `forward` is the teacher-forced training pass; the generation loop calls the submodules directly.
    """

    def __init__(self, config: FunAudioChatAudioEncoderConfig):
        super().__init__()
        self.group_size = config.group_size
        hidden_size = config.output_dim
        crq_config = config.crq_transformer_config
        self.pre_matching = nn.Linear(hidden_size, hidden_size * self.group_size, bias=True)
        self.input_matching = nn.Linear(hidden_size, crq_config.hidden_size, bias=False)
        self.crq_transformer = Qwen3Model(crq_config)
        # The CRQ only ever gets `inputs_embeds`: its token embedding is dead weight (and absent from checkpoints).
        self.crq_transformer.embed_tokens = None
        self.output_matching = nn.Linear(crq_config.hidden_size, hidden_size, bias=False)
        self.lm_head = nn.Linear(hidden_size, config.codebook_size, bias=False)

    def split_positions(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`(B, L, H)` -> `(B, L * K, H)`: sub-position `t * K + k` gets slice k of `pre_matching` at position t."""
        batch, length, hidden = hidden_states.shape
        return self.pre_matching(hidden_states).reshape(batch, length * self.group_size, hidden)

    def forward(
        self,
        hidden_states: torch.Tensor,
        speech_label_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced pass over every LLM position (spec §5.4).

        Args:
            hidden_states: `(B, L, H)` conditioning = LLM final hidden state + (detached) input-token embeddings.
            speech_label_embeds: `(B, L * K, H)` embeddings of the flat speech labels (pad id where ignored). Rolled
                by -(K - 1) so sub-position j sees the token preceding its target ("previous speech token").
            attention_mask: `(B, L)` LLM attention mask (or packing segment ids); repeated for the K sub-positions.
            position_ids: `(B, L)` LLM positions; sub-position k of position p gets `p * K + k`, trailing padding 0.
        Returns:
            `(B, L * K, codebook_size)` speech logits.
        """
        group_size = self.group_size
        inputs = self.split_positions(hidden_states)
        if speech_label_embeds is not None:
            inputs = inputs + torch.roll(speech_label_embeds.to(inputs.device), shifts=-(group_size - 1), dims=1)
        inputs = self.input_matching(inputs)

        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask.repeat_interleave(group_size, dim=1)
        if position_ids is not None:
            length = position_ids.shape[-1]
            steps = torch.arange(group_size, device=position_ids.device)
            sub_positions = (position_ids[..., None] * group_size + steps).flatten(-2)
            # Trailing padding (after the last non-zero position) keeps position 0 on all its sub-positions.
            index = torch.arange(length, device=position_ids.device)
            last_nonzero = torch.where(position_ids != 0, index, -1).amax(dim=-1, keepdim=True)
            is_trailing_pad = (index > last_nonzero).repeat_interleave(group_size, dim=-1)
            position_ids = sub_positions.masked_fill(is_trailing_pad, 0)

        hidden = self.crq_transformer(
            inputs_embeds=inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.lm_head(self.output_matching(hidden))


__all__ = ["FunAudioChatCRQDecoder"]
