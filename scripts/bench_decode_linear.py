"""Micro-benchmark of the decode step's projections on one GPU: compiled torch (cuBLAS) vs the Triton GEMV kernels.

    python scripts/bench_decode_linear.py [--rows 1,2]

For every projection of a CRQ layer (fused q/k/v and gate/up) and of an LLM layer (its own weights), bfloat16, at
full size: µs per call of the compiled torch composition the kernel replaces (RMSNorm, `F.linear`, SiLU · up,
residual add; cuBLAS GEMMs) and of `triton_linear_funaudiochat.decode_linear`, each timed as one CUDA graph of one call
per layer (`triton.testing.do_bench_cudagraph`), every layer with its own weights so they are read from HBM as in a
decode step, not from L2; the weight bytes / time and the largest difference.
"""

from __future__ import annotations

import argparse

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
]


def torch_composition(x, weight, norm_weight, residual, gated, up_weight):
    """What the kernel computes, as transformers' modules compute it (bf16 rounding at the same places)."""
    if norm_weight is not None:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = norm_weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)
    if gated:
        if up_weight is None:
            gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
        else:
            gate, up = torch.nn.functional.linear(x, weight), torch.nn.functional.linear(x, up_weight)
        out = torch.nn.functional.silu(gate) * up
    else:
        out = torch.nn.functional.linear(x, weight)
    return out if residual is None else residual + out


def main(argv: list[str] | None = None) -> None:
    import triton

    from funaudiochat_hf.triton_linear_funaudiochat import launch_decode_linear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1", help="comma-separated input rows (batch size of a decode step)")
    args = parser.parse_args(argv)
    compiled = torch.compile(torch_composition, fullgraph=True, dynamic=False)
    options = dict(device="cuda", dtype=torch.bfloat16)
    print("| stack | projection | rows | out × in | torch compiled (µs) | Triton (µs) | Triton TB/s | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for stack, name, out_features, in_features, norm, gated, residual, separate_up, layers in PROJECTIONS:
            weight_rows = out_features * (2 if gated and not separate_up else 1)
            weights = [torch.randn(weight_rows, in_features, **options) / 32 for _ in range(layers)]
            ups = [torch.randn(out_features, in_features, **options) / 32 if separate_up else None for _ in weights]
            x = torch.randn(rows, in_features, **options)
            norm_weight = torch.rand(in_features, **options) + 0.5 if norm else None
            residual_t = torch.randn(rows, out_features, **options) if residual else None

            def run_torch():
                for weight, up in zip(weights, ups):
                    compiled(x, weight, norm_weight, residual_t, gated, up)

            def run_kernels():
                for weight, up in zip(weights, ups):
                    launch_decode_linear(x, weight, None, norm_weight, 1e-6, residual_t, gated, up)

            expected = torch_composition(x, weights[0], norm_weight, residual_t, gated, ups[0]).float()
            got = launch_decode_linear(x, weights[0], None, norm_weight, 1e-6, residual_t, gated, ups[0]).float()
            times = []
            for fn in (run_torch, run_kernels):
                fn()
                torch.cuda.synchronize()
                times.append(triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3 / layers)
            weight_bytes = (weight_rows + (out_features if separate_up else 0)) * in_features * 2
            print(
                f"| {stack} | {name} | {rows} | {out_features} × {in_features} | {times[0]:.2f} | {times[1]:.2f} | "
                f"{weight_bytes / times[1] / 1e6:.2f} | {(got - expected).abs().max().item():.1e} |",
                flush=True,
            )
            del weights, ups


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("This micro-benchmark needs a CUDA device.")
    main()
