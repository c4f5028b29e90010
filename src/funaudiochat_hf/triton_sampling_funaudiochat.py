"""The speech token sampler of a decode step as one Triton kernel (`generate_speech(speech_sampler="triton")`).

Every CRQ sub-step picks one speech token from `(batch, 6565)` logits with the official S2S settings: repetition
penalty over the speech history, temperature, top-p, then a draw. As PyTorch ops (`sampling_funaudiochat.select_tokens`)
that is a radix sort of each row (6 cub kernels: a row of 6,565 is past Inductor's 512-element in-register sort), a
cumulative sum, a scatter back and two softmaxes: 73 µs per sub-step compiled on an H200, 0.37 ms of a batch-1 step
(BENCHMARKS.md, 2026-12-01). Here each row is one program that holds the whole row in registers and does it all
without sorting, then writes the chosen id: 17.9 µs (`tl.sort` of the 8,192 scores alone took 108-172 µs); the batch-1
step 8.40 -> 8.23-8.26 ms side by side.

Top-p without a sort: the tokens `TopPLogitsWarper` removes are the longest prefix of the ascending order whose
cumulative probability is at most `1 - top_p` (never the most likely token). With `g(t)` the probability of the tokens
whose score key (the float's bits, ordered as the floats) is below `t`, the first token it keeps has the largest key
`t*` with `g(t*) <= 1 - top_p`, at most the most likely token's key: found bit by bit, 32 masked sums. Among the
tokens tied at `t*` (equal scores, equal probabilities `p*`), the first `floor((1 - top_p - g(t*)) / p*)` by id are
removed too: the order of PyTorch's CUDA sort of such a row (a stable radix sort); their id boundary is found bit by
bit as well. (Settling 2-4 bits per pass, one 2-D masked sum for all its candidates, was slower on an H200: 28-76
against 17.7 µs per call, BENCHMARKS.md 2026-12-02 17:55–18:30.)

The result is that of `select_tokens` up to float rounding (sums in another order, the GPU's `exp`): penalty
`where(seen, where(s < 0, s * p, s / p), s)` and `s / temperature` in float32 as transformers, then the exponential
race of `select_tokens` (`argmax(p / E)`, the caller's Exp(1) noise), or the first argmax when greedy. Top-k is not
done here (`sample_tokens` leaves it to `select_tokens`; the official settings do not use it).

The launcher is an opaque PyTorch operator (`torch.library.custom_op`) that `torch.compile` keeps in its graph and CUDA
graphs replay; on Hopper it is a programmatic dependent launch like the other decode kernels.
"""

import torch

from .sampling_funaudiochat import SamplingParameters, SamplingSwitches, select_tokens
from .triton_attention_funaudiochat import programmatic_launch, triton


