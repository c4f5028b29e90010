"""The decode step of `generate_speech` and the prompt's forward: module-level functions of `(model, workspace,
step config)` that only read the model and mutate the workspace in place, so that `torch.compile` can capture them
and a CUDA graph can record them (no host syncs inside).

One step = `llm_part` + K x `crq_part` + `finish_part`; `decode_step` chains them. `CompiledParts` is the step with
the three parts compiled separately.
"""

import torch
from torch.nn import functional as F
from transformers import StaticCache

from .attention_prompt_funaudiochat import register_prompt_attention
from .compat import cache_kwargs
from .decoder_stack_funaudiochat import EAGER_HALVES, DecoderLayerHalves, decoder_stack_forward
from .fused_crq_funaudiochat import PaddedLinear
from .generation_stack_inputs_funaudiochat import DecodeStackInputs, decode_stack_inputs, prepares_stack_inputs
from .generation_workspace_funaudiochat import DecodeWorkspace, StepConfig
from .sampling_funaudiochat import mark_seen_, select_tokens
from .triton_finish_funaudiochat import finish_kernel_supported, launch_finish_rows
from .triton_linear_funaudiochat import decode_linear, use_decode_kernels
from .triton_llm_tail_funaudiochat import launch_llm_tail, llm_tail_kernel_supported
from .triton_sampling_funaudiochat import sample_tokens, sample_tokens_into, use_sampler_kernel


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
    attention_implementation=None,
    kernel_config=None,
    position_embeddings=None,
):
    """Last hidden state `(batch, n, hidden)` of a Qwen3 stack (the LLM's or the CRQ's) over `inputs_embeds` at
    `positions`, updating `cache`: its own forward, or `decoder_stack_forward` with fused `projections`, layer
    `halves` (the compiled prefill) and / or another `attention_implementation` (the decode attention).
    `final_norm=False` (with `projections` or `halves`): before the stack's final norm. `split_k_counters`,
    `kernel_config`, `position_embeddings` (prepared rotary tables): see `decoder_stack_forward`."""
    if projections is None and halves is None and attention_implementation is None:
        if not final_norm or position_embeddings is not None:
            raise ValueError(
                "`final_norm=False` and prepared `position_embeddings` need the stack run layer by layer "
                "(`projections`, `halves` or an `attention_implementation`)."
            )
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
        attention_implementation=attention_implementation,
        kernel_config=kernel_config,
        position_embeddings=position_embeddings,
    )


