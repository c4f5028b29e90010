"""The DiT's fused residual update + adaptive LayerNorm (`adaln_cosyvoice3.residual_adaln`) against its torch path:
on CPU through Triton's interpreter (in a subprocess, see conftest), on a GPU for real (marked `gpu`), and the tiny
decoder on CUDA with and without it."""

import json

import pytest
import torch
from conftest import run_in_triton_interpreter, tiny_decoder_with_and_without

from funaudiochat_hf import adaln_cosyvoice3
from funaudiochat_hf.adaln_cosyvoice3 import residual_adaln, torch_residual_adaln


# (batch, frames, dim): a row width that is not a power of two (masked lanes), one frame, the full-size width.
CASES = [(2, 7, 48), (1, 1, 16), (2, 5, 1024)]


def make_inputs(batch, frames, dim, device="cpu", dtype=torch.float32, seed=0):
    """hidden, update (batch, frames, dim) and gate, shift, scale as strided views of one (batch, 6 * dim) modulation,
    as a DiT block passes them."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, frames, dim, generator=generator) * 3 + 1
    update = torch.randn(batch, frames, dim, generator=generator)
    modulation = torch.randn(batch, 6 * dim, generator=generator)
    hidden, update, modulation = (t.to(device, dtype) for t in (hidden, update, modulation))
    shift, scale, gate = modulation.chunk(6, dim=1)[:3]
    return hidden, update, gate, shift, scale


_INTERPRETER_SCRIPT = """
import json
import torch
from funaudiochat_hf.adaln_cosyvoice3 import torch_residual_adaln
from test_adaln_cosyvoice3 import CASES, make_inputs

errors = {}
for case in CASES:
    hidden, update, gate, shift, scale = make_inputs(*case)
    want_hidden, want_normed = torch_residual_adaln(hidden, update, gate, shift, scale, 1e-6)
    got_hidden, got_normed = torch.ops.funaudiochat.dit_residual_adaln(hidden, update, gate, shift, scale, 1e-6)
    got_plain = torch.ops.funaudiochat.dit_adaln(hidden, shift, scale, 1e-6)
    want_plain = torch_residual_adaln(hidden, None, None, shift, scale, 1e-6)[1]
    errors[str(case)] = [
        (got_hidden - want_hidden).abs().max().item(),
        (got_normed - want_normed).abs().max().item(),
        (got_plain - want_plain).abs().max().item(),
    ]
