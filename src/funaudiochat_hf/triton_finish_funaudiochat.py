"""The decode step's bookkeeping after the text token is chosen, as one Triton kernel (plan part
`bookkeeping_kernels`).

`generation_step_funaudiochat.finish_part` does, per row: the stop test against the end ids, the speech group's end
test, the group's write into the speech output, the speaking / done / group-count / history updates, the text output,
and the next LLM input (the text embedding, averaged with the group's fed-back encoding while speaking). As PyTorch
ops that is about forty small kernels; a CUDA-graphed step (the "cuda_graphs" backend, no Inductor to fuse them)
launches each one by one, a few microseconds apiece on the step's critical path. Here one program per row does it all.

The values equal `finish_part`'s: integer logic exactly, and the next input rounded as PyTorch rounds it (the K fed-back
rows summed in float32 and divided by K, rounded to the weights' dtype, added to the text embedding and rounded,
halved and rounded; the sum's order is the kernel's own, so the mean may round one unit apart). It needs the folded
feedback table (`fold_crq_matching`: the fed-back encoding of a group is the mean of K gathered rows) and leaves the
step counter's increment and the optional logits copies to the caller.
"""

import torch

from .triton_support import kernels_run_on, triton


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _finish_rows_kernel(
        token_ptr, done_ptr, speaking_ptr, group_ptr, groups_ptr, last_group_ptr, speech_out_ptr, speech_seen_ptr,
        text_seen_ptr, text_out_ptr, finish_step_ptr, next_ids_ptr, step_ptr, eos_ptr, n_eos,
        text_table_ptr, feedback_table_ptr, next_embeds_ptr,
        stride_group, stride_last_group, stride_speech_out, stride_speech_seen, stride_text_seen, stride_text_out,
        stride_text_table, stride_feedback_table, stride_next_embeds,
        pad_token_id, speech_eos_id, audio_eos_index, audio_bos_index, trash_column, hidden,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_EOS: tl.constexpr, BLOCK_H: tl.constexpr,
        SPEECH_HISTORY: tl.constexpr, TEXT_HISTORY: tl.constexpr,
    ):  # fmt: skip
        """Row `program_id(0)` of `finish_part` (see the module docstring); every pointer is to its tensor's row 0.
        The row's state is read before anything is written (a barrier between), so that no thread of the program
        reads what another already overwrote."""
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK_K)
        in_group = offsets < K
        eos_index = tl.arange(0, BLOCK_EOS)
        step = tl.load(step_ptr)
        done = tl.load(done_ptr + row) != 0
        chosen = tl.load(token_ptr + row)
        speaking = tl.load(speaking_ptr + row) != 0
        group = tl.load(group_ptr + row * stride_group + offsets, mask=in_group, other=0)
        groups = tl.load(groups_ptr + row)
        last_group = tl.load(last_group_ptr + row * stride_last_group + offsets, mask=in_group, other=0)
        finish_step = tl.load(finish_step_ptr + row)
        eos = tl.load(eos_ptr + eos_index, mask=eos_index < n_eos, other=-1)
        tl.debug_barrier()

        token = tl.where(done, pad_token_id, chosen)
        # Stopping is decided on the chosen token, before the speech-EOS overwrite (as the reference).
        stop = (tl.sum(((token == eos) & (eos_index < n_eos)).to(tl.int32), 0) > 0) & (done == 0)
        speaking = speaking & (done == 0)
        finish = speaking & (tl.sum(((group == speech_eos_id) & in_group).to(tl.int32), 0) > 0)
        group = tl.where(finish, speech_eos_id, group)
        token = tl.where(finish, audio_eos_index, token)
        slots = tl.where(speaking, groups * K, trash_column) + offsets
        tl.store(speech_out_ptr + row * stride_speech_out + slots, group, mask=in_group)
        last_group = tl.where(speaking, group, last_group)
        tl.store(last_group_ptr + row * stride_last_group + offsets, last_group, mask=in_group)
        groups += speaking.to(tl.int64)
        tl.store(groups_ptr + row, groups)
        if SPEECH_HISTORY:
            tl.store(speech_seen_ptr + row * stride_speech_seen + group, 1, mask=in_group & speaking)
        speaking = (speaking & (finish == 0)) | (token == audio_bos_index)
        tl.store(speaking_ptr + row, speaking.to(tl.int8))
        tl.store(text_out_ptr + row * stride_text_out + step, token)
        tl.store(finish_step_ptr + row, tl.where(stop, step, finish_step))
        tl.store(done_ptr + row, (done | stop).to(tl.int8))
        if TEXT_HISTORY:
            tl.store(text_seen_ptr + row * stride_text_seen + token, 1)
        tl.store(next_ids_ptr + row, token)

        # Next LLM input: the text embedding, averaged with the group's fed-back encoding while speaking (the K rows
        # of the new last group, gathered by the ids held in registers).
        use_feedback = speaking & (groups > 0)
        feedback_rows = feedback_table_ptr + last_group[:, None] * stride_feedback_table
        for start in range(0, hidden, BLOCK_H):
            columns = start + tl.arange(0, BLOCK_H)
            in_hidden = columns < hidden
            embeds = tl.load(text_table_ptr + token * stride_text_table + columns, mask=in_hidden, other=0.0)
            out_type = embeds.dtype
            if use_feedback:
                tile = tl.load(feedback_rows + columns[None, :], mask=in_group[:, None] & in_hidden[None, :], other=0.0)
                feedback = (tl.sum(tile.to(tl.float32), 0) / K).to(out_type)
                mixed = (embeds.to(tl.float32) + feedback.to(tl.float32)).to(out_type)
                embeds = (mixed.to(tl.float32) / 2).to(out_type)
            tl.store(next_embeds_ptr + row * stride_next_embeds + columns, embeds, mask=in_hidden)