def _prompt_attention(cache) -> str | None:
    """The attention function of a prompt pass over `cache`: `prompt_attention` (the prompt's own columns only) for a
    static cache, whose other columns SDPA would compute masked; None (the model's own) for a dynamic one, which holds
    those columns only."""
    return register_prompt_attention() if isinstance(cache, StaticCache) else None


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
    ws: DecodeWorkspace,
    cfg: StepConfig,
    sub_inputs: torch.Tensor,
    positions: torch.Tensor,
    halves: DecoderLayerHalves | None = None,
    mask: dict | None = None,
    sub_step: int | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """CRQ sub-step `sub_step` (None: the workspace's counter `ws.sub_step`, see `crq_part`) over `sub_inputs`
    `(batch, n, hidden)` at rotary `positions` `(batch, n)`; with `fold_crq_matching`, `(batch, n, crq_hidden)`: the
    sub-positions through `input_matching` already.

    The embedding of the previous speech token is added to every input sub-position (n > 1 only for sub-step 0 of the
    prefill, as the reference does). The token is sampled from the last position, with the repetition penalty over
    the row's speech history plus the tokens already chosen in this group. `halves`: run the CRQ layer by layer
    with these layer halves (`decoder_stack_funaudiochat`; the compiled prefill) instead of its own forward. `mask`:
    prepared attention masks (`prompt_masks`, `decode_stack_inputs`) instead of the workspace's 2-D padding mask;
    `position_embeddings`: prepared rotary tables (`decode_stack_inputs`).
    """
    tower = model.audio_invert_tower
    crq = tower.crq_transformer
    k = ws.sub_step.view(1) if sub_step is None else None
    plan = cfg.plan
    kernels, config = plan.crq_head_linear, cfg.kernel_config
    folded = ws.folded if plan.fold_crq_matching else None
    writes_inputs = sub_step is not None and _sampler_writes_inputs(ws, cfg)
    if folded is None:
        previous = model.audio_tower.embed_tokens(ws.prev_speech_token).to(sub_inputs.device)
        inputs_embeds = _matching(tower.input_matching, sub_inputs + previous[:, None], kernels, kernel_config=config)
    elif writes_inputs and sub_step > 0:  # written by the previous sub-step's sampler kernel
        inputs_embeds = ws.next_crq_input
    else:  # input_matching is linear: its image of the previous token's embedding, gathered
        table = folded.speech_inputs  # on the CRQ's device (a dispatched model: maybe not the workspace's)
        previous = F.embedding(ws.prev_speech_token.to(table.device), table)
        inputs_embeds = sub_inputs.to(table.device) + previous[:, None]
    fused = ws.fused_crq if plan.fuse_crq_projections else None
    # With the kernels, the final norm is folded into output_matching's (one row: the batch-1 decode sub-step).
    fold_norm = kernels and use_decode_kernels(sub_inputs[:, -1])
    # With the kernels, decode sub-steps of 2 to 16 rows take the several-row kernel, counting in the workspace.
    counters = ws.split_k_counters if plan.crq_linear else None
    # Decode sub-steps take the plan's attention; the prefill's one pass the model's, over its own columns.
    attention = cfg.attention_implementation if positions.shape[1] == 1 else _prompt_attention(ws.crq_cache)
    hidden = _stack_forward(
        crq, inputs_embeds, ws.crq_mask if mask is None else mask, positions, ws.crq_cache, fused, halves,
        not fold_norm, counters, attention, config, position_embeddings,
    )  # fmt: skip
    norm = crq.norm if fold_norm else None
    if folded is None:
        features = _matching(tower.output_matching, hidden[:, -1], kernels, norm, kernel_config=config)
        logits = _matching(tower.lm_head, features, kernels, padded=ws.speech_head, kernel_config=config)
    else:  # lm_head ∘ output_matching as one linear
        logits = _matching(folded.head, hidden[:, -1], kernels, norm, kernel_config=config)
    logits = logits.to(ws.device)
    noise = None
    if cfg.speech.do_sample:
        noise = ws.speech_noise.index_select(1, k)[:, 0] if sub_step is None else ws.speech_noise[:, sub_step]
    seen = ws.group_seen if cfg.speech.uses_history else None
    kernel = plan.speech_sampler and use_sampler_kernel(logits)  # reads 16-bit logits as float32 itself: no cast
    if kernel and sub_step is not None:
        # The token into the next sub-step's input, the group and the history, and the next position, by the
        # sampler's own kernel (one launch instead of five in the CUDA-graphed step).
        next_input = None
        if writes_inputs and sub_step + 1 < cfg.group_size:  # the next sub-step's input too
            next_input = (ws.folded_sub_inputs[:, sub_step + 1], folded.speech_inputs, ws.next_crq_input[:, 0])
        sample_tokens_into(
            logits, cfg.speech, ws.speech_sampling, seen, noise, config, out=ws.prev_speech_token,
            group_column=ws.group[:, sub_step], positions=positions[:, -1], next_positions=ws.crq_position,
            next_input=next_input,
        )  # fmt: skip
    else:
        if kernel:
            token = sample_tokens(logits, cfg.speech, ws.speech_sampling, seen, noise, kernel_config=config)
        else:
            token = select_tokens(logits.float(), cfg.speech, seen, noise, ws.speech_sampling)
        if cfg.speech.uses_history:
            mark_seen_(ws.group_seen, token[:, None])
        # Embedded by the next sub-step: the CRQ's output matrix is tied to the speech embedding, so that is the
        # reference's `lm_head.weight[token]`.
        ws.prev_speech_token.copy_(token)
        torch.add(positions[:, -1], 1, out=ws.crq_position)  # one kernel (a decode sub-step's positions are these)
        if sub_step is None:
            ws.group.index_copy_(1, k, token[:, None])
        else:
            ws.group[:, sub_step] = token
    if cfg.output_logits:  # read only to return the logits
        if sub_step is None:
            ws.group_logits.index_copy_(1, k, logits.float()[:, None])
        else:
            ws.group_logits[:, sub_step] = logits.float()
    if sub_step is None:  # after the copies above: `k` is a view of the counter
        ws.sub_step.add_(1)


