"""Unit tests of `generation_plan_funaudiochat.plan_decode`: which parts of the decode loop run, from facts alone (no
GPU, no model)."""

import pytest

from funaudiochat_hf.generation_plan_funaudiochat import (
    AUTO_CUDA_BACKEND,
    DeviceFacts,
    ModelFacts,
    plan_decode,
    prefill_compile_options,
    step_compile_options,
)


H200 = DeviceFacts("cuda", triton=True)
OLD_GPU = DeviceFacts("cuda", triton=False)  # compute capability < 8.0, or no Triton installed
CPU = DeviceFacts("cpu", triton=False)
SPEECH = ModelFacts(speech=True)
FAST_PARTS = ("fuse_crq_projections", "fold_crq_matching", "crq_linear", "llm_linear", "crq_head_linear",
              "speech_sampler", "overlap_text_head", "bookkeeping_kernels", "prompt_kernels")  # fmt: skip


def test_auto_is_eager_on_a_cpu_and_the_fast_backend_on_cuda():
    cpu = plan_decode("auto", CPU, SPEECH)
    assert cpu.backend == "eager" and not cpu.static_cache and not cpu.fallbacks
    assert not any(getattr(cpu, part) for part in FAST_PARTS) and cpu.attention == "default"
    gpu = plan_decode("auto", H200, SPEECH)
    assert gpu.backend == AUTO_CUDA_BACKEND == "cuda_graphs" and gpu.static_cache and gpu.step_graph
    assert all(getattr(gpu, part) for part in FAST_PARTS) and gpu.attention == "triton" and not gpu.fallbacks
    assert not gpu.compile_step and not gpu.compile_prefill  # no torch.compile in "cuda_graphs"
    assert not gpu.pad_speech_head  # folded: the folded head is padded itself


def test_compiled_backend():
    gpu = plan_decode("compiled", H200, SPEECH)
    assert gpu.compile_step and gpu.compile_prefill and gpu.step_graph and gpu.attention == "triton"
    assert not gpu.bookkeeping_kernels  # Inductor fuses the compiled step's bookkeeping
    cpu = plan_decode("compiled", CPU, SPEECH)  # a CPU: compiled, no CUDA graph, no Triton, GQA matmul attention
    assert cpu.compile_step and not cpu.step_graph and cpu.attention == "gqa_matmul"
    assert cpu.fuse_crq_projections and cpu.fold_crq_matching and not cpu.crq_linear and not cpu.speech_sampler


def test_fast_parts_fall_back_one_by_one_with_a_reason():
    old = plan_decode("auto", OLD_GPU, SPEECH)
    assert old.backend == "cuda_graphs" and old.step_graph and old.fuse_crq_projections and old.fold_crq_matching
    assert not (old.crq_linear or old.llm_linear or old.speech_sampler or old.overlap_text_head)
    assert not old.bookkeeping_kernels
    assert old.attention == "gqa_matmul" and any("Triton kernels off" in note for note in old.fallbacks)
    lora = plan_decode("auto", H200, ModelFacts(speech=True, crq_fusable=False, crq_foldable=False))
    assert not lora.fuse_crq_projections and not lora.crq_linear and not lora.fold_crq_matching
    assert lora.llm_linear and lora.pad_speech_head  # what does not depend on those still runs
    assert not lora.bookkeeping_kernels  # it gathers the folded feedback rows
    assert len(lora.fallbacks) == 2
    flash = plan_decode("auto", H200, ModelFacts(speech=True, decode_attention=False))
    assert flash.attention == "default" and any("attention" in note for note in flash.fallbacks)
    dispatched = plan_decode("auto", DeviceFacts("cuda", triton=True, dispatched=True), SPEECH)
    assert dispatched.backend == "eager" and "dispatched" in dispatched.fallbacks[0]


def test_batches_and_text_only():
    batch = plan_decode("auto", H200, ModelFacts(speech=True, batch_size=16, text_head_kernel=False))
    assert batch.crq_linear and batch.crq_head_linear
    assert not batch.overlap_text_head
    unfolded = plan_decode("auto", H200, ModelFacts(speech=True, batch_size=4), overrides={"fold_crq_matching": False})
    assert unfolded.pad_speech_head  # several rows through cuBLAS: the padded copy
    one_row = plan_decode("auto", H200, SPEECH, overrides={"fold_crq_matching": False})
    assert not one_row.pad_speech_head  # one row: the GEMV kernel reads the head as it is
    text_only = plan_decode("auto", H200, ModelFacts(speech=False))
    assert not (text_only.fuse_crq_projections or text_only.speech_sampler or text_only.overlap_text_head)
    assert not text_only.bookkeeping_kernels
    assert text_only.llm_linear and not text_only.pad_speech_head


def test_explicit_backends_that_cannot_run_raise():
    with pytest.raises(ValueError, match="cuda_graphs.*CUDA GPU"):
        plan_decode("cuda_graphs", CPU, SPEECH)
    with pytest.raises(ValueError, match="static"):
        plan_decode("compiled", H200, SPEECH, cache_implementation="dynamic")
    with pytest.raises(ValueError, match="dispatched"):
        plan_decode("cuda_graphs", DeviceFacts("cuda", triton=True, dispatched=True), SPEECH)
    with pytest.raises(ValueError, match="backend"):
        plan_decode("fast", H200, SPEECH)
    auto_dynamic = plan_decode("auto", H200, SPEECH, cache_implementation="dynamic")
    assert auto_dynamic.backend == "eager" and not auto_dynamic.static_cache and auto_dynamic.fallbacks
    assert plan_decode("eager", H200, SPEECH, cache_implementation="static").static_cache


