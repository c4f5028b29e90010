"""Tests of the Triton one-query attention (`triton_attention_funaudiochat`, the fast backends' decode attention on CUDA).

The kernels are checked against `gqa_decode_attention` (itself checked against SDPA in test_attention_funaudiochat.py):
on CPU through Triton's interpreter (`TRITON_INTERPRET=1`, in a subprocess: the variable must be set before the
kernels are defined; skipped where Triton is not installed), on a GPU for real (marked `gpu`).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf import triton_attention_funaudiochat as triton_attention
from funaudiochat_hf.attention_funaudiochat import gqa_decode_attention
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

from conftest import (
    FUNAUDIOCHAT_GOLDEN,
    FUNAUDIOCHAT_TINY,
    assert_waits_before_reading,
    hopper_ptx,
    run_in_triton_interpreter,
)


GOLDEN_KWARGS = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.0, eos_token_id=322, pad_token_id=320)

# (batch, heads, kv_heads, kv_len, head_dim, mask): masks "tail" (a static cache's unused end), "padding" (left
# padding, a row seeing one position), "broadcast" (one row's mask expanded to the batch, stride 0), None.
CASES = [
    (1, 16, 8, 300, 128, "tail"),  # the CRQ's head layout, several splits, skipped blocks
    (3, 4, 2, 70, 64, "padding"),
    (2, 6, 3, 10, 32, None),  # fewer positions than one block
    (2, 4, 4, 200, 48, "broadcast"),  # no grouping, head_dim not a power of two
    (2, 32, 8, 129, 128, "tail"),  # the LLM's head layout
]


def _case_tensors(batch, heads, kv_heads, kv_len, head_dim, mask_kind, dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(batch * 1000 + kv_len)
    query = torch.randn(batch, heads, 1, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, kv_len, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, kv_len, head_dim, generator=generator)
    mask = None
    if mask_kind == "tail":
        mask = torch.zeros(batch, 1, 1, kv_len, dtype=torch.bool)
        mask[..., : kv_len // 2 + 1] = True
    elif mask_kind == "padding":
        mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
        mask[0, ..., :5] = False
        mask[1, ..., 50:] = False
        mask[2] = False
        mask[2, ..., 3] = True  # sees a single position
    elif mask_kind == "broadcast":
        mask = (torch.rand(1, 1, 1, kv_len, generator=generator) > 0.3).expand(batch, 1, 1, kv_len)
    tensors = [t.to(device=device, dtype=dtype) for t in (query, key, value)]
    return (*tensors, None if mask is None else mask.to(device))


_INTERPRETER_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_triton_attention_funaudiochat import CASES, _case_tensors
from funaudiochat_hf.attention_funaudiochat import gqa_decode_attention
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig
from funaudiochat_hf.triton_attention_funaudiochat import launch_decode_attention
errors = []
for case in CASES:
    query, key, value, mask = _case_tensors(*case)
    expected, _ = gqa_decode_attention(None, query, key, value, mask, scaling=0.1)
    flat = None if mask is None else mask[:, 0, 0, :]
    got = launch_decode_attention(query, key, value, flat, 0.1)
    assert got.shape == expected.shape and got.is_contiguous(), (got.shape, expected.shape)
    errors.append((got - expected).abs().max().item())
    if mask is not None:  # NaN keys and values at the hidden positions: never part of the result
        hidden = (~mask[:, :, 0, :, None]).expand_as(key)  # (batch, 1, kv_len, 1) -> the cache's shape
        poisoned = [t.masked_fill(hidden, float("nan")) for t in (key, value)]
        errors.append((launch_decode_attention(query, *poisoned, flat, 0.1) - expected).abs().max().item())
print(json.dumps(errors))
"""


def test_kernels_match_matmul_attention_in_the_triton_interpreter():
    """Every mask layout, grouping and head size; float32, tolerance 1e-5 (same math, another summation order). With
    NaN in the cache at the positions the mask hides, the same results: hidden positions are never part of them."""
    errors = json.loads(run_in_triton_interpreter(_INTERPRETER_SCRIPT.format(tests=str(Path(__file__).parent))))
    assert len(errors) == len(CASES) + sum(case[-1] is not None for case in CASES)
    assert all(error < 1e-5 for error in errors), errors  # (not max(): it may pass over a NaN)


