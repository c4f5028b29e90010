"""The decode-step projections of a Qwen3 stack as Triton GEMV kernels, with the layer's norms and activation folded in.

`generate_speech(crq_linear="triton")` runs the CRQ's layers on them, `llm_linear="triton"` the LLM's, over its own
unfused weights (4 kernels per layer: its q, k and v weights are read by one kernel, `part_weights`); both are the
compiled default on CUDA when Triton is installed. At batch 1 a CRQ sub-step is 28 layers of 4 GEMMs with a single
input row: each streams 4-13 MB of weights, which an H200 reads in 1-3 µs, yet cuBLAS takes 5-12 µs per call (its
o_proj kernel reads at 0.4 TB/s) and the norms, SiLU and residual adds around them are 5 more small kernels per layer.
Here each projection is one kernel of many small programs (2-8 output columns over the whole reduction each;
`kernel_tile`), enough loads in flight to approach the copy bandwidth:

- `qkv = linear(RMSNorm(x))`: the input norm folded in (each program recomputes the RMS of its input row);
- `h = x + linear(attention)`: o_proj with the residual add;
- `a = SiLU(gate(RMSNorm(h))) * up(RMSNorm(h))`: the post-attention norm, the fused gate/up GEMM and the activation;
- `y = h + linear(a)`: down_proj with the residual add.

Rounding follows the eager layer: the norm output, each GEMM output and the activation are rounded to the model
dtype where transformers rounds them; only the float32 summation order differs from cuBLAS (results equal the eager
layer up to one rounding of the model dtype; in float32 to ~1e-6). One exception: the one-row kernel folds the norm
of inputs of up to `GEMV_FOLDED_NORM_MAX_FEATURES` into its products and does not round the normed input. The
launcher is an opaque PyTorch operator (`torch.library.custom_op`) that `torch.compile` keeps in its graph and CUDA
graphs replay.

On Hopper GPUs the kernels are programmatic dependent launches (`PROGRAMMATIC_DEPENDENT_LAUNCH` in
`triton_attention_funaudiochat`): each program fetches its first weight tiles before `griddepcontrol.wait`, so the
weight stream of one projection starts while the previous kernel finishes.

Measured on an H200 (BENCHMARKS.md, 2026-11-30): one full-size CRQ sub-step at batch 1 took 1,188 against 1,492 µs
with cuBLAS (CUDA-graph timed, same process), the whole batch-1 step 12.48 against 13.71 ms. Summing each program's
products once after the reduction loop, instead of once per unrolled step (each sum synchronised the warps between
weight loads), made the CRQ's four kernels 19.0 instead of 25.0 µs per layer and the step 11.58 ms; with the LLM on
them too, 10.69 ms (side by side). Launched as programmatic dependent launches: 9.97 against 10.59 ms (side by
side; a chain of the CRQ's 112 projections 427 against 525 µs).

Batches of 2 to 16 rows: the GEMV kernel reads the weights once per row, so above `MAX_ROWS` rows the layers keep
cuBLAS unless given `split_k_counters` (`generate_speech` passes its workspace's, for the CRQ and the LLM): they then
take `_decode_rows_kernel`, which reads each weight tile once for all rows on tensor cores and splits the reduction
over several programs per column tile. With the CRQ on it: batch 16 at 13.78 against 14.57 ms per step, batch 4 11.50
against 12.36; with the LLM's layers too: batch 16 at 13.77 against 14.46 ms (side by side; the LLM's 36 layers at 16
rows 5,014 against 5,638 µs). In those steps the residual projections also return their outputs' sums of squares
by 16 columns, which the next input norm adds up instead of reading all 16 x K inputs in every program
(`NORM_SQUARES`): a 16-row CRQ sub-step 1,240 against 1,269 µs, the LLM's 36 layers 4,478 against 4,635, the whole
batch-16 step 10.33 against 10.86 ms (BENCHMARKS.md, 2026-12-04).
"""

import itertools
import logging
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .triton_attention_funaudiochat import check_arrival_counters, programmatic_launch, triton


logger = logging.getLogger(__name__)
if triton is not None:
    from triton.runtime.autotuner import OutOfResources  # where Triton's compiler takes it from
else:

    class OutOfResources(Exception):
        """Stands in for Triton's (CPU-only installs, where no kernel is launched)."""


