"""What the speech engine's decode and prefill threads hand its output thread (`serving_engine_funaudiochat`): a
request's step outputs, merged per request into the items of a vocoder round, and the round itself."""

from __future__ import annotations

from typing import NamedTuple

from .serving_requests_funaudiochat import RequestHandle
from .serving_vocoder_funaudiochat import PendingAudio, VocodeItem


class StepOutput(NamedTuple):
    """What the decode (or prefill) thread hands the output thread about one request: its step results, or its end
    (the output thread merges a request's queued ones, `merged_outputs`)."""

    handle: RequestHandle
    text_ids: list[int]
    speech_ids: list[int]
    finish: str | None  # the finish reason of its last item
    error: str | None
    queued: float  # when it was handed over (`time.perf_counter()`)


class VocoderRound(NamedTuple):
    """A vocoder round of the output thread: its items (one per request), its audio queued on the GPU (None without
    a vocoder, or when queueing it failed: `failure`), and when it started."""

    items: list[StepOutput]
    audio: PendingAudio | None
    failure: Exception | None
    started: float


def merged_outputs(items: list[StepOutput]) -> StepOutput:
    """One request's consecutive step outputs as one: their text and speech ids in order, the finish reason and
    error of the last, handed over when the first was (the metrics' wait for the vocoder is its oldest output's)."""
    if len(items) == 1:
        return items[0]
    first, last = items[0], items[-1]
    text_ids = [token for item in items for token in item.text_ids]
    speech_ids = [token for item in items for token in item.speech_ids]
    return StepOutput(last.handle, text_ids, speech_ids, last.finish, last.error, first.queued)


def vocode_items(items: list[StepOutput]) -> list[VocodeItem]:
    """The vocoder's view of a round's (merged) items: audio is wanted unless a request was cancelled or failed."""
    return [VocodeItem(item.handle.id, item.handle.request.voice, item.speech_ids, item.finish is not None,
                       item.finish not in ("cancelled", "error"))
            for item in items]  # fmt: skip


__all__ = ["StepOutput", "VocoderRound", "merged_outputs", "vocode_items"]
