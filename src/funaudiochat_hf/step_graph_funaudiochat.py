"""`generate_speech`'s decode step replayed as one CUDA graph (the "cuda_graphs" and "compiled" backends on CUDA).

[`CapturedStep`] records the whole step (LLM part, the text head on its side stream, K CRQ sub-steps, bookkeeping;
run eagerly, or as parts compiled without CUDA graphs of their own) as one CUDA graph per workspace and configuration:
one launch per step, instead of a launch per kernel (eager) or a replay per compiled part, each of which checks in
Python that every tensor it reads is where it was recorded. The step only reads and writes fixed-address tensors (the
workspace's buffers and caches, the weights and the run's weight copies), so the graph stays valid as long as they
stay where they are; that is checked once per call instead of once per replay ([`StepGraphs.check`] on
[`tensor_addresses`]): if any moved (weights replaced, copies rebuilt), the workspace's graphs are dropped and recorded
again.
"""

import dataclasses
from collections.abc import Callable, Hashable

import torch
from torch import nn

from .cuda_graph_capture import capture_stream, recording


def tensor_addresses(*objects) -> tuple[tuple, ...]:
    """`(data_ptr, dtype, shape)` of every tensor in `objects`, in a fixed order: tensors, modules (their parameters
    and buffers), dataclasses, lists, tuples and dicts of them; anything else (ints, None, ...) is skipped. Each object
    is visited once."""
    addresses: list[tuple] = []
    seen: set[int] = set()
    pending = list(reversed(objects))
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            addresses.append((item.data_ptr(), item.dtype, tuple(item.shape)))
        elif isinstance(item, nn.Module):
            tensors = (*item.parameters(), *item.buffers())
            addresses.extend((tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)) for tensor in tensors)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            pending.extend(reversed([getattr(item, field.name) for field in dataclasses.fields(item)]))
        elif isinstance(item, (list, tuple)):
            pending.extend(reversed(item))
        elif isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
    return tuple(addresses)


class StepGraphs:
    """The CUDA graphs recorded on one decode workspace, by key, and the tensor addresses they were recorded with."""

    def __init__(self):
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.warm: set[Hashable] = set()  # keys whose function has run once outside a capture
        self.addresses: tuple[tuple, ...] | None = None
        self._shared_pool = None  # the memory pool of the graphs recorded with `shared_pool=True`

    def shared_pool(self):
        """The memory pool shared by this workspace's graphs that never replay at the same time (made on first use,
        dropped with the graphs): they then hold the memory of the largest one, not the sum."""
        if self._shared_pool is None:
            self._shared_pool = torch.cuda.graph_pool_handle()
        return self._shared_pool

    def check(self, addresses: tuple[tuple, ...]) -> None:
        """Keep the graphs if they read tensors at these `addresses` (see [`tensor_addresses`]), else drop them (and
        their memory pools): the next calls warm up and record again."""
        if addresses != self.addresses:
            self.graphs.clear()
            self._shared_pool = None
            # The first check follows the first warm-up runs, made with these very tensors: they stay warm, so that
            # the second call records (the prompt pass, which runs before the first check, included).
            if self.addresses is not None:
                self.warm.clear()
            self.addresses = addresses

    def __len__(self) -> int:
        return len(self.graphs)


class CapturedStep:
    """`function(model, ws, cfg)` (a decode step, or one CRQ sub-step) replayed as a CUDA graph recorded on the
    workspace (`ws.step_graphs`, a [`StepGraphs`]) under `key`.

    The function must only enqueue GPU work on fixed-address tensors (no host syncs, no allocations that outlive it)
    and depend on nothing but those tensors and `key` (which names its configuration). Its first call for a key runs
    it directly: `torch.compile` compiles it or checks its guards and Triton builds its kernels, none of which may
    happen while capturing. The second records it (recording runs nothing) and replays the recording; later calls
    only replay, one launch each. `shared_pool`: its intermediates in the workspace's shared pool
    ([`StepGraphs.shared_pool`]), for functions that write every output into fixed buffers and never run alongside
    another such graph (e.g. the prompt's audio encoder, one recording per chunk count).
    """

    def __init__(self, function: Callable, key: Hashable, shared_pool: bool = False):
        self.function, self.key, self.uses_shared_pool = function, key, shared_pool

    def __call__(self, model, ws, cfg) -> None:
        graphs: StepGraphs = ws.step_graphs
        graph = graphs.graphs.get(self.key)
        if graph is None:
            if self.key not in graphs.warm:
                self.function(model, ws, cfg)
                graphs.warm.add(self.key)
                return
            graph = torch.cuda.CUDAGraph()
            # One capture at a time in the process, on the device's one side stream (`cuda_graph_capture`).
            pool = graphs.shared_pool() if self.uses_shared_pool else None
            with capture_stream(ws.device) as stream, recording(graph, stream, pool):
                self.function(model, ws, cfg)
            graphs.graphs[self.key] = graph
        graph.replay()


__all__ = ["CapturedStep", "StepGraphs", "tensor_addresses"]