# Input rows (batch x positions) up to which the kernels replace cuBLAS. Measured on an H200 (full-size CRQ sub-step,
# BENCHMARKS.md): 1,188 against 1,492 µs at one row, but 2,096 against 1,541 µs at two, where cuBLAS shares each
# weight read between the rows; this kernel reads the weights once per row (one row per program).
MAX_ROWS = 1
BLOCK_N = 8  # output columns per program
NUM_WARPS = 8
# Reduction elements per weight load (the loop over K is unrolled): 64 per thread and load. A gated program loads two
# weights and holds two product tiles: 512 for the CRQ's 1,024-wide inputs, 256 for wider ones (the LLM's gate/up took
# 53 µs at 256 against 77 µs at 512 on an H200; every other full-size shape was fastest or within 1 µs at 2,048).
MAX_BLOCK_K = 2048
MAX_BLOCK_K_GATED = 512
MAX_BLOCK_K_GATED_WIDE = 256
# The GEMV kernel's input norm folded into its products for inputs of up to this many features (the CRQ's q/k/v and
# gate/up): `sum_k x_k g_k w_nk` and `sum_k x_k^2` accumulate in one pass and the RMS scales the sums at the end, so
# no program waits for the norm's reduction before its first product (the normed input is not rounded to the model
# dtype there, as the eager layer rounds it: results within one more rounding). Measured on an H200 (BENCHMARKS.md,
# 2026-12-04, interleaved rounds): a one-row CRQ sub-step 647 against 667 µs; folded at every width the LLM's 36
# layers took 4,550 against 3,938 µs. 0: never folded (for comparisons).
GEMV_FOLDED_NORM_MAX_FEATURES = 1024
# A layer with its own q, k and v weights (the LLM) runs the three as one kernel (`part_weights`) instead of three.
# Measured on an H200 (BENCHMARKS.md, 2026-12-01 20:50–21:35): the LLM's 36 layers at batch 1, 4,031 against 4,204 µs
# (interleaved rounds). False: three kernels (for comparisons).
GROUPED_QKV = True
# 2 to ROWS_KERNEL_MAX_ROWS rows (the decode steps at batch 2-16, where the caller passes `split_k_counters`): the
# several-row kernel, `_decode_rows_kernel`. Each weight tile is read once for all rows (a 16-row `tl.dot`, rows past
# the batch masked) and the reduction is split over SPLIT_K programs per column tile.
# `(BLOCK_N, BLOCK_K, SPLIT_K, num_warps[, num_stages, swap_ab])` by `(out_features, in_features, gated)`: the fastest
# of 10-75 per shape at 16 rows on an H200, over the pipeline depth and SWAP_AB too (`python
# scripts/bench_decode_linear.py --sweep-rows-tiles CRQ,LLM --wide --jobs 14`, BENCHMARKS.md 2026-12-02 12:55), µs
# per call (tile before the sweep / torch compiled, i.e. cuBLAS with its norm / activation / residual kernels). The
# CRQ: q/k/v 6.24 (8.00 / 6.92), o_proj 3.43 (3.72 / 7.16), gate/up 7.12 with SWAP_AB (10.72 / 9.16), down_proj 5.21
# (5.39 / 9.48). The LLM: q, k and v (three weights) 18.48 with SWAP_AB (20.45 / 18.05 for one GEMM of their
# concatenation), o_proj 11.53 (12.26 / 15.55), gate/up (two weights) 56.94 (unchanged / 61.08), down_proj 27.36
# (27.98 / 31.74). Whole compiled 16-row decode steps, interleaved rounds: a CRQ sub-step 1,386 against 1,463 µs, the
# LLM's 36 layers 4,709 against 4,982 µs. Without the split (one program per column tile over the whole reduction),
# the 1,024-output projections had 64 programs at most, too few to stream their weights (2026-12-01 18:15–18:50).
# The CRQ's down_proj then took a tile whose every split is one 512-input chunk, which the kernel fetches before its
# wait (`--sweep-rows-tiles CRQ --prefetch`, BENCHMARKS.md 2026-12-02 15:15): 4.71 against 5.16 µs per call; a CRQ
# sub-step 1,351 against 1,378 µs. Such tiles were slower for the three other shapes. These tiles are for bfloat16
# on an H200: where one needs more shared memory than the GPU has (float32 doubles it: the CRQ's gate/up tile then
# takes 278,528 bytes, over the H200's 232,448; GPUs of 99 KB per program cannot hold the bfloat16 ones of up to
# 148 KB), the launcher takes the next of `smaller_rows_tiles` that fits.
ROWS_KERNEL_MAX_ROWS = 16
USE_ROWS_KERNEL = True  # False: batches of 2 to 16 rows keep cuBLAS (for comparisons)
MIN_ROWS_BLOCK_N = 16  # the narrowest column tile of the several-row kernel (tl.dot's least N)
ROWS_BLOCK_N, ROWS_BLOCK_K, ROWS_NUM_WARPS = 32, 128, 4
ROWS_NUM_STAGES = 3  # weight tiles in flight in the reduction loop (Triton's default) where a tile names none
# The several-row kernel's programs fetch their residual tile right after waiting for the previous kernel, not in
# the epilogue (with the reduction split, only the tile's last program adds it, after the others' partials: one L2
# round trip less on its path). Measured on an H200 (BENCHMARKS.md, 2026-12-02 15:15, compiled 16-row decode
# steps, interleaved rounds): a CRQ sub-step 1,376 against 1,391 µs, the LLM's 36 layers 4,684 against 4,694. False:
# read in the epilogue (for comparisons). Reading the first input tile with the norm's loads too (and the first
# norm-weight chunk before the wait), not after the norm's reduction, was slower (2026-12-03 19:10, 3 rounds): a CRQ
# sub-step at 16 rows 1,348 against 1,325 µs, the LLM's 36 layers 4,661 against 4,668.
ROWS_EARLY_RESIDUAL = True
# The several-row kernels of a layer's residual projections (o_proj, down_proj) also return their output rows' sums
# of squares by 16-column group (`launch_decode_linear(with_squares=True)`), which the next projection's input norm
# (post-attention, the next layer's input) adds up (`norm_squares`) instead of every program reading all 16 x K
# inputs (a 16-row program of the LLM read 128 KB for its norm before its first product). Measured on an H200
# (BENCHMARKS.md, 2026-12-04, interleaved rounds): a 16-row CRQ sub-step 1,240 against 1,269 µs, the LLM's 36 layers
# 4,478 against 4,635; whole batch-16 steps 10.33 against 10.86 ms. False: every program reads its rows (for
# comparisons).
NORM_SQUARES = True
SQUARES_GROUP = MIN_ROWS_BLOCK_N  # output columns per stored sum of squares: every column tile holds whole groups
ROWS_NORM_CHUNK_ELEMENTS = 8192  # input elements per load of the norm's pass over the rows (16 rows x 512)
ROWS_MIN_PROGRAMS = 128  # other shapes: SPLIT_K doubles (up to MAX_SPLIT_K) until the grid has this many programs
MAX_SPLIT_K = 8
ROWS_TUNED_TILES = {
    (4096, 1024, False): (128, 256, 4, 8, 4, False),  # CRQ q/k/v (fused)
    (1024, 2048, False): (64, 256, 8, 8, 2, False),  # CRQ o_proj
    (3072, 1024, True): (128, 256, 4, 8, 2, True),  # CRQ gate/up (fused)
    (1024, 3072, False): (32, 512, 6, 4, 2, False),  # CRQ down_proj: each split one chunk, fetched before the wait
    (6144, 4096, False): (128, 128, 2, 8, 4, True),  # LLM q, k and v (`part_weights`)
    (4096, 4096, False): (128, 128, 4, 8, 4, True),  # LLM o_proj
    (12288, 4096, True): (64, 128, 1, 8),  # LLM gate/up (two weights)
    (4096, 12288, False): (128, 128, 4, 8, 4, True),  # LLM down_proj
}
# `(BLOCK_N, BLOCK_K, num_warps)` of Fun-Audio-Chat-8B's projections, by `(out_features, in_features, gated)`; other
# shapes take the defaults above. The fastest of 11 tiles per shape on an H200 (`python
# scripts/bench_decode_linear.py --sweep-tiles`, BENCHMARKS.md 2026-12-01 13:20–14:00): narrower programs (2-4
# columns, 2-4 warps) for most shapes; with them a CRQ sub-step took 709 against 728 µs and the LLM's 36 layers 4,232
# against 4,335 µs (interleaved rounds).
TUNED_TILES = {
    (4096, 1024, False): (4, 1024, 4),  # CRQ q/k/v (fused)
    (1024, 2048, False): (4, 2048, 4),  # CRQ o_proj
    (3072, 1024, True): (4, 512, 2),  # CRQ gate/up (fused)
    (4096, 4096, False): (4, 2048, 8),  # LLM q_proj and o_proj
    (1024, 4096, False): (2, 2048, 4),  # LLM k_proj and v_proj
    (6144, 4096, False): (4, 2048, 8),  # LLM q, k and v in one kernel (`GROUPED_QKV`): q_proj's tile
    (12288, 4096, True): (4, 256, 2),  # LLM gate/up
    (4096, 12288, False): (8, 2048, 4),  # LLM down_proj (the CRQ's down_proj keeps the defaults)
    (6565, 4096, False): (2, 2048, 4),  # CRQ speech head (lm_head): 14.4 against 20.1 µs with the defaults
    # `fold_crq_matching` (BENCHMARKS.md, 2026-12-02 18:07): the folded speech head, padded (lm_head ∘
    # output_matching, the final norm folded in), 5.11 against 5.39 µs with the defaults; input_matching ∘
    # pre_matching, 11.26 against 12.69 µs
    (6568, 1024, False): (8, 512, 4),
    (5120, 4096, False): (4, 2048, 8),
}


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _load_weight_tile(weight_ptr, col, k, col_ok, k_ok, K: tl.constexpr, MASKED: tl.constexpr):
        """The `(BLOCK_N, BLOCK_K)` tile of a `(N, K)` weight at columns `col` and reduction indices `k`."""
        offsets = col[:, None] * K + k[None, :]
        if MASKED:
            return tl.load(weight_ptr + offsets, mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                           eviction_policy="evict_first")
        return tl.load(weight_ptr + offsets, eviction_policy="evict_first")

    @triton.jit
    def _decode_linear_kernel(
        x_ptr, weight_ptr, bias_ptr, up_weight_ptr, up_bias_ptr, norm_weight_ptr, residual_ptr, out_ptr,
        weight_1_ptr, bias_1_ptr, weight_2_ptr, bias_2_ptr,
        stride_x, stride_residual, stride_out,
        N: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr, PART_1: tl.constexpr = 0, PART_2: tl.constexpr = 0, FOLDED_NORM: tl.constexpr = False,
    ):  # fmt: skip
        """BLOCK_N output columns of row `program_id(1)`. x `(rows, K)`; weight (the gate's when GATED) and up weight
        `(N, K)`, biases `(N,)`; norm weight `(K,)`; residual / out `(rows, N)`.

        PART_1 > 0: the outputs are those of several weights side by side (the q, k and v projections of a layer that
        keeps its own weights): columns from PART_1 come from weight_1 / bias_1 `(PART_2 - PART_1, K)`, and with
        PART_2 > 0 those from PART_2 from weight_2 / bias_2; the first part's are `weight`'s. Part boundaries are
        multiples of BLOCK_N, so a program reads one part.

        The products are accumulated elementwise in a `(BLOCK_N, BLOCK_K)` tile over the unrolled reduction and summed
        once at the end: a sum per step would synchronise the warps (through shared memory) between the weight loads.
        With PDL (launched as a programmatic dependent launch) the first weight tiles and the norm weight's first
        chunk are fetched before waiting for the previous kernel of the stream, whose output (x, the residual) is
        only read after the wait; the residual right after it, with x, not after the reduction (the LLM's 36 layers
        at batch 1: 4,005 against 4,040 µs; a CRQ sub-step unchanged, 695 / 693).

        FOLDED_NORM: the norm in the same pass as the products, `rsqrt(mean(x^2) + eps) * sum_k x_k g_k w_nk` (not
        rounded to the model dtype before the products), instead of a pass over x for the RMS before them.
        """
        dtype = out_ptr.dtype.element_ty
        x_row = x_ptr + tl.program_id(1) * stride_x
        col = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        MASK_N: tl.constexpr = N % BLOCK_N != 0
        MASK_K: tl.constexpr = K % BLOCK_K != 0
        col_ok = col < N
        weight_col = col  # the column within this program's weight
        if PART_1 > 0:
            first_col = tl.program_id(0) * BLOCK_N
            if first_col >= PART_1:
                weight_ptr, bias_ptr, weight_col = weight_1_ptr, bias_1_ptr, col - PART_1
            if PART_2 > 0:
                if first_col >= PART_2:
                    weight_ptr, bias_ptr, weight_col = weight_2_ptr, bias_2_ptr, col - PART_2
        if PDL:  # weights are never written by a decode step: read them while the previous kernel finishes
            k = tl.arange(0, BLOCK_K)
            first_weight = _load_weight_tile(weight_ptr, weight_col, k, col_ok, k < K, K, MASK_N or MASK_K)
            if GATED:
                first_up_weight = _load_weight_tile(up_weight_ptr, col, k, col_ok, k < K, K, MASK_N or MASK_K)
            if HAS_NORM:  # a weight too: loaded after the norm's reduction, it would cost one more L2 round trip
                first_norm_weight = tl.load(norm_weight_ptr + k, mask=(k < K) if MASK_K else None,
                                            other=0.0 if MASK_K else None)  # fmt: skip
            tl.extra.cuda.gdc_wait()
        if HAS_RESIDUAL:  # an earlier kernel's output: fetched with x, not after the reduction
            residual = tl.load(residual_ptr + tl.program_id(1) * stride_residual + col, mask=col_ok, other=0.0)
        squares = tl.zeros([BLOCK_K], tl.float32)
        # Qwen3RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, rounded, times the weight, rounded (FOLDED_NORM: below)
        if HAS_NORM and not FOLDED_NORM:
            for k0 in tl.static_range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + k, mask=(k < K) if MASK_K else None, other=0.0 if MASK_K else None)
                squares += x.to(tl.float32) * x.to(tl.float32)
            inverse_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + EPS)
        products = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        up_products = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_row + k, mask=k_ok if MASK_K else None, other=0.0 if MASK_K else None)
            if HAS_NORM:
                if PDL and k0 == 0:
                    norm_weight = first_norm_weight
                else:
                    norm_weight = tl.load(norm_weight_ptr + k, mask=k_ok if MASK_K else None,
                                          other=0.0 if MASK_K else None)  # fmt: skip
                if FOLDED_NORM:  # x * weight now, times the inverse RMS after the reduction
                    squares += x.to(tl.float32) * x.to(tl.float32)
                    x = x.to(tl.float32) * norm_weight.to(tl.float32)
                else:
                    x = (x.to(tl.float32) * inverse_rms).to(dtype) * norm_weight
            x = x.to(tl.float32)[None, :]
            if PDL and k0 == 0:
                w = first_weight
            else:
                w = _load_weight_tile(weight_ptr, weight_col, k, col_ok, k_ok, K, MASK_N or MASK_K)
            products += x * w.to(tl.float32)
            if GATED:
                if PDL and k0 == 0:
                    w = first_up_weight
                else:
                    w = _load_weight_tile(up_weight_ptr, col, k, col_ok, k_ok, K, MASK_N or MASK_K)
                up_products += x * w.to(tl.float32)
        if PDL:  # the next kernel may start fetching its weights
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.sum(products, axis=1)
        if HAS_NORM and FOLDED_NORM:
            inverse_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + EPS)
            acc = acc * inverse_rms
        if HAS_BIAS:
            acc += tl.load(bias_ptr + weight_col, mask=col_ok, other=0.0).to(tl.float32)
        out = acc.to(dtype)
        if GATED:  # act_fn(gate) * up on the rounded GEMM outputs, the activation rounded first
            acc_up = tl.sum(up_products, axis=1)
            if HAS_NORM and FOLDED_NORM:
                acc_up = acc_up * inverse_rms
            if HAS_BIAS:
                acc_up += tl.load(up_bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
            gate = out.to(tl.float32)
            out = (gate * tl.sigmoid(gate)).to(dtype) * acc_up.to(dtype)
        if HAS_RESIDUAL:
            out += residual
        tl.store(out_ptr + tl.program_id(1) * stride_out + col, out.to(dtype), mask=col_ok)

    @triton.jit
    def _rows_input_tile(x_ptr, norm_weight_ptr, inverse_rms, row, row_ok, k, k_ok, stride_x,
                         HAS_NORM: tl.constexpr, MASK_K: tl.constexpr):  # fmt: skip
        """The `(BLOCK_M, BLOCK_K)` input tile, normed as Qwen3RMSNorm: rounded to the model dtype, times its weight."""
        x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:
            norm_weight = tl.load(norm_weight_ptr + k, mask=k_ok if MASK_K else None, other=0.0 if MASK_K else None)
            x = (x.to(tl.float32) * inverse_rms).to(x.dtype) * norm_weight[None, :]
        return x

    @triton.jit
    def _rows_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
        """A float32 accumulator of `_rows_dot`: `(BLOCK_N, BLOCK_M)` with SWAP_AB, else `(BLOCK_M, BLOCK_N)`."""
        if SWAP_AB:  # a constexpr branch: one shape is built (a return in each would be two return types)
            zeros = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            zeros = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        return zeros

    @triton.jit
    def _rows_dot(x, w, acc, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
        """`acc + x @ w^T` for a `(BLOCK_M, BLOCK_K)` input tile and a `(BLOCK_N, BLOCK_K)` weight tile; with SWAP_AB
        its transpose `acc + w @ x^T`, acc `(BLOCK_N, BLOCK_M)`."""
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _rows_epilogue(acc, acc_up, bias_ptr, up_bias_ptr, residual_ptr, out_ptr, squares_ptr, tile, row, row_ok, col,
                       weight_col, col_ok, stride_residual, stride_out, HAS_BIAS: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, residual, EARLY_RESIDUAL: tl.constexpr,
                       N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_SQUARES: tl.constexpr,
                       GROUP: tl.constexpr):  # fmt: skip
        """Bias, SiLU(gate) * up and residual, rounded as `_decode_linear_kernel` rounds them; stores the tile of
        output columns `col` (`weight_col` within the program's weight). EARLY_RESIDUAL: `residual` is the residual
        tile, loaded by the caller; else it is read here. STORE_SQUARES: also the float32 sums of squares of the
        stored (rounded) outputs by GROUP columns, in `squares` `(rows, cdiv(N, GROUP))` (columns past N are zeros)."""
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + weight_col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dtype)
        if GATED:
            if HAS_BIAS:
                acc_up += tl.load(up_bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            gate = out.to(tl.float32)
            out = (gate * tl.sigmoid(gate)).to(dtype) * acc_up.to(dtype)
        tile_ok = row_ok[:, None] & col_ok[None, :]
        if HAS_RESIDUAL:
            if not EARLY_RESIDUAL:
                residual = tl.load(residual_ptr + row[:, None] * stride_residual + col[None, :], mask=tile_ok,
                                   other=0.0)  # fmt: skip
            out += residual
        out = out.to(dtype)
        tl.store(out_ptr + row[:, None] * stride_out + col[None, :], out, mask=tile_ok)
        if STORE_SQUARES:
            GROUPS: tl.constexpr = BLOCK_N // GROUP
            squares = out.to(tl.float32)
            squares = tl.sum(tl.reshape(squares * squares, [BLOCK_M, GROUPS, GROUP]), axis=2)
            group = tile * GROUPS + tl.arange(0, GROUPS)
            stride: tl.constexpr = (N + GROUP - 1) // GROUP
            tl.store(squares_ptr + row[:, None] * stride + group[None, :], squares,
                     mask=row_ok[:, None] & (group < stride)[None, :])  # fmt: skip

    @triton.jit
    def _decode_rows_kernel(
        x_ptr, weight_ptr, bias_ptr, up_weight_ptr, up_bias_ptr, norm_weight_ptr, residual_ptr, out_ptr,
        partials_ptr, counters_ptr, weight_1_ptr, bias_1_ptr, weight_2_ptr, bias_2_ptr, norm_squares_ptr, squares_ptr,
        rows, stride_x, stride_residual, stride_out,
        N: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr, NORM_BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, PDL: tl.constexpr, PART_1: tl.constexpr = 0, PART_2: tl.constexpr = 0,
        NUM_STAGES: tl.constexpr = 3, SWAP_AB: tl.constexpr = False, EARLY_RESIDUAL: tl.constexpr = False,
        NORM_GROUPS: tl.constexpr = 0, NORM_GROUPS_BLOCK: tl.constexpr = 1, STORE_SQUARES: tl.constexpr = False,
        GROUP: tl.constexpr = 16,
    ):  # fmt: skip
        """Program (t, s): columns [t * BLOCK_N, (t + 1) * BLOCK_N) of all `rows` (<= BLOCK_M) over the reduction
        indices [s * K_SPLIT, (s + 1) * K_SPLIT) (a multiple of BLOCK_K; indices >= K masked), on tensor cores.

        x `(rows, K)`; weight (the gate's when GATED) and up weight `(N, K)`, biases `(N,)`; norm weight `(K,)`;
        residual / out `(rows, N)`; PART_1 / PART_2 and weight_1 / bias_1 / weight_2 / bias_2: several weights side
        by side, as in `_decode_linear_kernel`. SPLIT_K > 1: each program stores its float32 partial in
        `partials` `[tiles, SPLIT_K, 1 + GATED, BLOCK_M, BLOCK_N]` and counts itself in `counters[t]` (int32, zero on
        entry); the last of a tile's programs to arrive adds the partials in split order (the same sums every run),
        applies the epilogue and sets the counter back to zero, so a CUDA graph replays the kernel without a memset.

        The reduction loop is software-pipelined over NUM_STAGES weight tiles. SWAP_AB: each product is computed as
        `w @ x^T`, a `(BLOCK_N, BLOCK_M)` tile, so the weight's columns are the MMA's M side (Hopper's wgmma takes
        M >= 64 from shared memory) and the rows its N side, then transposed once for the epilogue.

        NORM_GROUPS > 0: the norm's sums of squares come from `norm_squares` `(rows, NORM_GROUPS)` float32 (the
        producer's STORE_SQUARES output: x's sums by GROUP columns), added in a fixed order, instead of from all of x.
        STORE_SQUARES: the epilogue also stores the output's (`_rows_epilogue`).
        """
        tile = tl.program_id(0)
        split = tl.program_id(1)
        MASK_N: tl.constexpr = N % BLOCK_N != 0
        MASK_K: tl.constexpr = K_SPLIT * SPLIT_K != K
        row = tl.arange(0, BLOCK_M)
        row_ok = row < rows
        col = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = col < N
        weight_col = col  # the column within this program's weight
        if PART_1 > 0:
            if tile * BLOCK_N >= PART_1:
                weight_ptr, bias_ptr, weight_col = weight_1_ptr, bias_1_ptr, col - PART_1
            if PART_2 > 0:
                if tile * BLOCK_N >= PART_2:
                    weight_ptr, bias_ptr, weight_col = weight_2_ptr, bias_2_ptr, col - PART_2
        k_start = split * K_SPLIT
        k = k_start + tl.arange(0, BLOCK_K)
        k_ok = k < K
        # The first weight tiles before the wait (as `_decode_linear_kernel`); x, the residual, the partials and the
        # counters only after it.
        w = _load_weight_tile(weight_ptr, weight_col, k, col_ok, k_ok, K, MASK_N or MASK_K)
        if GATED:
            w_up = _load_weight_tile(up_weight_ptr, col, k, col_ok, k_ok, K, MASK_N or MASK_K)
        if PDL:
            tl.extra.cuda.gdc_wait()
        # EARLY_RESIDUAL: every program fetches its residual tile (an earlier kernel's output) now, with x, so the
        # epilogue of the tile's last program does not wait for one more L2 round trip.
        residual = tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            if EARLY_RESIDUAL:
                residual = tl.load(residual_ptr + row[:, None] * stride_residual + col[None, :],
                                   mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        inverse_rms = tl.zeros([BLOCK_M, 1], tl.float32)
        if HAS_NORM:  # each program computes its rows' RMS over the whole K, not only its split's share
            if NORM_GROUPS > 0:  # the sums of squares by column group, stored by the kernel that wrote x
                group = tl.arange(0, NORM_GROUPS_BLOCK)
                squares = tl.load(norm_squares_ptr + row[:, None] * NORM_GROUPS + group[None, :],
                                  mask=row_ok[:, None] & (group < NORM_GROUPS)[None, :], other=0.0)  # fmt: skip
            else:
                # In wide chunks, unrolled: every load of the input in flight at once (one L2 round trip for K <= 4096).
                squares = tl.zeros([BLOCK_M, NORM_BLOCK_K], tl.float32)
                for k0 in tl.static_range(0, K, NORM_BLOCK_K):
                    kk = k0 + tl.arange(0, NORM_BLOCK_K)
                    xs = tl.load(x_ptr + row[:, None] * stride_x + kk[None, :],
                                 mask=row_ok[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)  # fmt: skip
                    squares += xs * xs
            inverse_rms = tl.rsqrt(tl.sum(squares, axis=1) / K + EPS)[:, None]
        x = _rows_input_tile(x_ptr, norm_weight_ptr, inverse_rms, row, row_ok, k, k_ok, stride_x, HAS_NORM, MASK_K)
        acc = _rows_dot(x, w, _rows_zeros(BLOCK_M, BLOCK_N, SWAP_AB), SWAP_AB, PRECISION)
        acc_up = _rows_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        if GATED:
            acc_up = _rows_dot(x, w_up, acc_up, SWAP_AB, PRECISION)
        for k0 in tl.range(BLOCK_K, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
            k = k_start + k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = _rows_input_tile(x_ptr, norm_weight_ptr, inverse_rms, row, row_ok, k, k_ok, stride_x, HAS_NORM, MASK_K)
            w = _load_weight_tile(weight_ptr, weight_col, k, col_ok, k_ok, K, MASK_N or MASK_K)
            acc = _rows_dot(x, w, acc, SWAP_AB, PRECISION)
            if GATED:
                w_up = _load_weight_tile(up_weight_ptr, col, k, col_ok, k_ok, K, MASK_N or MASK_K)
                acc_up = _rows_dot(x, w_up, acc_up, SWAP_AB, PRECISION)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if SWAP_AB:  # back to (BLOCK_M, BLOCK_N), the epilogue's and the partials' layout
            acc = tl.trans(acc)
            acc_up = tl.trans(acc_up)
        if SPLIT_K == 1:
            _rows_epilogue(acc, acc_up, bias_ptr, up_bias_ptr, residual_ptr, out_ptr, squares_ptr, tile, row, row_ok,
                           col, weight_col, col_ok, stride_residual, stride_out, HAS_BIAS, HAS_RESIDUAL, GATED,
                           residual, EARLY_RESIDUAL, N, BLOCK_M, BLOCK_N, STORE_SQUARES, GROUP)  # fmt: skip
        else:
            PARTS: tl.constexpr = 2 if GATED else 1
            TILE: tl.constexpr = BLOCK_M * BLOCK_N
            local = row[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            partial_ptr = partials_ptr + (tile * SPLIT_K + split) * (PARTS * TILE) + local
            tl.store(partial_ptr, acc)
            if GATED:
                tl.store(partial_ptr + TILE, acc_up)
            # Triton issues a scalar atomic from one thread: every thread's stores must precede it (a CTA barrier);
            # its gpu-scope release then makes them visible to the program that acquires the final count.
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the tile's last program
                tl.debug_barrier()  # every thread's loads below stay behind the acquiring atomic
                tile_ptr = partials_ptr + tile * SPLIT_K * (PARTS * TILE) + local
                acc = tl.load(tile_ptr, cache_modifier=".cg")  # .cg: from L2, never a stale L1 line
                if GATED:
                    acc_up = tl.load(tile_ptr + TILE, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    acc += tl.load(tile_ptr + s * (PARTS * TILE), cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(tile_ptr + s * (PARTS * TILE) + TILE, cache_modifier=".cg")
                _rows_epilogue(acc, acc_up, bias_ptr, up_bias_ptr, residual_ptr, out_ptr, squares_ptr, tile, row,
                               row_ok, col, weight_col, col_ok, stride_residual, stride_out, HAS_BIAS, HAS_RESIDUAL,
                               GATED, residual, EARLY_RESIDUAL, N, BLOCK_M, BLOCK_N, STORE_SQUARES, GROUP)  # fmt: skip
                # Zero again for the next launch, which touches the counters only after waiting for this grid.
                tl.store(counters_ptr + tile, 0)


def kernel_tile(out_features: int, in_features: int, gated: bool) -> tuple[int, int, int]:
    """`(BLOCK_N, BLOCK_K, num_warps)` of the kernel for a projection of this shape: `TUNED_TILES`, or the defaults."""
    if gated:
        block_k = MAX_BLOCK_K_GATED if in_features <= 1024 else MAX_BLOCK_K_GATED_WIDE
    else:
        block_k = MAX_BLOCK_K
    block_n, block_k, num_warps = TUNED_TILES.get((out_features, in_features, gated), (BLOCK_N, block_k, NUM_WARPS))
    return block_n, min(block_k, 1 << (in_features - 1).bit_length()), num_warps  # at most the next power of two


def rows_kernel_tile(out_features: int, in_features: int, gated: bool) -> tuple[int, int, int, int, int, bool]:
    """`(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, swap_ab)` of the several-row kernel for a projection of this
    shape: `ROWS_TUNED_TILES` (whose entries may leave out the last two: `ROWS_NUM_STAGES`, no swap), or a default tile
    whose reduction is split until the grid has `ROWS_MIN_PROGRAMS` programs."""
    widest_k = max(16, 1 << (in_features - 1).bit_length())  # tl.dot takes at least 16 along each dimension
    tile = ROWS_TUNED_TILES.get((out_features, in_features, gated))
    if tile is None:
        block_k = min(ROWS_BLOCK_K, widest_k)
        split_k, tiles = 1, triton.cdiv(out_features, ROWS_BLOCK_N)
        while split_k < MAX_SPLIT_K and tiles * split_k < ROWS_MIN_PROGRAMS and 2 * split_k * block_k <= in_features:
            split_k *= 2
        tile = (ROWS_BLOCK_N, block_k, split_k, ROWS_NUM_WARPS)
    block_n, block_k, split_k, num_warps, num_stages, swap_ab = (*tile, ROWS_NUM_STAGES, False)[:6]
    block_n, block_k = max(block_n, MIN_ROWS_BLOCK_N), min(block_k, widest_k)
    # At most one split per reduction chunk (a split past the reduction's end would only add zeros).
    split_k = max(1, min(split_k, triton.cdiv(in_features, block_k)))
    return block_n, block_k, split_k, num_warps, num_stages, bool(swap_ab)


def _pointer(tensor: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A kernel's tensor argument, or `placeholder` for one it never reads (its HAS_* / PART_* / SPLIT_K flag off)."""
    return placeholder if tensor is None else tensor


def _part_tile(block_n: int, part_ends: list[int], narrowest: int = 1) -> int | None:
    """`block_n` halved until every part boundary (`part_ends[:-1]`) is a multiple of it, so that a program reads one
    part; None where that takes fewer than `narrowest` columns."""
    while block_n > narrowest and any(end % block_n for end in part_ends[:-1]):
        block_n //= 2
    return None if any(end % block_n for end in part_ends[:-1]) else block_n


def _part_flags(part_ends: list[int]) -> dict:
    """The kernels' PART_1 / PART_2: the first output column of the second and third weight (0: no such part)."""
    part_1, part_2 = [*part_ends[:-1], 0, 0][:2]
    return {"PART_1": part_1, "PART_2": part_2}


def smaller_rows_tiles(tile: tuple[int, int, int, int, int, bool]):
    """The tiles `_launch_rows_kernel` tries, in order, after a `rows_kernel_tile` whose launch needs more shared
    memory than the GPU has (the tuned tiles are for bfloat16 on an H200: a float32 model doubles their buffers, and
    other GPUs have less per program): fewer pipeline stages (down to 1), then half the reduction chunk (down to 32),
    then half the columns (down to `MIN_ROWS_BLOCK_N`)."""
    block_n, block_k, split_k, num_warps, num_stages, swap_ab = tile
    while num_stages > 1:
        num_stages -= 1
        yield block_n, block_k, split_k, num_warps, num_stages, swap_ab
    while block_k > 32:
        block_k //= 2
        yield block_n, block_k, split_k, num_warps, num_stages, swap_ab
    while block_n > MIN_ROWS_BLOCK_N:
        block_n //= 2
        yield block_n, block_k, split_k, num_warps, num_stages, swap_ab


# The tile that launched, by (out_features, in_features, gated, dtype, device), where the first choice of
# `rows_kernel_tile` ran out of shared memory (`smaller_rows_tiles`): later launches take it directly.
_FITTED_ROWS_TILES: dict[tuple, tuple] = {}


def _launch_rows_kernel(
    x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated, counters,
    norm_squares=None, squares=None,
):  # fmt: skip
    """`launch_decode_linear` for 2 to `ROWS_KERNEL_MAX_ROWS` rows: `_decode_rows_kernel`, one launch (arguments as
    `launch_decode_linear` prepares them for either kernel; `squares`: None, or the `(rows, groups)` float32 buffer
    of the output's sums of squares). Returns None where a part boundary is not a multiple of the narrowest tile
    (`MIN_ROWS_BLOCK_N`). A tile the GPU cannot hold (Triton's `OutOfResources`, raised before anything is queued)
    gives way to the next of `smaller_rows_tiles`, remembered for the shape."""
    rows, in_features = x.shape
    out_features = part_ends[-1]
    key = (out_features, in_features, gated, x.dtype, x.device)
    tile = _FITTED_ROWS_TILES.get(key) or rows_kernel_tile(out_features, in_features, gated)
    for candidate in (tile, *smaller_rows_tiles(tile)):
        block_n = _part_tile(candidate[0], part_ends, MIN_ROWS_BLOCK_N)
        if block_n is None:  # only the widest tile can fail it: a narrower one divides the boundaries too
            return None
        try:
            out = _launch_rows_tile(
                (block_n, *candidate[1:]), x, weight, bias, up_weight, up_bias, part_ends, part_pointers,
                norm_weight, eps, residual, gated, counters, norm_squares, squares,
            )  # fmt: skip
        except OutOfResources as error:
            last_error = error
            continue
        if candidate != tile:
            _FITTED_ROWS_TILES[key] = candidate
            logger.info(f"decode_linear {out_features}x{in_features} ({x.dtype}): tile {tile} needs more shared "
                        f"memory than {x.device} has; using {candidate}.")  # fmt: skip
        return out
    raise last_error


def _launch_rows_tile(
    tile, x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated, counters,
    norm_squares=None, squares=None,
):  # fmt: skip
    """One launch of `_decode_rows_kernel` with `tile` `(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, swap_ab)`."""
    rows, in_features = x.shape
    out_features = part_ends[-1]
    block_n, block_k, split_k, num_warps, num_stages, swap_ab = tile
    tiles = triton.cdiv(out_features, block_n)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    partials = x  # a placeholder: one split needs neither partials nor counters
    if split_k > 1:
        check_arrival_counters(counters, tiles, x.device, "split_k_counters")
        partials = torch.empty(tiles * split_k * (2 if gated else 1) * ROWS_KERNEL_MAX_ROWS * block_n,
                               dtype=torch.float32, device=x.device)  # fmt: skip
    norm_groups = 0 if norm_squares is None else norm_squares.shape[1]
    pdl = programmatic_launch(x.device)
    _decode_rows_kernel[(tiles, split_k)](
        x, weight, *(_pointer(t, x) for t in (bias, up_weight, up_bias, norm_weight, residual)), out, partials,
        counters, *part_pointers, _pointer(norm_squares, x), _pointer(squares, x), rows, x.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0),
        N=out_features, K=in_features, EPS=float(eps), HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, GATED=gated, BLOCK_M=ROWS_KERNEL_MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, K_SPLIT=triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k,
        NORM_BLOCK_K=min(triton.next_power_of_2(in_features), ROWS_NORM_CHUNK_ELEMENTS // ROWS_KERNEL_MAX_ROWS),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl, **_part_flags(part_ends),
        NUM_STAGES=num_stages, SWAP_AB=swap_ab, EARLY_RESIDUAL=ROWS_EARLY_RESIDUAL, NORM_GROUPS=norm_groups,
        NORM_GROUPS_BLOCK=triton.next_power_of_2(max(norm_groups, 1)), STORE_SQUARES=squares is not None,
        GROUP=SQUARES_GROUP, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out


def squares_groups(features: int) -> int:
    """Columns of the sums of squares of `features`-wide rows: one per `SQUARES_GROUP` features, the last partial."""
    return -(-features // SQUARES_GROUP)


def row_squares(rows: torch.Tensor) -> torch.Tensor:
    """`(n, features)` -> `(n, squares_groups(features))` float32: each `SQUARES_GROUP` columns' sum of squares, the
    layout `launch_decode_linear(with_squares=True)` returns and `norm_squares` takes (here in PyTorch)."""
    features = rows.shape[-1]
    padded = nn.functional.pad(rows.float(), (0, squares_groups(features) * SQUARES_GROUP - features))
    return padded.square().view(rows.shape[0], -1, SQUARES_GROUP).sum(-1)


def launch_decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    up_weight: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    part_weights: list[torch.Tensor] | tuple = (),
    part_biases: list[torch.Tensor] | tuple = (),
    split_k_counters: torch.Tensor | None = None,
    norm_squares: torch.Tensor | None = None,
    with_squares: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`residual + act(linear(norm(x)))` for a few rows; the body of the `funaudiochat::decode_linear` operator.

    Args:
        x: `(rows, in_features)`, last dimension contiguous; a few rows (each row's programs read all the weights).
        weight: `(out_features, in_features)` contiguous. With `gated` and no `up_weight`, `(2 * out_features,
            in_features)`: the gate rows then the up rows (`FusedLayerProjections.gate_up_weight`).
        bias: None or `(weight.shape[0],)`.
        norm_weight: None, or the `(in_features,)` weight of a Qwen3 RMSNorm applied to x first (with `eps`).
        residual: None or `(rows, out_features)`, added to the output.
        gated: output `SiLU(x @ gate^T) * (x @ up^T)` (the Qwen3 MLP's activation) instead of the plain projection;
            `weight` / `bias` are the gate's.
        up_weight, up_bias: the up projection's `(out_features, in_features)` weight and bias when it is a tensor of
            its own (the LLM's layers), None when it is in `weight`.
        part_weights: up to two more `(out_i, in_features)` weights whose outputs follow `weight`'s in the output
            (a layer's own k and v projections after its q projection: one kernel instead of three). Not with `gated`.
        part_biases: their biases when `bias` is given (then one per part weight), else empty.
        split_k_counters: None, or int32 zeros (one per output column tile, `rows_kernel_tile`): with 2 to
            `ROWS_KERNEL_MAX_ROWS` rows the several-row kernel runs instead of the GEMV kernel (unless a part
            boundary is not a multiple of `MIN_ROWS_BLOCK_N` columns); its programs count their arrivals there and
            leave it zero. Not to be shared by launches that may run at the same time (another stream).
        norm_squares: None, or x's sums of squares `(rows, squares_groups(in_features))` float32 (`row_squares`'
            layout: what the launch that wrote x returned `with_squares`), for the norm: the several-row kernel then
            adds these up instead of reading all of x in every program. Needs `norm_weight`.
        with_squares: also return the output's `row_squares` (the several-row kernel stores them in its epilogue).
    Returns:
        `(rows, out_features)` in x's dtype (`out_features` summed over the parts); with `with_squares`, a tuple of
        it and its `(rows, squares_groups(out_features))` float32 sums of squares.
    """
    if len(part_weights) > 2 or (gated and part_weights):
        raise ValueError("`part_weights` takes at most two weights, and not with `gated`.")
    if len(part_biases) != (len(part_weights) if bias is not None else 0):
        raise ValueError("`part_biases` needs one bias per part weight exactly when `bias` is given.")
    # The kernel walks rows by their stride, with unit strides within a row, and reads weights as contiguous matrices.
    x, residual = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (x, residual))
    weight, up_weight = (t if t is None or t.is_contiguous() else t.contiguous() for t in (weight, up_weight))
    part_weights = [t if t.is_contiguous() else t.contiguous() for t in part_weights]
    rows, in_features = x.shape
    if any(part.shape[1] != in_features for part in part_weights):
        raise ValueError(f"Every part weight must take the {in_features} input features of `x`.")
    if norm_squares is not None:
        _check_norm_squares(norm_squares, norm_weight, rows, in_features)
    if gated and up_weight is None:  # views of the fused copy: its two halves are contiguous
        out_features = weight.shape[0] // 2
        weight, up_weight = weight[:out_features], weight[out_features:]
        if bias is not None:
            bias, up_bias = bias[:out_features], bias[out_features:]
    part_ends = list(itertools.accumulate(t.shape[0] for t in (weight, *part_weights)))
    out_features = part_ends[-1]
    parts = [*itertools.zip_longest(part_weights, part_biases), (None, None), (None, None)][:2]
    part_pointers = [_pointer(t, x) for part in parts for t in part]  # weight_1, bias_1, weight_2, bias_2
    if split_k_counters is not None and 1 < rows <= ROWS_KERNEL_MAX_ROWS:
        squares = None
        if with_squares:
            squares = torch.empty(rows, squares_groups(out_features), dtype=torch.float32, device=x.device)
        out = _launch_rows_kernel(
            x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated,
            split_k_counters, norm_squares, squares,
        )  # fmt: skip
        if out is not None:
            return (out, squares) if with_squares else out
    # The GEMV kernel: each program reads its row whole, and computes the norm from it.
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = kernel_tile(out_features, in_features, gated)
    block_n = _part_tile(block_n, part_ends)
    pdl = programmatic_launch(x.device)
    _decode_linear_kernel[(triton.cdiv(out_features, block_n), rows)](
        x, weight, *(_pointer(t, x) for t in (bias, up_weight, up_bias, norm_weight, residual)), out,
        *part_pointers, x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        N=out_features, K=in_features, EPS=float(eps), HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
        **_part_flags(part_ends), FOLDED_NORM=in_features <= GEMV_FOLDED_NORM_MAX_FEATURES,
        num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return (out, row_squares(out)) if with_squares else out


def _check_norm_squares(norm_squares: torch.Tensor, norm_weight: torch.Tensor | None, rows: int, in_features: int):
    """`launch_decode_linear`'s `norm_squares` argument: for a normed input, of `row_squares`' layout."""
    if norm_weight is None:
        raise ValueError("`norm_squares` are the sums of squares of a normed input: give `norm_weight` too.")
    expected = (rows, squares_groups(in_features))
    if tuple(norm_squares.shape) != expected or norm_squares.dtype != torch.float32:
        raise ValueError(
            f"`norm_squares` must be float32 of shape {expected} (the sums of squares of x's {in_features} features "
            f"by {SQUARES_GROUP}), got {norm_squares.dtype} {tuple(norm_squares.shape)}."
        )
    if not norm_squares.is_contiguous():
        raise ValueError("`norm_squares` must be contiguous.")


def _fake_output(x, weight, gated, up_weight, part_weights) -> torch.Tensor:
    """The `(rows, out_features)` output of `launch_decode_linear` as a fake (meta) tensor."""
    out_features = weight.shape[0] // 2 if gated and up_weight is None else weight.shape[0]
    return x.new_empty(x.shape[0], out_features + sum(part.shape[0] for part in part_weights))


# The operators' bodies (`launch_decode_linear` looked up at each call).
def _decode_linear(*args) -> torch.Tensor:
    return launch_decode_linear(*args)


def _decode_linear_and_squares(*args) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_decode_linear(*args, with_squares=True)


# The operators' arguments: `launch_decode_linear`'s but `with_squares`, which picks the operator.
_OPERATOR_ARGUMENTS = (
    "(Tensor x, Tensor weight, Tensor? bias, Tensor? norm_weight, float eps, Tensor? residual, bool gated, "
    "Tensor? up_weight, Tensor? up_bias, Tensor[] part_weights, Tensor[] part_biases, Tensor? split_k_counters, "
    "Tensor? norm_squares=None)"
)
if triton is not None:
    # Opaque operators (not `triton_op`): torch.compile's own launches of traced Triton kernels cannot ask for a
    # programmatic dependent launch; with CUDA graphs (the compiled loop's default) the launcher's host code only
    # runs while recording. `split_k_counters` is written while the kernels run but left as it was found (zeros):
    # not a mutation.
    _decode_linear_op = torch.library.custom_op(
        "funaudiochat::decode_linear", _decode_linear, mutates_args=(), schema=f"{_OPERATOR_ARGUMENTS} -> Tensor"
    )
    _decode_linear_and_squares_op = torch.library.custom_op(
        "funaudiochat::decode_linear_and_squares", _decode_linear_and_squares, mutates_args=(),
        schema=f"{_OPERATOR_ARGUMENTS} -> (Tensor, Tensor)",
    )  # fmt: skip

    @_decode_linear_op.register_fake
    def _(x, weight, bias, norm_weight, eps, residual, gated, up_weight, up_bias, part_weights, *rest):
        return _fake_output(x, weight, gated, up_weight, part_weights)

    @_decode_linear_and_squares_op.register_fake
    def _(x, weight, bias, norm_weight, eps, residual, gated, up_weight, up_bias, part_weights, *rest):
        out = _fake_output(x, weight, gated, up_weight, part_weights)
        return out, x.new_empty(x.shape[0], squares_groups(out.shape[1]), dtype=torch.float32)


def kernel_readable(linears, norms=()) -> bool:
    """Whether the kernels can read these modules as they are: plain `nn.Linear`s (not LoRA-wrapped or quantized: the
    kernels read `weight` as it is) with contiguous weights (else they would be copied on every call), and RMSNorms
    with a weight and `variance_epsilon`."""
    if any(type(linear) is not nn.Linear or not linear.weight.is_contiguous() for linear in linears):
        return False
    return all(hasattr(norm, "variance_epsilon") and getattr(norm, "weight", None) is not None for norm in norms)


def decode_kernels_supported(stack: nn.Module) -> bool:
    """Whether the layers of a Qwen3 stack can run their decode projections through the kernels: a SiLU MLP, and
    projections and RMSNorms (also the q / k norms, see `triton_attention_inputs_funaudiochat`) the kernels can read
    ([`kernel_readable`])."""
    if getattr(stack.config, "hidden_act", None) != "silu":
        return False
    for layer in stack.layers[: stack.config.num_hidden_layers]:
        attention, mlp = layer.self_attn, layer.mlp
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        linears = (*linears, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm)
        if not kernel_readable(linears, norms):
            return False
    return True


@dataclass(frozen=True)
class OwnWeightLayer:
    """`decoder_stack_forward` projections of one layer that runs its decode steps through the kernels with its own
    q/k/v and gate/up weights (the LLM: fused copies of an 8B model's weights would cost ~9 GB)."""

    decode_kernels: bool = True
    qkv_weight: None = None  # None: the layer's own projections, no fused copy
    gate_up_weight: None = None


@dataclass(frozen=True)
class OwnWeightKernels:
    """Per-layer [`OwnWeightLayer`]s of a stack, the `projections` argument of `decoder_stack_forward`."""

    layers: tuple[OwnWeightLayer, ...]


_OWN_WEIGHT_KERNELS: "weakref.WeakKeyDictionary[nn.Module, OwnWeightKernels]" = weakref.WeakKeyDictionary()


def own_weight_kernels(stack: nn.Module) -> OwnWeightKernels:
    """The [`OwnWeightKernels`] of a Qwen3 stack: one object per stack (a compiled step guards on it)."""
    kernels = _OWN_WEIGHT_KERNELS.get(stack)
    if kernels is None:
        kernels = OwnWeightKernels(layers=(OwnWeightLayer(),) * stack.config.num_hidden_layers)
        _OWN_WEIGHT_KERNELS[stack] = kernels
    return kernels


def use_decode_kernels(hidden_states: torch.Tensor) -> bool:
    """Whether a `(batch, n, features)` layer input takes the kernels: a CUDA tensor of at most `MAX_ROWS` rows, Triton
    installed (shape and device only, so the choice is a constant of a compiled graph; the run checked the GPU with
    `triton_available`)."""
    rows = hidden_states.numel() // hidden_states.shape[-1]
    return triton is not None and hidden_states.is_cuda and rows <= MAX_ROWS


def split_k_counters_for(stack_configs, device: torch.device | str, batch_size: int = 1) -> torch.Tensor:
    """int32 zeros enough for the several-row kernel over the projections of the Qwen3 stacks of `stack_configs` (a
    config, or a sequence of them: one tensor serves each stack in turn), one per column tile of the widest
    projection (q/k/v together, gate/up), and for the decode attention's arrivals at `batch_size` rows (one per row
    and KV head, and one more: `triton_attention_funaudiochat.launch_decode_attention(counters=...)`), for
    `decoder_stack_forward(split_k_counters=...)`."""
    configs = stack_configs if isinstance(stack_configs, (list, tuple)) else [stack_configs]
    size = 0
    for config in configs:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
        widest = max(qkv, config.intermediate_size, config.hidden_size)
        size = max(size, -(-widest // MIN_ROWS_BLOCK_N), batch_size * config.num_key_value_heads + 1)
    return torch.zeros(size, dtype=torch.int32, device=device)


def use_rows_kernel(hidden_states: torch.Tensor) -> bool:
    """Whether a `(batch, n, features)` layer input can take the several-row kernel (given `split_k_counters`): a
    decode step (one position per row) on CUDA of 2 to `ROWS_KERNEL_MAX_ROWS` rows, Triton installed."""
    rows = hidden_states.numel() // hidden_states.shape[-1]
    one_position = hidden_states.ndim < 3 or hidden_states.shape[-2] == 1
    several = 1 < rows <= ROWS_KERNEL_MAX_ROWS
    return USE_ROWS_KERNEL and triton is not None and hidden_states.is_cuda and one_position and several


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: nn.Module | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    up: nn.Linear | None = None,
    parts: tuple[nn.Linear, ...] = (),
    split_k_counters: torch.Tensor | None = None,
    norm_squares: torch.Tensor | None = None,
    with_squares: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`(..., in_features)` -> `(..., out_features)`: `residual + act(linear(norm(x)))` through the operator.

    `norm` is a Qwen3 RMSNorm module (its weight and `variance_epsilon` are used); `gated` as in
    [`launch_decode_linear`], with `up` the up projection when it is not part of `weight`; `parts`: up to two more
    linears of the same input whose outputs follow (`launch_decode_linear`'s `part_weights`); `split_k_counters`: for
    2 to `ROWS_KERNEL_MAX_ROWS` rows, the several-row kernel's counters (see `launch_decode_linear`). `with_squares`:
    also return the output rows' `(rows, groups)` sums of squares, which a next call whose `norm` reads this output
    takes as `norm_squares` (`funaudiochat::decode_linear_and_squares`)."""
    shape = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    flat_residual = None if residual is None else residual.reshape(rows.shape[0], -1)
    operators = torch.ops.funaudiochat
    operator = operators.decode_linear_and_squares if with_squares else operators.decode_linear
    result = operator(
        rows,
        weight,
        bias,
        None if norm is None else norm.weight,
        1e-6 if norm is None else float(norm.variance_epsilon),
        flat_residual,
        gated,
        None if up is None else up.weight,
        None if up is None else up.bias,
        [part.weight for part in parts],
        [] if bias is None else [part.bias for part in parts],
        split_k_counters,
        norm_squares,
    )
    out, squares = result if with_squares else (result, None)
    out = out.view(*shape, out.shape[-1])
    return (out, squares) if with_squares else out


__all__ = [
    "MAX_ROWS",
    "OwnWeightKernels",
    "decode_kernels_supported",
    "decode_linear",
    "kernel_readable",
    "kernel_tile",
    "launch_decode_linear",
    "own_weight_kernels",
    "row_squares",
    "rows_kernel_tile",
    "smaller_rows_tiles",
    "split_k_counters_for",
    "squares_groups",
    "use_decode_kernels",
    "use_rows_kernel",
]
