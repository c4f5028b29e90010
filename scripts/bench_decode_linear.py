"""Micro-benchmark of the decode step's projections on one GPU: compiled torch (cuBLAS) vs the Triton GEMV kernels.

    python scripts/bench_decode_linear.py [--rows 1,2] [--substep | --sweep-tiles]

For every projection of a CRQ layer (fused q/k/v and gate/up) and of an LLM layer (its own weights), bfloat16, at
full size: µs per call of the compiled torch composition the kernel replaces (RMSNorm, `F.linear`, SiLU · up,
residual add; cuBLAS GEMMs) and of `triton_linear_funaudiochat.decode_linear`, each timed as one CUDA graph of one call
per layer (`triton.testing.do_bench_cudagraph`), every layer with its own weights so they are read from HBM as in a
decode step, not from L2; the weight bytes / time and the largest difference.

`--sweep-tiles`: instead, each projection's µs per call for 11 kernel tiles (columns per program, warps, reduction
chunk: `DecodeKernelConfig.gemv_kernel_tile`) and the fastest, then a whole compiled CRQ sub-step and the LLM's 36
layers (one row, random weights) with the GPU's config (its tuned tiles) against one without tuned tiles, in
interleaved rounds (`--only NAME`: the sweep of the projections whose name contains NAME, e.g. "lm_head", without the
rounds).

`--sweep-rows-tiles [CRQ | LLM]`: the CRQ's (default) or the LLM's four projections at 16 rows (a batch-16 decode
step) through the several-row kernel (`DecodeKernelConfig.rows_kernel_tile`: columns per program, reduction chunk,
reduction splits,
warps), 12-14 tiles per shape against the compiled torch composition, and the fastest. The LLM's q, k and v are read
as three weights (`part_weights`), its gate and up as two; the torch column runs one GEMM over their concatenation.

With `--rows N` (N from 2 to 16) the table's kernel column is the several-row kernel.

`--attention-share`: the same steps at each of `--rows` with the attention kernels and with the attention operator
returning an empty tensor (outputs garbage, timing only), and the attention's µs per layer.

`--stack-ab VARIANT [VARIANT ...]`: whole compiled decode steps of the CRQ (a sub-step) and of the LLM's 36 layers at
each of `--rows`, once per variant, in `--rounds` interleaved rounds; a variant is a JSON object of
`DecodeKernelConfig` field overrides over the GPU's config (`'{}'` keeps it), passed down as `kernel_config`, e.g.
`--stack-ab '{}' '{"attention_split_warps": [[1, 4]]}' --rows 16,1`.

`--substep`: also one whole CRQ sub-step (the default config's 28 layers, random weights, a 1,280-position static
cache of which 700 are written), `decoder_stack_forward` compiled with the fused projections and the Triton attention,
with cuBLAS projections and with the kernels (`with_decode_kernels`), each replayed as a CUDA graph, and their largest
difference from the eager transformers CRQ.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch


# (stack, projection, out_features, in_features, norm, gated, residual, separate up, layers)
PROJECTIONS = [
    ("CRQ", "q/k/v (fused)", 4096, 1024, True, False, False, False, 28),
    ("CRQ", "o_proj", 1024, 2048, False, False, True, False, 28),
    ("CRQ", "gate/up (fused)", 3072, 1024, True, True, False, False, 28),
    ("CRQ", "down_proj", 1024, 3072, False, False, True, False, 28),
    ("LLM", "q_proj", 4096, 4096, True, False, False, False, 36),
    ("LLM", "k_proj / v_proj", 1024, 4096, True, False, False, False, 36),
    ("LLM", "o_proj", 4096, 4096, False, False, True, False, 36),
    ("LLM", "gate/up", 12288, 4096, True, True, False, True, 36),
    ("LLM", "down_proj", 4096, 12288, False, False, True, False, 36),
    # Around the CRQ stack, once per sub-step (5 per LLM step): the 6,565-way speech head; input_matching (1024 x
    # 4096) and output_matching (4096 x 1024, the final norm folded in) have the shapes of projections above.
    ("CRQ head", "lm_head", 6565, 4096, False, False, False, False, 5),
    # With `fold_crq_matching` (the default of a compiled loop): lm_head ∘ output_matching (its padded copy, the final
    # norm folded in) per sub-step, and input_matching ∘ pre_matching once per LLM step.
    ("CRQ head", "folded head", 6568, 1024, True, False, False, False, 5),
    ("CRQ head", "folded sub-inputs", 5120, 4096, False, False, False, False, 5),
]


def torch_composition(x, weight, norm, residual, gated, up_weight):
    """What the kernel computes, with transformers' `Qwen3RMSNorm` module `norm` (or None) and `F.linear`."""
    if norm is not None:
        x = norm(x)
    if gated:
        if up_weight is None:
            gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
        else:
            gate, up = torch.nn.functional.linear(x, weight), torch.nn.functional.linear(x, up_weight)
        out = torch.nn.functional.silu(gate) * up
    else:
        out = torch.nn.functional.linear(x, weight)
    return out if residual is None else residual + out