def _sampler_writes_inputs(ws: DecodeWorkspace, cfg: StepConfig) -> bool:
    """Whether the speech sampler's kernel writes each CRQ sub-step's input for the next one (`sample_tokens_into`'s
    `next_input`): the bookkeeping kernels and the sampler kernel over the folded matching, all in one dtype."""
    plan = cfg.plan
    if not (plan.bookkeeping_kernels and plan.speech_sampler and ws.folded is not None):
        return False
    table = ws.folded.speech_inputs
    same = table.device == ws.device and table.dtype == ws.folded_sub_inputs.dtype == ws.next_crq_input.dtype
    return same and use_sampler_kernel(ws.group_logits[:, 0])


def counted_sub_steps(cfg: StepConfig) -> bool:
    """Whether the CRQ sub-steps index the workspace by its counter tensor `ws.sub_step` (the compiled step: one
    graph serves the K sub-steps) rather than by Python ints (the eager loop, and the one CUDA graph of the whole
    "cuda_graphs" step, where a constant index is a view: no index kernels and no counter to keep)."""
    return cfg.plan.compile_step


def crq_part(
    model, ws: DecodeWorkspace, cfg: StepConfig, sub_step: int | None = None, prepared: DecodeStackInputs | None = None
) -> None:
    """CRQ sub-step `sub_step` of a decode step (None: the next one, `ws.sub_step`, counted in the workspace): one
    sub-position, `ws.sub_inputs[:, sub_step]` (or the folded ones). `prepared`: the step's stack inputs."""
    all_sub_inputs = ws.folded_sub_inputs if cfg.plan.fold_crq_matching else ws.sub_inputs
    if sub_step is None:
        sub_inputs = all_sub_inputs.index_select(1, ws.sub_step.view(1))
    else:
        sub_inputs = all_sub_inputs[:, sub_step : sub_step + 1]
    mask, tables = prepared.sub_step(sub_step) if prepared is not None else (None, None)
    _run_crq(model, ws, cfg, sub_inputs, ws.crq_position[:, None], mask=mask, sub_step=sub_step,
             position_embeddings=tables)  # fmt: skip


def _prepared(model, ws: DecodeWorkspace, cfg: StepConfig, first_sub_step: int, llm: bool) -> DecodeStackInputs | None:
    """The step's stack inputs where it prepares them (`prepares_stack_inputs`; Python-int sub-steps), else None."""
    if counted_sub_steps(cfg) or not prepares_stack_inputs(model, cfg):
        return None
    return decode_stack_inputs(model, ws, cfg, first_sub_step, llm)


def prefill_crq_steps(model, ws: DecodeWorkspace, cfg: StepConfig) -> None:
    """The prompt's first group's other K - 1 CRQ sub-steps (decode-shaped, after `prefill_forward`'s sub-step 0)."""
    prepared = _prepared(model, ws, cfg, 1, llm=False)
    for sub_step in range(1, cfg.group_size):
        crq_part(model, ws, cfg, None if counted_sub_steps(cfg) else sub_step, prepared)


