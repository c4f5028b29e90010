"""Compare `generate_speech(backend="compiled", compile_config=...)` configurations on one model build: ms per LLM step for each.

    python scripts/compile_sweep.py default \
        '{"fullgraph": true, "dynamic": false, "mode": "max-autotune"}' \
        '{"fullgraph": true, "dynamic": false, "options": {"triton.cudagraphs": true, "coordinate_descent_tuning": true}}'

Each argument is one `compile_config` value (the GenerationConfig field: torch.compile options) as JSON, or `default`
(what `scripts/benchmark.py` passes: none on CUDA, dynamo's eager backend on CPU). A dict updates the step parts'
defaults (`generation_plan_funaudiochat.STEP_COMPILE_DEFAULTS`: `fullgraph=True, dynamic=False`; on CUDA the whole step
is one CUDA graph, so the mode "reduce-overhead" is dropped and "max-autotune" runs as "max-autotune-no-cudagraphs");
the prefill's layer halves take only its `backend`. The step time is `scripts/benchmark_chat.py`'s slope between runs of
`steps // 4` and `steps` LLM steps (median of `--repeats`), on one random-weight full-size model, so the
configurations are measured side by side. Prints one line per configuration; record results in docs/performance.md by
hand (this script does not write it). Smoke test on CPU:
`python scripts/compile_sweep.py --tiny --device cpu --steps 4 '{"backend": "eager", "fullgraph": true}'`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
import benchmark  # noqa: E402  (same folder: its options)
import benchmark_chat  # noqa: E402  (its model builder, inputs and step timing)
import benchmark_common  # noqa: E402
import benchmark_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="compile_config= values as JSON, or `default`")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny random configs from tests/fixtures (smoke test)")
    args = parser.parse_args(argv)
    configs = [None if text == "default" else json.loads(text) for text in args.configs]

    bench_args = benchmark.parse_args(
        ["--device", args.device, "--repeats", str(args.repeats), "--steps", str(args.steps)]
        + (["--tiny"] if args.tiny else [])
    )
    benchmark.raise_recompile_limits()
    model, info = benchmark_chat.build_chat_model(bench_args)
    print(f"built {info['parameters'] / 1e9:.2f} G parameters ({info['dtype']}) in {info['build_s']} s", flush=True)
    inputs = benchmark_chat.make_chat_inputs(model, args.batch, bench_args.input_seconds, args.device)
    status = 0
    for config in configs:
        bench_args.compile_config = None if config is None else json.dumps(config)
        start = time.perf_counter()
        try:
            m = benchmark_chat.measure_step_time(
                model, inputs, "compiled", bench_args, args.device, max(1, args.steps // 4), args.steps
            )
        except Exception as error:  # one failing configuration must not hide the others
            print(f"{config or 'default'}: failed: {benchmark_common.one_line(error)}", flush=True)
            status = 1
            continue
        print(
            f"{config or 'default'}: {m['ms_per_step']:.2f} ms/step (spread {m['spread_ms']:.2f}), batch {args.batch}, "
            f"compile {m['compile_s']:.0f} s, prefill + call overhead {m['fixed_s'] * 1e3:.0f} ms, "
            f"peak {benchmark_report.fmt(m['peak_gb'])} GB, {time.perf_counter() - start:.0f} s in all",
            flush=True,
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
