"""Fixed-shape, sync-free token samplers for the speech decoding loop.

Every function here works on whole `(batch, vocab)` tensors with no `.item()`, no data-dependent shapes and no
`torch.multinomial`, so the decode step that calls them can be captured as one CUDA graph. They reproduce the
transformers logits processors the reference runs (`RepetitionPenaltyLogitsProcessor`, `TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`) with the token history kept as a `(batch, vocab)` "seen" mask instead of a
growing list of ids (the penalty only depends on *which* ids occurred, not how often).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSettings:
    """Decoding settings of one token stream (the text stream or the speech stream).

    Attributes mirror `GenerationConfig`: `do_sample=False` means argmax of the (repetition-penalised) scores;
    `top_k=0` and `top_p=1.0` disable those filters; `repetition_penalty=1.0` disables the penalty.
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"`temperature` must be > 0 when sampling, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"`top_k` must be >= 0 (0 disables it), got {self.top_k}.")
        if not self.repetition_penalty > 0:
            raise ValueError(f"`repetition_penalty` must be > 0, got {self.repetition_penalty}.")

    @property
    def uses_history(self) -> bool:
        """Whether the scores depend on the previously emitted tokens (repetition penalty)."""
        return self.repetition_penalty != 1.0


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """`RepetitionPenaltyLogitsProcessor` on a seen-mask.

    Args:
        scores: `(batch, vocab)` float logits.
        seen: `(batch, vocab)` bool, True for every id in the history.
        penalty: > 1 discourages repeats (negative scores are multiplied, positive ones divided).
    """
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def apply_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """`TopKLogitsWarper`: keep the `top_k` best scores (ties with the k-th included), others -> -inf."""
    top_k = min(top_k, scores.shape[-1])
    kth_best = torch.topk(scores, top_k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth_best, float("-inf"))


def apply_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """`TopPLogitsWarper` (nucleus filter) with `min_tokens_to_keep=1`, as fixed-shape sort/scatter ops."""
    sorted_scores, sorted_indices = torch.sort(scores, dim=-1, descending=False)
    cumulative_probs = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative_probs <= (1 - top_p)
    # Always keep the most likely token (the last one in ascending order).
    sorted_remove[..., -1] = False
    remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, float("-inf"))


def process_scores(scores: torch.Tensor, settings: SamplingSettings, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the processors/warpers of `settings` in transformers' order (penalty, temperature, top-k, top-p).

    Args:
        scores: `(batch, vocab)` float32 logits.
        seen: `(batch, vocab)` bool history mask, required when `settings.repetition_penalty != 1`.
    """
    if settings.uses_history:
        if seen is None:
            raise ValueError("A repetition penalty needs the `seen` history mask.")
        scores = apply_repetition_penalty(scores, seen, settings.repetition_penalty)
    if settings.do_sample:
        if settings.temperature != 1.0:
            scores = scores / settings.temperature
        if settings.top_k > 0:
            scores = apply_top_k(scores, settings.top_k)
        if settings.top_p < 1.0:
            scores = apply_top_p(scores, settings.top_p)
    return scores


def select_tokens(
    scores: torch.Tensor,
    settings: SamplingSettings,
    seen: torch.Tensor | None = None,
    exponential_noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row: argmax when not sampling, else an exponential race (no host sync).

    The exponential race `argmax(p / E)`, `E ~ Exp(1)` i.i.d., draws from the categorical distribution `p` exactly
    like `torch.multinomial`, but with fixed shapes and no synchronisation, so it can live inside a CUDA graph.
    The noise is drawn by the caller (from its own `torch.Generator`) so seeded runs repeat exactly and the eager and
    compiled loops consume the same random numbers.

    Args:
        scores: `(batch, vocab)` float logits.
        settings: decoding settings of this stream.
        seen: `(batch, vocab)` bool history mask for the repetition penalty.
        exponential_noise: `(batch, vocab)` float32 samples of Exp(1); required when `settings.do_sample`.

    Returns:
        `(batch,)` int64 token ids.
    """
    scores = process_scores(scores.float(), settings, seen)
    if not settings.do_sample:
        return scores.argmax(dim=-1)
    if exponential_noise is None:
        raise ValueError("Sampling needs `exponential_noise` drawn from Exp(1).")
    probs = scores.softmax(dim=-1)
    return (probs / exponential_noise).argmax(dim=-1)


def mark_seen(seen: torch.Tensor, token_ids: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Return `seen` with `token_ids` `(batch, n)` added, only for rows where `row_mask` `(batch,)` is True."""
    update = torch.zeros_like(seen).scatter_(-1, token_ids, True)
    if row_mask is not None:
        update = update & row_mask[:, None]
    return seen | update