def _start_group(
    model, ws: DecodeWorkspace, cfg: StepConfig, hidden: torch.Tensor, input_ids: torch.Tensor, conditioning=None
):
    """Speech-head inputs of the positions just fed: `pre_matching(h + embed(input ids))` split in K sub-positions.

    Returns all `(batch, L * K, hidden)` sub-positions and keeps the last K (those of the newest position) in
    `ws.sub_inputs`; with `fold_crq_matching`, `(batch, L * K, crq_hidden)`: through `input_matching` too, in
    `ws.folded_sub_inputs`. The text embedding is the raw embedding of the input ids (`<|AUDIO|>` included).
    `conditioning`: `h + embed(input ids)` `(batch, L, hidden)` computed already (`launch_llm_tail`).
    """
    if conditioning is None:
        conditioning = hidden + model.language_model.get_input_embeddings()(input_ids).to(ws.device)
    if cfg.plan.fold_crq_matching:
        batch, length, _ = conditioning.shape
        weight = ws.folded.sub_inputs.weight
        sub_positions = _matching(
            ws.folded.sub_inputs, conditioning.to(weight.device), cfg.plan.crq_head_linear, kernel_config=cfg.kernel_config
        )
        sub_positions = sub_positions.reshape(batch, length * cfg.group_size, -1)
        ws.folded_sub_inputs.copy_(sub_positions[:, -cfg.group_size :])
    else:
        sub_positions = model.audio_invert_tower.split_positions(conditioning)
        ws.sub_inputs.copy_(sub_positions[:, -cfg.group_size :])
    if counted_sub_steps(cfg):
        ws.sub_step.zero_()
    ws.group_seen.copy_(ws.speech_seen)
    return sub_positions


def llm_part(model, ws: DecodeWorkspace, cfg: StepConfig, prepared: DecodeStackInputs | None = None) -> None:
    """LLM forward of the fed embeddings -> text logits and the speech-head inputs of the new position.
    `prepared`: the step's stack inputs (its `llm` mask and tables)."""
    language_model = model.language_model
    positions = ws.llm_position[:, None]
    stack = language_model.model
    mask, tables = prepared.llm if prepared is not None else (ws.llm_mask, None)
    # With the kernels, decode steps of 2 to 16 rows take the several-row kernel, counting in the workspace.
    counters = ws.split_k_counters if cfg.plan.llm_linear else None
    tail_table = _llm_tail_table(model, ws, cfg)  # set: the final norm, the head's input and conditioning in one kernel
    hidden = _stack_forward(
        stack, ws.next_embeds, mask, positions, ws.llm_cache, ws.llm_kernels, None, tail_table is None, counters,
        cfg.attention_implementation, cfg.kernel_config, tables,
    )  # fmt: skip
    conditioning = None
    if tail_table is not None:  # the text head's input into its buffer, the conditioning, the position advanced
        conditioning = launch_llm_tail(hidden[:, -1], stack.norm, tail_table, ws.next_ids, ws.text_head_input,
                                       ws.llm_position)[:, None]  # fmt: skip
        head_input = ws.text_head_input
    else:
        hidden = hidden.to(ws.device)
        ws.llm_position.add_(1)
        head_input = hidden[:, -1]
        if cfg.plan.overlap_text_head:
            ws.text_head_input.copy_(head_input)
    if not cfg.plan.overlap_text_head:  # else the head runs after this part, beside the CRQ sub-steps
        ws.text_logits_step.copy_(language_model.lm_head(head_input).float())
    if not cfg.disable_speech:
        _start_group(model, ws, cfg, hidden, ws.next_ids[:, None], conditioning)


