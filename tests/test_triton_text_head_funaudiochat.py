"""Tests of the text head on a side stream (`triton_text_head_funaudiochat`, `generate_speech(text_head=...)`).

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
@pytest.mark.parametrize("compile", [False, True])
def test_generation_with_the_overlapped_head_matches_the_reference_on_gpu(inputs, compile):
    """`text_head="triton"`, eager and compiled in parts (float32 tiny model): the golden tokens, the golden per-step
    text logits within 1e-4; and a left-padded batch gives the tokens of `text_head="torch"`."""
    pytest.importorskip("triton")
    from transformers import AutoModel

    from conftest import FUNAUDIOCHAT_TINY
    from test_generation_funaudiochat import GOLDEN_KWARGS, _golden, _left_padded_batch

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    golden, text_logits, _ = _golden("1.0")
    cuda_inputs = {name: value.cuda() for name, value in inputs.items()}
    for _ in range(2):  # compiled: the second call replays the captured graphs
        out = model.generate_speech(
            **cuda_inputs, **GOLDEN_KWARGS, output_logits=True, compile=compile, text_head="triton"
        )
        assert torch.equal(out.sequences.cpu(), golden["sequences"])
        assert torch.equal(out.speech_ids.cpu(), golden["speech_ids"])
        torch.testing.assert_close(out.text_logits[0].cpu(), text_logits, atol=1e-4, rtol=1e-4)
    batch_ids, mask, _, audio = _left_padded_batch(inputs)
    batch = {"input_ids": batch_ids.cuda(), "attention_mask": mask.cuda(), **{k: v.cuda() for k, v in audio.items()}}
    runs = [model.generate_speech(**batch, **GOLDEN_KWARGS, compile=compile, text_head=h) for h in ("triton", "torch")]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert torch.equal(runs[0].speech_ids, runs[1].speech_ids)


def test_text_head_choice(monkeypatch, inputs):
    """"auto" overlaps the head in a loop compiled in parts up to 16 rows with speech on; not a loop compiled whole
    (one CUDA graph cannot end with a forked stream), not a batch of 17, not speech-to-text, not eagerly. "triton"
    where it cannot run is a clear error; unknown names are refused."""
    pytest.importorskip("triton")
    from transformers import AutoModel

    from conftest import FUNAUDIOCHAT_TINY

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()
    ids = inputs["input_ids"]
    compiled = {"compile": {"backend": "eager", "fullgraph": True}}
    assert not model._speech_run(ids, None, {}, compiled).cfg.overlap_text_head  # CPU: no Triton GPU
    with pytest.raises(ValueError, match="'auto', 'triton' or 'torch'"):
        model._speech_run(ids, None, {}, {"text_head": "stream"})

    monkeypatch.setattr("funaudiochat_hf.generation_funaudiochat.triton_available", lambda device: True)
    assert model._speech_run(ids, None, {}, compiled).cfg.overlap_text_head
    assert not model._speech_run(ids, None, {}, {**compiled, "text_head": "torch"}).cfg.overlap_text_head
    assert not model._speech_run(ids, None, {}, {**compiled, "compile_scope": "step"}).cfg.overlap_text_head
    assert model._speech_run(ids.repeat(2, 1), None, {}, compiled).cfg.overlap_text_head  # up to text_head_overlap_max_rows
    assert not model._speech_run(ids.repeat(17, 1), None, {}, compiled).cfg.overlap_text_head
    assert not model._speech_run(ids, None, {}, {**compiled, "disable_speech": True}).cfg.overlap_text_head
    assert not model._speech_run(ids, None, {}, {}).cfg.overlap_text_head  # eager, "auto"
    assert model._speech_run(ids, None, {}, {"text_head": "triton"}).cfg.overlap_text_head  # eager, asked for
    assert model._speech_run(ids.repeat(2, 1), None, {}, {**compiled, "text_head": "triton"}).cfg.overlap_text_head
    with pytest.raises(ValueError, match="text_head='triton'.*compile_scope='parts'"):
        model._speech_run(ids, None, {}, {**compiled, "compile_scope": "step", "text_head": "triton"})
    with pytest.raises(ValueError, match="text_head='triton'"):
        model._speech_run(ids.repeat(17, 1), None, {}, {**compiled, "text_head": "triton"})
