"""Tests of the CRQ's Triton decode projections (`triton_linear_funaudiochat`, the plan parts `crq_linear` / `llm_linear`).

The kernel is checked against the eager composition it replaces (Qwen3RMSNorm, `F.linear`, SiLU * up, residual add):
on CPU through Triton's interpreter (`TRITON_INTERPRET=1`, in a subprocess: the variable must be set before the kernel
is defined; skipped where Triton is not installed), on a GPU for real (marked `gpu`). The interpreter also runs the
whole tiny model through the kernel path (availability checks patched to accept the CPU) against the golden tokens.
"""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModel

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
from funaudiochat_hf.fused_crq_funaudiochat import fused_crq_projections, with_decode_kernels
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

from conftest import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, hopper_ptx, run_in_triton_interpreter


GOLDEN_KWARGS = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.0, eos_token_id=322, pad_token_id=320)

# (rows, out_features, in_features, norm, bias, residual, gated, separate_up): out_features not a multiple of the
# 8-column program tile, in_features not a power of two, every epilogue.
CASES = [
    (1, 40, 64, False, False, False, False, False),
    (1, 48, 96, True, False, False, False, False),  # q/k/v: input norm folded in
    (1, 40, 128, False, False, True, False, False),  # o_proj / down_proj: residual
    (1, 24, 64, True, False, False, True, False),  # the CRQ's fused gate/up: norm + SiLU * up
    (1, 24, 64, True, True, False, True, True),  # the LLM's gate and up as tensors of their own
    (3, 20, 96, True, True, True, False, False),
    (4, 36, 64, True, True, False, True, False),
    (2, 16, 3072, False, False, True, False, False),  # two reduction chunks, the second one masked
    (1, 16, 1312, True, False, False, True, True),  # a wide gated input: six chunks, the last one masked
]


def case_tensors(
    rows, out_features, in_features, norm, bias, residual, gated, separate_up, dtype=torch.float32, device="cpu"
):
    """`(kernel kwargs, expected output)` of one case; the expected output is the eager composition."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight_rows = 2 * out_features if gated else out_features
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(weight_rows, in_features, generator=generator) / in_features**0.5
    bias_t = torch.randn(weight_rows, generator=generator) if bias else None
    residual_t = torch.randn(rows, out_features, generator=generator) if residual else None
    norm_module = None
    if norm:
        norm_module = Qwen3RMSNorm(in_features, eps=1e-5)
        norm_module.weight.data = torch.rand(in_features, generator=generator) + 0.5
        norm_module = norm_module.to(device=device, dtype=dtype)
    x, weight = x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype)
    bias_t = None if bias_t is None else bias_t.to(device=device, dtype=dtype)
    residual_t = None if residual_t is None else residual_t.to(device=device, dtype=dtype)

    inputs = x if norm_module is None else norm_module(x)
    expected = nn.functional.linear(inputs, weight, bias_t)
    if gated:
        gate, up = expected.split(out_features, dim=-1)
        expected = nn.functional.silu(gate) * up
    if residual_t is not None:
        expected = residual_t + expected
    up_weight = up_bias = None
    if separate_up:
        weight, up_weight = weight[:out_features].clone(), weight[out_features:].clone()
        if bias_t is not None:
            bias_t, up_bias = bias_t[:out_features].clone(), bias_t[out_features:].clone()
    kwargs = dict(
        x=x,
        weight=weight,
        bias=bias_t,
        norm_weight=None if norm_module is None else norm_module.weight,
        eps=1e-5,
        residual=residual_t,
        gated=gated,
        up_weight=up_weight,
        up_bias=up_bias,
    )
    return kwargs, expected


_KERNEL_SCRIPT = """
import json
import torch
from test_triton_linear_funaudiochat import CASES, case_tensors
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig
from funaudiochat_hf.triton_linear_funaudiochat import launch_decode_linear
errors = []
# The norm folded into the products (inputs of up to 1,024 features, the default config), then never (wider inputs).
for config in (DecodeKernelConfig(), DecodeKernelConfig(gemv_folded_norm_max_features=0)):
    for case in CASES:
        kwargs, expected = case_tensors(*case)
        got = launch_decode_linear(**kwargs, config=config)
        assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, expected.shape)
        errors.append((got - expected).abs().max().item())
# A strided input row (a view of a wider tensor) and a transposed-storage weight: copied, not misread.
kwargs, expected = case_tensors(*CASES[1])
wide = torch.zeros(1, 2 * kwargs["x"].shape[1])
wide[:, ::2] = kwargs["x"]
kwargs["x"], kwargs["weight"] = wide[:, ::2], kwargs["weight"].t().contiguous().t()
errors.append((launch_decode_linear(**kwargs) - expected).abs().max().item())
print(json.dumps(errors))
"""


def test_kernel_matches_eager_composition_in_the_triton_interpreter():
    """Every epilogue and row count, the norm folded into the products or not; float32, tolerance 1e-5 (same math,
    another summation order)."""
    errors = json.loads(run_in_triton_interpreter(_KERNEL_SCRIPT))
    assert len(errors) == 2 * len(CASES) + 1
    assert all(error < 1e-5 for error in errors), errors  # (not max(): it may pass over a NaN)


# (rows, out_features, in_features, norm, bias, residual, gated, separate_up) of the several-row kernel: 2-16 rows,
# output and reduction tails, every epilogue, the gate/up weight fused (the CRQ) or two weights (the LLM).
ROWS_CASES = [
    (2, 40, 96, True, False, False, False, False),
    (3, 40, 128, False, False, True, False, False),
    (16, 24, 64, True, True, False, True, False),
    (5, 36, 200, True, True, True, False, False),
    (4, 24, 64, True, True, False, True, True),
]

_ROWS_SCRIPT = """
import json
import torch
from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig
from test_triton_linear_funaudiochat import ROWS_CASES, case_tensors
errors, launches = [], []
rows_kernel = triton_linear.launch_rows
triton_linear.launch_rows = lambda *args: launches.append(1) or rows_kernel(*args)
counters = torch.zeros(8, dtype=torch.int32)
# (BLOCK_N, BLOCK_K, SPLIT_K, warps[, stages, swap_ab]): one split; two; four (with a split past the reduction's end
# for K = 96); the products as w @ x^T (SWAP_AB) unsplit and split, with other pipeline depths.
TILES = [(16, 32, 1, 4), (32, 32, 2, 4), (16, 16, 4, 4), (32, 32, 1, 4, 2, True), (16, 16, 2, 4, 4, True)]
for tile in TILES:
    for case in ROWS_CASES:
        config = DecodeKernelConfig().replace(rows_tiles={(case[1], case[2], case[6]): (*tile, 3, False)[:6]})
        kwargs, expected = case_tensors(*case)
        got = triton_linear.launch_decode_linear(**kwargs, split_k_counters=counters, config=config)
        again = triton_linear.launch_decode_linear(**kwargs, split_k_counters=counters, config=config)
        assert got.shape == expected.shape and torch.equal(got, again) and not counters.any(), (tile, case)
        errors.append((got - expected).abs().max().item())
