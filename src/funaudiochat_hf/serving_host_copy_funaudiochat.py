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


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU (a tensor already there is returned as it is). For a CUDA tensor: a non-blocking copy into
    pinned memory on the current stream, then that stream's progress polled (`Event.query`) until the copy is done,
    sleeping `POLL_SECONDS` between polls. Returns the pinned CPU tensor."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))
    while not copied.query():
        time.sleep(POLL_SECONDS)
    return host


__all__ = ["POLL_SECONDS", "to_host"]
