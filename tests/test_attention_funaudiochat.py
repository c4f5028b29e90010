"""Tests of `gqa_decode_attention` and of the compiled backend's GQA decode attention on the tiny fixture.

Golden parity: tests/fixtures/MANIFEST.md §2e (reference `generate`, greedy, max_new_tokens 16, eos 322, pad 320).
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf import attention_funaudiochat
from funaudiochat_hf.attention_funaudiochat import (
    gqa_decode_attention,
    register_gqa_decode_attention,
)

from conftest import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY


GOLDEN_KWARGS = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.0, eos_token_id=322, pad_token_id=320)
COMPILE = {"backend": "aot_eager", "fullgraph": True}
AUDIO_TOKEN, IM_END, PAD, SPEECH_PAD = 346, 322, 320, 38
BATCH, HEADS, KV_HEADS, KV_LEN, HEAD_DIM = 3, 8, 2, 11, 16


# --------------------------------------------------------------------------------------------------------------------
# The attention function against SDPA
# --------------------------------------------------------------------------------------------------------------------


def _module(groups: int = HEADS // KV_HEADS):
    return SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)


def _qkv(q_len: int, dtype=torch.float32):
    query = torch.randn(BATCH, HEADS, q_len, HEAD_DIM, dtype=dtype)
    key = torch.randn(BATCH, KV_HEADS, KV_LEN, HEAD_DIM, dtype=dtype)
    value = torch.randn(BATCH, KV_HEADS, KV_LEN, HEAD_DIM, dtype=dtype)
    return query, key, value


def _bool_mask(q_len: int, heads: int = 1, batch: int = BATCH) -> torch.Tensor:
    mask = torch.rand(batch, heads, q_len, KV_LEN) > 0.4
    mask[..., -1] = True  # every query sees at least one key (as when decoding: itself)
    return mask


def _additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def _reference(query, key, value, mask, scaling):
    """Plain SDPA on K/V expanded to every query head: `(batch, q_len, heads, head_dim)`."""
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query.float(),
        key.float().repeat_interleave(groups, 1),
        value.float().repeat_interleave(groups, 1),
        attn_mask=mask,
        scale=scaling,
    )
    return out.transpose(1, 2)


MASKS = {
    "none": lambda: None,
    "bool": lambda: _bool_mask(1),
    "float": lambda: _additive(_bool_mask(1)),
    "bool_per_head": lambda: _bool_mask(1, heads=HEADS),
    "float_broadcast_batch": lambda: _additive(_bool_mask(1, batch=1)),
}


@pytest.mark.parametrize("scaling", [None, 0.3])
@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_decode_position_matches_sdpa(mask_kind, scaling):
    query, key, value = _qkv(1)
    mask = MASKS[mask_kind]()
    out, weights = gqa_decode_attention(_module(), query, key, value, mask, scaling=scaling)
    assert weights is None
    assert out.shape == (BATCH, 1, HEADS, HEAD_DIM) and out.is_contiguous()
    torch.testing.assert_close(out, _reference(query, key, value, mask, scaling), atol=1e-5, rtol=1e-5)
    # ... and transformers' own sdpa path (what "default" runs) gives the same.
    expected, _ = sdpa_attention_forward(_module(), query, key, value, mask, scaling=scaling)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_position_in_bfloat16():
    query, key, value = _qkv(1, torch.bfloat16)
    mask = _bool_mask(1)
    out, _ = gqa_decode_attention(_module(), query, key, value, mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(query, key, value, mask, None), atol=2e-2, rtol=2e-2)


def test_decode_position_does_not_call_sdpa_and_longer_queries_delegate(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape[2])
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention_funaudiochat, "sdpa_attention_forward", spy)
    gqa_decode_attention(_module(), *_qkv(1), _bool_mask(1))
    assert calls == []
    for mask in (_bool_mask(4), _additive(_bool_mask(4)), None):
        query, key, value = _qkv(4)
        out, _ = gqa_decode_attention(_module(), query, key, value, mask, scaling=0.25)
        expected, _ = sdpa_attention_forward(_module(), query, key, value, mask, scaling=0.25)
        assert torch.equal(out, expected)
        if mask is not None:
            torch.testing.assert_close(out, _reference(query, key, value, mask, 0.25), atol=1e-5, rtol=1e-5)
    assert calls == [4, 4, 4]
    # Dropout (training) also goes to sdpa.
    gqa_decode_attention(_module(), *_qkv(1), None, dropout=0.1)
    assert calls == [4, 4, 4, 1]


def test_bad_shapes_raise():
    query, key, value = _qkv(1)
    with pytest.raises(ValueError, match="attention mask"):
        gqa_decode_attention(_module(), query, key, value, torch.ones(BATCH, 1, 2, KV_LEN, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention mask"):
        gqa_decode_attention(_module(), query, key, value, torch.ones(BATCH, KV_LEN, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple"):
        gqa_decode_attention(_module(), query[:, :7], key, value, None)


# --------------------------------------------------------------------------------------------------------------------
# The compiled backend's decode attention (a CPU: the GQA matmuls)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attention_calls():
    """Counts (at run time, inside the compiled graph) the calls of the registered decode attention.

    A tensor counter rather than a Python one: a graph mutating a tensor is one graph, a Python side effect would
    retrace on every call.
    """
    counter = torch.zeros((), dtype=torch.long)
    real = attention_funaudiochat.gqa_decode_attention

    def counting(module, query, *args, **kwargs):
        counter.add_(1)
        return real(module, query, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(attention_funaudiochat, "gqa_decode_attention", counting)
    yield counter
    patch.undo()
    register_gqa_decode_attention()  # put the real function back in the registry


def _layers_per_step(model) -> int:
    """Attention calls of one decode step: the LLM layers + K x the CRQ layers."""
    return model.config.text_config.num_hidden_layers + model.config.audio_config.group_size * len(
        model.audio_invert_tower.crq_transformer.layers
    )


@pytest.mark.parametrize("rep", ["1.0", "1.2"])
def test_compiled_gqa_step_reproduces_reference(model, inputs, attention_calls, rep):
    golden = load_file(FUNAUDIOCHAT_GOLDEN / f"e_generate_rep{rep}.safetensors")
    attention_calls.zero_()
    out = model.generate_speech(
        **inputs, **dict(GOLDEN_KWARGS, repetition_penalty=float(rep)), backend="compiled", compile_config=COMPILE
    )  # on a CPU the compiled backend's decode attention is the GQA matmuls
    assert torch.equal(out.sequences, golden["sequences"])
    assert torch.equal(out.speech_ids, golden["speech_ids"])
    # The compiled decode steps, and the K - 1 CRQ sub-steps that end the prefill (not its eager one-pass forwards),
    # really ran through the function, every layer of every step.
    calls = int(attention_calls)
    prefill_calls = (model.config.audio_config.group_size - 1) * len(model.audio_invert_tower.crq_transformer.layers)
    assert calls > prefill_calls and (calls - prefill_calls) % _layers_per_step(model) == 0
    # The models' attention setting is never changed (the choice is passed down the call path).
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.audio_invert_tower.crq_transformer.config._attn_implementation == "sdpa"


def test_compiled_gqa_batch_rows_equal_single_runs(model, inputs):
    long_ids = inputs["input_ids"][:, -60:]  # cut (the audio placeholder ids too) to keep the test fast
    ids = long_ids[0][long_ids[0] != AUDIO_TOKEN]
    long_ids, short_ids = ids[None, -40:], ids[None, -25:]
    batch_ids = torch.full((2, 40), PAD)
    batch_ids[0] = long_ids[0]
    batch_ids[1, -25:] = short_ids[0]
    mask = torch.ones_like(batch_ids)
    mask[1, :-25] = 0
    kwargs = dict(GOLDEN_KWARGS, max_new_tokens=8, repetition_penalty=1.2, backend="compiled", compile_config=COMPILE)

    batch = model.generate_speech(batch_ids, mask, **kwargs)
    for row, prompt in enumerate([long_ids, short_ids]):
        single = model.generate_speech(prompt, **kwargs)
        new = single.sequences[0, prompt.shape[1] :]
        assert torch.equal(batch.sequences[row, 40 : 40 + len(new)], new)
        groups = single.speech_ids.shape[1]
        assert groups > 0
        assert torch.equal(batch.speech_ids[row, :groups], single.speech_ids[0])
        assert (batch.speech_ids[row, groups:] == SPEECH_PAD).all()


@pytest.mark.gpu
def test_cuda_graph_gqa_step_matches_eager_on_gpu(inputs):
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    eager = model.generate_speech(**inputs, **GOLDEN_KWARGS, backend="eager")  # rep 1.0: the widest greedy margins
    golden = load_file(FUNAUDIOCHAT_GOLDEN / "e_generate_rep1.0.safetensors")
    assert torch.equal(eager.sequences.cpu(), golden["sequences"])
    generator = model.speech_generator(backend="compiled", plan_overrides={"triton_attention": False})
    assert generator.plan(None, 1, False, None).attention == "gqa_matmul"
    for _ in range(3):  # the later calls replay the captured CUDA graph
        graphed = generator.generate(**inputs, **GOLDEN_KWARGS)
        assert torch.equal(graphed.sequences, eager.sequences)
        assert torch.equal(graphed.speech_ids, eager.speech_ids)
    assert model.config.text_config._attn_implementation == "sdpa"


def test_prompt_attention_reads_the_prompts_own_columns_only():
    """`prompt_attention` over a static cache's columns: the same output as the module's attention over all of them
    (the dropped columns masked for every query), computed from the first `n` only; a sliding-window layer's keys are
    passed on as they are (its cache may place positions otherwise)."""
    from transformers.modeling_utils import AttentionInterface

    from funaudiochat_hf.attention_prompt_funaudiochat import prompt_attention

    torch.manual_seed(0)
    n, columns, heads, kv_heads, dim = 7, 32, 4, 2, 16
    config = SimpleNamespace(_attn_implementation="sdpa")
    module = SimpleNamespace(config=config, is_causal=True, training=False, num_key_value_groups=heads // kv_heads)
    query = torch.randn(1, heads, n, dim)
    key, value = torch.randn(1, kv_heads, columns, dim), torch.randn(1, kv_heads, columns, dim)
    mask = torch.zeros(1, 1, n, columns, dtype=torch.bool)
    mask[..., :n] = torch.ones(n, n, dtype=torch.bool).tril()  # a prompt written at columns 0 .. n-1
    seen = []

    def attention(module, query, key, value, mask, **kwargs):
        seen.append(key.shape[-2])
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    full, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(AttentionInterface._global_mapping, "sdpa", attention)
        narrowed, _ = prompt_attention(module, query, key, value, mask, scaling=dim**-0.5)
        module.sliding_window = 16
        windowed, _ = prompt_attention(module, query, key, value, mask, scaling=dim**-0.5)
    assert seen == [n, columns]
    torch.testing.assert_close(narrowed, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(windowed, full, atol=0, rtol=0)
