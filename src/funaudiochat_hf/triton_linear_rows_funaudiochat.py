"""The decode projections of 2 to 16 rows as one Triton kernel on tensor cores, `_decode_rows_kernel`.

The one-row GEMV kernel (`triton_linear_gemv_funaudiochat`) reads the weights once per row; here each weight tile is
read once for all rows (a 16-row `tl.dot`, rows past the batch masked), and the reduction is split over SPLIT_K
programs per column tile, so a 1,024-output projection still has enough programs to stream its weights. The norm,
activation, bias and residual are folded in as in the GEMV kernel, rounded the same way.

A layer's residual projections (o_proj, down_proj) may also store their output rows' sums of squares by `SQUARES_GROUP`
columns (`STORE_SQUARES`), which the next projection's input norm adds up (`NORM_GROUPS`) instead of every program
reading all 16 x K inputs for it (measured faster in whole decode steps).

Tiles come from `DecodeKernelConfig.rows_kernel_tile` (tuned per GPU capability and shape); one that needs more shared
memory than a program may use on the GPU (`DecodeKernelConfig.max_shared_memory`: the compiled kernel's own need,
checked before launching) gives way to the next of `rows_tile_candidates` that fits.
"""

import torch
from torch import nn
from transformers.utils import logging

from .triton_attention_funaudiochat import check_arrival_counters
from .triton_support import triton
from .triton_config_funaudiochat import MIN_ROWS_BLOCK_N, RowsTile, rows_tile_candidates
from .triton_linear_gemv_funaudiochat import part_flags, part_tile


logger = logging.get_logger(__name__)

ROWS_KERNEL_MAX_ROWS = 16  # BLOCK_M: the rows of one `tl.dot` tile (tl.dot's least)
SQUARES_GROUP = MIN_ROWS_BLOCK_N  # output columns per stored sum of squares: every column tile holds whole groups


