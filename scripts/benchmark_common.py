"""Shared pieces of `scripts/benchmark.py` and the scripts built on it: the repo's paths (its `src/` goes on sys.path
here, so importing this module first makes the working tree's package importable), the constants, the log line and
the device helpers (synchronise, time, memory, copy bandwidth)."""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch


REPO = Path(__file__).resolve().parents[1]
# Benchmark the working tree's package even where it is not pip-installed (the GPU machine runs a plain copy).
sys.path.insert(0, str(REPO / "src"))


FUNAUDIOCHAT_TINY = REPO / "tests" / "fixtures" / "funaudiochat_tiny"
COSYVOICE3_TINY = REPO / "tests" / "fixtures" / "cosyvoice3_tiny"

STEP_SECONDS = 0.2  # one LLM step = 5 speech tokens at 25 Hz
TOKENS_PER_SECOND = 25  # CosyVoice3 speech tokens
SPEECH_VOCAB = 6561  # valid CosyVoice3 token ids are [0, 6561)

# Official numbers (spec/performance.md, one H200, batch 1), quoted as context for the ratios.
OFFICIAL_CHAT_MS = {"default SDPA": 390.0, "cuDNN SDPA off": 189.0}
OFFICIAL_DECODER = {
    "offline 10 s": {"wall_s": 0.32, "rtf": 0.032},
    "offline 30 s": {"wall_s": 0.65, "rtf": 0.022},
    "stream 10 s": {"wall_s": 9.4, "rtf": 0.94, "first_chunk_ms": 600.0},
    "stream 30 s": {"wall_s": 24.6, "rtf": 0.82, "first_chunk_ms": 460.0},
}


def log(*parts: Any) -> None:
    print(*parts, flush=True)


def one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line[:200]


# ----------------------------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------------------------


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def synchronize(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def cleanup(device: str) -> None:
    gc.collect()
    if is_cuda(device):
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    """Wall-clock seconds of `fn()` with the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def reset_peak(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: str) -> float | None:
    if is_cuda(device):
        return torch.cuda.max_memory_allocated(device) / 1e9
    return None


def allocated_gb(device: str) -> float | None:
    if is_cuda(device):
        return torch.cuda.memory_allocated(device) / 1e9
    return None


def measure_copy_bandwidth(device: str, megabytes: int, iterations: int = 20) -> dict:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + bytes written (the METHOD.md ceiling)."""
    n = megabytes * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds, _ = timed(lambda: [dst.copy_(src) for _ in range(iterations)], device)
    del src, dst
    return {"copy_gb_per_s": 2 * n * iterations / seconds / 1e9, "buffer_mb": megabytes, "iterations": iterations}


def call_with_supported_kwargs(fn: Callable, kwargs: dict, notes: list[str] | None = None):
    """Calls `fn(**kwargs)`, dropping (and noting) kwargs its signature does not accept, unless it takes **kwargs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    dropped = [k for k in kwargs if k not in params]
    if dropped and notes is not None:
        note = "unsupported kwargs dropped: " + ", ".join(dropped)
        if note not in notes:
            notes.append(note)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def check_buffers_finite(model: torch.nn.Module) -> list[str]:
    bad = []
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.numel() and not bool(torch.isfinite(buf).all()):
            bad.append(name)
    return bad