def _random_stack(config):
    """A transformers `Qwen3Model` of `config` on CUDA in bfloat16 (built in bfloat16: the LLM's 8B parameters would
    not fit twice in float32), random weights, norm weights around 1 as trained ones are."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            stack = Qwen3Model(copy.deepcopy(config)).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default_dtype)
    for parameter in stack.parameters():
        if parameter.ndim == 1:
            parameter.data.uniform_(0.5, 1.5)
    return stack


def _prefilled_decode_inputs(stack, batch: int, cache_length: int, written: int):
    """`(cache, mask, x, positions)`: a `cache_length` static cache whose first `written` positions hold a random
    prefill of `stack`, the next decode step's `(batch, cache_length)` mask (the prefill and the new position
    visible, as in a real step: nothing is written past it), and its `(batch, 1, hidden)` input and `(batch, 1)`
    positions."""
    from transformers import StaticCache

    from funaudiochat_hf.compat import cache_kwargs

    cache = StaticCache(config=stack.config, max_cache_len=cache_length)
    mask = torch.ones(batch, cache_length, dtype=torch.bool, device="cuda")
    hidden = stack.config.hidden_size
    with torch.no_grad():
        stack(
            inputs_embeds=torch.randn(batch, written, hidden, device="cuda", dtype=torch.bfloat16),
            attention_mask=mask,
            position_ids=torch.arange(written, device="cuda")[None].expand(batch, -1),
            use_cache=True,
            **cache_kwargs(cache),
        )
    mask[:, written + 1 :] = False
    x = torch.randn(batch, 1, hidden, device="cuda", dtype=torch.bfloat16)
    return cache, mask, x, torch.full((batch, 1), written, device="cuda")


def _replayable_step(step, stack, projections, x, mask, positions, cache, written: int, **step_kwargs):
    """A call of the compiled decode `step` that can be replayed: every call rewinds `cache` to `written` positions,
    so every replay writes the same position."""

    def call():
        for layer in cache.layers:
            layer.cumulative_length.fill_(written)
        return step(stack, projections, x, mask, positions, cache, **step_kwargs)

    return call


def _decode_stack_steps(rows: int, split_k_counters: bool = False):
    """`(name, step(kernel_config))` of a compiled `rows`-row decode step of the CRQ (28 layers, fused projections on
    the kernels, 1,280 cache positions of which 700 written) and of the LLM (36 layers, own weights, 640 / 350), random
    weights, through the Triton attention: `step(config)` is a replayable call ([`_replayable_step`]) whose kernels
    take `config` (a `DecodeKernelConfig`); `split_k_counters`: with the several-row kernel's counters."""
    from funaudiochat_hf import FunAudioChatConfig
    from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
    from funaudiochat_hf.decoder_stack_funaudiochat import decoder_stack_forward
    from funaudiochat_hf.fused_crq_funaudiochat import fused_crq_projections, with_decode_kernels
    from funaudiochat_hf.triton_attention_funaudiochat import register_triton_decode_attention

    attention = register_triton_decode_attention()
    step = torch.compile(decoder_stack_forward, fullgraph=True, dynamic=False)
    config = FunAudioChatConfig()
    for stack_name, stack_config, cache_length, written in (
        ("CRQ sub-step", config.audio_config.crq_transformer_config, 1280, 700),
        ("LLM", config.text_config, 640, 350),
    ):
        stack = _random_stack(stack_config)
        if stack_name == "LLM":
            projections = triton_linear.own_weight_kernels(stack)
        else:
            projections = with_decode_kernels(fused_crq_projections(stack))
        step_kwargs = {}
        if split_k_counters:
            step_kwargs["split_k_counters"] = triton_linear.split_k_counters_for(stack_config, "cuda", rows)
        cache, mask, x, positions = _prefilled_decode_inputs(stack, rows, cache_length, written)
        stack.config._attn_implementation = attention

        def with_config(kernel_config, stack=stack, projections=projections, inputs=(x, mask, positions, cache),
                        step_kwargs=step_kwargs):  # fmt: skip
            return _replayable_step(step, stack, projections, *inputs, written, kernel_config=kernel_config,
                                    **step_kwargs)  # fmt: skip

        yield stack_name, with_config


