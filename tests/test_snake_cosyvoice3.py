"""HiFT's Snake activation and the residual blocks' element-wise work around it: the Triton kernel
(`funaudiochat::conv_epilogue`: the conv bias before a Snake, the causal padding of the conv after it, the residual sum)
against the torch ops, through Triton's CPU interpreter (in a subprocess, see conftest) and on a GPU for real (marked
`gpu`); the torch path everywhere else."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import hopper_ptx, run_in_triton_interpreter

from funaudiochat_hf import snake_cosyvoice3
from funaudiochat_hf.modeling_cosyvoice3_hift import CausalConv1d, CausalResBlock, Snake
from funaudiochat_hf.snake_cosyvoice3 import add_bias_and_residual, snake, snake_reference


# (shape, left padding, layout): frames and channels not multiples of the tiles, several tiles both ways, the padding
# of a dilated conv, a strided view (a slice of a wider tensor), the transposed view of a frames-by-channels tensor,
# HiFT's channels-last (batch, channels, 1, frames) and the contiguous 4-D shape.
CASES = [
    ((2, 5, 37), 0, "contiguous"),
    ((2, 70, 300), 6, "contiguous"),
    ((1, 16, 45), 30, "sliced"),
    ((2, 24, 50), 2, "transposed"),
    ((1, 70, 1, 45), 10, "channels_last"),
    ((2, 9, 1, 33), 4, "contiguous"),
]

# float32 Snake against the torch expression: a few ulp (sin, a fused multiply-add) of values up to ~|x| + 1 / alpha.
# The sums are bit-identical (the same float32 additions in the same order).
FLOAT32_RTOL, FLOAT32_ATOL = 4e-6, 1e-6


def make_inputs(shape, layout, device="cpu", dtype=torch.float32, seed=0):
    """hidden of `shape` in `layout` (values up to ~10: several periods of the sine), alpha with a zero, a negative
    and small entries (1 / alpha up to ~20), a bias `(channels,)` and a contiguous residual of hidden's shape."""
    generator = torch.Generator().manual_seed(seed)
    channels = shape[1]
    if layout == "sliced":
        hidden = (torch.randn(shape[0], channels + 3, shape[2] + 5, generator=generator) * 4)[:, 1 : channels + 1, 5:]
    elif layout == "transposed":
        hidden = (torch.randn(shape[0], shape[2], channels, generator=generator) * 4).transpose(1, 2)
    else:
        hidden = torch.randn(shape, generator=generator) * 4
    alpha = torch.rand(channels, generator=generator) * 2 + 0.05
    alpha[0], alpha[-1] = 0.0, -0.7
    bias = torch.randn(channels, generator=generator)
    residual = torch.randn(shape, generator=generator)
    hidden, alpha, bias, residual = (tensor.to(device, dtype) for tensor in (hidden, alpha, bias, residual))
    if layout == "channels_last":
        hidden = hidden.contiguous(memory_format=torch.channels_last)
    assert tuple(hidden.shape) == shape
    return hidden, alpha, bias, residual


def expected(hidden, alpha, left_padding, bias=None):
    """The torch expression of `hidden + bias` in float32, then the causal padding."""
    hidden = hidden.float() if bias is None else hidden.float() + bias.float().view(-1, *[1] * (hidden.dim() - 2))
    return F.pad(snake_reference(hidden, alpha.float()), (left_padding, 0))


def expected_sum(hidden, bias, residual):
    return (hidden.float() + bias.float().view(-1, *[1] * (hidden.dim() - 2))) + residual.float()


