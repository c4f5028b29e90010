"""Speech-to-speech decoding for Fun-Audio-Chat: joint text + speech tokens, static caches, one compiled step.

One LLM step emits one text token and, from the same final hidden state, the CRQ ("Speech Refined Head") emits a group
of `group_size` (K = 5) speech tokens autoregressively with its own KV cache spanning the whole conversation. The
group and the text token are fed back (averaged) as the next LLM input. The loop reproduces the reference `_sample`
(spec funaudiochat.md §6.3a) bit for bit at batch 1:

* the prefill runs the LLM over the prompt and the CRQ over `K * L0 - (K - 1)` sub-positions in one pass, with the
  speech-bos embedding as "previous speech token" (its 5 tokens are discarded unless the prompt ends in speech mode);
* the CRQ runs at *every* step, so its cache covers prompt + answer; the last sampled token's embedding is carried on;
* the first text token is forced to `<|audio_bos|>` (`force_text_abos`), which switches speech on from the next step;
* a group containing the speech EOS becomes K x EOS, the step's text token is overwritten by `<|audio_eos|>`, and
  speech stops; the text EOS ends the reply (checked before that overwrite); `<|audio_eos|>` is not a stop token.

Beyond the reference: per-row state for left-padded batches (each row decodes exactly as if alone), two
`StaticCache`s reused across calls, the whole decode step (LLM + K CRQ sub-steps + sampling + feedback + stop
bookkeeping) as one function that `torch.compile` can capture as a single CUDA graph (no host syncs inside), and a
streaming iterator that vocodes audio while decoding.
"""

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, StaticCache
from transformers.utils import ModelOutput, logging

from .attention_funaudiochat import register_gqa_decode_attention
from .compat import cache_kwargs
from .decoder_stack_funaudiochat import EAGER_HALVES, DecoderLayerHalves, decoder_stack_forward
from .fused_crq_funaudiochat import (
    PaddedLinear,
    can_fold_crq_matching,
    can_fuse_crq_projections,
    folded_crq_matching,
    fused_crq_projections,
    padded_output_linear,
    with_decode_kernels,
)
from .sampling_funaudiochat import SamplingParameters, SamplingSettings, SamplingSwitches, mark_seen, select_tokens
from .step_graph_funaudiochat import CapturedStep, StepGraphs, tensor_addresses
from .triton_attention_funaudiochat import register_triton_decode_attention, triton_available
from .triton_config_funaudiochat import DecodeKernelConfig
from .triton_linear_funaudiochat import (
    MAX_ROWS,
    decode_kernels_supported,
    decode_linear,
    kernel_readable,
    own_weight_kernels,
    split_k_counters_for,
    use_decode_kernels,
)
from .triton_sampling_funaudiochat import MAX_VOCAB as MAX_SAMPLER_VOCAB
from .triton_sampling_funaudiochat import sample_tokens, sampler_kernel_supported, use_sampler_kernel
from .triton_text_head_funaudiochat import BLOCK_M as TEXT_HEAD_MAX_ROWS
from .triton_text_head_funaudiochat import OverlappedTextHead, text_head_supported


logger = logging.get_logger(__name__)

# Offline vocoding splits the speech stream into independent 30-s segments (spec funaudiochat.md §8).
SEGMENT_TOKENS = 750
MIN_LAST_SEGMENT_TOKENS = 50
# Decode-step buffers are sized to a multiple of this many LLM positions, so calls with slightly different prompt
# lengths reuse the same caches and the same compiled graph.
CACHE_LENGTH_MULTIPLE = 128
# How many workspaces (caches + state buffers for one batch size / length) a model keeps for reuse.
MAX_CACHED_WORKSPACES = 2


@dataclass
class FunAudioChatSpeechOutput(ModelOutput):
    """Output of [`~FunAudioChatSpeechGenerationMixin.generate_speech`].

    Args:
        sequences (`torch.LongTensor` of shape `(batch, prompt_len + new_tokens)`):
            Prompt ids followed by the generated text ids (rows that stopped early are padded with `pad_token_id`).
        speech_ids (`torch.LongTensor` of shape `(batch, group_size * groups)`):
            Raw speech-token stream per row (speech-bos delay tokens and the EOS group included), padded with the
            speech pad id after the row's stream ends.
        audio (`list[torch.FloatTensor]`, *optional*):
            One 1-D waveform per row at `sampling_rate`, when a speech decoder was available.
        sampling_rate (`int`, *optional*): Sample rate of `audio`.
        text_logits (`torch.FloatTensor` of shape `(batch, new_tokens, vocab)`, *optional*):
            Raw text logits of every step (`output_logits=True`).
        speech_logits (`torch.FloatTensor` of shape `(batch, new_tokens, group_size, codebook)`, *optional*):
            Raw CRQ logits of the K sub-steps of every step (`output_logits=True`), also for steps whose speech
            tokens were discarded.
    """

    sequences: torch.LongTensor | None = None
    speech_ids: torch.LongTensor | None = None
    audio: list[torch.Tensor] | None = None
    sampling_rate: int | None = None
    text_logits: torch.FloatTensor | None = None
    speech_logits: torch.FloatTensor | None = None


@dataclass
class SpeechStreamEvent:
    """One increment of [`~FunAudioChatSpeechGenerationMixin.generate_speech_stream`] (batch 1).

    Attributes:
        text: new text since the previous event (needs a tokenizer, else "").
        text_ids: `(n,)` new text token ids (special tokens included).
        speech_ids: `(m,)` new raw speech ids (delay/EOS tokens included).
        audio: `(samples,)` new waveform samples at `sampling_rate` (may be empty).
        sampling_rate: sample rate of `audio`.
        finished: True on the last event.
    """

    text: str
    text_ids: torch.LongTensor
    speech_ids: torch.LongTensor
    audio: torch.FloatTensor
    sampling_rate: int
    finished: bool


@dataclass(frozen=True)
class _StepConfig:
    """Python constants of one decoding run (hashable: `torch.compile` specialises on them).

    Only the sampling *switches* are here; their values live in the workspace as tensors, so a new temperature /
    top-p / top-k / penalty reuses the compiled step.
    """

    text: SamplingSwitches
    speech: SamplingSwitches
    disable_speech: bool
    group_size: int
    speech_bos_id: int
    speech_eos_id: int
    audio_bos_index: int
    audio_eos_index: int
    pad_token_id: int
    output_logits: bool
    fuse_crq_projections: bool = False
    fold_crq_matching: bool = False  # the linear maps around the CRQ stack multiplied out (`FoldedCRQMatching`)
    crq_linear: bool = False  # the fused projections' decode steps through `triton_linear_funaudiochat`
    llm_linear: bool = False  # the LLM's decode steps through `triton_linear_funaudiochat`
    crq_head_linear: bool = False  # the CRQ's input / output matching and speech head too (one-row steps)
    speech_sampler: bool = False  # speech tokens through `triton_sampling_funaudiochat` (CUDA)
    pad_speech_head: bool = False  # the speech head, where cuBLAS runs it, through a padded copy (compiled loops)
    overlap_text_head: bool = False  # the text head on a side stream during the CRQ sub-steps (`text_head="triton"`)
    kernels: DecodeKernelConfig = DecodeKernelConfig()  # tiles and launches of every Triton kernel (part of graph keys)