def crq_substep(rows: list[int], cache_length: int = 1280, written: int = 700) -> None:
    """CUDA-graph time of one compiled CRQ sub-step with cuBLAS projections and with the kernels."""
    import triton

    from funaudiochat_hf import FunAudioChatConfig
    from funaudiochat_hf.compat import cache_kwargs
    from funaudiochat_hf.decoder_stack_funaudiochat import decoder_stack_forward
    from funaudiochat_hf.fused_crq_funaudiochat import fused_crq_projections, with_decode_kernels
    from funaudiochat_hf.triton_attention_funaudiochat import register_triton_decode_attention

    crq = _random_stack(FunAudioChatConfig().audio_config.crq_transformer_config)
    fused = fused_crq_projections(crq)
    step = torch.compile(decoder_stack_forward, fullgraph=True, dynamic=False)
    attention = register_triton_decode_attention()
    print("| rows | cuBLAS projections (µs) | Triton kernels (µs) | ratio | max diff vs eager (cuBLAS / kernels) |")
    print("|---|---|---|---|---|")
    for batch in rows:
        cache, mask, x, positions = _prefilled_decode_inputs(crq, batch, cache_length, written)
        with torch.no_grad():
            caches = [copy.deepcopy(cache) for _ in range(3)]
            expected = crq(
                inputs_embeds=x, attention_mask=mask, position_ids=positions, use_cache=True, **cache_kwargs(caches[2])
            ).last_hidden_state.float()
            crq.config._attn_implementation = attention
            times, differences = [], []
            for layer_cache, projections in ((caches[0], fused), (caches[1], with_decode_kernels(fused))):
                call = _replayable_step(step, crq, projections, x, mask, positions, layer_cache, written)
                differences.append((call().float() - expected).abs().max().item())
                torch.cuda.synchronize()
                times.append(triton.testing.do_bench_cudagraph(call, rep=200) * 1e3)
            crq.config._attn_implementation = "sdpa"
        print(
            f"| {batch} | {times[0]:.0f} | {times[1]:.0f} | {times[0] / times[1]:.2f}× | "
            f"{differences[0]:.3f} / {differences[1]:.3f} |",
            flush=True,
        )


# (columns per program, warps, reduction chunk as a multiple of the default one) tried by `--sweep-tiles`
SWEPT_TILES = [(8, 8, 1), (8, 4, 1), (8, 4, 0.5), (4, 4, 1), (4, 8, 1), (16, 8, 0.5), (16, 8, 1), (16, 4, 0.25),
               (32, 8, 0.25), (4, 2, 1), (2, 4, 1)]  # fmt: skip


def sweep_tiles(only: str | None = None) -> None:
    """Per projection (one row, a chain of distinct weights per CUDA graph): µs per call of every `SWEPT_TILES` tile;
    `only`: the projections whose "stack projection" name contains it."""
    import triton

    from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    generic = DecodeKernelConfig.for_device("cuda").replace(gemv_tiles=())
    options = dict(device="cuda", dtype=torch.bfloat16)
    tiles = " | ".join(f"{n} col, {w} warps, k x{k}" for n, w, k in SWEPT_TILES)
    print(f"| stack | projection | {tiles} | fastest (columns, chunk, warps) |")
    print("|---|---|" + "---|" * (len(SWEPT_TILES) + 1))
    for stack, name, out_features, in_features, norm, gated, residual, separate_up, layers in PROJECTIONS:
        if only is not None and only not in f"{stack} {name}":
            continue
        weight_rows = out_features * (2 if gated and not separate_up else 1)
        weights = [torch.randn(weight_rows, in_features, **options) / 32 for _ in range(layers)]
        ups = [torch.randn(out_features, in_features, **options) / 32 if separate_up else None for _ in weights]
        x = torch.randn(1, in_features, **options)
        norm_weight = torch.rand(in_features, **options) + 0.5 if norm else None
        residual_t = torch.randn(1, out_features, **options) if residual else None
        arguments = [(x, w, None, norm_weight, 1e-6, residual_t, gated, up) for w, up in zip(weights, ups)]
        default_block_k = generic.gemv_kernel_tile(out_features, in_features, gated)[1]
        expected = triton_linear.launch_decode_linear(*arguments[0], config=generic).float()
        times = {}
        for block_n, warps, k_scale in SWEPT_TILES:
            tile = (block_n, max(16, int(default_block_k * k_scale)), warps)
            config = generic.replace(gemv_tiles={(out_features, in_features, gated): tile})
            got = triton_linear.launch_decode_linear(*arguments[0], config=config).float()
            error = (got - expected).abs().max().item()
            if error > 0.05:
                raise RuntimeError(f"{stack} {name}: tile {tile} is {error} off the default tile")

            def run(arguments=arguments, config=config):
                for args in arguments:
                    triton_linear.launch_decode_linear(*args, config=config)

            run()
            torch.cuda.synchronize()
            times[tile] = triton.testing.do_bench_cudagraph(run, rep=60) * 1e3 / layers
        cells = " | ".join(f"{t:.2f}" for t in times.values())
        print(f"| {stack} | {name} | {cells} | {min(times, key=times.get)} |", flush=True)
        del weights, ups


