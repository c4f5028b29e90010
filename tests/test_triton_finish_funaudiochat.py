"""Tests of the decode step's bookkeeping kernel after the text token (`triton_finish_funaudiochat`, plan part
`bookkeeping_kernels`): the kernel against `finish_part`'s PyTorch ops on the same states, in Triton's interpreter (a
subprocess, skipped without Triton) and on a GPU (marked `gpu`)."""

import json

import pytest
import torch

from conftest import run_in_triton_interpreter


_CASE_CODE = """
import copy
from types import SimpleNamespace

import torch

from funaudiochat_hf.generation_step_funaudiochat import finish_part
from funaudiochat_hf.sampling_funaudiochat import SamplingParameters, SamplingSettings

ROWS, K, HIDDEN, VOCAB, CODEBOOK, LENGTH = 7, 5, 40, 50, 30, 12
PAD, SPEECH_EOS, AUDIO_EOS, AUDIO_BOS, EOS = 1, CODEBOOK - 1, 5, 6, (7, 9)


def finish_states(seed, dtype, device="cpu", text_history=False):
    '''(model, workspace, step config) of a random mid-reply state: rows done, speaking, with a speech end in their
    group, choosing an end id, `<|audio_bos|>` or `<|audio_eos|>`; text history marked with `text_history`.'''
    g = torch.Generator().manual_seed(seed)
    embedding = torch.nn.Embedding(VOCAB, HIDDEN).to(dtype)
    embedding.weight.data = (torch.randn(VOCAB, HIDDEN, generator=g) * 3).to(dtype)
    model = SimpleNamespace(language_model=SimpleNamespace(get_input_embeddings=lambda: embedding))
    logits = torch.randn(ROWS, VOCAB, generator=g)
    for row, token in enumerate((EOS[0], EOS[1], AUDIO_BOS, AUDIO_EOS)):  # rows choosing the special ids
        logits[row, token] = 10.0
    group = torch.randint(0, CODEBOOK - 1, (ROWS, K), generator=g)
    group[1::3, 2] = SPEECH_EOS
    text = SamplingSettings(do_sample=False, repetition_penalty=1.3 if text_history else 1.0)
    speech = SamplingSettings(do_sample=True, repetition_penalty=1.2)
    ws = SimpleNamespace(
        device=torch.device(device),
        text_logits_step=logits,
        step=torch.tensor(3),
        done=torch.rand(ROWS, generator=g) < 0.25,
        speaking=torch.rand(ROWS, generator=g) < 0.7,
        group=group,
        groups=torch.randint(0, 2, (ROWS,), generator=g),
        last_group=torch.randint(0, CODEBOOK - 1, (ROWS, K), generator=g),
        speech_out=torch.full((ROWS, K * LENGTH + K), -3),
        speech_seen=torch.rand(ROWS, CODEBOOK, generator=g) < 0.2,
        text_seen=torch.rand(ROWS, VOCAB, generator=g) < 0.2,
        text_out=torch.full((ROWS, LENGTH), -2),
        finish_step=torch.full((ROWS,), LENGTH),
        next_ids=torch.zeros(ROWS, dtype=torch.long),
        next_embeds=torch.zeros(ROWS, 1, HIDDEN, dtype=dtype),
        eos_ids=torch.tensor(EOS),
        folded=SimpleNamespace(feedback=(torch.randn(CODEBOOK, HIDDEN, generator=g) * 2).to(dtype)),
        text_sampling=SamplingParameters("cpu", text),
    )
    for name, value in vars(ws).items():
        if isinstance(value, torch.Tensor):
            setattr(ws, name, value.to(device))
    ws.folded.feedback = ws.folded.feedback.to(device)
    ws.device = ws.done.device  # "cuda:0", as a real workspace's (the kernel runs where the weights are)
    embedding.to(device)
    ws.text_sampling = SamplingParameters(device, text)
    cfg = SimpleNamespace(
        group_size=K, text=text.switches, speech=speech.switches, pad_token_id=PAD, speech_eos_id=SPEECH_EOS,
        audio_eos_index=AUDIO_EOS, audio_bos_index=AUDIO_BOS, disable_speech=False, output_logits=False,
        plan=SimpleNamespace(bookkeeping_kernels=False, fold_crq_matching=True),
    )
    return model, ws, cfg


def kernel_against_torch(seed, dtype, device="cpu", text_history=False, force_token=None):
    '''{name: (kernel's, torch's)} of every workspace tensor after one `finish_part` each way from the same state.'''
    model, ws, cfg = finish_states(seed, dtype, device, text_history)
    results = {}
    for kernel in (True, False):
        state = copy.deepcopy(ws)
        finish_part(model, state, SimpleNamespace(**{**vars(cfg), "plan": SimpleNamespace(bookkeeping_kernels=kernel,
                    fold_crq_matching=True)}), force_token=force_token)  # fmt: skip
        results[kernel] = {name: value for name, value in vars(state).items() if isinstance(value, torch.Tensor)}
    return {name: (results[True][name], results[False][name]) for name in results[True]}
"""