_BALANCE_SCRIPT = """
import json, torch
from funaudiochat_hf import triton_attention_funaudiochat as attention

launches = {}

class Recording:  # stands in for a kernel: keeps its grid and arguments, then launches it
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            launches[self.kernel.__name__] = (grid, args, kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch

attention._split_kernel = Recording(attention._split_kernel)

# 16 rows x 8 KV heads = 128 (row, head) programs per split: 3 splits of a 12-block cache, of which a decode step
# sees the first 3 blocks (192 positions).
query, key, value = torch.randn(16, 8, 1, 16), torch.randn(16, 8, 768, 16), torch.randn(16, 8, 768, 16)
mask = torch.zeros(16, 768, dtype=torch.bool)
mask[:, :192] = True
attention.launch_decode_attention(query, key, value, mask, 0.25)
grid, args, kwargs = launches["_split_kernel"]
part_max = args[5].view(grid[0], kwargs["NUM_SPLITS"], kwargs["BLOCK_G"])[:, :, 0]
print(json.dumps({"splits": kwargs["NUM_SPLITS"], "splits_with_work": torch.isfinite(part_max).sum(1).tolist()}))
"""


def test_used_cache_prefix_is_shared_by_all_splits():
    """Regression: the cache blocks were split into contiguous ranges, so the used prefix of a long static cache fell
    on the first split and the others skipped everything (at batch 16, 43 µs per CRQ layer instead of ~15). Dealt
    in turn, every split gets one of the three used blocks."""
    result = json.loads(run_in_triton_interpreter(_BALANCE_SCRIPT))
    assert result["splits"] == 3
    assert result["splits_with_work"] == [3] * 128


def _kernel_ptx(kernel, pdl: bool, divisible: tuple = (), **constexprs) -> str:
    types = {name: "*bf16" for name in kernel.arg_names if name.endswith("_ptr")}
    types.update(part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", mask_ptr="*i1", scaling="fp32")
    types.update(length_ptr="*i64", counters_ptr="*i32")
    shared = dict(KV_HEADS=8, GROUPS=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=8, PDL=pdl)
    if kernel is triton_attention._split_kernel:
        shared.update(PIPELINED=False, NUM_STAGES=2, MASK_BLOCKS=0, MERGE=False, BLOCK_S=1)
    return hopper_ptx(kernel, {**shared, **constexprs}, types, divisible=divisible)


@pytest.mark.parametrize("pdl", [True, False])
def test_programmatic_launch_waits_before_reading(pdl):
    """As programmatic dependent launches (H100 / H200) both kernels wait for the previous kernel before their first
    read (the query, the cache, the partial results); plain launches compile without the instructions."""
    pytest.importorskip("triton")
    split = dict(BLOCK_N=64, SPLIT_BLOCKS=2, HAS_MASK=True, PRECISION="tf32", Q_EPS=1e-6, K_EPS=1e-6)
    for kernel, constexprs in [
        (triton_attention._split_kernel, {**split, "PREPARE": False}),
        (triton_attention._split_kernel, {**split, "PREPARE": True}),  # with the attention inputs' work
        (triton_attention._split_kernel, {**split, "PREPARE": True, "PIPELINED": True}),
        (triton_attention._combine_kernel, {"BLOCK_S": 8, "ADVANCE": False}),
        (triton_attention._combine_kernel, {"BLOCK_S": 8, "ADVANCE": True}),
    ]:
        assert_waits_before_reading(_kernel_ptx(kernel, pdl, **constexprs), pdl)


def test_split_kernel_warps_and_grid_follow_the_kernel_config(monkeypatch):
    """The launcher takes the split kernel's warps (by batch size) and its grid (programs per multiprocessor times
    multiprocessors) from the `DecodeKernelConfig` it is handed, not from module globals; without one, from the
    device's (8 warps at batch 1, 4 above)."""
    pytest.importorskip("triton")
    launches = []

    class Recorder:
        def __init__(self, kind):
            self.kind = kind

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kind, grid, kwargs.get("num_warps")))

    monkeypatch.setattr(triton_attention, "_split_kernel", Recorder("split"))
    monkeypatch.setattr(triton_attention, "_combine_kernel", Recorder("combine"))
    for batch in (1, 2, 16):
        query, key, value, _ = _case_tensors(batch, 4, 2, 700, 16, None)
        triton_attention.launch_decode_attention(query, key, value, None, 0.25)
    assert [warps for kind, _, warps in launches if kind == "split"] == [8, 4, 4]
    launches.clear()
    config = DecodeKernelConfig(attention_split_warps=(), attention_default_split_warps=2, multiprocessors=2,
                                attention_programs_per_multiprocessor=3)  # fmt: skip
    query, key, value, _ = _case_tensors(1, 4, 2, 700, 16, None)
    triton_attention.launch_decode_attention(query, key, value, None, 0.25, config=config)
    # 2 KV heads, 11 blocks: 3 splits give the 6 programs the config aims for.
    assert [(grid, warps) for kind, grid, warps in launches if kind == "split"] == [((2, 3), 2)]


