"""Where the package records CUDA graphs: one capture at a time in the process, on one side stream per device.

A capture needs a stream other than the default one. Each stream that runs a cuBLAS GEMM gets cuBLAS workspaces of its
own (34.6 MB on an H100) that PyTorch keeps for the life of the process: with a fresh stream per capture, every
recording of a new shape left that much allocated for good (a generator's three calls left 104 MB after its `close`,
H100). And two captures at once on one stream are invalid, while the speech engine's prefill thread (a new prompt
bucket, an audio chunk count) and output thread (a decoder shape) may both record ("only one capture may be underway
at a time in the process", PyTorch's CUDA graph notes). So every capture, and the warm-up run before it, takes the
process's capture lock and runs on its device's side stream, made once and kept (as `torch.cuda.graph`'s own default
stream is): the cuBLAS workspaces of at most one extra stream per device, ever. Captures are rare (start-up, a new
shape) and short; replays take no lock.

`recording` is `torch.cuda.graph` without what that does before every capture: a device-wide synchronize and emptying
the CUDA and pinned-host caching allocators (memory hygiene, not needed for a capture). In a serving process a capture
happens while other threads run: those would stall them all and make their next allocations call cudaMalloc and
cudaHostAlloc, which synchronise the device again.
"""

import contextlib
import threading
from collections.abc import Iterator

import torch


class _CaptureStreams:
    """The capture lock and the side stream of every device (by index) that has recorded."""

    def __init__(self):
        self.lock = threading.RLock()
        self.streams: dict[int, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = torch.cuda.Stream(torch.device("cuda", index))
        return stream


_CAPTURE = _CaptureStreams()


@contextlib.contextmanager
def capture_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Hold the process's capture lock and yield `device`'s side stream, after it waited for the current stream's
    work: run a warm-up under `torch.cuda.stream(...)` of it, and / or capture with `recording(...)` on it."""
    with _CAPTURE.lock:
        stream = _CAPTURE.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        yield stream


@contextlib.contextmanager
def recording(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool=None) -> Iterator[None]:
    """Capture the CUDA work queued inside into `graph`, on `stream` (from `capture_stream`), its memory from `pool`
    (a `torch.cuda.graph_pool_handle()`; None: a pool of its own). thread_local: CUDA work of other threads during
    the capture (the decode steps, the vocoder) is not an error."""
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


__all__ = ["capture_stream", "recording"]