print(json.dumps({"errors": errors, "launches": len(launches), "tiles": len(TILES)}))
"""


def test_rows_kernel_matches_eager_composition_in_the_triton_interpreter():
    """With `split_k_counters`, 2-16 rows take the several-row kernel, its reduction in 1, 2 or 4 splits, its products
    as `x @ w^T` or `w @ x^T` (SWAP_AB): the eager composition's values (float32, 1e-5), the same output twice, its
    counters left at zero."""
    result = json.loads(run_in_triton_interpreter(_ROWS_SCRIPT))
    tiles = result["tiles"]
    assert tiles == 5 and result["launches"] == 2 * tiles * len(ROWS_CASES), result
    assert len(result["errors"]) == tiles * len(ROWS_CASES) and all(e < 1e-5 for e in result["errors"]), result


_SQUARES_SCRIPT = """
import json
import torch
from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig
from test_triton_linear_funaudiochat import case_tensors
counters = torch.zeros(16, dtype=torch.int32)
generator = torch.Generator().manual_seed(3)
results = []
# (BLOCK_N, BLOCK_K, SPLIT_K, warps[, stages, swap_ab]): one split, two, and w @ x^T.
for tile in [(16, 32, 1, 4), (32, 32, 2, 4), (32, 32, 1, 4, 2, True)]:
    # A residual projection (o_proj / down_proj: 40 outputs, a partial last group and tile) writes h and its sums of
    # squares, which a normed projection of h (gate/up, the next q/k/v) reads instead of all of h.
    for rows, bias in [(3, True), (16, False)]:
        tile = (*tile, 3, False)[:6]
        config = DecodeKernelConfig().replace(rows_tiles={(40, 64, False): tile, (24, 40, True): tile,
                                                          (48, 40, False): tile})  # fmt: skip
        x = torch.randn(rows, 64, generator=generator)
        weight = torch.randn(40, 64, generator=generator) / 8
        residual = torch.randn(rows, 40, generator=generator)
        bias_t = torch.randn(40, generator=generator) if bias else None
        h, squares = triton_linear.launch_decode_linear(
            x, weight, bias_t, residual=residual, split_k_counters=counters, with_squares=True, config=config
        )
        plain = triton_linear.launch_decode_linear(x, weight, bias_t, residual=residual, split_k_counters=counters,
                                                   config=config)  # fmt: skip
        expected_squares = triton_linear.row_squares(h)
        errors = {"h": (h - plain).abs().max().item(),
                  "squares": ((squares - expected_squares).abs() / expected_squares).max().item()}
        for out_features, gated in [(24, True), (48, False)]:
            norm_weight = torch.rand(40, generator=generator) + 0.5
            next_weight = torch.randn(out_features * (2 if gated else 1), 40, generator=generator) / 6
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight
            expected = torch.nn.functional.linear(normed, next_weight)
            if gated:
                gate, up = expected.split(out_features, dim=-1)
                expected = torch.nn.functional.silu(gate) * up
            args = dict(x=h, weight=next_weight, norm_weight=norm_weight, eps=1e-5, gated=gated,
                        split_k_counters=counters, config=config)
            got = triton_linear.launch_decode_linear(**args, norm_squares=squares)
            errors[f"next {out_features}"] = (got - expected).abs().max().item()
            if not gated:  # sums of squares 4x larger: an RMS 2x larger, the projection of a normed input halved
                quadrupled = triton_linear.launch_decode_linear(**args, norm_squares=squares * 4)
                errors["quadrupled"] = (2 * quadrupled - got).abs().max().item()
        results.append(errors)
# One row: the GEMV kernel, its output's sums of squares computed by `row_squares`.
x = torch.randn(1, 64, generator=generator)
one, one_squares = triton_linear.launch_decode_linear(x, weight, split_k_counters=counters, with_squares=True)
one_error = (one_squares - triton_linear.row_squares(one)).abs().max().item()
print(json.dumps({"results": results, "one_row": one_error, "shape": list(squares.shape),
                  "counters": counters.abs().sum().item()}))
