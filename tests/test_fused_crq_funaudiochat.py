"""Tests of the fused q/k/v + gate/up CRQ forward (`generate_speech(fuse_crq_projections=True)`) on tiny configs.

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
from funaudiochat_hf.fused_crq_funaudiochat import (
    _FUSED,
    _PADDED,
    can_fuse_crq_projections,
    fused_crq_projections,
    padded_output_linear,
)
from funaudiochat_hf.generation_funaudiochat import _WORKSPACES, _resolve_options

from conftest import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, assert_batch_rows_equal_single_runs


GOLDEN_KWARGS = dict(max_new_tokens=16, do_sample=False, eos_token_id=322, pad_token_id=320)
ATOL = RTOL = 1e-5


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


def test_fused_weights_are_cached_and_rebuilt_after_weight_changes():
    crq = _small_qwen3()
    first = fused_crq_projections(crq)
    assert fused_crq_projections(crq) is first  # no change: the cached copy
    layer = crq.layers[1]
    expected = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    assert torch.equal(first.layers[1].qkv_weight, expected)

    state = {name: tensor + 0.1 for name, tensor in crq.state_dict().items()}
    crq.load_state_dict(state)  # in place: same data pointers, bumped versions
    second = fused_crq_projections(crq)
    assert second is not first
    expected = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
    assert torch.equal(second.layers[1].gate_up_weight, expected)
    _assert_fused_matches(crq, "static")

    crq.to(torch.float64)  # re-allocated weights
    third = fused_crq_projections(crq)
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
    """Zero output rows up to a multiple of 8; the same outputs; cached, rebuilt after a weight change; None where it
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
    assert padded_output_linear(linear) is padded
    with torch.no_grad():
        linear.weight.mul_(2.0)  # in place: a new version of the same tensor
    rebuilt = padded_output_linear(linear)
    assert rebuilt is not padded and torch.equal(rebuilt.weight[:13], linear.weight)
    assert padded_output_linear(nn.Linear(16, 13, bias=False)).bias is None
    assert padded_output_linear(nn.Linear(16, 24)) is None

    class LoraLikeLinear(nn.Linear):
        pass

    assert padded_output_linear(LoraLikeLinear(16, 13)) is None


