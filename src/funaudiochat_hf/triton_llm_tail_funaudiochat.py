"""The decode step's work between the LLM stack and the speech head, as one Triton kernel (plan part
`bookkeeping_kernels`).

After the LLM stack the step takes the last hidden state `h` of every row through the stack's final RMSNorm (the text
head's input), adds the embedding of the token that was fed (the speech head's conditioning `norm(h) + E[id]`, then
`pre_matching` and the folded `input_matching` as one GEMV) and advances the row's LLM position. As PyTorch ops that is
twelve small kernels (the norm alone eight), which the CUDA-graphed step ("cuda_graphs", no Inductor) launches one by
one; here one program per row does it. The values are PyTorch's up to rounding: the norm's sum of squares is taken in
float32 in the kernel's own order, then everything is rounded where `Qwen3RMSNorm` and the bfloat16 add round.
"""

import torch

from .triton_support import kernels_run_on, triton


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _llm_tail_kernel(
        hidden_ptr, weight_ptr, table_ptr, ids_ptr, normed_ptr, conditioning_ptr, position_ptr,
        stride_hidden, stride_table, stride_normed, stride_conditioning, eps, hidden_size,
        BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """Row `program_id(0)`: `normed = weight * (h * rsqrt(mean(h^2) + eps))` (as `Qwen3RMSNorm`, in the hidden
        states' dtype), `conditioning = normed + table[id]`, `position += 1`."""
        row = tl.program_id(0).to(tl.int64)
        position = tl.load(position_ptr + row)
        token = tl.load(ids_ptr + row)
        squares = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden_size, BLOCK_H):
            columns = start + tl.arange(0, BLOCK_H)
            h = tl.load(hidden_ptr + row * stride_hidden + columns, mask=columns < hidden_size, other=0.0)
            h = h.to(tl.float32)
            squares += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / hidden_size + eps)
        for start in range(0, hidden_size, BLOCK_H):
            columns = start + tl.arange(0, BLOCK_H)
            inside = columns < hidden_size
            h = tl.load(hidden_ptr + row * stride_hidden + columns, mask=inside, other=0.0)
            out_type = h.dtype
            scaled = (h.to(tl.float32) * rstd).to(out_type)
            weight = tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
            normed = (weight * scaled.to(tl.float32)).to(out_type)
            tl.store(normed_ptr + row * stride_normed + columns, normed, mask=inside)
            embedding = tl.load(table_ptr + token * stride_table + columns, mask=inside, other=0.0)
            conditioning = (normed.to(tl.float32) + embedding.to(tl.float32)).to(out_type)
            tl.store(conditioning_ptr + row * stride_conditioning + columns, conditioning, mask=inside)
        tl.debug_barrier()  # every thread has read the position
        tl.store(position_ptr + row, position + 1)


def llm_tail_kernel_supported(hidden: torch.Tensor, norm: torch.nn.Module, text_table: torch.Tensor) -> bool:
    """Whether the kernel computes the step's tail for these: hidden states on a GPU it runs on, an RMSNorm with a
    weight and `variance_epsilon` of the hidden states' width, a text table of their width and dtype on their device."""
    weight = getattr(norm, "weight", None)
    return (
        kernels_run_on(hidden)
        and hasattr(norm, "variance_epsilon")
        and weight is not None
        and weight.shape == hidden.shape[-1:]
        and weight.device == hidden.device
        and text_table.device == hidden.device
        and text_table.dtype == hidden.dtype
        and text_table.shape[-1] == hidden.shape[-1]
        and text_table.stride(-1) == 1
    )


def launch_llm_tail(
    hidden: torch.Tensor,
    norm: torch.nn.Module,
    text_table: torch.Tensor,
    ids: torch.Tensor,
    normed: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The LLM stack's last hidden states `hidden` `(batch, hidden_size)` (before its final `norm`) -> the speech
    head's conditioning `norm(hidden) + text_table[ids]` `(batch, hidden_size)`; writes `norm(hidden)` into `normed`
    `(batch, hidden_size)` and adds 1 to `positions` `(batch,)`, in place."""
    batch, hidden_size = hidden.shape
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    conditioning = torch.empty_like(normed)
    _llm_tail_kernel[(batch,)](
        hidden, norm.weight, text_table, ids, normed, conditioning, positions,
        hidden.stride(0), text_table.stride(0), normed.stride(0), conditioning.stride(0), float(norm.variance_epsilon),
        hidden_size, BLOCK_H=min(1024, triton.next_power_of_2(hidden_size)), num_warps=4,
    )  # fmt: skip
    return conditioning


__all__ = ["launch_llm_tail", "llm_tail_kernel_supported"]