class _DecodeWorkspace:
    """KV caches and per-row decoding state of one run, as fixed-address buffers.

    The decode step only mutates these tensors in place, so a compiled step sees the same addresses every call (a
    requirement of CUDA graphs). A workspace is reused by later runs with the same batch size and cache length; the
    lock keeps two concurrent runs from sharing one.
    """

    def __init__(self, model, batch_size: int, max_length: int, static: bool, output_logits: bool):
        text_config = model.config.text_config
        audio_config = model.config.audio_config
        embedding_weight = model.language_model.get_input_embeddings().weight
        self.device, self.dtype = embedding_weight.device, embedding_weight.dtype
        self.batch_size, self.max_length, self.static = batch_size, max_length, static
        self.lock = threading.Lock()
        k = audio_config.group_size
        vocab = model.language_model.get_output_embeddings().weight.shape[0]
        codebook = audio_config.codebook_size
        hidden = text_config.hidden_size
        b, dev = batch_size, self.device

        crq_config = model.audio_invert_tower.crq_transformer.config if model.audio_invert_tower is not None else None
        # The several-row kernel's and the attention's arrival counters (`crq_linear` / `llm_linear`): per workspace,
        # as a run's own; one tensor for both stacks, which never run at the same time.
        self.split_k_counters = split_k_counters_for([c for c in (text_config, crq_config) if c is not None], dev, b)
        if static:
            self.llm_cache = StaticCache(config=text_config, max_cache_len=max_length)
            self.crq_cache = StaticCache(config=crq_config, max_cache_len=k * max_length) if crq_config else None
        else:
            self.llm_cache = DynamicCache(config=text_config)
            self.crq_cache = DynamicCache(config=crq_config) if crq_config else None

        long = dict(dtype=torch.long, device=dev)
        self.llm_mask = torch.ones(b, max_length, dtype=torch.bool, device=dev)
        self.crq_mask = torch.ones(b, k * max_length, dtype=torch.bool, device=dev)
        self.step = torch.zeros((), **long)
        self.llm_position = torch.zeros(b, **long)
        self.crq_position = torch.zeros(b, **long)
        self.next_embeds = torch.zeros(b, 1, hidden, dtype=self.dtype, device=dev)
        self.next_ids = torch.zeros(b, **long)
        self.prev_speech_token = torch.zeros(b, **long)  # the last speech token sampled (the CRQ's next input)
        self.speaking = torch.zeros(b, dtype=torch.bool, device=dev)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.finish_step = torch.zeros(b, **long)
        self.groups = torch.zeros(b, **long)  # speech groups appended per row
        self.last_group = torch.zeros(b, k, **long)
        self.speech_seen = torch.zeros(b, codebook, dtype=torch.bool, device=dev)
        self.text_seen = torch.zeros(b, vocab, dtype=torch.bool, device=dev)
        self.eos_ids = torch.zeros(1, **long)
        self.text_out = torch.zeros(b, max_length, **long)
        # K extra columns at the end receive the (discarded) groups of rows that are not speaking.
        self.speech_out = torch.zeros(b, k * max_length + k, **long)
        # Scratch of the current step: text logits, the K speech-head inputs, the group being sampled.
        self.text_logits_step = torch.zeros(b, vocab, dtype=torch.float32, device=dev)
        # `overlap_text_head`: the LLM's last hidden state, read by the text head on its own stream.
        self.text_head_input = torch.zeros(b, hidden, dtype=self.dtype, device=dev)
        self.sub_inputs = torch.zeros(b, k, hidden, dtype=self.dtype, device=dev)
        # `fold_crq_matching`: the K sub-position inputs already in the CRQ's width.
        crq_hidden = crq_config.hidden_size if crq_config else 1
        self.folded_sub_inputs = torch.zeros(b, k, crq_hidden, dtype=self.dtype, device=dev)
        self.sub_step = torch.zeros((), **long)
        self.group = torch.zeros(b, k, **long)
        self.group_logits = torch.zeros(b, k, codebook, dtype=torch.float32, device=dev)
        self.group_seen = torch.zeros(b, codebook, dtype=torch.bool, device=dev)
        self.text_noise = torch.ones(b, vocab, dtype=torch.float32, device=dev)
        self.speech_noise = torch.ones(b, k, codebook, dtype=torch.float32, device=dev)
        # Sampling values of the run (0-d tensors, filled by `reset`): read by the graph, not baked into it.
        self.text_sampling = SamplingParameters(dev)
        self.speech_sampling = SamplingParameters(dev)
        # `fuse_crq_projections=True`: the CRQ's fused weights, set by the run using the workspace (not a buffer).
        self.fused_crq = None
        # `pad_speech_head`: the speech head's `PaddedLinear` (or None), set by the run using the workspace.
        self.speech_head = None
        # `fold_crq_matching`: the `FoldedCRQMatching` copies, set by the run using the workspace.
        self.folded = None
        # `llm_linear`: the LLM's `OwnWeightKernels` (decode steps through the Triton kernels), set by the run.
        self.llm_kernels = None
        # `overlap_text_head`: the `OverlappedTextHead` (its stream), made by the first run that needs it.
        self.text_head = None
        # `step_graph`: the CUDA graphs of the decode step and CRQ sub-step recorded on this workspace.
        self.step_graphs = StepGraphs()
        # Per-step raw logits, only with `output_logits=True` (debugging / parity tests).
        self.text_logits = self.speech_logits = None
        if output_logits:
            self.text_logits = torch.zeros(b, max_length, vocab, dtype=torch.float32, device=dev)
            self.speech_logits = torch.zeros(b, max_length, k, codebook, dtype=torch.float32, device=dev)
        for tensor in self._buffers():
            torch._dynamo.mark_static_address(tensor)

    def _buffers(self) -> list[torch.Tensor]:
        tensors = [value for value in vars(self).values() if isinstance(value, torch.Tensor)]
        return tensors + self.text_sampling.tensors() + self.speech_sampling.tensors()

    def graph_inputs(self) -> list:
        """Everything of the workspace a recorded step reads or writes besides the model's own weights: its buffers,
        its caches' tensors and the run's weight copies (for `StepGraphs.check`)."""
        caches = [
            tensor
            for cache in (self.llm_cache, self.crq_cache) if cache is not None
            for layer in getattr(cache, "layers", ())
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
        ]  # fmt: skip
        return [*self._buffers(), *caches, self.fused_crq, self.folded, self.speech_head]

    def reset(
        self,
        eos_ids: torch.Tensor,
        speech_pad_id: int,
        text_settings: SamplingSettings | None = None,
        speech_settings: SamplingSettings | None = None,
    ) -> None:
        if text_settings is not None:
            self.text_sampling.fill_(text_settings)
        if speech_settings is not None:
            self.speech_sampling.fill_(speech_settings)
        for cache in (self.llm_cache, self.crq_cache):
            if cache is not None and self.static:
                cache.reset()
        self.step.zero_()
        if self.split_k_counters is not None:
            self.split_k_counters.zero_()  # after a run stopped mid-step (an error, a KeyboardInterrupt)
        self.done.zero_()
        self.speaking.zero_()
        self.groups.zero_()
        self.speech_seen.zero_()
        self.text_seen.zero_()
        self.finish_step.fill_(self.max_length)
        self.speech_out.fill_(speech_pad_id)
        if self.eos_ids.shape != eos_ids.shape:
            # A different number of stop ids is a different graph anyway; re-allocate and re-mark.
            self.eos_ids = eos_ids.clone()
            torch._dynamo.mark_static_address(self.eos_ids)
        else:
            self.eos_ids.copy_(eos_ids)


# --------------------------------------------------------------------------------------------------------------------
# The decoding step. Module-level functions of (model, workspace, config) so `torch.compile` can capture them. One
# step = `_llm_part` + K x `_crq_part` + `_finish_part`; `_decode_step` chains them so the whole step can be one
# graph, and `compile_scope="parts"` compiles the three parts separately (the CRQ sub-step graph is shared by the K
# sub-steps: ~5x less to compile, at the price of K + 2 graph launches per step instead of 1).
# --------------------------------------------------------------------------------------------------------------------

# torch.compile options of the compiled prefill: one graph per layer half, reused by every layer and prompt length.
PREFILL_COMPILE_DEFAULTS = {"fullgraph": True, "dynamic": True}


def _stack_forward(
    stack,
    inputs_embeds,
    attention_mask,
    positions,
    cache,
    projections=None,
    halves=None,
    final_norm=True,
    split_k_counters=None,
    kernel_config: DecodeKernelConfig | None = None,
):
    """Last hidden state `(batch, n, hidden)` of a Qwen3 stack (the LLM's or the CRQ's) over `inputs_embeds` at
    `positions`, updating `cache`: its own forward, or `decoder_stack_forward` with fused `projections` and / or
    layer `halves` (the compiled prefill). `final_norm=False` (with `projections` or `halves`): before the stack's
    final norm. `split_k_counters`, `kernel_config`: see `decoder_stack_forward`."""
    if projections is None and halves is None:
        if not final_norm:
            raise ValueError("`final_norm=False` needs the stack run layer by layer (`projections` or `halves`).")
        return stack(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            **cache_kwargs(cache),
        ).last_hidden_state
    return decoder_stack_forward(
        stack,
        projections,
        inputs_embeds,
        attention_mask,
        positions,
        cache,
        halves or EAGER_HALVES,
        final_norm,
        split_k_counters,
        kernel_config=kernel_config,
    )


def _matching(
    linear, x: torch.Tensor, kernels: bool, norm=None, padded: PaddedLinear | None = None, kernel_config=None
) -> torch.Tensor:
    """`linear(norm(x))` for one of the CRQ's plain linears around its stack or their folded copies (`linear`: an
    `nn.Linear` or a `PaddedLinear`; `norm`: an RMSNorm module or None), through the GEMV kernel of
    `triton_linear_funaudiochat` when `kernels` and x is one CUDA row (a padded copy's extra outputs dropped), else
    through `padded` (the linear's `PaddedLinear`) when given."""
    if kernels and use_decode_kernels(x):
        return decode_linear(x, linear.weight, linear.bias, norm, kernel_config=kernel_config)[..., : linear.out_features]
    return (linear if padded is None else padded)(x if norm is None else norm(x))


def _run_crq(
    model,
    ws: _DecodeWorkspace,
    cfg: _StepConfig,
    sub_inputs: torch.Tensor,
    positions: torch.Tensor,
    halves: DecoderLayerHalves | None = None,
) -> None:
    """CRQ sub-step `ws.sub_step` over `sub_inputs` `(batch, n, hidden)` at rotary `positions` `(batch, n)`; with
    `fold_crq_matching`, `(batch, n, crq_hidden)`: the sub-positions through `input_matching` already.

    The embedding of the previous speech token is added to every input sub-position (n > 1 only for sub-step 0 of the
    prefill, as the reference does). The token is sampled from the last position, with the repetition penalty over
    the row's speech history plus the tokens already chosen in this group. `halves`: run the CRQ layer by layer
    with these layer halves (`decoder_stack_funaudiochat`; the compiled prefill) instead of its own forward.
    """
    tower = model.audio_invert_tower
    crq = tower.crq_transformer
    k = ws.sub_step.view(1)
    kernels, config = cfg.crq_head_linear, cfg.kernels
    folded = ws.folded if cfg.fold_crq_matching else None
    if folded is None:
        previous = model.audio_tower.embed_tokens(ws.prev_speech_token).to(sub_inputs.device)
        inputs_embeds = _matching(tower.input_matching, sub_inputs + previous[:, None], kernels, kernel_config=config)
    else:  # input_matching is linear: its image of the previous token's embedding, gathered
        table = folded.speech_inputs  # on the CRQ's device (a dispatched model: maybe not the workspace's)
        previous = F.embedding(ws.prev_speech_token.to(table.device), table)
        inputs_embeds = sub_inputs.to(table.device) + previous[:, None]
    fused = ws.fused_crq if cfg.fuse_crq_projections else None
    # With the kernels, the final norm is folded into output_matching's (one row: the batch-1 decode sub-step).
    fold_norm = kernels and use_decode_kernels(sub_inputs[:, -1])
    # With the kernels, decode sub-steps of 2 to 16 rows take the several-row kernel, counting in the workspace.
    counters = ws.split_k_counters if cfg.crq_linear else None
    hidden = _stack_forward(
        crq, inputs_embeds, ws.crq_mask, positions, ws.crq_cache, fused, halves, not fold_norm, counters, config
    )
    norm = crq.norm if fold_norm else None
    if folded is None:
        features = _matching(tower.output_matching, hidden[:, -1], kernels, norm, kernel_config=config)
        logits = _matching(tower.lm_head, features, kernels, padded=ws.speech_head, kernel_config=config)
    else:  # lm_head ∘ output_matching as one linear
        logits = _matching(folded.head, hidden[:, -1], kernels, norm, kernel_config=config)
    logits = logits.float().to(ws.device)
    noise = ws.speech_noise.index_select(1, k)[:, 0] if cfg.speech.do_sample else None
    seen = ws.group_seen if cfg.speech.uses_history else None
    if cfg.speech_sampler and use_sampler_kernel(logits):
        token = sample_tokens(logits, cfg.speech, ws.speech_sampling, seen, noise, kernel_config=config)
    else:
        token = select_tokens(logits, cfg.speech, seen, noise, ws.speech_sampling)
    if cfg.speech.uses_history:
        ws.group_seen.copy_(mark_seen(ws.group_seen, token[:, None]))
    # Embedded by the next sub-step: the CRQ's output matrix is tied to the speech embedding, so that is the
    # reference's `lm_head.weight[token]`.
    ws.prev_speech_token.copy_(token)
    ws.crq_position.copy_(positions[:, -1] + 1)
    ws.group.index_copy_(1, k, token[:, None])
    ws.group_logits.index_copy_(1, k, logits[:, None])
    ws.sub_step.add_(1)


