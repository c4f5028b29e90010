"""The bookkeeping of a `scripts/benchmark.py` run: the time budget (with its hard-stop alarm), the results (written
as JSON + markdown to $OUT as they come) with the environment they were measured in, and one isolated measurement
(`run_measurement`: a failure is recorded, never raised)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

from benchmark_chat import compile_argument, plan_overrides
from benchmark_common import REPO, cleanup, log, one_line
from benchmark_report import render_markdown


class BudgetExceeded(BaseException):
    """Raised by the hard-stop alarm; a BaseException so library code catching `Exception` cannot swallow it."""


class Budget:
    """Wall-clock budget of the whole run; a SIGALRM hard stop interrupts a measurement that overruns it."""

    def __init__(self, seconds: float, hard_margin: float = 20.0):
        self.start = time.perf_counter()
        self.seconds = seconds
        if hasattr(signal, "SIGALRM") and seconds > 0:
            signal.signal(signal.SIGALRM, self._alarm)
            signal.alarm(int(math.ceil(seconds + hard_margin)))

    @staticmethod
    def _alarm(signum, frame):
        raise BudgetExceeded("hard time limit hit (time budget + margin)")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def cancel_alarm(self) -> None:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)


class Results:
    """Everything measured, kept JSON-serialisable so it can be rendered on another machine."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.data: dict[str, Any] = {
            "meta": environment_info(args, argv),
            "bandwidth": {},
            "chat_model": {},
            "chat": [],
            "compare": [],
            "crq_share": [],
            "ttfa": [],
            "repeat_calls": [],
            "decoder_model": {},
            "decoder": [],
            "decoder_precision": [],
            "log": [],
        }

    def add(self, section: str, row: dict) -> dict:
        self.data[section].append(row)
        self.save()
        return row

    def save(self) -> None:
        out = os.environ.get("OUT")
        if not out:
            return
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "benchmark.json").write_text(json.dumps(self.data, indent=1, default=str))
            (Path(out) / "benchmark.md").write_text(render_markdown(self.data))
        except OSError as error:  # never let bookkeeping abort the benchmark
            log(f"[warn] could not write $OUT: {error}")


def environment_info(args: argparse.Namespace, argv: list[str]) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python scripts/benchmark.py " + " ".join(shlex.quote(a) for a in argv),
        "device": args.device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "tiny": args.tiny,
        "chat_compile": (
            f"backend={args.chat_backend!r}, compile_config={compile_argument('compiled', args)!r}, "
            f"plan_overrides={plan_overrides(args)!r}"
            + (f"; kernel_config {json.dumps(args.kernel_config)}" if args.kernel_config else "")
            + ("; time to first audio also with backend='cuda_graphs' (eager prefill)" if args.eager_prefill else "")
        ),
        "decoder_compile": (args.decoder_compile_config or "compile_estimator() defaults")
        + (" + compile_vocoder()" if args.compile_vocoder else ""),
        "decoder_precision": args.decoder_precision,
        "vocoder_layout": "channels-last" if args.channels_last_vocoder else "default",
        "stream_options": args.stream_options or "streaming_decoder() defaults",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(args.device)
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = f"none (cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        import funaudiochat_hf

        info["funaudiochat_hf"] = getattr(funaudiochat_hf, "__version__", "?")
    except Exception as error:  # recorded, the measurements will fail with the real reason
        info["funaudiochat_hf"] = f"import failed: {one_line(error)}"
    try:
        import subprocess

        info["git"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except Exception:
        info["git"] = "?"
    return info


def run_measurement(results: Results, budget: Budget, label: str, fn: Callable[[], Any], device: str) -> Any:
    """Runs one measurement; returns its value, or a dict with "status" on skip/failure (never raises)."""
    if budget.left() <= 0:
        status = f"skipped: time budget ({budget.seconds:.0f} s) spent"
        log(f"[skip] {label}: {status}")
        results.data["log"].append({"label": label, "status": status})
        return {"status": status}
    log(f"[run ] {label} (t={budget.elapsed():.0f}s)")
    start = time.perf_counter()
    try:
        value = fn()
        status = "ok"
    except BudgetExceeded as error:
        value, status = {"status": f"failed: {one_line(error)}"}, "timeout"
    except Exception as error:  # record and continue with the next measurement
        import traceback

        traceback.print_exc(limit=-8)  # the innermost frames: enough to find the cause, short enough for the log
        value, status = {"status": f"failed: {one_line(error)}"}, "failed"
    finally:
        cleanup(device)
    took = time.perf_counter() - start
    log(f"[done] {label}: {status} in {took:.1f}s")
    results.data["log"].append({"label": label, "status": status, "seconds": round(took, 1)})
    results.save()
    return value
