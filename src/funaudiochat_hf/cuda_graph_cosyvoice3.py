"""CUDA-graph replay of the streaming CosyVoice3 decoder's fixed-shape calls (flow solver, HiFT filter).

A streaming chunk runs the flow's 10-step Euler solver (10 x 22 DiT blocks with classifier-free guidance) and the
HiFT filter on windows whose shapes repeat from chunk to chunk. Eagerly, that is thousands of small kernel launches
per chunk, and the GPU waits on the host. `CUDAGraphRunner` records a function once per input signature (shapes,
dtypes, the precision settings it depends on) and replays it: one launch per call. No compilation is involved, so
it works with the eager model (and with an estimator compiled without CUDA graphs of its own).

Inputs are copied into the graph's static buffers and the output is cloned out, so callers keep ordinary tensor
semantics; an input broadcast along a dimension (stride 0, as `expand` makes it) keeps one copy of that dimension
(part of the signature: a dense input of the same shape is another recording). A runner's replays are serialised, on
the host by a lock and on the GPU by an event: a replay queued on another CUDA stream (another engine's vocoder
thread, a direct streaming call beside the engine) waits for the last one, whose static buffers and pool memory it
would otherwise overwrite while that one runs. An input passed again as the very same tensor, unmodified since (same
version counter; a raw kernel that writes it without a PyTorch in-place op is not seen), is not copied again: a
streamed chunk's constant inputs (time conditioning, speaker condition, key mask) then cost no launches before the
replay, while the GPU waits for it.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Optional

import torch

from .cuda_graph_capture import capture_stream, recording


def broadcast_dims(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dimensions along which `tensor` repeats one slice (stride 0, more than one element)."""
    sizes_and_strides = enumerate(zip(tensor.shape, tensor.stride()))
    return tuple(dim for dim, (size, stride) in sizes_and_strides if stride == 0 and size > 1)


def _one_slice(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """`tensor` with each of `dims` narrowed to its first index (the slice it repeats)."""
    for dim in dims:
        tensor = tensor.narrow(dim, 0, 1)
    return tensor


class _Recording:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], output: torch.Tensor):
        self.graph, self.output = graph, output
        # What the graph reads (broadcast inputs as expanded views) and, per input, the dense storage written before a
        # replay with its broadcast dimensions.
        self.inputs = inputs
        broadcast = [broadcast_dims(static) for static in inputs]
        self.storage = [(_one_slice(static, dims), dims) for static, dims in zip(inputs, broadcast)]
        # (tensor, its version) last copied into each static input; None = copy on the next call.
        self.sources: list[Optional[tuple[torch.Tensor, int]]] = [None] * len(inputs)

    def load_inputs(self, tensors: tuple[torch.Tensor, ...]) -> None:
        for index, ((storage, dims), value) in enumerate(zip(self.storage, tensors)):
            # Inference-mode tensors have no version counter: copied every time.
            version = None if value.is_inference() else value._version
            source = self.sources[index]
            if version is not None and source is not None and source[0] is value and source[1] == version:
                continue  # already there: the graph never writes to its inputs
            storage.copy_(_one_slice(value, dims))
            self.sources[index] = None if version is None else (value, version)


def input_signature(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """What a recording depends on of its inputs: shapes, dtypes, devices and broadcast dimensions."""
    return tuple((tuple(t.shape), t.dtype, t.device, broadcast_dims(t)) for t in tensors)


def _static_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` for a recording: dense, except that its broadcast dimensions stay broadcast (one slice)."""
    dims = broadcast_dims(tensor)
    return _one_slice(tensor, dims).clone().expand(tensor.shape)


class CUDAGraphRunner:
    """Replay `function(*tensors)` as CUDA graphs, one recorded per input signature (LRU, at most `max_graphs`).

    `function` must be capturable: fixed shapes for fixed input shapes, no host synchronisation, no CPU tensors
    created inside, no in-place writes to its inputs, and its result must depend only on the tensors passed and on
    what `settings()` returns (for example an autocast dtype read from a config: it is part of the signature, so a
    change records a new graph).
    """

    def __init__(
        self,
        function: Callable[..., torch.Tensor],
        settings: Optional[Callable[[], Hashable]] = None,
        max_graphs: int = 8,
    ):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.function = function
        self.settings = settings
        self.max_graphs = max_graphs
        self._recordings: "OrderedDict[Hashable, _Recording]" = OrderedDict()
        self._lock = threading.Lock()
        # One memory pool for all of this runner's recordings (created with the first): replays are serialised by
        # the lock and each output is cloned before it is released, so a recording's intermediates may overlap
        # another's. The runner then holds the memory of its largest recording, not the sum of all of them. (A pool's
        # free blocks serve only allocations on the stream they were made on: every recording is captured on the
        # device's one capture stream, `cuda_graph_capture`.)
        self._pool = None
        # The end of the last replay's output copy, and the stream it was queued on: a call from another stream waits
        # for it (on one stream the order is already the queue's).
        self._done: Optional[torch.cuda.Event] = None
        self._done_stream: Optional[torch.cuda.Stream] = None

    def __len__(self) -> int:
        return len(self._recordings)

    @torch.no_grad()
    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        if not tensors or any(not isinstance(t, torch.Tensor) or t.device.type != "cuda" for t in tensors):
            raise ValueError("CUDAGraphRunner takes CUDA tensors only (bind other arguments with functools.partial)")
        key = (input_signature(tensors), self.settings() if self.settings is not None else None)
        with self._lock:
            recording = self._recordings.get(key)
            if recording is None:
                recording = self._record(tensors)
                self._recordings[key] = recording
                while len(self._recordings) > self.max_graphs:
                    self._recordings.popitem(last=False)
            else:
                self._recordings.move_to_end(key)
            stream = torch.cuda.current_stream(tensors[0].device)
            if self._done is not None and self._done_stream != stream:
                stream.wait_event(self._done)
            recording.load_inputs(tensors)
            recording.graph.replay()
            output = recording.output.clone()
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record(stream)
            self._done_stream = stream
            return output

    def _record(self, tensors: tuple[torch.Tensor, ...]) -> _Recording:
        device = tensors[0].device
        inputs = [_static_copy(t) for t in tensors]
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with capture_stream(device) as stream:
            # Warm up first (lazy cuBLAS / cuDNN / cuFFT initialisation must not happen during capture).
            with torch.cuda.stream(stream):
                self.function(*inputs)
            with recording(graph, stream, pool=self._pool):
                output = self.function(*inputs)
            torch.cuda.current_stream(device).wait_stream(stream)  # the warm-up read `inputs`, reloaded there
        return _Recording(graph, inputs, output)


__all__ = ["CUDAGraphRunner", "broadcast_dims", "input_signature"]
