"""The sync-free samplers must match transformers' logits processors and draw from the right distribution."""

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from funaudiochat_hf.sampling_funaudiochat import (
    SamplingParameters,
    SamplingSettings,
    SamplingSwitches,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    first_argmax,
    mark_seen_,
    process_scores,
    select_tokens,
)


def _seen_mask(history: torch.Tensor, vocab: int) -> torch.Tensor:
    return mark_seen_(torch.zeros(history.shape[0], vocab, dtype=torch.bool), history)


def test_repetition_penalty_matches_transformers():
    scores = torch.randn(3, 50) * 3
    history = torch.randint(0, 50, (3, 12))
    expected = RepetitionPenaltyLogitsProcessor(1.3)(history, scores.clone())
    torch.testing.assert_close(apply_repetition_penalty(scores, _seen_mask(history, 50), 1.3), expected)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_matches_transformers(top_p):
    scores = torch.randn(4, 64) * 2
    expected = TopPLogitsWarper(top_p)(None, scores.clone())
    assert torch.equal(apply_top_p(scores, top_p), expected)


@pytest.mark.parametrize("top_k", [1, 5, 64, 100])
def test_top_k_matches_transformers(top_k):
    scores = torch.randn(4, 64)
    expected = TopKLogitsWarper(top_k)(None, scores.clone())
    assert torch.equal(apply_top_k(scores, top_k), expected)


def test_process_scores_chain_order():
    scores = torch.randn(2, 30) * 2
    history = torch.randint(0, 30, (2, 6))
    settings = SamplingSettings(do_sample=True, temperature=0.7, top_p=0.8, top_k=10, repetition_penalty=1.2)
    expected = RepetitionPenaltyLogitsProcessor(1.2)(history, scores.clone())
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(10), TopPLogitsWarper(0.8)):
        expected = warper(history, expected)
    torch.testing.assert_close(process_scores(scores, settings, _seen_mask(history, 30)), expected)


def test_greedy_ignores_warpers_and_noise():
    scores = torch.tensor([[1.0, 3.0, 2.0], [-1.0, -3.0, -2.0]])
    seen = torch.tensor([[False, True, False], [True, False, False]])
    greedy = SamplingSettings(do_sample=False, temperature=0.1, top_k=1, repetition_penalty=2.0)
    # row 0: the seen 3.0 becomes 1.5 < 2.0 -> id 2; row 1: the seen -1 becomes -2, a tie with id 2 -> first max, id 0
    assert select_tokens(scores, greedy, seen).tolist() == [2, 0]


def test_exponential_race_draws_from_the_distribution():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draws = 40000
    logits = probs.log().expand(draws, 4)
    noise = torch.empty(draws, 4).exponential_(generator=generator)
    tokens = select_tokens(logits, SamplingSettings(do_sample=True), exponential_noise=noise)
    frequencies = torch.bincount(tokens, minlength=4).float() / draws
    torch.testing.assert_close(frequencies, probs, atol=0.01, rtol=0)
    assert frequencies[3] == 0


def test_mark_seen_respects_row_mask():
    seen = torch.zeros(3, 5, dtype=torch.bool)
    seen[1, 4] = seen[2, 0] = True
    updated = mark_seen_(seen, torch.tensor([[1, 3], [2, 2], [4, 4]]), torch.tensor([True, False, True]))
    assert updated is seen  # in place
    assert updated.tolist() == [[False, True, False, True, False], [False] * 4 + [True], [True] + [False] * 3 + [True]]


