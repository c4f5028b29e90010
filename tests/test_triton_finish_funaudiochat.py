"""Tests of the decode step's bookkeeping kernel (`triton_finish_funaudiochat`, the plan part `finish_kernel`): the
kernel against `finish_part`'s PyTorch ops on the same states, in Triton's interpreter (a subprocess, skipped without
Triton) and on a GPU (marked `gpu`)."""

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
        plan=SimpleNamespace(finish_kernel=False, fold_crq_matching=True),
    )
    return model, ws, cfg


def kernel_against_torch(seed, dtype, device="cpu", text_history=False, force_token=None):
    '''{name: (kernel's, torch's)} of every workspace tensor after one `finish_part` each way from the same state.'''
    model, ws, cfg = finish_states(seed, dtype, device, text_history)
    results = {}
    for kernel in (True, False):
        state = copy.deepcopy(ws)
        finish_part(model, state, SimpleNamespace(**{**vars(cfg), "plan": SimpleNamespace(finish_kernel=kernel,
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
    speech_sampler=True, finish_kernel=True)
step.use_sampler_kernel = lambda scores: True
triton_finish.kernels_run_on = lambda tensor: True
calls = []
into, finish = step.sample_tokens_into, step.launch_finish_rows
step.sample_tokens_into = lambda *args, **kw: calls.append("into") or into(*args, **kw)
step.launch_finish_rows = lambda *args, **kw: calls.append("finish") or finish(*args, **kw)
fast = model.generate_speech(**inputs, **kwargs)
print(json.dumps({"text": torch.equal(fast.sequences, eager.sequences),
                  "speech": torch.equal(fast.speech_ids, eager.speech_ids), "groups": fast.speech_ids.shape[-1],
                  "into": calls.count("into"), "finish": calls.count("finish")}))
"""


def test_a_reply_with_both_step_kernels_equals_the_eager_loop_in_the_triton_interpreter():
    """The tiny model's golden prompt, 12 steps with the speech history on: the default GPU step's parts that run on
    a CPU, with the sampler writing its sub-steps' state and the bookkeeping kernel (through the interpreter) give the
    eager loop's text and speech tokens; both kernels ran at every sub-step and step (the prefill's included)."""
    result = json.loads(run_in_triton_interpreter(_STEP_SCRIPT))
    assert result["text"] and result["speech"] and result["groups"] > 0, result
    assert result["into"] == 12 * 5 and result["finish"] == 12, result
