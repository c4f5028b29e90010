"""One-query GQA attention over a static KV cache as two Triton kernels (split-KV "flash decoding").

The plan part `triton_attention` of the fast backends ("cuda_graphs", "compiled") on CUDA when Triton is installed.
Each decode step attends one query position per row to the whole static cache of every LLM and CRQ layer. The matmul
version (`attention_funaudiochat.gqa_decode_attention`) costs three kernels per call (scores GEMM, masked softmax,
probabilities GEMM) and reads every cache position, used or not. Here:

- `_split_kernel`, grid `(batch * kv_heads, splits)`: each program takes the `groups` query heads of one KV head as
  the rows of a small matrix, walks its share of the cache in blocks of `BLOCK_N` positions with an online softmax,
  and skips blocks the mask hides entirely (the unused tail of a static cache, a row's left padding) without
  reading their keys or values. The blocks are dealt to the splits in turn (split s takes blocks s, s + splits,
  ...), so the used prefix of a static cache is every split's work, not the first splits'. It writes a partial
  (max, sum, weighted values) per head and split.
- `_combine_kernel`, grid `(batch * kv_heads, groups)`: merges the splits of one head (unless the splits' last
  program did, given arrival counters).

A decode step over a static cache on CUDA (`triton_attention_inputs_funaudiochat.decode_attention_with_inputs`, at
any batch size) also hands the kernels the work between the q/k/v projections and the attention (`AttentionInputs`):
each split program norms and rotates its heads' queries, the split that reads the new position's block first writes
the new key and value there, and the merge advances the cache length: no kernel of its own for that work. The splits
then know the new position and loop over their blocks up to it only, software-pipelined, so a step costs the same
whatever the cache's unused tail; the loop takes its blocks' mask from registers (one load of all of the split's mask
bytes before the loop, `MAX_MASK_BLOCKS`), so the copies of a block's keys and values wait for no memory read in the
loop. Every read that waits only for the previous kernels is issued right after the kernel's wait, before any
arithmetic (CPU tests check the order in the sm_90 PTX). Given a decode step's arrival counters, the last split of
each (row, KV head) merges the others and the merge kernel is not launched, where that program's serial merge is
small (`DecodeKernelConfig.attention_max_merge_parts`).

Splitting the cache gives enough programs to fill the GPU at batch 1 (8 KV heads alone would leave most
multiprocessors idle). The scores are accumulated in float32 from the cache's dtype, softmax in float32 and the
probabilities are cast to the value dtype for the second product, as SDPA and `gqa_decode_attention` do. A row that
sees no position gets zeros (never the case when decoding: a position sees itself).

The launcher is an opaque PyTorch operator (`torch.library.custom_op`) that `torch.compile` keeps in its graph and
CUDA graphs replay; its host code only depends on shapes and the [`DecodeKernelConfig`] values it is handed (the
operators' `launch` argument), so it adds no sync. It is opaque rather than a traced `triton_op` because
torch.compile launches traced kernels itself, and those launches cannot be programmatic dependent launches, which let
a kernel start while the previous one finishes.
"""

import math
from typing import NamedTuple

import torch

from .attention_funaudiochat import gqa_decode_attention
from .triton_config_funaudiochat import DecodeKernelConfig
from .triton_support import triton