_INTERPRETER_SCRIPT = """
import json
import torch
from funaudiochat_hf import snake_cosyvoice3
from funaudiochat_hf.snake_cosyvoice3 import add_bias_and_residual, snake
from test_snake_cosyvoice3 import CASES, FLOAT32_RTOL, expected, expected_sum, make_inputs
from test_modeling_cosyvoice3_hift import _filter_inputs, build_hift

snake_cosyvoice3._kernel_applies = lambda *args: True
results = {}
with torch.no_grad():
    for shape, padding, layout in CASES:
        hidden, alpha, bias, residual = make_inputs(shape, layout)
        for with_bias in (False, True):
            got = snake(hidden, alpha, padding, bias if with_bias else None)
            want = expected(hidden, alpha, padding, bias if with_bias else None)
            results[str((shape, padding, layout, with_bias))] = {
                "error": ((got - want).abs() - FLOAT32_RTOL * want.abs()).max().item(),
                "padding_is_zero": bool((got[..., :padding] == 0).all()),
                "channels_last": got.dim() == 4 and got.is_contiguous(memory_format=torch.channels_last),
                "contiguous": got.is_contiguous(),
            }
        summed = add_bias_and_residual(hidden, bias, residual)
        results[str((shape, layout, "sum"))] = {"exact": bool((summed == expected_sum(hidden, bias, residual)).all())}
    # through torch.compile (the operator's fake implementation; no graph break)
    hidden, alpha, bias, residual = make_inputs(*CASES[1][::2])
    compiled = torch.compile(
        lambda *args: torch.ops.funaudiochat.conv_epilogue(*args) * 2, fullgraph=True, backend="aot_eager"
    )
    got = compiled(hidden, bias, residual, alpha, 6)
    want = 2 * expected(hidden + residual, alpha, 6, bias)
    results["compiled"] = {"error": (got - want).abs().max().item()}
    # the tiny HiFT's filter with the kernel in every residual block, in both layouts
    hift = build_hift()
    inputs = _filter_inputs(hift, 12)
    for layout in ("default", "channels_last"):
        hift.use_channels_last_convolutions(layout == "channels_last")
        kernel = hift.filter_body(*inputs)
        snake_cosyvoice3._kernel_applies = lambda *args: False
        torch_path = hift.filter_body(*inputs)
        snake_cosyvoice3._kernel_applies = lambda *args: True
        results["hift_" + layout] = {"error": ((kernel - torch_path).abs().max() / torch_path.abs().max()).item()}
print(json.dumps(results))
"""


def test_kernel_matches_the_torch_ops_in_the_triton_interpreter():
    """float32 (the interpreter's bfloat16 is not faithful): Snake with and without a bias, the padding written as
    exact zeros, a channels-last output for a 4-D input (contiguous or not), contiguous for 3-D; the bias + residual
    sum bit for bit; a compiled call, and the tiny HiFT's filter."""
    results = json.loads(run_in_triton_interpreter(_INTERPRETER_SCRIPT))
    assert len(results) == 3 * len(CASES) + 3
    for (shape, padding, layout) in CASES:
        for with_bias in (False, True):
            name = str((shape, padding, layout, with_bias))
            result = results[name]
            assert result["error"] <= FLOAT32_ATOL, (name, result)  # |got - want| <= atol + rtol |want|
            assert result["padding_is_zero"], name
            assert result["channels_last" if len(shape) == 4 else "contiguous"], (name, result)
        assert results[str((shape, layout, "sum"))]["exact"], (shape, layout)
    assert results["compiled"]["error"] < 1e-5
    for layout in ("default", "channels_last"):
        assert results["hift_" + layout]["error"] < 1e-5, results  # relative to the largest output


