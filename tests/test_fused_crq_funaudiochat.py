"""Tests of the fused q/k/v + gate/up CRQ forward (the fast backends' `fuse_crq_projections` part) on tiny configs.

Golden parity: tests/fixtures/MANIFEST.md §2e (reference `generate` with text_greedy, do_sample=False,
max_new_tokens 16, eos 322, pad 320).
"""

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModel, DynamicCache, Qwen3Config, StaticCache
from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf.compat import cache_kwargs
from funaudiochat_hf.decoder_stack_funaudiochat import decoder_stack_forward
from funaudiochat_hf import fused_crq_funaudiochat
from funaudiochat_hf.fused_crq_funaudiochat import can_fuse_crq_projections, fused_crq_projections, padded_output_linear

from conftest import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, assert_batch_rows_equal_single_runs


GOLDEN_KWARGS = dict(max_new_tokens=16, do_sample=False, eos_token_id=322, pad_token_id=320)
ATOL = RTOL = 1e-5
# The "compiled" backend on a CPU (fused CRQ projections in its plan), through a compiler that needs no C++ toolchain.
CPU_COMPILE = {"backend": "aot_eager", "fullgraph": True}


def _fused_generator(model, **overrides):
    """A generator of the compiled backend with the fused CRQ projections and without the folded matching (which
    would replace the linears around the stack: test_folded_matching_funaudiochat)."""
    return model.speech_generator(backend="compiled", plan_overrides={"fold_crq_matching": False, **overrides})


def _golden(rep: str) -> dict:
    return load_file(FUNAUDIOCHAT_GOLDEN / f"e_generate_rep{rep}.safetensors")


def _make_cache(kind: str, config, max_len: int):
    return StaticCache(config=config, max_cache_len=max_len) if kind == "static" else DynamicCache(config=config)


def _assert_fused_matches(crq: nn.Module, cache_kind: str, batch: int = 2, prefill: int = 13, steps: int = 3) -> None:
    """Prefill of `prefill` positions (row 1 left-padded by 4), then `steps` single decode positions, both ways."""
    hidden = crq.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    max_len = prefill + steps
    padding = torch.tensor([0] + [4] * (batch - 1))
    mask = torch.ones(batch, max_len, dtype=torch.bool)
    mask[1:, :4] = False
    reference_cache, fused_cache = (_make_cache(cache_kind, crq.config, max_len) for _ in range(2))
    fused = fused_crq_projections(crq)

    def both(embeds, positions, length):
        # A StaticCache takes the mask over the whole cache, a DynamicCache the mask up to the current length.
        step_mask = mask if cache_kind == "static" else mask[:, :length]
        with torch.no_grad():
            reference = crq(
                inputs_embeds=embeds,
                attention_mask=step_mask,
                position_ids=positions,
                use_cache=True,
                **cache_kwargs(reference_cache),
            ).last_hidden_state
            ours = decoder_stack_forward(crq, fused, embeds, step_mask, positions, fused_cache)
        assert ours.shape == reference.shape == (batch, embeds.shape[1], hidden)
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=RTOL)

    positions = (torch.arange(prefill)[None] - padding[:, None]).clamp(min=0)
    both(torch.randn(batch, prefill, hidden, generator=generator), positions, prefill)
    for step in range(steps):
        positions = (prefill + step - padding)[:, None]
        both(torch.randn(batch, 1, hidden, generator=generator), positions, prefill + step + 1)
    # The caches were filled identically.
    torch.testing.assert_close(fused_cache.layers[0].keys, reference_cache.layers[0].keys, atol=ATOL, rtol=RTOL)


def _small_qwen3(**overrides) -> Qwen3Model:
    config = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        vocab_size=16,
        max_position_embeddings=64,
    )
    config.update(overrides)
    torch.manual_seed(0)
    model = Qwen3Model(Qwen3Config(**config)).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a mistake in them shows
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    return model