def _rows_tiles(out_features: int, in_features: int, gated: bool, min_programs: int = 128) -> list[tuple]:
    """About 12 `(BLOCK_N, BLOCK_K, SPLIT_K, num_warps)` of the several-row kernel for one shape: each (columns,
    chunk) pair with the smallest split that gives `min_programs` programs (no split left empty), then a few with twice
    the split or other warps."""
    import triton

    def splits(block_k):
        per_split = lambda s: triton.cdiv(triton.cdiv(in_features, s), block_k) * block_k  # noqa: E731
        return [s for s in (1, 2, 4, 8) if block_k <= in_features and (s - 1) * per_split(s) < in_features]

    tiles = []
    for block_n in (16, 32, 64):
        for block_k in (64, 128, 256):
            usable = splits(block_k)
            split = next((s for s in usable if triton.cdiv(out_features, block_n) * s >= min_programs), usable[-1])
            tiles.append((block_n, block_k, split, 8 if block_n * block_k * (1 + gated) >= 8192 else 4))
    for block_n, block_k, split, warps in list(tiles):
        if block_n == 16 and block_k in (64, 128) and 2 * split in splits(block_k):
            tiles.append((block_n, block_k, 2 * split, warps))
        if block_n == 32 and block_k == 128:
            tiles.append((block_n, block_k, split, 12 - warps))
        if block_n == 32 and block_k == 64 and 2 * split in splits(block_k):
            tiles.append((block_n, block_k, 2 * split, warps))
    return list(dict.fromkeys(tiles))[:12]


# The LLM's projections at several rows as the several-row kernel reads them: (name, output sizes of the weights read
# side by side (q, k, v: `part_weights`), in_features, norm, gated (gate and up two weights), residual).
LLM_ROWS_PROJECTIONS = [
    ("q/k/v (parts)", (4096, 1024, 1024), 4096, True, False, False),
    ("o_proj", (4096,), 4096, False, False, True),
    ("gate/up", (12288,), 4096, True, True, False),
    ("down_proj", (4096,), 12288, False, False, True),
]


def _llm_rows_tiles(out_features: int, in_features: int, gated: bool) -> list[tuple]:
    """`(BLOCK_N, BLOCK_K, SPLIT_K, num_warps)` candidates of the several-row kernel for an LLM-sized projection:
    64 to 128 columns, 64- or 128-wide chunks, 1 to 4 splits, grids of 128 to 1,100 programs."""
    import triton

    tiles = []
    for block_n in (32, 64, 128):
        for block_k in (64, 128):
            for split in (1, 2, 4):
                programs = triton.cdiv(out_features, block_n) * split
                if 128 <= programs <= 1100:
                    tiles.append((block_n, block_k, split, 8 if block_n * block_k * (1 + gated) >= 8192 else 4))
    return tiles


def _wide_rows_tiles(out_features: int, in_features: int, gated: bool) -> list[tuple]:
    """`--wide`: `(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, swap_ab)` candidates over the pipeline depth and
    the product's orientation too (SWAP_AB: the weight's columns as the MMA's M side, wgmma on Hopper, 64 columns or
    more), 2 or 4 stages (the tuned tiles have Triton's default, 3): 128- or 256-wide chunks (also 64 for inputs of
    2,048 or fewer), grids of 96 to 1,100 programs, no split left empty."""
    import triton

    tiles = []
    for block_n in (32, 64, 128):
        for block_k in (64, 128, 256) if in_features <= 2048 else (128, 256):
            for split in (1, 2, 4, 8):
                per_split = triton.cdiv(triton.cdiv(in_features, split), block_k) * block_k
                programs = triton.cdiv(out_features, block_n) * split
                if (split - 1) * per_split >= in_features or not 96 <= programs <= 1100:
                    continue
                warps = 8 if block_n * block_k * (1 + gated) >= 8192 else 4
                for swap_ab in (False, True) if block_n >= 64 else (False,):
                    for stages in (2, 4):
                        tiles.append((block_n, block_k, split, warps, stages, swap_ab))
    return tiles


def _prefetch_rows_tiles(out_features: int, in_features: int, gated: bool) -> list[tuple]:
    """`--prefetch`: `(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, swap_ab)` candidates whose split is a single
    chunk of 512 to 2,048 inputs, which a program fetches whole before waiting for the previous kernel (the kernel
    fetches its first chunk early): no weight read left after the wait. 16 to 64 columns, 4 or 8 warps (at most 256
    bytes of weights per thread), grids of 64 to 1,100 programs."""
    import triton

    tiles = []
    for block_n in (16, 32, 64):
        for block_k in (512, 1024, 2048):
            if block_k > max(512, triton.next_power_of_2(in_features)):
                continue
            split = triton.cdiv(in_features, block_k)
            if not 64 <= triton.cdiv(out_features, block_n) * split <= 1100:
                continue
            for warps in (4, 8):
                if block_n * block_k * 2 * (1 + gated) > warps * 32 * 256:  # at most 256 bytes per thread held
                    continue
                for swap_ab in (False, True) if block_n >= 64 else (False,):
                    tiles.append((block_n, block_k, split, warps, 2, swap_ab))
    return tiles