# through torch.compile (the operators' fake implementations; no graph break)
hidden, update, gate, shift, scale = make_inputs(*CASES[0])
compiled = torch.compile(
    lambda *args: [2 * t for t in torch.ops.funaudiochat.dit_residual_adaln(*args)], fullgraph=True,
    backend="aot_eager",
)
got = compiled(hidden, update, gate, shift, scale, 1e-6)
want = torch_residual_adaln(hidden, update, gate, shift, scale, 1e-6)
errors["compiled"] = max((2 * w - g).abs().max().item() for g, w in zip(got, want))
print(json.dumps(errors))
"""


def test_kernel_matches_torch_in_the_triton_interpreter():
    """float32 (the interpreter's 16-bit arithmetic is not faithful): the stream exact, the norm within float32
    rounding of the LayerNorm's summation order."""
    errors = json.loads(run_in_triton_interpreter(_INTERPRETER_SCRIPT))
    for case, (stream, normed, plain) in ((k, v) for k, v in errors.items() if k != "compiled"):
        assert stream == 0.0, case
        assert normed < 1e-5 and plain < 1e-5, (case, normed, plain)
    assert errors["compiled"] < 1e-5


@pytest.mark.triton
@pytest.mark.parametrize("pointer", ["*fp32", "*bf16"])
def test_kernel_compiles_for_hopper_without_fused_multiply_adds(pointer):
    """The kernel as launched compiles for sm_90 (no GPU needed) and rounds each product and sum on its own, as the
    torch ops do: no fused multiply-add in its PTX."""
    from conftest import hopper_ptx

    names = ["hidden_ptr", "update_ptr", "gate_ptr", "shift_ptr", "scale_ptr", "hidden_out_ptr", "normed_ptr"]
    ptx = hopper_ptx(
        adaln_cosyvoice3._residual_adaln_kernel,
        {"HAS_UPDATE": True, "BLOCK_D": 1024},
        {**{name: pointer for name in names}, "eps": "fp32"},
        options=adaln_cosyvoice3.KERNEL_OPTIONS,
    )
    assert "st.global" in ptx and "rsqrt" in ptx
    # With fusion on, the residual `hidden + gate * update` compiles to `fma.rn.bf16` / `fma.rn.f32`: one rounding
    # where the torch ops round twice (the stream then differs from torch's by an ulp here and there).
    assert "fma." not in ptx


def test_cpu_and_gradients_take_the_torch_path():
    hidden, update, gate, shift, scale = make_inputs(2, 7, 48)
    assert not adaln_cosyvoice3._kernel_applies(hidden, update, gate, shift, scale)
    got = residual_adaln(hidden, update, gate, shift, scale)
    want_hidden = hidden + gate[:, None] * update
    want_normed = torch.nn.functional.layer_norm(want_hidden, (48,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(got[0], want_hidden, rtol=0, atol=0)
    torch.testing.assert_close(got[1], want_normed, rtol=0, atol=0)
    # without an update the stream is returned as it is
    stream, normed = residual_adaln(hidden, None, None, shift, scale)
    assert stream is hidden
    torch.testing.assert_close(normed, torch_residual_adaln(hidden, None, None, shift, scale, 1e-6)[1])


def test_operators_have_shape_only_fake_implementations():
    """On meta tensors (as torch.compile traces them) the operators give contiguous outputs of the stream's shape."""
    hidden, update, gate, shift, scale = (t.to("meta") for t in make_inputs(2, 7, 48))
    stream, normed = torch.ops.funaudiochat.dit_residual_adaln(hidden, update, gate, shift, scale, 1e-6)
    assert stream.shape == normed.shape == hidden.shape and normed.is_contiguous()
    assert torch.ops.funaudiochat.dit_adaln(hidden, shift, scale, 1e-6).shape == hidden.shape


def test_dit_blocks_chain_the_norms_as_the_reference_computes_them():
    """The DiT's fused block order (each block's last update with the next norm) computes the reference's
    unfused sequence: attention norm, attention, gated residual, feed-forward norm, feed-forward, gated residual,
    per block, then the final norm."""
    from funaudiochat_hf.modeling_cosyvoice3 import CosyVoice3Config
    from funaudiochat_hf.modeling_cosyvoice3_dit import CosyVoice3DiT

    torch.manual_seed(0)
    config = CosyVoice3Config(dit_dim=32, dit_depth=3, dit_heads=2, dit_dim_head=16, mel_bins=8)
    dit = CosyVoice3DiT(config).eval()
    x, mu, cond = (torch.randn(2, 8, 10) for _ in range(3))
    t, spks = torch.rand(2), torch.randn(2, 8)
    with torch.no_grad():
        got = dit(x, mu, t, spks, cond)
        blocks, final = dit.time_conditioning(t)
        hidden = dit.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        rotary = dit.rotary_embed(10, x.device)
        ln = lambda h: torch.nn.functional.layer_norm(h, (32,), eps=1e-6)  # noqa: E731
        for block, modulation in zip(dit.transformer_blocks, blocks):
            shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = modulation.chunk(6, dim=1)
            hidden = hidden + gate_a[:, None] * block.attn(ln(hidden) * (1 + scale_a[:, None]) + shift_a[:, None], rotary)
            hidden = hidden + gate_f[:, None] * block.ff(ln(hidden) * (1 + scale_f[:, None]) + shift_f[:, None])
        scale, shift = final.chunk(2, dim=1)
        want = dit.proj_out(ln(hidden) * (1 + scale[:, None]) + shift[:, None]).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# -- GPU -----------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES + [(2, 436, 1024)])
def test_cuda_kernel_matches_the_autocast_torch_path(case, dtype):
    """As the estimator runs it (16-bit under autocast, where the LayerNorm is float32): the stream exactly, the
    norm within one rounding of the stream's dtype, relative (the LayerNorm's summation order moves a value across a
    rounding boundary at most)."""
    pytest.importorskip("triton")
    hidden, update, gate, shift, scale = make_inputs(*case, device="cuda", dtype=dtype)
    assert adaln_cosyvoice3._kernel_applies(hidden, update, gate, shift, scale)
    got_hidden, got_normed = residual_adaln(hidden, update, gate, shift, scale)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        want_hidden, want_normed = torch_residual_adaln(hidden, update, gate, shift, scale, 1e-6)
    assert got_hidden.dtype == got_normed.dtype == dtype
    torch.testing.assert_close(got_hidden, want_hidden, rtol=0, atol=0)
    # one unit in the last place of the dtype, relative; |normed| reaches ~20
    rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got_normed.float(), want_normed.float(), rtol=rtol, atol=1e-4)
    plain = residual_adaln(hidden, None, None, shift, scale)[1]
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        want_plain = torch_residual_adaln(hidden, None, None, shift, scale, 1e-6)[1]
    torch.testing.assert_close(plain.float(), want_plain.float(), rtol=rtol, atol=1e-4)


@pytest.mark.gpu
@cuda
def test_cuda_gradients_take_the_torch_path():
    pytest.importorskip("triton")
    hidden, update, gate, shift, scale = make_inputs(2, 7, 48, device="cuda")
    leaf = update.detach().requires_grad_()
    assert not adaln_cosyvoice3._kernel_applies(hidden, leaf, gate, shift, scale)
    residual_adaln(hidden, leaf, gate, shift, scale)[1].sum().backward()
    assert leaf.grad is not None


@pytest.mark.gpu
@cuda
def test_cuda_tiny_decoder_with_the_kernel_matches_torch(monkeypatch):
    """The tiny decoder, bf16 estimator, offline and streamed, with and without the kernel: the mel agrees to bf16
    rounding."""
    pytest.importorskip("triton")
    results = tiny_decoder_with_and_without(monkeypatch, adaln_cosyvoice3)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=5e-2)
    assert results[True][1].shape == results[False][1].shape
