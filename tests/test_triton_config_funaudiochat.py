"""Tests of the decode kernels' configuration (`triton_config_funaudiochat.DecodeKernelConfig`): chosen per GPU,
frozen and hashable (part of every graph key), overridable by field, and the tiles it picks."""

import dataclasses

import pytest
import torch

from funaudiochat_hf.generation_plan_funaudiochat import DecodePlan
from funaudiochat_hf.generation_workspace_funaudiochat import StepConfig
from funaudiochat_hf.sampling_funaudiochat import SamplingSwitches
from funaudiochat_hf.triton_config_funaudiochat import (
    _SM90_GEMV_TILES,
    _SM90_ROWS_TILES,
    DecodeKernelConfig,
    rows_tile_candidates,
    supports_programmatic_launch,
)


class _Properties:
    def __init__(self, major, minor, multiprocessors=132, shared=232448):
        self.major, self.minor = major, minor
        self.multi_processor_count = multiprocessors
        self.shared_memory_per_block_optin = shared


def _fake_gpu(monkeypatch, major, minor, **properties):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Properties(major, minor, **properties))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))


def test_config_off_cuda_is_the_generic_default():
    config = DecodeKernelConfig.for_device("cpu")
    assert config == DecodeKernelConfig() and config.capability is None and config.max_shared_memory is None
    assert not config.programmatic_launch and config.gemv_tiles == () and config.rows_tiles == ()
    assert not supports_programmatic_launch("cpu")


def test_config_follows_the_gpu(monkeypatch):
    """sm_90 (H100 / H200): programmatic launches and the tuned tiles; an sm_80 GPU: plain launches and the generic
    tiles; both with the GPU's multiprocessors and shared memory per program."""
    _fake_gpu(monkeypatch, 9, 0, multiprocessors=132, shared=232448)
    hopper = DecodeKernelConfig.for_device("cuda:0")
    assert hopper.capability == (9, 0) and hopper.programmatic_launch and supports_programmatic_launch("cuda")
    assert hopper.gemv_tiles == _SM90_GEMV_TILES and hopper.rows_tiles == _SM90_ROWS_TILES
    assert hopper.max_shared_memory == 232448 and hopper.attention_programs() == 264
    _fake_gpu(monkeypatch, 8, 0, multiprocessors=108, shared=166912)
    ampere = DecodeKernelConfig.for_device("cuda:0")
    assert ampere.capability == (8, 0) and not ampere.programmatic_launch and not supports_programmatic_launch("cuda")
    assert ampere.gemv_tiles == () and ampere.rows_tiles == ()
    assert ampere.multiprocessors == 108 and ampere.max_shared_memory == 166912 and ampere.attention_programs() == 216
    assert hopper != ampere and hash(hopper) != hash(ampere)


def test_config_is_frozen_hashable_and_part_of_the_step_config():
    """Never mutated in place; two configs that differ in any field are different step configurations (so they
    never share recorded CUDA graphs or compiled steps)."""
    config = DecodeKernelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.split_num_warps = 8
    other = config.replace(attention_split_warps={1: 4, 16: 8})
    assert other.attention_split_warps == ((1, 4), (16, 8)) and other.attention_num_warps(16) == 8
    assert config.attention_num_warps(16) == 4 and config.attention_num_warps(1) == 8
    assert config.attention_stages(16) == 3 and config.attention_stages(1) == config.attention_stages(4) == 2
    assert config.replace(attention_pipeline_stages=4).attention_stages(1) == 4
    from funaudiochat_hf.triton_attention_funaudiochat import AttentionLaunch

    assert AttentionLaunch.of(config, 16).pipeline_stages == 3 and AttentionLaunch.of(config, 1).pipeline_stages == 2
    switches = SamplingSwitches(do_sample=False, uses_history=False, uses_top_p=False, uses_top_k=False)
    plan = DecodePlan(backend="cuda_graphs", static_cache=True)
    steps = [
        StepConfig(switches, switches, False, 5, 1, 2, 3, 4, 0, False, plan, kernel_config=kernels)
        for kernels in (config, other)
    ]
    assert steps[0] != steps[1] and len({steps[0], steps[1]}) == 2
    assert StepConfig(switches, switches, False, 5, 1, 2, 3, 4, 0, False, plan, kernel_config=config) == steps[0]


