"""Tests of `generation_stack_inputs_funaudiochat`: a decode step's masks and rotary tables prepared once for its LLM
call and its K CRQ sub-steps. On a CPU the step that prepares them (static caches, the stacks layer by layer with the
GQA decode attention, Python-int sub-steps: the "cuda_graphs" step without its CUDA-only parts) is forced through the
plan; it must compute bit for bit what the same step computes building them call by call."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from funaudiochat_hf import decoder_stack_funaudiochat, generation_state_funaudiochat, generation_step_funaudiochat
from funaudiochat_hf import generation_stack_inputs_funaudiochat as stack_inputs
from funaudiochat_hf.generation_plan_funaudiochat import DecodePlan


KWARGS = dict(max_new_tokens=10, do_sample=False, repetition_penalty=1.2, eos_token_id=[], pad_token_id=320,
              backend="eager", cache_implementation="static", output_logits=True)  # fmt: skip
# The step that prepares its stack inputs, without the CUDA-only parts (Triton kernels, CUDA graphs).
LAYERED_PLAN = DecodePlan("eager", static_cache=True, attention="gqa_matmul", fuse_crq_projections=True,
                          fold_crq_matching=True)  # fmt: skip


@pytest.fixture
def layered(monkeypatch):
    monkeypatch.setattr(generation_state_funaudiochat, "plan_decode", lambda *args, **kwargs: LAYERED_PLAN)


def _left_padded_batch(inputs):
    """Two rows: the golden prompt, and its last 40 text ids left-padded (a row's key mask with a hole)."""
    ids = inputs["input_ids"]
    batch = torch.full((2, ids.shape[1]), 320)
    batch[0] = ids[0]
    text = ids[0][ids[0] != 346]
    batch[1, -40:] = text[-40:]
    mask = torch.ones_like(batch)
    mask[1, :-40] = 0
    audio = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return dict(input_ids=batch, attention_mask=mask, **audio)


def test_prepared_masks_are_the_causal_masks_of_each_call(model, inputs, layered, monkeypatch):
    """Every one-position stack call of a batch with left padding: `decode_masks` from the cache length equals the
    mask `create_causal_mask` builds for that call (the call-by-call path)."""
    monkeypatch.setattr(generation_step_funaudiochat, "prepares_stack_inputs", lambda model, cfg: False)
    build = decoder_stack_funaudiochat.create_causal_mask
    compared = []

    def spy(config, inputs_embeds, key_mask, cache, positions):
        mask = build(config, inputs_embeds, key_mask, cache, positions)
        if inputs_embeds.shape[1] == 1:
            length = cache.layers[0].cumulative_length.view(1)
            compared.append(torch.equal(mask, stack_inputs.decode_masks(key_mask, length)[0]))
        return mask

    monkeypatch.setattr(decoder_stack_funaudiochat, "create_causal_mask", spy)
    model.generate_speech(**_left_padded_batch(inputs), **dict(KWARGS, max_new_tokens=4))
    group_size = model.config.audio_config.group_size
    assert compared == [True] * ((group_size - 1) + 3 * (1 + group_size)), compared  # prefill's sub-steps, 3 steps


def test_a_reply_with_prepared_inputs_is_bit_identical_and_builds_no_mask_per_call(model, inputs, layered, monkeypatch):
    """The same batch, 10 steps, with and without the preparation: equal tokens, speech and logits bit for bit; with
    it, no stack call builds a mask (the masks of the K sub-steps come from one batch)."""
    calls = Counter()
    build = decoder_stack_funaudiochat.create_causal_mask

    def counting(*args):
        calls["one position" if args[1].shape[1] == 1 else "prompt"] += 1
        return build(*args)

    monkeypatch.setattr(decoder_stack_funaudiochat, "create_causal_mask", counting)
    batch = _left_padded_batch(inputs)
    prepared = model.generate_speech(**batch, **KWARGS)
    assert calls["one position"] == 0, calls
    monkeypatch.setattr(generation_step_funaudiochat, "prepares_stack_inputs", lambda model, cfg: False)
    built = model.generate_speech(**batch, **KWARGS)
    assert calls["one position"] > 0
    for name in ("sequences", "speech_ids", "text_logits", "speech_logits"):
        assert torch.equal(getattr(prepared, name), getattr(built, name)), name


def test_preparing_the_step_launches_fewer_ops(model, inputs, layered, monkeypatch):
    """The ops of one decode step with and without the preparation (a CUDA-graphed step launches each one): about
    twenty a stack call fewer (the rotary tables gathered from the workspace's tables of every position)."""

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket.__name__ not in ("view", "unsqueeze", "slice", "expand", "select")
            return func(*args, **(kwargs or {}))

    def ops_per_step():
        counts = []
        for steps in (4, 8):
            with Ops() as ops:
                model.generate_speech(**inputs, **dict(KWARGS, max_new_tokens=steps, output_logits=False))
            counts.append(ops.count)
        return (counts[1] - counts[0]) / 4

    prepared = ops_per_step()
    monkeypatch.setattr(generation_step_funaudiochat, "prepares_stack_inputs", lambda model, cfg: False)
    built = ops_per_step()
    calls = 1 + model.config.audio_config.group_size
    assert built - prepared >= 15 * calls, (built, prepared)


def test_which_steps_prepare_their_stack_inputs(model):
    """Static caches and a decode attention (layer by layer), not the compiled step (Inductor fuses these ops) nor the
    eager loop's own forwards."""
    from types import SimpleNamespace

    def cfg(plan, attention="funaudiochat_gqa_decode"):
        return SimpleNamespace(plan=plan, attention_implementation=attention, disable_speech=False)

    assert stack_inputs.prepares_stack_inputs(model, cfg(LAYERED_PLAN))
    assert not stack_inputs.prepares_stack_inputs(model, cfg(LAYERED_PLAN, attention=None))
    assert not stack_inputs.prepares_stack_inputs(model, cfg(DecodePlan("eager", static_cache=False)))
    compiled = DecodePlan("compiled", static_cache=True, compile_step=True, attention="gqa_matmul")
    assert not stack_inputs.prepares_stack_inputs(model, cfg(compiled))


def test_the_workspace_keeps_the_tables_it_gathers_from(model, inputs, layered):
    """The rotary tables of every cache position and the column indices are built by a workspace's first step and
    kept: a second reply on the same generator builds none."""
    with model.speech_generator(backend="eager") as generator:
        generator.generate(**inputs, **dict(KWARGS, max_new_tokens=3))
        workspace = next(iter(generator._workspaces.values()))
        tables = dict(workspace.decode_tables)
        generator.generate(**inputs, **dict(KWARGS, max_new_tokens=3))
        assert workspace.decode_tables.keys() == tables.keys() and len(tables) >= 4
        assert all(workspace.decode_tables[key] is table for key, table in tables.items())