"""


def test_rows_kernel_sums_of_squares_feed_the_next_norm_in_the_triton_interpreter():
    """`with_squares`: the several-row kernel's epilogue stores its rounded output's sums of squares by 16 columns (a
    partial last group, 1 or 2 splits, SWAP_AB), equal to `row_squares` of the output (float32, relative 1e-5), and
    the output unchanged; a normed projection given them as `norm_squares` equals the eager norm and projection
    (1e-5), and with them quadrupled its output halves (it reads them, not its input)."""
    result = json.loads(run_in_triton_interpreter(_SQUARES_SCRIPT))
    assert len(result["results"]) == 6 and result["shape"] == [16, 3] and result["counters"] == 0, result
    for errors in result["results"]:
        assert errors["h"] == 0 and errors["squares"] < 1e-5, result
        assert errors["next 24"] < 1e-5 and errors["next 48"] < 1e-5 and errors["quadrupled"] < 1e-5, result
    assert result["one_row"] == 0, result


def test_norm_squares_are_checked():
    """`norm_squares` of the wrong shape, dtype or layout, or without a norm, raise before any launch."""
    x, weight, norm_weight = torch.zeros(4, 40), torch.zeros(8, 40), torch.ones(40)
    good = torch.zeros(4, 3)
    assert triton_linear.squares_groups(40) == 3 and triton_linear.squares_groups(48) == 3
    with pytest.raises(ValueError, match="give `norm_weight`"):
        triton_linear.launch_decode_linear(x, weight, norm_squares=good)
    for bad in (torch.zeros(4, 2), torch.zeros(3, 3), good.double()):
        with pytest.raises(ValueError, match=r"float32 of shape \(4, 3\)"):
            triton_linear.launch_decode_linear(x, weight, norm_weight=norm_weight, norm_squares=bad)
    with pytest.raises(ValueError, match="contiguous"):
        triton_linear.launch_decode_linear(x, weight, norm_weight=norm_weight, norm_squares=torch.zeros(3, 4).t())


def test_row_squares_sums_each_group_of_columns():
    rows = torch.arange(40.0).view(2, 20)
    squares = triton_linear.row_squares(rows.to(torch.bfloat16))
    assert squares.dtype == torch.float32 and squares.shape == (2, 2)
    expected = torch.stack([rows[:, :16].square().sum(-1), rows[:, 16:].square().sum(-1)], dim=-1)
    torch.testing.assert_close(squares, expected)


def test_gemv_kernel_folds_the_norm_of_narrow_inputs(monkeypatch):
    """The one-row kernel folds its input norm into the products for inputs of up to the config's
    `gemv_folded_norm_max_features` (1,024 by default: the CRQ's q/k/v and gate/up), not for wider ones (the LLM's
    4,096, measured slower folded)."""
    pytest.importorskip("triton")
    from funaudiochat_hf import triton_linear_gemv_funaudiochat as gemv

    launches = []

    class Recorded:  # `_decode_linear_kernel[grid](...)`: the launch's constexprs recorded, nothing run
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(gemv, "_decode_linear_kernel", Recorded())
    for config in (None, DecodeKernelConfig(gemv_folded_norm_max_features=4096)):
        for in_features in (1024, 4096):
            x, weight, norm_weight = torch.zeros(1, in_features), torch.zeros(64, in_features), torch.ones(in_features)
            triton_linear.launch_decode_linear(x, weight, norm_weight=norm_weight, config=config)
    folded = [(kwargs["K"], kwargs["FOLDED_NORM"]) for kwargs in launches]
    assert folded == [(1024, True), (4096, False), (1024, True), (4096, True)]


@pytest.mark.triton
def test_rows_kernel_counters_are_checked():
    """Too few counters raise before any launch; a stack's counters cover its widest projection's column tiles and
    the decode attention's arrivals."""
    from transformers import Qwen3Config

    x, weight = torch.zeros(2, 4096), torch.zeros(512, 4096)
    with pytest.raises(ValueError, match="16 or more int32 zeros"):
        triton_linear.launch_decode_linear(x, weight, split_k_counters=torch.zeros(4, dtype=torch.int32))
    config = Qwen3Config(
        hidden_size=64, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=8
    )
    assert triton_linear.split_k_counters_for(config, "cpu").shape == (13,)  # 200 outputs / 16-column tiles
    wider = Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=16, num_key_value_heads=8, head_dim=8)
    assert triton_linear.split_k_counters_for([config, wider], "cpu").shape == (16,)  # 256 q/k/v outputs
    # The decode attention's arrivals at 16 rows (the last split merges): 16 rows x 8 KV heads, and one more.
    assert triton_linear.split_k_counters_for([config, wider], "cpu", batch_size=16).shape == (129,)


def test_rows_kernel_takes_the_first_tile_that_fits_the_shared_memory():
    """A tuned several-row tile can need more shared memory than a program may use (the CRQ's gate/up tile in float32,
    the bfloat16 tiles on GPUs with less shared memory): the launcher takes the first of `rows_tile_candidates` whose
    need fits (fewer pipeline stages, then narrower reduction chunks, then fewer columns), its columns narrowed to
    divide the part boundaries, and raises a clear error when none fits. Deterministic: no memo of earlier launches."""
    pytest.importorskip("triton")
    from funaudiochat_hf.triton_linear_rows_funaudiochat import fitted_rows_tile

    tuned = (128, 256, 4, 8, 2, True)
    tried = []

    def fits(tile):  # a GPU that holds one pipeline stage of 64-input chunks at most
        tried.append(tile)
        return tile[4] == 1 and tile[1] <= 64

    assert fitted_rows_tile(tuned, [3072], fits) == (128, 64, 4, 8, 1, True)
    assert tried == [tuned, (128, 256, 4, 8, 1, True), (128, 128, 4, 8, 1, True), (128, 64, 4, 8, 1, True)]
    assert fitted_rows_tile(tuned, [3072], fits) == (128, 64, 4, 8, 1, True)  # the same answer every time
    assert fitted_rows_tile(tuned, [48, 96], lambda tile: True) == (16, 256, 4, 8, 2, True)  # 16 divides 48
    assert fitted_rows_tile(tuned, [24, 48], lambda tile: True) is None  # no 16-column tile divides 24
    with pytest.raises(ValueError, match="shared memory"):
        fitted_rows_tile(tuned, [3072], lambda tile: False)


_PARTS_SCRIPT = """
import json
import torch
from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
errors, rows_kernel_outputs = [], []
rows_kernel = triton_linear.launch_rows


def counted_rows_kernel(*args):
    rows_kernel_outputs.append(rows_kernel(*args))
    return rows_kernel_outputs[-1]


triton_linear.launch_rows = counted_rows_kernel
counters = torch.zeros(16, dtype=torch.int32)
generator = torch.Generator().manual_seed(0)
# (part sizes, bias): a q/k/v-like split; parts of 6 and 10 columns (the 8-column tile shrinks to 2 so that a program
# reads one part; the several-row kernel's 16-column tile cannot, so 3 rows take the GEMV kernel); two parts. One row
# (the GEMV kernel), three rows with the several-row kernel's counters.
for rows in (1, 3):
    for sizes, bias in [((32, 16, 16), False), ((32, 16, 16), True), ((6, 10, 24), True), ((48, 32), False)]:
        x = torch.randn(rows, 96, generator=generator)
        norm_weight = torch.rand(96, generator=generator) + 0.5
        weights = [torch.randn(n, 96, generator=generator) / 10 for n in sizes]
        biases = [torch.randn(n, generator=generator) if bias else None for n in sizes]
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * norm_weight
        expected = torch.cat([torch.nn.functional.linear(normed, w, b) for w, b in zip(weights, biases)], dim=-1)
        got = triton_linear.launch_decode_linear(
            x, weights[0], biases[0], norm_weight, 1e-5, part_weights=weights[1:],
            part_biases=biases[1:] if bias else [], split_k_counters=counters if rows > 1 else None,
        )
        assert got.shape == expected.shape and not counters.any(), (got.shape, expected.shape)
        errors.append((got - expected).abs().max().item())
print(json.dumps({"errors": errors, "rows_kernel": [out is not None for out in rows_kernel_outputs]}))
"""


