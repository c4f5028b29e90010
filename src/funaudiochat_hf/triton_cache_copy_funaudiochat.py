"""A request's prefilled cache columns copied into a batch slot, every layer of a static cache in one Triton launch.

A request joins the serving batch (`serving_batch_funaudiochat.ServingBatch.admit`) by moving the keys and values its
prefill wrote into its slot of the batch's caches: for the full-size model 36 LLM and 28 CRQ layers, keys and values,
128 slice copies. On the GPU they are little work, but each is a few PyTorch calls of the decode thread's host time
(views, checks, a launch) while no step is queued. Here a cache's copies are one launch over a table of its layers'
addresses (`CachePointers`, made once per cache by its owner): an admission's host time 2.5 -> 0.5 ms (H100 host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_support import triton


_BLOCK = 1024  # elements per program: a head's columns of one layer are `length * head_dim` contiguous elements
_TRITON_DTYPES = {}  # the cache dtypes the kernel copies, with their Triton types


if triton is not None:
    import triton.language as tl

    # Offsets and lengths change with every request: not specialized on, so one compiled kernel serves them all.
    @triton.jit(do_not_specialize=["src_offset", "dst_offset", "n"])
    def _copy_columns_kernel(
        src_table, dst_table, src_offset, dst_offset, src_stride_head, dst_stride_head, n,
        BLOCK: tl.constexpr, DTYPE: tl.constexpr,
    ):  # fmt: skip
        """Program `(tensor, head, block)`: `n` contiguous elements from `src_offset + head * src_stride_head` of the
        tensor at `src_table[tensor]` to `dst_offset + head * dst_stride_head` of the one at `dst_table[tensor]`."""
        tensor = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        offsets = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < n
        src = tl.load(src_table + tensor).to(tl.pointer_type(DTYPE))
        dst = tl.load(dst_table + tensor).to(tl.pointer_type(DTYPE))
        values = tl.load(src + src_offset + head * src_stride_head + offsets, mask=ok)
        tl.store(dst + dst_offset + head * dst_stride_head + offsets, values, mask=ok)

    _TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class CachePointers:
    """The addresses of a static cache's tensors for `copy_cache_columns`, with the layout they share.

    table: `(2 * layers,)` int64 on the cache's device: layer `i`'s keys at `2 i`, its values at `2 i + 1`.
    Every tensor is a contiguous `(rows, heads, columns, head_dim)` of `dtype`. Valid while the cache keeps its
    tensors (a `StaticCache` does once its layers are initialized); `current` checks that it still does.
    """

    table: torch.Tensor
    rows: int
    heads: int
    columns: int
    head_dim: int
    dtype: torch.dtype
    first_address: int

    @classmethod
    def of(cls, cache) -> CachePointers | None:
        """The table of `cache`, or None where the kernel cannot copy it: no Triton, layers not all initialized
        static tensors of one contiguous shape and dtype (a `DynamicCache` grows its tensors)."""
        layers = getattr(cache, "layers", None)
        if triton is None or not layers:
            return None
        tensors = []
        for layer in layers:
            if not getattr(layer, "is_initialized", False) or not hasattr(layer, "max_cache_len"):
                return None
            tensors += [layer.keys, layer.values]
        first = tensors[0]
        if first.dim() != 4 or first.dtype not in _TRITON_DTYPES:
            return None
        if any(t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous() for t in tensors):
            return None
        table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=first.device)
        rows, heads, columns, head_dim = first.shape
        return cls(table, rows, heads, columns, head_dim, first.dtype, first.data_ptr())

    def current(self, cache) -> bool:
        """Whether `cache` still holds the tensors this table was made of."""
        return cache.layers[0].keys.data_ptr() == self.first_address

    def layout(self) -> tuple:
        return self.heads, self.head_dim, self.dtype, int(self.table.numel())


def copy_cache_columns(
    dst: CachePointers, dst_row: int, dst_start: int, src: CachePointers, src_row: int, src_start: int, length: int
) -> None:
    """For every layer `i` of two caches of one layout (heads, head_dim, dtype, layer count):
    `dst[i][dst_row, :, dst_start : dst_start + length] = src[i][src_row, :, src_start : src_start + length]`, keys and
    values, in one launch on the current stream."""
    if dst.layout() != src.layout():
        raise ValueError(f"The caches differ in layout (heads, head_dim, dtype, tensors): {dst.layout()} against "
                         f"{src.layout()}.")  # fmt: skip
    if not (0 <= dst_row < dst.rows and 0 <= src_row < src.rows):
        raise ValueError(f"Rows out of range: {dst_row} of {dst.rows}, {src_row} of {src.rows}.")
    fits = all(0 <= start and start + length <= columns for start, columns in ((dst_start, dst.columns),
                                                                              (src_start, src.columns)))
    if length < 0 or not fits:
        raise ValueError(f"Columns out of range: {length} from {src_start} (of {src.columns}) to {dst_start} (of "
                         f"{dst.columns}).")  # fmt: skip
    n = length * dst.head_dim
    if n == 0:
        return
    grid = (dst.table.numel(), dst.heads, triton.cdiv(n, _BLOCK))
    _copy_columns_kernel[grid](
        src.table, dst.table,
        (src_row * src.heads * src.columns + src_start) * src.head_dim,
        (dst_row * dst.heads * dst.columns + dst_start) * dst.head_dim,
        src.columns * src.head_dim, dst.columns * dst.head_dim, n,
        BLOCK=_BLOCK, DTYPE=_TRITON_DTYPES[dst.dtype],
    )  # fmt: skip


__all__ = ["CachePointers", "copy_cache_columns"]
