"""The DiT attention's Triton kernel (`funaudiochat::dit_attention`) against its SDPA path: on CPU through Triton's
interpreter (in a subprocess, see conftest), on a GPU for real (marked `gpu`), and the tiny decoder on CUDA with and
without it."""

import json

import pytest
import torch
from conftest import run_in_triton_interpreter, tiny_decoder_with_and_without

from funaudiochat_hf import attention_cosyvoice3
from funaudiochat_hf.attention_cosyvoice3 import dit_attention, sdpa_dit_attention
from funaudiochat_hf.modeling_cosyvoice3 import (
    CosyVoice3RotaryEmbedding,
    additive_attention_mask,
    build_attention_mask,
)


# (batch, frames, heads, head_dim, mask kind): frames not a multiple of the 64-frame blocks, several key blocks, a
# key-padding mask, the block-causal streaming mask, a row that sees no key (length 0: SDPA's additive mask then
# averages every value, and so must the kernel).
CASES = [
    (2, 37, 3, 16, "none"),
    (2, 130, 2, 32, "lengths"),
    (1, 70, 2, 16, "chunk"),
    (2, 20, 2, 16, "empty_row"),
]


def make_inputs(batch, frames, heads, head_dim, kind, device="cpu", dtype=torch.float32, seed=0):
    """q, k, v as views of one fused projection `(batch, frames, 3 * heads * head_dim)`, the rotary tables, the
    additive mask (or None)."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, frames, 3 * heads * head_dim, generator=generator).to(device, dtype)
    query, key, value = qkv.chunk(3, dim=-1)
    cos, sin = CosyVoice3RotaryEmbedding(head_dim).to(device)(frames, torch.device(device))
    lengths = {"lengths": [frames - 50 * (row % 2) for row in range(batch)], "empty_row": [frames, 0]}.get(kind)
    chunk = 16 if kind == "chunk" else None
    mask = build_attention_mask(None if lengths is None else torch.tensor(lengths), frames, chunk, device, batch)
    if mask is not None:
        mask = additive_attention_mask(mask, dtype)
    return query, key, value, cos, sin, mask


_INTERPRETER_SCRIPT = """
import json
import torch
from funaudiochat_hf import attention_cosyvoice3 as kernel
from funaudiochat_hf.attention_cosyvoice3 import sdpa_dit_attention
from test_attention_cosyvoice3 import CASES, make_inputs

errors = {}
for case in CASES:
    query, key, value, cos, sin, mask = make_inputs(*case)
    heads = case[2]
    want = sdpa_dit_attention(query, key, value, cos, sin, heads, mask)
    got = torch.ops.funaudiochat.dit_attention(query, key, value, cos, sin, mask, heads)
    errors[str(case)] = (got - want).abs().max().item()
    # the tiles a Hopper takes for many rows
    got = kernel.launch_dit_attention(query, key, value, cos, sin, mask, heads, kernel.MANY_ROWS_TILES)
    errors[f"{case} many rows"] = (got - want).abs().max().item()