def test_part_weights_give_the_concatenated_outputs_in_the_triton_interpreter():
    """Several weights in one kernel (`part_weights`: the LLM's q, k and v): the outputs of the separate projections
    side by side, with and without biases, also where the part sizes force a narrower program tile (float32, 1e-5);
    at 3 rows through the several-row kernel, except where a part boundary is not a multiple of its 16 columns."""
    result = json.loads(run_in_triton_interpreter(_PARTS_SCRIPT))
    errors = result["errors"]
    assert len(errors) == 8 and all(error < 1e-5 for error in errors), errors
    assert result["rows_kernel"] == [True, True, False, True], result


def test_part_weights_are_checked():
    x, weight = torch.zeros(1, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="at most two"):
        triton_linear.launch_decode_linear(x, weight, part_weights=[weight] * 3)
    with pytest.raises(ValueError, match="one bias per part"):
        triton_linear.launch_decode_linear(x, weight, torch.zeros(4), part_weights=[weight])


_TUNED_TILES_SCRIPT = """
import json
from funaudiochat_hf import triton_config_funaudiochat, triton_linear_funaudiochat as triton_linear
from test_triton_linear_funaudiochat import CASES, case_tensors
errors = {}
for tile in sorted({tile for _, tile in triton_config_funaudiochat._SM90_GEMV_TILES}):
    # Every case's shape takes this tile (its BLOCK_K capped at the case's input width, as for any shape).
    config = triton_config_funaudiochat.DecodeKernelConfig().replace(
        gemv_tiles={(case[1], case[2], case[6]): tile for case in CASES}
    )
    for case in CASES:
        kwargs, expected = case_tensors(*case)
        assert config.gemv_kernel_tile(case[1], case[2], case[6])[0] == tile[0]
        error = (triton_linear.launch_decode_linear(**kwargs, config=config) - expected).abs().max().item()
        errors.setdefault(str(tile), []).append(error)
print(json.dumps(errors))
"""


def test_tuned_tiles_match_eager_composition_in_the_triton_interpreter():
    """Each tuned GEMV tile of sm_90 (2-8 columns per program, other reduction chunks) on every case: same results."""
    from funaudiochat_hf.triton_config_funaudiochat import _SM90_GEMV_TILES

    errors = json.loads(run_in_triton_interpreter(_TUNED_TILES_SCRIPT))
    assert len(errors) == len({tile for _, tile in _SM90_GEMV_TILES}) >= 5, errors
    assert all(error < 1e-5 for tile_errors in errors.values() for error in tile_errors), errors


_GENERATE_SCRIPT = """
import json, sys, torch
from safetensors.torch import load_file
from transformers import AutoModel
import funaudiochat_hf
from funaudiochat_hf import decoder_stack_funaudiochat, generation_step_funaudiochat, triton_linear_funaudiochat
from funaudiochat_hf import generation_plan_funaudiochat, generation_state_funaudiochat
from funaudiochat_hf import triton_attention_funaudiochat, triton_attention_inputs_funaudiochat
from funaudiochat_hf import fused_crq_funaudiochat, triton_sampling_funaudiochat, triton_text_head_funaudiochat
from test_triton_linear_funaudiochat import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, GOLDEN_KWARGS

# Let the CPU take the kernel path (the interpreter runs the kernels on CPU tensors): plans as on a Triton GPU, their
# steps run directly (no CUDA graph off CUDA); and count the launches.
generation_plan_funaudiochat.DeviceFacts.of = classmethod(lambda cls, model: cls("cuda", True))
generation_state_funaudiochat.CapturedStep = lambda function, key: function
rows = lambda h: h.numel() // h.shape[-1]
use_kernels = lambda h: rows(h) <= triton_linear_funaudiochat.MAX_ROWS
decoder_stack_funaudiochat.use_decode_kernels = generation_step_funaudiochat.use_decode_kernels = use_kernels
generation_step_funaudiochat.use_sampler_kernel = lambda scores: True
model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()
tower = model.audio_invert_tower
head = {m.weight.data_ptr() for m in (tower.input_matching, tower.output_matching, tower.lm_head)}
calls = []
launch = triton_linear_funaudiochat.launch_decode_linear
def counted(*args, **kwargs):
    folded = generator._weights.folded  # the compiled run folds the head's linears
    folded = () if folded is None else (folded.head.weight.data_ptr(), folded.sub_inputs.weight.data_ptr())
    if args[1].data_ptr() in head:
        calls.append("head")
    elif args[1].data_ptr() in folded:
        calls.append("folded")
    elif args[9]:  # part weights: the LLM's q, k and v in one kernel
        calls.append("grouped_qkv")
    else:
        calls.append(("llm_mlp" if args[7] is not None else "crq_mlp") if args[6] else "plain")
    return launch(*args, **kwargs)
triton_linear_funaudiochat.launch_decode_linear = counted  # what the operators call (also when compiled)
class CountedKernel:  # stands in for a kernel, counting its launches
    def __init__(self, kernel, name):
        self.kernel, self.name = kernel, name
    def __getitem__(self, grid):
        calls.append(self.name)
        return self.kernel[grid]
for module, name, kind in ((triton_attention_inputs_funaudiochat, "_attention_inputs_kernel", "attention_inputs"),
                           (triton_attention_funaudiochat, "_split_kernel", "attention"),
                           (triton_sampling_funaudiochat, "_sample_kernel", "sampler"),
                           (triton_text_head_funaudiochat, "_text_head_kernel", "text_head")):
    setattr(module, name, CountedKernel(getattr(module, name), kind))

inputs = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")
inputs.pop("waveform_16k")
golden = load_file(FUNAUDIOCHAT_GOLDEN / "e_generate_rep1.0.safetensors")
result = {}
# The first two runs: the CRQ's kernels, then the LLM's too, run eagerly ("cuda_graphs" without its graph here), with
# the other fast parts off. The last run compiles the loop (its parts, fullgraph: the kernels' operators, the cache
# writes among them) with every part: the Triton attention, which takes the attention inputs' work into its
# kernels, the folded linears, the sampler and text head kernels.
only_linears = {"triton_attention": False, "fold_crq_matching": False, "speech_sampler": False,
                "overlap_text_head": False}
runs = (
    ("torch", "cuda_graphs", {**only_linears, "llm_linear": False}, {}),
    ("triton", "cuda_graphs", only_linears, {}),
    ("compiled", "compiled", {}, {"compile_config": {"backend": "aot_eager", "fullgraph": True}}),
)
# 8 of the golden run's 16 steps (6 of them with speech): greedy decoding's first steps are a prefix of the golden
# sequences and speech ids (each interpreted step is slow: the whole run took ~5 minutes of the CI's test time).
steps = 8
kwargs = dict(GOLDEN_KWARGS, max_new_tokens=steps)
for name, backend, overrides, options in runs:
    calls.clear()
    generator = model.speech_generator(backend=backend, plan_overrides=overrides)
    out = generator.generate(**inputs, **kwargs, **options)
    length, speech = out.sequences.shape[1], out.speech_ids.shape[1]
    result[name] = {
        "sequences": length == inputs["input_ids"].shape[1] + steps
        and torch.equal(out.sequences, golden["sequences"][:, :length]),
        "speech_ids": speech >= 5 * (steps - 2) and torch.equal(out.speech_ids, golden["speech_ids"][:, :speech]),
        **{kind: calls.count(kind) for kind in ("plain", "grouped_qkv", "crq_mlp", "llm_mlp", "attention_inputs",
                                                 "attention", "head", "folded", "sampler", "text_head")},
    }
result["crq_layers"] = tower.crq_transformer.config.num_hidden_layers
result["decode_steps"] = steps - 1
print(json.dumps(result))
"""


