"""Tests of the text head on a side stream (`triton_text_head_funaudiochat`, the plan part `overlap_text_head`).

The persistent kernel is checked against `lm_head(x).float()` on CPU through Triton's interpreter (a subprocess) and on
a GPU for real (marked `gpu`), where the side stream's ordering is checked too. The whole tiny model decoding with the
head overlapped is in `test_triton_linear_funaudiochat.test_generate_through_the_kernels_matches_reference_...`.
"""

import json

import pytest
import torch
from torch import nn

from funaudiochat_hf import triton_text_head_funaudiochat as text_head

from conftest import run_in_triton_interpreter


# (rows, vocab, in_features, bias, programs): a vocabulary not a multiple of the 64-column tile, a reduction not a
# multiple of the 128-wide chunk, programs that walk several tiles each, a grid wider than the tiles.
CASES = [
    (1, 200, 96, False, 3),
    (3, 130, 256, True, 2),
    (16, 64, 160, False, 1),
    (2, 70, 64, True, 8),
]

_SCRIPT = """
import json, torch
from funaudiochat_hf.triton_text_head_funaudiochat import OverlappedTextHead, launch_text_head
from test_triton_text_head_funaudiochat import CASES, case_tensors
errors = []
for case in CASES:
    # float16 for the rounding to a 16-bit model dtype: the interpreter's bfloat16 tl.dot is wrong (Triton 3.6).
    for dtype in (torch.float32, torch.float16):
        x, head, expected = case_tensors(*case[:4], dtype)
        out = torch.full_like(expected, float("nan"))
        launch_text_head(x, head.weight, head.bias, out, programs=case[4])
        # The same float32 sum in another order; in float16 then one rounding: at most one float16 step apart.
        step = (expected.abs() * (2**-10 if dtype == torch.float16 else 1e-6)).clamp(min=1e-5)
        errors.append(bool(((out - expected).abs() <= step).all()))
# Off CUDA the overlapped head runs inline.
x, head, expected = case_tensors(*CASES[0][:4], torch.float32)
out = torch.zeros_like(expected)
overlapped = OverlappedTextHead(x.device)
overlapped.start(x, head, out)
overlapped.join()
errors.append(bool(torch.allclose(out, expected, atol=1e-5)))
print(json.dumps(errors))
"""


def case_tensors(rows, vocab, in_features, bias, dtype=torch.float32, device="cpu"):
    """`(x, head, expected)`: a `(rows, in_features)` input, an `nn.Linear` text head and `head(x).float()`."""
    generator = torch.Generator().manual_seed(rows * 1000 + vocab + in_features)
    head = nn.Linear(in_features, vocab, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, in_features, generator=generator) / in_features**0.5)
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=generator))
    head = head.to(device=device, dtype=dtype)
    x = torch.randn(rows, in_features, generator=generator).to(device=device, dtype=dtype)
    with torch.no_grad():
        return x, head, head(x).float()


def test_kernel_matches_the_linear_head_in_the_triton_interpreter():
    """Every case in float32 and float16 (logits rounded to the model dtype, as `lm_head(x).float()`), each program
    walking several column tiles or none; and the overlapped head's inline path (CPU)."""
    results = json.loads(run_in_triton_interpreter(_SCRIPT))
    assert results == [True] * (2 * len(CASES) + 1), results


def test_launch_rejects_what_the_kernel_cannot_take():
    pytest.importorskip("triton")
    x, head, expected = case_tensors(17, 8, 16, False)
    with pytest.raises(ValueError, match="rows <= 16"):
        text_head.launch_text_head(x, head.weight, None, expected)
    x, head, expected = case_tensors(2, 8, 16, False)
    with pytest.raises(ValueError, match="float32 out"):
        text_head.launch_text_head(x, head.weight, None, expected.double())