# The kernel's uses: a Snake (with the bias of the conv before it or without) and the bias + residual sum; each in
# the frames-major layout (unit frame stride) and channels-last (unit channel stride).
USES = [(True, False, True), (False, False, True), (True, True, False)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("unit_stride", ["t", "c"], ids=["frames_major", "channels_last"])
@pytest.mark.parametrize("use", USES, ids=["bias_snake", "snake", "bias_residual"])
def test_kernel_compiles_for_hopper_with_an_accurate_sine_and_division(dtype, unit_stride, use):
    """On the GPU the kernel's float32 arithmetic is the torch path's: libdevice's sinf (no `sin.approx`, whose error
    grows with the argument) and an IEEE-rounded 1 / (alpha + 1e-9) (`div.rn`, as torch's reciprocal)."""
    pytest.importorskip("triton")
    has_bias, has_residual, snake_on = use
    kernel = snake_cosyvoice3._conv_epilogue_kernel
    types = {name: f"*{dtype}" for name in kernel.arg_names if name.endswith("_ptr")}
    tiles = {"t": snake_cosyvoice3.FRAMES_MAJOR_TILE, "c": snake_cosyvoice3.CHANNELS_MAJOR_TILE}
    block_c, block_t = tiles[unit_stride]
    constexprs = dict(HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, SNAKE=snake_on, BLOCK_C=block_c, BLOCK_T=block_t)
    constexprs.update({f"stride_x{unit_stride}": 1, f"stride_o{unit_stride}": 1})
    ptx = hopper_ptx(kernel, constexprs, types)
    assert "sin.approx" not in ptx and "div.full" not in ptx and "div.approx" not in ptx
    if snake_on:
        assert "__nv_sinf" in ptx and "div.rn.f32" in ptx


def test_off_cuda_the_torch_ops_run_and_keep_gradients(monkeypatch):
    """On CPU `snake` is the expression (bit for bit) followed by F.pad and `add_bias_and_residual` two adds, the
    operator is not called, and a gradient-requiring input gets its gradient."""
    calls = []
    monkeypatch.setattr(torch.ops.funaudiochat, "conv_epilogue", lambda *args: calls.append(args), raising=False)
    for shape, padding, layout in CASES:
        hidden, alpha, bias, residual = make_inputs(shape, layout)
        assert not snake_cosyvoice3._kernel_applies(hidden, alpha)
        with torch.no_grad():
            torch.testing.assert_close(snake(hidden, alpha, padding), expected(hidden, alpha, padding), rtol=0, atol=0)
            got = snake(hidden, alpha, padding, bias)
            torch.testing.assert_close(got, expected(hidden, alpha, padding, bias), rtol=0, atol=0)
            got = add_bias_and_residual(hidden, bias, residual)
            torch.testing.assert_close(got, expected_sum(hidden, bias, residual), rtol=0, atol=0)
    leaf = hidden.detach().requires_grad_()
    snake(leaf, alpha, 3).sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    assert not calls
    with pytest.raises(ValueError, match="left_padding must be >= 0"):
        snake(hidden, alpha, -1)


def test_resblock_adds_the_biases_and_writes_the_paddings_around_its_convs():
    """`CausalResBlock`, with each conv's bias added by the element-wise op after it and each Snake writing the
    causal padding of the conv after it, equals the plain block (float32 rounding: oneDNN adds a CPU conv's bias
    inside the conv); a padded conv call takes no context."""
    torch.manual_seed(0)
    block = CausalResBlock(8, 5, (1, 3)).eval()
    with torch.no_grad():
        for activation in [*block.activations1, *block.activations2]:
            activation.alpha.uniform_(0.2, 2.0)
    hidden = torch.randn(2, 8, 29)

    def plain(x):
        for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, block.activations1, block.activations2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x

    with torch.no_grad():
        torch.testing.assert_close(block(hidden), plain(hidden), rtol=1e-6, atol=1e-6)
        out = Snake(8)(hidden, left_padding=4)
        assert out.shape == (2, 8, 33) and (out[..., :4] == 0).all()
    conv = CausalConv1d(8, 8, 5)
    with pytest.raises(ValueError, match="padded=True takes no context"):
        conv(out, context=hidden[..., :4], padded=True)


# -- GPU -----------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, padding, layout", CASES + [((1, 64, 11881), 50, "contiguous")])
def test_cuda_kernel_matches_the_torch_ops(shape, padding, layout, dtype):
    """Snake of hidden + bias: float32 a few ulp from the expression; 16-bit within one rounding of the float32
    expression of the same inputs, closer to it than the torch path (which rounds after each op). The bias +
    residual sum: float32 bit for bit, 16-bit within one rounding."""
    pytest.importorskip("triton")
    hidden, alpha, bias, residual = make_inputs(shape, layout, device="cuda", dtype=dtype)
    with torch.no_grad():
        assert snake_cosyvoice3._kernel_applies(hidden, alpha, bias)
        got = snake(hidden, alpha, padding, bias)
        want = expected(hidden, alpha, padding, bias)
        summed = add_bias_and_residual(hidden, bias, residual)
    assert got.dtype == summed.dtype == dtype and got.shape == want.shape and (got[..., :padding] == 0).all()
    memory_format = torch.channels_last if len(shape) == 4 else torch.contiguous_format
    assert got.is_contiguous(memory_format=memory_format) and summed.is_contiguous(memory_format=memory_format)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)
        torch.testing.assert_close(summed, expected_sum(hidden, bias, residual), rtol=0, atol=0)
        return
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # the unit roundoff: half an ulp, relative
    torch.testing.assert_close(got.float(), want, rtol=rounding, atol=1e-6)
    torch.testing.assert_close(summed.float(), expected_sum(hidden, bias, residual), rtol=rounding, atol=1e-6)
    with torch.no_grad():
        torch_path = F.pad(snake_reference(hidden + bias.view(-1, *[1] * (hidden.dim() - 2)), alpha), (padding, 0))
    # In float16 the torch path's 1 / (alpha + 1e-9) is inf at alpha = 0 (the 1e-9 underflows) and its Snake NaN:
    # as far from the expression as it gets (the kernel computes in float32).
    torch_error = (torch_path.float() - want).abs().nan_to_num(nan=float("inf"))
    assert (got.float() - want).abs().max() <= torch_error.max()