def _bookkeeping_text_table(model, ws: DecodeWorkspace, cfg: StepConfig) -> torch.Tensor | None:
    """The text embedding's weight for the bookkeeping kernels (`launch_llm_tail`, `launch_finish_rows`), or None
    where they do not run: plan part `bookkeeping_kernels`, speech on, a plain embedding (its weight is what it
    computes) on the workspace's device."""
    if not cfg.plan.bookkeeping_kernels or cfg.disable_speech:
        return None
    embedding = model.language_model.get_input_embeddings()
    plain = type(embedding) is torch.nn.Embedding and embedding.max_norm is None
    return embedding.weight if plain and embedding.weight.device == ws.device else None


def _llm_tail_table(model, ws: DecodeWorkspace, cfg: StepConfig) -> torch.Tensor | None:
    """The text table for `launch_llm_tail` where the step between the LLM stack and the speech head runs as that one
    kernel (the bookkeeping kernels' text table, the stack run layer by layer with its final norm left to the kernel,
    a norm the kernel reads), else None."""
    table = _bookkeeping_text_table(model, ws, cfg)
    layered = ws.llm_kernels is not None or cfg.attention_implementation is not None
    if table is None or not layered:
        return None
    return table if llm_tail_kernel_supported(ws.text_head_input, model.language_model.model.norm, table) else None


def finish_part(model, ws: DecodeWorkspace, cfg: StepConfig, force_token: int | None = None) -> None:
    """Choose the text token, do the per-row speech/stop bookkeeping and build the next LLM input (all in place)."""
    k = cfg.group_size
    text_logits = ws.text_logits_step
    noise = ws.text_noise if cfg.text.do_sample else None
    seen = ws.text_seen if cfg.text.uses_history else None
    token = select_tokens(text_logits, cfg.text, seen, noise, ws.text_sampling)
    if force_token is not None:
        token = torch.full_like(token, force_token)
    if cfg.output_logits:
        step = ws.step.view(1)
        ws.text_logits.index_copy_(1, step, text_logits[:, None])
        if not cfg.disable_speech:
            ws.speech_logits.index_copy_(1, step, ws.group_logits[:, None])
    table = _bookkeeping_text_table(model, ws, cfg)
    if table is not None and ws.folded is not None and finish_kernel_supported(table, ws.folded.feedback):
        # The rest in one kernel (the step counter after it).
        launch_finish_rows(
            token, ws, table, ws.folded.feedback, pad_token_id=cfg.pad_token_id,
            speech_eos_id=cfg.speech_eos_id, audio_eos_index=cfg.audio_eos_index, audio_bos_index=cfg.audio_bos_index,
            speech_history=cfg.speech.uses_history, text_history=cfg.text.uses_history,
        )  # fmt: skip
        ws.step.add_(1)
        return
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
        # In place through `out=` (same elements only): each state update is one kernel, not a result and a copy.
        torch.where(speaking[:, None], group, ws.last_group, out=ws.last_group)
        ws.groups.add_(speaking)
        if cfg.speech.uses_history:
            mark_seen_(ws.speech_seen, group, speaking)
        speaking = torch.bitwise_or(speaking & ~finish, token == cfg.audio_bos_index, out=ws.speaking)

    ws.text_out.index_copy_(1, ws.step.view(1), token[:, None])
    # Not `masked_fill_(stop, ws.step)`: a tensor fill value is read on the host (a sync; it breaks a CUDA graph).
    torch.where(stop, ws.step, ws.finish_step, out=ws.finish_step)
    done.bitwise_or_(stop)
    if cfg.text.uses_history:
        mark_seen_(ws.text_seen, token[:, None])

    # Next LLM input: the text embedding, averaged with the last speech group's encoding while speaking.
    embeds = model.language_model.get_input_embeddings()(token[:, None]).to(ws.device)
    if speaking is not None:
        if cfg.plan.fold_crq_matching:  # the mean of the group's rows of the folded table (`FoldedCRQMatching`)
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