def test_falls_back_to_matmul_attention_off_cuda_and_for_unsupported_masks():
    """On CPU (and for float masks or several query positions) the function is `gqa_decode_attention`, bit for bit."""
    query, key, value, mask = _case_tensors(3, 4, 2, 70, 64, "padding")
    expected, _ = gqa_decode_attention(None, query, key, value, mask, scaling=0.1)
    got, weights = triton_attention.triton_decode_attention(None, query, key, value, mask, scaling=0.1)
    assert weights is None and torch.equal(got, expected)
    additive = torch.zeros(mask.shape).masked_fill(~mask, -1e9)
    assert triton_attention._flat_bool_mask(additive, 3, 70) == (False, None)
    supported, flat = triton_attention._flat_bool_mask(mask, 3, 70)
    assert supported and flat.shape == (3, 70) and torch.equal(flat, mask[:, 0, 0])
    assert triton_attention._flat_bool_mask(mask, 3, 71) == (False, None)  # mask / cache length mismatch


def test_decode_attention_choice():
    """The fast backends take the Triton kernels where they can run, the GQA matmuls elsewhere; the eager loop the
    model's own attention; forcing the Triton attention where it cannot run is a clear error."""
    from funaudiochat_hf.generation_plan_funaudiochat import DeviceFacts, ModelFacts, plan_decode

    speech = ModelFacts(speech=True)
    assert plan_decode("auto", DeviceFacts("cuda", triton=True), speech).attention == "triton"
    assert plan_decode("compiled", DeviceFacts("cpu", triton=False), speech).attention == "gqa_matmul"
    assert plan_decode("eager", DeviceFacts("cuda", triton=True), speech).attention == "default"
    assert plan_decode("auto", DeviceFacts("cuda", triton=False), speech).attention == "gqa_matmul"
    with pytest.raises(ValueError, match="triton_attention"):
        plan_decode("compiled", DeviceFacts("cpu", triton=False), speech, overrides={"triton_attention": True})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_matmul_attention(dtype):
    """Float32: 1e-5; bfloat16: within the bf16 rounding of the probabilities (2e-2 on unit-variance values)."""
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for case in [*CASES, (16, 16, 8, 3200, 128, "tail"), (1, 32, 8, 4096, 128, "tail")]:
        query, key, value, mask = _case_tensors(*case, dtype=dtype, device="cuda")
        expected, _ = gqa_decode_attention(None, query, key, value, mask, scaling=0.1)
        got, _ = triton_attention.triton_decode_attention(None, query, key, value, mask, scaling=0.1)
        assert got.dtype == dtype and got.shape == expected.shape
        assert (got.float() - expected.float()).abs().max().item() < tolerance, case


@pytest.mark.gpu
def test_cuda_operator_compiles_into_one_graph():
    query, key, value, mask = _case_tensors(1, 16, 8, 300, 128, "tail", dtype=torch.bfloat16, device="cuda")
    flat = mask[:, 0, 0, :]

    def attention(query, key, value, mask):
        return torch.ops.funaudiochat.decode_attention(query * 2, key, value, mask, 0.1, []) + 1

    compiled = torch.compile(attention, fullgraph=True)
    expected = attention(query, key, value, flat)
    assert torch.equal(compiled(query, key, value, flat), expected)