def test_generate_through_the_kernels_matches_reference_in_the_triton_interpreter():
    """The plan's `crq_linear`: the CRQ decode sub-steps run through the kernels (4 launches per layer and sub-step, and
    the attention inputs' kernel; input matching, output matching and speech head around the stack);
    `llm_linear` adds the LLM's decode steps (4 per layer and step: q, k and v in one kernel over the three
    weights, the gate and up weights unfused; and the attention inputs). The compiled run also picks its speech tokens
    with the sampler kernel, and its decode steps' text logits with the text head kernel (inline here, off CUDA),
    and folds the linears around the CRQ stack (`fold_crq_matching`:
    one folded head per sub-step, one folded sub-input projection per decode step). The greedy tokens of the first 8
    steps equal the official implementation's either way, also with the loop compiled whole."""
    result = json.loads(run_in_triton_interpreter(_GENERATE_SCRIPT))
    crq_layers = result.pop("crq_layers")
    decode_steps = result.pop("decode_steps")
    for run in result.values():
        assert run["sequences"] and run["speech_ids"], result
    crq_only, both, compiled = result["torch"], result["triton"], result["compiled"]
    # Per decode sub-step the three head projections; the prefill's CRQ pass (several positions) only its last two.
    sub_steps = crq_only["crq_mlp"] // crq_layers
    assert crq_only["head"] == both["head"] == 3 * sub_steps + 2, result
    assert crq_only["folded"] == both["folded"] == compiled["head"] == 0, result
    # The prefill's sub-inputs are several rows (cuBLAS); its first sub-step's head is one row, as every other's.
    assert compiled["folded"] == sub_steps + 1 + decode_steps, result
    assert crq_only["sampler"] == both["sampler"] == 0, result  # turned off in those runs
    assert compiled["sampler"] == sub_steps + 1, result
    assert crq_only["text_head"] == both["text_head"] == 0 and compiled["text_head"] == decode_steps, result
    assert crq_only["crq_mlp"] > 0 and crq_only["llm_mlp"] == 0 and crq_only["plain"] == 3 * crq_only["crq_mlp"]
    assert both["crq_mlp"] == crq_only["crq_mlp"] and both["llm_mlp"] > 0
    assert crq_only["grouped_qkv"] == 0 and both["grouped_qkv"] == both["llm_mlp"], result
    assert both["plain"] == 3 * both["crq_mlp"] + 2 * both["llm_mlp"], result
    assert crq_only["attention_inputs"] == crq_only["crq_mlp"], result
    assert both["attention_inputs"] == both["crq_mlp"] + both["llm_mlp"], result
    assert compiled["crq_mlp"] > 0 and compiled["llm_mlp"] > 0 and compiled["attention_inputs"] == 0, result
    assert compiled["attention"] == compiled["crq_mlp"] + compiled["llm_mlp"], result  # one per layer step


def test_falls_back_off_cuda_and_for_many_rows():
    assert not triton_linear.use_decode_kernels(torch.zeros(1, 1, 8))  # CPU tensor
    if torch.cuda.is_available() and triton_linear.triton is not None:
        assert triton_linear.use_decode_kernels(torch.zeros(1, 1, 8, device="cuda"))
        assert not triton_linear.use_decode_kernels(torch.zeros(2, 1, 8, device="cuda"))  # a batch: cuBLAS
        assert not triton_linear.use_decode_kernels(torch.zeros(1, 5, 8, device="cuda"))  # a prefill chunk


def _linear_ptx(pdl: bool, gated: bool, **overrides) -> list[str]:
    pytest.importorskip("triton")
    constexprs = dict(N=3072, K=1024, EPS=1e-6, HAS_BIAS=False, HAS_NORM=True, HAS_RESIDUAL=False, GATED=gated,
                      BLOCK_N=8, BLOCK_K=512, PDL=pdl, PART_1=0, PART_2=0, FOLDED_NORM=False)
    constexprs.update(overrides)
    from funaudiochat_hf.triton_linear_gemv_funaudiochat import _decode_linear_kernel

    types = {name: "*bf16" for name in _decode_linear_kernel.arg_names if name.endswith("_ptr")}
    return hopper_ptx(_decode_linear_kernel, constexprs, types, num_warps=8).splitlines()


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_programmatic_launch_fetches_weights_before_waiting_for_the_previous_kernel(gated, folded):
    """As a programmatic dependent launch (H100 / H200), the GEMV streams its first weight tiles (per weight: 8 rows x
    512 bf16 = 8 KB, 16 bytes per load over 256 threads = 2 loads per thread) while the previous kernel finishes and
    reads its input only after `griddepcontrol.wait`; the next kernel is let in after the reduction. Plain launches
    compile without either instruction. (The norm weight's first chunk is fetched early too, one more load.) The same
    with the norm folded into the products (`FOLDED_NORM`)."""
    lines = _linear_ptx(pdl=True, gated=gated, FOLDED_NORM=folded)
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    launch = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    early = [lines[i] for i in loads if i < wait]
    weight_loads = [line for line in early if ".L1::no_allocate" in line or "evict_first" in line]
    assert len(weight_loads) == (4 if gated else 2) and len(early) == len(weight_loads) + 1, early
    assert wait < launch and any(wait < i < launch for i in loads)
    assert not any("griddepcontrol" in line for line in _linear_ptx(pdl=False, gated=gated, FOLDED_NORM=folded))


