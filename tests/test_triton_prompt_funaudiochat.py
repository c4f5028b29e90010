"""Tests of the prompt pass's element-wise kernels (`triton_prompt_funaudiochat`): the norms, the q/k norms with the
rotary embedding, the residual add with the post-attention norm and the SiLU product, against the eager Qwen3 layer; the
layer halves built on them; the plan wiring (`prompt_kernels`: both stacks' prompt passes take the halves). On CPU
through Triton's interpreter (in a subprocess, see conftest), on a GPU for real (marked `gpu`).
"""

import json

import pytest
import torch

from funaudiochat_hf import triton_prompt_funaudiochat as prompt_kernels
from funaudiochat_hf.decoder_stack_funaudiochat import EAGER_HALVES

from conftest import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, run_in_triton_interpreter


# (batch, n, hidden, intermediate, heads, kv_heads, head_dim): widths not a power of two, an MLP wider than one SiLU
# program's block, two rows at different positions.
CASES = [
    (1, 5, 64, 96, 4, 2, 16),
    (2, 7, 48, 1100, 6, 2, 24),
]


def layer_case(case, dtype=torch.float32, device="cpu", fused=False):
    """A Qwen3 decoder layer of `case` (norm weights away from 1), its inputs and, with `fused`, its fused q/k/v and
    gate/up projections (the CRQ's prompt pass: strided views of one output): `(layer, projections, x, attn, cos,
    sin)`."""
    from transformers import Qwen3Config, Qwen3Model

    from funaudiochat_hf.fused_crq_funaudiochat import fused_crq_projections

    batch, n, hidden, intermediate, heads, kv_heads, head_dim = case
    config = Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1, rms_norm_eps=1e-6,
                         vocab_size=16)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    stack = Qwen3Model(config)
    for module in stack.modules():
        if hasattr(module, "variance_epsilon"):
            module.weight.data.uniform_(0.5, 1.5, generator=generator)
    stack = stack.to(device, dtype)
    layer = stack.layers[0]
    projections = fused_crq_projections(stack).layers[0] if fused else None
    x = (torch.randn(batch, n, hidden, generator=generator) * 2).to(device, dtype)
    attn = torch.randn(batch, n, heads * head_dim, generator=generator).to(device, dtype)
    positions = (torch.arange(n)[None] + 3 * torch.arange(batch)[:, None]).to(device)
    cos, sin = stack.rotary_emb(x, positions)
    return layer, projections, x, attn, cos, sin


def halves_errors(case, dtype=torch.float32, device="cpu", fused=False) -> dict:
    """{output: max abs difference} of the kernel halves against the eager halves on `layer_case`."""
    layer, projections, x, attn, cos, sin = layer_case(case, dtype, device, fused)
    with torch.no_grad():
        got = prompt_kernels.PROMPT_KERNEL_HALVES.attention_inputs(layer, projections, x, cos, sin)
        want = EAGER_HALVES.attention_inputs(layer, projections, x, cos, sin)
        got_out = prompt_kernels.PROMPT_KERNEL_HALVES.attention_output_and_mlp(layer, projections, attn, x)
        want_out = EAGER_HALVES.attention_output_and_mlp(layer, projections, attn, x)
    errors = {name: (a.float() - b.float()).abs().max().item() for name, a, b in zip("qkv", got, want)}
    errors["out"] = (got_out.float() - want_out.float()).abs().max().item()
    errors["shapes"] = [list(t.shape) for t in (*got, got_out)] == [list(t.shape) for t in (*want, want_out)]
    return errors