def _crq_part(model, ws: _DecodeWorkspace, cfg: _StepConfig) -> None:
    """Next CRQ sub-step of a decode step: one sub-position, `ws.sub_inputs[:, ws.sub_step]` (or the folded ones)."""
    all_sub_inputs = ws.folded_sub_inputs if cfg.fold_crq_matching else ws.sub_inputs
    sub_inputs = all_sub_inputs.index_select(1, ws.sub_step.view(1))
    _run_crq(model, ws, cfg, sub_inputs, ws.crq_position[:, None])


def _start_group(model, ws: _DecodeWorkspace, cfg: _StepConfig, hidden: torch.Tensor, input_ids: torch.Tensor):
    """Speech-head inputs of the positions just fed: `pre_matching(h + embed(input ids))` split in K sub-positions.

    Returns all `(batch, L * K, hidden)` sub-positions and keeps the last K (those of the newest position) in
    `ws.sub_inputs`; with `fold_crq_matching`, `(batch, L * K, crq_hidden)`: through `input_matching` too, in
    `ws.folded_sub_inputs`. The text embedding is the raw embedding of the input ids (`<|AUDIO|>` included).
    """
    text_embeds = model.language_model.get_input_embeddings()(input_ids).to(ws.device)
    conditioning = hidden + text_embeds
    if cfg.fold_crq_matching:
        batch, length, _ = conditioning.shape
        weight = ws.folded.sub_inputs.weight
        sub_positions = _matching(
            ws.folded.sub_inputs, conditioning.to(weight.device), cfg.crq_head_linear, kernel_config=cfg.kernels
        )
        sub_positions = sub_positions.reshape(batch, length * cfg.group_size, -1)
        ws.folded_sub_inputs.copy_(sub_positions[:, -cfg.group_size :])
    else:
        sub_positions = model.audio_invert_tower.split_positions(conditioning)
        ws.sub_inputs.copy_(sub_positions[:, -cfg.group_size :])
    ws.sub_step.zero_()
    ws.group_seen.copy_(ws.speech_seen)
    return sub_positions


def _llm_part(model, ws: _DecodeWorkspace, cfg: _StepConfig) -> None:
    """LLM forward of the fed embeddings -> text logits and the speech-head inputs of the new position."""
    language_model = model.language_model
    positions = ws.llm_position[:, None]
    stack = language_model.model
    # With the kernels, decode steps of 2 to 16 rows take the several-row kernel, counting in the workspace.
    counters = ws.split_k_counters if cfg.llm_linear else None
    hidden = _stack_forward(
        stack, ws.next_embeds, ws.llm_mask, positions, ws.llm_cache, ws.llm_kernels, split_k_counters=counters,
        kernel_config=cfg.kernels,
    )  # fmt: skip
    hidden = hidden.to(ws.device)
    ws.llm_position.add_(1)
    if cfg.overlap_text_head:  # the head runs after this part, beside the CRQ sub-steps (`_start_text_head`)
        ws.text_head_input.copy_(hidden[:, -1])
    else:
        ws.text_logits_step.copy_(language_model.lm_head(hidden[:, -1]).float())
    if not cfg.disable_speech:
        _start_group(model, ws, cfg, hidden, ws.next_ids[:, None])


def _finish_part(model, ws: _DecodeWorkspace, cfg: _StepConfig, force_token: int | None = None) -> None:
    """Choose the text token, do the per-row speech/stop bookkeeping and build the next LLM input (all in place)."""
    k = cfg.group_size
    text_logits = ws.text_logits_step
    noise = ws.text_noise if cfg.text.do_sample else None
    seen = ws.text_seen if cfg.text.uses_history else None
    token = select_tokens(text_logits, cfg.text, seen, noise, ws.text_sampling)
    if force_token is not None:
        token = torch.full_like(token, force_token)
    done = ws.done
    token = torch.where(done, cfg.pad_token_id, token)
    # Stopping is decided on the chosen token, before the speech-EOS overwrite (as the reference).
    stop = ~done & (token[:, None] == ws.eos_ids[None, :]).any(-1)

    speaking = None
    if not cfg.disable_speech:
        speaking = ws.speaking & ~done
        group = ws.group
        finish = speaking & (group == cfg.speech_eos_id).any(-1)
        group = torch.where(finish[:, None], cfg.speech_eos_id, group)
        token = torch.where(finish, cfg.audio_eos_index, token)
        offsets = torch.arange(k, device=ws.device)
        trash = ws.speech_out.shape[1] - k
        slots = torch.where(speaking[:, None], ws.groups[:, None] * k + offsets, trash + offsets)
        ws.speech_out.scatter_(1, slots, group)
        ws.last_group.copy_(torch.where(speaking[:, None], group, ws.last_group))
        ws.groups.add_(speaking.long())
        if cfg.speech.uses_history:
            ws.speech_seen.copy_(mark_seen(ws.speech_seen, group, speaking))
        speaking = (speaking & ~finish) | (token == cfg.audio_bos_index)
        ws.speaking.copy_(speaking)

    step = ws.step.view(1)
    ws.text_out.index_copy_(1, step, token[:, None])
    if cfg.output_logits:
        ws.text_logits.index_copy_(1, step, text_logits[:, None])
        if not cfg.disable_speech:
            ws.speech_logits.index_copy_(1, step, ws.group_logits[:, None])
    ws.finish_step.copy_(torch.where(stop, ws.step, ws.finish_step))
    ws.done.copy_(done | stop)
    if cfg.text.uses_history:
        ws.text_seen.copy_(mark_seen(ws.text_seen, token[:, None]))

    # Next LLM input: the text embedding, averaged with the last speech group's encoding while speaking.
    embeds = model.language_model.get_input_embeddings()(token[:, None]).to(ws.device)
    if speaking is not None:
        if cfg.fold_crq_matching:  # the mean of the group's rows of the folded table (`FoldedCRQMatching`)
            table = ws.folded.feedback
            feedback = F.embedding(ws.last_group.to(table.device), table).mean(dim=1, keepdim=True)
        else:
            feedback = model.audio_tower.encode_groups(ws.last_group)
        feedback = feedback.to(ws.device)
        use_feedback = speaking & (ws.groups > 0)
        embeds = torch.where(use_feedback[:, None, None], (embeds + feedback) / 2, embeds)
    ws.next_embeds.copy_(embeds)
    ws.next_ids.copy_(token)
    ws.step.add_(1)


def _start_text_head(model, ws: _DecodeWorkspace, cfg: _StepConfig) -> None:
    """With `overlap_text_head`: the text logits of the LLM part's hidden state, on the head's own stream (outside
    any compiled part: it only enqueues)."""
    if cfg.overlap_text_head:
        ws.text_head.start(ws.text_head_input, model.language_model.lm_head, ws.text_logits_step, cfg.kernels)


def _join_text_head(ws: _DecodeWorkspace, cfg: _StepConfig) -> None:
    """With `overlap_text_head`: the current stream waits for the text logits (before the token is chosen)."""
    if cfg.overlap_text_head:
        ws.text_head.join()


def _decode_step(model, ws: _DecodeWorkspace, cfg: _StepConfig) -> None:
    """One LLM step (+ K CRQ sub-steps) of every row; only mutates `ws`. Free of host syncs, compilable whole (then
    without `overlap_text_head`)."""
    _llm_part(model, ws, cfg)
    _start_text_head(model, ws, cfg)
    if not cfg.disable_speech:
        for _ in range(cfg.group_size):
            _crq_part(model, ws, cfg)
    _join_text_head(ws, cfg)
    _finish_part(model, ws, cfg)


def _prefill_forward(
    model,
    ws: _DecodeWorkspace,
    cfg: _StepConfig,
    input_ids,
    inputs_embeds,
    padding,
    halves: DecoderLayerHalves | None = None,
) -> None:
    """The prompt's variable-length forward: the LLM over its `L` positions and the CRQ over the first
    `K * L - (K - 1)` sub-positions, each in one pass.

    `halves` (`compile_prefill` on: the compiled `EAGER_HALVES` of `decoder_stack_funaudiochat`) runs both stacks
    layer by layer through them; None runs the models' own forwards.
    """
    length = input_ids.shape[1]
    k = cfg.group_size
    language_model = model.language_model
    positions = (torch.arange(length, device=ws.device)[None, :] - padding[:, None]).clamp(min=0)
    hidden = _stack_forward(language_model.model, inputs_embeds, ws.llm_mask, positions, ws.llm_cache, halves=halves)
    hidden = hidden.to(ws.device)
    ws.llm_position.copy_(length - padding)
    ws.text_logits_step.copy_(language_model.lm_head(hidden[:, -1]).float())
    if not cfg.disable_speech:
        sub_positions = _start_group(model, ws, cfg, hidden, input_ids)
        first = length * k - (k - 1)
        crq_positions = (torch.arange(first, device=ws.device)[None, :] - k * padding[:, None]).clamp(min=0)
        _run_crq(model, ws, cfg, sub_positions[:, :first], crq_positions, halves)