def start_text_head(model, ws: DecodeWorkspace, cfg: StepConfig) -> None:
    """With `overlap_text_head`: the text logits of the LLM part's hidden state, on the head's own stream (outside
    any compiled part: it only enqueues)."""
    if cfg.plan.overlap_text_head:
        ws.text_head.start(ws.text_head_input, model.language_model.lm_head, ws.text_logits_step, cfg.kernel_config)


def join_text_head(ws: DecodeWorkspace, cfg: StepConfig) -> None:
    """With `overlap_text_head`: the current stream waits for the text logits (before the token is chosen)."""
    if cfg.plan.overlap_text_head:
        ws.text_head.join()


def decode_step(model, ws: DecodeWorkspace, cfg: StepConfig) -> None:
    """One LLM step (+ K CRQ sub-steps) of every row; only mutates `ws`. Free of host syncs and of allocations that
    outlive it: the "cuda_graphs" backend records it as one CUDA graph as it is."""
    prepared = _prepared(model, ws, cfg, 0, llm=True)
    llm_part(model, ws, cfg, prepared)
    start_text_head(model, ws, cfg)
    if not cfg.disable_speech:
        for sub_step in range(cfg.group_size):
            crq_part(model, ws, cfg, None if counted_sub_steps(cfg) else sub_step, prepared)
    join_text_head(ws, cfg)
    finish_part(model, ws, cfg)


def prefill_forward(
    model,
    ws: DecodeWorkspace,
    cfg: StepConfig,
    input_ids,
    inputs_embeds,
    padding,
    halves: DecoderLayerHalves | None = None,
    masks: tuple[dict, dict | None] | None = None,
) -> None:
    """The prompt's variable-length forward: the LLM over its `L` positions and the CRQ over the first
    `K * L - (K - 1)` sub-positions, each in one pass.

    `halves` (`plan.compile_prefill`: the compiled `EAGER_HALVES` of `decoder_stack_funaudiochat`;
    `plan.prompt_kernels`: `PROMPT_KERNEL_HALVES` of `triton_prompt_funaudiochat`) runs both stacks layer by layer
    through them; None runs the models' own forwards. `masks`: the LLM's and the CRQ's prepared attention masks
    (`prompt_masks`), else the workspace's 2-D padding masks (the models build theirs).
    """
    length = input_ids.shape[1]
    k = cfg.group_size
    language_model = model.language_model
    positions = (torch.arange(length, device=ws.device)[None, :] - padding[:, None]).clamp(min=0)
    llm_mask = ws.llm_mask if masks is None else masks[0]
    hidden = _stack_forward(
        language_model.model, inputs_embeds, llm_mask, positions, ws.llm_cache, halves=halves,
        attention_implementation=_prompt_attention(ws.llm_cache),
    )  # fmt: skip
    hidden = hidden.to(ws.device)
    ws.llm_position.copy_(length - padding)
    ws.text_logits_step.copy_(language_model.lm_head(hidden[:, -1]).float())
    if not cfg.disable_speech:
        sub_positions = _start_group(model, ws, cfg, hidden, input_ids)
        first = length * k - (k - 1)
        crq_positions = (torch.arange(first, device=ws.device)[None, :] - k * padding[:, None]).clamp(min=0)
        crq_mask = None if masks is None else masks[1]
        sub_step = None if counted_sub_steps(cfg) else 0
        _run_crq(model, ws, cfg, sub_positions[:, :first], crq_positions, halves, crq_mask, sub_step)


def _prompt_mask(key_mask: torch.Tensor, queries: int) -> dict:
    """`{"full_attention": (batch, 1, queries, kv) bool}` (True = attend) of a stack's prompt pass from cache column
    0: query i reads the unpadded keys j <= i, and itself, so that a padding query attends to something (a row of
    nothing would give NaN, which its cache entries would carry into later reads)."""
    columns = torch.arange(key_mask.shape[1], device=key_mask.device)
    rows = torch.arange(queries, device=key_mask.device)
    causal = columns[None, :] <= rows[:, None]
    allowed = (causal[None] & key_mask[:, None, :]) | (columns[None, :] == rows[:, None])[None]
    return {"full_attention": allowed[:, None]}