# The largest vocabulary a program holds in registers (a row of scores, their keys and probabilities): the speech
# codebook (6,565) fits; the text vocabulary (151,936) keeps the PyTorch sampler.
MAX_VOCAB = 16384
NUM_WARPS = 8


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _ordered_key(scores):
        """uint32 keys ordered as the float32 `scores` (negative floats: all bits flipped; others: the sign bit)."""
        bits = scores.to(tl.uint32, bitcast=True)
        return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)

    @triton.jit
    def _sample_kernel(
        scores_ptr, seen_ptr, noise_ptr, temperature_ptr, top_p_ptr, penalty_ptr, out_ptr,
        stride_scores, stride_seen, stride_noise,
        VOCAB: tl.constexpr, BLOCK_V: tl.constexpr, INDEX_BITS: tl.constexpr, DO_SAMPLE: tl.constexpr,
        USES_HISTORY: tl.constexpr, USES_TOP_P: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """The token of row `program_id(0)`: scores `(rows, VOCAB)` float, seen `(rows, VOCAB)` bool, noise `(rows,
        VOCAB)` float32 Exp(1); 0-d temperature, top-p and penalty (float64); out `(rows,)` int64. Positions past the
        vocabulary hold -inf scores and no probability."""
        if PDL:  # the scores are the previous kernel's output
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        index = tl.arange(0, BLOCK_V)
        in_vocab = index < VOCAB
        scores = tl.load(scores_ptr + row * stride_scores + index, mask=in_vocab, other=float("-inf"))
        scores = scores.to(tl.float32)
        if USES_HISTORY:
            seen = tl.load(seen_ptr + row * stride_seen + index, mask=in_vocab, other=0) != 0
            penalty = tl.load(penalty_ptr).to(tl.float32)
            scores = tl.where(seen, tl.where(scores < 0, scores * penalty, scores / penalty), scores)
        if DO_SAMPLE:
            scores = scores / tl.load(temperature_ptr).to(tl.float32)
            top = tl.max(scores, 0)
            exps = tl.exp(scores - top)
            probs = exps / tl.sum(exps, 0)
            if USES_TOP_P:
                removed_mass = (1.0 - tl.load(top_p_ptr)).to(tl.float32)
                key = _ordered_key(scores)
                # The largest key t with g(t) <= removed_mass, g(t) the probability below key t, at most the most
                # likely tokens' key: they weigh infinitely here, since where 1 - top_p rounds to 1 in float32, g of
                # every key can be within it (the search then passed them and kept no token).
                weights = tl.where(scores == top, float("inf"), probs)
                one = tl.full([], 1, tl.uint32)
                boundary = tl.zeros([], tl.uint32)
                below = tl.zeros([], tl.float32)
                for bit in tl.static_range(31, -1, -1):
                    candidate = boundary | (one << bit)
                    mass = tl.sum(tl.where(key < candidate, weights, 0.0), 0)
                    boundary = tl.where(mass <= removed_mass, candidate, boundary)
                    below = tl.where(mass <= removed_mass, mass, below)
                tied = in_vocab & (key == boundary)
                tied_count = tl.sum(tied.to(tl.int32), 0)
                tied_prob = tl.max(tl.where(tied, probs, 0.0), 0)
                # The first tied tokens whose cumulative probability is still at most removed_mass go too; at least
                # one tied token stays (the boundary's first kept token, or the most likely one).
                room = tl.minimum((removed_mass - below) / tl.maximum(tied_prob, 1e-38), tied_count - 1.0)
                tied_removed = tl.where(tied_prob > 0, tl.floor(room), tied_count - 1.0).to(tl.int32)
                first_kept = tl.zeros([], tl.int32)  # the id of the tied token of rank `tied_removed`
                for bit in tl.static_range(INDEX_BITS - 1, -1, -1):
                    candidate = first_kept | (1 << bit)
                    tied_below = tl.sum((tied & (index < candidate)).to(tl.int32), 0)
                    first_kept = tl.where(tied_below <= tied_removed, candidate, first_kept)
                keep = in_vocab & ((key > boundary) | (tied & (index >= first_kept)))
                exps = tl.where(keep, exps, 0.0)  # the softmax of the kept scores (the maximum is kept)
                probs = exps / tl.sum(exps, 0)
            noise = tl.load(noise_ptr + row * stride_noise + index, mask=in_vocab, other=1.0)
            scores = tl.where(in_vocab, probs / noise, -1.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr + row, tl.argmax(scores, 0).to(tl.int64))


def sampler_kernel_supported(vocab_size: int) -> bool:
    """Whether rows of `vocab_size` scores fit one program of the kernel (`MAX_VOCAB`)."""
    return triton is not None and 1 <= vocab_size <= MAX_VOCAB


def use_sampler_kernel(scores: torch.Tensor) -> bool:
    """Whether `(batch, vocab)` scores take the kernel: CUDA scores whose rows fit a program (shape and device only,
    a constant of a compiled graph; the run checked the GPU with `triton_available`)."""
    return scores.is_cuda and sampler_kernel_supported(scores.shape[-1])


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
) -> torch.Tensor:
    """`(rows, vocab)` scores -> `(rows,)` int64 token ids; the body of the `funaudiochat::sample_tokens` operator.

    seen: `(rows, vocab)` bool history (read with `uses_history`); noise: `(rows, vocab)` float32 Exp(1) samples (read
    with `do_sample`); the settings as the 0-d tensors of a `SamplingParameters`.
    """
    rows, vocab = scores.shape
    scores, seen, noise = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (scores, seen, noise))
    out = torch.empty(rows, dtype=torch.long, device=scores.device)
    block_v = triton.next_power_of_2(vocab)
    pdl = programmatic_launch(scores.device)
    _sample_kernel[(rows,)](
        scores, scores if seen is None else seen, scores if noise is None else noise,
        temperature, top_p, repetition_penalty, out,
        scores.stride(0), 0 if seen is None else seen.stride(0), 0 if noise is None else noise.stride(0),
        VOCAB=vocab, BLOCK_V=block_v, INDEX_BITS=max(1, (block_v - 1).bit_length()), DO_SAMPLE=do_sample,
        USES_HISTORY=uses_history, USES_TOP_P=uses_top_p, PDL=pdl, num_warps=NUM_WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return out


if triton is not None:
    # Opaque, as `funaudiochat::decode_linear` (torch.compile's launches of traced kernels have no PDL).
    _sample_tokens_op = torch.library.custom_op("funaudiochat::sample_tokens", launch_sample_tokens, mutates_args=())

    @_sample_tokens_op.register_fake
    def _(scores, seen, noise, temperature, top_p, repetition_penalty, do_sample, uses_history, uses_top_p):
        return scores.new_empty(scores.shape[0], dtype=torch.long)


def sample_tokens(
    scores: torch.Tensor,
    switches: SamplingSwitches,
    parameters: SamplingParameters,
    seen: torch.Tensor | None = None,
    exponential_noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """`select_tokens(scores, switches, seen, exponential_noise, parameters)` as one kernel: `(rows, vocab)` CUDA
    scores (vocab at most `MAX_VOCAB`) -> `(rows,)` int64 token ids. With top-k on, `select_tokens` itself."""
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
    )


__all__ = ["MAX_VOCAB", "launch_sample_tokens", "sample_tokens", "sampler_kernel_supported", "use_sampler_kernel"]