_COMPILED: dict = {}


# Each distinct set of sampling switches (do_sample, top-k / top-p / penalty on or off), batch size or cache length is
# its own graph (they are Python constants of the step; the sampling values are workspace tensors), and with
# `fullgraph=True` dynamo's default limit of 8 graphs per function is a hard error, not a fallback: a long-running
# process that varies them would fail on the 9th. Raise the limit (never lower a user's).
_RECOMPILE_LIMIT = 64


def _compiled(function, options: dict):
    key = (function.__name__, tuple(sorted((name, repr(value)) for name, value in options.items())))
    if key not in _COMPILED:
        if not any(options_key == key[1] for _, options_key in _COMPILED):  # long one-off work says so
            logger.warning(f"torch.compile {options}: the first call compiles (minutes at full size); then reused")
        dynamo_config = torch._dynamo.config
        if hasattr(dynamo_config, "recompile_limit"):
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
        _COMPILED[key] = torch.compile(function, **options)
    return _COMPILED[key]


_SDPA_BACKENDS = {
    "math": [SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
}


class _PinnedAttention:
    """Run a compiled step (or part) with SDPA pinned to some backends (`compile_attention="math" | "efficient" | ...`).

    The backend is fixed when the step is traced, so the context is held around every call. Measured on an H200
    (BENCHMARKS.md, 2026-11-29), "math" (Inductor generates the decode attention itself) is slower than PyTorch's own
    kernel choice (batch 1: 20.7 vs 18.1 ms per LLM step; batch 16: 76.7 vs 32.5 ms, the GQA expansion is
    materialised). The compiled default ("auto") is `gqa_matmul` instead (with the fused CRQ projections: 14.15 / 17.4
    ms, 2026-11-30); these switches are kept for other GPUs / torch versions.
    """

    def __init__(self, step_fn, backend: str):
        self.step_fn = step_fn
        self.backends = _SDPA_BACKENDS[backend]

    def __call__(self, model, ws: "_DecodeWorkspace", cfg: _StepConfig) -> None:
        with sdpa_kernel(self.backends):
            self.step_fn(model, ws, cfg)


class _DecodeAttention:
    """Run a compiled step (or part) with the attention in one of our one-query attention functions:
    `compile_attention="gqa_matmul"` (`gqa_decode_attention`: two batched GEMMs over the KV heads, no `repeat_kv`
    copy of the cache, no SDPA backend choice) or `"triton"` (`triton_decode_attention`: two Triton kernels that skip
    the cache positions the mask hides).

    The eager prefill keeps the model's own attention. The switch is the configs' `_attn_implementation`, set around
    every call and restored in `finally`: it is per model, not per thread, so an eager forward of the same model in
    another thread during a step also runs through it (same results: both functions delegate to `sdpa` for more than
    one query position and compute the same attention for one). `torch.compile` guards on the value, so alternating
    with "default" on one model recompiles once per variant.
    """

    def __init__(self, step_fn, attention: str):
        self.step_fn = step_fn
        register = register_triton_decode_attention if attention == "triton" else register_gqa_decode_attention
        self.implementation = register()

    def __call__(self, model, ws: "_DecodeWorkspace", cfg: _StepConfig) -> None:
        configs = [model.language_model.config]
        if model.audio_invert_tower is not None:
            configs.append(model.audio_invert_tower.crq_transformer.config)
        saved = [config._attn_implementation for config in configs]
        try:
            for config in configs:
                config._attn_implementation = self.implementation
            self.step_fn(model, ws, cfg)
        finally:
            for config, implementation in zip(configs, saved):
                config._attn_implementation = implementation


class _CompiledParts:
    """`_decode_step` with its three parts compiled separately (`compile_scope="parts"`)."""

    def __init__(self, options: dict):
        self.llm_part = _compiled(_llm_part, options)
        self.crq_part = _compiled(_crq_part, options)
        self.finish_part = _compiled(_finish_part, options)

    def __call__(self, model, ws: _DecodeWorkspace, cfg: _StepConfig) -> None:
        self.llm_part(model, ws, cfg)
        _start_text_head(model, ws, cfg)  # between the parts' CUDA graphs: the head overlaps the CRQ's
        if not cfg.disable_speech:
            for _ in range(cfg.group_size):
                self.crq_part(model, ws, cfg)
        _join_text_head(ws, cfg)
        self.finish_part(model, ws, cfg)


# --------------------------------------------------------------------------------------------------------------------
# Vocoding
# --------------------------------------------------------------------------------------------------------------------


def _plain_crq_head(tower) -> bool:
    """Whether the GEMV kernel can read the CRQ's input / output matching and speech head, and its final norm
    ([`kernel_readable`])."""
    linears = (tower.input_matching, tower.output_matching, tower.lm_head)
    return kernel_readable(linears, (tower.crq_transformer.norm,))


def split_speech_segments(
    tokens: torch.Tensor, segment_tokens: int = SEGMENT_TOKENS, min_last: int = MIN_LAST_SEGMENT_TOKENS
) -> list[torch.Tensor]:
    """Split a 1-D token stream into consecutive 30-s segments (spec funaudiochat.md §8).

    If there is more than one segment and the last is shorter than `min_last`, the last two are merged and split
    into two halves (first half `n // 2` tokens), so no segment is vocoded from a very short context.
    """
    segments = list(torch.split(tokens, segment_tokens))
    if len(segments) > 1 and len(segments[-1]) < min_last:
        merged = torch.cat(segments[-2:])
        half = len(merged) // 2
        segments[-2:] = [merged[:half], merged[half:]]
    return segments


def _decoder_speaker_kwargs(speaker) -> dict:
    if speaker is None:
        return {}
    if isinstance(speaker, torch.Tensor):
        return {"speaker_embedding": speaker}
    return {"speaker": speaker}


def _decoder_device(decoder) -> torch.device:
    try:
        return next(decoder.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _decoder_sampling_rate(decoder) -> int:
    rate = getattr(getattr(decoder, "config", None), "sampling_rate", None)
    return int(rate if rate is not None else getattr(decoder, "sampling_rate", 24000))


def _valid_speech_tokens(speech_ids: torch.Tensor, speech_bos_id: int) -> torch.Tensor:
    """Keep only codec tokens (drops the bos delay tokens, EOS and padding)."""
    return speech_ids[(speech_ids >= 0) & (speech_ids < speech_bos_id)]


def _waveforms(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(waveform (N, samples), valid lengths (N,) or None)` of a decoder call (`CosyVoice3Token2WavOutput`, a
    `(waveform, lengths)` tuple or a plain tensor)."""
    if isinstance(output, torch.Tensor):
        return output.reshape(output.shape[0], -1), None
    if isinstance(output, dict):
        return output["waveform"], output.get("waveform_lengths")
    return output[0], output[1] if len(output) > 1 else None


@torch.no_grad()
def decode_speech_offline(decoder, speech_ids: torch.Tensor, speech_bos_id: int, speaker=None) -> list[torch.Tensor]:
    """Vocode raw speech streams `(batch, n)` into one 1-D waveform per row (on the CPU).

    Only codec ids (0 <= id < speech bos) are kept; each row is cut into independent 30-s segments (spec §8). All
    segments of all rows go through the decoder in one right-padded batch call (`speech_token_lengths`) on the
    decoder's own device, which may differ from the chat model's.
    """
    rows = [split_speech_segments(_valid_speech_tokens(row, speech_bos_id)) for row in speech_ids]
    segments = [segment for row in rows for segment in row if len(segment) > 0]
    if not segments:
        return [torch.zeros(0) for _ in rows]
    device = _decoder_device(decoder)
    lengths = torch.tensor([len(segment) for segment in segments])
    tokens = torch.nn.utils.rnn.pad_sequence(segments, batch_first=True).to(device)
    kwargs = _decoder_speaker_kwargs(speaker)
    if len(segments) > 1:
        kwargs["speech_token_lengths"] = lengths.to(device)
    waveform, waveform_lengths = _waveforms(decoder(tokens, **kwargs))
    waveform = waveform.float().cpu()
    if waveform_lengths is None:
        waveform_lengths = torch.full((len(segments),), waveform.shape[1])
    pieces = iter(waveform[i, : int(n)] for i, n in enumerate(waveform_lengths.cpu()))
    return [torch.cat([next(pieces) for segment in row if len(segment) > 0] or [torch.zeros(0)]) for row in rows]


# --------------------------------------------------------------------------------------------------------------------
# The mixin
# --------------------------------------------------------------------------------------------------------------------

# Reusable workspaces per model, kept outside the module so the model stays picklable and they die with it.
_WORKSPACES: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()
_WORKSPACES_LOCK = threading.Lock()


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


class _SpeechRun:
    """One `generate_speech` call: validated inputs, settings, workspace, and the step loop."""

    def __init__(self, model, *, input_ids, attention_mask, prompt_inputs, options: dict):
        self.model = model
        self.options = options
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            got = f"shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"`input_ids` must be a (batch, length) LongTensor, got {got}.")
        length = input_ids.shape[1]
        if length == 0:
            raise ValueError("`input_ids` is empty: the prompt needs at least one token.")
        max_new_tokens = options["max_new_tokens"]
        if max_new_tokens is None or max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens}.")
        device = model.language_model.get_input_embeddings().weight.device
        # A copy: never a view of the caller's tensor (a compiled prefill would otherwise guard on the view's base).
        input_ids = input_ids.to(device, copy=True)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(device)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"`attention_mask` shape {tuple(attention_mask.shape)} != `input_ids` shape {tuple(input_ids.shape)}."
            )
        mask = attention_mask.bool()
        if not mask[:, -1].all() or (mask[:, 1:].long() < mask[:, :-1].long()).any():
            raise ValueError(
                "generate_speech needs left-padded prompts (padding_side='left'): every row's tokens must end at the "
                "last column."
            )
        self.input_ids, self.mask = input_ids, mask
        self.padding = length - mask.long().sum(-1)

        config = model.config
        text_config, audio_config = config.text_config, config.audio_config
        disable_speech = bool(options["disable_speech"])
        if not disable_speech and getattr(model, "audio_invert_tower", None) is None:
            raise ValueError("This model has no speech decoder (`audio_invert_tower`); pass `disable_speech=True`.")

        generation_config = getattr(model, "generation_config", None)
        eos = options["eos_token_id"]
        if eos is None and generation_config is not None:
            eos = generation_config.eos_token_id
        if eos is None:
            eos = text_config.eos_token_id
        eos_ids = _as_id_tuple(eos)
        pad = options["pad_token_id"]
        if pad is None and generation_config is not None:
            pad = generation_config.pad_token_id
        if pad is None:
            pad = getattr(text_config, "pad_token_id", None)
        if pad is None:
            pad = eos_ids[0] if eos_ids else 0
        self.eos_ids = torch.tensor(eos_ids if eos_ids else (-1,), dtype=torch.long, device=device)

        self.text_settings, self.speech_settings = options["text_settings"], options["speech_settings"]
        kernel_config = options["kernel_config"]
        if kernel_config is None:
            kernel_config = DecodeKernelConfig.for_device(device)
        elif not isinstance(kernel_config, DecodeKernelConfig):
            raise ValueError(f"`kernel_config` must be a DecodeKernelConfig or None, got {type(kernel_config).__name__}.")
        self.cfg = _StepConfig(
            text=self.text_settings.switches,
            speech=self.speech_settings.switches,
            disable_speech=disable_speech,
            group_size=audio_config.group_size,
            speech_bos_id=audio_config.bos_token_id,
            speech_eos_id=audio_config.eos_token_id,
            audio_bos_index=text_config.audio_bos_index,
            audio_eos_index=text_config.audio_eos_index,
            pad_token_id=int(pad),
            output_logits=bool(options["output_logits"]),
            kernels=kernel_config,
        )
        self.speech_pad_id = audio_config.pad_token_id
        self.max_new_tokens = max_new_tokens

        cache_implementation = options["cache_implementation"]
        if cache_implementation not in ("static", "dynamic"):
            raise ValueError(f"`cache_implementation` must be 'static' or 'dynamic', got {cache_implementation!r}.")
        self.static = cache_implementation == "static"
        needed = length + max_new_tokens
        cache_max_length = options["cache_max_length"]
        if cache_max_length is None:
            cache_max_length = -(-needed // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE
        elif needed > cache_max_length:
            raise ValueError(
                f"The request needs {needed} LLM cache positions (prompt {length} + max_new_tokens {max_new_tokens}) "
                f"and {audio_config.group_size * needed} CRQ positions, but the caches hold only "
                f"`cache_max_length`={cache_max_length} LLM positions. Raise `cache_max_length` or lower "
                "`max_new_tokens`."
            )
        self.cache_max_length = cache_max_length
        self.step_fn = self._pick_step_function(
            options["compile"], options["compile_scope"], options["step_graph"], device
        )
        compiled = self.step_fn is not _decode_step
        compile_prefill = options["compile_prefill"]
        if compile_prefill is None:
            # Auto: with a compiled loop, the prompt forward is the largest part of the time to first audio and is
            # bound by eager kernel launches; compiling its layer halves takes ~13 s at full size on an H200 and took
            # 19-64 ms off the prefill in two runs (BENCHMARKS.md). A test backend given to `compile` is used too.
            compile_prefill = compiled
            if compiled and isinstance(options["compile"], dict) and "backend" in options["compile"]:
                compile_prefill = {**PREFILL_COMPILE_DEFAULTS, "backend": options["compile"]["backend"]}
        self.prefill_forward = self._pick_prefill_function(compile_prefill)
        crq = None if disable_speech else model.audio_invert_tower.crq_transformer  # speech off: no CRQ steps
        fuse = options["fuse_crq_projections"]
        if fuse is None:
            # Auto: a compiled loop is bound by the CRQ's many small GEMMs (measured on an H200, BENCHMARKS.md), so
            # fuse them when the projections are plain linears (not LoRA-wrapped / quantized).
            fuse = compiled and crq is not None and can_fuse_crq_projections(crq)
        fuse = bool(fuse) and crq is not None
        fold = options["fold_crq_matching"]
        if fold is None:
            # Auto: where the linears around the CRQ stack are plain, a compiled loop reads 0.44 GB less per step at
            # full size in 11 fewer GEMMs: on an H200 (BENCHMARKS.md, 2026-12-02 18:01-18:07, side by side) batch 1
            # 7.70 against 7.86 ms per step, batch 16 11.75 against 11.91 ms.
            fold = compiled and crq is not None and can_fold_crq_matching(model)
        elif fold and crq is not None:
            folded_crq_matching(model)  # builds the copies now, or raises the reason they cannot be
        fold = bool(fold) and crq is not None
        # The CRQ's kernels read its fused copies: unfused, there is nothing for them to run.
        crq_linear = crq is not None and self._pick_linear_kernels(
            "crq_linear", options["crq_linear"], compiled, crq if fuse else None, device
        )
        llm = model.language_model.model
        llm_linear = self._pick_linear_kernels("llm_linear", options["llm_linear"], compiled, llm, device)
        crq_head_linear = crq_linear and _plain_crq_head(model.audio_invert_tower)
        # Steps of at most MAX_ROWS rows multiply the speech head with the GEMV kernel: no padded copy for them.
        head_on_kernel = crq_head_linear and input_ids.shape[0] <= MAX_ROWS
        speech_sampler = not disable_speech and self._pick_speech_sampler(
            options["speech_sampler"], compiled, audio_config.codebook_size, device
        )
        overlap_text_head = self._pick_text_head(options["text_head"], compiled, disable_speech, device)
        self.cfg = replace(
            self.cfg,
            fuse_crq_projections=fuse,
            crq_linear=crq_linear,
            llm_linear=llm_linear,
            crq_head_linear=crq_head_linear,
            speech_sampler=speech_sampler,
            fold_crq_matching=fold,
            # The folded speech head is padded itself.
            pad_speech_head=compiled and not disable_speech and not head_on_kernel and not fold,
            overlap_text_head=overlap_text_head,
        )
        self.attention = attention = self._pick_attention(options["compile_attention"], compiled, device)
        # The prefill's last K - 1 CRQ sub-steps are decode sub-steps: reuse the compiled one when there is one.
        self.prefill_crq_part = self.step_fn.crq_part if isinstance(self.step_fn, _CompiledParts) else _crq_part
        if compiled and attention in ("gqa_matmul", "triton"):
            self.step_fn = _DecodeAttention(self.step_fn, attention)
            self.prefill_crq_part = _DecodeAttention(self.prefill_crq_part, attention)
        elif compiled and attention != "default" and device.type == "cuda":
            self.step_fn = _PinnedAttention(self.step_fn, attention)
            self.prefill_crq_part = _PinnedAttention(self.prefill_crq_part, attention)
        if self.step_graph:
            # Keyed by everything the recorded work depends on besides the tensors (`StepGraphs.check`).
            key = (self.compile_key, attention, self.cfg)
            self.step_fn = CapturedStep(self.step_fn, ("step", *key))
            if self.prefill_crq_part is not _crq_part:
                self.prefill_crq_part = CapturedStep(self.prefill_crq_part, ("crq_part", *key))
        self.prompt_inputs = prompt_inputs
        self.generator = self._make_generator(options["generator"], options["seed"], device)
        self._owned_lock = None

    # ------------------------------------------------------------------ setup
    def _compile_options(self, name: str, option, defaults: dict) -> dict | None:
        """`torch.compile` options for the `name` argument (False | True | dict), or None: run eagerly."""
        if option is False or option is None:
            return None
        if option is not True and not isinstance(option, dict):
            raise ValueError(f"`{name}` must be a bool or a dict of torch.compile options, got {option!r}.")
        if not self.static:
            logger.warning(f"`{name}` needs `cache_implementation='static'`; running eagerly.")
            return None
        if self._dispatched():
            logger.warning(
                f"The model is dispatched over several devices (device_map); `{name}` cannot capture it, so that "
                "part runs eagerly."
            )
            return None
        return dict(defaults) if option is True else dict(option)

    def _dispatched(self) -> bool:
        """Whether the model is spread over several devices or offloaded (`device_map`): no compiled capture, no
        Triton kernels."""
        mapped_devices = set(map(str, (getattr(self.model, "hf_device_map", None) or {}).values()))
        return len(mapped_devices) > 1 or bool(mapped_devices & {"cpu", "disk"})

    def _pick_prefill_function(self, compile_option):
        """`_prefill_forward`, with its LLM and CRQ layers' halves compiled when asked to.

        Regional compilation: the two halves of a decoder layer around its attention are compiled once, with dynamic
        shapes, and serve every layer and prompt length (compiling the whole prompt forward as one graph took more
        than 5 minutes at full size on an H200). No CUDA graphs by default: every prompt length would record its own.
        """
        options = self._compile_options("compile_prefill", compile_option, PREFILL_COMPILE_DEFAULTS)
        if options is None:
            return _prefill_forward
        halves = DecoderLayerHalves(*(_compiled(half, options) for half in EAGER_HALVES))
        return functools.partial(_prefill_forward, halves=halves)

    def _pick_kernels(self, name: str, choice: str, compiled: bool, device, supported, needs: str) -> bool:
        """Whether the run takes a Triton kernel option (`crq_linear`, `llm_linear`, `speech_sampler`): "auto" in a
        compiled loop (each measured faster there on an H200, BENCHMARKS.md) where `supported()` and one CUDA GPU
        with Triton allow it; "triton" raises where they do not (`needs`: what else it needs); "torch" never."""
        if choice not in ("auto", "triton", "torch"):
            raise ValueError(f"`{name}` must be 'auto', 'triton' or 'torch', got {choice!r}.")
        if choice == "torch" or (choice == "auto" and not compiled):
            return False
        usable = not self._dispatched() and triton_available(device) and supported()
        if choice == "triton" and not usable:
            raise ValueError(
                f"`{name}='triton'` needs the `triton` package, the model on one CUDA GPU of compute capability 8.0 "
                f"or newer{needs}; use 'torch' or 'auto'."
            )
        return usable

    def _pick_linear_kernels(self, name: str, choice: str, compiled: bool, stack, device: torch.device) -> bool:
        """Whether a stack's decode steps run their projections through the Triton GEMV kernels (`crq_linear`,
        `llm_linear`); `stack` is None where the kernels cannot apply (the CRQ without fused projections / speech).
        Measured at full size on an H200 (BENCHMARKS.md, 2026-11-30): the batch-1 step 13.71 -> 12.48 ms with the
        CRQ's, 11.58 -> 10.69 ms with the LLM's added, side by side."""
        fused = " with the fused CRQ projections (`fuse_crq_projections` not False)" if name == "crq_linear" else ""
        return self._pick_kernels(
            name, choice, compiled, device,
            lambda: stack is not None and decode_kernels_supported(stack),
            f"{fused}, and plain linear projections with a SiLU MLP",
        )  # fmt: skip

    def _pick_speech_sampler(self, choice: str, compiled: bool, vocab_size: int, device: torch.device) -> bool:
        """Whether the speech tokens are picked by the Triton sampler (`speech_sampler`). Measured on an H200
        (BENCHMARKS.md, 2026-12-01): the batch-1 step 8.40 -> 8.23-8.26 ms, side by side."""
        return self._pick_kernels(
            "speech_sampler", choice, compiled, device,
            lambda: sampler_kernel_supported(vocab_size),
            f" and a speech codebook of at most {MAX_SAMPLER_VOCAB} ids",
        )  # fmt: skip

    def _pick_text_head(self, choice: str, compiled: bool, disable_speech: bool, device: torch.device) -> bool:
        """Whether the decode steps run the LLM's text head on a side stream beside the CRQ sub-steps (`text_head`):
        a step whose parts are compiled separately or run eagerly (a step compiled as one graph keeps it inline), with
        speech on (else there is nothing to overlap), at most `TEXT_HEAD_MAX_ROWS` rows ("auto": at most
        the kernel config's `text_head_overlap_max_rows`, where it was measured faster), a plain linear head."""
        separate_parts = self.step_fn is _decode_step or isinstance(self.step_fn, _CompiledParts)
        if choice == "auto" and self.input_ids.shape[0] > self.cfg.kernels.text_head_overlap_max_rows:
            return False
        return self._pick_kernels(
            "text_head", choice, compiled, device,
            lambda: separate_parts and not disable_speech and text_head_supported(
                self.model.language_model.lm_head, self.input_ids.shape[0]
            ),
            f", speech on, compile_scope='parts' (or no compile), at most {TEXT_HEAD_MAX_ROWS} rows and a plain "
            "linear text head",
        )  # fmt: skip

    @staticmethod
    def _pick_attention(attention: str, compiled: bool, device: torch.device) -> str:
        """The decode attention of the run: `compile_attention` with "auto" resolved."""
        choices = ("auto", "default", "gqa_matmul", "triton")
        if attention not in choices and attention not in _SDPA_BACKENDS:
            raise ValueError(
                f"`compile_attention` must be one of {list(choices) + sorted(_SDPA_BACKENDS)}, got {attention!r}."
            )
        if attention == "triton" and not triton_available(device):
            raise ValueError(
                "`compile_attention='triton'` needs the `triton` package and the model on a CUDA GPU of compute "
                "capability 8.0 or newer; use 'gqa_matmul' (the same attention as batched matmuls) or 'auto'."
            )
        if attention == "auto":
            if not compiled:
                return "default"
            return "triton" if triton_available(device) else "gqa_matmul"
        return attention

    def _pick_step_function(self, compile_option, compile_scope: str, step_graph, device):
        """The step function, compiled as asked; sets `self.step_graph` (whether `CapturedStep` records it as one
        CUDA graph) and `self.compile_key` (its compile options)."""
        if compile_scope not in ("step", "parts"):
            raise ValueError(f"`compile_scope` must be 'step' or 'parts', got {compile_scope!r}.")
        if step_graph not in (None, True, False):
            raise ValueError(f"`step_graph` must be None, True or False, got {step_graph!r}.")
        defaults = {"fullgraph": True, "dynamic": False}
        if device.type == "cuda":
            defaults["mode"] = "reduce-overhead"
        options = self._compile_options("compile", compile_option, defaults)
        self.step_graph, self.compile_key = False, None
        if options is None or device.type != "cuda":
            if step_graph:
                raise ValueError(
                    "`step_graph=True` needs a compiled loop (`compile`) with a static cache, on one CUDA device."
                )
            return _decode_step if options is None else self._compiled_step(options, compile_scope)
        # Auto: where the loop would replay torch.compile's CUDA graphs part by part (the CUDA default), one graph
        # per step instead (`step_graph_funaudiochat`): a step's host work is then one launch, not ~7 replays
        # that each check every weight's address.
        mode = options.get("mode")
        self.step_graph = mode == "reduce-overhead" if step_graph is None else step_graph
        if self.step_graph:  # the parts without CUDA graphs of their own: they are captured inside the step's
            options = {key: value for key, value in options.items() if key != "mode"}
            if mode == "max-autotune":
                options["mode"] = "max-autotune-no-cudagraphs"
            elif mode not in (None, "reduce-overhead"):
                options["mode"] = mode
        return self._compiled_step(options, compile_scope)

    def _compiled_step(self, options: dict, compile_scope: str):
        self.compile_key = (compile_scope, tuple(sorted((name, repr(value)) for name, value in options.items())))
        return _compiled(_decode_step, options) if compile_scope == "step" else _CompiledParts(options)

    @staticmethod
    def _make_generator(generator, seed, device):
        if generator is not None:
            return generator
        generator = torch.Generator(device=device)
        if seed is None:
            # Follow the global RNG so `torch.manual_seed(...)` before the call makes it reproducible.
            seed = int(torch.randint(0, 2**62, (1,)).item())
        generator.manual_seed(int(seed))
        return generator

    def _acquire_workspace(self) -> _DecodeWorkspace:
        batch = self.input_ids.shape[0]
        if not self.static:
            return _DecodeWorkspace(self.model, batch, self.cache_max_length, False, self.cfg.output_logits)
        key = (batch, self.cache_max_length, self.cfg.output_logits)
        with _WORKSPACES_LOCK:
            workspaces = _WORKSPACES.setdefault(self.model, OrderedDict())
            workspace = workspaces.get(key)
            if workspace is not None and workspace.lock.acquire(blocking=False):
                workspaces.move_to_end(key)
                self._owned_lock = workspace.lock
                return workspace
        # Not cached, or in use by another thread: build one (only a free one is cached for reuse).
        workspace = _DecodeWorkspace(self.model, batch, self.cache_max_length, True, self.cfg.output_logits)
        workspace.lock.acquire()
        self._owned_lock = workspace.lock
        with _WORKSPACES_LOCK:
            workspaces = _WORKSPACES.setdefault(self.model, OrderedDict())
            if key not in workspaces:
                workspaces[key] = workspace
                while len(workspaces) > MAX_CACHED_WORKSPACES:
                    workspaces.popitem(last=False)
        return workspace

    def release(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            # A cached workspace must not keep stale copies alive after the weights change.
            ws.fused_crq = ws.speech_head = ws.folded = None
        if self._owned_lock is not None:
            self._owned_lock.release()
            self._owned_lock = None

    def _draw_noise(self, ws: _DecodeWorkspace) -> None:
        streams = [(self.cfg.text, ws.text_noise)]
        if not self.cfg.disable_speech:
            streams.append((self.cfg.speech, ws.speech_noise))
        generator = self.generator
        for settings, noise in streams:
            if not settings.do_sample:
                continue
            if generator.device == noise.device:
                noise.exponential_(generator=generator)
            else:  # a user generator on another device (e.g. CPU) than the model
                noise.copy_(torch.empty(noise.shape, device=generator.device).exponential_(generator=generator))

    # ------------------------------------------------------------------ loop
    def prefill(self) -> _DecodeWorkspace:
        model, cfg = self.model, self.cfg
        ws = self._acquire_workspace()
        self.ws = ws
        ws.reset(self.eos_ids, self.speech_pad_id, self.text_settings, self.speech_settings)
        length = self.input_ids.shape[1]
        k = cfg.group_size
        ws.llm_mask.fill_(True)
        ws.llm_mask[:, :length] = self.mask
        ws.crq_mask.fill_(True)
        ws.crq_mask[:, : length * k] = self.mask.repeat_interleave(k, dim=1)
        if cfg.fuse_crq_projections:
            # Looked up (and rebuilt if the weights changed) here, outside the compiled step.
            ws.fused_crq = fused_crq_projections(model.audio_invert_tower.crq_transformer)
            if cfg.crq_linear:
                ws.fused_crq = with_decode_kernels(ws.fused_crq)
        ws.llm_kernels = own_weight_kernels(model.language_model.model) if cfg.llm_linear else None
        if cfg.overlap_text_head and ws.text_head is None:
            ws.text_head = OverlappedTextHead(ws.device)
        ws.speech_head = padded_output_linear(model.audio_invert_tower.lm_head) if cfg.pad_speech_head else None
        ws.folded = folded_crq_matching(model) if cfg.fold_crq_matching else None
        if not cfg.disable_speech:
            ws.prev_speech_token.fill_(cfg.speech_bos_id)
            ws.speaking.copy_(self.input_ids[:, -1] == cfg.audio_bos_index)
        if cfg.text.uses_history:
            # The text repetition penalty covers the prompt too (as the reference), but not the left padding.
            vocab = ws.text_seen.shape[1]
            prompt_ids = self.input_ids.masked_fill(~self.mask, vocab)
            seen = torch.zeros(ws.text_seen.shape[0], vocab + 1, dtype=torch.bool, device=ws.device)
            ws.text_seen.copy_(seen.scatter_(1, prompt_ids, True)[:, :vocab])
        inputs_embeds = model.embed_prompt(self.input_ids, **self.prompt_inputs).to(ws.device, ws.dtype)
        self._draw_noise(ws)
        self.prefill_forward(model, ws, cfg, self.input_ids, inputs_embeds, self.padding)
        if self.step_graph:  # the caches exist now (a static cache allocates its tensors on first use)
            ws.step_graphs.check(tensor_addresses(model, ws.graph_inputs()))
        if not cfg.disable_speech:
            # The first group's other K - 1 CRQ sub-steps have a decode sub-step's shapes: they run through the
            # compiled decode sub-step when the loop is compiled (part of the time to first audio).
            for _ in range(cfg.group_size - 1):
                self.prefill_crq_part(model, ws, cfg)
        force = cfg.audio_bos_index if self.options["force_text_abos"] else None
        _finish_part(model, ws, cfg, force_token=force)
        self.steps = 1
        return ws

    def decode(self) -> None:
        self._draw_noise(self.ws)
        self.step_fn(self.model, self.ws, self.cfg)
        self.steps += 1

    def all_done(self) -> bool:
        return bool(self.ws.done.all())

    def decode_until_done(self, check_every: int = 1) -> None:
        """Decode steps until every row has finished or `max_new_tokens` is reached, checking for the former after
        every `check_every`-th step ([`_LaggedCheck`]: the check of one step is read after the next step has been
        launched, so at most `check_every` steps run after the last row finishes)."""
        check = _LaggedCheck(self.ws.done)
        check.issue(self.steps)  # after the prefill
        while self.steps < self.max_new_tokens:
            self.decode()
            if check.due(self.steps) and check.read():
                return
            if (self.steps - 1) % check_every == 0:
                check.issue(self.steps)

    def result(self) -> FunAudioChatSpeechOutput:
        ws, cfg = self.ws, self.cfg
        new_tokens = self.steps
        if self.all_done():
            new_tokens = int(ws.finish_step.max()) + 1
        sequences = torch.cat([self.input_ids, ws.text_out[:, :new_tokens]], dim=1).clone()
        groups = int(ws.groups.max())
        speech_ids = ws.speech_out[:, : cfg.group_size * groups].clone()
        output = FunAudioChatSpeechOutput(sequences=sequences, speech_ids=speech_ids)
        if cfg.output_logits:
            output.text_logits = ws.text_logits[:, :new_tokens].clone()
            if not cfg.disable_speech:
                output.speech_logits = ws.speech_logits[:, :new_tokens].clone()
        return output


class _LaggedCheck:
    """Whether every row has finished, read one step late so that the GPU never waits for the host.

    A blocking check (`bool(done.all())`) drains the GPU's queue: the GPU then idles while the host launches the next
    step (an H200 profile at batch 16: ~0.45 ms per check, mostly the launch of the step's CUDA graph). Here `issue`
    queues the check behind a step (a reduction and a copy to pinned memory, then an event), and `read`, called once
    the host has launched the next step, waits for that event only: the launched step keeps the GPU busy meanwhile.
    On a CPU the copy is synchronous and the event is not needed.
    """

    def __init__(self, done: torch.Tensor):
        self.done = done
        cuda = done.is_cuda
        self.flag = torch.zeros((), dtype=torch.bool, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.step: int | None = None  # the step count the pending check was issued after

    def issue(self, step: int) -> None:
        self.flag.copy_(self.done.all(), non_blocking=self.event is not None)
        if self.event is not None:  # on the stream the copy was queued on (the model's GPU may not be the current one)
            self.event.record(torch.cuda.current_stream(self.done.device))
        self.step = step

    def due(self, step: int) -> bool:
        """Whether a check is pending and a step was launched after it (`step` steps now)."""
        return self.step is not None and step > self.step

    def read(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        self.step = None
        return bool(self.flag)


class FunAudioChatSpeechGenerationMixin:
    """Adds `generate_speech` (text + speech tokens + optional audio) and `generate_speech_stream` to the model."""

    def clear_speech_caches(self) -> None:
        """Free the KV caches and decode buffers that `generate_speech` keeps for reuse by later calls."""
        with _WORKSPACES_LOCK:
            _WORKSPACES.pop(self, None)

    def _speech_run(self, input_ids, attention_mask, prompt_inputs, kwargs) -> _SpeechRun:
        options = _resolve_options(kwargs)
        return _SpeechRun(
            self, input_ids=input_ids, attention_mask=attention_mask, prompt_inputs=prompt_inputs, options=options
        )

    def _speech_decoder(self, speech_decoder, return_audio):
        decoder = speech_decoder if speech_decoder is not None else getattr(self, "token2wav", None)
        if return_audio is True and decoder is None:
            raise ValueError(
                "`return_audio=True` needs a speech decoder: pass `speech_decoder=` or set `model.token2wav`."
            )
        return None if return_audio is False else decoder

    @torch.no_grad()
    def generate_speech(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        speech_ids: torch.LongTensor | None = None,
        speech_attention_mask: torch.Tensor | None = None,
        input_features: torch.FloatTensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        feature_exist_mask: torch.Tensor | None = None,
        *,
        speech_decoder=None,
        speaker=None,
        return_audio: bool | None = None,
        streamer=None,
        sync_every: int = 1,
        **generation_kwargs,
    ) -> FunAudioChatSpeechOutput:
        """Answer a (spoken) prompt with text and speech tokens, and optionally the vocoded waveform.

        Args:
            input_ids: `(batch, length)` prompt ids, left-padded for batches (the processor's output).
            attention_mask: `(batch, length)`, 0 on left padding.
            speech_ids, speech_attention_mask, input_features, feature_attention_mask, feature_exist_mask:
                user-audio inputs exactly as the processor returns them.
            speech_decoder: a `CosyVoice3Token2Wav` (defaults to `self.token2wav`); may live on another device.
            speaker: speaker name or `(192,)` embedding for the decoder.
            return_audio: None = vocode when a decoder is available; False = never; True = required.
            streamer: transformers-style streamer (`put`/`end`) receiving the prompt then each text token (batch 1).
            sync_every: check whether every row has finished after every this many steps (1: each step); a check is
                read once the next step has been launched, so it never leaves the GPU idle, and at most this many
                steps run after the last row finishes.
            **generation_kwargs: `max_new_tokens` (512), `do_sample` (True), `temperature` (0.8), `top_p` (0.9),
                `top_k` (0), `repetition_penalty` (1.2), `text_greedy` (True), `force_text_abos` (True),
                `disable_speech` (False), `eos_token_id`, `pad_token_id` (default: `generation_config`),
                `text_`/`speech_` prefixed overrides of do_sample/temperature/top_p/top_k/repetition_penalty,
                `generator` or `seed`, `compile` (False | True | dict of torch.compile options), `compile_scope`
                ("parts", default: LLM part, CRQ sub-step and bookkeeping compiled separately, ~5x faster to
                compile than "step", the whole step as one graph), `step_graph` (None, default: on where the loop
                would replay torch.compile's own CUDA graphs, i.e. compiled on CUDA with the default mode
                "reduce-overhead"; True: the parts compiled without CUDA graphs of their own and the whole decode step,
                text head stream included, recorded as one CUDA graph per workspace and settings, replayed with one
                launch per step, the tensors it reads checked once per call, `step_graph_funaudiochat`; on an H200,
                batch 16 11.44 against 11.64 ms per step, the GPU no longer idles ~1.5-2 ms after each `sync_every`
                check while the host catches up; False: torch.compile's graphs, one per part), `compile_prefill`
                (None, default: on when the loop is
                compiled, with `compile`'s backend if it names one | False | True | dict of torch.compile options:
                the two halves of every LLM and CRQ decoder layer around its attention compiled once with dynamic
                shapes, one graph per half and stack for every layer and prompt length, no CUDA graphs: fewer kernel
                launches in the prefill, which eagerly is bound by them; on an H200 the time to first audio went
                from 189 to 135 ms for ~13 s more compilation on the first call, BENCHMARKS.md), `compile_attention`
                ("auto", default: "triton" when compiled on a CUDA GPU of compute capability >= 8.0 with Triton
                installed, "gqa_matmul" when compiled elsewhere, else "default"; "default": PyTorch's SDPA kernel
                choice; "math" | "efficient" | "cudnn": pin the SDPA backend of the compiled step on CUDA;
                "gqa_matmul": the compiled step's attention as two GQA-aware batched matmuls, any device; "triton":
                two Triton kernels that also skip the cache positions not yet written, CUDA only),
                `fuse_crq_projections` (None, default: True when compiled and the CRQ projections are plain
                linears, else False; True: the CRQ layers run with their q/k/v and gate/up projections fused into
                one GEMM each, 4 instead of 7 per layer, compiled or eager; costs one extra copy of those weights,
                ~0.6 GB in bfloat16 at full size; same math, float rounding may differ slightly),
                `fold_crq_matching` (None, default: True when compiled and the linears around the CRQ stack are plain,
                else False; True: those linear maps multiplied out once, compiled or eager, `FoldedCRQMatching`:
                `input_matching ∘ pre_matching` as one GEMM per LLM position, `lm_head ∘ output_matching` as one per
                CRQ sub-step, the previous speech token's input and the speech fed back to the LLM as gathered rows;
                0.11 instead of 0.55 GB read per step and 11 fewer GEMMs at full size, for 0.12 GB of copies; same
                math, float rounding may differ slightly), `crq_linear`
                ("auto", default: "triton" when the fused CRQ projections are on in a compiled loop on a CUDA GPU
                of compute capability >= 8.0 with Triton installed, else "torch"; "triton": a batch-1 CRQ decode
                step runs each layer's projections as 4 Triton GEMV kernels with the norms, the SiLU and the
                residual adds folded in, `triton_linear_funaudiochat`, and over a static cache its q/k norms,
                rotary embedding and cache write as one more, `triton_attention_inputs_funaudiochat`, or inside the
                Triton attention's kernels when that is the attention, and the CRQ's input matching, output matching
                (with the final norm folded in) and speech head as 3 more (batches keep cuBLAS, faster there); "torch":
                cuBLAS GEMMs; same math, float rounding may differ slightly),
                `llm_linear` (the same
                choice for the LLM: "auto" gives "triton" under the same conditions, minus the fused projections:
                its batch-1 decode step runs the kernels over its own, unfused weights, 6 per layer; "torch": the
                LLM's own forward), `speech_sampler` ("auto", default: "triton" in a compiled loop on a CUDA GPU of
                compute capability >= 8.0 with Triton installed, else "torch"; "triton": each speech token's penalty,
                temperature, top-p and draw as one sort-free kernel, `triton_sampling_funaudiochat`, any batch size
                (a top-k, off by default, keeps the PyTorch ops); "torch": PyTorch ops, a sort per row; same draws up
                to float rounding), `text_head` ("auto", default: "triton" in a loop compiled with
                `compile_scope="parts"` on a CUDA GPU of compute capability >= 8.0 with Triton installed, speech on,
                up to 16 rows, else "torch"; "triton" (up to 16 rows): each decode step's text logits come from a
                Triton kernel of few programs on a second CUDA stream while the CRQ sub-steps run (batch 1: 0.05-0.8
                ms, median ~0.2 ms, batch 16: ~0.24 ms less per step on an H200), `triton_text_head_funaudiochat`;
                "torch": the LLM's `lm_head` after the LLM part; same logits up to float rounding),
                `kernel_config` (None, default: `DecodeKernelConfig.for_device(device)`; a
                `triton_config_funaudiochat.DecodeKernelConfig`: the tiles, warps, grids and launch kind of every
                Triton kernel, part of the step graphs' key), `cache_implementation` ("static" | "dynamic"),
                `cache_max_length`, `output_logits`.

        Returns:
            [`FunAudioChatSpeechOutput`]: `sequences` `(batch, length + new)`, `speech_ids` `(batch, K * groups)`,
            `audio` (list of 1-D tensors or None) and `sampling_rate`.
        """
        if sync_every < 1:
            raise ValueError(f"`sync_every` must be >= 1, got {sync_every}.")
        decoder = self._speech_decoder(speech_decoder, return_audio)
        prompt_inputs = dict(
            speech_ids=speech_ids,
            speech_attention_mask=speech_attention_mask,
            input_features=input_features,
            feature_attention_mask=feature_attention_mask,
            feature_exist_mask=feature_exist_mask,
        )
        run = self._speech_run(input_ids, attention_mask, prompt_inputs, generation_kwargs)
        if streamer is not None and input_ids.shape[0] != 1:
            raise ValueError("`streamer` supports batch size 1 only.")
        try:
            ws = run.prefill()
            if streamer is not None:
                streamer.put(input_ids.cpu())
                streamer.put(ws.text_out[:, 0].cpu())
            if streamer is None:
                run.decode_until_done(sync_every)
            else:  # each step's token is read at once, for the streamer
                while run.steps < run.max_new_tokens and not run.all_done():
                    run.decode()
                    if not bool(ws.finish_step[0] < run.steps - 1):
                        streamer.put(ws.text_out[:, run.steps - 1].cpu())
            output = run.result()
        finally:
            run.release()
        if streamer is not None:
            streamer.end()
        if decoder is not None and not run.cfg.disable_speech:
            output.audio = decode_speech_offline(decoder, output.speech_ids, run.cfg.speech_bos_id, speaker)
            output.sampling_rate = _decoder_sampling_rate(decoder)
        return output

    @torch.no_grad()
    def generate_speech_stream(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        speech_ids: torch.LongTensor | None = None,
        speech_attention_mask: torch.Tensor | None = None,
        input_features: torch.FloatTensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        feature_exist_mask: torch.Tensor | None = None,
        *,
        tokenizer=None,
        speech_decoder=None,
        speaker=None,
        return_audio: bool | None = None,
        token_hop_len: int = 15,
        pre_lookahead_len: int = 3,
        first_token_hop_len: int | None = 5,
        stream_options: dict | None = None,
        **generation_kwargs,
    ) -> Iterator[SpeechStreamEvent]:
        """Like `generate_speech`, but yields a [`SpeechStreamEvent`] after every LLM step (0.2 s of speech).

        Audio is vocoded while decoding by the decoder's `streaming_decoder(speaker, token_hop_len,
        pre_lookahead_len, first_token_hop_len)`: the first chunk covers `first_token_hop_len` speech tokens (5 =
        0.2 s, so it arrives after 2 LLM steps instead of the 4 that a first chunk of `token_hop_len` = 15 tokens
        needs; None = the reference's chunking), later chunks `token_hop_len` tokens each. Batch size 1 only.
        `tokenizer` (the processor's tokenizer) turns the text ids into `text`. `stream_options` go to
        `streaming_decoder` as well and take precedence (e.g. `{"flow_left_context_tokens": 50}`: a shorter flow
        look-back, cheaper chunks; `{"cuda_graphs": False}`).
        """
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(
                f"generate_speech_stream supports batch size 1, got input_ids of shape {tuple(input_ids.shape)}."
            )
        decoder = self._speech_decoder(speech_decoder, return_audio)
        prompt_inputs = dict(
            speech_ids=speech_ids,
            speech_attention_mask=speech_attention_mask,
            input_features=input_features,
            feature_attention_mask=feature_attention_mask,
            feature_exist_mask=feature_exist_mask,
        )
        run = self._speech_run(input_ids, attention_mask, prompt_inputs, generation_kwargs)
        if run.cfg.disable_speech:
            decoder = None
        if decoder is not None:
            sampling_rate = _decoder_sampling_rate(decoder)
        else:
            sampling_rate = int(getattr(self.config, "sampling_rate", 24000))
        stream = (
            decoder.streaming_decoder(
                **_decoder_speaker_kwargs(speaker),
                token_hop_len=token_hop_len,
                pre_lookahead_len=pre_lookahead_len,
                **{"first_token_hop_len": first_token_hop_len, **(stream_options or {})},
            )
            if decoder is not None
            else None
        )
        k = run.cfg.group_size
        text_ids_so_far: list[int] = []
        emitted_text = ""
        empty_audio = torch.zeros(0)

        def text_delta(final: bool) -> str:
            nonlocal emitted_text
            if tokenizer is None:
                return ""
            text = tokenizer.decode(text_ids_so_far, skip_special_tokens=True)
            if not final and text.endswith("\ufffd"):
                return ""  # an incomplete multi-byte character: wait for the next token
            delta = text[len(emitted_text) :] if text.startswith(emitted_text) else text
            emitted_text = text
            return delta

        try:
            ws = run.prefill()
            groups_seen = 0
            while True:
                step = run.steps - 1
                done_before = bool(ws.finish_step[0] < step)
                new_text = ws.text_out[0, step : step + 1].cpu()
                if done_before:
                    new_text = new_text[:0]
                text_ids_so_far.extend(new_text.tolist())
                groups = int(ws.groups[0])
                new_speech = ws.speech_out[0, groups_seen * k : groups * k].cpu()
                groups_seen = groups
                audio = empty_audio
                if stream is not None:
                    valid = _valid_speech_tokens(new_speech, run.cfg.speech_bos_id)
                    if len(valid):
                        audio = stream.push(valid).reshape(-1).float().cpu()  # CPU ids: checked without a sync
                finished = run.all_done() or run.steps >= run.max_new_tokens
                if not finished:
                    yield SpeechStreamEvent(text_delta(False), new_text, new_speech, audio, sampling_rate, False)
                    run.decode()
                    continue
                tail = stream.finalize().reshape(-1).float().cpu() if stream is not None else empty_audio
                audio = torch.cat([audio, tail])
                yield SpeechStreamEvent(text_delta(True), new_text, new_speech, audio, sampling_rate, True)
                break
        finally:
            run.release()


_DEFAULTS = {
    "max_new_tokens": 512,
    "do_sample": True,
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 0,
    "repetition_penalty": 1.2,
    "text_greedy": True,
    "force_text_abos": True,
    "disable_speech": False,
    "eos_token_id": None,
    "pad_token_id": None,
    "generator": None,
    "seed": None,
    "compile": False,
    "compile_scope": "parts",
    "step_graph": None,
    "compile_prefill": None,
    "compile_attention": "auto",
    "fuse_crq_projections": None,
    "fold_crq_matching": None,
    "crq_linear": "auto",
    "llm_linear": "auto",
    "speech_sampler": "auto",
    "text_head": "auto",
    "cache_implementation": "static",
    "cache_max_length": None,
    "output_logits": False,
    "kernel_config": None,
}
_STREAM_KNOBS = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")


def _resolve_options(kwargs: dict) -> dict:
    """Merge user kwargs with the official S2S defaults and build the text/speech `SamplingSettings`."""
    known = set(_DEFAULTS) | {f"{p}_{n}" for p in ("text", "speech") for n in _STREAM_KNOBS}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"Unknown generate_speech arguments: {unknown}. Known: {sorted(known)}.")
    options = {name: kwargs.get(name, default) for name, default in _DEFAULTS.items()}

    def stream(prefix: str, base: dict) -> SamplingSettings:
        values = {name: kwargs.get(f"{prefix}_{name}", base[name]) for name in _STREAM_KNOBS}
        return SamplingSettings(**values)

    shared = {name: options[name] for name in _STREAM_KNOBS}
    # Speech uses the shared knobs (the reference applies the text processors to the CRQ logits).
    options["speech_settings"] = stream("speech", shared)
    if options["text_greedy"]:
        # text_greedy: plain argmax of the raw text logits, no processors (the reference bypasses them).
        text_base = dict(shared, do_sample=False, repetition_penalty=1.0)
    else:
        text_base = shared
    options["text_settings"] = stream("text", text_base)
    return options
