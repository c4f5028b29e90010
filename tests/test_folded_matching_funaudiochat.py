"""Tests of the folded linear maps around the CRQ stack (the fast backends' `fold_crq_matching` part,
`fused_crq_funaudiochat.folded_crq_matching`) on the tiny fixture.

Golden parity: tests/fixtures/MANIFEST.md §2e (reference `generate` with text_greedy, do_sample=False,
max_new_tokens 16, eos 322, pad 320; per-step raw text logits and the 5 raw CRQ logits of every forward call).
"""

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf.fused_crq_funaudiochat import can_fold_crq_matching, folded_crq_matching

from conftest import FUNAUDIOCHAT_GOLDEN, assert_batch_rows_equal_single_runs


GOLDEN_KWARGS = dict(max_new_tokens=16, do_sample=False, eos_token_id=322, pad_token_id=320)
COMPILED = {"backend": "aot_eager", "fullgraph": True}
AUDIO_TOKEN, PAD = 346, 320
ATOL = RTOL = 1e-5


class LoraLikeLinear(nn.Linear):
    """A subclass computes something else than `weight @ x` for all the fold knows (LoRA, quantized layers)."""


def _with_biases(model):
    """A copy of `model` whose folded linears all have non-zero biases (the tiny checkpoint's have one on
    pre_matching only), so that every bias path of the fold is exercised."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    for owner, name in (
        (other.audio_invert_tower, "input_matching"),
        (other.audio_invert_tower, "output_matching"),
        (other.audio_invert_tower, "lm_head"),
        (other.audio_tower, "output_matching"),
    ):
        old = getattr(owner, name)
        new = nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(0.1 * torch.randn(old.out_features, generator=generator))
        setattr(owner, name, new)
    return other


@pytest.mark.parametrize("biases", [False, True])
def test_folded_maps_equal_the_maps_they_fold(model, biases):
    """Each folded copy gives what the chain of linears it replaces gives (float32, to rounding)."""
    model = _with_biases(model) if biases else model
    tower, discrete = model.audio_invert_tower, model.audio_tower
    folded = folded_crq_matching(model)
    generator = torch.Generator().manual_seed(0)
    hidden = tower.pre_matching.in_features
    conditioning = torch.randn(2, 3, hidden, generator=generator)
    tokens = torch.tensor([[0, 5, 36, 7, 39], [12, 12, 3, 38, 1]])
    with torch.no_grad():
        # Sub-position inputs: input_matching(pre_matching(z)_k + E[token]) = folded(z)_k + table[token].
        embeds = discrete.embed_tokens(tokens[:, :1])  # (2, 1, H), broadcast over the 3 * K sub-positions
        expected = tower.input_matching(tower.split_positions(conditioning) + embeds)
        sub_inputs = folded.sub_inputs(conditioning).reshape(2, 3 * tower.group_size, -1)
        ours = sub_inputs + folded.speech_inputs[tokens[:, :1]]
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)
        # Logits: lm_head(output_matching(h)).
        states = torch.randn(2, tower.output_matching.in_features, generator=generator)
        torch.testing.assert_close(
            folded.head(states), tower.lm_head(tower.output_matching(states)), atol=ATOL, rtol=RTOL
        )
        # Speech feedback: the discrete encoder's output_matching of a group's mean embedding.
        feedback = folded.feedback[tokens].mean(dim=1, keepdim=True)
        torch.testing.assert_close(feedback, discrete.encode_groups(tokens), atol=ATOL, rtol=RTOL)
    assert folded.head.weight.shape[0] % 8 == 0  # padded for cuBLAS, as the unfolded head's copy
    assert folded.head(states).shape == (2, tower.lm_head.out_features)


def test_folded_copies_are_kept_and_rebuilt_after_weight_changes(model):
    other = copy.deepcopy(model)
    first = folded_crq_matching(other)
    assert folded_crq_matching(other, previous=first) is first
    with torch.no_grad():
        other.audio_tower.embed_tokens.weight.mul_(2.0)  # in place: a new version
    second = folded_crq_matching(other, previous=first)
    assert second is not first
    torch.testing.assert_close(second.speech_inputs, 2.0 * first.speech_inputs, atol=ATOL, rtol=RTOL)
    other.to(torch.float64)  # re-allocated
    third = folded_crq_matching(other, previous=second)
    assert third is not second and third.head.weight.dtype == torch.float64


def _generator(model, fold: bool = True):
    return model.speech_generator(backend="compiled", plan_overrides={"fold_crq_matching": fold})


def test_fold_refuses_what_it_cannot_fold(model, inputs):
    """A LoRA-wrapped (or quantized) source is not folded by the plan (no error); asking for the fold raises, naming
    the module; without a speech decoder there is nothing to fold."""
    other = copy.deepcopy(model)
    old = other.audio_invert_tower.output_matching
    wrapped = LoraLikeLinear(old.in_features, old.out_features, bias=False)
    wrapped.load_state_dict(old.state_dict())
    other.audio_invert_tower.output_matching = wrapped
    assert can_fold_crq_matching(model) and not can_fold_crq_matching(other)
    assert not other.speech_generator(backend="compiled").plan(None, 1, False, None).fold_crq_matching
    with pytest.raises(ValueError, match="fold_crq_matching"):
        _generator(other).plan(None, 1, False, None)
    with pytest.raises(ValueError, match=r"audio_invert_tower\.output_matching.*LoraLikeLinear"):
        folded_crq_matching(other)
    speechless = copy.deepcopy(model)
    speechless.audio_invert_tower = None
    with pytest.raises(ValueError, match="audio_invert_tower"):
        folded_crq_matching(speechless)


def test_compiled_backend_folds(model):
    """The compiled backend folds where it can; the eager one and a speech-off call do not; an override turns it
    off."""
    generator = model.speech_generator(backend="compiled")
    assert generator.plan(None, 1, False, None).fold_crq_matching
    assert not generator.plan("eager", 1, False, None).fold_crq_matching
    assert not generator.plan(None, 1, True, None).fold_crq_matching  # disable_speech
    assert not _generator(model, fold=False).plan(None, 1, False, None).fold_crq_matching


@pytest.mark.parametrize("rep", ["1.0", "1.2"])
def test_folded_generate_matches_reference(model, inputs, rep):
    """The golden tokens, and the golden per-step logits within the parity tolerance, compiled (fullgraph=True: the
    folded sub-step is one graph)."""
    golden = load_file(FUNAUDIOCHAT_GOLDEN / f"e_generate_rep{rep}.safetensors")
    with _generator(model) as generator:
        out = generator.generate(
            **inputs, **dict(GOLDEN_KWARGS, repetition_penalty=float(rep)), output_logits=True, compile_config=COMPILED
        )
        assert generator._weights.folded is not None
    assert torch.equal(out.sequences, golden["sequences"])
    assert torch.equal(out.speech_ids, golden["speech_ids"])
    steps = len(golden["generated_text_ids"][0])
    crq_logits = torch.stack([golden[f"step{i:02d}.crq_logits_last5"][0] for i in range(steps)])
    torch.testing.assert_close(out.speech_logits[0], crq_logits, atol=1e-4, rtol=1e-4)


def test_the_folded_copies_are_what_runs(model, inputs):
    """Corrupting the generator's folded copy (its sources untouched, so it is not rebuilt) changes the output: the
    plan runs the folded weights inside the compiled step; unfolded, the same logits as before."""
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True, compile_config=COMPILED)
    with _generator(model) as generator:
        good = generator.generate(**inputs, **kwargs)
        folded = generator._weights.folded
        for corrupt in (folded.head.weight, folded.speech_inputs, folded.sub_inputs.weight, folded.feedback):
            original = corrupt.clone()
            with torch.no_grad():
                corrupt.mul_(3.0)
            bad = generator.generate(**inputs, **kwargs)
            with torch.no_grad():
                corrupt.copy_(original)
            changed = not torch.allclose(bad.speech_logits, good.speech_logits, atol=1e-3)
            assert changed or not torch.allclose(bad.text_logits, good.text_logits, atol=1e-3)
    with _generator(model, fold=False) as generator:
        plain = generator.generate(**inputs, **kwargs)
    torch.testing.assert_close(plain.speech_logits, good.speech_logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(plain.text_logits, good.text_logits, atol=ATOL, rtol=RTOL)


def test_folded_batch_rows_equal_single_runs(model, inputs):
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, backend="compiled", compile_config=COMPILED)
    assert_batch_rows_equal_single_runs(model, inputs, kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_cuda_graph_folded_loop_matches_unfolded_on_gpu(inputs, batch):
    """On CUDA the fast backend runs the folded copies through the GEMV kernel at one row and through cuBLAS (the
    padded head) at several: float32 tokens equal the unfolded loop's, logits to rounding, batch rows alike."""
    from transformers import AutoModel

    from conftest import FUNAUDIOCHAT_TINY

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    if batch == 1:
        inputs = {name: value.cuda() for name, value in inputs.items()}
    else:  # two text-only prompts of different lengths, left-padded
        ids = inputs["input_ids"][0][inputs["input_ids"][0] != AUDIO_TOKEN]
        input_ids = torch.stack([ids, torch.cat([torch.full((8,), PAD), ids[8:]])])
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, :8] = 0
        inputs = {"input_ids": input_ids.cuda(), "attention_mask": attention_mask.cuda()}
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.0, output_logits=True)
    unfolded = model.speech_generator(
        max_batch_size=batch, backend="cuda_graphs", plan_overrides={"fold_crq_matching": False}
    ).generate(
        **inputs, **kwargs
    )
    generator = model.speech_generator(max_batch_size=batch, backend="cuda_graphs")
    for _ in range(3):  # the later calls replay the recorded CUDA graphs, reading the folded copies in place
        folded = generator.generate(**inputs, **kwargs)
        assert torch.equal(folded.sequences, unfolded.sequences)
        assert torch.equal(folded.speech_ids, unfolded.speech_ids)
        torch.testing.assert_close(folded.speech_logits, unfolded.speech_logits, atol=1e-4, rtol=1e-4)