def test_replace_names_unknown_fields():
    with pytest.raises(ValueError, match="no field split_num_warps"):
        DecodeKernelConfig().replace(split_num_warps=8)
    # Lists (JSON) become tuples: the config stays hashable.
    config = DecodeKernelConfig().replace(gemv_tile=[4, 512, 2], rows_tiles=[[[64, 64, False], [16, 16, 2, 4, 3, 0]]])
    assert config.gemv_tile == (4, 512, 2) and hash(config)
    assert config.rows_kernel_tile(64, 64, False) == (16, 16, 2, 4, 3, False)


def test_gemv_tile_takes_the_tuned_tile_of_a_full_size_projection():
    hopper = DecodeKernelConfig(gemv_tiles=_SM90_GEMV_TILES)
    assert hopper.gemv_kernel_tile(4096, 1024, False) == dict(_SM90_GEMV_TILES)[(4096, 1024, False)]
    assert hopper.gemv_kernel_tile(12288, 4096, True) == (4, 256, 2)  # the LLM's gate/up
    generic = DecodeKernelConfig()
    assert generic.gemv_kernel_tile(4096, 1024, False) == (8, 1024, 8)  # BLOCK_K at most the input's width
    for shape, block_k in [((40, 64, False), 64), ((24, 3000, True), 256), ((24, 1000, True), 512)]:
        block_n, got_block_k, num_warps = generic.gemv_kernel_tile(*shape)
        assert (block_n, num_warps) == (8, 8) and got_block_k == block_k, shape


def test_rows_tile_defaults_split_the_reduction_until_the_grid_is_large_enough():
    """Default tiles split the reduction until the grid has `rows_min_programs` programs (at most
    `rows_max_split_k` splits), never into empty splits; tuned tiles are taken as they are."""
    hopper = DecodeKernelConfig(rows_tiles=_SM90_ROWS_TILES)
    assert hopper.rows_kernel_tile(1024, 3072, False) == dict(_SM90_ROWS_TILES)[(1024, 3072, False)]
    generic = DecodeKernelConfig()
    assert generic.rows_kernel_tile(512, 4096, False) == (32, 128, 8, 4, 3, False)  # 16 column tiles x 8 splits
    assert generic.rows_kernel_tile(512, 200, False)[2] == 1  # 200 inputs: a second 128-wide split would be empty
    assert generic.replace(rows_min_programs=32).rows_kernel_tile(512, 4096, False)[2] == 2


def test_rows_tile_candidates_shrink_stages_then_chunks_then_columns():
    assert list(rows_tile_candidates((64, 128, 4, 8, 3, True))) == [
        (64, 128, 4, 8, 3, True), (64, 128, 4, 8, 2, True), (64, 128, 4, 8, 1, True), (64, 64, 4, 8, 1, True),
        (64, 32, 4, 8, 1, True), (32, 32, 4, 8, 1, True), (16, 32, 4, 8, 1, True),
    ]  # fmt: skip


def test_text_head_grid_follows_the_config():
    assert DecodeKernelConfig(multiprocessors=132).text_head_programs() == 66
    assert DecodeKernelConfig(multiprocessors=1, text_head_programs_per_multiprocessor=0.25).text_head_programs() == 1


def test_speech_generator_carries_its_kernel_config_in_the_step_config(inputs):
    """A generator's `kernel_config` lands in its runs' step configuration (so in every graph key); None takes the
    device's; anything else is a clear error."""
    from transformers import AutoModel

    from conftest import FUNAUDIOCHAT_TINY
    from funaudiochat_hf.generation_loop_funaudiochat import SpeechRun

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()
    recorded = []
    original = SpeechRun.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        recorded.append(self.cfg.kernel_config)

    kwargs = dict(max_new_tokens=2, do_sample=False, return_audio=False)
    config = DecodeKernelConfig(attention_pipeline_stages=3)
    try:
        SpeechRun.__init__ = recording
        model.generate_speech(**inputs, **kwargs)
        with model.speech_generator(kernel_config=config) as generator:
            generator.generate(**inputs, **kwargs)
    finally:
        SpeechRun.__init__ = original
    assert recorded == [DecodeKernelConfig.for_device("cpu"), config]
    with pytest.raises(TypeError, match="`kernel_config` must be a DecodeKernelConfig"):
        model.speech_generator(kernel_config={"attention_pipeline_stages": 3})