@pytest.mark.gpu
def test_cuda_graph_triton_step_matches_eager_on_gpu(inputs):
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    eager = model.generate_speech(**inputs, **GOLDEN_KWARGS, backend="eager")
    golden = load_file(FUNAUDIOCHAT_GOLDEN / "e_generate_rep1.0.safetensors")
    assert torch.equal(eager.sequences.cpu(), golden["sequences"])
    for _ in range(3):  # the later calls replay the captured CUDA graphs
        graphed = model.generate_speech(**inputs, **GOLDEN_KWARGS, backend="compiled")
        assert torch.equal(graphed.sequences, eager.sequences)
        assert torch.equal(graphed.speech_ids, eager.speech_ids)
    assert model.config.text_config._attn_implementation == "sdpa"


@pytest.mark.parametrize("pipelined", [False, True])
def test_split_writing_the_new_position_syncs_before_reading_the_cache(pipelined):
    """With the attention inputs' work (PREPARE), the split that writes the new key and value passes a barrier before
    any of its threads reads the cache: the block it then reads holds the new position. The pipelined loop's first
    loads (asynchronous copies) come after that barrier too."""
    pytest.importorskip("triton")
    constexprs = dict(BLOCK_N=64, SPLIT_BLOCKS=2, HAS_MASK=True, PRECISION="tf32", Q_EPS=1e-6, K_EPS=1e-6)
    ptx = _kernel_ptx(triton_attention._split_kernel, True, PREPARE=True, PIPELINED=pipelined, **constexprs)
    lines = ptx.splitlines()
    cache_writes = [i for i, line in enumerate(lines) if "st.global" in line]
    reads = ("ld.global", "cp.async") if pipelined else ("ld.global",)
    next_read = next(i for i, line in enumerate(lines) if any(r in line for r in reads) and i > cache_writes[0])
    last_write = max(i for i in cache_writes if i < next_read)
    assert any("bar.sync" in line for line in lines[last_write:next_read])


def test_pipelined_split_fetches_the_next_block_during_this_ones_math():
    """`PIPELINED`: the loop over the blocks up to the new position is software-pipelined (asynchronous copies of the
    next block in flight while this block's products run); the block loop, whose every block waits for its own mask
    test, has none. Compiled as a launch specialises it: unit strides along the mask and the head dimension, the
    other integers multiples of 16."""
    pytest.importorskip("triton")
    kernel = triton_attention._split_kernel
    constexprs = dict(
        BLOCK_N=64, SPLIT_BLOCKS=4, HAS_MASK=True, PRECISION="tf32", Q_EPS=1e-6, K_EPS=1e-6, PREPARE=True,
        stride_mn=1, stride_kd=1, stride_vd=1, stride_qd=1,
    )  # fmt: skip
    divisible = [name for name in kernel.arg_names if name.startswith("stride_") or name == "kv_len"]
    for pipelined in (True, False):
        ptx = _kernel_ptx(kernel, True, divisible=divisible, PIPELINED=pipelined, **constexprs)
        assert ("cp.async" in ptx) == pipelined


@pytest.mark.parametrize("mask_blocks", [4, 0])
def test_pipelined_split_copies_a_block_without_waiting_for_a_mask_load(mask_blocks):
    """The pipelined loop takes each block's mask from bits loaded before the loop, so the asynchronous copies of the
    next block's keys and values (which the mask predicates) follow no global load after the block's last product.
    With a mask load per block (MASK_BLOCKS 0: splits of more than `MAX_MASK_BLOCKS` blocks) Triton issues the next
    block's mask load right there, and the copies wait for it."""
    pytest.importorskip("triton")
    kernel = triton_attention._split_kernel
    constexprs = dict(
        BLOCK_N=64, SPLIT_BLOCKS=4, HAS_MASK=True, PRECISION="tf32", Q_EPS=1e-6, K_EPS=1e-6, PREPARE=True,
        PIPELINED=True, MASK_BLOCKS=mask_blocks, stride_mn=1, stride_kd=1, stride_vd=1, stride_qd=1,
    )  # fmt: skip
    divisible = [name for name in kernel.arg_names if name.startswith("stride_") or name == "kv_len"]
    lines = _kernel_ptx(kernel, True, divisible=divisible, **constexprs).splitlines()
    last_product = max(i for i, line in enumerate(lines) if "mma" in line)
    next_copy = min(i for i, line in enumerate(lines) if "cp.async.cg" in line and i > last_product)
    loads_between = [line for line in lines[last_product:next_copy] if "ld.global" in line]
    assert bool(loads_between) == (mask_blocks == 0), loads_between


