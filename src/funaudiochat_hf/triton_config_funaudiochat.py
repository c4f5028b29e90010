"""What the decode step's Triton kernels may be tuned by, as one frozen value: [`DecodeKernelConfig`].

Every kernel launcher of the decode step (the projections of `triton_linear_funaudiochat`, the attention of
`triton_attention_funaudiochat`, the speech sampler and the text head) takes its tiles, warps, grids and launch kind
from a `DecodeKernelConfig` handed down the call path. Nothing is read from module globals at launch time, and the
config is hashable: a decoding run keeps it in its step configuration, so it is part of every compiled-graph and
CUDA-graph key, and two configs never share recorded work.

`DecodeKernelConfig.for_device(device)` picks the values for a GPU: its compute capability (programmatic dependent
launches from sm_90; tile tables tuned for a capability, the generic defaults elsewhere), its multiprocessor count
(grids sized in programs per multiprocessor) and the shared memory a program may use (a tuned several-row tile that
does not fit gives way to a smaller one, `rows_tile_candidates`). Comparisons of variants build configs with
`dataclasses.replace(config, field=value)` and pass them, e.g. `model.speech_generator(kernel_config=...)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch


# A tile of the one-row GEMV kernel: `(BLOCK_N, BLOCK_K, num_warps)`; of the several-row kernel: `(BLOCK_N, BLOCK_K,
# SPLIT_K, num_warps, num_stages, swap_ab)`. Tables map `(out_features, in_features, gated)` to a tile.
GemvTile = tuple[int, int, int]
RowsTile = tuple[int, int, int, int, int, bool]
TileTable = tuple[tuple[tuple[int, int, bool], tuple], ...]

# The several-row kernel's narrowest column tile (`tl.dot` takes at least 16 along each dimension).
MIN_ROWS_BLOCK_N = 16

# Fun-Audio-Chat-8B's projections on sm_90 GPUs, from sweeps of the tiles per shape in compiled decode
# steps (`scripts/bench_decode_linear.py --sweep-tiles` and `--sweep-rows-tiles`); other shapes and GPUs take the
# defaults of `DecodeKernelConfig`.
_SM90_GEMV_TILES: TileTable = (
    ((4096, 1024, False), (4, 1024, 4)),  # CRQ q/k/v (fused)
    ((1024, 2048, False), (4, 2048, 4)),  # CRQ o_proj
    ((3072, 1024, True), (4, 512, 2)),  # CRQ gate/up (fused)
    ((4096, 4096, False), (4, 2048, 8)),  # LLM q_proj and o_proj
    ((1024, 4096, False), (2, 2048, 4)),  # LLM k_proj and v_proj
    ((6144, 4096, False), (4, 2048, 8)),  # LLM q, k and v in one kernel: q_proj's tile
    ((12288, 4096, True), (4, 256, 2)),  # LLM gate/up
    ((4096, 12288, False), (8, 2048, 4)),  # LLM down_proj (the CRQ's keeps the defaults)
    ((6565, 4096, False), (2, 2048, 4)),  # CRQ speech head (lm_head)
    ((6568, 1024, False), (8, 512, 4)),  # the folded speech head, padded (`fold_crq_matching`)
    ((5120, 4096, False), (4, 2048, 8)),  # input_matching ∘ pre_matching (`fold_crq_matching`)
)
# The CRQ's down_proj takes a tile whose every split is one 512-input chunk, fetched before the kernel's wait.
_SM90_ROWS_TILES: TileTable = (
    ((4096, 1024, False), (128, 256, 4, 8, 4, False)),  # CRQ q/k/v (fused)
    ((1024, 2048, False), (64, 256, 8, 8, 2, False)),  # CRQ o_proj
    ((3072, 1024, True), (128, 256, 4, 8, 2, True)),  # CRQ gate/up (fused)
    ((1024, 3072, False), (32, 512, 6, 4, 2, False)),  # CRQ down_proj
    ((6144, 4096, False), (128, 128, 2, 8, 4, True)),  # LLM q, k and v (three weights, one kernel)
    ((4096, 4096, False), (128, 128, 4, 8, 4, True)),  # LLM o_proj
    ((12288, 4096, True), (64, 128, 1, 8, 3, False)),  # LLM gate/up (two weights)
    ((4096, 12288, False), (128, 128, 4, 8, 4, True)),  # LLM down_proj
)
# Tile tables by compute capability (major, minor).
_TUNED_TILES: dict[tuple[int, int], tuple[TileTable, TileTable]] = {(9, 0): (_SM90_GEMV_TILES, _SM90_ROWS_TILES)}


def supports_programmatic_launch(device: torch.device | str) -> bool:
    """Whether kernels on `device` can be programmatic dependent launches: a CUDA GPU of compute capability 9.0+."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


