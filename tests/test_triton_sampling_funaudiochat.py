"""Tests of the speech sampler kernel (`triton_sampling_funaudiochat`, the plan part `speech_sampler`).

The kernel is checked against `select_tokens` (the PyTorch sampler, itself checked against transformers' processors in
test_sampling_funaudiochat.py) on CPU through Triton's interpreter (a subprocess, skipped without Triton) and on a GPU
(marked `gpu`). Top-p ties are checked against a stable sort, the order of PyTorch's CUDA sort of a speech row.
"""

import json

import pytest
import torch

from funaudiochat_hf.sampling_funaudiochat import SamplingParameters, SamplingSettings, select_tokens
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

from conftest import hopper_ptx, run_in_triton_interpreter


# (vocab, rows, do_sample, top_k, top_p, repetition_penalty): every switch of the kernel alone and together,
# vocabularies that are not powers of two (padding), the full-size codebook (6,565). Top-k is left to `select_tokens`.
CASES = [
    (40, 3, False, 0, 1.0, 1.0),
    (40, 3, False, 0, 1.0, 1.2),
    (40, 3, True, 0, 1.0, 1.0),
    (40, 3, True, 0, 0.9, 1.0),
    (300, 2, True, 0, 0.8, 1.2),
    (300, 2, True, 0, 0.5, 1.2),
    (1500, 2, True, 0, 0.9, 1.2),
    (6565, 2, True, 0, 0.9, 1.2),
    # 1 - top_p rounds to 1 in float32: the kernel kept no token and picked id 0 (a bug of 2026-12-01, fixed)
    (40, 4, True, 0, 1e-9, 1.0),
]
GPU_CASES = [(6565, 16, True, 0, 0.9, 1.2), (6565, 4, False, 0, 1.0, 1.2), (6565, 3, True, 0, 0.99, 1.0)]


