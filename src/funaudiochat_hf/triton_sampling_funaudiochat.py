"""The speech token sampler of a decode step as one Triton kernel (plan part `speech_sampler`).

Every CRQ sub-step picks one speech token from `(batch, 6565)` logits with the official S2S settings: repetition
penalty over the speech history, temperature, top-p, then a draw. As PyTorch ops (`sampling_funaudiochat.select_tokens`)
that is a radix sort of each row (several cub kernels: a row of 6,565 is past Inductor's in-register sort), a
cumulative sum, a scatter back and two softmaxes. Here each row is one program that holds the whole row in registers
and does it all without sorting (`tl.sort` of the scores alone was slower than the whole kernel), then writes the
chosen id.

Top-p without a sort, as a race that goes on: the tokens `TopPLogitsWarper` removes are the longest prefix of the
ascending order (tied scores by id, the order of PyTorch's CUDA sort of such a row, a stable radix sort) whose
cumulative probability is at most `1 - top_p`, never the most likely token. The kernel runs the exponential race over
every token; where top-p removes the winner (the probability up to it in that order, one masked sum, is at most `1 -
top_p`), every token before it goes too, and the race goes on among the others. Top-p removes at most `1 - top_p` of
the probability, so the first winner stays with probability `top_p` or more: two reductions per pass, ~1.1 passes at
the official `top_p=0.9` (measured faster than finding the boundary key bit by bit).

The result is that of `select_tokens` up to float rounding (sums in another order, the GPU's `exp`, the race's
probabilities normalised over every token rather than the kept ones: the same winner but where two draws tie within a
rounding): penalty `where(seen, where(s < 0, s * p, s / p), s)` and `s / temperature` in float32 as transformers, then
the exponential race of `select_tokens` (`argmax(p / E)`, the caller's Exp(1) noise), or the first argmax when
greedy. Top-k is not done here (`sample_tokens` leaves it to `select_tokens`; the official settings do not use it).

The launcher is an opaque PyTorch operator (`torch.library.custom_op`) that `torch.compile` keeps in its graph and CUDA
graphs replay; its warps and launch kind come from a [`DecodeKernelConfig`] (its `launch` argument), on sm_90+ a
programmatic dependent launch like the other decode kernels.
"""

from typing import NamedTuple

import torch

from .sampling_funaudiochat import SamplingParameters, SamplingSwitches, select_tokens
from .triton_support import triton
from .triton_config_funaudiochat import DecodeKernelConfig


