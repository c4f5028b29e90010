"""Decode the ready chunks of several CosyVoice3 streaming decoders together (a server's concurrent replies).

A streamed chunk's flow call (10 Euler steps over the 22 DiT blocks, with classifier-free guidance) is thousands of
kernels. Decoding the chunks of N streams one after another costs N such calls, each with its launches and its
GEMMs on a single row; `decode_ready` stacks one chunk of every ready stream into one flow call per padded window
size (and one HiFT filter call per group of equal HiFT windows). Rows are grouped by window size, not padded to the
round's longest: at full size the DiT's GEMMs dominate a long window's call, so its cost grows with rows x window,
and a reply's short first window padded to a steady one would cost about as much as the steady chunk.

Every row is computed as its own decoder would compute it alone (`CosyVoice3StreamingDecoder.push`): rows are
independent in the flow (per-row key mask over its own window, its own token count, start noise at its own absolute
frame offset, its own speaker condition; the DiT's convs look left only, the CFG batch concatenates the conditional
and unconditional rows as whole rows) and in HiFT (a batched filter call computes each row as a batch-1 call). So a
row's mel and audio equal its decoder's own `push` up to float rounding (tested), and every decoder's state moves
exactly as its own `push` would move it.
"""

from collections.abc import Sequence
from typing import Optional, Union

import torch

from .streaming_cosyvoice3 import CosyVoice3StreamingDecoder, flow_window_to_mel, positive_int_sizes


# Batch sizes of the graphed (or compiled) calls: a batch is padded up to the next one (copies of a real row, outputs
# dropped), so the runners record at most (window sizes x these) flow graphs. Larger batches are split into calls of
# the largest.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16)


@torch.no_grad()
def decode_ready(
    decoders: Sequence[CosyVoice3StreamingDecoder],
    batch_sizes: Union[tuple[int, ...], str, None] = "auto",
    graph_runners: Optional[dict] = None,
    max_rounds: Optional[int] = None,
) -> list[torch.Tensor]:
    """Decode every ready chunk of `decoders` (tokens added with `add_tokens`) and return each decoder's new audio
    (samples,) (possibly empty), in order: what `decoder.decode_ready()` returns for each, with one flow call (and
    HiFT calls grouped by window shape) per round instead of one per decoder.

    While any decoder has a ready chunk (`chunk_ready()`), one chunk of every ready decoder is decoded per round, each
    with its own next hop (streams with hop growth may be at different hops): rows whose windows are padded to the
    same size (`padded_window`) share a flow call, smallest size first (with exact shapes, all rows share one, padded
    to the longest), each row hidden from attention past its real frames; HiFT runs once per group of rows with equal
    windows.

    batch_sizes: the batch sizes a call may have, ascending; a round's rows are padded up to the smallest that holds
    them (copies of a real row, whose outputs are dropped) and split into calls of the largest when there are more.
    "auto" (default): `GRAPH_BATCH_SIZES` when the decoders replay CUDA graphs or the model's flow is compiled (graphs
    and compiled code are specialised to shapes: this bounds the recordings), else None (one call per round with
    exactly the ready rows).

    graph_runners: the {"flow", "hift"} runners the rounds replay, for decoders that replay CUDA graphs (default:
        the model's own, which the decoders replay alone); runners of their own
        (`streaming_cosyvoice3.new_graph_runners`) may replay at the same time as the model's, on another stream.
    max_rounds: decode at most this many chunks of each decoder (None: every ready chunk); the rest stay ready.

    All decoders must stream from the same model with the same `cuda_graphs` setting (one flow call runs one model's
    weights and one precision setting); a mix raises a ValueError. A failed call leaves every decoder as it was before
    it (decoding each alone then finds the one that fails), except for a token-range error: tokens added on an
    accelerator are checked when their chunk is decoded; a bad one raises a ValueError naming the decoder's index, and
    that decoder's unchecked tokens are discarded, as by `push`.
    """
    decoders = list(decoders)
    if not decoders:
        return []
    if any(not isinstance(decoder, CosyVoice3StreamingDecoder) for decoder in decoders):
        raise ValueError("decode_ready takes CosyVoice3StreamingDecoder objects")
    if len({id(decoder) for decoder in decoders}) != len(decoders):
        raise ValueError("decode_ready: a decoder appears twice (its chunks would be decoded twice)")
    model, graphed = decoders[0].model, decoders[0].cuda_graphs
    for index, decoder in enumerate(decoders):
        if decoder.model is not model:
            raise ValueError(
                f"decode_ready: decoder {index} streams from another model than decoder 0; one call decodes one "
                "model's streams (call it once per model)"
            )
        if decoder.cuda_graphs != graphed:
            raise ValueError(
                f"decode_ready: decoder {index} has cuda_graphs={decoder.cuda_graphs}, decoder 0 {graphed}; one call "
                "decodes streams of one setting"
            )
    sizes = _batch_sizes(batch_sizes, fixed_shapes=graphed or model.flow_is_compiled)
    if max_rounds is not None and (not isinstance(max_rounds, int) or max_rounds < 1):
        raise ValueError(f"max_rounds must be None or an int >= 1, got {max_rounds!r}")
    runners = (graph_runners or decoders[0]._graphs) if graphed else None
    # The decoders' state before the call: the decoding replaces state tensors, never writes into them, so a shallow
    # copy restores it if the call fails (no chunk is then half-decoded, e.g. its mel taken but not vocoded).
    states = [dict(vars(decoder)) for decoder in decoders]
    pieces: list[list[torch.Tensor]] = [[] for _ in decoders]
    rounds = 0
    try:
        while max_rounds is None or rounds < max_rounds:
            rounds += 1
            ready = [index for index, decoder in enumerate(decoders) if decoder.chunk_ready()]
            if not ready:
                break
            for index in ready:
                try:
                    decoders[index]._accept_pending()
                except ValueError as error:
                    states[index] = dict(vars(decoders[index]))  # without the discarded tokens, as `push` leaves it
                    raise ValueError(f"streaming decoder {index}: {error}") from None
            for window_group in _by_window_size(ready, decoders):
                step = len(window_group) if sizes is None else sizes[-1]
                for first in range(0, len(window_group), step):
                    group = window_group[first : first + step]
                    audio = _decode_chunks([decoders[index] for index in group], sizes, runners)
                    for index, samples in zip(group, audio):
                        pieces[index].append(samples)
    except BaseException:
        for decoder, state in zip(decoders, states):
            vars(decoder).clear()
            vars(decoder).update(state)
        raise
    return [decoder._concat(audio) for decoder, audio in zip(decoders, pieces)]


