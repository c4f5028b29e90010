"""The one-row decode projection as a Triton GEMV kernel, with the layer's norm, activation and residual folded in.

At batch 1 a decode step's projections are GEMMs with a single input row: each streams megabytes of weights, which
the GPU reads in a few microseconds, yet cuBLAS takes several times that per call, and the norms, SiLU and residual
adds around them are more small kernels. Here each projection is one kernel of many small programs (2-8 output
columns over the whole reduction each; `DecodeKernelConfig.gemv_kernel_tile`), enough loads in flight to approach the
copy bandwidth:

- `qkv = linear(RMSNorm(x))`: the input norm folded in (each program recomputes the RMS of its input row; for inputs
  of up to `DecodeKernelConfig.gemv_folded_norm_max_features` in the same pass as its products);
- `h = x + linear(attention)`: o_proj with the residual add;
- `a = SiLU(gate(RMSNorm(h))) * up(RMSNorm(h))`: the post-attention norm, the fused gate/up GEMM and the activation;
- `y = h + linear(a)`: down_proj with the residual add.

Each program accumulates its products elementwise over the unrolled reduction and sums them once at the end (a sum
per step would synchronise the warps between weight loads). As a programmatic dependent launch each program fetches
its first weight tiles before `griddepcontrol.wait`, so the weight stream of one projection starts while the previous
kernel finishes. `triton_linear_funaudiochat.launch_decode_linear` picks this kernel or the several-row one.
"""

import torch

from .triton_support import triton


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
        only read after the wait; the residual right after it, with x, not after the reduction (measured faster).

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


def launch_gemv(
    x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated, tile,
    fold_norm: bool, pdl: bool,
) -> torch.Tensor:  # fmt: skip
    """`_decode_linear_kernel` over `(rows, in_features)` x, one program per `BLOCK_N` columns and row: arguments as
    `launch_decode_linear` prepares them (`part_pointers`: weight_1, bias_1, weight_2, bias_2, x where absent), `tile`
    `(BLOCK_N, BLOCK_K, num_warps)` with BLOCK_N dividing the part boundaries. Returns `(rows, out_features)`."""
    rows, in_features = x.shape
    out_features = part_ends[-1]
    block_n, block_k, num_warps = tile
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    _decode_linear_kernel[(triton.cdiv(out_features, block_n), rows)](
        x, weight, *(x if t is None else t for t in (bias, up_weight, up_bias, norm_weight, residual)), out,
        *part_pointers, x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        N=out_features, K=in_features, EPS=float(eps), HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
        **part_flags(part_ends), FOLDED_NORM=fold_norm, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out


def part_tile(block_n: int, part_ends: list[int], narrowest: int = 1) -> int | None:
    """`block_n` halved until every part boundary (`part_ends[:-1]`) is a multiple of it, so that a program reads one
    part; None where that takes fewer than `narrowest` columns."""
    while block_n > narrowest and any(end % block_n for end in part_ends[:-1]):
        block_n //= 2
    return None if any(end % block_n for end in part_ends[:-1]) else block_n


def part_flags(part_ends: list[int]) -> dict:
    """The kernels' PART_1 / PART_2: the first output column of the second and third weight (0: no such part)."""
    part_1, part_2 = [*part_ends[:-1], 0, 0][:2]
    return {"PART_1": part_1, "PART_2": part_2}


__all__ = ["launch_gemv", "part_flags", "part_tile"]