def test_supported_heads():
    head = nn.Linear(8, 32, bias=False)
    available = text_head.triton is not None
    assert text_head.text_head_supported(head, 16) == available
    assert not text_head.text_head_supported(head, 17)  # more rows than a tile
    head.weight.data = head.weight.data.t().contiguous().t()
    assert not text_head.text_head_supported(head, 1)  # a transposed weight would be misread


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 16])
def test_overlapped_head_on_cuda_matches_the_head_after_busy_work(rows):
    """On a side stream, started after a long kernel on the current stream that writes the head's input, and joined
    before the logits are read: the result is the head of the written input (the side stream waited for it, and the
    current stream for the side stream). The full-size vocabulary, a smaller hidden size."""
    pytest.importorskip("triton")
    device = torch.device("cuda")
    x, head, _ = case_tensors(rows, 151936, 1024, False, torch.bfloat16, device)
    source = torch.randn(rows, 1024, device=device, dtype=torch.bfloat16)
    busy = torch.randn(4096, 4096, device=device)
    out = torch.zeros(rows, 151936, device=device)
    overlapped = text_head.OverlappedTextHead(device)
    for _ in range(3):
        out.zero_()
        x.zero_()
        torch.cuda.synchronize()
        busy @ busy  # keeps the current stream busy before the input is written
        x.copy_(source)
        overlapped.start(x, head, out)
        busy @ busy  # the CRQ's place: runs beside the head
        overlapped.join()
        got = out.clone()  # on the current stream, after the join
        with torch.no_grad():
            expected = head(source).float()
        step = (expected.abs() * 2**-7).clamp(min=1e-5)
        assert ((got - expected).abs() <= step).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cuda_graphs", "compiled"])
def test_generation_with_the_overlapped_head_matches_the_reference_on_gpu(inputs, backend):
    """The overlapped text head in the fast backends (float32 tiny model): the golden tokens, the golden per-step
    text logits within 1e-4; and a left-padded batch gives the tokens of the plan without it."""
    pytest.importorskip("triton")
    from transformers import AutoModel

    from conftest import FUNAUDIOCHAT_TINY
    from test_generation_funaudiochat import GOLDEN_KWARGS, _golden, _left_padded_batch

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    golden, text_logits, _ = _golden("1.0")
    cuda_inputs = {name: value.cuda() for name, value in inputs.items()}
    generator = model.speech_generator(max_batch_size=2, backend=backend)
    assert generator.plan(None, 1, False, None).overlap_text_head
    for _ in range(3):  # the later calls replay the captured graphs
        out = generator.generate(**cuda_inputs, **GOLDEN_KWARGS, output_logits=True)
        assert torch.equal(out.sequences.cpu(), golden["sequences"])
        assert torch.equal(out.speech_ids.cpu(), golden["speech_ids"])
        torch.testing.assert_close(out.text_logits[0].cpu(), text_logits, atol=1e-4, rtol=1e-4)
    batch_ids, mask, _, audio = _left_padded_batch(inputs)
    batch = {"input_ids": batch_ids.cuda(), "attention_mask": mask.cuda(), **{k: v.cuda() for k, v in audio.items()}}
    without = model.speech_generator(max_batch_size=2, backend=backend, plan_overrides={"overlap_text_head": False})
    runs = [gen.generate(**batch, **GOLDEN_KWARGS) for gen in (generator, without)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert torch.equal(runs[0].speech_ids, runs[1].speech_ids)


def test_text_head_choice(monkeypatch):
    """The fast backends overlap the head up to `AUTO_MAX_ROWS` rows with speech on; not a batch of 17, not
    speech-to-text, not the eager loop; forcing it where it cannot run is a clear error."""
    pytest.importorskip("triton")
    from transformers import AutoModel

    from conftest import FUNAUDIOCHAT_TINY
    from funaudiochat_hf import generation_plan_funaudiochat as plan_module

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()
    compiled = model.speech_generator(backend="compiled")
    if not torch.cuda.is_available():
        assert not compiled.plan(None, 1, False, None).overlap_text_head  # CPU: no Triton GPU

    monkeypatch.setattr(plan_module.DeviceFacts, "of", classmethod(lambda cls, model: cls("cuda", True)))
    assert compiled.plan(None, 1, False, None).overlap_text_head
    assert compiled.plan("cuda_graphs", 1, False, None).overlap_text_head  # inside the step's CUDA graph too
    assert compiled.plan(None, 2, False, None).overlap_text_head  # up to AUTO_MAX_ROWS
    assert not compiled.plan(None, 17, False, None).overlap_text_head
    assert not compiled.plan(None, 1, True, None).overlap_text_head  # disable_speech
    assert not compiled.plan("eager", 1, False, None).overlap_text_head
    off = model.speech_generator(backend="compiled", plan_overrides={"overlap_text_head": False})
    assert not off.plan(None, 1, False, None).overlap_text_head
    forced = model.speech_generator(backend="compiled", plan_overrides={"overlap_text_head": True})
    with pytest.raises(ValueError, match="overlap_text_head"):
        forced.plan(None, 17, False, None)

