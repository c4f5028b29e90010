#!/usr/bin/env python
"""Speed benchmark for Fun-Audio-Chat speech-to-speech: the chat loop (LLM + CRQ) and the CosyVoice3 decoder.

Builds the full-size architectures with random weights directly on the device (weight values do not change the cost of
a step), feeds processor-shaped random inputs (a spoken "question" of `--input-seconds`), and measures:

chat part (`FunAudioChatForConditionalGeneration.generate_speech`), per mode (eager / compiled) x batch size:
    * ms per LLM step = slope between two runs with different `max_new_tokens` (prefill, compile and other one-off costs
      cancel), text EOS disabled so every run does the full number of steps; one LLM step = 1 text + 5 speech tokens =
      0.2 s of output audio, so real-time factor = step ms / 200 ms and aggregate x real time = batch * 200 / step ms;
    * the floor = bytes read per step (LLM weights without the input embedding + 5 x (CRQ body + input/output matching
      + speech head) + pre_matching + the KV cache read at the mean context) / measured device copy bandwidth (the
      gpt-fast KPI: achieved GB/s = weight bytes / step time);
    * compile time (first call minus a warm call), peak memory, the CRQ share of a step (`disable_speech=True` vs
      normal), time to the first audio chunk of `generate_speech_stream` with the full-size decoder (hop 15), and
      memory before/after 100 consecutive short calls.
decoder part (`CosyVoice3Token2Wav`, float32): offline RTF for 10 s and 30 s of tokens (25 tokens/s), streaming at hop
15 (RTF, first chunk latency after its tokens arrive, max per-chunk time), peak memory; eager and compiled.

Every measurement is isolated: a failure is recorded in the table as "failed: <reason>" and the run goes on. Work is
ordered by importance and stops when `--time-budget` seconds are spent. Results are printed as markdown tables, written
to `--markdown PATH` when given, and written as JSON + markdown to $OUT/benchmark.{json,md} when OUT is set.
`--from-json FILE` renders the tables of a JSON written on another machine (printed, and to `--markdown PATH`). How to
read the numbers and the recorded results: docs/performance.md.

The pieces: `benchmark_common.py` (paths, constants, device helpers), `benchmark_results.py` (time budget, results,
isolated measurements), `benchmark_chat.py` and `benchmark_decoder.py` (builders, inputs and rows of each part),
`benchmark_report.py` (the markdown tables); this file parses the options, plans the rows and runs them.

    python scripts/benchmark.py --markdown results.md            # full size, on cuda
    python scripts/benchmark.py --tiny --device cpu --steps 4    # smoke test of the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch


SCRIPTS = str(Path(__file__).resolve().parent)
if SCRIPTS not in sys.path:  # the benchmark_* modules beside this file, also when it is loaded by path
    sys.path.insert(0, SCRIPTS)

from benchmark_chat import (  # noqa: E402
    build_chat_model,
    chat_step_row,
    compare_row,
    crq_share_row,
    repeat_calls_row,
    ttfa_row,
)
from benchmark_common import is_cuda, log, measure_copy_bandwidth, one_line  # noqa: E402
from benchmark_decoder import (  # noqa: E402
    apply_decoder_precision,
    build_decoder,
    compile_decoder,
    decoder_offline_row,
    decoder_precision_row,
    decoder_stream_row,
)
from benchmark_report import fmt, render_markdown, write_markdown  # noqa: E402
from benchmark_results import Budget, BudgetExceeded, Results, run_measurement  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny random configs from tests/fixtures (smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=128, help="LLM steps of the long timing run (short run: steps // 4)")
    p.add_argument("--eager-steps", type=int, default=32, help="cap on --steps in eager mode (slow per step)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions of each run, median (3; 1 with --tiny)")
    p.add_argument("--batch-sizes", default=None, help="1,4,16 (1,2 with --tiny)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--parts", default="chat,decoder")
    p.add_argument("--input-seconds", type=float, default=None, help="spoken question length (10; 2 with --tiny)")
    p.add_argument("--chat-dtype", default="auto", help="auto = bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--compile-config", default=None,
        help='generate_speech(compile_config=...) of the compiled rows as JSON, e.g. \'{"mode": "max-autotune"}\'',
    )
    p.add_argument(
        "--chat-backend", default="compiled", choices=["compiled", "cuda_graphs", "auto"],
        help="generate_speech(backend=...) of the chat's non-eager rows (their mode is still labelled 'compiled')",
    )
    p.add_argument(
        "--plan-overrides", default=None,
        help='SpeechGenerator(plan_overrides=...) as JSON, e.g. \'{"fold_crq_matching": false}\' (debugging)',
    )
    p.add_argument(
        "--compile-vocoder", action="store_true",
        help="compiled decoder mode also runs decoder.compile_vocoder() (HiFT's upsampling stack, dynamic shapes)",
    )
    p.add_argument(
        "--eager-prefill", action="store_true",
        help="also measure the time to first audio with backend='cuda_graphs' (no compiled prefill), side by side",
    )
    p.add_argument(
        "--kernel-config", default=None, metavar="JSON",
        help="DecodeKernelConfig field overrides for every chat call, e.g. '{\"attention_pipeline_stages\": 3}'\n"
             "(model.speech_generator(kernel_config=DecodeKernelConfig.for_device(device).replace(**JSON)))",
    )
    p.add_argument(
        "--plain-launches", action="store_true",
        help="the Triton decode kernels without programmatic dependent launch: --kernel-config's\n"
             "{\"programmatic_launch\": false}",
    )
    p.add_argument("--decoder-compile-config", default=None, help="JSON kwargs for the decoder's compile helper")
    p.add_argument(
        "--decoder-precision", default="auto", choices=["auto", "float32", "tf32", "bfloat16", "float16"],
        help="DiT estimator precision: auto (the decoder's default: bfloat16 on CUDA, float32 elsewhere); float32;\n"
        "tf32 (float32 + torch.backends.cuda.matmul.allow_tf32 = True); bfloat16 / float16\n"
        "(use_low_precision_estimator()). A precision check row compares it with float32",
    )
    p.add_argument(
        "--channels-last-vocoder", action="store_true",
        help="run HiFT's filter channels-last in every decoder row (decoder.hift.use_channels_last_convolutions())",
    )
    p.add_argument("--decoder-tests", default="offline,stream", help="which decoder measurements to run")
    p.add_argument("--decoder-modes", default=None, help="decoder modes (default: --modes)")
    p.add_argument(
        "--stream-options", default=None,
        help='JSON kwargs for streaming_decoder(), e.g. \'{"flow_left_context_tokens": 100}\''
    )
    p.add_argument("--hop", type=int, default=15, help="streaming decoder token hop")
    p.add_argument("--decoder-seconds", default=None, help="decoder reply lengths (10,30; 1,2 with --tiny)")
    p.add_argument("--no-crq-share", dest="crq_share", action="store_false",
                   help="skip the compiled CRQ-share row (one more compile of the step, ~1 min on an H200)")
    p.add_argument("--ttfa-steps", type=int, default=None, help="max_new_tokens of the TTFA stream (40; 12 tiny)")
    p.add_argument("--repeat-calls", type=int, default=None, help="consecutive short calls (100; 3 with --tiny)")
    p.add_argument("--repeat-steps", type=int, default=8, help="max_new_tokens of each repeated call")
    p.add_argument(
        "--cache-steps", type=int, default=0,
        help="size the static caches for this many new tokens (a long max_new_tokens, the reply ending sooner);\n"
             "default: the longest measured run",
    )
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds; remaining measurements are skipped")
    p.add_argument("--bandwidth-mb", type=int, default=None, help="copy buffer size (default 2048 cuda, 64 cpu)")
    p.add_argument(
        "--compare", nargs="+", default=None, metavar="JSON",
        help="measure only chat variants, side by side: each a JSON object of generate_speech keyword arguments\n"
             "(e.g. '{\"plan_overrides\": {\"overlap_text_head\": false}}' '{}'), every round measuring each in turn, per batch size. A\n"
             "variant's \"kernel_config\" holds DecodeKernelConfig field overrides (e.g. '{\"kernel_config\":\n"
             "{\"attention_split_warps\": [[1, 4]]}}'): a config object passed down, which records the variant's\n"
             "own step graphs",
    )
    p.add_argument("--compare-rounds", type=int, default=3, help="rounds of --compare (medians reported)")
    p.add_argument(
        "--markdown", default=None, metavar="PATH",
        help="also write the markdown tables to PATH (replaced if it exists); default: print them only",
    )
    p.add_argument(
        "--from-json", default=None, metavar="FILE",
        help="render the tables of a results JSON (printed, and to --markdown PATH), then exit",
    )
    args = p.parse_args(argv)
    if args.markdown is not None and not Path(args.markdown).resolve().parent.is_dir():
        p.error(f"--markdown {args.markdown}: its folder does not exist")
    try:
        args.kernel_config = parse_kernel_config(args.kernel_config, args.plain_launches)
    except ValueError as error:
        p.error(f"--kernel-config: {error}")
    if args.compare is not None:
        try:
            args.compare = [json.loads(text) for text in args.compare]
        except json.JSONDecodeError as error:
            p.error(f"--compare takes JSON objects of generate_speech keyword arguments: {error}")
        if not all(isinstance(kwargs, dict) for kwargs in args.compare) or args.compare_rounds < 1:
            p.error("--compare takes JSON objects (e.g. '{\"plan_overrides\": {\"overlap_text_head\": false}}') and --compare-rounds >= 1")
        try:
            for kwargs in args.compare:
                parse_kernel_config(kwargs.get("kernel_config"))
        except ValueError as error:
            p.error(f"--compare: a variant's \"kernel_config\": {error}")
    # --tiny runs on a CPU in well under a minute: shorter audio and fewer repetitions (numbers are meaningless there).
    defaults = {
        "repeats": (3, 1),
        "input_seconds": (10.0, 2.0),
        "decoder_seconds": ("10,30", "1,2"),
        "ttfa_steps": (40, 12),
        "repeat_calls": (100, 3),
        "batch_sizes": ("1,4,16", "1,2"),
    }
    for name, (full, tiny) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.bandwidth_mb is None:
        args.bandwidth_mb = 2048 if is_cuda(args.device) else 64
    if args.decoder_precision == "auto":  # what CosyVoice3Config(estimator_precision="auto") gives on the device
        args.decoder_precision = "bfloat16" if is_cuda(args.device) else "float32"
    return args


def parse_kernel_config(value, plain_launches: bool = False) -> dict | None:
    """`DecodeKernelConfig` field overrides from JSON text or a parsed object (None: none), checked against the
    config's fields and values (`DecodeKernelConfig.replace`); `plain_launches` adds `programmatic_launch=False`.
    Raises ValueError naming what is wrong."""
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"takes a JSON object of DecodeKernelConfig fields, got {value!r}")
    overrides = dict(value or {}, **({"programmatic_launch": False} if plain_launches else {}))
    try:
        hash(DecodeKernelConfig().replace(**overrides))
    except TypeError as error:
        raise ValueError(f"{overrides!r}: {error}") from None
    return overrides or None


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def plan(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(kind, label, params) in priority order, so a run cut short by `--time-budget` still has the key numbers.

    Each new decoder shape (another offline length, the streaming window) costs a compile of ~90 s at full size, so
    the numbers that are furthest from their targets come first: the batch-1 step, the time to first audio and the
    streaming decoder (its graphs are the ones the time-to-first-audio stream captures), then the offline decoder.
    """
    modes = csv(args.modes)
    batches = [int(b) for b in csv(args.batch_sizes)]
    parts = csv(args.parts)
    compiled = [m for m in ("compiled", "eager") if m in modes]  # compiled first
    best = compiled[0] if compiled else "eager"
    first_batch = 1 if 1 in batches else batches[0]
    items: list[tuple[str, str, dict]] = []
    if "chat" in parts and args.compare:  # the variants side by side instead of the chat rows
        return [("compare", f"compare batch {b}", {"mode": best, "batch": b}) for b in batches]
    if "chat" in parts:
        for mode in compiled:
            items.append(("chat", f"chat {mode} batch {first_batch}", {"mode": mode, "batch": first_batch}))
        if "eager" in modes:
            items.append(("crq", f"CRQ share eager batch {first_batch}", {"mode": "eager", "batch": first_batch}))
    if "decoder" in parts:
        seconds = [float(s) for s in csv(args.decoder_seconds)]
        decoder_modes = csv(args.decoder_modes) if args.decoder_modes else modes
        tests = [test for test in ("stream", "offline") if test in csv(args.decoder_tests)]
        for mode in [m for m in ("compiled", "eager") if m in decoder_modes]:
            if mode == "compiled":
                items.append(("decoder_compile", "decoder compile", {"mode": mode}))
            if "chat" in parts and not any(kind == "ttfa" for kind, _, _ in items):  # the decoder as first set up
                items.append(("ttfa", f"time to first audio ({best})", {"mode": best}))
                if args.eager_prefill and best == "compiled":  # side by side: the same graphs apart from the prefill
                    label = f"time to first audio ({best}, eager prefill)"
                    items.append(("ttfa", label, {"mode": best, "eager_prefill": True}))
            for s in seconds:
                for test in tests:
                    label = f"decoder {mode} {test} {s:g} s"
                    items.append((f"decoder_{test}", label, {"mode": mode, "seconds": s}))
    if "chat" in parts:
        rest = sorted([b for b in batches if b != first_batch], reverse=True)  # batch 16 before batch 4
        for b in rest:
            for mode in compiled:
                items.append(("chat", f"chat {mode} batch {b}", {"mode": mode, "batch": b}))
        items.append(("repeat", f"{args.repeat_calls} consecutive calls ({best})", {"mode": best}))
        if "compiled" in modes and not args.tiny and args.crq_share:  # another compile: too slow for CPU smoke runs
            items.append(("crq", f"CRQ share compiled batch {first_batch}", {"mode": "compiled", "batch": first_batch}))
    return items