@pytest.mark.parametrize("prepare", [True, False])
def test_last_split_counts_in_after_a_barrier_and_merges(prepare):
    """MERGE (given arrival counters, sm_90 PTX): all threads' partial stores are behind a barrier before the
    acquire-release atomic that counts the split in; with the attention inputs' work (PREPARE) a second one counts
    the finished heads (for the length's advance), issued before the merge's loads of the other splits' partials,
    which bypass L1 (`.cg`: stored by other programs of the same grid)."""
    pytest.importorskip("triton")
    kernel = triton_attention._split_kernel
    constexprs = dict(
        BLOCK_N=64, SPLIT_BLOCKS=4, HAS_MASK=True, PRECISION="tf32", Q_EPS=1e-6, K_EPS=1e-6, PREPARE=prepare,
        PIPELINED=prepare, MASK_BLOCKS=4 if prepare else 0, MERGE=True, BLOCK_S=8,
    )  # fmt: skip
    lines = _kernel_ptx(kernel, True, **constexprs).splitlines()
    atomics = [i for i, line in enumerate(lines) if "atom." in line]
    assert len(atomics) == (2 if prepare else 1), [lines[i] for i in atomics]
    assert all("acq_rel" in lines[i] and ".gpu" in lines[i] for i in atomics)
    partial_stores = [i for i, line in enumerate(lines) if "st.global" in line and i < atomics[0]]
    assert partial_stores and any("bar.sync" in line for line in lines[partial_stores[-1] : atomics[0]])
    merge_loads = [line for line in lines[atomics[-1] :] if "ld.global" in line]
    assert merge_loads and all(".cg" in line for line in merge_loads), merge_loads
    assert not [line for line in lines[atomics[0] : atomics[-1]] if "ld.global" in line]


def test_counters_too_small_for_the_heads_are_refused():
    """`launch_decode_attention(counters=...)` needs one int32 per (row, KV head) and one more: a clear error before
    any launch, not a kernel writing past the tensor."""
    pytest.importorskip("triton")
    query, key, value = torch.zeros(2, 4, 1, 16), torch.zeros(2, 2, 64, 16), torch.zeros(2, 2, 64, 16)
    for counters in (torch.zeros(4, dtype=torch.int32), torch.zeros(5, dtype=torch.int64)):
        with pytest.raises(ValueError, match="5 or more int32 zeros"):
            triton_attention.launch_decode_attention(query, key, value, None, 0.25, counters=counters)


def test_split_reads_come_before_the_querys_norm():
    """The cache length and the split's mask bytes (and every other read that waits only for the previous kernels) are
    loaded right after the wait, before the query's norm, whose reductions end in barriers that no load crosses."""
    pytest.importorskip("triton")
    kernel = triton_attention._split_kernel
    constexprs = dict(
        BLOCK_N=64, SPLIT_BLOCKS=4, HAS_MASK=True, PRECISION="tf32", Q_EPS=1e-6, K_EPS=1e-6, PREPARE=True,
        PIPELINED=True, MASK_BLOCKS=4, stride_mn=1, stride_kd=1, stride_vd=1, stride_qd=1,
    )  # fmt: skip
    divisible = [name for name in kernel.arg_names if name.startswith("stride_") or name == "kv_len"]
    lines = _kernel_ptx(kernel, True, divisible=divisible, **constexprs).splitlines()
    first_barrier = min(i for i, line in enumerate(lines) if "bar.sync" in line)
    length_load = min(i for i, line in enumerate(lines) if "ld.global.b64" in line)  # the int64 cache length
    loads_after_barrier = [line for line in lines[first_barrier:] if "ld.global" in line]
    assert length_load < first_barrier
    assert not loads_after_barrier, loads_after_barrier