_INTERPRETER_SCRIPT = _CASE_CODE + """
import json
from funaudiochat_hf import triton_finish_funaudiochat
triton_finish_funaudiochat.kernels_run_on = lambda tensor: True  # CPU tensors: the interpreter runs the kernel
report = []
# float16 for a 16-bit model dtype: the interpreter truncates float32 to bfloat16 (Triton 3.6), the GPU rounds to
# nearest as PyTorch does (the GPU test runs bfloat16).
for seed, dtype, text_history, force in ((0, torch.float32, False, None), (1, torch.float32, True, None),
                                         (2, torch.float16, False, None), (3, torch.float16, True, AUDIO_BOS)):
    pairs = kernel_against_torch(seed, dtype, text_history=text_history, force_token=force)
    kernel, eager = (t.float() for t in pairs.pop("next_embeds"))
    report.append({"case": [seed, str(dtype), text_history, force],
                   "different": [name for name, (a, b) in pairs.items() if not torch.equal(a, b)],
                   "next_embeds_relative": ((kernel - eager).abs() / eager.abs().clamp(min=1e-3)).max().item(),
                   "next_embeds_exact_rows": (kernel == eager).all(-1)[:, 0].tolist(),
                   "speaking": pairs["speaking"][1].tolist(), "done": pairs["done"][1].tolist(),
                   "finish_step": pairs["finish_step"][1].tolist()})
print(json.dumps(report))
"""


def test_finish_kernel_equals_the_pytorch_bookkeeping_in_the_triton_interpreter():
    """Every workspace tensor equal after one step each way, over states that take every branch: done rows, a speech
    end in the group, end ids chosen, `<|audio_bos|>` starting speech, a forced token, text history on and off. The
    next input is equal up to the rounding of the fed-back rows' mean (the kernel and PyTorch sum the K rows each in
    its own order): at most one unit in the last place of its dtype, and bit for bit in the rows that
    feed back no speech."""
    for case in json.loads(run_in_triton_interpreter(_INTERPRETER_SCRIPT)):
        assert case["different"] == [], case
        ulp = 2**-23 if case["case"][1] == "torch.float32" else 2**-10
        assert case["next_embeds_relative"] <= ulp, case
        assert any(case["next_embeds_exact_rows"]), case
        # The states did take the branches: rows stopped, rows speaking and rows silent after the step.
        assert any(case["speaking"]) and not all(case["speaking"]), case
        forced = case["case"][3] is not None  # every row's token is <|audio_bos|>: none stops
        assert any(step == 3 for step in case["finish_step"]) != forced, case


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finish_kernel_equals_the_pytorch_bookkeeping_on_gpu(dtype):
    namespace = {}
    exec(_CASE_CODE, namespace)
    for seed in range(4):
        pairs = namespace["kernel_against_torch"](seed, dtype, device="cuda", text_history=seed % 2 == 1)
        kernel, eager = (t.float() for t in pairs.pop("next_embeds"))
        assert [name for name, (a, b) in pairs.items() if not torch.equal(a, b)] == [], seed
        ulp = 2**-23 if dtype == torch.float32 else 2**-7  # the fed-back mean's sum order (see the interpreter test)
        assert ((kernel - eager).abs() <= ulp * eager.abs() + 1e-6).all(), seed