def case_inputs(vocab, rows, do_sample, top_k, top_p, repetition_penalty, device="cpu"):
    """`(settings, scores, seen, noise)` of one case: scores with many ties (a quarter rounded to integers)."""
    generator = torch.Generator().manual_seed(vocab * 10 + rows)
    settings = SamplingSettings(
        do_sample=do_sample, temperature=0.8, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty
    )
    scores = torch.randn(rows, vocab, generator=generator) * 3
    scores[:, : vocab // 4] = scores[:, : vocab // 4].round()
    seen = torch.rand(rows, vocab, generator=generator) < 0.1
    noise = torch.empty(rows, vocab).exponential_(generator=generator)
    return settings, scores.to(device), seen.to(device), noise.to(device)


def kernel_tokens(settings, scores, seen, noise):
    from funaudiochat_hf.triton_sampling_funaudiochat import launch_sample_tokens

    values = SamplingParameters(scores.device, settings)
    switches = settings.switches
    return launch_sample_tokens(
        scores, seen, noise, values.temperature, values.top_p, values.repetition_penalty, switches.do_sample,
        switches.uses_history, switches.uses_top_p, [],
    )  # fmt: skip


def stable_top_p_keep(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """`TopPLogitsWarper`'s kept tokens `(rows, vocab)` with a stable ascending sort (tied scores by id)."""
    sorted_scores, order = torch.sort(scores, dim=-1, stable=True)
    remove = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
    remove[:, -1] = False
    return ~remove.scatter(-1, order, remove)


_CASES_SCRIPT = """
import json, torch
from test_triton_sampling_funaudiochat import CASES, case_inputs, kernel_tokens
from funaudiochat_hf.sampling_funaudiochat import select_tokens
result = []
for case in CASES:
    settings, scores, seen, noise = case_inputs(*case)
    expected = select_tokens(scores, settings, seen, noise)
    result.append({"case": case, "expected": expected.tolist(), "got": kernel_tokens(settings, scores, seen, noise).tolist()})
print(json.dumps(result))
"""


def test_kernel_matches_select_tokens_in_the_triton_interpreter():
    for case in json.loads(run_in_triton_interpreter(_CASES_SCRIPT)):
        assert case["got"] == case["expected"], case


_BF16_SCRIPT = """
import json, torch
from test_triton_sampling_funaudiochat import CASES, case_inputs, kernel_tokens
from funaudiochat_hf.sampling_funaudiochat import select_tokens
result = []
for case in CASES[:8]:
    settings, scores, seen, noise = case_inputs(*case)
    # As the decode step hands them over: the speech head's 16-bit output, a slice of its padded rows.
    padded = torch.zeros(scores.shape[0], scores.shape[1] + 3, dtype=torch.bfloat16)
    padded[:, : scores.shape[1]] = scores
    scores = padded[:, : scores.shape[1]]
    expected = select_tokens(scores.float(), settings, seen, noise)
    result.append({"case": case, "expected": expected.tolist(), "got": kernel_tokens(settings, scores, seen, noise).tolist()})
print(json.dumps(result))
"""


def test_kernel_reads_16_bit_logits_as_their_float32_values_in_the_triton_interpreter():
    """The decode step hands the speech head's bfloat16 logits to the kernel uncast (one kernel fewer per CRQ
    sub-step): the tokens are those of the float32 values."""
    for case in json.loads(run_in_triton_interpreter(_BF16_SCRIPT)):
        assert case["got"] == case["expected"], case


_INTO_SCRIPT = """
import json, torch
from test_triton_sampling_funaudiochat import CASES, case_inputs
from funaudiochat_hf.sampling_funaudiochat import SamplingParameters, select_tokens
from funaudiochat_hf.triton_sampling_funaudiochat import sample_tokens_into
result = []
for case in CASES:
    settings, scores, seen, noise = case_inputs(*case)
    rows = scores.shape[0]
    expected = select_tokens(scores, settings, seen, noise)
    marked = seen.clone()
    if settings.switches.uses_history:
        marked[torch.arange(rows), expected] = True
    group = torch.full((rows, 5), -1)
    positions = torch.arange(rows * 3).view(rows, 3) * 10  # a prefill's positions: the last column is read
    out, next_positions = torch.full((rows,), -1), torch.full((rows,), -1)
    # The next sub-step's input: a column of the K sub-inputs plus the token's row of the table (1,500 columns: two
    # column blocks).
    sub_inputs = torch.randn(rows, 5, 1500, dtype=torch.float16)
    table = torch.randn(scores.shape[1], 1500, dtype=torch.float16)
    into = torch.zeros(rows, 1, 1500, dtype=torch.float16)
    returned = sample_tokens_into(scores, settings.switches, SamplingParameters("cpu", settings), seen, noise, None,
                                  out=out, group_column=group[:, 2], positions=positions[:, -1],
                                  next_positions=next_positions, next_input=(sub_inputs[:, 3], table, into[:, 0]))
    result.append({"case": case, "expected": expected.tolist(), "out": out.tolist(), "returned_out": returned is out,
                   "group": group.tolist(), "seen_marked": torch.equal(seen, marked),
                   "next_positions": next_positions.tolist(), "expected_positions": (positions[:, -1] + 1).tolist(),
                   "next_input": torch.equal(into[:, 0], sub_inputs[:, 3] + table[expected])})
print(json.dumps(result))
"""


def test_sample_tokens_into_writes_the_sub_steps_state_in_the_triton_interpreter():
    """The CUDA-graphed step's sampler call also writes the token into the next sub-step's input and the group's
    column, marks it in the history (after reading the history for the penalty), advances the position and writes the
    next sub-step's input row (exactly PyTorch's float16 add): the same token as `select_tokens`, every write in
    place."""
    for case in json.loads(run_in_triton_interpreter(_INTO_SCRIPT)):
        expected = case["expected"]
        assert case["out"] == expected and case["returned_out"], case
        assert [row[2] for row in case["group"]] == expected, case
        assert all(value == -1 for row in case["group"] for column, value in enumerate(row) if column != 2), case
        assert case["seen_marked"] and case["next_positions"] == case["expected_positions"], case
        assert case["next_input"], case


_TIES_SCRIPT = """
import json, torch
from test_triton_sampling_funaudiochat import kernel_tokens, stable_top_p_keep
from funaudiochat_hf.sampling_funaudiochat import SamplingSettings
# Scores of 5 distinct values, 12 tokens each: the top-p boundary falls inside a group of tied tokens.
scores = torch.arange(60).remainder(5).float()[None] * 0.5
settings = SamplingSettings(do_sample=True, temperature=1.0, top_p=0.7)
keep = stable_top_p_keep(scores, 0.7)[0]
kept_by_kernel = []
for token in range(60):  # a near-zero draw for `token` wins the race if and only if the token is kept
    noise = torch.ones(1, 60)
    noise[0, token] = 1e-30
    kept_by_kernel.append(kernel_tokens(settings, scores, None, noise).item() == token)
print(json.dumps({"expected": keep.tolist(), "got": kept_by_kernel}))
"""


def test_top_p_keeps_the_ties_a_stable_sort_keeps_in_the_triton_interpreter():
    """Where the top-p boundary splits tied scores, the kernel removes the tied tokens of the lowest ids, as
    `TopPLogitsWarper` over PyTorch's (stable) CUDA sort of a speech row does."""
    result = json.loads(run_in_triton_interpreter(_TIES_SCRIPT))
    expected = torch.tensor(result["expected"])
    assert 0 < expected.sum() < 60
    # The boundary group is partly kept: otherwise the test would not test ties.
    boundary = torch.arange(60).remainder(5)[~expected].max()
    assert expected[torch.arange(60).remainder(5) == boundary].any()
    assert result["got"] == result["expected"]


_RACE_SCRIPT = """
import json, torch
from test_triton_sampling_funaudiochat import kernel_tokens, stable_top_p_keep
from funaudiochat_hf.sampling_funaudiochat import SamplingSettings
generator = torch.Generator().manual_seed(0)
rows, vocab = 48, 300
scores = torch.randn(rows, vocab, generator=generator) * 2
scores[:, ::3] = scores[:, ::3].round()  # ties, some of them at the top-p boundary
result = []
for top_p in (0.05, 0.3, 0.6, 0.9, 0.999):
    settings = SamplingSettings(do_sample=True, temperature=1.0, top_p=top_p)
    noise = torch.empty(rows, vocab).exponential_(generator=generator)
    keep = stable_top_p_keep(scores, top_p)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    unfiltered_winner = (scores.softmax(-1) / noise).argmax(-1)
    result.append({
        "expected": (probs / noise).argmax(-1).tolist(),
        "got": kernel_tokens(settings, scores, None, noise).tolist(),
        "unfiltered_winner_removed": int((~keep.gather(1, unfiltered_winner[:, None])).sum()),
    })
nan_row = torch.full((1, vocab), float("nan"))  # a broken model's row: the passes end, the id is in range
nan_token = kernel_tokens(settings, nan_row, None, noise[:1]).item()
print(json.dumps({"cases": result, "nan_token": nan_token}))
"""


def test_nucleus_race_goes_on_past_removed_winners_in_the_triton_interpreter():
    """Where top-p removes the race's first winner, the kernel drops every token before it in the ascending order and
    runs the race again: 48 rows with ties at each of five top-p values equal the race over the tokens a stable sort
    keeps, also where many winners in a row are removed (top-p 0.05); a row of NaN ends with an id in range."""
    result = json.loads(run_in_triton_interpreter(_RACE_SCRIPT))
    cases = result["cases"]
    for case in cases:
        assert case["got"] == case["expected"]
    assert cases[0]["unfiltered_winner_removed"] > 10  # the race really went on past removed winners
    assert 0 <= result["nan_token"] < 300


# (do_sample, uses_history, uses_top_p)
HOPPER_SWITCHES = [(True, True, True), (True, False, False), (False, True, False)]


@pytest.mark.triton
@pytest.mark.parametrize("write_state", [False, True])
@pytest.mark.parametrize("switches", HOPPER_SWITCHES)
def test_kernel_compiles_for_hopper(switches, write_state):
    """Every path of the kernel through Triton's compiler (sm_90, on the CPU), with and without the sub-step's state
    writes (`sample_tokens_into`). The interpreter tests run its Python only: an edit once passed them and failed to
    compile on the GPU (a variable whose type changed in an `if`)."""
    from funaudiochat_hf import triton_sampling_funaudiochat as sampling

    do_sample, uses_history, uses_top_p = switches
    pointers = ["scores", "seen", "noise", "temperature", "top_p", "penalty", "out", "group", "position",
                "next_position", "input", "table", "next_input"]  # fmt: skip
    kinds = ["*bf16", "*i8", "*fp32", "*fp64", "*fp64", "*fp64", "*i64", "*i64", "*i64", "*i64", "*bf16", "*bf16",
             "*bf16"]  # fmt: skip
    types = {f"{name}_ptr": kind for name, kind in zip(pointers, kinds, strict=True)}  # the strides: i32
    constexprs = {
        "VOCAB": 6565, "BLOCK_V": 8192, "DO_SAMPLE": do_sample, "USES_HISTORY": uses_history,
        "USES_TOP_P": uses_top_p, "PDL": True, "WRITE_STATE": write_state, "WRITE_INPUT": write_state, "BLOCK_C": 1024,
    }  # fmt: skip
    assert hopper_ptx(sampling._sample_kernel, constexprs, types, DecodeKernelConfig().sampler_num_warps)  # Triton's compiler and ptxas


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + GPU_CASES)
def test_kernel_matches_select_tokens_on_gpu(case):
    settings, scores, seen, noise = case_inputs(*case, device="cuda")
    assert torch.equal(kernel_tokens(settings, scores, seen, noise), select_tokens(scores, settings, seen, noise))


@pytest.mark.gpu
def test_top_k_is_left_to_select_tokens():
    from funaudiochat_hf.triton_sampling_funaudiochat import sample_tokens

    settings, scores, seen, noise = case_inputs(6565, 4, True, 40, 0.9, 1.2, device="cuda")
    values = SamplingParameters("cuda", settings)
    tokens = sample_tokens(scores, settings.switches, values, seen, noise)
    assert torch.equal(tokens, select_tokens(scores, settings, seen, noise))


def test_speech_sampler_choice(monkeypatch):
    """"auto" takes the kernel only in a compiled loop where it can run; "triton" elsewhere is a clear error; "torch"
    and speech-to-text never take it; unknown names are refused."""
    from transformers import AutoModel

    import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
    from conftest import FUNAUDIOCHAT_TINY

    from funaudiochat_hf import generation_plan_funaudiochat as plan_module

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()
    compiled = model.speech_generator(backend="compiled")
    if not torch.cuda.is_available():
        assert not compiled.plan(None, 1, False, None).speech_sampler  # CPU: no Triton GPU
        with pytest.raises(ValueError, match="speech_sampler"):
            model.speech_generator(backend="compiled", plan_overrides={"speech_sampler": True}).plan(None, 1, False, None)

    # A Triton GPU (also where Triton is not installed: the choice, not the kernel, is tested here).
    monkeypatch.setattr(plan_module, "triton_available", lambda device: True)
    monkeypatch.setattr(plan_module.DeviceFacts, "of", classmethod(lambda cls, model: cls("cuda", True)))
    monkeypatch.setattr(plan_module, "sampler_kernel_supported", lambda vocab: True)
    assert compiled.plan(None, 1, False, None).speech_sampler
    assert not compiled.plan("eager", 1, False, None).speech_sampler  # eager loop
    assert compiled.plan("cuda_graphs", 1, False, None).speech_sampler
    off = model.speech_generator(backend="compiled", plan_overrides={"speech_sampler": False})
    assert not off.plan(None, 1, False, None).speech_sampler
    assert not compiled.plan(None, 1, True, None).speech_sampler  # disable_speech


_PER_ROW_SCRIPT = """
import json, torch
from test_triton_sampling_funaudiochat import case_inputs
from funaudiochat_hf.sampling_funaudiochat import SamplingParameters, SamplingSettings
from funaudiochat_hf.triton_sampling_funaudiochat import launch_sample_tokens
# Three rows, each with its own temperature / top-p / penalty (a continuous batch of three requests).
_, scores, seen, noise = case_inputs(300, 3, True, 0, 0.9, 1.2)
rows = [SamplingSettings(temperature=0.5, top_p=0.6, repetition_penalty=1.5),
        SamplingSettings(temperature=1.3, top_p=1.0, repetition_penalty=1.0),
        SamplingSettings(temperature=0.8, top_p=0.9, repetition_penalty=1.2)]
per_row = SamplingParameters(rows=3)
for row, settings in enumerate(rows):
    per_row.fill_row_(row, settings)
def launch(values, s, h, n):
    return launch_sample_tokens(s, h, n, values.temperature, values.top_p, values.repetition_penalty,
                                True, True, True, [])
got = launch(per_row, scores, seen, noise).tolist()
alone = [launch(SamplingParameters(settings=settings), scores[r:r + 1], seen[r:r + 1], noise[r:r + 1]).item()
         for r, settings in enumerate(rows)]
print(json.dumps({"expected": alone, "got": got}))
"""


def test_kernel_reads_per_row_values_in_the_triton_interpreter():
    """Per-row sampling values (`SamplingParameters(rows=...)`) give each row the token of its own values alone."""
    result = json.loads(run_in_triton_interpreter(_PER_ROW_SCRIPT))
    assert result["got"] == result["expected"]