if triton is not None:
    import triton.language as tl

    from .triton_linear_gemv_funaudiochat import _load_weight_tile

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
    def _rows_epilogue(acc, acc_up, bias_ptr, up_bias_ptr, out_ptr, squares_ptr, tile, row, row_ok, col, weight_col,
                       col_ok, stride_out, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                       residual, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       STORE_SQUARES: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
        """Bias, SiLU(gate) * up and residual, rounded as `_decode_linear_kernel` rounds them; stores the tile of
        output columns `col` (`weight_col` within the program's weight). `residual`: the residual tile, loaded by the
        caller. STORE_SQUARES: also the float32 sums of squares of the
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
        NUM_STAGES: tl.constexpr = 3, SWAP_AB: tl.constexpr = False, NORM_GROUPS: tl.constexpr = 0, NORM_GROUPS_BLOCK: tl.constexpr = 1, STORE_SQUARES: tl.constexpr = False,
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
        # Every program fetches its residual tile (an earlier kernel's output) now, with x, so the epilogue of the
        # tile's last program does not wait for one more L2 round trip.
        residual = tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
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
            _rows_epilogue(acc, acc_up, bias_ptr, up_bias_ptr, out_ptr, squares_ptr, tile, row, row_ok, col, weight_col,
                           col_ok, stride_out, HAS_BIAS, HAS_RESIDUAL, GATED, residual, N, BLOCK_M, BLOCK_N,
                           STORE_SQUARES, GROUP)  # fmt: skip
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
                _rows_epilogue(acc, acc_up, bias_ptr, up_bias_ptr, out_ptr, squares_ptr, tile, row, row_ok, col,
                               weight_col, col_ok, stride_out, HAS_BIAS, HAS_RESIDUAL, GATED, residual, N, BLOCK_M,
                               BLOCK_N, STORE_SQUARES, GROUP)  # fmt: skip
                # Zero again for the next launch, which touches the counters only after waiting for this grid.
                tl.store(counters_ptr + tile, 0)


def _rows_kernel_arguments(
    tile, x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated, counters,
    norm_squares, squares, out, norm_chunk_elements: int, pdl: bool,
) -> tuple[tuple, tuple, dict]:  # fmt: skip
    """`(grid, positional arguments, keyword arguments)` of `_decode_rows_kernel` with `tile`."""
    rows, in_features = x.shape
    out_features = part_ends[-1]
    block_n, block_k, split_k, num_warps, num_stages, swap_ab = tile
    tiles = triton.cdiv(out_features, block_n)
    partials = x  # a placeholder: one split needs neither partials nor counters
    if split_k > 1:
        partials = torch.empty(tiles * split_k * (2 if gated else 1) * ROWS_KERNEL_MAX_ROWS * block_n,
                               dtype=torch.float32, device=x.device)  # fmt: skip
    norm_groups = 0 if norm_squares is None else norm_squares.shape[1]
    args = (
        x, weight, *(x if t is None else t for t in (bias, up_weight, up_bias, norm_weight, residual)), out, partials,
        counters, *part_pointers, x if norm_squares is None else norm_squares, x if squares is None else squares, rows,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
    )  # fmt: skip
    kwargs = dict(
        N=out_features, K=in_features, EPS=float(eps), HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, GATED=gated, BLOCK_M=ROWS_KERNEL_MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, K_SPLIT=triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k,
        NORM_BLOCK_K=min(triton.next_power_of_2(in_features), norm_chunk_elements // ROWS_KERNEL_MAX_ROWS),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl, **part_flags(part_ends),
        NUM_STAGES=num_stages, SWAP_AB=swap_ab, NORM_GROUPS=norm_groups,
        NORM_GROUPS_BLOCK=triton.next_power_of_2(max(norm_groups, 1)), STORE_SQUARES=squares is not None,
        GROUP=SQUARES_GROUP, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return (tiles, split_k), args, kwargs


def fitted_rows_tile(tile: RowsTile, part_ends: list[int], fits) -> RowsTile | None:
    """The first of `rows_tile_candidates(tile)`, its columns narrowed to divide the part boundaries, for which
    `fits(candidate)` holds; None where no tile of at least `MIN_ROWS_BLOCK_N` columns divides them. Raises a
    ValueError where none fits."""
    for candidate in rows_tile_candidates(tile):
        block_n = part_tile(candidate[0], part_ends, MIN_ROWS_BLOCK_N)
        if block_n is None:  # only the widest tile can fail it: a narrower one divides the boundaries too
            return None
        candidate = (block_n, *candidate[1:])
        if fits(candidate):
            return candidate
    raise ValueError(f"No tile of the several-row kernel from {tile} fits the GPU's shared memory per program.")


def launch_rows(
    x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated, counters,
    norm_squares, squares, tile: RowsTile, max_shared_memory: int, norm_chunk_elements: int, pdl: bool,
) -> torch.Tensor | None:  # fmt: skip
    """`_decode_rows_kernel` for 2 to `ROWS_KERNEL_MAX_ROWS` rows, one launch (arguments as `launch_decode_linear`
    prepares them; `squares`: None, or the `(rows, groups)` float32 buffer of the output's sums of squares). Returns
    None where a part boundary is not a multiple of the narrowest tile (`MIN_ROWS_BLOCK_N`). `max_shared_memory` > 0:
    the first of `rows_tile_candidates(tile)` whose compiled kernel needs at most that many bytes per program."""
    rows = x.shape[0]
    out = torch.empty(rows, part_ends[-1], dtype=x.dtype, device=x.device)
    common = (x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated,
              counters, norm_squares, squares, out, norm_chunk_elements, pdl)  # fmt: skip

    def fits(candidate) -> bool:
        if not max_shared_memory or not x.is_cuda:
            return True
        grid, args, kwargs = _rows_kernel_arguments(candidate, *common)
        compiled = _decode_rows_kernel.warmup(*args, grid=grid, **kwargs)  # compiles (or finds) it, no launch
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        return compiled.metadata.shared <= max_shared_memory

    fitted = fitted_rows_tile(tile, part_ends, fits)
    if fitted is None:
        return None
    if fitted[1:] != tile[1:] or fitted[0] != part_tile(tile[0], part_ends, MIN_ROWS_BLOCK_N):
        logger.info_once(f"decode_linear {part_ends[-1]}x{x.shape[1]} ({x.dtype}): tile {tile} needs more shared "
                         f"memory than a program has on {x.device}; using {fitted}.")  # fmt: skip
    grid, args, kwargs = _rows_kernel_arguments(fitted, *common)
    if fitted[2] > 1:
        check_arrival_counters(counters, grid[0], x.device, "split_k_counters")
    _decode_rows_kernel[grid](*args, **kwargs)
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


__all__ = ["ROWS_KERNEL_MAX_ROWS", "SQUARES_GROUP", "fitted_rows_tile", "launch_rows", "row_squares", "squares_groups"]
