"""The input limits every surface enforces (processor, pipeline, CLI, demo Space, server): one place, one set of
numbers.

Small inputs must not cost large memory or time, so each limit is checked on what the input *claims* (a file
header's frame count and rate, an array's length, a string's length) before anything is decoded, resampled,
tokenized or allocated. Beyond a limit the caller gets an `InputTooLongError` (a `ValueError`) naming the limit, or
a `ValueError` for a rate out of range; nothing is cut silently.
docs/limits.md describes them for users.

* `MAX_AUDIO_SECONDS`: the longest clip the model can hear. The continuous encoder reads at most its feature
  extractor's window (the official checkpoint's Whisper extractor: 300 s; the tiny test model's: 30 s) and the model
  was sized for 1500 `<|AUDIO|>` positions (= 300 s at 5 Hz). A processor enforces the smaller of this and its own
  extractor's window (`FunAudioChatProcessor.max_audio_seconds`).
* `MIN_AUDIO_SECONDS`: the shortest clip the model can hear: one speech frame (25 Hz). The processor refuses a
  shorter one; the CLI says so before it loads a model.
* `MIN_SAMPLING_RATE` / `MAX_SAMPLING_RATE`: the rates accepted for input audio. Below 8 kHz (telephone speech)
  there is no intelligible speech, and a header claiming 1 Hz would make a few kilobytes resample into hours of
  audio; above 384 kHz no audio interface records.
* `MAX_TEXT_CHARS`: the longest text accepted as one prompt (system prompt, user instruction, history included)
  before tokenization. Attention over the prompt costs memory quadratic in its length; this keeps a prompt far
  inside the model's context (`max_position_embeddings`) and its prefill memory bounded.
* `MAX_SYSTEM_PROMPT_CHARS`: the longest system prompt a user-facing surface (CLI, demo Space, server) accepts from
  its user; it leaves most of `MAX_TEXT_CHARS` to the conversation history.

The longest *reply* is bounded by the model's context minus the prompt (`generate_speech` enforces it).
"""

from __future__ import annotations

import math
from typing import Any


class InputTooLongError(ValueError):
    """An audio clip or a text over its limit (a `ValueError`; a server can answer it with 413)."""


MAX_AUDIO_SECONDS = 300.0
MIN_AUDIO_SECONDS = 1 / 25
MIN_SAMPLING_RATE = 8000
MAX_SAMPLING_RATE = 384000
MAX_TEXT_CHARS = 16384
MAX_SYSTEM_PROMPT_CHARS = 4096


def check_audio_duration(num_samples: int, sampling_rate: int, max_seconds: float, what: str = "Audio input") -> None:
    """Raise `InputTooLongError` if `num_samples` at `sampling_rate` lasts longer than `max_seconds`."""
    seconds = num_samples / sampling_rate
    if seconds > max_seconds:
        raise InputTooLongError(
            f"{what} lasts {seconds:.1f} s ({num_samples} samples at {sampling_rate} Hz), longer than the "
            f"{max_seconds:g} s limit; split it into shorter clips."
        )


def check_sampling_rate_range(sampling_rate: int, what: str = "Audio input") -> None:
    """Raise `ValueError` if `sampling_rate` is outside [`MIN_SAMPLING_RATE`, `MAX_SAMPLING_RATE`]."""
    if not MIN_SAMPLING_RATE <= sampling_rate <= MAX_SAMPLING_RATE:
        raise ValueError(
            f"{what} is sampled at {sampling_rate} Hz; supported rates are {MIN_SAMPLING_RATE}-{MAX_SAMPLING_RATE} "
            "Hz (is the rate or the file header wrong?)."
        )


def check_text_length(text: Any, what: str = "The prompt text", max_chars: int = MAX_TEXT_CHARS) -> None:
    """Raise `InputTooLongError` if the string `text` has more than `max_chars` characters (non-strings are left to
    the caller's type checks)."""
    if isinstance(text, str) and len(text) > max_chars:
        raise InputTooLongError(f"{what} has {len(text)} characters, more than the {max_chars} limit.")


def check_max_seconds(max_seconds: Any) -> float:
    """A positive finite duration limit in seconds (or `math.inf` for no limit, which callers must opt into)."""
    if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or math.isnan(max_seconds):
        raise ValueError(f"`max_seconds` must be a positive number of seconds, got {max_seconds!r}.")
    if max_seconds <= 0:
        raise ValueError(f"`max_seconds` must be positive, got {max_seconds!r}.")
    return float(max_seconds)


__all__ = [
    "InputTooLongError",
    "MAX_AUDIO_SECONDS",
    "MAX_SAMPLING_RATE",
    "MAX_SYSTEM_PROMPT_CHARS",
    "MAX_TEXT_CHARS",
    "MIN_SAMPLING_RATE",
    "check_audio_duration",
    "check_max_seconds",
    "check_sampling_rate_range",
    "check_text_length",
]