def test_compiled_loop_runs_the_speech_head_through_its_padded_copy(model, inputs, monkeypatch):
    """The compiled loop multiplies the speech head through `padded_output_linear`'s copy (the tiny head's 40 rows are
    aligned to 8, so here to 16: 48 rows): the golden tokens, and corrupting the copy's padding-free rows changes the
    logits (it is what runs)."""
    monkeypatch.setattr(fused_crq_funaudiochat, "OUTPUT_ALIGNMENT", 16)
    golden = _golden("1.2")
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True)
    kwargs["compile"] = {"backend": "aot_eager", "fullgraph": True}
    kwargs["fold_crq_matching"] = False  # folded, the head is a padded product of its own (test_folded_matching_*)
    other = copy.deepcopy(model)
    good = other.generate_speech(**inputs, **kwargs)
    assert torch.equal(good.sequences, golden["sequences"]) and torch.equal(good.speech_ids, golden["speech_ids"])
    padded = _PADDED[other.audio_invert_tower.lm_head]
    assert padded.weight.shape[0] == 48
    with torch.no_grad():
        padded.weight[:40].mul_(3.0)
    bad = other.generate_speech(**inputs, **kwargs)
    assert not torch.allclose(bad.speech_logits, good.speech_logits, atol=1e-3)
    eager = other.generate_speech(**inputs, **dict(kwargs, compile=False))  # the eager loop keeps the head itself
    torch.testing.assert_close(eager.speech_logits, good.speech_logits, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------------------------------------------------
# generate_speech(fuse_crq_projections=True)
# --------------------------------------------------------------------------------------------------------------------


def test_compiled_loops_fuse_and_use_gqa_attention_by_default(model, inputs):
    """Issue 4: `fuse_crq_projections=None` / `compile_attention="auto"` (defaults) turn both on for a compiled loop
    (measured faster on an H200) and leave the eager loop as the plain model; explicit values win."""
    from funaudiochat_hf.generation_funaudiochat import _CompiledParts, _decode_step, _DecodeAttention

    options = _resolve_options({})
    assert options["fuse_crq_projections"] is None and options["compile_attention"] == "auto"
    ids = inputs["input_ids"]
    compile_options = {"backend": "eager", "fullgraph": True}
    eager = model._speech_run(ids, None, {}, {})
    assert eager.step_fn is _decode_step and not eager.cfg.fuse_crq_projections
    compiled = model._speech_run(ids, None, {}, {"compile": compile_options})
    assert compiled.cfg.fuse_crq_projections and isinstance(compiled.step_fn, _DecodeAttention)
    assert isinstance(compiled.prefill_crq_part, _DecodeAttention)
    assert compiled.attention == "gqa_matmul"  # CPU: no Triton kernels
    plain = model._speech_run(
        ids, None, {}, {"compile": compile_options, "fuse_crq_projections": False, "compile_attention": "default"}
    )
    assert not plain.cfg.fuse_crq_projections and isinstance(plain.step_fn, _CompiledParts)
    speech_to_text = model._speech_run(ids, None, {}, {"compile": compile_options, "disable_speech": True})
    assert not speech_to_text.cfg.fuse_crq_projections


def test_auto_fusion_skips_non_plain_projections(model, inputs):
    """A LoRA-wrapped / quantized CRQ is not fused by default (no error); asking for fusion explicitly raises."""

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
    compile_options = {"backend": "eager", "fullgraph": True}
    assert not other._speech_run(inputs["input_ids"], None, {}, {"compile": compile_options}).cfg.fuse_crq_projections
    with pytest.raises(ValueError, match="LoraLikeLinear"):
        other.generate_speech(**inputs, **GOLDEN_KWARGS, fuse_crq_projections=True)


@pytest.mark.parametrize("rep", ["1.0", "1.2"])
def test_generate_matches_reference(model, inputs, rep):
    golden = _golden(rep)
    out = model.generate_speech(**inputs, **GOLDEN_KWARGS, repetition_penalty=float(rep), fuse_crq_projections=True)
    assert torch.equal(out.sequences, golden["sequences"])
    assert torch.equal(out.speech_ids, golden["speech_ids"])


@pytest.mark.parametrize(
    "rep, compile_scope, compile_attention",
    [
        ("1.0", "parts", "default"),
        ("1.2", "parts", "default"),
        ("1.2", "step", "default"),
        ("1.2", "parts", "gqa_matmul"),
    ],
)
def test_compiled_generate_matches_reference(model, inputs, rep, compile_scope, compile_attention):
    """fullgraph=True fails on any graph break, so this also proves the fused CRQ sub-step is one graph."""
    golden = _golden(rep)
    out = model.generate_speech(
        **inputs,
        **GOLDEN_KWARGS,
        repetition_penalty=float(rep),
        fuse_crq_projections=True,
        compile={"backend": "aot_eager", "fullgraph": True},
        compile_scope=compile_scope,
        compile_attention=compile_attention,
    )
    assert torch.equal(out.sequences, golden["sequences"])
    assert torch.equal(out.speech_ids, golden["speech_ids"])


@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_copy_is_what_runs(model, inputs, compiled):
    """Corrupting the cached fused copy (the source weights are untouched, so it is not rebuilt) changes the output:
    the option really runs the fused weights, eagerly and inside the compiled step."""
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True, fuse_crq_projections=True)
    if compiled:
        kwargs["compile"] = {"backend": "aot_eager", "fullgraph": True}
    other = copy.deepcopy(model)
    crq = other.audio_invert_tower.crq_transformer
    good = other.generate_speech(**inputs, **kwargs)
    with torch.no_grad():
        for layer in _FUSED[crq].layers:
            layer.gate_up_weight.mul_(3.0)
    bad = other.generate_speech(**inputs, **kwargs)
    assert not torch.allclose(bad.speech_logits, good.speech_logits, atol=1e-3)
    plain = other.generate_speech(**inputs, **dict(kwargs, fuse_crq_projections=False))
    torch.testing.assert_close(plain.speech_logits, good.speech_logits, atol=ATOL, rtol=RTOL)


