"""The DiT position embedding's conv + Mish: the torch path (unfold + matmul or the convolution), the Triton kernel
(`funaudiochat::causal_conv_mish`) through Triton's CPU interpreter (in a subprocess, see conftest) and compiled for
sm_90 without a GPU, and on a GPU for real (marked `gpu`)."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    COSYVOICE3_TINY,
    assert_waits_before_reading,
    hopper_ptx,
    run_in_triton_interpreter,
    tiny_decoder_with_and_without,
)

from funaudiochat_hf import CosyVoice3Token2Wav, position_conv_cosyvoice3
from funaudiochat_hf.modeling_cosyvoice3 import CosyVoice3CausalConvPositionEmbedding
from funaudiochat_hf.position_conv_cosyvoice3 import causal_conv_mish, causal_grouped_conv1d, tap_major_weight


# (batch, frames, in_channels, out_channels, groups, kernel, bias, residual): the DiT's shape family (in/g = out/g),
# groups narrower than a tensor-core tile (in/g = 4, out/g = 6, padded inside the kernel), fewer frames than taps,
# several frame blocks.
CASES = [
    (2, 37, 64, 64, 4, 31, True, True),
    (1, 70, 8, 12, 2, 5, False, False),
    (2, 3, 32, 32, 2, 7, True, False),
    (1, 100, 32, 32, 1, 3, False, True),
]


def make_inputs(batch, frames, in_channels, out_channels, groups, kernel, bias, residual, device="cpu",
                dtype=torch.float32, seed=0):  # fmt: skip
    """hidden `(batch, frames, in)` as a strided view (a slice of a wider projection), the conv, the residual."""
    generator = torch.Generator().manual_seed(seed)
    conv = torch.nn.Conv1d(in_channels, out_channels, kernel, groups=groups, bias=bias)
    with torch.no_grad():
        for parameter in conv.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    wide = torch.randn(batch, frames, in_channels + 8, generator=generator) * 3  # Mish on both sides of 20 too
    hidden = wide[..., :in_channels]
    extra = torch.randn(batch, frames, out_channels, generator=generator) if residual else None
    conv = conv.to(device, dtype)
    return hidden.to(device, dtype), conv, None if extra is None else extra.to(device, dtype)


def _close(actual, expected, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def reference(hidden, conv, residual):
    """mish(left-padded conv) [+ residual] through the convolution itself."""
    out = F.mish(conv(F.pad(hidden.transpose(1, 2), (conv.kernel_size[0] - 1, 0))).transpose(1, 2))
    return out if residual is None else out + residual


@pytest.mark.parametrize("max_unfold_elements", [None, 1_500], ids=["matmul", "both_sides_of_the_limit"])
@pytest.mark.parametrize("groups, bias", [(4, True), (1, False)])
def test_causal_grouped_conv1d_equals_the_convolution(max_unfold_elements, groups, bias):
    """The unfold + matmul conv the DiT uses on CUDA (cuDNN's float32 FFT choice took ~49 ms per call on an H200)
    computes the left-padded convolution (the convolution itself past the size limit), and compiles without
    breaks with dynamic shapes on either side of the limit."""
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(8, 12, 5, groups=groups, bias=bias)
    hidden = torch.randn(2, 23, 8)  # (batch, frames, channels)
    expected = conv(torch.nn.functional.pad(hidden.transpose(1, 2), (4, 0))).transpose(1, 2)
    kwargs = {} if max_unfold_elements is None else {"max_unfold_elements": max_unfold_elements}
    convolution_calls = []
    conv.register_forward_hook(lambda *_: convolution_calls.append(1))
    with torch.no_grad():
        _close(causal_grouped_conv1d(hidden, conv, **kwargs), expected)  # 2 * 23 * 8 * 5 = 1840
        _close(causal_grouped_conv1d(hidden[:, :17], conv, **kwargs), expected[:, :17])  # 1360
        assert len(convolution_calls) == (0 if max_unfold_elements is None else 1)
        torch._dynamo.reset()
        compiled = torch.compile(causal_grouped_conv1d, fullgraph=True, backend="aot_eager", dynamic=True)
        _close(compiled(hidden, conv, **kwargs), expected)
        _close(compiled(hidden[:, :17], conv, **kwargs), expected[:, :17])  # causal: a prefix
    torch._dynamo.reset()


_INTERPRETER_SCRIPT = """
import json
import torch
from funaudiochat_hf.position_conv_cosyvoice3 import tap_major_weight
from test_position_conv_cosyvoice3 import CASES, make_inputs, reference

errors = {}
for case in CASES:
    hidden, conv, residual = make_inputs(*case)
    with torch.no_grad():
        want = reference(hidden, conv, residual)
        weight = tap_major_weight(conv.weight, conv.groups).contiguous()
        got = torch.ops.funaudiochat.causal_conv_mish(hidden, weight, conv.bias, residual)
    errors[str(case)] = ((got - want).abs().max() / want.abs().max()).item()
# through torch.compile (the operator's fake implementation; no graph break)
hidden, conv, residual = make_inputs(*CASES[0])
with torch.no_grad():
    weight = tap_major_weight(conv.weight, conv.groups).contiguous()
    compiled = torch.compile(
        lambda *args: torch.ops.funaudiochat.causal_conv_mish(*args) * 2, fullgraph=True, backend="aot_eager"
    )
    got = compiled(hidden, weight, conv.bias, residual)
    want = 2 * reference(hidden, conv, residual)
    errors["compiled"] = ((got - want).abs().max() / want.abs().max()).item()
print(json.dumps(errors))
"""


def test_kernel_matches_the_convolution_in_the_triton_interpreter():
    """float32 (the interpreter's bfloat16 is not faithful): taps before the first frame, bias, Mish, residual."""
    errors = json.loads(run_in_triton_interpreter(_INTERPRETER_SCRIPT))
    assert len(errors) == len(CASES) + 1
    for case, error in errors.items():
        assert error < 1e-6, (case, error)  # relative to the largest output: float32 rounding of the sums


@pytest.mark.parametrize("pdl", [True, False])
def test_kernel_compiles_for_hopper_and_waits_before_reading(pdl):
    """The full-size DiT's instance (64 channels per group, 31 taps, bfloat16) compiles for sm_90; as a programmatic
    dependent launch it waits for the previous kernel before its first read and lets the next one launch."""
    pytest.importorskip("triton")
    kernel = position_conv_cosyvoice3._causal_conv_mish_kernel
    types = {name: "*bf16" for name in kernel.arg_names if name.endswith("_ptr")}
    constexprs = dict(
        IN_PER_GROUP=64, OUT_PER_GROUP=64, KERNEL=31, BLOCK_M=position_conv_cosyvoice3.BLOCK_M, BLOCK_C=64,
        BLOCK_O=64, HAS_BIAS=True, HAS_RESIDUAL=True, PRECISION="tf32", NUM_STAGES=position_conv_cosyvoice3.NUM_STAGES,
        PDL=pdl,
    )  # fmt: skip
    assert_waits_before_reading(hopper_ptx(kernel, constexprs, types), pdl)


def test_cpu_and_float32_take_the_torch_path(monkeypatch):
    """The kernel is for CUDA 16-bit inference: on CPU `causal_conv_mish` is the convolution + Mish (bit for bit)."""
    calls = []
    monkeypatch.setattr(torch.ops.funaudiochat, "causal_conv_mish", lambda *args: calls.append(args), raising=False)
    hidden, conv, residual = make_inputs(*CASES[0])
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            args = (hidden.to(dtype), conv.to(dtype), residual.to(dtype))
            _close(causal_conv_mish(*args, max_unfold_elements=0), reference(*args), rtol=0, atol=0)
    assert not calls


def test_position_embedding_adds_the_residual_and_keeps_tap_major_weights_out_of_checkpoints():
    torch.manual_seed(0)
    embedding = CosyVoice3CausalConvPositionEmbedding(32, kernel_size=5, groups=4)
    hidden = torch.randn(2, 11, 32)
    with torch.no_grad():
        position = reference(reference(hidden, embedding.conv1[0], None), embedding.conv2[0], None)
        _close(embedding(hidden), position, rtol=0, atol=0)
        _close(embedding(hidden, residual=hidden), position + hidden, rtol=0, atol=0)
    assert embedding.conv1_tap_major is None
    embedding.store_tap_major_weights()
    weight = embedding.conv2[0].weight  # (out, in / groups, kernel) = (32, 8, 5)
    assert embedding.conv2_tap_major.shape == (4, 5, 8, 8) and embedding.conv2_tap_major.is_contiguous()
    # group 1, tap 3, input channel 2 of the group, output channel 5 of the group
    assert embedding.conv2_tap_major[1, 3, 2, 5] == weight[8 + 5, 2, 3]
    assert not any("tap_major" in key for key in embedding.state_dict())
    embedding.drop_tap_major_weights()
    assert embedding.conv1_tap_major is None and embedding.conv2_tap_major is None


def test_compile_estimator_stores_the_tap_major_weights_and_low_precision_follows():
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    embedding = model.flow.decoder.estimator.input_embed.conv_pos_embed
    model.compile_estimator(backend="eager")
    try:
        conv = embedding.conv1[0]
        _close(embedding.conv1_tap_major, tap_major_weight(conv.weight, conv.groups), atol=0, rtol=0)
        model.use_low_precision_estimator("bfloat16")
        assert embedding.conv1_tap_major.dtype == embedding.conv2_tap_major.dtype == torch.bfloat16
    finally:
        torch._dynamo.reset()


# -- GPU -----------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + [(2, 136, 1024, 1024, 16, 31, True, True)])
def test_cuda_kernel_matches_the_convolution(case, dtype):
    """16-bit on the GPU: the kernel within a few roundings of the float32 result, as the torch path is."""
    pytest.importorskip("triton")
    hidden, conv, residual = make_inputs(*case, device="cuda", dtype=dtype)
    with torch.no_grad():
        assert position_conv_cosyvoice3._kernel_applies(hidden, conv, residual)
        cpu_residual = None if residual is None else residual.float().cpu()
        expected = reference(hidden.float().cpu(), copy.deepcopy(conv).float().cpu(), cpu_residual)
        got = causal_conv_mish(hidden, conv, residual)
        torch_path = F.mish(causal_grouped_conv1d(hidden, conv))
        torch_path = torch_path if residual is None else torch_path + residual
    assert got.dtype == dtype and got.shape == expected.shape
    scale = expected.abs().max().item()
    tolerance = (2e-2 if dtype == torch.bfloat16 else 4e-3) * max(1.0, scale)  # a few roundings of the outputs
    _close(got.float().cpu(), expected, rtol=0, atol=tolerance)
    _close(torch_path.float().cpu(), expected, rtol=0, atol=tolerance)


@pytest.mark.gpu
@cuda
def test_cuda_kernel_compiles_into_one_graph_and_needs_no_gradient():
    pytest.importorskip("triton")
    hidden, conv, residual = make_inputs(2, 136, 1024, 1024, 16, 31, True, True, device="cuda", dtype=torch.bfloat16)
    weight = tap_major_weight(conv.weight, conv.groups).contiguous()
    with torch.no_grad():
        eager = causal_conv_mish(hidden, conv, residual, weight)
        compiled = torch.compile(causal_conv_mish, fullgraph=True, dynamic=True)
        _close(compiled(hidden, conv, residual, weight), eager, rtol=0, atol=0)
        # without the stored weight: the same result, the weight transposed on the fly
        _close(causal_conv_mish(hidden, conv, residual), eager, rtol=0, atol=0)
    # with a gradient to keep, the torch path (the kernel has no backward)
    assert not position_conv_cosyvoice3._kernel_applies(hidden, conv, residual)
    leaf = hidden.detach().requires_grad_()
    causal_conv_mish(leaf, conv, residual).float().sum().backward()
    assert leaf.grad is not None and conv.weight.grad is not None
    torch._dynamo.reset()


@pytest.mark.gpu
@cuda
def test_cuda_tiny_decoder_with_the_kernel_matches_the_torch_path(monkeypatch):
    """The tiny decoder, bf16 estimator, offline and streamed, with and without the kernel: the mel agrees to bf16
    rounding and the streamed audio has the same length."""
    pytest.importorskip("triton")
    results = tiny_decoder_with_and_without(monkeypatch, position_conv_cosyvoice3)
    _close(results[True][0], results[False][0], rtol=0, atol=5e-2)
    assert results[True][1].shape == results[False][1].shape