_PDL_PATH_SCRIPT = """
import json

import torch
import triton.language as tl

# The interpreter runs no PTX: the programmatic-launch instructions as no-ops, so that the PDL path's loads (the first
# weight tiles and norm weight chunk before the wait, then used in the reduction) run here.
tl.extra.cuda.gdc_wait = lambda *args, **kwargs: None
tl.extra.cuda.gdc_launch_dependents = lambda *args, **kwargs: None

from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

torch.manual_seed(0)
errors = []
for out_features, in_features, gated, norm, residual in [(48, 96, True, True, False), (40, 80, False, False, True),
                                                         (32, 64, False, True, True), (24, 32, True, True, False)]:
    x, weight = torch.randn(2, in_features), torch.randn((1 + gated) * out_features, in_features)
    norm_weight, residual_rows = torch.rand(in_features) + 0.5, torch.randn(2, out_features)
    outputs = []
    for pdl in (False, True):
        config = DecodeKernelConfig(programmatic_launch=pdl).replace(
            gemv_tiles={(out_features, in_features, gated): (8, 32, 2)}  # 1 to 3 reduction chunks
        )
        outputs.append(triton_linear.launch_decode_linear(
            x, weight, None, norm_weight if norm else None, 1e-6, residual_rows if residual else None, gated,
            config=config,
        ))
    errors.append((outputs[1] - outputs[0]).abs().max().item())
print(json.dumps(errors))
"""


def test_programmatic_launch_path_matches_the_plain_one_in_the_triton_interpreter():
    """The GEMV launched as a programmatic dependent launch (its first reduction chunk's weight tiles and the norm
    weight's first chunk fetched before the wait, then used in the reduction) gives the plain launch's values
    exactly, for one to three chunks, gated or not, with or without the norm and the residual: the PTX tests only see
    where the loads are, this checks what they feed. (A draft that also fetched the second chunk early left its
    indices where the norm weight's early load read them: outputs off by up to 82 here.)"""
    errors = json.loads(run_in_triton_interpreter(_PDL_PATH_SCRIPT))
    assert errors == [0.0] * 4


@pytest.mark.parametrize("norm", [True, False])
def test_gemv_reads_its_norm_weight_before_waiting_and_its_residual_with_its_input(norm):
    """The GEMV leaves no global load on its critical path after the wait but its input's: the norm weight (a weight,
    never written by a decode step) is fetched before `griddepcontrol.wait` with the first weight tiles, and the
    residual (an earlier kernel's output) with the input right after it, so neither costs an L2 round trip after the
    norm's or the products' reduction (a one-chunk reduction: the CRQ's q/k/v and o_proj)."""
    lines = _linear_ptx(pdl=True, gated=False, N=4096, BLOCK_N=4, BLOCK_K=1024, HAS_NORM=norm, HAS_RESIDUAL=not norm)
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    release = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    if norm:
        rsqrt = next(i for i, line in enumerate(lines) if "rsqrt" in line and "exit" not in line)
        assert [lines[i] for i in loads if i < wait and "evict_first" not in lines[i]], "no norm weight load"
        assert not [lines[i] for i in loads if i > rsqrt]
    else:
        assert [i for i in loads if wait < i < release]  # the input and the residual
        assert not [lines[i] for i in loads if i > release]


def _rows_kernel_ptx(constexprs: dict) -> list[str]:
    """The several-row kernel's sm_90 PTX lines at 8 warps, bfloat16 tensors (float32 partials, int32 counters)."""
    from funaudiochat_hf.triton_linear_rows_funaudiochat import _decode_rows_kernel

    types = {name: "*bf16" for name in _decode_rows_kernel.arg_names if name.endswith("_ptr")}
    types.update(partials_ptr="*fp32", counters_ptr="*i32", norm_squares_ptr="*fp32", squares_ptr="*fp32")
    # The sums of squares neither read nor stored unless the caller asks.
    constexprs = {"NORM_GROUPS": 0, "NORM_GROUPS_BLOCK": 1, "STORE_SQUARES": False, "GROUP": 16, **constexprs}
    return hopper_ptx(_decode_rows_kernel, constexprs, types, num_warps=8).splitlines()


@pytest.mark.parametrize("split_k", [1, 2])
def test_rows_kernel_counts_arrivals_after_a_barrier_and_fetches_weights_before_waiting(split_k):
    """The several-row kernel as a programmatic dependent launch (sm_90 PTX): its first weight tiles (gate and up) are
    fetched before `griddepcontrol.wait`; with a split reduction, all threads' partial stores are behind a barrier
    before the one acquire-release atomic that counts the program in, and no atomic without a split."""
    pytest.importorskip("triton")
    constexprs = dict(N=3072, K=1024, EPS=1e-6, HAS_BIAS=False, HAS_NORM=True, HAS_RESIDUAL=False, GATED=True,
                      BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=split_k, K_SPLIT=1024 // split_k, PRECISION="tf32",
                      NORM_BLOCK_K=512, PDL=True, PART_1=0, PART_2=0, NUM_STAGES=3, SWAP_AB=False)  # fmt: skip
    lines = _rows_kernel_ptx(constexprs)
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    assert any("griddepcontrol.launch_dependents" in line for line in lines[wait:])
    early = [line for line in lines[:wait] if "ld.global" in line]
    assert early and all("evict_first" in line or "no_allocate" in line for line in early), early
    atomics = [i for i, line in enumerate(lines) if "atom." in line]
    if split_k == 1:
        assert not atomics
        return
    assert len(atomics) == 1 and "acq_rel" in lines[atomics[0]] and "gpu" in lines[atomics[0]], atomics
    assert any("bar.sync" in line for line in lines[wait : atomics[0]])


def test_rows_kernel_fetches_its_residual_before_counting_in():
    """With a split reduction, every program reads its residual tile after `griddepcontrol.wait` and before the atomic
    that counts it in, so the tile's last program has no more reads left after the atomic with a residual than
    without (sm_90 PTX)."""
    pytest.importorskip("triton")
    reads_after_atomic = {}
    for residual in (True, False):
        constexprs = dict(N=1024, K=2048, EPS=1e-6, HAS_BIAS=False, HAS_NORM=False, HAS_RESIDUAL=residual,
                          GATED=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=8, K_SPLIT=256, PRECISION="tf32",
                          NORM_BLOCK_K=512, PDL=True, PART_1=0, PART_2=0, NUM_STAGES=2, SWAP_AB=False)  # fmt: skip
        lines = _rows_kernel_ptx(constexprs)
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        atomic = next(i for i, line in enumerate(lines) if "atom." in line)
        assert wait < atomic
        reads_after_atomic[residual] = sum("ld.global" in line for line in lines[atomic:])
        if residual:
            assert any("ld.global" in line for line in lines[wait:atomic])
    assert reads_after_atomic[True] == reads_after_atomic[False], reads_after_atomic