@dataclass(frozen=True)
class DecodeKernelConfig:
    """The tunable values of the decode step's kernels (frozen and hashable; see the module docstring).

    Device:
        capability: the GPU's compute capability, None off CUDA (the Triton interpreter).
        multiprocessors: the GPU's multiprocessors (grids are sized per multiprocessor).
        max_shared_memory: bytes of shared memory a program may use; None: no limit checked (the interpreter).
        programmatic_launch: launch the kernels as programmatic dependent launches (sm_90+): a kernel starts while
            the previous one finishes, fetches what no decode kernel writes (weights) and waits in
            `griddepcontrol.wait` before reading anything else.
    One-row projections (`_decode_linear_kernel`):
        gemv_tile: the default `(BLOCK_N, BLOCK_K, num_warps)`; BLOCK_K is the most reduction elements per load.
        gemv_gated_block_k: `(inputs of up to 1,024 features, wider)`: BLOCK_K of a gated program, which loads two
            weights and holds two product tiles.
        gemv_folded_norm_max_features: inputs of up to this many features fold the input norm into the products
            (`sum_k x_k g_k w_nk` and `sum_k x_k^2` in one pass, no program waits for the norm's reduction); wider
            inputs are normed in a pass before the products, which was faster for them.
        gemv_tiles: tuned tiles by `(out_features, in_features, gated)`.
    Several-row projections (`_decode_rows_kernel`, 2 to 16 rows):
        rows_tile: the default `(BLOCK_N, BLOCK_K, num_warps, num_stages)` of shapes without a tuned tile, whose
            reduction is split (SPLIT_K doubles up to rows_max_split_k) until the grid has rows_min_programs.
        rows_tiles: tuned `(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, swap_ab)` tiles by shape.
        rows_norm_chunk_elements: input elements per load of the norm's pass over the rows.
    Attention (`triton_attention_funaudiochat`):
        attention_programs_per_multiprocessor: split programs aimed for per multiprocessor (more splits mostly add
            merge work).
        attention_pipeline_stages: blocks in flight in the split kernel's software-pipelined loop, at batch sizes
            without an entry in attention_split_stages.
        attention_split_stages: blocks in flight by batch size, `((batch, stages), ...)` (3 at 16 rows: 1.5 % off
            the whole step on an H100, where one row's step did not gain).
        attention_max_merge_parts: the last split of a (row, KV head) merges the splits itself (no merge kernel)
            where query heads per KV head x splits (rounded up to a power of two) is at most this; its serial merge
            is slower than the merge kernel's program per query head beyond.
        attention_split_warps: warps of the split kernel by batch size, `((batch, warps), ...)`; others take
            attention_default_split_warps.
    Sampler and text head:
        sampler_num_warps: warps of the speech sampler's program per row.
        text_head_programs_per_multiprocessor: the persistent text head's programs per multiprocessor: a fraction
            of the GPU, so the CRQ's kernels beside it keep room on every multiprocessor.
        text_head_overlap_max_rows: batch rows up to which the fast backends overlap the text head (plan part
            `overlap_text_head`).
    """

    capability: tuple[int, int] | None = None
    multiprocessors: int = 132
    max_shared_memory: int | None = None
    programmatic_launch: bool = False
    gemv_tile: GemvTile = (8, 2048, 8)
    gemv_gated_block_k: tuple[int, int] = (512, 256)
    gemv_folded_norm_max_features: int = 1024
    gemv_tiles: TileTable = ()
    rows_tile: tuple[int, int, int, int] = (32, 128, 4, 3)
    rows_min_programs: int = 128
    rows_max_split_k: int = 8
    rows_tiles: TileTable = ()
    rows_norm_chunk_elements: int = 8192
    attention_programs_per_multiprocessor: int = 2
    attention_pipeline_stages: int = 2
    attention_split_stages: tuple[tuple[int, int], ...] = ((16, 3),)
    attention_max_merge_parts: int = 8
    attention_split_warps: tuple[tuple[int, int], ...] = ((1, 8),)
    attention_default_split_warps: int = 4
    sampler_num_warps: int = 8
    text_head_programs_per_multiprocessor: float = 0.5
    text_head_overlap_max_rows: int = 16

    @classmethod
    def for_device(cls, device: torch.device | str) -> DecodeKernelConfig:
        """The config for `device`: a CUDA GPU's capability, multiprocessors, shared memory per program and tuned
        tiles (for its capability; the defaults elsewhere); the defaults off CUDA."""
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return cls()
        properties = torch.cuda.get_device_properties(device)
        capability = (properties.major, properties.minor)
        gemv_tiles, rows_tiles = _TUNED_TILES.get(capability, ((), ()))
        shared = getattr(properties, "shared_memory_per_block_optin", 0) or None
        return cls(
            capability=capability,
            multiprocessors=properties.multi_processor_count,
            max_shared_memory=shared,
            programmatic_launch=capability >= (9, 0),
            gemv_tiles=gemv_tiles,
            rows_tiles=rows_tiles,
        )

    def replace(self, **changes) -> DecodeKernelConfig:
        """A copy with `changes` (field names; unknown names raise a ValueError naming the fields)."""
        unknown = sorted(set(changes) - {field.name for field in dataclasses.fields(self)})
        if unknown:
            known = ", ".join(field.name for field in dataclasses.fields(self))
            raise ValueError(f"DecodeKernelConfig has no field {', '.join(unknown)} (fields: {known}).")
        return dataclasses.replace(self, **{name: _frozen(value) for name, value in changes.items()})

    def gemv_kernel_tile(self, out_features: int, in_features: int, gated: bool) -> GemvTile:
        """`(BLOCK_N, BLOCK_K, num_warps)` of the one-row kernel for a projection of this shape: the tuned tile, or
        the defaults; BLOCK_K at most the next power of two of `in_features`."""
        block_n, block_k, num_warps = self.gemv_tile
        if gated:
            block_k = self.gemv_gated_block_k[0] if in_features <= 1024 else self.gemv_gated_block_k[1]
        tile = dict(self.gemv_tiles).get((out_features, in_features, gated), (block_n, block_k, num_warps))
        block_n, block_k, num_warps = tile
        return block_n, min(block_k, 1 << (in_features - 1).bit_length()), num_warps

    def rows_kernel_tile(self, out_features: int, in_features: int, gated: bool) -> RowsTile:
        """The several-row kernel's first-choice tile for a projection of this shape: the tuned one, or the default
        tile with its reduction split until the grid has `rows_min_programs` programs."""
        widest_k = max(16, 1 << (in_features - 1).bit_length())  # tl.dot takes at least 16 along each dimension
        tile = dict(self.rows_tiles).get((out_features, in_features, gated))
        if tile is None:
            block_n, block_k, num_warps, num_stages = self.rows_tile
            block_k = min(block_k, widest_k)
            split_k, tiles = 1, -(-out_features // block_n)
            while (split_k < self.rows_max_split_k and tiles * split_k < self.rows_min_programs
                   and 2 * split_k * block_k <= in_features):  # fmt: skip
                split_k *= 2
            tile = (block_n, block_k, split_k, num_warps, num_stages, False)
        block_n, block_k, split_k, num_warps, num_stages, swap_ab = tile
        block_n, block_k = max(block_n, MIN_ROWS_BLOCK_N), min(block_k, widest_k)
        # At most one split per reduction chunk (a split past the reduction's end would only add zeros).
        split_k = max(1, min(split_k, -(-in_features // block_k)))
        return block_n, block_k, split_k, num_warps, num_stages, bool(swap_ab)

    def attention_programs(self) -> int:
        """The split programs the attention aims for over the whole GPU."""
        return self.attention_programs_per_multiprocessor * self.multiprocessors

    def attention_num_warps(self, batch: int) -> int:
        """The split kernel's warps at this batch size."""
        return dict(self.attention_split_warps).get(batch, self.attention_default_split_warps)

    def attention_stages(self, batch: int) -> int:
        """The split kernel's blocks in flight at this batch size."""
        return dict(self.attention_split_stages).get(batch, self.attention_pipeline_stages)

    def text_head_programs(self) -> int:
        """The persistent text head kernel's grid: `text_head_programs_per_multiprocessor` per multiprocessor."""
        return max(1, round(self.text_head_programs_per_multiprocessor * self.multiprocessors))


def rows_tile_candidates(tile: RowsTile) -> Iterator[RowsTile]:
    """`tile`, then the smaller tiles the several-row launcher tries, in order, where a tile needs more shared memory
    than a program may use (a float32 model doubles the buffers of the bfloat16-tuned tiles; other GPUs have less per
    program): fewer pipeline stages (down to 1), then half the reduction chunk (down to 32), then half the columns
    (down to `MIN_ROWS_BLOCK_N`)."""
    block_n, block_k, split_k, num_warps, num_stages, swap_ab = tile
    yield tile
    while num_stages > 1:
        num_stages -= 1
        yield block_n, block_k, split_k, num_warps, num_stages, swap_ab
    while block_k > 32:
        block_k //= 2
        yield block_n, block_k, split_k, num_warps, num_stages, swap_ab
    while block_n > MIN_ROWS_BLOCK_N:
        block_n //= 2
        yield block_n, block_k, split_k, num_warps, num_stages, swap_ab


def _frozen(value):
    """Lists (from JSON) as tuples, recursively, and mappings as sorted item tuples: a config field stays hashable."""
    if isinstance(value, dict):
        return tuple(sorted((_frozen(key), _frozen(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


__all__ = ["DecodeKernelConfig", "rows_tile_candidates", "supports_programmatic_launch"]
