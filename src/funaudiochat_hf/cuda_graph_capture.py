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

A captured call may record independent parts of its work on more streams (`capture_branches`, `run_beside`):
the graph then holds them as parallel branches, which a replay runs side by side, where one stream would run their
small kernels one after the other. Those streams are made once per device and kept, as the capture stream.

`recording` is `torch.cuda.graph` without what that does before every capture: a device-wide synchronize and emptying
the CUDA and pinned-host caching allocators (memory hygiene, not needed for a capture). In a serving process a capture
happens while other threads run: those would stall them all and make their next allocations call cudaMalloc and
cudaHostAlloc, which synchronise the device again.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch


class _CaptureStreams:
    """The capture lock, the side stream of every device (by index) that has recorded, and the branch streams of
    those whose captures recorded branches."""

    def __init__(self):
        self.lock = threading.RLock()
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.branches: dict[int, tuple[torch.cuda.Stream, ...]] = {}
        self.inside = threading.local()  # `depth`: this thread's `capture_stream` contexts

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        index = _index(device)
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = torch.cuda.Stream(torch.device("cuda", index))
        return stream

    def branch_streams(self, device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
        index = _index(device)
        streams = self.branches.get(index, ())
        if len(streams) < count:
            new = (torch.cuda.Stream(torch.device("cuda", index)) for _ in range(count - len(streams)))
            streams = self.branches[index] = (*streams, *new)
        return streams[:count]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_CAPTURE = _CaptureStreams()


@contextlib.contextmanager
def capture_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Hold the process's capture lock and yield `device`'s side stream, after it waited for the current stream's
    work: run a warm-up under `torch.cuda.stream(...)` of it, and / or capture with `recording(...)` on it."""
    with _CAPTURE.lock:
        stream = _CAPTURE.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        _CAPTURE.inside.depth = getattr(_CAPTURE.inside, "depth", 0) + 1
        try:
            yield stream
        finally:
            _CAPTURE.inside.depth -= 1


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


def capture_branches(tensor: torch.Tensor, count: int) -> Optional[tuple[torch.cuda.Stream, ...]]:
    """`count` streams for independent branches (`run_beside`) of a call on `tensor`'s device that runs on the capture
    stream inside `capture_stream`: a recording, and the warm-up run before it, which so initialises whatever the
    branches' streams need before the capture. None elsewhere (and under `torch.compile`): such calls run their work
    on one stream as written."""
    if not tensor.is_cuda or torch.compiler.is_compiling() or not getattr(_CAPTURE.inside, "depth", 0):
        return None
    if torch.cuda.current_stream(tensor.device) != _CAPTURE.streams.get(_index(tensor.device)):
        return None
    return _CAPTURE.branch_streams(tensor.device, count)  # this thread holds the capture lock


def run_beside(stream: torch.cuda.Stream, function: Callable[..., Any], *inputs: torch.Tensor) -> "Branch":
    """`function(*inputs)` queued on `stream` (from `capture_branches`) after the current stream's work so far, so that
    the current stream goes on with other work meanwhile; the current stream reads its output through the returned
    branch's `result()`."""
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        output = function(*inputs)
        done = torch.cuda.Event()
        done.record(stream)
    for tensor in inputs:  # the caller may free them while the branch still reads them
        tensor.record_stream(stream)
    return Branch(output, done)


class Branch:
    """The output (a tensor, or a list or tuple of them) of work queued on a side stream by `run_beside`, and the
    event that marks its end there."""

    def __init__(self, output: Any, done: torch.cuda.Event):
        self.output, self.done = output, done

    def result(self) -> Any:
        """The output, once the current stream has waited for the branch's work (not for later work on its stream)."""
        caller = torch.cuda.current_stream()
        caller.wait_event(self.done)
        for tensor in self.output if isinstance(self.output, (list, tuple)) else (self.output,):
            tensor.record_stream(caller)  # made on the branch's stream, read and freed on the caller's
        return self.output


__all__ = ["Branch", "capture_branches", "capture_stream", "recording", "run_beside"]
