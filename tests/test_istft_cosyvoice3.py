"""HiFT's iSTFT kernels (`funaudiochat::hift_spectrum`, `funaudiochat::hift_overlap_add`) against their torch paths,
through Triton's CPU interpreter (in a subprocess, see conftest) and on a GPU for real (marked `gpu`); the torch
paths against `torch.istft`."""

import json

import pytest
import torch
from conftest import hopper_ptx, run_in_triton_interpreter

from funaudiochat_hf import istft_cosyvoice3
from funaudiochat_hf.istft_cosyvoice3 import (
    hift_overlap_add,
    hift_spectrum,
    overlap_add_reference,
    spectrum_reference,
)


N_FFT, HOP, LIMIT = 16, 4, 0.99
# (batch, stft frames, samples dropped at the end): fewer frames than a sample's overlapping frames, several blocks
# with the last streamed frame dropped (480 samples), one block.
CASES = [(1, 3, 0), (2, 1201, 480), (1, 300, 0)]
# float32: a few ulp of the largest output (exp as ex2.approx, fused multiply-adds).
RTOL = ATOL = 2e-6


def make_inputs(batch, frames, device="cpu", seed=0):
    """conv_post's output (batch, n_fft + 2, frames) as a strided view (log-magnitudes up to ~6: some clipped at
    100), the inverse-FFT frames (batch, n_fft, frames) as the transpose of a frames-major tensor, the window."""
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(batch, frames, N_FFT + 2, generator=generator) * 2).transpose(1, 2)
    frames_td = (torch.randn(batch, frames, N_FFT, generator=generator) * 0.3).transpose(1, 2)
    window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float64).float()
    return hidden.to(device), frames_td.to(device), window.to(device)


_INTERPRETER_SCRIPT = """
import json
import torch
from funaudiochat_hf import istft_cosyvoice3
from funaudiochat_hf.istft_cosyvoice3 import overlap_add_reference, spectrum_reference
from test_istft_cosyvoice3 import CASES, HOP, LIMIT, N_FFT, make_inputs
from test_modeling_cosyvoice3_hift import build_hift


def error(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


results = {}
with torch.no_grad():
    for batch, frames, drop in CASES:
        hidden, frames_td, window = make_inputs(batch, frames)
        spectrum = torch.view_as_complex(torch.ops.funaudiochat.hift_spectrum(hidden, N_FFT // 2 + 1))
        results[f"spectrum {batch, frames}"] = error(torch.view_as_real(spectrum), torch.view_as_real(
            spectrum_reference(hidden, N_FFT // 2 + 1)))
        wav = torch.ops.funaudiochat.hift_overlap_add(frames_td, window, HOP, drop, LIMIT)
        want = overlap_add_reference(frames_td, window, HOP, drop, LIMIT)
        results[f"overlap_add {batch, frames, drop}"] = error(wav, want) if wav.shape == want.shape else 1.0
    # through torch.compile (the fake implementations; no graph break)
    compiled = torch.compile(
        lambda h, w: torch.ops.funaudiochat.hift_overlap_add(
            torch.fft.irfft(torch.view_as_complex(torch.ops.funaudiochat.hift_spectrum(h, 9)), n=16, dim=1),
            w, HOP, 0, LIMIT,
        ),
        fullgraph=True, backend="aot_eager",
    )
    hidden, _, window = make_inputs(2, 50)
    want = overlap_add_reference(torch.fft.irfft(spectrum_reference(hidden, 9), n=16, dim=1), window, HOP, 0, LIMIT)
    results["compiled"] = error(compiled(hidden, window), want)
    # the tiny HiFT's decode, final and not
    hift = build_hift()
    torch.manual_seed(0)
    mel, source = torch.randn(1, 80, 20), torch.rand(1, 1, 20 * 480) * 0.2 - 0.1
    for finalize in (True, False):
        istft_cosyvoice3._kernel_applies = lambda *args: True
        kernel = hift.decode(mel, source, finalize)
        istft_cosyvoice3._kernel_applies = lambda *args: False
        torch_path = hift.decode(mel, source, finalize)
        results[f"decode {finalize}"] = error(kernel, torch_path) if kernel.shape == torch_path.shape else 1.0
print(json.dumps(results))
"""