@pytest.mark.triton
def test_finish_kernel_compiles_for_hopper():
    """The kernel as the full-size model launches it (bfloat16 tables of 4,096 columns, K = 5), compiled for sm_90 by
    Triton's compiler and ptxas on the CPU: the interpreter does not compile it."""
    from conftest import hopper_ptx

    from funaudiochat_hf import triton_finish_funaudiochat as finish

    pointers = {name: "*i64" for name in finish._finish_rows_kernel.arg_names if name.endswith("_ptr")}
    pointers.update({name: "*i8" for name in ("done_ptr", "speaking_ptr", "speech_seen_ptr", "text_seen_ptr")})
    pointers.update({name: "*bf16" for name in ("text_table_ptr", "feedback_table_ptr", "next_embeds_ptr")})
    constexprs = {"K": 5, "BLOCK_K": 8, "BLOCK_EOS": 2, "BLOCK_H": 512, "SPEECH_HISTORY": True, "TEXT_HISTORY": False}
    ptx = hopper_ptx(finish._finish_rows_kernel, constexprs, pointers, options={"launch_pdl": False})
    assert ".entry _finish_rows_kernel" in ptx and "griddepcontrol" not in ptx


_STEP_SCRIPT = """
import json, torch
from conftest import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY
from safetensors.torch import load_file
from transformers import AutoModel
import funaudiochat_hf
from funaudiochat_hf import generation_state_funaudiochat as state, generation_step_funaudiochat as step
from funaudiochat_hf import triton_finish_funaudiochat as triton_finish
from funaudiochat_hf import triton_llm_tail_funaudiochat as triton_tail
from funaudiochat_hf.generation_plan_funaudiochat import DecodePlan

model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()
inputs = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")
inputs.pop("waveform_16k")
kwargs = dict(max_new_tokens=12, do_sample=False, repetition_penalty=1.2, eos_token_id=322, pad_token_id=320,
              backend="eager", cache_implementation="static")
eager = model.generate_speech(**inputs, **kwargs)
# The "cuda_graphs" step's parts on CPU tensors (the kernels through the interpreter): the stacks layer by layer with
# the GQA decode attention and the step's prepared masks and tables, the folded matching, the sampler writing the
# sub-step's state, the bookkeeping kernel; Python-int sub-steps as in the recorded step.
state.plan_decode = lambda *args, **kw: DecodePlan(
    "eager", static_cache=True, attention="gqa_matmul", fuse_crq_projections=True, fold_crq_matching=True,
    speech_sampler=True, bookkeeping_kernels=True)
step.use_sampler_kernel = lambda scores: True
triton_finish.kernels_run_on = triton_tail.kernels_run_on = lambda tensor: True
calls = []
into, finish, tail = step.sample_tokens_into, step.launch_finish_rows, step.launch_llm_tail
step.sample_tokens_into = lambda *args, **kw: (
    calls.append("into" if kw["next_input"] is None else "into+input") or into(*args, **kw))
step.launch_finish_rows = lambda *args, **kw: calls.append("finish") or finish(*args, **kw)
step.launch_llm_tail = lambda *args, **kw: calls.append("tail") or tail(*args, **kw)
fast = model.generate_speech(**inputs, **kwargs)
print(json.dumps({"text": torch.equal(fast.sequences, eager.sequences),
                  "speech": torch.equal(fast.speech_ids, eager.speech_ids), "groups": fast.speech_ids.shape[-1],
                  "into": calls.count("into"), "into_input": calls.count("into+input"), "finish": calls.count("finish"),
                  "tail": calls.count("tail")}))
"""


def test_a_reply_with_the_step_kernels_equals_the_eager_loop_in_the_triton_interpreter():
    """The tiny model's golden prompt, 12 steps with the speech history on: the default GPU step's parts that run on
    a CPU, with the sampler writing its sub-steps' state and the two bookkeeping kernels (through the interpreter)
    give the eager loop's text and speech tokens; the kernels ran at every sub-step and step (the tail after each
    decode step's LLM stack, the others in the prefill too)."""
    result = json.loads(run_in_triton_interpreter(_STEP_SCRIPT))
    assert result["text"] and result["speech"] and result["groups"] > 0, result
    # Each group's sub-steps 0 to 3 also write the next one's input.
    assert result["into"] == 12 and result["into_input"] == 12 * 4, result
    assert result["finish"] == 12 and result["tail"] == 11, result


