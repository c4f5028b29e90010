"""One `generate_speech` call's decode loop: prepare the run (plan, step configuration, workspace, step functions
from its `SpeechGenerator`), the prefill, the decode steps with a lagged "all rows done?" check, the result.

The loop reproduces the reference `_sample` (spec funaudiochat.md §6.3a) bit for bit at batch 1:

* the prefill runs the LLM over the prompt and the CRQ over `K * L0 - (K - 1)` sub-positions in one pass, with the
  speech-bos embedding as "previous speech token" (its 5 tokens are discarded unless the prompt ends in speech mode);
* the CRQ runs at *every* step, so its cache covers prompt + answer; the last sampled token's embedding is carried on;
* the first text token is forced to `<|audio_bos|>` (`force_text_abos`), which switches speech on from the next step;
* a group containing the speech EOS becomes K x EOS, the step's text token is overwritten by `<|audio_eos|>`, and
  speech stops; the text EOS ends the reply (checked before that overwrite); `<|audio_eos|>` is not a stop token.

Beyond the reference: per-row state for left-padded batches (each row decodes exactly as if alone).
"""

import functools

import torch

from .attention_funaudiochat import register_gqa_decode_attention
from .generation_audio_graph_funaudiochat import RecordedChunkEncoder
from .generation_config_funaudiochat import SpeechRequest
from .generation_output_funaudiochat import FunAudioChatSpeechOutput
from .generation_plan_funaudiochat import PROMPT_BUCKET, DecodePlan
from .generation_state_funaudiochat import SpeechGenerator
from .generation_step_funaudiochat import bucketed_prefill_forward, finish_part, prefill_forward
from .generation_workspace_funaudiochat import DecodeWorkspace, StepConfig
from .step_graph_funaudiochat import CapturedStep
from .triton_attention_funaudiochat import register_triton_decode_attention


def step_config(model, generator: SpeechGenerator, request: SpeechRequest, plan: DecodePlan) -> StepConfig:
    """The [`StepConfig`] of a run of `request` under `plan` on `generator`'s model: the sampling switches, the model's
    special ids, the plan, the registered decode attention and the kernel config."""
    text_config, audio_config = model.config.text_config, model.config.audio_config
    device = model.language_model.get_input_embeddings().weight.device
    # The decode attention is registered with transformers' attention interface and named in the step configuration,
    # which passes it down to the layers (the model's config is left as it is).
    attention = None
    if plan.attention == "gqa_matmul":
        attention = register_gqa_decode_attention()
    elif plan.attention == "triton":
        attention = register_triton_decode_attention()
    return StepConfig(
        text=request.text.switches,
        speech=request.speech.switches,
        disable_speech=request.disable_speech,
        group_size=audio_config.group_size,
        speech_bos_id=audio_config.bos_token_id,
        speech_eos_id=audio_config.eos_token_id,
        audio_bos_index=text_config.audio_bos_index,
        audio_eos_index=text_config.audio_eos_index,
        pad_token_id=request.pad_token_id,
        output_logits=request.output_logits,
        plan=plan,
        attention_implementation=attention,
        kernel_config=generator.kernel_config_for(device),
    )