def raise_recompile_limits() -> None:
    """Several batch sizes / cache sizes / disable_speech each make a graph: never fall back to eager silently."""
    with contextlib.suppress(Exception):
        from torch import _dynamo

        config = _dynamo.config
        for name, value in (("cache_size_limit", 64), ("recompile_limit", 64), ("accumulated_cache_size_limit", 512)):
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), value))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_json:
        markdown = render_markdown(json.loads(Path(args.from_json).read_text()))
        log("\n" + markdown)
        if args.markdown:
            write_markdown(args.markdown, markdown)
        return 0
    if is_cuda(args.device) and not torch.cuda.is_available():
        log("CUDA is not available; use --device cpu")
        return 2
    budget = Budget(args.time_budget)
    results = Results(args, argv)
    meta = results.data["meta"]
    log(f"benchmark: {meta['gpu']} | torch {meta['torch']} | transformers {meta['transformers']} | {meta['command']}")
    torch.manual_seed(0)
    raise_recompile_limits()

    device = args.device
    bandwidth = run_measurement(
        results, budget, "copy bandwidth", lambda: measure_copy_bandwidth(device, args.bandwidth_mb), device
    )
    results.data["bandwidth"] = bandwidth
    if bandwidth.get("copy_gb_per_s"):
        log(f"copy bandwidth: {bandwidth['copy_gb_per_s']:.0f} GB/s")

    state: dict[str, Any] = {}

    def chat_model():
        if "chat" not in state:
            value = run_measurement(results, budget, "build chat model", lambda: build_chat_model(args), device)
            if isinstance(value, tuple):
                state["chat"], results.data["chat_model"] = value
                log(f"chat model: {json.dumps(results.data['chat_model'], default=str)}")
            else:
                state["chat"], results.data["chat_model"] = None, value
        if state["chat"] is None:
            raise RuntimeError(f"chat model unavailable ({results.data['chat_model'].get('status')})")
        return state["chat"]

    def decoder_model():
        if "decoder" not in state:
            value = run_measurement(results, budget, "build decoder", lambda: build_decoder(args), device)
            if isinstance(value, tuple):
                state["decoder"], results.data["decoder_model"] = value
                log(f"decoder: {json.dumps(results.data['decoder_model'], default=str)}")
                if args.decoder_precision != "float32":
                    # Against float32 first (same model, eager), then switch for every decoder measurement.
                    label = f"decoder precision check ({args.decoder_precision})"
                    row = run_measurement(
                        results, budget, label, lambda: decoder_precision_row(state["decoder"], args), device
                    )
                    results.add("decoder_precision", row)
                    if "mel_snr_db" in row:
                        log(f"  -> mel SNR {row['mel_snr_db']:.1f} dB, wav SNR {row['wav_snr_db']:.1f} dB vs float32")
                apply_decoder_precision(state["decoder"], args.decoder_precision)
                if args.channels_last_vocoder:
                    state["decoder"].hift.use_channels_last_convolutions()
                results.data["decoder_model"]["hift_channels_last"] = state["decoder"].hift.channels_last_convolutions
            else:
                state["decoder"], results.data["decoder_model"] = None, value
        if state["decoder"] is None:
            raise RuntimeError(f"decoder unavailable ({results.data['decoder_model'].get('status')})")
        return state["decoder"]

    full_step_ms: dict[tuple[str, int], float] = {}
    try:
        run_plan(args, results, budget, bandwidth, chat_model, decoder_model, state, full_step_ms)
    except BudgetExceeded as error:  # the hard stop fired between two measurements: keep what was measured
        log(f"[stop] {one_line(error)}")
    budget.cancel_alarm()
    markdown = render_markdown(results.data)
    log("\n" + markdown)
    results.save()
    if args.markdown:
        write_markdown(args.markdown, markdown)
    return 0