TRITON_DECODE_ATTENTION = "funaudiochat_triton_decode"
BLOCK_N = 64  # cache positions per block (and per skip decision); a block's mask is one 64-bit word
MAX_SPLITS = 64
# The most blocks of one split whose mask bytes the pipelined loop holds in registers (one bit per position); a split
# of more blocks loads each block's mask in the loop.
MAX_MASK_BLOCKS = 64


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _load_heads(row_ptr, heads, NUM_HEADS: tl.constexpr, d, d_ok, partner, HEAD_DIM: tl.constexpr):
        """`(x, x_partner)`, each `(BLOCK_H, BLOCK_D)`: the `heads` of one row of projections, and the same features
        at the `partner` indices (rotate_half's source)."""
        mask = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
        offsets = heads[:, None] * HEAD_DIM
        x = tl.load(row_ptr + offsets + d[None, :], mask=mask, other=0.0)
        return x, tl.load(row_ptr + offsets + partner[None, :], mask=mask, other=0.0)

    @triton.jit
    def _normed_and_rotated(x, x_partner, first_half, weight, partner_weight, cos, sin, HEAD_DIM: tl.constexpr,
                            EPS: tl.constexpr):  # fmt: skip
        """Qwen3RMSNorm then the rotary embedding of `_load_heads`' tiles, rounded as the eager layer rounds: the
        norm's output in the model dtype, then times its weight; the rotary's two products and their sum each in the
        model dtype. On a GPU ~13-17 % of the bfloat16 outputs are one unit apart from the eager layer's (H100), as if
        the rotary's sum were rounded once: the compiler contracts a product into the sum (rounding each product
        explicitly through float32 changed none of them)."""
        dtype = x.dtype
        x = x.to(tl.float32)
        inverse_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + EPS)[:, None]
        normed = (x * inverse_rms).to(dtype) * weight[None, :]
        normed_partner = (x_partner.to(tl.float32) * inverse_rms).to(dtype) * partner_weight[None, :]
        rotated = tl.where(first_half[None, :], -normed_partner, normed_partner)
        return normed * cos[None, :] + rotated * sin[None, :]

    @triton.jit
    def _norm_and_rotate(
        row_ptr, heads, NUM_HEADS: tl.constexpr, d, d_ok, partner, first_half, weight, partner_weight, cos, sin,
        HEAD_DIM: tl.constexpr, EPS: tl.constexpr,
    ):  # fmt: skip
        """`(BLOCK_H, BLOCK_D)`: `_load_heads` then `_normed_and_rotated`."""
        x, x_partner = _load_heads(row_ptr, heads, NUM_HEADS, d, d_ok, partner, HEAD_DIM)
        return _normed_and_rotated(x, x_partner, first_half, weight, partner_weight, cos, sin, HEAD_DIM, EPS)

    @triton.jit
    def _load_new_key_and_value(new_k_ptr, new_v_ptr, k_norm_ptr, row, d, d_ok, partner, new_d, new_first,
                                HEAD_DIM: tl.constexpr):  # fmt: skip
        """`(key, key_partner, k_weight, k_partner_weight, value)`: a KV head's new key (`_load_heads`' tiles, `row`
        the `(2,)` tile rows, the head in the first), the k norm's weight at `d` and at `partner`, and its new value
        `(2, BLOCK_D)` (first row)."""
        key, key_partner = _load_heads(new_k_ptr, row, 1, d, d_ok, partner, HEAD_DIM)
        k_weight = tl.load(k_norm_ptr + d, mask=d_ok, other=0.0)
        k_partner_weight = tl.load(k_norm_ptr + partner, mask=d_ok, other=0.0)
        return key, key_partner, k_weight, k_partner_weight, tl.load(new_v_ptr + new_d, mask=new_first)

    @triton.jit
    def _visible_positions(
        mask_row_ptr, block, split, kv_len, position, stride_mn,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_MASK: tl.constexpr, PREPARE: tl.constexpr,
    ):  # fmt: skip
        """`(n, valid)`: the cache positions of the split's `block`-th block (blocks are dealt to the splits in turn,
        so the used prefix of a static cache is every split's work, not the first splits') and whether the row sees
        them: inside the cache, not past the new position (PREPARE: nothing after it is written), not masked."""
        n = (block * NUM_SPLITS + split) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = n < kv_len
        if PREPARE:
            valid = valid & (n <= position)
        if HAS_MASK:
            valid = valid & (tl.load(mask_row_ptr + n * stride_mn, mask=valid, other=0) != 0)
        return n, valid

    @triton.jit
    def _split_mask_tile(
        mask_row_ptr, split, kv_len, stride_mn,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, MASK_BLOCKS: tl.constexpr,
    ):  # fmt: skip
        """`(MASK_BLOCKS, BLOCK_N)` boolean: entry (j, i) the mask at the split's j-th block's i-th position, for the
        blocks j < SPLIT_BLOCKS inside the cache (MASK_BLOCKS: a power of two at least SPLIT_BLOCKS). All of the
        split's mask bytes in one load that waits for no other (not for the cache length)."""
        split_block = tl.arange(0, MASK_BLOCKS)
        n = (split_block[:, None] * NUM_SPLITS + split) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        inside = (n < kv_len) & (split_block < SPLIT_BLOCKS)[:, None]
        return tl.load(mask_row_ptr + n * stride_mn, mask=inside, other=0) != 0

    @triton.jit
    def _split_mask_bits(mask_tile, split, position, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         MASK_BLOCKS: tl.constexpr):  # fmt: skip
        """`(MASK_BLOCKS,)` int64: bit i of entry j set where `_split_mask_tile`'s entry (j, i) is set and the position
        is not past the new one (`position`; BLOCK_N <= 64)."""
        offset = tl.arange(0, BLOCK_N)
        n = (tl.arange(0, MASK_BLOCKS)[:, None] * NUM_SPLITS + split) * BLOCK_N + offset[None, :]
        visible = mask_tile & (n <= position)
        # Distinct bits: their sum is their union.
        return tl.sum(visible.to(tl.int64) << offset.to(tl.int64)[None, :], axis=1)

    @triton.jit
    def _visible_from_bits(bits, block, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           MASK_BLOCKS: tl.constexpr):  # fmt: skip
        """`(n, valid)` of the split's `block`-th block, as `_visible_positions`, from `_split_mask_bits` (no load: the
        copies of the block's keys and values, which `valid` predicates, wait for no memory read in the loop)."""
        offset = tl.arange(0, BLOCK_N)
        n = (block * NUM_SPLITS + split) * BLOCK_N + offset
        word = tl.sum(tl.where(tl.arange(0, MASK_BLOCKS) == block, bits, 0), axis=0)
        return n, ((word >> offset.to(tl.int64)) & 1) != 0

    @triton.jit
    def _attend_block(
        q, k_base, v_base, n, valid, scaling, stride_kn, stride_kd, stride_vn, stride_vd, d, d_ok,
        row_max, row_sum, acc, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """The online softmax's update `(row_max, row_sum, acc)` by the cache positions `n` the row sees (`valid`):
        only their keys and values are read, and a block with none of them adds nothing."""
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * stride_kn + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        # The values with the keys, before the scores need them: one DRAM round trip per block, not two.
        v = tl.load(v_base + n[:, None] * stride_vn + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        # `.to`: under torch.compile a Python float argument may arrive as a float64 constant.
        scores = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling).to(tl.float32)  # (G, N)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: exp(-inf) = 0, not NaN
        correction = tl.exp(row_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        return new_max, row_sum, acc

    @triton.jit
    def _merged_head(part_acc_ptr, part_max_ptr, part_sum_ptr, batch_head, g, NUM_SPLITS: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
        """The attention output `(BLOCK_D,)` float32 of query head `g` of `batch_head`: its splits' partial results
        merged. The partial sums are loaded with the maxima and sums, not after their reductions (whose barriers no
        load crosses): one round trip. CACHE: the loads' cache modifier (".cg" for partials stored by the same grid)."""
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_ok = s < NUM_SPLITS
        part = (batch_head * NUM_SPLITS + s) * BLOCK_G + g
        split_max = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"), cache_modifier=CACHE)
        split_sum = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0, cache_modifier=CACHE)
        acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0,
                      cache_modifier=CACHE)  # fmt: skip
        head_max = tl.max(split_max, axis=0)
        # Splits that saw nothing have max -inf: weight 0. If no split saw anything, keep the weights finite.
        head_max = tl.where(head_max == float("-inf"), 0.0, head_max)
        weight = tl.exp(split_max - head_max)
        total = tl.sum(weight * split_sum, axis=0)
        return tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        new_k_ptr, new_v_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, length_ptr,
        kv_len, scaling,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_mb, stride_mn,
        stride_new_k, stride_new_v, stride_cos, stride_sin,
        KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_BLOCKS: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr, PREPARE: tl.constexpr, Q_EPS: tl.constexpr, K_EPS: tl.constexpr,
        PIPELINED: tl.constexpr = False, NUM_STAGES: tl.constexpr = 2, MASK_BLOCKS: tl.constexpr = 0,
        out_ptr=None, counters_ptr=None, stride_ob=0, stride_oh=0, stride_od=0,
        MERGE: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
    ):  # fmt: skip
        """MERGE: each program counts itself in `counters[batch_head]` (int32, zero on entry) once its partial
        results are stored, and the last split of a (row, KV head) to arrive merges them into `out` `(batch, 1, heads,
        head_dim)` (the merge kernel's work) and sets its counter back to zero; with PREPARE, the last (row, KV head)
        to finish (`counters[num_programs(0)]`) also advances the cache length.

        PREPARE: q is the projected queries `(batch, heads * HEAD_DIM)` (row stride `stride_qb`), normed and rotated
        here; the split whose blocks hold the cache position `*length_ptr` first writes there its KV head's new key
        (normed, rotated) and value, from `new_k` / `new_v` `(batch, kv_heads * HEAD_DIM)`. The merge kernel (with
        MERGE, the last head to finish) then advances the length. PIPELINED (with PREPARE, on a GPU): the loop over the blocks up to that position,
        software-pipelined over NUM_STAGES blocks, instead of testing each block of the cache."""
        if PDL:  # a programmatic dependent launch: the query and the cache are the previous kernels' output
            tl.extra.cuda.gdc_wait()
        batch_head = tl.program_id(0)
        split = tl.program_id(1)
        b = batch_head // KV_HEADS
        h = batch_head % KV_HEADS
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUPS
        d_ok = d < HEAD_DIM
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        position = 0  # the new position's index (PREPARE)
        mask_row_ptr = mask_ptr + b * stride_mb
        mask_tile = tl.zeros([max(MASK_BLOCKS, 1), BLOCK_N], tl.int1)  # PIPELINED with MASK_BLOCKS: the split's mask
        if PREPARE:
            partner = (d + HEAD_DIM // 2) % HEAD_DIM
            first_half = d < HEAD_DIM // 2
            new_row = tl.arange(0, 2)  # the new key's KV head as the first row of a (2, BLOCK_D) tile
            new_first = (new_row < 1)[:, None] & d_ok[None, :]
            new_d = new_row[:, None] * 0 + d[None, :]  # the feature index over that tile
            new_k_row = new_k_ptr + b * stride_new_k + h * HEAD_DIM  # this KV head's new key and value
            new_v_row = new_v_ptr + b * stride_new_v + h * HEAD_DIM
            # Every read that waits for nothing but the previous kernels, issued at once, before any arithmetic (the
            # query's norm ends in barriers, which no load crosses): the cache length, the split's mask bytes, the
            # new key and value and the key's norm weight (read by every split, for the one that writes them), then
            # the query's reads below.
            position = tl.load(length_ptr)
            if PIPELINED:
                if MASK_BLOCKS > 0:
                    mask_tile = _split_mask_tile(
                        mask_row_ptr, split, kv_len, stride_mn, BLOCK_N, NUM_SPLITS, SPLIT_BLOCKS, MASK_BLOCKS
                    )
            new_key, new_key_partner, k_weight, k_partner_weight, value = _load_new_key_and_value(
                new_k_row, new_v_row, k_norm_ptr, new_row, d, d_ok, partner, new_d, new_first, HEAD_DIM
            )
            cos = tl.load(cos_ptr + b * stride_cos + d, mask=d_ok, other=0.0)
            sin = tl.load(sin_ptr + b * stride_sin + d, mask=d_ok, other=0.0)
            q_weight = tl.load(q_norm_ptr + d, mask=d_ok, other=0.0)
            q_partner_weight = tl.load(q_norm_ptr + partner, mask=d_ok, other=0.0)
            q = _norm_and_rotate(
                q_ptr + b * stride_qb + h * GROUPS * HEAD_DIM, g, GROUPS, d, d_ok, partner, first_half, q_weight,
                q_partner_weight, cos, sin, HEAD_DIM, Q_EPS,
            )  # fmt: skip
            if (position // BLOCK_N) % NUM_SPLITS == split:  # the split that reads the new position's block
                key = _normed_and_rotated(
                    new_key, new_key_partner, first_half, k_weight, k_partner_weight, cos, sin, HEAD_DIM, K_EPS
                )
                tl.store(k_base + position * stride_kn + new_d * stride_kd, key, mask=new_first)
                tl.store(v_base + position * stride_vn + new_d * stride_vd, value, mask=new_first)
                tl.debug_barrier()  # the block's loads below, by all the program's threads, see the new position
        else:
            q = tl.load(
                q_ptr + b * stride_qb + (h * GROUPS + g)[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
        row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if PIPELINED:
            # The split's blocks among 0 .. position // BLOCK_N (at least 0: split < NUM_SPLITS), software-pipelined.
            blocks = tl.minimum((position // BLOCK_N - split + NUM_SPLITS) // NUM_SPLITS, SPLIT_BLOCKS)
            bits = tl.zeros([max(MASK_BLOCKS, 1)], tl.int64)
            if MASK_BLOCKS > 0:
                bits = _split_mask_bits(mask_tile, split, position, BLOCK_N, NUM_SPLITS, MASK_BLOCKS)
            for block in tl.range(0, blocks, num_stages=NUM_STAGES):
                if MASK_BLOCKS > 0:
                    n, valid = _visible_from_bits(bits, block, split, BLOCK_N, NUM_SPLITS, MASK_BLOCKS)
                else:
                    n, valid = _visible_positions(
                        mask_row_ptr, block, split, kv_len, position, stride_mn, BLOCK_N, NUM_SPLITS, HAS_MASK,
                        PREPARE,
                    )  # fmt: skip
                row_max, row_sum, acc = _attend_block(
                    q, k_base, v_base, n, valid, scaling, stride_kn, stride_kd, stride_vn, stride_vd, d, d_ok,
                    row_max, row_sum, acc, PRECISION,
                )  # fmt: skip
        else:
            for block in range(SPLIT_BLOCKS):
                n, valid = _visible_positions(
                    mask_row_ptr, block, split, kv_len, position, stride_mn, BLOCK_N, NUM_SPLITS, HAS_MASK, PREPARE
                )
                # A block nobody may see (the unused tail of a static cache, left padding): skip its keys and values.
                if tl.max(valid.to(tl.int32), axis=0) > 0:
                    row_max, row_sum, acc = _attend_block(
                        q, k_base, v_base, n, valid, scaling, stride_kn, stride_kd, stride_vn, stride_vd, d, d_ok,
                        row_max, row_sum, acc, PRECISION,
                    )  # fmt: skip
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        part = (batch_head * NUM_SPLITS + split) * BLOCK_G + g
        tl.store(part_max_ptr + part, row_max)
        tl.store(part_sum_ptr + part, row_sum)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc)
        if MERGE:
            # Triton issues a scalar atomic from one thread: every thread's stores must precede it (a CTA barrier);
            # its gpu-scope release then makes them visible to the program that acquires the final count.
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + batch_head, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:  # the (row, KV head)'s last split: every split's partials are stored
                tl.debug_barrier()  # every thread's loads below stay behind the acquiring atomic
                pairs = tl.num_programs(0)
                finished = 0
                if PREPARE:  # issued before the merge's loads, whose round trip then hides this one's
                    finished = tl.atomic_add(counters_ptr + pairs, 1, sem="acq_rel")
                for group in tl.static_range(GROUPS):
                    out = _merged_head(part_acc_ptr, part_max_ptr, part_sum_ptr, batch_head, group, NUM_SPLITS,
                                       BLOCK_G, BLOCK_D, BLOCK_S, ".cg")  # fmt: skip
                    tl.store(out_ptr + b * stride_ob + (h * GROUPS + group) * stride_oh + d * stride_od, out,
                             mask=d_ok)  # fmt: skip
                # Zero again for the next launch, which touches the counters only after waiting for this grid.
                tl.store(counters_ptr + batch_head, 0)
                if PREPARE:
                    if finished == pairs - 1:  # every program of the grid has read the length: advance it
                        tl.store(counters_ptr + pairs, 0)
                        tl.store(length_ptr, position + 1)

    @triton.jit
    def _combine_kernel(
        part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, length_ptr,
        stride_ob, stride_oh, stride_od,
        KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
        PDL: tl.constexpr, ADVANCE: tl.constexpr,
    ):  # fmt: skip
        """ADVANCE: the split kernel wrote the cache at `*length_ptr` (PREPARE): advance it, now that every split
        has read it, after the output's store (the length's load, which its store waits for, would otherwise delay
        the partial sums' reads)."""
        if PDL:  # wait for the split kernel, then let the next kernel (o_proj) start fetching its weights
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        batch_head = tl.program_id(0)
        g = tl.program_id(1)
        b = batch_head // KV_HEADS
        h = batch_head % KV_HEADS
        d = tl.arange(0, BLOCK_D)
        out = _merged_head(part_acc_ptr, part_max_ptr, part_sum_ptr, batch_head, g, NUM_SPLITS, BLOCK_G, BLOCK_D,
                           BLOCK_S, "")  # fmt: skip
        tl.store(out_ptr + b * stride_ob + (h * GROUPS + g) * stride_oh + d * stride_od, out, mask=d < HEAD_DIM)
        if ADVANCE:  # last: its store waits for the length's load
            if batch_head + g == 0:
                tl.store(length_ptr, tl.load(length_ptr) + 1)


class AttentionLaunch(NamedTuple):
    """The [`DecodeKernelConfig`] values one attention launch reads, as the operators take them (`launch`, a list of
    ints; empty: `DecodeKernelConfig.for_device` of the query's device)."""

    programs: int  # split programs aimed for over the GPU
    num_warps: int  # of the split kernel
    pipeline_stages: int
    max_merge_parts: int
    programmatic: int  # 1: programmatic dependent launches

    @classmethod
    def of(cls, config: DecodeKernelConfig, batch: int) -> "AttentionLaunch":
        return cls(config.attention_programs(), config.attention_num_warps(batch), config.attention_stages(batch),
                   config.attention_max_merge_parts, int(config.programmatic_launch))  # fmt: skip

    @classmethod
    def from_ints(cls, launch: list[int], device: torch.device, batch: int) -> "AttentionLaunch":
        return cls(*launch) if launch else cls.of(DecodeKernelConfig.for_device(device), batch)


def check_arrival_counters(counters: torch.Tensor, needed: int, device: torch.device, name: str) -> None:
    """Raise a ValueError naming `name` unless `counters` holds at least `needed` int32s on `device` (the arrival
    counters that split programs count themselves in, here and in `triton_linear_funaudiochat`)."""
    if counters.dtype != torch.int32 or counters.numel() < needed or counters.device != device:
        raise ValueError(f"`{name}` must be {needed} or more int32 zeros on {device}.")


def mask_blocks(split_blocks: int) -> int:
    """The split kernel's MASK_BLOCKS: the power of two that holds a split's blocks, 0 (a mask load per block) past
    `MAX_MASK_BLOCKS` blocks."""
    blocks = triton.next_power_of_2(split_blocks)
    return blocks if blocks <= MAX_MASK_BLOCKS else 0


def _num_splits(batch_heads: int, kv_len: int, programs: int) -> tuple[int, int]:
    """`(splits, blocks per split)`: about `programs` programs over the grid, at least one block per split."""
    blocks = max(1, triton.cdiv(kv_len, BLOCK_N))
    splits = min(blocks, MAX_SPLITS, max(1, triton.cdiv(programs, batch_heads)))
    split_blocks = triton.cdiv(blocks, splits)
    return triton.cdiv(blocks, split_blocks), split_blocks


class AttentionInputs(NamedTuple):
    """What turns a decode step's projections into the attention's inputs, for `launch_decode_attention` to apply
    (the q/k norms, the rotary embedding and the static cache write of `triton_attention_inputs_funaudiochat`).

    key, value: `(batch, kv_heads * head_dim)` projected keys and values (rows contiguous in their last dimension);
    q_norm_weight, k_norm_weight: `(head_dim,)` RMSNorm weights (epsilons q_eps, k_eps); cos, sin: `(batch, head_dim)`
    rotary tables; length: the static cache layer's 0-d `cumulative_length`, the position written, then advanced.
    """

    key: torch.Tensor
    value: torch.Tensor
    q_norm_weight: torch.Tensor
    k_norm_weight: torch.Tensor
    q_eps: float
    k_eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    length: torch.Tensor


def launch_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    inputs: AttentionInputs | None = None,
    counters: torch.Tensor | None = None,
    config: DecodeKernelConfig | AttentionLaunch | None = None,
) -> torch.Tensor:
    """Attention of one query position per row; the body of the `funaudiochat::decode_attention` operator.

    Args:
        query: `(batch, heads, 1, head_dim)`; with `inputs`, the projected queries `(batch, heads * head_dim)` (rows
            contiguous in their last dimension), normed and rotated by the kernel.
        key, value: `(batch, kv_heads, kv_len, head_dim)` (any strides), `heads` a multiple of `kv_heads`; with
            `inputs`, a `StaticLayer`'s caches (last dimension contiguous), where the new key and value are written.
        mask: None or boolean `(batch or 1, kv_len)` (True = attend, any strides).
        scaling: softmax scale.
        inputs: None, or the step's projected keys and values and what prepares them ([`AttentionInputs`]): the
            kernels then also do `triton_attention_inputs_funaudiochat`'s work, without a kernel of its own.
        counters: None, or int32 zeros (at least `batch * kv_heads + 1`, left zero) in which the split programs count
            their arrivals, so that the last split of each head merges the splits (where the config's
            `attention_max_merge_parts` allows) instead of a merge kernel. Not shared with work that may run at the
            same time (another stream).
        config: the [`DecodeKernelConfig`] (or its [`AttentionLaunch`] values); None: that of the query's device.
    Returns:
        `(batch, 1, heads, head_dim)` in the query's dtype, contiguous.
    """
    batch, kv_heads, kv_len, head_dim = key.shape
    if not isinstance(config, AttentionLaunch):
        config = AttentionLaunch.of(config or DecodeKernelConfig.for_device(query.device), batch)
    heads = query.shape[1] if inputs is None else query.shape[1] // head_dim
    groups = heads // kv_heads
    block_g = max(16, triton.next_power_of_2(groups))  # tl.dot needs 16 rows at least
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits, split_blocks = _num_splits(batch * kv_heads, kv_len, config.programs)
    parts = batch * kv_heads * splits * block_g
    part_acc = torch.empty(parts, block_d, dtype=torch.float32, device=query.device)
    part_max = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(parts, dtype=torch.float32, device=query.device)
    out = torch.empty(batch, 1, heads, head_dim, dtype=query.dtype, device=query.device)
    has_mask = mask is not None
    mask_strides = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1)) if has_mask else (0, 0)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # exact float32; unused for 16-bit inputs
    pdl = bool(config.programmatic)
    # Triton's interpreter (CPU tensors) cannot run a loop whose trip count was loaded from memory: the block loop.
    pipelined = inputs is not None and query.is_cuda
    if inputs is None:
        query_strides = (query.stride(0), query.stride(1), query.stride(3))
        prepare_pointers, prepare_strides = (query,) * 7, (0,) * 4  # placeholders, not read without PREPARE
        prepare_flags = {"PREPARE": False, "Q_EPS": 0.0, "K_EPS": 0.0}
    else:
        query_strides = (query.stride(0), head_dim, 1)  # heads side by side in each row
        prepare_pointers = (
            inputs.key, inputs.value, inputs.q_norm_weight, inputs.k_norm_weight, inputs.cos, inputs.sin, inputs.length
        )
        prepare_strides = (inputs.key.stride(0), inputs.value.stride(0), inputs.cos.stride(0), inputs.sin.stride(0))
        prepare_flags = {"PREPARE": True, "Q_EPS": float(inputs.q_eps), "K_EPS": float(inputs.k_eps)}
    block_s = max(2, triton.next_power_of_2(splits))
    merge = counters is not None
    if merge:  # one per (row, KV head) and one for the heads that finished
        check_arrival_counters(counters, batch * kv_heads + 1, out.device, "counters")
    merge = merge and groups * block_s <= config.max_merge_parts
    _split_kernel[(batch * kv_heads, splits)](
        query, key, value, mask if has_mask else query, part_acc, part_max, part_sum, *prepare_pointers,
        kv_len, scaling,
        *query_strides, *key.stride(), *value.stride(), *mask_strides, *prepare_strides,
        KV_HEADS=kv_heads, GROUPS=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        SPLIT_BLOCKS=split_blocks, NUM_SPLITS=splits, HAS_MASK=has_mask, PRECISION=precision, PDL=pdl,
        **prepare_flags, PIPELINED=pipelined, NUM_STAGES=config.pipeline_stages,
        MASK_BLOCKS=mask_blocks(split_blocks) if pipelined and has_mask else 0,
        out_ptr=out, counters_ptr=counters if merge else out, stride_ob=out.stride(0), stride_oh=out.stride(2),
        stride_od=out.stride(3), MERGE=merge, BLOCK_S=block_s if merge else 1,
        num_warps=config.num_warps, launch_pdl=pdl,
    )  # fmt: skip
    if merge:
        return out
    _combine_kernel[(batch * kv_heads, groups)](
        part_acc, part_max, part_sum, out, part_max if inputs is None else inputs.length,
        out.stride(0), out.stride(2), out.stride(3),
        KV_HEADS=kv_heads, GROUPS=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        NUM_SPLITS=splits, BLOCK_S=block_s, PDL=pdl, ADVANCE=inputs is not None, launch_pdl=pdl,
    )  # fmt: skip
    return out


if triton is not None:
    # Opaque, as `funaudiochat::decode_linear` (torch.compile's launches of traced kernels have no PDL).
    @torch.library.custom_op("funaudiochat::decode_attention", mutates_args=())
    def _decode_attention_op(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float,
        launch: list[int],
    ) -> torch.Tensor:  # fmt: skip
        config = AttentionLaunch.from_ints(launch, query.device, query.shape[0])
        return launch_decode_attention(query, key, value, mask, scaling, config=config)

    @_decode_attention_op.register_fake
    def _(query, key, value, mask, scaling, launch):
        batch, heads, _, head_dim = query.shape
        return query.new_empty(batch, 1, heads, head_dim)


def _flat_bool_mask(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> tuple[bool, torch.Tensor | None]:
    """`(supported, mask)`: a `(batch or 1, 1, 1, kv_len)` boolean mask as a `(batch or 1, kv_len)` view."""
    if attention_mask is None:
        return True, None
    shape_ok = attention_mask.ndim == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1
    if attention_mask.dtype != torch.bool or not shape_ok or attention_mask.shape[-1] != kv_len:
        return False, None
    if attention_mask.shape[0] not in (1, batch):
        return False, None
    return True, attention_mask[:, 0, 0, :]


def triton_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: the Triton kernels for one CUDA query position with a boolean (or no) mask,
    `gqa_decode_attention` (matmuls, or SDPA for several positions) for anything else. `kernel_config` (in kwargs):
    the [`DecodeKernelConfig`] of the kernels (`decoder_stack_forward` passes its own), else the device's.

    Shapes as `gqa_decode_attention`: query `(batch, heads, q_len, head_dim)`, key / value `(batch, kv_heads,
    kv_len, head_dim)`; returns `((batch, q_len, heads, head_dim), None)`.
    """
    batch, heads, q_len, head_dim = query.shape
    usable = (
        triton is not None
        and query.is_cuda
        and q_len == 1
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and heads % key.shape[1] == 0
    )
    supported, mask = _flat_bool_mask(attention_mask, batch, key.shape[2]) if usable else (False, None)
    if not supported:
        return gqa_decode_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if scaling is None:
        scaling = 1.0 / math.sqrt(head_dim)
    config = kwargs.get("kernel_config")
    launch = [] if config is None else list(AttentionLaunch.of(config, int(batch)))
    return torch.ops.funaudiochat.decode_attention(query, key, value, mask, float(scaling), launch), None


def register_triton_decode_attention() -> str:
    """Register `triton_decode_attention` (with the `sdpa` mask builder) globally; returns its name. Idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(TRITON_DECODE_ATTENTION, triton_decode_attention)
    AttentionMaskInterface.register(TRITON_DECODE_ATTENTION, sdpa_mask)
    return TRITON_DECODE_ATTENTION


__all__ = [
    "TRITON_DECODE_ATTENTION",
    "AttentionInputs",
    "AttentionLaunch",
    "launch_decode_attention",
    "register_triton_decode_attention",
    "triton_decode_attention",
]