class SpeechRun:
    """One call: validated request, plan, workspace and the step loop. The caller holds `generator` for the run."""

    def __init__(
        self,
        model,
        generator: SpeechGenerator,
        request: SpeechRequest,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        prompt_inputs: dict,
        backend: str | None,
        per_row_sampling: bool = False,
        rows_of: DecodeWorkspace | None = None,
    ):
        self.model, self.request = model, request
        device = model.language_model.get_input_embeddings().weight.device
        # A copy: never a view of the caller's tensor (a compiled prefill would otherwise guard on the view's base).
        input_ids = input_ids.to(device, dtype=torch.long, copy=True)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device)
        mask = mask.bool()
        if not mask[:, -1].all() or (mask[:, 1:].long() < mask[:, :-1].long()).any():
            raise ValueError(
                "generate_speech needs left-padded prompts (padding_side='left'): every row's tokens must end at the "
                "last column."
            )
        if not request.disable_speech and getattr(model, "audio_invert_tower", None) is None:
            raise ValueError("This model has no speech decoder (`audio_invert_tower`); pass `disable_speech=True`.")
        self.prompt_ids = input_ids  # the output sequences start with the prompt as given
        batch = input_ids.shape[0]
        plan = generator.plan(backend, batch, request.disable_speech, request.cache_implementation)
        self.cfg = step_config(model, generator, request, plan)
        # `plan.prefill_graph`: the prompt left-padded to a bucket boundary (masked columns, like a batch's padding)
        # and its pass recorded; None: the prompt pass runs as it is.
        self.bucket_padding = self._bucket_padding(model, generator, input_ids.shape[1], request.max_new_tokens)
        if self.bucket_padding:
            pad = torch.full((batch, self.bucket_padding), self.cfg.pad_token_id, dtype=torch.long, device=device)
            input_ids = torch.cat([pad, input_ids], dim=1)
            mask = torch.cat([torch.zeros_like(pad, dtype=torch.bool), mask], dim=1)
        self.input_ids, self.mask = input_ids, mask
        length = input_ids.shape[1]
        self.padding = length - mask.long().sum(-1)
        self.eos_ids = torch.tensor(request.eos_token_ids or (-1,), dtype=torch.long, device=device)
        self.speech_pad_id = model.config.audio_config.pad_token_id
        self.max_new_tokens = request.max_new_tokens
        needed = length + request.max_new_tokens
        cache_length = generator.cache_length(batch, needed, plan.static_cache)
        self.step_fn, self.prefill_crq_steps, self.prefill_halves = generator.step_functions(
            self.cfg, request.compile_options
        )
        # `per_row_sampling`: sampling values per row (a continuous batch of requests, `serving_batch_funaudiochat`);
        # `rows_of`: the run steps the first rows of that workspace (no prefill of its own: the rows are that one's).
        self.ws = generator.workspace(batch, cache_length, self.cfg, per_row_sampling, rows_of)
        self.prompt_inputs = prompt_inputs
        self.generator = _random_generator(request, device)
        self.steps = 0

    def _bucket_padding(self, model, generator: SpeechGenerator, length: int, max_new_tokens: int) -> int | None:
        """Columns of left padding that bring a prompt of `length` to a multiple of `PROMPT_BUCKET` when the plan
        records the prompt pass; None when it does not, or when the padded call would not fit the generator or the
        model's context, or a stack has sliding-window layers (whose masks `prompt_masks` does not build)."""
        plan = self.cfg.plan
        if not plan.prefill_graph or not plan.static_cache:
            return None
        extra = -length % PROMPT_BUCKET
        needed = length + extra + max_new_tokens
        tower = getattr(model, "audio_invert_tower", None)
        stacks = [model.language_model.model] + ([tower.crq_transformer] if tower is not None else [])
        fits = generator.holds(needed) and needed <= model.config.text_config.max_position_embeddings
        if not fits or any(getattr(stack, "has_sliding_layers", False) for stack in stacks):
            return None
        return extra

    def _draw_noise(self) -> None:
        ws = self.ws
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

    def prefill(self) -> DecodeWorkspace:
        model, cfg, ws, request = self.model, self.cfg, self.ws, self.request
        ws.reset(self.eos_ids, self.speech_pad_id, request.text, request.speech)
        length = self.input_ids.shape[1]
        k = cfg.group_size
        ws.llm_mask.fill_(True)
        ws.llm_mask[:, :length] = self.mask
        ws.crq_mask.fill_(True)
        ws.crq_mask[:, : length * k] = self.mask.repeat_interleave(k, dim=1)
        if not cfg.disable_speech:
            ws.prev_speech_token.fill_(cfg.speech_bos_id)
            ws.speaking.copy_(self.input_ids[:, -1] == cfg.audio_bos_index)
        if cfg.text.uses_history:
            # The text repetition penalty covers the prompt too (as the reference), but not the left padding.
            vocab = ws.text_seen.shape[1]
            prompt_ids = self.input_ids.masked_fill(~self.mask, vocab)
            seen = torch.zeros(ws.text_seen.shape[0], vocab + 1, dtype=torch.bool, device=ws.device)
            ws.text_seen.copy_(seen.scatter_(1, prompt_ids, True)[:, :vocab])
        # A workspace checked before has its caches: check now, before the audio encoder or the prompt pass may replay
        # a recording that reads a tensor replaced since (a weight's old memory may be freed). Its first call checks
        # after the pass, which allocates the caches (a static cache makes its tensors on first use).
        checked = cfg.plan.step_graph and ws.step_graphs.addresses is not None
        if checked:
            ws.check_graphs(model)
        # The audio encoder's layers recorded per chunk count with the prompt pass (host-bound when eager).
        chunk_encoder = RecordedChunkEncoder(model, ws, cfg) if cfg.plan.prefill_graph and cfg.plan.step_graph else None
        inputs_embeds = model.embed_prompt(self.input_ids, **self.prompt_inputs, chunk_encoder=chunk_encoder)
        inputs_embeds = inputs_embeds.to(ws.device, ws.dtype)
        self._draw_noise()
        if self.bucket_padding is not None:
            # The prompt pass over fixed buffers: recorded once per padded length, then one replay.
            buffers = ws.prompt_buffers_for(length, inputs_embeds.shape[-1])
            buffers.input_ids.copy_(self.input_ids)
            buffers.inputs_embeds.copy_(inputs_embeds)
            buffers.padding.copy_(self.padding)
            prompt_pass = functools.partial(bucketed_prefill_forward, length=length, halves=self.prefill_halves)
            if cfg.plan.step_graph:
                prompt_pass = CapturedStep(prompt_pass, ("prompt", length, cfg))
            prompt_pass(model, ws, cfg)
        else:
            prefill_forward(model, ws, cfg, self.input_ids, inputs_embeds, self.padding, self.prefill_halves)
        if cfg.plan.step_graph and not checked:
            ws.check_graphs(model)
        if not cfg.disable_speech:
            # The first group's other K - 1 CRQ sub-steps have a decode sub-step's shapes: they run as the decode
            # sub-step does (compiled / recorded in the fast backends; part of the time to first audio).
            self.prefill_crq_steps(model, ws, cfg)
        finish_part(model, ws, cfg, force_token=cfg.audio_bos_index if request.force_text_abos else None)
        self.steps = 1
        return ws

    def decode(self) -> None:
        self._draw_noise()
        self.step_fn(self.model, self.ws, self.cfg)
        self.steps += 1

    def all_done(self) -> bool:
        return bool(self.ws.done.all())

    def decode_until_done(self) -> None:
        """Decode steps until every row has finished or `max_new_tokens` is reached. Each "all rows finished" check
        is read after the next step has been launched ([`LaggedCheck`]), so at most one step runs after the last row
        finishes."""
        check = LaggedCheck(self.ws.done)
        check.issue(self.steps)  # after the prefill
        while self.steps < self.max_new_tokens:
            self.decode()
            if check.due(self.steps) and check.read():
                return
            check.issue(self.steps)

    def result(self) -> FunAudioChatSpeechOutput:
        ws, cfg = self.ws, self.cfg
        new_tokens = self.steps
        if self.all_done():
            new_tokens = int(ws.finish_step.max()) + 1
        sequences = torch.cat([self.prompt_ids, ws.text_out[:, :new_tokens]], dim=1).clone()
        groups = int(ws.groups.max())
        speech_ids = ws.speech_out[:, : cfg.group_size * groups].clone()
        output = FunAudioChatSpeechOutput(sequences=sequences, speech_ids=speech_ids)
        if cfg.output_logits:
            output.text_logits = ws.text_logits[:, :new_tokens].clone()
            if not cfg.disable_speech:
                output.speech_logits = ws.speech_logits[:, :new_tokens].clone()
        return output


def _random_generator(request: SpeechRequest, device: torch.device) -> torch.Generator:
    if request.generator is not None:
        return request.generator
    generator = torch.Generator(device=device)
    seed = request.seed
    if seed is None:
        # Follow the global RNG so `torch.manual_seed(...)` before the call makes it reproducible.
        seed = int(torch.randint(0, 2**62, (1,)).item())
    generator.manual_seed(seed)
    return generator


class LaggedCheck:
    """Whether every row has finished, read one step late so that the GPU never waits for the host.

    A blocking check (`bool(done.all())`) drains the GPU's queue: the GPU then idles while the host launches the next
    step. Here `issue` queues the check behind a step (a reduction and a copy to pinned memory, then an event), and
    `read`, called once the host has launched the next step, waits for that event only: the launched step keeps the
    GPU busy meanwhile. On a CPU the copy is synchronous and the event is not needed.
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


__all__ = ["LaggedCheck", "SpeechRun", "step_config"]