def test_marking_the_history_is_one_kernel_without_a_row_mask_and_three_with_one():
    """The decode step marks a history every CRQ sub-step and every text token, over the whole vocabulary (151,936
    text ids): in place, with no mask the size of the history made and or'ed in (four and five kernels a mark)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in ("view", "unsqueeze", "slice", "expand"):  # no kernel
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    seen, ids, rows = torch.zeros(2, 50, dtype=torch.bool), torch.tensor([[1], [7]]), torch.tensor([True, False])
    with Ops() as plain:
        mark_seen_(seen, ids)
    with Ops() as masked:
        mark_seen_(seen, ids, rows)
    assert plain.names == ["scatter_"] and masked.names == ["gather", "bitwise_or", "scatter_"]


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="temperature"):
        SamplingSettings(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingSettings(top_k=-1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingSettings(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="exponential_noise"):
        select_tokens(torch.zeros(1, 3), SamplingSettings(do_sample=True))


# Values as 0-d tensors (what the compiled decode step passes, so new values reuse its graph) must give exactly the
# same scores as the Python values.


@pytest.mark.parametrize("top_k", [1, 3, 7, 64, 100])
def test_tensor_top_k_matches_transformers_with_ties(top_k):
    scores = torch.randint(-3, 4, (4, 64)).float()  # many ties at the k-th best score
    expected = TopKLogitsWarper(top_k)(None, scores.clone())
    assert torch.equal(apply_top_k(scores, torch.tensor(top_k)), expected)
    assert torch.equal(apply_top_k(scores, top_k), expected)


@pytest.mark.parametrize("top_p", [0.1, 0.3, 0.7, 0.95])
def test_tensor_top_p_matches_transformers(top_p):
    scores = torch.randn(4, 64) * 2
    expected = TopPLogitsWarper(top_p)(None, scores.clone())
    assert torch.equal(apply_top_p(scores, torch.tensor(top_p, dtype=torch.float64)), expected)


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(do_sample=True, temperature=0.7, top_p=0.8, top_k=10, repetition_penalty=1.2),
        SamplingSettings(do_sample=True, temperature=1.3, top_p=1.0, top_k=0, repetition_penalty=1.0),
        SamplingSettings(do_sample=False, temperature=0.3, top_k=4, repetition_penalty=0.8),
    ],
)
def test_switches_with_parameters_equal_settings(settings):
    scores = torch.randn(2, 30) * 3
    seen = _seen_mask(torch.randint(0, 30, (2, 6)), 30)
    expected = process_scores(scores, settings, seen)
    parameters = SamplingParameters(settings=settings)
    assert torch.equal(process_scores(scores, settings.switches, seen, parameters), expected)
    # Refilling the same tensors in place with other values changes the result accordingly.
    other = dataclasses.replace(settings, temperature=2.0, top_k=settings.top_k and settings.top_k + 3)
    parameters.fill_(other)
    refilled = process_scores(scores, settings.switches, seen, parameters)
    assert torch.equal(refilled, process_scores(scores, other, seen))


def test_switches_are_the_structure_only():
    a = SamplingSettings(temperature=0.7, top_p=0.8, top_k=10, repetition_penalty=1.2)
    b = SamplingSettings(temperature=1.5, top_p=0.3, top_k=2, repetition_penalty=1.05)
    assert a.switches == b.switches and hash(a.switches) == hash(b.switches)
    assert a.switches != SamplingSettings(temperature=0.7, top_p=1.0, top_k=10, repetition_penalty=1.2).switches
    greedy = SamplingSettings(do_sample=False, top_k=5, top_p=0.5)
    assert greedy.switches == SamplingSwitches(False, False, False, False)
    with pytest.raises(ValueError, match="parameters"):
        process_scores(torch.zeros(1, 3), a.switches)


@pytest.mark.parametrize("vocab", [5000, 151936, 2048 * 5])
def test_first_argmax_equals_argmax_on_long_rows(vocab):
    """The two-stage argmax of long rows (the text logits) picks exactly `argmax`'s index: the first maximum, across
    chunk boundaries, with -inf rows and NaN (which `argmax` counts as the maximum)."""
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(6, vocab, generator=generator).round()  # many ties of the maximum
    scores[1, :] = float("-inf")
    scores[2, vocab - 1] = 100.0  # the last position, in the padded chunk
    scores[3, [7, 4097, vocab - 3]] = 50.0  # ties in several chunks: the first wins
    scores[4, [vocab - 900, vocab - 10]] = float("nan")
    scores[5, 2047:2049] = 80.0  # a tie across a chunk boundary
    expected = scores.argmax(dim=-1)
    assert expected.tolist()[1:4] == [0, vocab - 1, 7]
    assert torch.equal(first_argmax(scores), expected)
    graphs = []

    def keep_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(first_argmax, backend=keep_graph, fullgraph=True)
    assert torch.equal(compiled(scores), expected)
    argmaxes = sum("argmax" in str(node.target) for node in graphs[0].graph.nodes)
    assert argmaxes == (2 if vocab > 2 * 2048 else 1)  # compiled: two stages for long rows


def test_first_argmax_outside_compile_is_one_argmax():
    """Eagerly (the CUDA-graphed default step launches each op as a kernel) a long row's argmax is PyTorch's one
    kernel, not the compiled step's seven-op two-stage form."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    scores = torch.randn(2, 151936)
    with Ops() as ops:
        first_argmax(scores)
    assert ops.names == ["argmax"]


def test_per_row_parameters_equal_each_row_sampled_alone():
    """`SamplingParameters(rows=...)`: every row of a batch reads its own temperature / top-k / top-p / penalty (a
    continuous batch of requests) and gets the token it gets alone with those values as 0-d parameters."""
    from funaudiochat_hf.sampling_funaudiochat import SamplingParameters, SamplingSettings, select_tokens

    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 50, generator=generator) * 3
    seen = torch.rand(3, 50, generator=generator) < 0.2
    noise = torch.empty(3, 50).exponential_(generator=generator)
    rows = [
        SamplingSettings(temperature=0.5, top_p=0.6, top_k=5, repetition_penalty=1.5),
        SamplingSettings(temperature=1.3, top_p=1.0, top_k=50, repetition_penalty=1.0),
        SamplingSettings(temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2),
    ]
    per_row = SamplingParameters(rows=3)
    for row, settings in enumerate(rows):
        per_row.fill_row_(row, settings)
    switches = SamplingSettings(temperature=1.0, top_p=0.5, top_k=3, repetition_penalty=1.5).switches  # all on
    together = select_tokens(scores, switches, seen, noise, per_row)
    alone = [
        select_tokens(scores[r : r + 1], switches, seen[r : r + 1], noise[r : r + 1], SamplingParameters(settings=s))
        for r, s in enumerate(rows)
    ]
    assert together.tolist() == torch.cat(alone).tolist()
    # Rows differ in their values: the same scores with one row's values everywhere would pick other tokens.
    assert per_row.temperature.shape == (3, 1) and len(set(per_row.top_p.flatten().tolist())) == 3
    with pytest.raises(ValueError, match="per-row"):
        SamplingParameters().fill_row_(0, rows[0])