_SCRIPT = """
import json, torch
from funaudiochat_hf import triton_prompt_funaudiochat as prompt_kernels
from test_triton_prompt_funaudiochat import CASES, halves_errors, layer_case

prompt_kernels.kernels_run_on = lambda tensor: True  # the interpreter runs the kernels on CPU tensors
results = []
for case in CASES:
    layer, projections, x, attn, cos, sin = layer_case(case)
    norm = layer.input_layernorm
    # Strided rows: the halves of a fused gate/up output, a q/k/v split.
    gate_up = torch.randn(*x.shape[:2], 2 * case[3])
    gate, up = gate_up.split(case[3], dim=-1)
    qkv = torch.randn(*x.shape[:2], (case[4] + 2 * case[5]) * case[6])
    q, k, _ = qkv.split([case[4] * case[6], case[5] * case[6], case[5] * case[6]], dim=-1)
    total, normed = prompt_kernels.add_rms_norm_rows(norm, attn[..., : x.shape[-1]], x)
    query, key = prompt_kernels.normed_rotated_query_and_key(layer.self_attn, q, k, cos, sin)
    shape = (*q.shape[:2], -1, case[6])
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    want_q, want_k = apply_rotary_pos_emb(layer.self_attn.q_norm(q.view(shape)).transpose(1, 2),
                                          layer.self_attn.k_norm(k.view(shape)).transpose(1, 2), cos, sin)
    error = lambda a, b: (a - b).abs().max().item()
    results.append({
        "norm": error(prompt_kernels.rms_norm_rows(norm, x), norm(x)),
        "sum": error(total, x + attn[..., : x.shape[-1]]),
        "add_norm": error(normed, norm(x + attn[..., : x.shape[-1]])),
        "silu": error(prompt_kernels.silu_mul(gate, up), torch.nn.functional.silu(gate) * up),
        "query": error(query, want_q), "key": error(key, want_k),
        "contiguous": query.is_contiguous() and key.is_contiguous(),
        "halves": halves_errors(case), "fused_halves": halves_errors(case, fused=True),
    })
print(json.dumps(results))
"""


def test_kernels_and_halves_match_the_eager_layer_in_the_triton_interpreter():
    """Float32, to 1e-5 (the norms' summation order differs): each kernel over strided rows, and the layer halves on
    them against the eager halves, with the layer's own projections and with fused ones."""
    results = json.loads(run_in_triton_interpreter(_SCRIPT))
    assert len(results) == len(CASES)
    for case, result in zip(CASES, results):
        assert result.pop("contiguous"), case
        for halves in (result.pop("halves"), result.pop("fused_halves")):
            assert halves.pop("shapes"), (case, halves)
            assert all(error < 1e-5 for error in halves.values()), (case, halves)
        assert all(error < 1e-5 for error in result.values()), (case, result)


_GENERATE_SCRIPT = """
import json, torch
from safetensors.torch import load_file
from transformers import AutoModel
from funaudiochat_hf import generation_plan_funaudiochat, generation_state_funaudiochat, triton_prompt_funaudiochat
from test_triton_linear_funaudiochat import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, GOLDEN_KWARGS

# Plans as on a Triton GPU, their steps run directly; the prompt kernels on CPU tensors (the interpreter); count them.
generation_plan_funaudiochat.DeviceFacts.of = classmethod(lambda cls, model: cls("cuda", True))
generation_state_funaudiochat.CapturedStep = lambda function, key: function
triton_prompt_funaudiochat.kernels_run_on = lambda tensor: True
calls = []
class CountedKernel:
    def __init__(self, kernel, name):
        self.kernel, self.name = kernel, name
    def __getitem__(self, grid):
        calls.append(self.name)
        return self.kernel[grid]
for name in ("_rms_norm_kernel", "_rotated_kernel", "_silu_mul_kernel"):
    setattr(triton_prompt_funaudiochat, name, CountedKernel(getattr(triton_prompt_funaudiochat, name), name))

model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()
inputs = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")
inputs.pop("waveform_16k")
golden = load_file(FUNAUDIOCHAT_GOLDEN / "e_generate_rep1.0.safetensors")
# Only the prompt kernels among the Triton parts (the decode steps' kernels have tests of their own).
others = ("crq_linear", "llm_linear", "triton_attention", "speech_sampler", "overlap_text_head", "bookkeeping_kernels")
others = {part: False for part in others}
generator = model.speech_generator(backend="cuda_graphs", plan_overrides=others)
steps = 4
out = generator.generate(**inputs, **dict(GOLDEN_KWARGS, max_new_tokens=steps))
length, speech = out.sequences.shape[1], out.speech_ids.shape[1]
print(json.dumps({
    "sequences": torch.equal(out.sequences, golden["sequences"][:, :length]), "length": length,
    "prompt": inputs["input_ids"].shape[1],
    "speech_ids": speech > 0 and torch.equal(out.speech_ids, golden["speech_ids"][:, :speech]),
    "counts": {name: calls.count(name) for name in set(calls)},
    "layers": sum(stack.config.num_hidden_layers for stack in (model.language_model.model,
                                                              model.audio_invert_tower.crq_transformer)),
}))
"""