def finish_kernel_supported(text_table: torch.Tensor, feedback_table: torch.Tensor) -> bool:
    """Whether the kernel can read the embedding tables: on a GPU it runs on (`kernels_run_on`), both on one device,
    rows contiguous and of one width and dtype (the next input is written in it)."""
    return (
        kernels_run_on(text_table)
        and text_table.device == feedback_table.device
        and text_table.dtype == feedback_table.dtype
        and text_table.shape[-1] == feedback_table.shape[-1]
        and text_table.stride(-1) == 1
        and feedback_table.stride(-1) == 1
    )


def launch_finish_rows(
    token: torch.Tensor,
    ws,
    text_table: torch.Tensor,
    feedback_table: torch.Tensor,
    *,
    pad_token_id: int,
    speech_eos_id: int,
    audio_eos_index: int,
    audio_bos_index: int,
    speech_history: bool,
    text_history: bool,
) -> None:
    """`finish_part`'s bookkeeping of every row of the `DecodeWorkspace` `ws` for the chosen text `token` `(batch,)`
    int64 (before the padding of done rows), in place; everything but `ws.step.add_(1)` and the logits copies.
    `text_table`: the text embedding `(vocab, hidden)`; `feedback_table`: the folded feedback rows `(codebook,
    hidden)` (`FoldedCRQMatching.feedback`)."""
    batch, k = ws.group.shape
    hidden = text_table.shape[-1]
    bool_as_int8 = [t.view(torch.int8) for t in (ws.done, ws.speaking, ws.speech_seen, ws.text_seen)]
    done, speaking, speech_seen, text_seen = bool_as_int8
    token = token.contiguous()
    next_embeds = ws.next_embeds.view(batch, hidden)
    _finish_rows_kernel[(batch,)](
        token, done, speaking, ws.group, ws.groups, ws.last_group, ws.speech_out, speech_seen, text_seen,
        ws.text_out, ws.finish_step, ws.next_ids, ws.step, ws.eos_ids, ws.eos_ids.numel(),
        text_table, feedback_table, next_embeds,
        ws.group.stride(0), ws.last_group.stride(0), ws.speech_out.stride(0), speech_seen.stride(0),
        text_seen.stride(0), ws.text_out.stride(0), text_table.stride(0), feedback_table.stride(0),
        next_embeds.stride(0),
        pad_token_id, speech_eos_id, audio_eos_index, audio_bos_index, ws.speech_out.shape[1] - k, hidden,
        K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_EOS=triton.next_power_of_2(max(ws.eos_ids.numel(), 1)),
        BLOCK_H=min(512, triton.next_power_of_2(hidden)), SPEECH_HISTORY=speech_history, TEXT_HISTORY=text_history,
        num_warps=4,
    )  # fmt: skip


__all__ = ["finish_kernel_supported", "launch_finish_rows"]
