"""Fixed-shape, sync-free token samplers for the speech decoding loop.

Every function here works on whole `(batch, vocab)` tensors with no `.item()`, no data-dependent shapes and no
`torch.multinomial`, so the decode step that calls them can be captured as one CUDA graph. They reproduce the
transformers logits processors the reference runs (`RepetitionPenaltyLogitsProcessor`, `TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`) with the token history kept as a `(batch, vocab)` "seen" mask instead of a
growing list of ids (the penalty only depends on *which* ids occurred, not how often).

A compiled step specialises on Python constants, so the settings are split in two: `SamplingSwitches` (which
processors run at all: the structure of the graph) and `SamplingParameters` (their values, as 0-d tensors the graph
reads at run time). Changing only a value (temperature, top-p, top-k, penalty) then reuses the compiled graph.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSwitches:
    """Which processors of one token stream run: the static structure of a compiled sampler (hashable)."""

    do_sample: bool
    uses_top_k: bool
    uses_top_p: bool
    uses_history: bool


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

    @property
    def switches(self) -> SamplingSwitches:
        """The structural part of these settings (what a compiled step specialises on)."""
        return SamplingSwitches(
            do_sample=self.do_sample,
            uses_top_k=self.do_sample and self.top_k > 0,
            uses_top_p=self.do_sample and self.top_p < 1.0,
            uses_history=self.uses_history,
        )


class SamplingParameters:
    """The values of one stream's settings as fixed-address tensors, refilled per run with `fill_`.

    `temperature`, `top_p` and `repetition_penalty` are float64 (exactly the Python values; each use casts them to
    the scores' dtype, as a Python scalar operand is cast), `top_k` is int64. 0-d (one value for every row), or with
    `rows`, `(rows, 1)`: one value per row of the scores (a continuous batch whose rows are different requests,
    `fill_row_`), broadcast against `(rows, vocab)` scores.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        settings: SamplingSettings | None = None,
        rows: int | None = None,
    ):
        shape = () if rows is None else (rows, 1)
        self.temperature = torch.ones(shape, dtype=torch.float64, device=device)
        self.top_p = torch.ones(shape, dtype=torch.float64, device=device)
        self.top_k = torch.zeros(shape, dtype=torch.long, device=device)
        self.repetition_penalty = torch.ones(shape, dtype=torch.float64, device=device)
        if settings is not None:
            self.fill_(settings)

    def tensors(self) -> list[torch.Tensor]:
        return [self.temperature, self.top_p, self.top_k, self.repetition_penalty]

    def fill_(self, settings: SamplingSettings) -> "SamplingParameters":
        """Copy the values of `settings` in place (no host sync, the addresses stay the same)."""
        self.temperature.fill_(settings.temperature)
        self.top_p.fill_(settings.top_p)
        self.top_k.fill_(settings.top_k)
        self.repetition_penalty.fill_(settings.repetition_penalty)
        return self

    def first_rows(self, rows: int) -> "SamplingParameters":
        """The parameters of the first `rows` rows, sharing these tensors' storage (views); 0-d parameters (one value
        for every row) are shared as they are."""
        view = object.__new__(SamplingParameters)
        for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
            tensor = getattr(self, name)
            setattr(view, name, tensor if tensor.ndim == 0 else tensor[:rows])
        return view

    def fill_row_(self, row: int, settings: SamplingSettings) -> "SamplingParameters":
        """Copy the values of `settings` into one row of per-row parameters (`rows` given), in place."""
        if self.temperature.ndim == 0:
            raise ValueError("`fill_row_` needs per-row parameters (`SamplingParameters(rows=...)`).")
        self.temperature[row] = settings.temperature
        self.top_p[row] = settings.top_p
        self.top_k[row] = settings.top_k
        self.repetition_penalty[row] = settings.repetition_penalty
        return self


def apply_repetition_penalty(
    scores: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor
) -> torch.Tensor:
    """`RepetitionPenaltyLogitsProcessor` on a seen-mask.

    Args:
        scores: `(batch, vocab)` float logits.
        seen: `(batch, vocab)` bool, True for every id in the history.
        penalty: > 1 discourages repeats (negative scores are multiplied, positive ones divided); a float or a 0-d
            tensor.
    """
    if isinstance(penalty, torch.Tensor):
        penalty = penalty.to(scores.dtype)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def apply_top_k(scores: torch.Tensor, top_k: int | torch.Tensor) -> torch.Tensor:
    """`TopKLogitsWarper`: keep the `top_k` best scores (ties with the k-th included), others -> -inf.

    `top_k` may be a 0-d int tensor (>= 1; larger than the vocabulary keeps everything): the k-th best score is then
    read from the sorted scores, so the value of k is not baked into a compiled graph.
    """
    vocab = scores.shape[-1]
    if isinstance(top_k, torch.Tensor):
        kth_index = (top_k.clamp(min=1, max=vocab) - 1).reshape(-1, 1).expand(*scores.shape[:-1], 1)
        kth_best = scores.sort(dim=-1, descending=True).values.gather(-1, kth_index)
    else:
        kth_best = torch.topk(scores, min(top_k, vocab), dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth_best, float("-inf"))


def apply_top_p(scores: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """`TopPLogitsWarper` (nucleus filter) with `min_tokens_to_keep=1`, as fixed-shape sort/scatter ops.

    `top_p` is a float or a 0-d tensor (best float64: `1 - top_p` is then rounded to the scores' dtype exactly as the
    Python scalar is).
    """
    sorted_scores, sorted_indices = torch.sort(scores, dim=-1, descending=False)
    cumulative_probs = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    removed_mass = 1 - top_p
    if isinstance(removed_mass, torch.Tensor):
        removed_mass = removed_mass.to(cumulative_probs.dtype)
    sorted_remove = cumulative_probs <= removed_mass
    # Always keep the most likely token (the last one in ascending order).
    sorted_remove[..., -1] = False
    remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, float("-inf"))