def test_merge_reads_come_before_its_reductions():
    """The merge program loads its partial sums with the maxima and sums, before their reductions, and advances the
    cache length after its output's store (sm_90 PTX)."""
    pytest.importorskip("triton")
    lines = _kernel_ptx(triton_attention._combine_kernel, True, BLOCK_S=4, NUM_SPLITS=3, ADVANCE=True).splitlines()
    first_reduction = min(i for i, line in enumerate(lines) if "shfl.sync" in line or "bar.sync" in line)
    length_load = min(i for i, line in enumerate(lines) if "ld.global.b64" in line)
    output_store = min(i for i, line in enumerate(lines) if "st.global.b16" in line)
    late_loads = [line for line in lines[first_reduction:] if "ld.global" in line and "b64" not in line]
    assert not late_loads, late_loads
    assert length_load > output_store


_MASK_BITS_SCRIPT = """
import json, torch, triton
import triton.language as tl
from funaudiochat_hf import triton_attention_funaudiochat as attention

@triton.jit
def blocks_seen(mask_ptr, out_ptr, kv_len, position, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                SPLIT_BLOCKS: tl.constexpr, MASK_BLOCKS: tl.constexpr):
    split = tl.program_id(0)
    tile = attention._split_mask_tile(mask_ptr, split, kv_len, 1, BLOCK_N, NUM_SPLITS, SPLIT_BLOCKS, MASK_BLOCKS)
    bits = attention._split_mask_bits(tile, split, position, BLOCK_N, NUM_SPLITS, MASK_BLOCKS)
    for block in range(SPLIT_BLOCKS):
        n, valid = attention._visible_from_bits(bits, block, split, BLOCK_N, NUM_SPLITS, MASK_BLOCKS)
        tl.store(out_ptr + n, valid.to(tl.int8), mask=n < kv_len)

generator = torch.Generator().manual_seed(0)
results = []
for kv_len, position, splits, split_blocks in [(640, 500, 3, 4), (640, 639, 2, 5), (256, 70, 1, 4), (64, 0, 1, 1)]:
    mask = torch.rand(kv_len, generator=generator) < 0.7
    mask[position] = True
    out = torch.full((kv_len,), -1, dtype=torch.int8)
    blocks = triton.next_power_of_2(split_blocks)
    blocks_seen[(splits,)](mask, out, kv_len, position, BLOCK_N=64, NUM_SPLITS=splits, SPLIT_BLOCKS=split_blocks,
                           MASK_BLOCKS=blocks)
    expected = mask & (torch.arange(kv_len) <= position)
    results.append(bool(torch.equal(out.bool(), expected)) and bool((out >= 0).all()))
print(json.dumps(results))
"""


def test_split_mask_bits_give_each_blocks_visible_positions():
    """The pipelined loop's mask from registers: every position of every split's blocks (the 64th of a block in the
    sign bit of its word included) is seen where the mask shows it at or before the new position, in the Triton
    interpreter."""
    assert json.loads(run_in_triton_interpreter(_MASK_BITS_SCRIPT)) == [True] * 4


@pytest.mark.triton
def test_mask_blocks_hold_a_splits_blocks_up_to_the_limit():
    assert [triton_attention.mask_blocks(b) for b in (1, 3, 4, 5, 64)] == [1, 4, 4, 8, 64]
    assert triton_attention.mask_blocks(65) == 0  # past MAX_MASK_BLOCKS: a mask load per block


def test_split_loads_a_blocks_values_with_its_keys():
    """Each cache block's values are loaded with its keys, before the scores' tensor-core products: the block costs one
    DRAM round trip, not a second one after its softmax."""
    pytest.importorskip("triton")
    constexprs = dict(BLOCK_N=64, SPLIT_BLOCKS=2, HAS_MASK=False, PRECISION="tf32", Q_EPS=1e-6, K_EPS=1e-6)
    lines = _kernel_ptx(triton_attention._split_kernel, True, PREPARE=False, **constexprs).splitlines()
    products = [i for i, line in enumerate(lines) if "mma" in line]
    assert products, "no tensor-core products in the split kernel"
    # Between a block's first product (query x keys) and its last (probabilities x values), no global load.
    assert not [line for line in lines[products[0] : products[-1]] if "ld.global" in line]