def prompt_masks(ws: DecodeWorkspace, cfg: StepConfig, length: int) -> tuple[dict, dict | None]:
    """The LLM's and the CRQ's attention masks of the prompt pass of `length` positions (from the workspace's padding
    masks, set by the run): prepared here, without the host synchronisation with which the models check whether a
    mask can be skipped, so that the pass can be recorded as a CUDA graph. Both stacks use full attention only. Each
    covers the prompt's own cache columns, those its attention reads (`attention_prompt_funaudiochat`)."""
    llm = _prompt_mask(ws.llm_mask[:, :length], length)
    if cfg.disable_speech:
        return llm, None
    sub_positions = length * cfg.group_size - (cfg.group_size - 1)
    return llm, _prompt_mask(ws.crq_mask[:, :sub_positions], sub_positions)


def bucketed_prefill_forward(
    model, ws: DecodeWorkspace, cfg: StepConfig, length: int, halves: DecoderLayerHalves | None = None
) -> None:
    """`prefill_forward` of a bucket-padded prompt held in the workspace's fixed buffers for `length`
    (`ws.prompt_buffers`), with prepared masks: only fixed-address tensors, so it is recorded as a CUDA graph.
    `halves`: as in `prefill_forward` (the plan's `prompt_kernels`)."""
    buffers = ws.prompt_buffers[length]
    masks = prompt_masks(ws, cfg, length)
    prefill_forward(model, ws, cfg, buffers.input_ids, buffers.inputs_embeds, buffers.padding, halves, masks)



# Each distinct set of sampling switches, batch size, cache length or plan is a graph of its own (Python constants of
# the step), and with `fullgraph=True` dynamo's default limit of 8 graphs per function is a hard error: a long-running
# process that varies them would fail on the 9th. The compiled calls run under this higher limit (never lower than
# the user's), scoped to them: nothing changes dynamo's settings at import.
RECOMPILE_LIMIT = 64


def recompile_limit():
    """A context in which dynamo allows `RECOMPILE_LIMIT` graphs per function (for the compiled parts' calls)."""
    config = torch._dynamo.config
    return config.patch(recompile_limit=max(config.recompile_limit, RECOMPILE_LIMIT))


class CompiledParts:
    """`decode_step` with its three parts compiled separately by `torch.compile` (the CRQ sub-step's graph serves
    the K sub-steps). The compiled functions belong to the `SpeechGenerator` that made this object."""

    def __init__(self, options: dict):
        self.llm_part = torch.compile(llm_part, **options)
        self.crq_part = torch.compile(crq_part, **options)
        self.finish_part = torch.compile(finish_part, **options)

    def __call__(self, model, ws: DecodeWorkspace, cfg: StepConfig) -> None:
        with recompile_limit():
            self.llm_part(model, ws, cfg)
            start_text_head(model, ws, cfg)  # outside the compiled parts: the head overlaps the CRQ sub-steps
            if not cfg.disable_speech:
                for _ in range(cfg.group_size):
                    self.crq_part(model, ws, cfg)
            join_text_head(ws, cfg)
            self.finish_part(model, ws, cfg)

    def prefill_crq_steps(self, model, ws: DecodeWorkspace, cfg: StepConfig) -> None:
        """`prefill_crq_steps` through the compiled sub-step."""
        with recompile_limit():
            for _ in range(1, cfg.group_size):
                self.crq_part(model, ws, cfg)


__all__ = [
    "RECOMPILE_LIMIT",
    "CompiledParts",
    "bucketed_prefill_forward",
    "counted_sub_steps",
    "crq_part",
    "decode_step",
    "finish_part",
    "llm_part",
    "prefill_crq_steps",
    "prefill_forward",
    "prompt_masks",
    "recompile_limit",
]