def _switches_and_parameters(settings, parameters, device):
    if isinstance(settings, SamplingSettings):
        return settings.switches, parameters if parameters is not None else SamplingParameters(device, settings)
    if parameters is None:
        raise ValueError("`SamplingSwitches` need their values as `parameters` (a `SamplingParameters`).")
    return settings, parameters


def process_scores(
    scores: torch.Tensor,
    settings: SamplingSettings | SamplingSwitches,
    seen: torch.Tensor | None = None,
    parameters: SamplingParameters | None = None,
) -> torch.Tensor:
    """Apply the processors/warpers of `settings` in transformers' order (penalty, temperature, top-k, top-p).

    Args:
        scores: `(batch, vocab)` float32 logits.
        settings: full `SamplingSettings`, or only their `SamplingSwitches` with the values in `parameters`.
        seen: `(batch, vocab)` bool history mask, required when the repetition penalty is active.
        parameters: the values as 0-d tensors (a compiled step passes them so new values reuse its graph).
    """
    switches, parameters = _switches_and_parameters(settings, parameters, scores.device)
    if switches.uses_history:
        if seen is None:
            raise ValueError("A repetition penalty needs the `seen` history mask.")
        scores = apply_repetition_penalty(scores, seen, parameters.repetition_penalty)
    if switches.do_sample:
        # Dividing by a temperature of 1.0 is exact, so it needs no switch of its own.
        scores = scores / parameters.temperature.to(scores.dtype)
        if switches.uses_top_k:
            scores = apply_top_k(scores, parameters.top_k)
        if switches.uses_top_p:
            scores = apply_top_p(scores, parameters.top_p)
    return scores


def select_tokens(
    scores: torch.Tensor,
    settings: SamplingSettings | SamplingSwitches,
    seen: torch.Tensor | None = None,
    exponential_noise: torch.Tensor | None = None,
    parameters: SamplingParameters | None = None,
) -> torch.Tensor:
    """Pick one token per row: argmax when not sampling, else an exponential race (no host sync).

    The exponential race `argmax(p / E)`, `E ~ Exp(1)` i.i.d., draws from the categorical distribution `p` exactly
    like `torch.multinomial`, but with fixed shapes and no synchronisation, so it can live inside a CUDA graph.
    The noise is drawn by the caller (from its own `torch.Generator`) so seeded runs repeat exactly and the eager and
    compiled loops consume the same random numbers.

    Args:
        scores: `(batch, vocab)` float logits.
        settings: decoding settings of this stream, or only their `SamplingSwitches` with the values in `parameters`.
        seen: `(batch, vocab)` bool history mask for the repetition penalty.
        exponential_noise: `(batch, vocab)` float32 samples of Exp(1); required when sampling.
        parameters: the values of the settings as 0-d tensors (see `process_scores`).

    Returns:
        `(batch,)` int64 token ids.
    """
    scores = process_scores(scores.float(), settings, seen, parameters)
    if not settings.do_sample:
        return first_argmax(scores)
    if exponential_noise is None:
        raise ValueError("Sampling needs `exponential_noise` drawn from Exp(1).")
    probs = scores.softmax(dim=-1)
    return first_argmax(probs / exponential_noise)


# Rows longer than this are reduced in two stages by `first_argmax`.
ARGMAX_CHUNK = 2048


def first_argmax(scores: torch.Tensor) -> torch.Tensor:
    """`scores.argmax(dim=-1)` of `(batch, vocab)` scores (the first index of the maximum; NaN counts as the maximum),
    computed in two stages for long rows.

    A compiled step turns a one-row argmax into one GPU program walking the whole row: slow for the 151,936 text
    logits, as one program reads them all while the rest of the GPU idles. There the row is cut in chunks of
    `ARGMAX_CHUNK` (padded with -inf), each chunk reduced by its own program, then the first chunk holding the maximum
    gives the index: the same result, exactly. Outside torch.compile PyTorch's own argmax already spreads a row over
    the GPU in one kernel (the chunked form would be seven): it is used as it is.
    """
    batch, vocab = scores.shape
    if vocab <= 2 * ARGMAX_CHUNK or not torch.compiler.is_compiling():
        return scores.argmax(dim=-1)
    chunks = -(-vocab // ARGMAX_CHUNK)
    padded = torch.nn.functional.pad(scores, (0, chunks * ARGMAX_CHUNK - vocab), value=float("-inf"))
    blocks = padded.view(batch, chunks, ARGMAX_CHUNK)
    block_index = blocks.argmax(dim=-1)  # (batch, chunks)
    block_max = blocks.gather(-1, block_index[..., None])[..., 0]
    best_block = block_max.argmax(dim=-1, keepdim=True)  # the first block whose maximum is the row's (NaN first)
    return (best_block * ARGMAX_CHUNK + block_index.gather(-1, best_block))[:, 0]


def mark_seen_(seen: torch.Tensor, token_ids: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Add `token_ids` `(batch, n)` to the `(batch, vocab)` bool history `seen` in place, only in the rows where
    `row_mask` `(batch,)` is True; returns `seen`. One scatter (three kernels with a row mask), not a new mask the
    size of `seen` or'ed into it: the decode step marks a history every CRQ sub-step and every text token."""
    if row_mask is None:
        return seen.scatter_(-1, token_ids, True)
    # A masked row writes back what it holds; repeated ids write the same value.
    return seen.scatter_(-1, token_ids, seen.gather(-1, token_ids) | row_mask[:, None])