def resident_gb(model) -> float:
    """Parameter + buffer bytes of a model on the device, in GB (0 for None)."""
    if model is None:
        return 0.0
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9


def exclude_other_model(row: dict, other) -> dict:
    """Peak memory of a measurement without the other model's weights (both models stay resident in one run)."""
    other_gb = resident_gb(other)
    if row.get("peak_gb") is not None and other_gb:
        row["peak_gb"] -= other_gb
        row["peak_excludes_gb"] = other_gb
    return row


def usable_mode(preferred: str, full_step_ms: dict) -> str:
    """The compiled mode for TTFA / repeated calls, unless every compiled chat measurement failed (then eager)."""
    measured = {mode for mode, _ in full_step_ms}
    if preferred in measured or not measured:
        return preferred
    return "eager" if "eager" in measured else preferred


def run_plan(args, results, budget, bandwidth, chat_model, decoder_model, state, full_step_ms) -> None:
    def measure(label: str, fn: Callable[[], Any]):
        return run_measurement(results, budget, label, fn, args.device)

    for kind, label, p in plan(args):
        mode = p.get("mode")
        if kind == "chat":
            row = measure(label, lambda: chat_step_row(chat_model(), bandwidth, mode, p["batch"], args, results))
            row = exclude_other_model({"mode": mode, "batch": p["batch"], **row}, state.get("decoder"))
            if "ms_per_step" in row:
                full_step_ms[(mode, p["batch"])] = row["ms_per_step"]
                log(f"  -> {row['ms_per_step']:.2f} ms/step, RTF {row['rtf']:.4f}, peak {fmt(row.get('peak_gb'))} GB")
            results.add("chat", row)
        elif kind == "compare":
            row = measure(label, lambda: compare_row(chat_model(), mode, p["batch"], args))
            results.add("compare", {"mode": mode, "batch": p["batch"], **row})
        elif kind == "crq":
            full = full_step_ms.get((mode, p["batch"]))
            row = measure(label, lambda: crq_share_row(chat_model(), mode, p["batch"], args, full))
            results.add("crq_share", {"mode": mode, "batch": p["batch"], **row})
        elif kind == "ttfa":
            mode = usable_mode(mode, full_step_ms)
            eager_prefill = p.get("eager_prefill", False) and mode == "compiled"
            label = f"time to first audio ({mode}{', eager prefill' if eager_prefill else ''})"
            row = measure(label, lambda: ttfa_row(chat_model(), decoder_model(), mode, args, eager_prefill))
            prefill = "compiled" if mode == "compiled" and not eager_prefill else "eager"
            row = {"mode": mode, "input_seconds": args.input_seconds, "prefill": prefill, **row}
            results.add("ttfa", row)  # both models count
        elif kind == "repeat":
            mode = usable_mode(mode, full_step_ms)
            label = f"{args.repeat_calls} consecutive calls ({mode})"
            row = measure(label, lambda: repeat_calls_row(chat_model(), mode, args))
            results.add("repeat_calls", exclude_other_model({"mode": mode, **row}, state.get("decoder")))
        elif kind == "decoder_compile":
            value = measure(label, lambda: compile_decoder(decoder_model(), args))
            if isinstance(value, dict):  # failed or skipped: no compiled decoder rows
                state["decoder_compile_failed"] = value["status"]
            else:
                log(f"  -> decoder compiled with {value}()")
        elif kind in ("decoder_offline", "decoder_stream"):
            name = f"{'offline' if kind == 'decoder_offline' else 'stream'} {p['seconds']:g} s"
            if mode == "compiled" and state.get("decoder_compile_failed"):
                row = {"status": state["decoder_compile_failed"]}
            else:
                fn = decoder_offline_row if kind == "decoder_offline" else decoder_stream_row
                row = measure(label, lambda: fn(decoder_model(), mode, p["seconds"], args))
            results.add("decoder", exclude_other_model({"mode": mode, "test": name, **row}, state.get("chat")))
        log(f"  (elapsed {budget.elapsed():.0f} s of {args.time_budget:.0f} s)")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without interpreter teardown: after a measurement interrupted by the time limit (e.g. inside a CUDA-graph
    # capture or with compile workers alive) teardown can hang, and the results are already written.
    os._exit(code)
