"""HiFT's excitation mixing + Linear as one Triton kernel (`funaudiochat::hift_source_merge`) against its torch path,
through Triton's CPU interpreter (in a subprocess, see conftest) and on a GPU for real (marked `gpu`)."""

import json

import pytest
import torch
from conftest import hopper_ptx, run_in_triton_interpreter

from funaudiochat_hf import source_merge_cosyvoice3
from funaudiochat_hf.source_merge_cosyvoice3 import merge_linear, merge_reference


HARMONICS, SCALE = 9, 480
# The released HiFT's source settings (voiced threshold 10 Hz, noise std 0.003, sine amplitude 0.1).
SETTINGS = (10, 0.003, 0.1)
# (batch, frames, layout of the sines): the offline one ((batch, harmonics, samples) memory, held by `_hold`), the
# streaming one (`repeat_interleave` over frames), a batch reading the shared noise table.
CASES = [(1, 7, "offline"), (1, 5, "streaming"), (2, 3, "offline")]
# float32: the Linear's 9-term sum in another order than the torch path's (a few ulp of the largest output).
ATOL = 1e-6


def make_inputs(batch, frames, layout, device="cpu", seed=0):
    """The pieces `merge_source` receives: 0.1 sin(phase) held per frame, f0 held per frame (voiced and unvoiced
    frames, one exactly at the threshold), the table's noise (1, samples, harmonics), the Linear's weight and bias."""
    generator = torch.Generator().manual_seed(seed)
    sines = torch.sin(torch.rand(batch, frames, HARMONICS, generator=generator) * 1000) * 0.1
    if layout == "offline":
        sines = sines.transpose(1, 2).unsqueeze(-1).expand(-1, -1, -1, SCALE).flatten(-2).transpose(1, 2)
    else:
        sines = sines.repeat_interleave(SCALE, dim=1)
    f0 = torch.rand(batch, frames, generator=generator) * 400 * (torch.rand(batch, frames, generator=generator) > 0.3)
    f0[0, 0] = 10.0
    f0_up = f0.unsqueeze(-1).expand(-1, -1, SCALE).flatten(1).unsqueeze(-1)
    noise = torch.rand(1, frames * SCALE, HARMONICS, generator=generator)
    weight = torch.randn(1, HARMONICS, generator=generator) * 0.5
    bias = torch.randn(1, generator=generator) * 0.1
    return tuple(tensor.to(device) for tensor in (sines, f0_up, noise, weight, bias))


_INTERPRETER_SCRIPT = """
import json
import torch
from funaudiochat_hf.source_merge_cosyvoice3 import merge_reference
from test_source_merge_cosyvoice3 import CASES, SETTINGS, make_inputs

errors = {}
with torch.no_grad():
    for case in CASES:
        inputs = make_inputs(*case)
        got = torch.ops.funaudiochat.hift_source_merge(*inputs, *map(float, SETTINGS))
        want = merge_reference(*inputs, *SETTINGS).squeeze(-1)
        errors[str(case)] = (got - want).abs().max().item() if got.shape == want.shape else 1.0
    compiled = torch.compile(
        lambda *args: torch.tanh(torch.ops.funaudiochat.hift_source_merge(*args)), fullgraph=True, backend="aot_eager"
    )
    inputs = make_inputs(*CASES[0])
    got = compiled(*inputs, *map(float, SETTINGS))
    errors["compiled"] = (got - torch.tanh(merge_reference(*inputs, *SETTINGS).squeeze(-1))).abs().max().item()
print(json.dumps(errors))
"""


def test_kernel_matches_the_torch_path_in_the_triton_interpreter():
    errors = json.loads(run_in_triton_interpreter(_INTERPRETER_SCRIPT))
    assert len(errors) == len(CASES) + 1
    for case, error in errors.items():
        assert error <= ATOL, (case, error)


def test_kernel_compiles_for_hopper_with_a_rounded_division():
    """The unvoiced amplitude `((1 - voiced) * 0.1) / 3` is divided as the torch path divides (IEEE `div.rn`)."""
    pytest.importorskip("triton")
    kernel = source_merge_cosyvoice3._source_merge_kernel
    types = {name: "*fp32" for name in kernel.arg_names if name.endswith("_ptr")}
    types.update(voiced_threshold="fp32", noise_std="fp32", sine_amp="fp32")
    constexprs = dict(HARMONICS=HARMONICS, BLOCK_H=16, BLOCK=source_merge_cosyvoice3.BLOCK)
    ptx = hopper_ptx(kernel, constexprs, types)
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx


def test_cpu_takes_the_torch_path_bit_for_bit(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.ops.funaudiochat, "hift_source_merge", lambda *args: calls.append(args), raising=False)
    inputs = make_inputs(*CASES[0])
    assert not source_merge_cosyvoice3._kernel_applies(*inputs)
    got = merge_linear(*inputs, *SETTINGS)
    torch.testing.assert_close(got, merge_reference(*inputs, *SETTINGS), rtol=0, atol=0)
    assert got.shape == (1, 7 * SCALE, 1) and not calls


# -- GPU -----------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("case", CASES + [(1, 96, "streaming")])
def test_cuda_kernel_matches_the_torch_path(case):
    pytest.importorskip("triton")
    inputs = make_inputs(*case, device="cuda")
    with torch.no_grad():
        assert source_merge_cosyvoice3._kernel_applies(*inputs)
        got = merge_linear(*inputs, *SETTINGS)
        want = merge_reference(*inputs, *SETTINGS)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    weight = inputs[3].clone().requires_grad_()
    assert not source_merge_cosyvoice3._kernel_applies(*inputs[:3], weight, inputs[4])  # no backward: torch path
