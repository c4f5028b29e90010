"""The LLM's text head of a decode step on a second CUDA stream, while the CRQ sub-steps run.

The plan part `overlap_text_head` of the fast backends ("cuda_graphs", "compiled"). A decode step is the LLM
(bandwidth-bound: it reads all its weights), then 5 CRQ sub-steps (latency-bound: a chain of ~170 small kernels each,
reading their 0.9 GB of weights well below the copy bandwidth), then the text token and the bookkeeping. The text head
(151,936 x 4,096 in bfloat16: 1.2 GB to read) needs only the LLM's last hidden state, and the CRQ only needs that
hidden state too (spec funaudiochat.md §6.3a: it is conditioned on the embedding of the token fed, not of the token
chosen). So the head can stream its weights during the CRQ's sub-steps, in the bandwidth they leave unused, and only the
token choice waits for it.

`_text_head_kernel` is a persistent kernel of few programs (`DecodeKernelConfig.text_head_programs`): each walks its
share of the vocabulary's column tiles on tensor cores (rows past the batch masked), so it holds a bounded part of the
GPU and the CRQ's kernels, launched on the main stream meanwhile, keep room on every multiprocessor (a grid of one
program per tile would queue ahead of them). Its logits are rounded as `lm_head(hidden).float()` rounds them: the
GEMM's float32 sum, rounded to the model dtype, then float32. Overlapped, a step was measured faster than with the head
inline, so the fast backends take it up to `DecodeKernelConfig.text_head_overlap_max_rows` rows.

[`OverlappedTextHead`] orders the streams: `start` makes the side stream wait for the work queued so far on the
current stream (the LLM part that wrote the hidden state), then launches the kernel there; `join` makes the current
stream wait for it before the token is chosen. Both only enqueue (no host sync). They run between the parts of a step
(the LLM part, the K CRQ sub-steps and the bookkeeping; in the "compiled" backend each part is compiled on its own, as
Inductor does not schedule streams), and the whole step, fork and join included, is recorded as one CUDA graph
(`step_graph_funaudiochat`).
"""

import torch
from torch import nn

from .triton_support import triton
from .triton_config_funaudiochat import DecodeKernelConfig


BLOCK_M = 16  # rows per tile: tl.dot's least; a decode step has one row per batch row (at most BLOCK_M)
BLOCK_N = 64
BLOCK_K = 128
NUM_STAGES = 3  # weight tiles in flight per program (the K loop is software-pipelined)
NUM_WARPS = 4


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _text_head_kernel(
        x_ptr, weight_ptr, bias_ptr, out_ptr, rows, stride_x, stride_out,
        N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, PROGRAMS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Program p: the column tiles p, p + PROGRAMS, ... of `out = (x @ weight^T + bias)` rounded to x's dtype,
        stored as float32. x `(rows, K)` (rows <= BLOCK_M); weight `(N, K)` contiguous; bias `(N,)`; out `(rows, N)`."""
        dtype = x_ptr.dtype.element_ty
        row = tl.arange(0, BLOCK_M)
        row_ok = row < rows
        TILES: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        for tile in range(tl.program_id(0), TILES, PROGRAMS):
            col = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = col < N
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                            other=0.0)  # fmt: skip
                w = tl.load(weight_ptr + col[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                            other=0.0, eviction_policy="evict_first")  # fmt: skip
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            out = acc.to(dtype).to(tl.float32)
            tl.store(out_ptr + row[:, None] * stride_out + col[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def launch_text_head(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, programs: int | None = None
) -> None:
    """`out[:] = linear(x, weight, bias).float()` through `_text_head_kernel`, on the current stream.

    Args:
        x: `(rows, in_features)`, rows <= `BLOCK_M`, last dimension contiguous.
        weight: `(vocab, in_features)` contiguous, x's dtype.
        bias: None or `(vocab,)`.
        out: `(rows, vocab)` float32, last dimension contiguous; written in place.
        programs: the grid (default: `DecodeKernelConfig.for_device(x.device).text_head_programs()`).
    """
    rows, in_features = x.shape
    vocab = weight.shape[0]
    if rows > BLOCK_M or out.shape != (rows, vocab) or out.dtype != torch.float32 or weight.shape[1] != in_features:
        raise ValueError(
            f"The text head kernel takes x (rows <= {BLOCK_M}, in), weight (vocab, in) and float32 out (rows, vocab); "
            f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)} {out.dtype}."
        )
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("The text head kernel needs contiguous rows of x and out and a contiguous weight.")
    programs = programs or DecodeKernelConfig.for_device(x.device).text_head_programs()
    programs = min(programs, triton.cdiv(vocab, BLOCK_N))  # no program without a tile
    _text_head_kernel[(programs,)](
        x, weight, x if bias is None else bias, out, rows, x.stride(0), out.stride(0),
        N=vocab, K=in_features, HAS_BIAS=bias is not None, PROGRAMS=programs, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS,
    )  # fmt: skip


def text_head_supported(lm_head: nn.Module, batch_size: int) -> bool:
    """Whether the kernel can run this text head for a batch: a plain `nn.Linear` (not LoRA-wrapped or quantized) with
    a contiguous weight, and at most `BLOCK_M` rows."""
    plain = type(lm_head) is nn.Linear and lm_head.weight.is_contiguous()
    return triton is not None and plain and batch_size <= BLOCK_M


class OverlappedTextHead:
    """The text head of one run's decode steps on a stream of its own (CUDA), or inline on the current stream (other
    devices: the Triton interpreter's tests).

    `start(x, lm_head, out)` after the LLM part wrote `x` `(batch, hidden)`; `join()` before anything reads `out`
    `(batch, vocab)` float32. Neither `x` nor `out` may be written in between (the workspace's own buffers).
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(
        self, x: torch.Tensor, lm_head: nn.Linear, out: torch.Tensor, kernel_config: DecodeKernelConfig | None = None
    ) -> None:
        """Launch the head (its grid from `kernel_config`, None: the device's) after the work queued so far."""
        programs = (kernel_config or DecodeKernelConfig.for_device(x.device)).text_head_programs()
        if self.stream is None:
            launch_text_head(x, lm_head.weight, lm_head.bias, out, programs)
            return
        self.stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.stream):
            launch_text_head(x, lm_head.weight, lm_head.bias, out, programs)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


__all__ = ["OverlappedTextHead", "launch_text_head", "text_head_supported"]