def _tiny_model():
    return AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()


def _on_a_triton_gpu(monkeypatch):
    """Plans as on a CUDA GPU with Triton, their steps run directly (no CUDA graph on this CPU)."""
    from funaudiochat_hf import generation_plan_funaudiochat as plan_module
    from funaudiochat_hf import generation_state_funaudiochat as state

    monkeypatch.setattr(plan_module.DeviceFacts, "of", classmethod(lambda cls, model: cls("cuda", True)))
    monkeypatch.setattr(state, "CapturedStep", lambda function, key: function)


def _plan(model, batch: int = 1, backend: str = "compiled", **overrides):
    return model.speech_generator(backend=backend, plan_overrides=overrides).plan(None, batch, False, None)


def test_crq_head_takes_the_kernels_only_as_plain_linears(monkeypatch):
    """With `crq_linear` on, the CRQ's input / output matching and speech head take the GEMV kernel too, unless one of
    them is not a plain `nn.Linear` (a LoRA wrapper, a quantized layer: the kernel would read its raw weight)."""
    model = _tiny_model()
    _on_a_triton_gpu(monkeypatch)
    assert _plan(model).crq_head_linear
    assert not _plan(model, crq_linear=False).crq_head_linear

    class Wrapped(nn.Linear):
        pass

    head = model.audio_invert_tower.lm_head
    wrapped = Wrapped(head.in_features, head.out_features, bias=False)
    wrapped.weight = head.weight
    model.audio_invert_tower.lm_head = wrapped
    plan = _plan(model)
    assert plan.crq_linear and not plan.crq_head_linear


def test_batched_decode_steps_hand_both_stacks_the_workspace_counters(monkeypatch, inputs):
    """With `llm_linear` and `crq_linear` on, every decode step of the LLM and of the CRQ gets the workspace's split-K
    counters, which let 2 to 16 rows take the several-row kernel on CUDA (on CPU the layers keep their torch path, so
    the tokens equal the run without the kernels)."""
    from funaudiochat_hf import generation_step_funaudiochat as step

    model = _tiny_model()
    _on_a_triton_gpu(monkeypatch)
    calls = []
    stack_forward = step._stack_forward

    def recording(stack, inputs_embeds, *args, **kwargs):
        counters = kwargs.get("split_k_counters", args[6] if len(args) > 6 else None)
        calls.append((stack is model.language_model.model, inputs_embeds.shape[1], counters))
        return stack_forward(stack, inputs_embeds, *args, **kwargs)

    monkeypatch.setattr(step, "_stack_forward", recording)
    batch = {name: torch.cat([value, value]) for name, value in inputs.items()}
    kwargs = dict(GOLDEN_KWARGS, max_new_tokens=3)
    # The text head's kernel has no CPU path outside the interpreter.
    generator = model.speech_generator(2, backend="cuda_graphs", plan_overrides={"overlap_text_head": False})
    kernels = generator.generate(**batch, **kwargs)
    decode_steps = [(is_llm, counters) for is_llm, positions, counters in calls if positions == 1]
    llm_counters = [counters for is_llm, counters in decode_steps if is_llm]
    crq_counters = [counters for is_llm, counters in decode_steps if not is_llm]
    assert llm_counters and crq_counters
    assert all(c is not None and c.dtype == torch.int32 for c in crq_counters + llm_counters)
    plain = model.generate_speech(**batch, **kwargs, backend="eager")
    assert torch.equal(kernels.sequences, plain.sequences) and torch.equal(kernels.speech_ids, plain.speech_ids)


def test_speech_head_is_padded_only_where_cublas_runs_it(monkeypatch):
    """The padded copy of the speech head (`padded_output_linear`) is for the head's cuBLAS multiplications: none for
    a one-row loop whose head takes the GEMV kernel, nor for the eager loop, nor where the head is folded."""
    model = _tiny_model()
    _on_a_triton_gpu(monkeypatch)
    # Folded (the default), the head is a padded product of its own: no copy of the unfolded head.
    assert not _plan(model, batch=2, crq_linear=False).pad_speech_head
    assert not _plan(model, fold_crq_matching=False).pad_speech_head  # one row: the GEMV kernel
    assert _plan(model, batch=2, fold_crq_matching=False).pad_speech_head  # two rows: cuBLAS
    assert _plan(model, fold_crq_matching=False, crq_linear=False).pad_speech_head
    assert not _plan(model, batch=2, backend="eager").pad_speech_head


def test_linear_kernel_choice(monkeypatch):
    """The fast backends take the CRQ's kernels where they can run over the fused copies; forcing them elsewhere is a
    clear error; overrides and speech-to-text turn them off; a sharded model runs eagerly."""
    model = _tiny_model()
    if not torch.cuda.is_available():
        assert not _plan(model).crq_linear and not _plan(model).llm_linear  # CPU: no Triton GPU
        with pytest.raises(ValueError, match="crq_linear"):
            _plan(model, crq_linear=True)
    _on_a_triton_gpu(monkeypatch)
    assert _plan(model).crq_linear and _plan(model, backend="cuda_graphs").crq_linear
    assert not _plan(model, backend="eager").crq_linear  # eager loop
    assert not _plan(model, crq_linear=False).crq_linear
    generator = model.speech_generator(backend="compiled")
    assert not generator.plan(None, 1, True, None).crq_linear  # disable_speech
    with pytest.raises(ValueError, match="crq_linear"):
        _plan(model, crq_linear=True, fuse_crq_projections=False)
    # The LLM's kernels: on by default in the fast backends on a Triton GPU, over its own weights (no fused copies).
    assert _plan(model).llm_linear and not _plan(model, backend="eager").llm_linear
    assert not _plan(model, llm_linear=False).llm_linear


def test_decode_kernels_supported_needs_plain_linears_and_silu():
    model = _tiny_model()
    crq = model.audio_invert_tower.crq_transformer
    assert triton_linear.decode_kernels_supported(crq)
    assert triton_linear.decode_kernels_supported(model.language_model.model)

    class LoraLikeLinear(nn.Linear):
        pass

    other = copy.deepcopy(crq)
    old = other.layers[0].self_attn.o_proj
    other.layers[0].self_attn.o_proj = LoraLikeLinear(old.in_features, old.out_features, bias=False)
    assert not triton_linear.decode_kernels_supported(other)
    other = copy.deepcopy(crq)
    old = other.layers[1].mlp.up_proj
    other.layers[1].mlp.up_proj = LoraLikeLinear(old.in_features, old.out_features, bias=False)
    assert not triton_linear.decode_kernels_supported(other)
    other = copy.deepcopy(crq)
    other.layers[0].mlp.down_proj.weight.data = other.layers[0].mlp.down_proj.weight.data.t().contiguous().t()
    assert not triton_linear.decode_kernels_supported(other)
    other = copy.deepcopy(crq)
    other.config.hidden_act = "gelu"
    assert not triton_linear.decode_kernels_supported(other)