def test_prompt_pass_on_the_kernels_gives_the_reference_tokens_in_the_triton_interpreter():
    """With the plan's `prompt_kernels`, both stacks' prompt passes (the LLM over the bucket-padded prompt, the CRQ
    over its sub-positions) run the kernels: per layer two norms, one q/k norm-and-rotary and one SiLU product, none in
    the decode steps; the greedy tokens of the first steps equal the official implementation's."""
    result = json.loads(run_in_triton_interpreter(_GENERATE_SCRIPT))
    assert result["sequences"] and result["speech_ids"] and result["length"] == result["prompt"] + 4, result
    layers = result["layers"]
    assert result["counts"] == {"_rms_norm_kernel": 2 * layers, "_rotated_kernel": layers, "_silu_mul_kernel": layers}


def test_prompt_passes_take_the_kernel_halves_on_a_triton_gpu(monkeypatch):
    """The wiring, without Triton: on a (faked) Triton GPU both stacks' prompt passes call the kernel halves, which
    off CUDA run the eager layer (the tokens equal the eager backend's); the decode steps never do."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from funaudiochat_hf import generation_plan_funaudiochat as plan_module
    from funaudiochat_hf import generation_state_funaudiochat as state

    monkeypatch.setattr(plan_module.DeviceFacts, "of", classmethod(lambda cls, model: cls("cuda", True)))
    monkeypatch.setattr(state, "CapturedStep", lambda function, key: function)
    seen = []
    take = prompt_kernels.prompt_kernels_take
    monkeypatch.setattr(prompt_kernels, "prompt_kernels_take", lambda x: seen.append(tuple(x.shape[:2])) or take(x))
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()
    inputs = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")
    inputs.pop("waveform_16k")
    kwargs = dict(max_new_tokens=3, do_sample=False, repetition_penalty=1.0, eos_token_id=322, pad_token_id=320)
    generator = model.speech_generator(backend="cuda_graphs", plan_overrides={"overlap_text_head": False})
    assert generator.plan(None, 1, False, None).prompt_kernels
    fast = generator.generate(**inputs, **kwargs)
    eager = model.generate_speech(**inputs, **kwargs, backend="eager")
    assert torch.equal(fast.sequences, eager.sequences) and torch.equal(fast.speech_ids, eager.speech_ids)
    llm_layers = model.config.text_config.num_hidden_layers
    crq_layers = model.audio_invert_tower.crq_transformer.config.num_hidden_layers
    lengths = sorted({n for _, n in seen})
    assert len(lengths) == 2 and all(n > 1 for n in lengths)  # the LLM's prompt and the CRQ's sub-positions
    assert len(seen) == 2 * (llm_layers + crq_layers)  # both halves of every layer, once


def test_prompt_kernels_supported_needs_rmsnorms_and_silu():
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=2, vocab_size=16)  # fmt: skip
    stack = Qwen3Model(config)
    assert prompt_kernels.prompt_kernels_supported(stack)
    stack.layers[1].self_attn.k_norm = torch.nn.LayerNorm(8)  # no variance_epsilon: not an RMSNorm the kernel computes
    assert not prompt_kernels.prompt_kernels_supported(stack)
    config.hidden_act = "gelu"
    assert not prompt_kernels.prompt_kernels_supported(Qwen3Model(config))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_halves_match_the_eager_layer(dtype, fused):
    """On the GPU: float32 to 1e-5; in bfloat16 the values and the MLP's output round as the eager layer's (a few
    entries apart: the norms' summation order), the rotated queries and keys one unit apart in places (the rotary's
    sum rounds once on the GPU, `_normed_and_rotated`)."""
    case = (2, 96, 1024, 3072, 16, 8, 128)  # the CRQ's layer
    layer, projections, x, attn, cos, sin = layer_case(case, dtype, "cuda", fused)
    with torch.no_grad():
        got = prompt_kernels.PROMPT_KERNEL_HALVES.attention_inputs(layer, projections, x, cos, sin)
        want = EAGER_HALVES.attention_inputs(layer, projections, x, cos, sin)
        got_out = prompt_kernels.PROMPT_KERNEL_HALVES.attention_output_and_mlp(layer, projections, attn, x)
        want_out = EAGER_HALVES.attention_output_and_mlp(layer, projections, attn, x)
    for name, a, b in zip(("query", "key", "value", "out"), (*got, got_out), (*want, want_out)):
        a, b = a.float(), b.float()
        if dtype == torch.float32:
            assert (a - b).abs().max().item() < 1e-5, name
            continue
        # One bfloat16 unit (8 significant bits) at the tensor's scale.
        assert (a - b).abs().max().item() <= b.abs().max().item() * 2**-7, name
        if name in ("value", "out"):
            assert (a != b).float().mean().item() < 2e-3, name