def _compile_worker(stack: str, tiles_by_name: dict, rows: int) -> int:
    """One process of `--jobs`: launches every tile of `tiles_by_name` once on zero inputs, so Triton's disk cache
    holds its kernel for the timing process; returns how many compiled."""
    import triton

    from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    device_config = DecodeKernelConfig.for_device("cuda").replace(max_shared_memory=None)  # every tile as it is
    counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    done = 0
    for name, out_features, in_features, norm, gated, residual, _, make in _rows_projections(stack, 1):
        if name not in tiles_by_name:
            continue
        weights = make()
        x = torch.zeros(rows, in_features, device="cuda", dtype=torch.bfloat16)
        norm_weight = torch.ones(in_features, device="cuda", dtype=torch.bfloat16) if norm else None
        residual_t = torch.zeros(rows, out_features, device="cuda", dtype=torch.bfloat16) if residual else None
        for tile in tiles_by_name.get(name, ()):
            config = device_config.replace(rows_tiles={(out_features, in_features, gated): tile})
            try:
                triton_linear.launch_decode_linear(
                    x, norm_weight=norm_weight, residual=residual_t, gated=gated, split_k_counters=counters,
                    config=config, **weights,
                )  # fmt: skip
                done += 1
            except triton.runtime.errors.OutOfResources:  # too much shared memory: the timing process skips it too
                pass
        del weights
    torch.cuda.synchronize()
    return done


def _precompile_rows_tiles(stack: str, tiles_by_name: dict, rows: int, jobs: int) -> None:
    """Compile the candidate kernels in `jobs` processes at once (Triton compiles one kernel at a time per process)."""
    import multiprocessing

    items = [(name, tile) for name, tiles in tiles_by_name.items() for tile in tiles]
    shares = [items[i::jobs] for i in range(jobs)]
    context = multiprocessing.get_context("spawn")
    with context.Pool(jobs) as pool:
        results = [
            pool.apply_async(_compile_worker, (stack, _group(share), rows))
            for share in shares if share
        ]  # fmt: skip
        compiled = sum(result.get() for result in results)
    print(f"precompiled {compiled} of {len(items)} kernels in {jobs} processes", flush=True)


def _group(items):
    """`[(name, tile), ...]` -> `{name: [tile, ...]}`."""
    grouped = {}
    for name, tile in items:
        grouped.setdefault(name, []).append(tile)
    return grouped


def _rows_projections(stack: str, layers: int):
    """`(name, out_features, in_features, norm, gated, residual, tiles, make_weights)` of `stack`'s projections at
    several rows; `make_weights()` gives the `launch_decode_linear` weight keyword arguments of one layer."""
    options = dict(device="cuda", dtype=torch.bfloat16)
    if stack == "CRQ":
        for stack_name, name, out_features, in_features, norm, gated, residual, _, _ in PROJECTIONS:
            if stack_name != "CRQ":
                continue
            shape = ((1 + gated) * out_features, in_features)  # the gate/up weight fused
            tiles = _rows_tiles(out_features, in_features, gated)
            yield name, out_features, in_features, norm, gated, residual, tiles, lambda shape=shape: {
                "weight": torch.randn(shape, **options) / 32
            }
        return
    for name, sizes, in_features, norm, gated, residual in LLM_ROWS_PROJECTIONS:
        def make(sizes=sizes, in_features=in_features, gated=gated):
            weights = [torch.randn(n, in_features, **options) / 32 for n in sizes]
            if gated:
                return {"weight": weights[0], "up_weight": torch.randn_like(weights[0]) / 32}
            return {"weight": weights[0], "part_weights": weights[1:]}

        out_features = sum(sizes)
        tiles = _llm_rows_tiles(out_features, in_features, gated)
        yield name, out_features, in_features, norm, gated, residual, tiles, make