@pytest.mark.gpu
@cuda
def test_cuda_gradients_and_compiled_calls_take_the_torch_path():
    """The kernel has no backward: a gradient-requiring input takes the torch path (and gets its gradient); inside
    torch.compile the torch ops are traced for Inductor to fuse (no operator in the graph)."""
    pytest.importorskip("triton")
    hidden, alpha, bias, residual = make_inputs((2, 16, 40), "contiguous", device="cuda")
    leaf = hidden.detach().requires_grad_()
    assert not snake_cosyvoice3._kernel_applies(leaf, alpha)
    snake(leaf, alpha, 2).sum().backward()
    assert leaf.grad is not None
    parameter = torch.nn.Parameter(bias)
    assert not snake_cosyvoice3._kernel_applies(hidden, parameter, residual)
    with torch.no_grad():
        assert snake_cosyvoice3._kernel_applies(hidden, parameter, residual)
        graphs = []

        def backend(graph_module, example_inputs):
            graphs.append(graph_module)
            return graph_module.forward

        torch._dynamo.reset()
        compiled = torch.compile(
            lambda x, a, b, r: add_bias_and_residual(snake(x, a, 0, b), b, r), fullgraph=True, backend=backend
        )
        got = compiled(hidden, alpha, bias, residual)
        want = expected_sum(expected(hidden, alpha, 0, bias), bias, residual)
        torch.testing.assert_close(got, want, rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)
        assert "funaudiochat" not in graphs[0].code and "sin" in graphs[0].code
    torch._dynamo.reset()


@pytest.mark.gpu
@cuda
def test_cuda_kernel_compiles_once_for_every_window():
    """Frame counts, paddings and slices of any alignment reuse one compiled kernel per use and layout (no
    divisibility specialisation: a stream's HiFT window changes over its first chunks)."""
    pytest.importorskip("triton")
    compiled = snake_cosyvoice3._conv_epilogue_kernel.device_caches[torch.cuda.current_device()][0]
    hidden, alpha, bias, _ = make_inputs((1, 64, 1000), "contiguous", device="cuda")
    with torch.no_grad():
        snake(hidden, alpha, 6, bias)
        before = len(compiled)
        for frames, padding in [(999, 2), (1000, 10), (257, 50), (112, 30)]:
            for start in (0, 1, 3):  # misaligned views
                out = snake(hidden[..., start : start + frames], alpha, padding, bias)
                torch.testing.assert_close(out, expected(hidden[..., start : start + frames], alpha, padding, bias),
                                           rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)  # fmt: skip
    assert len(compiled) == before