def test_kernels_match_the_torch_paths_in_the_triton_interpreter():
    results = json.loads(run_in_triton_interpreter(_INTERPRETER_SCRIPT))
    assert len(results) == 2 * len(CASES) + 3
    for name, error in results.items():
        assert error < (1e-5 if name.startswith("decode") else RTOL), (name, error)  # relative to the largest value


def test_torch_paths_are_torch_istft_bit_for_bit():
    """On CPU the spectrum + irfft + overlap-add is `torch.istft(center=True)` bit for bit (then clamped)."""
    hidden, _, window = make_inputs(2, 301)
    spectrum = spectrum_reference(hidden, N_FFT // 2 + 1)
    wav = overlap_add_reference(torch.fft.irfft(spectrum, n=N_FFT, dim=1), window, HOP, 0, LIMIT)
    expected = torch.istft(spectrum, N_FFT, HOP, N_FFT, window=window, center=True)
    torch.testing.assert_close(wav, expected.clamp(-LIMIT, LIMIT), rtol=0, atol=0)
    cut = overlap_add_reference(torch.fft.irfft(spectrum, n=N_FFT, dim=1), window, HOP, 480, LIMIT)
    torch.testing.assert_close(cut, wav[:, :-480], rtol=0, atol=0)
    assert not istft_cosyvoice3._kernel_applies(hidden)  # CPU: the torch path
    torch.testing.assert_close(hift_spectrum(hidden, N_FFT // 2 + 1), spectrum, rtol=0, atol=0)
    frames_td = torch.fft.irfft(spectrum, n=N_FFT, dim=1)
    torch.testing.assert_close(hift_overlap_add(frames_td, window, HOP, 0, LIMIT), wav, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", ["_spectrum_kernel", "_overlap_add_kernel"])
def test_kernels_compile_for_hopper_with_an_accurate_sine_and_division(kernel):
    """libdevice's sinf / cosf (no `sin.approx`, whose error grows with the argument) and IEEE division."""
    pytest.importorskip("triton")
    kernel = getattr(istft_cosyvoice3, kernel)
    types = {name: "*fp32" for name in kernel.arg_names if name.endswith("_ptr")}
    if "limit" in kernel.arg_names:
        constexprs = dict(N_FFT=N_FFT, HOP=HOP, BLOCK=istft_cosyvoice3.BLOCK)
        ptx = hopper_ptx(kernel, constexprs, {**types, "limit": "fp32"})
        assert "div.rn.f32" in ptx and "div.full" not in ptx
    else:
        constexprs = dict(NUM_BINS=9, MAX_MAGNITUDE=istft_cosyvoice3.MAX_MAGNITUDE, BLOCK=istft_cosyvoice3.BLOCK)
        ptx = hopper_ptx(kernel, constexprs, types)
        assert "__nv_sinf" in ptx and "__nv_cosf" in ptx
    assert "sin.approx" not in ptx and "cos.approx" not in ptx


# -- GPU -----------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("batch, frames, drop", CASES + [(1, 11881, 480)])
def test_cuda_kernels_match_the_torch_paths(batch, frames, drop):
    pytest.importorskip("triton")
    hidden, frames_td, window = make_inputs(batch, frames, device="cuda")
    with torch.no_grad():
        assert istft_cosyvoice3._kernel_applies(hidden) and istft_cosyvoice3._kernel_applies(frames_td, window)
        spectrum = hift_spectrum(hidden, N_FFT // 2 + 1)
        want = spectrum_reference(hidden, N_FFT // 2 + 1)
        scale = want.abs().max().item()
        torch.testing.assert_close(spectrum, want, rtol=RTOL, atol=ATOL * scale)
        wav = hift_overlap_add(frames_td, window, HOP, drop, LIMIT)
        want = overlap_add_reference(frames_td, window, HOP, drop, LIMIT)
        torch.testing.assert_close(wav, want, rtol=RTOL, atol=ATOL)
    leaf = hidden.detach().requires_grad_()
    assert not istft_cosyvoice3._kernel_applies(leaf)  # no backward: the torch path
    hift_spectrum(leaf, N_FFT // 2 + 1).abs().sum().backward()
    assert leaf.grad is not None
