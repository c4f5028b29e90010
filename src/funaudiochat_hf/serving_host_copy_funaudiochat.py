"""Device-to-host copies for the speech engine's two threads, without stalling the other thread's kernel launches.

The engine's decode thread reads each step's tokens, and its output thread each vocoder call's audio, from the GPU. A
copy into pageable memory (`.tolist()`, `.cpu()`) is staged by the CUDA driver while the calling thread waits for its
stream, and for all that time the other thread's kernel launches wait as well (seen in a profile of an idle server: a
launch of the output thread that fell inside a decode step's read returned only when the read did, so the output
thread got about one launch through per decode step, and a reply's first chunk, a few dozen launches around its graph
replays, took hundreds of milliseconds). `to_host` copies asynchronously into pinned memory and polls the stream's
progress, with the GIL released between polls: neither thread then holds up the other."""

import time

import torch


# Between two polls of a copy's completion (seconds): small against a decode step (~8 ms) or a chunk (~15 ms).
POLL_SECONDS = 5e-5


class HostCopy:
    """A copy of `tensor` to the CPU, started now (queued on the current stream, after the work that writes it) and
    taken later with `result()`: the caller can queue more work in between (the engine queues the next decode step
    before it reads this one's tokens). A CPU tensor is taken as it is (`tensor.cpu()` returns it: a caller that will
    overwrite it must pass a copy)."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type != "cuda":
            self._host, self._copied = tensor.cpu(), None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(tensor.device))

    def done(self) -> bool:
        """Whether the copy has finished (`result` then returns at once); never waits."""
        return self._copied is None or self._copied.query()

    def result(self) -> torch.Tensor:
        """The CPU tensor (pinned for a CUDA one), once the copy is done: the stream's progress polled
        (`Event.query`), sleeping `POLL_SECONDS` between polls."""
        if self._copied is not None:
            while not self._copied.query():
                time.sleep(POLL_SECONDS)
        return self._host


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU (a tensor already there is returned as it is). For a CUDA tensor: a non-blocking copy into
    pinned memory on the current stream, then that stream's progress polled until the copy is done (`HostCopy`).
    Returns the pinned CPU tensor."""
    return HostCopy(tensor).result()


__all__ = ["POLL_SECONDS", "HostCopy", "to_host"]