def sweep_rows_tiles(rows: int = 16, stack: str = "CRQ", wide: bool = False, jobs: int = 0, prefetch: bool = False
                     ) -> dict:  # fmt: skip
    """The CRQ's (or the LLM's) projections at `rows` rows: µs per call of the compiled torch composition and of the
    several-row kernel with each candidate tile (a chain of 28 / 36 distinct weights per CUDA graph), and the
    fastest; returns the fastest tile by `(out_features, in_features, gated)`, as `DecodeKernelConfig.rows_tiles` keys
    them.
    `wide`: the candidates of `_wide_rows_tiles` (pipeline depths, SWAP_AB) and each shape's tuned tile; `prefetch`:
    those of `_prefetch_rows_tiles` (whole splits fetched before the wait) and the tuned tile; `jobs` > 1:
    compiled first in that many processes. A tile that does not fit the GPU (shared memory) is skipped."""
    import triton
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from funaudiochat_hf import triton_linear_funaudiochat as triton_linear
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    device_config = DecodeKernelConfig.for_device("cuda").replace(max_shared_memory=None)  # every tile as it is
    compiled = torch.compile(torch_composition, fullgraph=True, dynamic=False)
    options = dict(device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    layers = 28 if stack == "CRQ" else 36
    print(f"{stack}, {rows} rows, µs per call; tiles (columns, chunk, splits, warps)")
    print("| projection | torch compiled | tiles | fastest |\n|---|---|---|---|")
    tuned = dict(device_config.rows_tiles)
    fastest_tiles = {}
    projections = list(_rows_projections(stack, layers))
    ranked_report = wide or prefetch  # the fastest tiles and the tuned one, not every candidate
    if ranked_report:
        candidates = _prefetch_rows_tiles if prefetch else _wide_rows_tiles
        projections = [
            (*p[:6], [*([tuned[p[1], p[2], p[4]]] if (p[1], p[2], p[4]) in tuned else []),
                      *candidates(p[1], p[2], p[4])], p[7])
            for p in projections
        ]  # fmt: skip
    if jobs > 1:
        _precompile_rows_tiles(stack, {p[0]: p[6] for p in projections}, rows, jobs)
    for name, out_features, in_features, norm, gated, residual, tiles, make in projections:
        weights = [make() for _ in range(layers)]
        x = torch.randn(rows, in_features, **options)
        norm_module = Qwen3RMSNorm(in_features, eps=1e-6).to(**options).requires_grad_(False) if norm else None
        norm_weight = None if norm_module is None else norm_module.weight
        residual_t = torch.randn(rows, out_features, **options) if residual else None

        # torch: the parts' outputs side by side as one GEMM over their concatenation.
        concatenated = [{**w, "weight": torch.cat([w["weight"], *w["part_weights"]]), "part_weights": []}
                        if w.get("part_weights") else w for w in weights]  # fmt: skip
        first = concatenated[0]
        expected = torch_composition(x, first["weight"], norm_module, residual_t, gated, first.get("up_weight")).float()
        # bf16 outputs: one rounding of the largest magnitude apart from cuBLAS's (another summation order).
        tolerance = 0.05 + expected.abs().max().item() / 64

        def run_torch():
            for w in concatenated:
                compiled(x, w["weight"], norm_module, residual_t, gated, w.get("up_weight"))

        def kernel(w, config):
            return triton_linear.launch_decode_linear(
                x, norm_weight=norm_weight, residual=residual_t, gated=gated, split_k_counters=counters,
                config=config, **w,
            )  # fmt: skip

        def run_kernel(config):
            for w in weights:
                kernel(w, config)

        run_torch()
        torch.cuda.synchronize()
        torch_us = triton.testing.do_bench_cudagraph(run_torch, rep=60) * 1e3 / layers
        times = {}
        for tile in dict.fromkeys(tiles):
            config = device_config.replace(rows_tiles={(out_features, in_features, gated): (*tile, 3, False)[:6]})
            try:
                got = kernel(weights[0], config).float()
            except triton.runtime.errors.OutOfResources:
                continue
            if not torch.isfinite(got).all() or (got - expected).abs().max().item() > tolerance or counters.any():
                raise RuntimeError(f"{name}: tile {tile} is off the torch composition (or left its counters set)")
            run_kernel(config)
            torch.cuda.synchronize()
            times[tile] = triton.testing.do_bench_cudagraph(lambda: run_kernel(config), rep=60) * 1e3 / layers
        ranked = sorted(times, key=times.get)
        cells = ", ".join(f"{tile}: {times[tile]:.2f}" for tile in (ranked[:8] if ranked_report else times))
        fastest = ranked[0]
        tuned_cell = ""
        if ranked_report and (out_features, in_features, gated) in tuned:
            tuned_tile = tuned[out_features, in_features, gated]
            tuned_cell = f" (tuned {tuned_tile}: {times.get(tuned_tile, float('nan')):.2f}; {len(times)} tiles)"
        print(f"| {name} | {torch_us:.2f} | {cells} | {fastest}: {times[fastest]:.2f}{tuned_cell} |", flush=True)
        fastest_tiles[(out_features, in_features, gated)] = fastest
        del weights, concatenated, first
    return fastest_tiles


def tuned_tiles_ab(rounds: int = 5) -> None:
    """A compiled one-row decode step of the CRQ (28 layers, fused projections) and of the LLM (36 layers, own
    weights), random weights, with the GPU's config (its tuned GEMV tiles) and without tuned tiles: µs per step,
    median (range)."""
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    tuned = DecodeKernelConfig.for_device("cuda")
    variants = {"tuned": tuned, "default": tuned.replace(gemv_tiles=())}
    print("| stack (one row) | tuned tiles (µs) | default tiles (µs) |\n|---|---|---|")
    for stack_name, _, times, _ in _stack_rounds(variants, [1], rounds):
        print(f"| {stack_name} | {_median_cells(times)} |", flush=True)


def rows_tiles_ab(candidate: dict, rows: int = 16, rounds: int = 5) -> None:
    """A compiled decode step of `rows` rows through the several-row kernel, of the CRQ and of the LLM
    ([`_decode_stack_steps`]), with the GPU's config and with its `rows_tiles` updated by `candidate`: µs per step,
    median (range) of interleaved rounds, and the largest difference of their outputs."""
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    tuned = DecodeKernelConfig.for_device("cuda")
    candidate = {shape: (*tile, 3, False)[:6] for shape, tile in candidate.items()}
    variants = {"tuned": tuned, "candidate": tuned.replace(rows_tiles={**dict(tuned.rows_tiles), **candidate})}
    print(f"| stack ({rows} rows) | tuned tiles (µs) | candidate tiles (µs) |\n|---|---|---|")
    for stack_name, _, times, outputs in _stack_rounds(variants, [rows], rounds):
        difference = (outputs["tuned"] - outputs["candidate"]).abs().max().item()
        print(f"| {stack_name} | {_median_cells(times)} | (max difference {difference:.3f})", flush=True)


def stack_configs_ab(variants: list[str], rows: list[int], rounds: int = 5) -> None:
    """Compiled decode steps of the CRQ and of the LLM ([`_decode_stack_steps`], the several-row kernel's counters
    given) at each of `rows`, once per variant: a variant is a JSON object of `DecodeKernelConfig` field overrides
    over the GPU's config ("{}" keeps it), passed down as `kernel_config`. µs per step, median (range) of interleaved
    rounds, and each variant's largest difference from the first's output."""
    import json

    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    device_config = DecodeKernelConfig.for_device("cuda")
    configs = {variant or "{}": device_config.replace(**json.loads(variant or "{}")) for variant in variants}
    print(f"| stack | rows | {' | '.join(f'{name} (µs)' for name in configs)} | max difference from the first |")
    print(f"|---|---|{'---|' * len(configs)}---|")
    for stack_name, batch, times, outputs in _stack_rounds(configs, rows, rounds):
        first = next(iter(outputs.values()))
        difference = max((output - first).abs().max().item() for output in outputs.values())
        print(f"| {stack_name} | {batch} | {_median_cells(times)} | {difference:.3g} |", flush=True)


def attention_share(rows: list[int], rounds: int = 3) -> None:
    """Both stacks' compiled decode steps ([`_decode_stack_steps`]) at each of `rows`, with the attention kernels and
    with the attention operator returning an empty tensor (outputs garbage; timing only): µs per step, median (range)
    of interleaved rounds, and the attention's µs per layer. (The stand-in replaces a function for the "without"
    step only; it is a measurement of the attention's share, not a kernel variant.)"""
    import triton

    from funaudiochat_hf import triton_attention_inputs_funaudiochat as attention_inputs
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    def no_attention(query, key, value, mask, scaling, inputs=None, counters=None, config=None):
        heads = query.shape[1] if inputs is None else query.shape[1] // key.shape[-1]
        return query.new_empty(key.shape[0], 1, heads, key.shape[-1])

    config = DecodeKernelConfig.for_device("cuda")
    print("| stack | rows | with the attention (µs) | without (µs) | attention per layer (µs) |\n|---|---|---|---|---|")
    for batch in rows:
        for stack_name, step in _decode_stack_steps(batch, split_k_counters=True):
            call = step(config)
            times = {"with": [], "without": []}
            original = attention_inputs.launch_decode_attention
            with torch.no_grad():
                for _ in range(rounds):
                    for variant in times:
                        attention_inputs.launch_decode_attention = original if variant == "with" else no_attention
                        try:
                            call()
                            torch.cuda.synchronize()
                            times[variant].append(triton.testing.do_bench_cudagraph(call, rep=150) * 1e3)
                        finally:
                            attention_inputs.launch_decode_attention = original
            layers = 28 if stack_name.startswith("CRQ") else 36
            share = (statistics.median(times["with"]) - statistics.median(times["without"])) / layers
            print(f"| {stack_name} | {batch} | {_median_cells(times)} | {share:.1f} |", flush=True)


def _stack_rounds(configs: dict, rows: list[int], rounds: int):
    """`(stack name, rows, times, outputs)` of [`_interleaved_rounds`] over both stacks' decode steps
    ([`_decode_stack_steps`], the several-row kernel's counters given) at each of `rows`, one call per
    `DecodeKernelConfig` of `configs` (each compiles and records its own graphs)."""
    for batch in rows:
        for stack_name, step in _decode_stack_steps(batch, split_k_counters=True):
            calls = {name: step(config) for name, config in configs.items()}
            yield stack_name, batch, *_interleaved_rounds(calls, rounds)


def _interleaved_rounds(calls: dict, rounds: int):
    """`({variant: [µs per call, one per round]}, {variant: float32 output})`: each variant's call replayed as a CUDA
    graph in turn, `rounds` times."""
    import triton

    times = {variant: [] for variant in calls}
    outputs = {}
    with torch.no_grad():
        for _ in range(rounds):
            for variant, call in calls.items():
                outputs[variant] = call().float()
                torch.cuda.synchronize()
                times[variant].append(triton.testing.do_bench_cudagraph(call, rep=150) * 1e3)
    return times, outputs


def _median_cells(times: dict) -> str:
    return " | ".join(f"{statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f})" for t in times.values())


def main(argv: list[str] | None = None) -> None:
    import triton
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from funaudiochat_hf.triton_linear_funaudiochat import launch_decode_linear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1", help="comma-separated input rows (batch size of a decode step)")
    parser.add_argument("--substep", action="store_true", help="also time a whole compiled CRQ sub-step")
    parser.add_argument("--sweep-tiles", action="store_true", help="sweep the kernel's tiles (one row) instead")
    parser.add_argument("--only", default=None, help="--sweep-tiles: only the projections whose name contains this")
    parser.add_argument("--sweep-rows-tiles", nargs="?", const="CRQ", choices=["CRQ", "LLM", "CRQ,LLM"], default=None,
                        help="sweep the several-row kernel's tiles instead, over the CRQ's (default) or the LLM's "
                        "projections (or both)")  # fmt: skip
    parser.add_argument("--wide", action="store_true",
                        help="--sweep-rows-tiles: also sweep pipeline depths and SWAP_AB, then time both stacks' "
                        "decode steps with the fastest tiles against the GPU's tuned tiles")  # fmt: skip
    parser.add_argument("--prefetch", action="store_true",
                        help="--sweep-rows-tiles: sweep tiles whose whole split is fetched before the wait instead, "
                        "then time both stacks' decode steps with the fastest against the GPU's tuned tiles")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=0, help="--sweep-rows-tiles: compile candidates in N processes")
    parser.add_argument("--rows-ab", default=None, metavar="TILES",
                        help="time both stacks' 16-row decode steps with the GPU's several-row tiles updated by TILES "
                        "(a Python dict literal) against them")  # fmt: skip
    parser.add_argument("--stack-ab", nargs="+", default=None, metavar="VARIANT",
                        help="time both stacks' compiled decode steps at each --rows once per VARIANT, a JSON object "
                        "of DecodeKernelConfig field overrides ('{}' = the GPU's config), interleaved rounds")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="--stack-ab, --attention-share: interleaved rounds")
    parser.add_argument("--attention-share", action="store_true",
                        help="time both stacks' compiled decode steps at each --rows with and without the attention")
    args = parser.parse_args(argv)
    if args.attention_share:
        attention_share([int(r) for r in args.rows.split(",")], args.rounds)
        return
    if args.stack_ab:
        stack_configs_ab(args.stack_ab, [int(r) for r in args.rows.split(",")], args.rounds)
        return
    if args.rows_ab:
        import ast

        rows_tiles_ab(ast.literal_eval(args.rows_ab))
        return
    if args.sweep_rows_tiles:
        fastest = {}
        for stack in args.sweep_rows_tiles.split(","):
            fastest.update(sweep_rows_tiles(stack=stack, wide=args.wide, jobs=args.jobs, prefetch=args.prefetch))
        print(f"fastest: {fastest!r}", flush=True)
        if args.wide or args.prefetch:
            rows_tiles_ab(fastest)
        return
    if args.sweep_tiles:
        sweep_tiles(args.only)
        if args.only is None:
            tuned_tiles_ab()
        return
    rows = [int(r) for r in args.rows.split(",")]
    # One graph per projection shape and row count: more than dynamo's default 8 recompilations of one function.
    torch._dynamo.config.recompile_limit = 8 * len(PROJECTIONS) * len(rows)
    compiled = torch.compile(torch_composition, fullgraph=True, dynamic=False)
    options = dict(device="cuda", dtype=torch.bfloat16)
    print("| stack | projection | rows | out × in | torch compiled (µs) | Triton (µs) | Triton TB/s | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in rows:
        for stack, name, out_features, in_features, norm, gated, residual, separate_up, layers in PROJECTIONS:
            weight_rows = out_features * (2 if gated and not separate_up else 1)
            weights = [torch.randn(weight_rows, in_features, **options) / 32 for _ in range(layers)]
            ups = [torch.randn(out_features, in_features, **options) / 32 if separate_up else None for _ in weights]
            x = torch.randn(batch, in_features, **options)
            norm_module = None
            if norm:
                norm_module = Qwen3RMSNorm(in_features, eps=1e-6).to(**options).requires_grad_(False)
                norm_module.weight.data.uniform_(0.5, 1.5)
            norm_weight = None if norm_module is None else norm_module.weight
            residual_t = torch.randn(batch, out_features, **options) if residual else None

            def run_torch():
                for weight, up in zip(weights, ups):
                    compiled(x, weight, norm_module, residual_t, gated, up)

            counters = torch.zeros(1024, dtype=torch.int32, device="cuda")  # the several-row kernel's (2-16 rows)

            def run_kernels():
                for weight, up in zip(weights, ups):
                    launch_decode_linear(
                        x, weight, None, norm_weight, 1e-6, residual_t, gated, up, None, (), (), counters
                    )

            expected = torch_composition(x, weights[0], norm_module, residual_t, gated, ups[0]).float()
            got = launch_decode_linear(
                x, weights[0], None, norm_weight, 1e-6, residual_t, gated, ups[0], None, (), (), counters
            ).float()
            times = []
            for fn in (run_torch, run_kernels):
                fn()
                torch.cuda.synchronize()
                times.append(triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3 / layers)
            weight_bytes = (weight_rows + (out_features if separate_up else 0)) * in_features * 2
            print(
                f"| {stack} | {name} | {batch} | {out_features} × {in_features} | {times[0]:.2f} | {times[1]:.2f} | "
                f"{weight_bytes / times[1] / 1e6:.2f} | {(got - expected).abs().max().item():.1e} |",
                flush=True,
            )
            del weights, ups
    if args.substep:
        crq_substep(rows)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("This micro-benchmark needs a CUDA device.")
    main()