def test_fused_logits_match_unfused(model, inputs):
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True)
    plain = model.generate_speech(**inputs, **kwargs)
    fused = model.generate_speech(**inputs, **kwargs, fuse_crq_projections=True)
    torch.testing.assert_close(fused.speech_logits, plain.speech_logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused.text_logits, plain.text_logits, atol=ATOL, rtol=RTOL)


def test_batch_rows_equal_single_runs(model, inputs):
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, fuse_crq_projections=True)
    assert_batch_rows_equal_single_runs(model, inputs, kwargs)


def test_generate_uses_new_weights_after_load_state_dict(model, inputs):
    changed = copy.deepcopy(model)
    crq = changed.audio_invert_tower.crq_transformer
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True, fuse_crq_projections=True)
    before = changed.generate_speech(**inputs, **kwargs)
    built = _FUSED[crq]
    generator = torch.Generator().manual_seed(1)
    noisy = {name: t + 0.3 * torch.randn(t.shape, generator=generator) for name, t in crq.state_dict().items()}
    crq.load_state_dict(noisy)
    fused = changed.generate_speech(**inputs, **kwargs)
    plain = changed.generate_speech(**inputs, **dict(kwargs, fuse_crq_projections=False))
    assert _FUSED[crq] is not built
    assert not torch.allclose(fused.speech_logits, before.speech_logits, atol=1e-3)
    torch.testing.assert_close(fused.speech_logits, plain.speech_logits, atol=ATOL, rtol=RTOL)
    assert torch.equal(fused.speech_ids, plain.speech_ids)
    # A finished run does not keep the fused copy alive through its cached workspace.
    assert all(ws.fused_crq is None for ws in _WORKSPACES[changed].values())


@pytest.mark.gpu
@pytest.mark.parametrize("compile_scope", ["step", "parts"])
def test_cuda_graph_fused_step_matches_reference_on_gpu(inputs, compile_scope):
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    golden = _golden("1.0")  # rep 1.0: the widest greedy margins (MANIFEST §2e)
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.0, compile_scope=compile_scope, fuse_crq_projections=True)
    eager = model.generate_speech(**inputs, **kwargs)
    assert torch.equal(eager.sequences.cpu(), golden["sequences"])
    assert torch.equal(eager.speech_ids.cpu(), golden["speech_ids"])
    for _ in range(2):  # the second call replays the captured CUDA graph(s), reading the fused copy in place
        graphed = model.generate_speech(**inputs, **kwargs, compile=True)
        assert torch.equal(graphed.sequences, eager.sequences)
        assert torch.equal(graphed.speech_ids, eager.speech_ids)


def test_workspace_counters_cover_both_stacks_and_are_zeroed_by_each_run(model, inputs):
    """The several-row kernel's arrival counters belong to the decode workspace (one run at a time), cover the widest
    projection's 16-column tiles over the LLM's and the CRQ's layers (both take the kernel at batch 2-16), and each
    run starts them at zero (a run stopped mid-kernel leaves them set)."""
    from funaudiochat_hf.generation_funaudiochat import _DecodeWorkspace

    workspace = _DecodeWorkspace(model, 2, 32, True, False)
    widest = 0
    for config in (model.config.text_config, model.audio_invert_tower.crq_transformer.config):
        qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
        widest = max(widest, qkv, config.intermediate_size, config.hidden_size)
    assert widest > 64  # the tiny LLM's widest projection is wider than the tiny CRQ's (64)
    assert workspace.split_k_counters.dtype == torch.int32 and len(workspace.split_k_counters) == -(-widest // 16)
    workspace.split_k_counters.fill_(3)
    workspace.reset(torch.tensor([322]), 320)
    assert not workspace.split_k_counters.any()