# The largest vocabulary a program holds in registers (a row of scores, their keys and probabilities): the speech
# codebook (6,565) fits; the text vocabulary (151,936) keeps the PyTorch sampler.
MAX_VOCAB = 16384


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _ordered_key(scores):
        """uint32 keys ordered as the float32 `scores` (negative floats: all bits flipped; others: the sign bit)."""
        bits = scores.to(tl.uint32, bitcast=True)
        return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)

    @triton.jit
    def _first_max_with_key(race_a, index_a, key_a, race_b, index_b, key_b):
        """`tl.reduce` combine of `(race, index, key)`: the larger race, the smaller index among equal ones (the first
        argmax), with its key."""
        take_b = (race_b > race_a) | ((race_b == race_a) & (index_b < index_a))
        return tl.where(take_b, race_b, race_a), tl.where(take_b, index_b, index_a), tl.where(take_b, key_b, key_a)

    @triton.jit
    def _nucleus_race_winner(scores, top, probs, race, index, in_vocab, top_p_ptr, VOCAB: tl.constexpr):
        """The token of the exponential `race` among those top-p keeps: the race's winner among the tokens not yet
        known to be removed; if top-p removes it, so it does every token before it in the ascending order (ties by
        id, as PyTorch's CUDA sort orders them): they are dropped and the race goes on. The winner is kept where the
        probability up to it in that order is above `1 - top_p`, or where it is the last token of the order (the most
        likely, never removed). As top-p removes at most `1 - top_p` of the probability, the first winner is kept with
        probability `top_p` or more: a few passes, not a search over every key."""
        removed_mass = (1.0 - tl.load(top_p_ptr)).to(tl.float32)
        key = _ordered_key(scores)
        last = tl.max(tl.where(in_vocab & (scores == top), index, -1), 0)  # the last token of the ascending order
        alive = in_vocab
        token = tl.full([], -1, tl.int32)
        passes = tl.zeros([], tl.int32)
        while (token < 0) & (passes < VOCAB):  # bounded: each pass drops its winner (NaN scores cannot loop forever)
            _, winner, winner_key = tl.reduce((tl.where(alive, race, -1.0), index, key), 0, _first_max_with_key)
            up_to = (key < winner_key) | ((key == winner_key) & (index <= winner))
            cumulative = tl.sum(tl.where(up_to, probs, 0.0), 0)
            token = tl.where((cumulative > removed_mass) | (winner == last), winner, -1)
            alive = alive & ~up_to
            passes += 1
        # No pass kept a token only where the row holds NaN (no last token either): an id in range, not -1.
        return tl.where(token < 0, tl.argmax(race, 0), token)

    @triton.jit
    def _sample_kernel(
        scores_ptr, seen_ptr, noise_ptr, temperature_ptr, top_p_ptr, penalty_ptr, out_ptr,
        stride_scores, stride_seen, stride_noise, stride_parameters,
        group_ptr, stride_group, position_ptr, stride_position, next_position_ptr,
        input_ptr, stride_input, table_ptr, stride_table, next_input_ptr, stride_next_input, input_size,
        VOCAB: tl.constexpr, BLOCK_V: tl.constexpr, DO_SAMPLE: tl.constexpr,
        USES_HISTORY: tl.constexpr, USES_TOP_P: tl.constexpr, PDL: tl.constexpr, WRITE_STATE: tl.constexpr,
        WRITE_INPUT: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """The token of row `program_id(0)`: scores `(rows, VOCAB)` float, seen `(rows, VOCAB)` bool, noise `(rows,
        VOCAB)` float32 Exp(1); temperature, top-p and penalty (float64), 0-d (`stride_parameters` 0) or one per row;
        out `(rows,)` int64. Positions past the vocabulary hold -inf scores and no probability.

        `WRITE_STATE` (a decode sub-step's state, `sample_tokens_into`): the token also goes to `group_ptr` (a
        column of the group, `stride_group` between rows) and into the history (`seen`, with `USES_HISTORY`), and
        `next_position_ptr[row] = position_ptr[row * stride_position] + 1`. `WRITE_INPUT` (with it): the next
        sub-step's input row `next_input = input + table[token]` (`input_size` columns, in the input's dtype, rounded
        as PyTorch rounds the add)."""
        if PDL:  # the scores are the previous kernel's output
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        index = tl.arange(0, BLOCK_V)
        in_vocab = index < VOCAB
        scores = tl.load(scores_ptr + row * stride_scores + index, mask=in_vocab, other=float("-inf"))
        scores = scores.to(tl.float32)
        if USES_HISTORY:
            seen = tl.load(seen_ptr + row * stride_seen + index, mask=in_vocab, other=0) != 0
            penalty = tl.load(penalty_ptr + row * stride_parameters).to(tl.float32)
            scores = tl.where(seen, tl.where(scores < 0, scores * penalty, scores / penalty), scores)
        if DO_SAMPLE:
            scores = scores / tl.load(temperature_ptr + row * stride_parameters).to(tl.float32)
            top = tl.max(scores, 0)
            exps = tl.exp(scores - top)
            probs = exps / tl.sum(exps, 0)
            noise = tl.load(noise_ptr + row * stride_noise + index, mask=in_vocab, other=1.0)
            race = tl.where(in_vocab, probs / noise, -1.0)  # the exponential race of `select_tokens`
            if USES_TOP_P:
                token = _nucleus_race_winner(
                    scores, top, probs, race, index, in_vocab, top_p_ptr + row * stride_parameters, VOCAB
                )
            else:
                token = tl.argmax(race, 0)
        else:
            token = tl.argmax(scores, 0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        token = token.to(tl.int64)
        tl.store(out_ptr + row, token)
        if WRITE_STATE:
            tl.debug_barrier()  # every thread has read its part of the history before one marks it
            tl.store(group_ptr + row * stride_group, token)
            if USES_HISTORY:
                tl.store(seen_ptr + row * stride_seen + token, 1)
            tl.store(next_position_ptr + row, tl.load(position_ptr + row * stride_position) + 1)
            if WRITE_INPUT:
                for start in range(0, input_size, BLOCK_C):
                    columns = start + tl.arange(0, BLOCK_C)
                    inside = columns < input_size
                    sub_input = tl.load(input_ptr + row * stride_input + columns, mask=inside, other=0.0)
                    embedding = tl.load(table_ptr + token * stride_table + columns, mask=inside, other=0.0)
                    summed = (sub_input.to(tl.float32) + embedding.to(tl.float32)).to(sub_input.dtype)
                    tl.store(next_input_ptr + row * stride_next_input + columns, summed, mask=inside)


def sampler_kernel_supported(vocab_size: int) -> bool:
    """Whether rows of `vocab_size` scores fit one program of the kernel (`MAX_VOCAB`)."""
    return triton is not None and 1 <= vocab_size <= MAX_VOCAB


def use_sampler_kernel(scores: torch.Tensor) -> bool:
    """Whether `(batch, vocab)` scores take the kernel: CUDA scores whose rows fit a program (shape and device only,
    a constant of a compiled graph; the run checked the GPU with `triton_available`)."""
    return scores.is_cuda and sampler_kernel_supported(scores.shape[-1])


def sampler_launch(config: DecodeKernelConfig) -> list[int]:
    """The sampler's `launch` argument: `[num_warps, programmatic]` of `config`."""
    return [config.sampler_num_warps, int(config.programmatic_launch)]


def launch_sample_tokens(
    scores: torch.Tensor,
    seen: torch.Tensor | None,
    noise: torch.Tensor | None,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    repetition_penalty: torch.Tensor,
    do_sample: bool,
    uses_history: bool,
    uses_top_p: bool,
    launch: list[int],
) -> torch.Tensor:
    """`(rows, vocab)` scores -> `(rows,)` int64 token ids; the body of the `funaudiochat::sample_tokens` operator.

    seen: `(rows, vocab)` bool history (read with `uses_history`); noise: `(rows, vocab)` float32 Exp(1) samples (read
    with `do_sample`); the settings as the tensors of a `SamplingParameters` (0-d, or `(rows, 1)`: one per row); launch: `sampler_launch(config)`,
    or empty (the config of the scores' device).
    """
    return _launch(scores, seen, noise, temperature, top_p, repetition_penalty, do_sample, uses_history, uses_top_p,
                   launch, None)  # fmt: skip


class _SubStepState(NamedTuple):
    """What `sample_tokens_into` writes besides the token (see there)."""

    out: torch.Tensor
    group_column: torch.Tensor
    positions: torch.Tensor
    next_positions: torch.Tensor
    next_input: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def _launch(scores, seen, noise, temperature, top_p, repetition_penalty, do_sample, uses_history, uses_top_p, launch,
            state: _SubStepState | None):  # fmt: skip
    """`launch_sample_tokens`, and with `state` the decode sub-step's state writes of `sample_tokens_into` (the token
    into `state.out`)."""
    rows, vocab = scores.shape
    scores, noise = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (scores, noise))
    if seen is not None:
        if seen.stride(-1) != 1:
            if state is not None:
                raise ValueError("The history marked in place must have unit stride along the vocabulary.")
            seen = seen.contiguous()
        seen = seen.view(torch.int8) if seen.dtype == torch.bool else seen  # bytes, read and (WRITE_STATE) written
    if state is None:
        out = torch.empty(rows, dtype=torch.long, device=scores.device)
        group, positions, next_positions = out, out, out  # not read (WRITE_STATE off)
    else:
        out, group, positions, next_positions = state.out, state.group_column, state.positions, state.next_positions
    next_input = None if state is None else state.next_input
    sub_input, table, next_row = next_input if next_input is not None else (out[:, None], out[:, None], out[:, None])
    block_v = triton.next_power_of_2(vocab)
    num_warps, programmatic = launch or sampler_launch(DecodeKernelConfig.for_device(scores.device))
    pdl = bool(programmatic)
    _sample_kernel[(rows,)](
        scores, scores if seen is None else seen, scores if noise is None else noise,
        temperature, top_p, repetition_penalty, out,
        scores.stride(0), 0 if seen is None else seen.stride(0), 0 if noise is None else noise.stride(0),
        temperature.stride(0) if temperature.ndim else 0,
        group, group.stride(0), positions, positions.stride(0), next_positions,
        sub_input, sub_input.stride(0), table, table.stride(0), next_row, next_row.stride(0), sub_input.shape[-1],
        VOCAB=vocab, BLOCK_V=block_v, DO_SAMPLE=do_sample, USES_HISTORY=uses_history, USES_TOP_P=uses_top_p,
        PDL=pdl, WRITE_STATE=state is not None, WRITE_INPUT=next_input is not None,
        BLOCK_C=min(1024, triton.next_power_of_2(sub_input.shape[-1])), num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out


if triton is not None:
    # Opaque, as `funaudiochat::decode_linear` (torch.compile's launches of traced kernels have no PDL).
    _sample_tokens_op = torch.library.custom_op("funaudiochat::sample_tokens", launch_sample_tokens, mutates_args=())

    @_sample_tokens_op.register_fake
    def _(scores, seen, noise, temperature, top_p, repetition_penalty, do_sample, uses_history, uses_top_p, launch):
        return scores.new_empty(scores.shape[0], dtype=torch.long)


def sample_tokens(
    scores: torch.Tensor,
    switches: SamplingSwitches,
    parameters: SamplingParameters,
    seen: torch.Tensor | None = None,
    exponential_noise: torch.Tensor | None = None,
    kernel_config: DecodeKernelConfig | None = None,
) -> torch.Tensor:
    """`select_tokens(scores, switches, seen, exponential_noise, parameters)` as one kernel: `(rows, vocab)` CUDA
    scores (vocab at most `MAX_VOCAB`) -> `(rows,)` int64 token ids. With top-k on, `select_tokens` itself.
    `kernel_config`: the kernel's [`DecodeKernelConfig`] (None: that of the scores' device)."""
    if switches.uses_top_k:
        return select_tokens(scores, switches, seen, exponential_noise, parameters)
    if switches.uses_history and seen is None:
        raise ValueError("A repetition penalty needs the `seen` history mask.")
    if switches.do_sample and exponential_noise is None:
        raise ValueError("Sampling needs `exponential_noise` drawn from Exp(1).")
    return torch.ops.funaudiochat.sample_tokens(
        scores,
        seen if switches.uses_history else None,
        exponential_noise if switches.do_sample else None,
        parameters.temperature,
        parameters.top_p,
        parameters.repetition_penalty,
        switches.do_sample,
        switches.uses_history,
        switches.uses_top_p,
        [] if kernel_config is None else sampler_launch(kernel_config),
    )


def sample_tokens_into(
    scores: torch.Tensor,
    switches: SamplingSwitches,
    parameters: SamplingParameters,
    seen: torch.Tensor | None,
    exponential_noise: torch.Tensor | None,
    kernel_config: DecodeKernelConfig | None,
    *,
    out: torch.Tensor,
    group_column: torch.Tensor,
    positions: torch.Tensor,
    next_positions: torch.Tensor,
    next_input: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`sample_tokens` with a decode sub-step's state written by the same kernel, instead of four small kernels after
    it: the token into `out` `(rows,)` and `group_column` `(rows,)` (a column view of the group), marked in `seen`
    (in place, with the repetition penalty), and `next_positions = positions + 1` `(rows,)` (views allowed);
    `next_input` = `(sub_input, table, into)`: also `into = sub_input + table[token]` `(rows, columns)` (the next CRQ
    sub-step's input, two kernels fewer), all three of one dtype. For the step recorded as a CUDA graph without
    torch.compile (a plain launch, not the opaque operator). With top-k on, `select_tokens` and the same writes as
    PyTorch ops. Returns `out`."""
    if switches.uses_top_k:
        token = select_tokens(scores, switches, seen, exponential_noise, parameters)
        out.copy_(token)
        group_column.copy_(token)
        if switches.uses_history:
            seen.scatter_(-1, token[:, None], True)
        torch.add(positions, 1, out=next_positions)
        if next_input is not None:
            sub_input, table, into = next_input
            torch.add(sub_input, table[token], out=into)
        return out
    if switches.uses_history and seen is None:
        raise ValueError("A repetition penalty needs the `seen` history mask.")
    if switches.do_sample and exponential_noise is None:
        raise ValueError("Sampling needs `exponential_noise` drawn from Exp(1).")
    if next_input is not None and (
        len({t.dtype for t in next_input}) != 1 or any(t.stride(-1) != 1 for t in next_input)
    ):
        raise ValueError("`next_input` must be three tensors of one dtype with unit stride along their columns.")
    return _launch(
        scores, seen if switches.uses_history else None, exponential_noise if switches.do_sample else None,
        parameters.temperature, parameters.top_p, parameters.repetition_penalty, switches.do_sample,
        switches.uses_history, switches.uses_top_p, [] if kernel_config is None else sampler_launch(kernel_config),
        _SubStepState(out, group_column, positions, next_positions, next_input),
    )  # fmt: skip


__all__ = [
    "MAX_VOCAB",
    "launch_sample_tokens",
    "sampler_launch",
    "sample_tokens",
    "sample_tokens_into",
    "sampler_kernel_supported",
    "use_sampler_kernel",
]