# --------------------------------------------------------------------------------------------------------------------
# The fused forward against transformers' Qwen3Model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_fused_forward_matches_crq_transformer(model, cache_kind):
    _assert_fused_matches(model.audio_invert_tower.crq_transformer, cache_kind)


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_fused_forward_with_attention_bias(cache_kind):
    crq = _small_qwen3(attention_bias=True)
    assert crq.layers[0].self_attn.q_proj.bias is not None
    fused = fused_crq_projections(crq)
    assert fused.layers[0].qkv_bias.shape == (4 * 8 + 2 * 2 * 8,)
    assert fused.layers[0].gate_up_bias is None
    _assert_fused_matches(crq, cache_kind)


def test_fused_forward_without_cache_matches():
    crq = _small_qwen3()
    embeds = torch.randn(1, 7, 32)
    positions = torch.arange(7)[None]
    with torch.no_grad():
        reference = crq(inputs_embeds=embeds, position_ids=positions, use_cache=False).last_hidden_state
        ours = decoder_stack_forward(crq, fused_crq_projections(crq), embeds, None, positions, None)
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=RTOL)


def test_fused_weights_are_kept_and_rebuilt_after_weight_changes():
    crq = _small_qwen3()
    first = fused_crq_projections(crq)
    assert fused_crq_projections(crq, previous=first) is first  # no change: the copy the caller holds
    layer = crq.layers[1]
    expected = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    assert torch.equal(first.layers[1].qkv_weight, expected)

    state = {name: tensor + 0.1 for name, tensor in crq.state_dict().items()}
    crq.load_state_dict(state)  # in place: same data pointers, bumped versions
    second = fused_crq_projections(crq, previous=first)
    assert second is not first
    expected = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
    assert torch.equal(second.layers[1].gate_up_weight, expected)
    _assert_fused_matches(crq, "static")

    crq.to(torch.float64)  # re-allocated weights
    third = fused_crq_projections(crq, previous=second)
    assert third is not second and third.layers[0].qkv_weight.dtype == torch.float64


def test_non_plain_linear_projection_raises():
    class LoraLikeLinear(nn.Linear):
        pass

    crq = _small_qwen3()
    old = crq.layers[1].mlp.up_proj
    crq.layers[1].mlp.up_proj = LoraLikeLinear(old.in_features, old.out_features, bias=False)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj.*LoraLikeLinear"):
        fused_crq_projections(crq)