# through torch.compile (the operator's fake implementation; no graph break)
query, key, value, cos, sin, mask = make_inputs(*CASES[1])
compiled = torch.compile(
    lambda *args: torch.ops.funaudiochat.dit_attention(*args) * 2, fullgraph=True, backend="aot_eager"
)
got = compiled(query, key, value, cos, sin, mask, CASES[1][2])
want = 2 * sdpa_dit_attention(query, key, value, cos, sin, CASES[1][2], mask)
errors["compiled"] = (got - want).abs().max().item()
print(json.dumps(errors))
"""


def test_kernel_matches_sdpa_attention_in_the_triton_interpreter():
    """float32 (the interpreter's bfloat16 is not faithful): rotary on head 0, masks, several key blocks."""
    errors = json.loads(run_in_triton_interpreter(_INTERPRETER_SCRIPT))
    assert len(errors) == 2 * len(CASES) + 1
    for case, error in errors.items():
        assert error < 1e-5, (case, error)


def test_tiles_by_gpu_and_rows():
    """The tiles measured on a Hopper only there; there, a serving round's many rows take their own."""
    tiles, many_rows = attention_cosyvoice3.dit_attention_tiles, attention_cosyvoice3.MANY_ROWS
    assert tiles(32, hopper=False) == tiles(2, hopper=False) == attention_cosyvoice3.TILES
    assert tiles(2, hopper=True) == tiles(many_rows - 1, hopper=True) == attention_cosyvoice3.TILES
    assert tiles(many_rows, hopper=True) == tiles(32, hopper=True) == attention_cosyvoice3.MANY_ROWS_TILES


def test_cpu_and_float32_take_the_sdpa_path(monkeypatch):
    """The kernel is for CUDA 16-bit inference: on CPU, `dit_attention` is the SDPA path (bit for bit)."""
    calls = []
    monkeypatch.setattr(torch.ops.funaudiochat, "dit_attention", lambda *args: calls.append(args), raising=False)
    query, key, value, cos, sin, mask = make_inputs(*CASES[1])
    for autocast in (False, True):  # the bf16 estimator runs under autocast
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = dit_attention(query, key, value, cos, sin, 2, mask)
            want = sdpa_dit_attention(query, key, value, cos, sin, 2, mask)
        assert got.dtype == (torch.bfloat16 if autocast else torch.float32)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not calls


def test_sdpa_path_rotates_head_zero_only():
    """x-transformers applies the table before the head split: head 0 of q and k rotates, the other heads do not."""
    query, key, value, cos, sin, _ = make_inputs(1, 9, 2, 16, "none")
    rotated = attention_cosyvoice3.apply_partial_rotary(query, cos, sin)
    torch.testing.assert_close(rotated[..., 16:], query[..., 16:], rtol=0, atol=0)
    assert not torch.allclose(rotated[..., :16], query[..., :16])
    # each (a, b) pair turns by the position's angle: norms are kept
    pairs, rotated_pairs = query[..., :16].unflatten(-1, (-1, 2)), rotated[..., :16].unflatten(-1, (-1, 2))
    torch.testing.assert_close(rotated_pairs.norm(dim=-1), pairs.norm(dim=-1))


def test_sdpa_path_takes_16_bit_projections_with_a_float32_table():
    """A bf16 estimator without the kernel (CPU, no Triton, an explicit bf16 estimator on an older GPU): the rotary
    table is float32, so the rotated channels must be rounded back (as x-transformers does), or SDPA refuses q/k in
    float32 next to a bf16 v."""
    query, key, value, cos, sin, mask = make_inputs(*CASES[1])
    want = sdpa_dit_attention(query, key, value, cos, sin, 2, mask)
    half = [t.bfloat16() for t in (query, key, value)]
    assert cos.dtype == torch.float32
    assert attention_cosyvoice3.apply_partial_rotary(half[0], cos, sin).dtype == torch.bfloat16
    got = sdpa_dit_attention(*half, cos, sin, 2, mask.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2)


# -- GPU -----------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + [(2, 136, 16, 64, "lengths"), (2, 250, 16, 64, "chunk")])
def test_cuda_kernel_matches_sdpa(case, dtype):
    """16-bit on the GPU: the kernel within a rounding of the float32 result (computed on CPU: SDPA's GPU kernels
    differ on a row that sees no key), as the SDPA path is."""
    pytest.importorskip("triton")
    query, key, value, cos, sin, mask = make_inputs(*case, device="cuda", dtype=dtype)
    heads = case[2]
    cpu_inputs = [t.float().cpu() for t in (query, key, value, cos, sin)]
    reference = sdpa_dit_attention(*cpu_inputs, heads, None if mask is None else mask.float().cpu())
    assert attention_cosyvoice3._kernel_applies(query, key, value, cos, heads, mask)
    got = dit_attention(query, key, value, cos, sin, heads, mask)
    assert got.dtype == dtype and got.shape == query.shape
    tolerance = 2e-2 if dtype == torch.bfloat16 else 4e-3  # a few roundings of outputs of magnitude ~1
    torch.testing.assert_close(got.float().cpu(), reference, rtol=0, atol=tolerance)
    if case[-1] != "empty_row":
        with torch.autocast("cuda", dtype=dtype):  # as the 16-bit estimator runs it (the rotary promotes to float32)
            sdpa = sdpa_dit_attention(query, key, value, cos, sin, heads, mask)
        torch.testing.assert_close(sdpa.float().cpu(), reference, rtol=0, atol=tolerance)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("streams, frames", [(1, 436), (4, 436), (16, 606)])
def test_cuda_kernel_at_both_tile_sets_matches_sdpa(streams, frames):
    """Full-size heads, bfloat16: both tile sets the kernel may pick, at serving rounds' shapes."""
    pytest.importorskip("triton")
    query, key, value, cos, sin, mask = make_inputs(2 * streams, frames, 16, 64, "lengths", "cuda", torch.bfloat16)
    cpu_inputs = [t.float().cpu() for t in (query, key, value, cos, sin)]
    reference = sdpa_dit_attention(*cpu_inputs, 16, mask.float().cpu())
    for tiles in (attention_cosyvoice3.TILES, attention_cosyvoice3.MANY_ROWS_TILES):
        got = attention_cosyvoice3.launch_dit_attention(query, key, value, cos, sin, mask, 16, tiles)
        torch.testing.assert_close(got.float().cpu(), reference, rtol=0, atol=2e-2, msg=lambda m: f"{tiles}: {m}")


@pytest.mark.gpu
@cuda
def test_cuda_kernel_compiles_into_one_graph_and_needs_no_gradient():
    pytest.importorskip("triton")
    query, key, value, cos, sin, mask = make_inputs(2, 136, 4, 64, "lengths", device="cuda", dtype=torch.bfloat16)
    assert mask.shape == (2, 1, 1, 136)  # a key-padding mask: one row, read once per key block
    compiled = torch.compile(dit_attention, fullgraph=True, dynamic=True)
    eager = dit_attention(query, key, value, cos, sin, 4, mask)
    torch.testing.assert_close(compiled(query, key, value, cos, sin, 4, mask), eager, rtol=0, atol=0)
    # with a gradient to keep, the SDPA path (the kernel has no backward)
    leaf = query.detach().requires_grad_()
    assert not attention_cosyvoice3._kernel_applies(leaf, key, value, cos, 4, mask)
    # longer windows run through cuDNN's attention, faster there
    long_inputs = make_inputs(1, attention_cosyvoice3.KERNEL_MAX_FRAMES + 1, 4, 64, "none", "cuda", torch.bfloat16)
    assert not attention_cosyvoice3._kernel_applies(*long_inputs[:4], 4, None)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        dit_attention(leaf, key, value, cos, sin, 4, mask).float().sum().backward()
    assert leaf.grad is not None


@pytest.mark.gpu
@cuda
def test_cuda_tiny_decoder_with_the_kernel_matches_sdpa(monkeypatch):
    """The tiny decoder, bf16 estimator, offline and streamed, with and without the kernel: the mel / audio agree to
    bf16 rounding."""
    pytest.importorskip("triton")
    results = tiny_decoder_with_and_without(monkeypatch, attention_cosyvoice3)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=5e-2)
    assert results[True][1].shape == results[False][1].shape