@pytest.mark.gpu
@cuda
def test_cuda_kernel_replays_in_a_cuda_graph():
    pytest.importorskip("triton")
    hidden, alpha, bias, _ = make_inputs((1, 64, 1000), "contiguous", device="cuda")
    with torch.no_grad():
        snake(hidden, alpha, 6, bias)  # compiles the kernel outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = snake(hidden, alpha, 6, bias)
        hidden.copy_(make_inputs((1, 64, 1000), "contiguous", device="cuda", seed=1)[0])
        graph.replay()
        torch.testing.assert_close(out, expected(hidden, alpha, 6, bias), rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("channels_last", [False, True], ids=["default_layout", "channels_last"])
def test_cuda_full_size_filter_with_the_kernel_matches_the_torch_path(monkeypatch, channels_last):
    """Released channel counts on CUDA, float32 with TF32 convs: HiFT's filter with the kernel against the torch
    path (the same convs; only the Snakes' few-ulp differences, carried through ~80 convs)."""
    pytest.importorskip("triton")
    from test_modeling_cosyvoice3_hift import _filter_inputs

    from funaudiochat_hf.modeling_cosyvoice3_hift import CosyVoice3HiFTGenerator

    torch.manual_seed(0)
    hift = CosyVoice3HiFTGenerator().cuda().eval()
    with torch.no_grad():
        for module in hift.modules():
            if isinstance(module, Snake):
                module.alpha.uniform_(0.2, 2.0)
        if channels_last:
            hift.use_channels_last_convolutions()
        inputs = [tensor.cuda() for tensor in _filter_inputs(hift, 23)]
        got = hift.filter_body(*inputs)
        monkeypatch.setattr(snake_cosyvoice3, "_kernel_applies", lambda *args: False)
        want = hift.filter_body(*inputs)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.gpu
@cuda
def test_cuda_graphed_streaming_vocoder_with_the_kernels_matches_the_torch_path(monkeypatch):
    """A steady streamed chunk's HiFT call (full size, 96 mel frames, finalize=False) replayed from a CUDA graph with
    every HiFT kernel (Snake / conv epilogue, iSTFT, source mixing) against the eager torch path, float32 with TF32
    convs; a second replay with new inputs too."""
    pytest.importorskip("triton")
    import functools

    from funaudiochat_hf import istft_cosyvoice3, source_merge_cosyvoice3
    from funaudiochat_hf.cuda_graph_cosyvoice3 import CUDAGraphRunner
    from funaudiochat_hf.modeling_cosyvoice3_hift import CosyVoice3HiFTGenerator

    torch.manual_seed(0)
    hift = CosyVoice3HiFTGenerator().cuda().eval()
    hift.init_source_tables(max_samples=96 * 480)
    runner = CUDAGraphRunner(functools.partial(hift.decode, finalize=False))
    modules = (snake_cosyvoice3, istft_cosyvoice3, source_merge_cosyvoice3)
    with torch.no_grad():
        for seed in (1, 2):
            generator = torch.Generator().manual_seed(seed)
            mel = (torch.randn(1, 80, 96, generator=generator) * 2).cuda()
            f0 = (torch.rand(1, 96, generator=generator) * 300).cuda()
            source = hift.source_from_f0(f0)
            got = runner(mel, source).clone()
            with monkeypatch.context() as patch:
                for module in modules:
                    patch.setattr(module, "_kernel_applies", lambda *args: False)
                want_source = hift.source_from_f0(f0)
                want = hift.decode(mel, want_source, finalize=False)
            torch.testing.assert_close(source, want_source, rtol=0, atol=1e-6)
            assert got.shape == want.shape == (1, (96 - 5) * 480)
            assert (got - want).abs().max() <= 1e-3 * want.abs().max()