_TAIL_SCRIPT = """
import json, torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from funaudiochat_hf.triton_llm_tail_funaudiochat import launch_llm_tail
report = []
for dtype, hidden_size in ((torch.float32, 40), (torch.float16, 40), (torch.float16, 2500)):
    g = torch.Generator().manual_seed(hidden_size)
    norm = Qwen3RMSNorm(hidden_size, eps=1e-6).to(dtype)
    norm.weight.data = (torch.rand(hidden_size, generator=g) + 0.5).to(dtype)
    table = (torch.randn(50, hidden_size, generator=g)).to(dtype)
    hidden = (torch.randn(3, 2, hidden_size, generator=g) * 4).to(dtype)[:, -1]  # the last position: strided rows
    ids = torch.tensor([4, 49, 0])
    positions = torch.tensor([7, 0, 100])
    normed = torch.zeros(3, hidden_size, dtype=dtype)
    conditioning = launch_llm_tail(hidden, norm, table, ids, normed, positions)
    expected_normed = norm(hidden)
    expected = expected_normed + table[ids]
    relative = lambda a, b: ((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-2)).max().item()
    report.append({"dtype": str(dtype), "hidden": hidden_size, "positions": positions.tolist(),
                   "normed": relative(normed, expected_normed), "conditioning": relative(conditioning, expected)})
print(json.dumps(report))
"""


def test_llm_tail_kernel_equals_the_norm_and_embedding_add_in_the_triton_interpreter():
    """The step's tail after the LLM stack as one kernel: `Qwen3RMSNorm` of the last hidden states (the text head's
    input) and the speech head's conditioning (plus the fed token's embedding), within a unit or two in the last place
    (the sum of squares in the kernel's order), over several column blocks; the positions advanced by one."""
    for case in json.loads(run_in_triton_interpreter(_TAIL_SCRIPT)):
        ulps = 2 * (2**-23 if case["dtype"] == "torch.float32" else 2**-10)
        assert case["positions"] == [8, 1, 101], case
        assert case["normed"] <= ulps and case["conditioning"] <= 2 * ulps, case


@pytest.mark.triton
def test_llm_tail_kernel_compiles_for_hopper():
    """As the full-size model launches it (bfloat16, 4,096 columns), through Triton's compiler and ptxas on the CPU."""
    from conftest import hopper_ptx

    from funaudiochat_hf import triton_llm_tail_funaudiochat as tail

    pointers = {name: "*bf16" for name in tail._llm_tail_kernel.arg_names if name.endswith("_ptr")}
    pointers.update({"ids_ptr": "*i64", "position_ptr": "*i64", "eps": "fp32"})
    ptx = hopper_ptx(tail._llm_tail_kernel, {"BLOCK_H": 1024}, pointers, options={"launch_pdl": False})
    assert ".entry _llm_tail_kernel" in ptx


@pytest.mark.gpu
@pytest.mark.triton
def test_llm_tail_kernel_equals_the_norm_and_embedding_add_on_gpu():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from funaudiochat_hf.triton_llm_tail_funaudiochat import launch_llm_tail

    g = torch.Generator().manual_seed(0)
    norm = Qwen3RMSNorm(4096, eps=1e-6).to("cuda", torch.bfloat16)
    norm.weight.data = (torch.rand(4096, generator=g) + 0.5).to("cuda", torch.bfloat16)
    table = torch.randn(1000, 4096, generator=g).to("cuda", torch.bfloat16)
    hidden = (torch.randn(16, 4096, generator=g) * 4).to("cuda", torch.bfloat16)
    ids, positions = torch.randint(0, 1000, (16,), generator=g).cuda(), torch.arange(16).cuda()
    normed = torch.zeros_like(hidden)
    conditioning = launch_llm_tail(hidden, norm, table, ids, normed, positions)
    torch.testing.assert_close(normed, norm(hidden), rtol=2**-6, atol=1e-3)  # a bfloat16 unit or two
    torch.testing.assert_close(conditioning, norm(hidden) + table[ids], rtol=2**-6, atol=1e-2)
    assert torch.equal(positions.cpu(), torch.arange(1, 17))