def _by_window_size(ready: list[int], decoders: list[CosyVoice3StreamingDecoder]) -> list[list[int]]:
    """The ready decoders' indices grouped by the size their next flow window is padded to, smallest first: a row
    padded to a larger window would pay for its padding (the flow's cost grows with rows x window). Decoders with
    exact shapes (`flow_window_sizes` None) form one group, padded to its longest window."""
    groups: dict[int, list[int]] = {}
    for index in ready:
        decoder = decoders[index]
        size = 0
        if decoder.flow_window_sizes is not None:
            window, _, _ = decoder._flow_window(finalize=False)
            size = decoder.padded_window(window.shape[0])
        groups.setdefault(size, []).append(index)
    return [groups[size] for size in sorted(groups)]


def _batch_sizes(batch_sizes, fixed_shapes: bool) -> Optional[tuple[int, ...]]:
    if batch_sizes == "auto":
        return GRAPH_BATCH_SIZES if fixed_shapes else None
    if batch_sizes is None:
        return None
    if positive_int_sizes(batch_sizes):
        return tuple(sorted(set(batch_sizes)))
    raise ValueError(f"batch_sizes must be 'auto', None or a tuple of ints >= 1, got {batch_sizes!r}")


def _pad_rows(tensors: list[torch.Tensor], sizes: Optional[tuple[int, ...]]) -> list[torch.Tensor]:
    """Pad the batch (dim 0) of each tensor up to the smallest of `sizes` that holds it, with copies of row 0."""
    batch = tensors[0].shape[0]
    if sizes is None:
        return tensors
    bucket = next(size for size in sizes if size >= batch)
    if bucket == batch:
        return tensors
    return [torch.cat([tensor, tensor[:1].expand(bucket - batch, *tensor.shape[1:])]) for tensor in tensors]


def _decode_chunks(decoders: list[CosyVoice3StreamingDecoder], sizes, runners: Optional[dict]) -> list[torch.Tensor]:
    """Decode the next (non-final) chunk of every decoder (all ready, pending tokens accepted): one flow call, then
    one HiFT filter call per group of equal window shapes (replayed by `runners`, eager if None). Returns each
    decoder's new audio (samples,)."""
    model = decoders[0].model
    windows = [decoder._flow_window(finalize=False) for decoder in decoders]
    padded = max(decoder.padded_window(window.shape[0]) for decoder, (window, _, _) in zip(decoders, windows))
    rows, real_frames = [], []
    for decoder, (window, window_start, _) in zip(decoders, windows):
        inputs, frames = decoder._flow_inputs(window, False, decoder.ratio * window_start, padded, masked=True)
        rows.append(inputs)
        real_frames.append(frames)
    # (tokens (B, padded), lengths (B,), noise (B, mel_bins, frames), speaker condition (B, mel_bins), mask
    # (B, 1, 1, frames)), B padded up to a batch size
    inputs = _pad_rows([torch.cat(parts) for parts in zip(*rows)], sizes)
    flow = model.flow
    conditioning = flow.decoder.cached_time_conditioning(
        inputs[0].shape[0], model.device, flow.input_embedding.weight.dtype
    )
    if runners is None:
        mel = flow_window_to_mel(flow, *inputs, *conditioning)
    else:
        mel = runners["flow"](*inputs, *conditioning)
    for row, (decoder, (_, window_start, end)) in enumerate(zip(decoders, windows)):
        decoder._take_mel(mel[row : row + 1, :, : real_frames[row]], window_start, end, finalize=False)

    # HiFT: rows with equal window shapes (the steady state: all of them, once at the same hop) in one filter call.
    audio: list[Optional[torch.Tensor]] = [None] * len(decoders)
    groups: dict[int, list[tuple[int, tuple]]] = {}
    for row, decoder in enumerate(decoders):
        hift_inputs = decoder._hift_inputs(finalize=False)
        if hift_inputs is None:
            audio[row] = decoder._concat([])
        else:
            groups.setdefault(hift_inputs[0].shape[-1], []).append((row, hift_inputs))
    for group in groups.values():
        mel_batch, source_batch = _pad_rows(
            [torch.cat([inputs[0] for _, inputs in group]), torch.cat([inputs[1] for _, inputs in group])], sizes
        )
        if runners is None:
            wav = model.hift.decode(mel_batch, source_batch, finalize=False)
        else:
            wav = runners["hift"](mel_batch, source_batch)
        for position, (row, (_, _, window_start, audio_end)) in enumerate(group):
            audio[row] = decoders[row]._take_audio(wav[position : position + 1], window_start, audio_end)
    return audio


__all__ = ["GRAPH_BATCH_SIZES", "decode_ready"]