def test_padded_output_linear():
    """Zero output rows up to a multiple of 8; the same outputs; kept, rebuilt after a weight change; None where it
    does not apply (already aligned, not a plain `nn.Linear`)."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 13)
    padded = padded_output_linear(linear)
    assert padded.weight.shape == (16, 16) and padded.bias.shape == (16,) and padded.out_features == 13
    assert torch.equal(padded.weight[:13], linear.weight) and torch.equal(padded.bias[:13], linear.bias)
    assert not padded.weight[13:].any() and not padded.bias[13:].any()
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        assert padded(x).shape == (2, 3, 13)
        torch.testing.assert_close(padded(x), linear(x), atol=1e-6, rtol=1e-6)
    assert padded_output_linear(linear, previous=padded) is padded
    with torch.no_grad():
        linear.weight.mul_(2.0)  # in place: a new version of the same tensor
    rebuilt = padded_output_linear(linear, previous=padded)
    assert rebuilt is not padded and torch.equal(rebuilt.weight[:13], linear.weight)
    assert padded_output_linear(nn.Linear(16, 13, bias=False)).bias is None
    assert padded_output_linear(nn.Linear(16, 24)) is None

    class LoraLikeLinear(nn.Linear):
        pass

    assert padded_output_linear(LoraLikeLinear(16, 13)) is None


def test_compiled_loop_runs_the_speech_head_through_its_padded_copy(model, inputs, monkeypatch):
    """The compiled backend multiplies the speech head through `padded_output_linear`'s copy (the tiny head's 40 rows
    are aligned to 8, so here to 16: 48 rows): the golden tokens, and corrupting the copy's padding-free rows changes
    the logits (it is what runs)."""
    monkeypatch.setattr(fused_crq_funaudiochat, "OUTPUT_ALIGNMENT", 16)
    golden = _golden("1.2")
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True, compile_config=CPU_COMPILE)
    with _fused_generator(model) as generator:
        good = generator.generate(**inputs, **kwargs)
        assert torch.equal(good.sequences, golden["sequences"]) and torch.equal(good.speech_ids, golden["speech_ids"])
        padded = generator._weights.padded_head
        assert padded.weight.shape[0] == 48
        with torch.no_grad():
            padded.weight[:40].mul_(3.0)
        bad = generator.generate(**inputs, **kwargs)
    assert not torch.allclose(bad.speech_logits, good.speech_logits, atol=1e-3)
    eager = model.generate_speech(**inputs, **kwargs, backend="eager")  # the eager loop keeps the head itself
    torch.testing.assert_close(eager.speech_logits, good.speech_logits, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------------------------------------------------
# The fused projections in generate_speech
# --------------------------------------------------------------------------------------------------------------------


def test_plans_fuse_and_use_gqa_attention_in_the_compiled_backend(model):
    """Issue 4: the compiled backend fuses the CRQ projections and takes the GQA decode attention on a CPU (no
    Triton); the eager backend is the plain model; speech off fuses nothing; an override turns fusion off."""
    with model.speech_generator(backend="compiled") as generator:
        compiled = generator.plan(None, 1, False, None)
        assert compiled.fuse_crq_projections and compiled.attention == "gqa_matmul" and compiled.compile_step
        assert not compiled.crq_linear and not compiled.step_graph  # CPU: no Triton kernels, no CUDA graph
        assert not generator.plan(None, 1, True, None).fuse_crq_projections  # disable_speech
        eager = generator.plan("eager", 1, False, None)
        assert not eager.fuse_crq_projections and eager.attention == "default" and not eager.compile_step
    with model.speech_generator(backend="compiled", plan_overrides={"fuse_crq_projections": False}) as generator:
        assert not generator.plan(None, 1, False, None).fuse_crq_projections


def test_plans_skip_fusion_of_non_plain_projections(model):
    """A LoRA-wrapped / quantized CRQ is not fused (no error, a log line says why); forcing fusion raises."""

    class LoraLikeLinear(nn.Linear):
        pass

    crq = _small_qwen3()
    assert can_fuse_crq_projections(crq)
    old = crq.layers[0].self_attn.k_proj
    crq.layers[0].self_attn.k_proj = LoraLikeLinear(old.in_features, old.out_features, bias=False)
    assert not can_fuse_crq_projections(crq)

    other = copy.deepcopy(model)
    proj = other.audio_invert_tower.crq_transformer.layers[0].mlp.gate_proj
    wrapped = LoraLikeLinear(proj.in_features, proj.out_features, bias=proj.bias is not None)
    wrapped.load_state_dict(proj.state_dict())
    other.audio_invert_tower.crq_transformer.layers[0].mlp.gate_proj = wrapped
    plan = other.speech_generator(backend="compiled").plan(None, 1, False, None)
    assert not plan.fuse_crq_projections and any("fused CRQ projections off" in note for note in plan.fallbacks)
    with pytest.raises(ValueError, match="fuse_crq_projections"):
        other.speech_generator(backend="compiled", plan_overrides={"fuse_crq_projections": True}).plan(
            None, 1, False, None
        )


@pytest.mark.parametrize("rep", ["1.0", "1.2"])
def test_compiled_fused_generate_matches_reference(model, inputs, rep):
    """fullgraph=True fails on any graph break, so this also proves the fused CRQ sub-step is one graph."""
    golden = _golden(rep)
    with _fused_generator(model) as generator:
        out = generator.generate(**inputs, **GOLDEN_KWARGS, repetition_penalty=float(rep), compile_config=CPU_COMPILE)
        assert generator._weights.fused is not None
    assert torch.equal(out.sequences, golden["sequences"])
    assert torch.equal(out.speech_ids, golden["speech_ids"])


def test_the_fused_copy_is_what_runs(model, inputs):
    """Corrupting the generator's fused copy (the source weights are untouched, so it is not rebuilt) changes the
    output: the plan really runs the fused weights inside the compiled step."""
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True, compile_config=CPU_COMPILE)
    with _fused_generator(model) as generator:
        good = generator.generate(**inputs, **kwargs)
        with torch.no_grad():
            for layer in generator._weights.fused.layers:
                layer.gate_up_weight.mul_(3.0)
        bad = generator.generate(**inputs, **kwargs)
    assert not torch.allclose(bad.speech_logits, good.speech_logits, atol=1e-3)
    with _fused_generator(model, fuse_crq_projections=False) as generator:
        plain = generator.generate(**inputs, **kwargs)
    torch.testing.assert_close(plain.speech_logits, good.speech_logits, atol=ATOL, rtol=RTOL)


def test_fused_logits_match_unfused(model, inputs):
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True)
    plain = model.generate_speech(**inputs, **kwargs, backend="eager")
    with _fused_generator(model) as generator:
        fused = generator.generate(**inputs, **kwargs, compile_config=CPU_COMPILE)
    torch.testing.assert_close(fused.speech_logits, plain.speech_logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused.text_logits, plain.text_logits, atol=ATOL, rtol=RTOL)


def test_batch_rows_equal_single_runs(model, inputs):
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, backend="compiled", compile_config=CPU_COMPILE)
    assert_batch_rows_equal_single_runs(model, inputs, kwargs)


def test_generate_uses_new_weights_after_load_state_dict(model, inputs):
    changed = copy.deepcopy(model)
    crq = changed.audio_invert_tower.crq_transformer
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True, compile_config=CPU_COMPILE)
    with _fused_generator(changed) as generator:
        before = generator.generate(**inputs, **kwargs)
        built = generator._weights.fused
        noise = torch.Generator().manual_seed(1)
        noisy = {name: t + 0.3 * torch.randn(t.shape, generator=noise) for name, t in crq.state_dict().items()}
        crq.load_state_dict(noisy)
        fused = generator.generate(**inputs, **kwargs)
        assert generator._weights.fused is not built  # rebuilt from the new weights, the stale copy dropped
    plain = changed.generate_speech(**inputs, **kwargs, backend="eager")
    assert not torch.allclose(fused.speech_logits, before.speech_logits, atol=1e-3)
    # Larger weights than the checkpoint's: the fused GEMMs' rounding shows a little more.
    torch.testing.assert_close(fused.speech_logits, plain.speech_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused.speech_ids, plain.speech_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_graphs", "compiled"])
def test_cuda_graph_fused_step_matches_reference_on_gpu(inputs, backend):
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    golden = _golden("1.0")  # rep 1.0: the widest greedy margins (MANIFEST §2e)
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.0)
    eager = model.generate_speech(**inputs, **kwargs, backend="eager")
    assert torch.equal(eager.sequences.cpu(), golden["sequences"])
    assert torch.equal(eager.speech_ids.cpu(), golden["speech_ids"])
    with model.speech_generator(backend=backend, plan_overrides={"fold_crq_matching": False}) as generator:
        for _ in range(3):  # the later calls replay the recorded CUDA graph, reading the fused copy in place
            graphed = generator.generate(**inputs, **kwargs)
            assert torch.equal(graphed.sequences, eager.sequences)
            assert torch.equal(graphed.speech_ids, eager.speech_ids)


def test_workspace_counters_cover_both_stacks_and_are_zeroed_by_each_run(model, inputs):
    """The several-row kernel's arrival counters belong to the decode workspace (one run at a time), cover the widest
    projection's 16-column tiles over the LLM's and the CRQ's layers (both take the kernel at batch 2-16), and each
    run starts them at zero (a run stopped mid-kernel leaves them set)."""
    from funaudiochat_hf.generation_workspace_funaudiochat import DecodeWorkspace

    workspace = DecodeWorkspace(model, 2, 32, True, False)
    widest = 0
    for config in (model.config.text_config, model.audio_invert_tower.crq_transformer.config):
        qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
        widest = max(widest, qkv, config.intermediate_size, config.hidden_size)
    assert widest > 64  # the tiny LLM's widest projection is wider than the tiny CRQ's (64)
    assert workspace.split_k_counters.dtype == torch.int32 and len(workspace.split_k_counters) == -(-widest // 16)
    workspace.split_k_counters.fill_(3)
    workspace.reset(torch.tensor([322]), 320)
    assert not workspace.split_k_counters.any()