def test_overrides_turn_parts_off_and_refuse_what_cannot_run():
    plan = plan_decode("cuda_graphs", H200, SPEECH, overrides={"crq_linear": False, "triton_attention": False})
    assert not plan.crq_linear and not plan.crq_head_linear and plan.fuse_crq_projections
    assert plan.attention == "gqa_matmul"
    unfused = plan_decode("cuda_graphs", H200, SPEECH, overrides={"fuse_crq_projections": False})
    assert not unfused.fuse_crq_projections and not unfused.crq_linear  # the CRQ kernels read the fused copies
    with pytest.raises(ValueError, match="llm_linear"):
        plan_decode("cuda_graphs", OLD_GPU, SPEECH, overrides={"llm_linear": True})
    with pytest.raises(ValueError, match="Unknown plan overrides"):
        plan_decode("cuda_graphs", H200, SPEECH, overrides={"compile_scope": False})
    with pytest.raises(ValueError, match="eager backend"):
        plan_decode("eager", H200, SPEECH, overrides={"fold_crq_matching": True})
    assert not plan_decode("cuda_graphs", H200, SPEECH, overrides={"bookkeeping_kernels": False}).bookkeeping_kernels
    with pytest.raises(ValueError, match="bookkeeping_kernels"):
        plan_decode("compiled", H200, SPEECH, overrides={"bookkeeping_kernels": True})


def test_plans_are_hashable_keys():
    assert hash(plan_decode("auto", H200, SPEECH)) == hash(plan_decode("auto", H200, SPEECH))
    assert plan_decode("auto", H200, SPEECH) != plan_decode("compiled", H200, SPEECH)


def test_compile_options():
    assert step_compile_options(None, step_graph=True) == {"fullgraph": True, "dynamic": False}
    # CompileConfig's default mode "reduce-overhead" is dropped: the step CUDA graph (or none, on a CPU) instead.
    config = {"fullgraph": False, "backend": "inductor", "mode": "reduce-overhead"}
    assert step_compile_options(config, step_graph=False) == {"fullgraph": False, "dynamic": False, "backend": "inductor"}
    assert step_compile_options({"mode": "max-autotune"}, step_graph=True)["mode"] == "max-autotune-no-cudagraphs"
    assert prefill_compile_options({"backend": "aot_eager", "mode": "max-autotune"}) == {
        "fullgraph": True, "dynamic": True, "backend": "aot_eager"
    }


def test_prompt_pass_is_recorded_on_the_cuda_graphs_backend_only():
    """`prefill_graph`: the bucket-padded prompt pass as a CUDA graph, on the "cuda_graphs" backend (also where the
    Triton kernels cannot run); "compiled" compiles the prompt's layers instead; a CPU has no CUDA graph."""
    assert plan_decode("auto", H200, SPEECH).prefill_graph
    assert plan_decode("auto", OLD_GPU, SPEECH).prefill_graph
    assert not plan_decode("compiled", H200, SPEECH).prefill_graph
    assert not plan_decode("auto", CPU, SPEECH).prefill_graph and not plan_decode("compiled", CPU, SPEECH).prefill_graph
    assert not plan_decode("auto", H200, SPEECH, overrides={"prefill_graph": False}).prefill_graph
    with pytest.raises(ValueError, match="prefill_graph"):
        plan_decode("compiled", H200, SPEECH, overrides={"prefill_graph": True})


def test_prompt_kernels_run_where_the_triton_kernels_do_outside_the_compiled_backend():
    """`prompt_kernels`: the prompt pass's element-wise work on Triton kernels, on the "cuda_graphs" backend of a Triton
    GPU (also without speech: the LLM's prompt pass); "compiled" compiles the prompt's layers instead (Inductor fuses
    them); not on an older GPU, a CPU, nor for stacks whose norms / activation the kernels do not compute (a reason)."""
    assert plan_decode("auto", H200, SPEECH).prompt_kernels
    assert plan_decode("auto", H200, ModelFacts(speech=False)).prompt_kernels
    assert not plan_decode("compiled", H200, SPEECH).prompt_kernels
    assert not plan_decode("auto", OLD_GPU, SPEECH).prompt_kernels
    assert not plan_decode("auto", CPU, SPEECH).prompt_kernels
    assert not plan_decode("compiled", CPU, SPEECH).prompt_kernels
    other = plan_decode("auto", H200, ModelFacts(speech=True, prompt_kernels=False))
    assert not other.prompt_kernels and other.llm_linear
    assert any("prompt kernels off" in note for note in other.fallbacks)
    assert not plan_decode("auto", H200, SPEECH, overrides={"prompt_kernels": False}).prompt_kernels
    with pytest.raises(ValueError, match="prompt_kernels"):
        plan_decode("compiled", H200, SPEECH, overrides={"prompt_kernels": True})
    with pytest.raises(ValueError, match="prompt_kernels"):
        plan_decode("cuda_graphs", OLD_GPU, SPEECH, overrides={"prompt_kernels": True})