def test_kernel_view_is_one_object_sharing_the_fused_weights():
    """`with_decode_kernels` returns the same view every run (a compiled step guards on it) over the same tensors;
    the kept copies themselves keep `decode_kernels` off."""
    crq = _tiny_model().audio_invert_tower.crq_transformer
    fused = fused_crq_projections(crq)
    view = with_decode_kernels(fused)
    assert with_decode_kernels(fused) is view and with_decode_kernels(fused_crq_projections(crq, fused)) is view
    assert all(layer.decode_kernels for layer in view.layers)
    assert not any(layer.decode_kernels for layer in fused.layers)
    assert view.layers[0].qkv_weight is fused.layers[0].qkv_weight
    with torch.no_grad():
        crq.layers[0].mlp.up_proj.weight.add_(1.0)  # stale copies: rebuilt, and so is the view
    assert with_decode_kernels(fused_crq_projections(crq, fused)) is not view


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_eager_composition(dtype):
    """Float32: 1e-5; bfloat16: one rounding of the model dtype on values of order 1-4 (3e-2), and where the norm is
    folded into the products (inputs of up to 1,024 features, the normed input not rounded) one or two roundings of
    the outputs, which reach 8-16 after SiLU * up (relative 2e-2)."""
    atol, rtol = (1e-5, 0.0) if dtype == torch.float32 else (3e-2, 2e-2)
    full_size = [(1, 4096, 1024, True, False, False, False, False), (1, 3072, 1024, True, False, False, True, False)]
    for case in [*CASES, *full_size, (1, 12288, 4096, True, False, False, True, True)]:
        kwargs, expected = case_tensors(*case, dtype=dtype, device="cuda")
        got = torch.ops.funaudiochat.decode_linear(*kwargs.values(), [], [], None)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol, msg=str(case))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_kernel_matches_eager_composition_and_leaves_its_counters_zero(dtype):
    """The several-row kernel (2-16 rows, split-K) on the GPU, where its programs really arrive at the same time: the
    eager composition's values (tolerances as above), the same output on a second launch, counters back at zero."""
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    counters = torch.zeros(512, dtype=torch.int32, device="cuda")
    full_size = [(16, 4096, 1024, True, False, False, False, False), (16, 1024, 2048, False, False, True, False, False),
                 (4, 3072, 1024, True, False, False, True, False), (16, 1024, 3072, False, False, True, False, False),
                 (16, 12288, 4096, True, False, False, True, True), (8, 4096, 12288, False, False, True, False, False)]
    for case in [*ROWS_CASES, *full_size]:
        kwargs, expected = case_tensors(*case, dtype=dtype, device="cuda")
        got = torch.ops.funaudiochat.decode_linear(*kwargs.values(), [], [], counters)
        again = torch.ops.funaudiochat.decode_linear(*kwargs.values(), [], [], counters)
        assert got.dtype == dtype and got.shape == expected.shape and torch.equal(got, again), case
        assert (got.float() - expected.float()).abs().max().item() < tolerance, case
        assert not counters.any(), case


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_kernel_sums_of_squares_feed_the_next_norm(dtype):
    """Full-size pairs of a residual projection and the normed projection after it (the CRQ's o_proj -> gate/up and
    down_proj -> q/k/v, the LLM's o_proj -> gate/up) at 16 rows on the GPU: the stored sums of squares are the
    output's (relative 1e-5), and the next projection given them equals the one that reads its whole input (float32
    1e-4; bfloat16: a norm output may round the other way, 3e-2)."""
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    operators = torch.ops.funaudiochat
    pairs = [((16, 1024, 2048), (3072, True, False)), ((16, 1024, 3072), (4096, False, False)),
             ((16, 4096, 4096), (12288, True, True))]  # fmt: skip
    for (rows, hidden, in_features), (out_features, gated, separate_up) in pairs:
        kwargs, _ = case_tensors(rows, hidden, in_features, False, False, True, False, False, dtype, "cuda")
        h, squares = operators.decode_linear_and_squares(*kwargs.values(), [], [], counters)
        assert torch.equal(h, operators.decode_linear(*kwargs.values(), [], [], counters))
        expected_squares = triton_linear.row_squares(h)
        assert ((squares - expected_squares).abs() / expected_squares).max().item() < 1e-5
        normed, _ = case_tensors(rows, out_features, hidden, True, False, False, gated, separate_up, dtype, "cuda")
        normed["x"] = h
        got = operators.decode_linear(*normed.values(), [], [], counters, squares)
        reads_input = operators.decode_linear(*normed.values(), [], [], counters)
        assert (got.float() - reads_input.float()).abs().max().item() < tolerance, (in_features, out_features)
        assert not counters.any()


@pytest.mark.gpu
def test_cuda_operator_compiles_into_one_graph():
    kwargs, _ = case_tensors(1, 48, 96, True, False, True, False, False, dtype=torch.bfloat16, device="cuda")

    def layer(x, weight, norm_weight, residual):
        out = torch.ops.funaudiochat.decode_linear(
            x * 2, weight, None, norm_weight, 1e-5, residual, False, None, None, [], [], None
        )
        return out + 1

    args = (kwargs["x"], kwargs["weight"], kwargs["norm_weight"], kwargs["residual"])
    with torch.no_grad():  # an inference operator (no autograd formula): generate_speech runs without gradients
        assert torch.equal(torch.compile(layer, fullgraph=True)(*args), layer(*args))


@pytest.mark.gpu
def test_cuda_graph_kernel_step_matches_eager_on_gpu(inputs):
    model = _tiny_model().cuda()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    golden = load_file(FUNAUDIOCHAT_GOLDEN / "e_generate_rep1.0.safetensors")
    for backend in ("cuda_graphs", "cuda_graphs", "cuda_graphs", "compiled", "compiled", "compiled"):
        graphed = model.generate_speech(**inputs, **GOLDEN_KWARGS, backend=backend)  # later calls replay the graphs
        assert torch.equal(graphed.sequences.cpu(), golden["sequences"])
        assert torch.equal(graphed.speech_ids.cpu(), golden["speech_ids"])
