"""Turn whatever a user hands us as "audio" into the mono 16 kHz float32 waveform the processor expects.

`load_audio` is the single entry point used by the processor, the pipeline, the CLI and the demo, so every surface
accepts the same inputs and fails with the same clear messages:

* a path (`str` / `pathlib.Path`, `~` expanded) to any file soundfile can decode (wav, flac, ogg, mp3, ...), with a
  librosa/audioread fallback for other containers;
* the raw bytes of such a file (`bytes`, `bytearray`, `memoryview`);
* a waveform as a numpy array or torch tensor, at `sampling_rate` (default: the target rate);
* a dict in the transformers ASR-pipeline / `datasets.Audio` convention: `{"raw" | "array": waveform,
  "sampling_rate": sr}`, or `{"bytes": ..., "path": ...}` / `{"path": ...}` for undecoded dataset rows.

Multi-channel audio is down-mixed by averaging the channels (what `librosa.load(mono=True)` does). A 2-D waveform
may be laid out as `(channels, samples)` or `(samples, channels)`: the shorter axis is taken as the channel axis, and
more than `MAX_CHANNELS` channels is refused (that is almost always a batch of clips passed as one array - pass a list
instead).
Integer PCM arrays are scaled to [-1, 1] by their type's range (int16 / 32768, ...). Other sampling rates are resampled
with soxr_hq, bit-identical to `librosa.resample` (what the reference implementation uses).

Bounded work: the duration (`max_seconds`, default `MAX_AUDIO_SECONDS`) and the sampling rate (`MIN_SAMPLING_RATE` ..
`MAX_SAMPLING_RATE`) are checked on the file header or the array length *before* decoding or resampling, so a small
file whose header claims a tiny rate cannot turn into hours of audio. A file whose data is shorter than its header
says (a cut download or upload) decodes what is there, with a warning naming the file.
"""

from __future__ import annotations

import io
import math
import os
import re
import warnings
import wave
from pathlib import Path
from typing import Any, Union

import numpy as np

from .limits_funaudiochat import (
    MAX_AUDIO_SECONDS,
    check_audio_duration,
    check_max_seconds,
    check_sampling_rate_range,
)


try:  # torch is a hard dependency of the package, but keep this module importable on its own
    import torch
except ImportError:  # pragma: no cover
    torch = None


MAX_CHANNELS = 8


class AudioDecodeError(ValueError):
    """A file or bytes that could not be decoded as audio at all (as opposed to audio that decodes but is refused:
    too long, empty, an unsupported rate): callers can tell "not an audio file" from the other problems."""


AudioInput = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, "torch.Tensor", dict]


def _is_tensor(value: Any) -> bool:
    return torch is not None and isinstance(value, torch.Tensor)


def _warn_if_truncated(sound_file: Any, num_read: int, description: str) -> None:
    """Warn when the file holds less audio than its header declares (libsndfile decodes what is there silently)."""
    declared_frames = sound_file.frames
    info = sound_file.extra_info or ""
    # WAV/AIFF: libsndfile notes "data : <declared bytes> (should be <bytes present>)" for a cut data chunk. Streaming
    # writers (ffmpeg to a pipe) declare 0 or 0xFFFFFFFF bytes on purpose: those are not truncations.
    cut = re.search(r"^data\s*:\s*(\d+)\s*\(should be (\d+)\)", info, re.MULTILINE)
    truncated = cut is not None and int(cut.group(1)) not in (0, 0xFFFFFFFF) and int(cut.group(2)) < int(cut.group(1))
    truncated |= "lacks an end-of-stream" in info  # Ogg: the last page is missing
    truncated |= 0 <= num_read < declared_frames
    if truncated:
        warnings.warn(
            f"{description} looks truncated: its header declares more audio than it contains; decoded the "
            f"{num_read} samples present ({num_read / max(sound_file.samplerate, 1):.2f} s).",
            UserWarning,
            stacklevel=5,
        )


def _decode_file(source: Any, description: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """Decode an audio file (a path or a file-like object) to `(samples, channels)` float32 and its sampling rate.

    The header's rate and length are checked against the limits before any sample is decoded.
    """
    import soundfile as sf

    what = description[0].upper() + description[1:]
    try:
        sound_file = sf.SoundFile(source)
    except Exception as sf_error:  # soundfile raises several types (LibsndfileError, RuntimeError, TypeError, ...)
        first_error = sf_error
    else:
        with sound_file:
            sr = int(sound_file.samplerate)
            check_sampling_rate_range(sr, what)
            check_audio_duration(max(sound_file.frames, 0), sr, max_seconds, what)
            try:
                data = sound_file.read(dtype="float32", always_2d=True)
            except Exception as error:
                message = f"Could not decode {description} as audio ({type(error).__name__}: {error})."
                raise AudioDecodeError(message) from None
            _warn_if_truncated(sound_file, data.shape[0], what)
        return data, sr
    # soundfile cannot read some containers (m4a, webm, ...); librosa falls back to audioread/ffmpeg for paths.
    if isinstance(source, (str, os.PathLike)):
        try:
            import librosa

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # Decode at most a second past the limit: enough to tell that the file is too long.
                limit = max_seconds + 1.0 if math.isfinite(max_seconds) else None
                data, sr = librosa.load(source, sr=None, mono=False, dtype=np.float32, duration=limit)
            data = np.atleast_2d(data).T  # librosa returns (channels, samples)
            decoded = (np.ascontiguousarray(data), int(sr))
        except Exception:
            decoded = None
        if decoded is not None:
            check_sampling_rate_range(decoded[1], what)
            check_audio_duration(decoded[0].shape[0], decoded[1], max_seconds, what)
            return decoded
    raise AudioDecodeError(f"Could not decode {description} as audio ({type(first_error).__name__}: {first_error}).")


def _load_path(path: str | os.PathLike, max_seconds: float) -> tuple[np.ndarray, int]:
    expanded = Path(os.path.expanduser(os.fspath(path)))
    if not expanded.exists():
        raise ValueError(f"Audio file not found: '{path}'.")
    if expanded.is_dir():
        raise ValueError(f"Expected an audio file but '{path}' is a directory.")
    return _decode_file(str(expanded), f"the file '{path}'", max_seconds)


def _load_bytes(data: bytes | bytearray | memoryview, max_seconds: float) -> tuple[np.ndarray, int]:
    if len(data) == 0:
        raise ValueError("Audio input is empty: got 0 bytes.")
    return _decode_file(io.BytesIO(bytes(data)), f"the audio data ({len(data)} bytes)", max_seconds)


def _integer_pcm_to_float(array: np.ndarray) -> np.ndarray:
    info = np.iinfo(array.dtype)
    if info.min == 0:  # unsigned PCM (e.g. 8-bit wav) is centred on the middle of the range
        middle = (info.max + 1) / 2
        return ((array.astype(np.float64) - middle) / middle).astype(np.float32)
    return (array.astype(np.float64) / (info.max + 1)).astype(np.float32)


def _to_mono(waveform: np.ndarray) -> np.ndarray:
    """`(samples,)`, `(channels, samples)` or `(samples, channels)` -> `(samples,)` by averaging channels."""
    if waveform.ndim == 1:
        return waveform
    if waveform.ndim != 2:
        raise ValueError(
            f"Expected a 1-D waveform (samples,) or a 2-D multi-channel waveform, got an array with shape "
            f"{tuple(waveform.shape)} ({waveform.ndim} dimensions)."
        )
    if waveform.size == 0:  # averaging no samples (or no channels) gives NaNs, not an empty clip
        raise ValueError(f"Audio input is empty: a waveform of shape {tuple(waveform.shape)} holds 0 samples.")
    channel_axis = 0 if waveform.shape[0] <= waveform.shape[1] else 1
    num_channels = waveform.shape[channel_axis]
    if num_channels > MAX_CHANNELS:
        raise ValueError(
            f"Got a 2-D waveform with shape {tuple(waveform.shape)}: {num_channels} channels is more than the "
            f"{MAX_CHANNELS} supported. To pass several clips, pass a list of 1-D waveforms."
        )
    return waveform.mean(axis=channel_axis, dtype=np.float32)


def _downmix_decoded(waveform: np.ndarray) -> np.ndarray:
    """Decoded files are always `(samples, channels)`: average the channels (no layout guessing needed)."""
    return waveform[:, 0] if waveform.shape[1] == 1 else waveform.mean(axis=1, dtype=np.float32)


def _array_from_value(value: Any) -> np.ndarray:
    if _is_tensor(value):
        value = value.detach().to("cpu")
        if value.dtype.is_floating_point and value.dtype != torch.float64:
            value = value.float()
        value = value.numpy()
    elif isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise ValueError(f"Expected a waveform array, got {type(value).__name__}.")
    if np.issubdtype(value.dtype, np.integer):
        return _integer_pcm_to_float(value)
    if np.issubdtype(value.dtype, np.bool_) or not np.issubdtype(value.dtype, np.floating):
        raise ValueError(f"Expected a floating-point or integer PCM waveform, got dtype {value.dtype}.")
    with np.errstate(over="ignore"):
        converted = value.astype(np.float32, copy=False)
    if converted is not value and np.isinf(converted).any() and np.isfinite(value[np.isinf(converted)]).any():
        raise ValueError(
            f"Audio samples reach {float(np.abs(value[np.isfinite(value)]).max()):.3g}, beyond the float32 range; "
            "expected a waveform in [-1, 1]."
        )
    return converted


def resample(waveform: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample `(samples,)` exactly like `librosa.resample(waveform, orig_sr=..., target_sr=...)` (soxr_hq).

    soxr is called directly: librosa's first call costs seconds of lazy imports, which a speech pipeline should not
    pay on its first request. The output length is fixed to `ceil(samples * target_sr / orig_sr)` as librosa does.
    """
    if orig_sr == target_sr:
        return waveform
    try:
        import soxr
    except ImportError:  # pragma: no cover - soxr ships with librosa >= 0.10
        import librosa

        return librosa.resample(waveform, orig_sr=orig_sr, target_sr=target_sr)
    out = soxr.resample(waveform, orig_sr, target_sr, quality="soxr_hq")
    num_samples = int(np.ceil(waveform.shape[-1] * float(target_sr) / orig_sr))
    if out.shape[-1] > num_samples:
        out = out[:num_samples]
    elif out.shape[-1] < num_samples:
        out = np.pad(out, (0, num_samples - out.shape[-1]))
    return out.astype(waveform.dtype, copy=False)


def _check_sampling_rate(sampling_rate: Any, name: str) -> int:
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer, float, np.floating)):
        raise ValueError(f"`{name}` must be a positive number of samples per second, got {sampling_rate!r}.")
    if not math.isfinite(sampling_rate) or sampling_rate <= 0 or int(sampling_rate) != sampling_rate:
        raise ValueError(f"`{name}` must be a positive integer number of samples per second, got {sampling_rate!r}.")
    rate = int(sampling_rate)
    check_sampling_rate_range(rate, f"`{name}={rate}`: the audio")
    return rate


def load_audio(
    audio: AudioInput,
    sampling_rate: int | None = None,
    target_sampling_rate: int = 16000,
    max_seconds: float = MAX_AUDIO_SECONDS,
) -> np.ndarray:
    """Load / convert `audio` to a mono float32 waveform `(samples,)` at `target_sampling_rate`.

    Args:
        audio: a file path (`~` expanded), the bytes of an audio file, a waveform (numpy array or torch tensor,
            `(samples,)`, `(channels, samples)` or `(samples, channels)`), or a dict `{"raw" | "array": waveform,
            "sampling_rate": sr}` / `{"bytes": ...}` / `{"path": ...}`. See the module docstring for the rules.
        sampling_rate: rate of a waveform given as an array/tensor; defaults to `target_sampling_rate`. Files carry
            their own rate, and passing a different one here is an error. A waveform dict needs its rate under
            "sampling_rate" or here (there is no default for dicts, as in the transformers ASR pipeline), and the
            two must agree where both are given.
        target_sampling_rate: rate of the returned waveform.
        max_seconds: the longest accepted audio (default `MAX_AUDIO_SECONDS`), checked on the file header or the
            array length before decoding or resampling.

    Returns:
        `np.ndarray` of dtype float32 and shape `(samples,)`.

    Raises:
        ValueError: missing or undecodable file/bytes, empty audio, NaN/Inf samples, unsupported shape or type,
            audio longer than `max_seconds`, a sampling rate outside the supported range.

    Warns:
        UserWarning: a file holds less audio than its header declares (decoded as far as it goes).
    """
    target_sampling_rate = _check_sampling_rate(target_sampling_rate, "target_sampling_rate")
    max_seconds = check_max_seconds(max_seconds)
    if sampling_rate is not None:
        sampling_rate = _check_sampling_rate(sampling_rate, "sampling_rate")

    if isinstance(audio, dict):
        if "raw" in audio or "array" in audio:
            waveform = audio["raw"] if "raw" in audio else audio["array"]
            dict_rate = audio.get("sampling_rate")
            if dict_rate is None and sampling_rate is None:
                # Only bare arrays default to the target rate: a dict that names no rate is more likely a mistake
                # (transformers' ASR pipeline refuses it too) than 16 kHz audio.
                raise ValueError(
                    "An audio dict with a waveform under 'raw' or 'array' needs its rate under 'sampling_rate', e.g. "
                    "{'array': waveform, 'sampling_rate': 16000}."
                )
            if dict_rate is None:
                dict_rate = sampling_rate
            elif sampling_rate is not None and _check_sampling_rate(dict_rate, "sampling_rate") != sampling_rate:
                raise ValueError(
                    f"The audio dict says 'sampling_rate': {dict_rate!r} but `sampling_rate={sampling_rate}` was "
                    "also given; pass one rate (the dict's alone is enough)."
                )
            return load_audio(waveform, dict_rate, target_sampling_rate, max_seconds)
        if audio.get("bytes") is not None:
            return load_audio(audio["bytes"], sampling_rate, target_sampling_rate, max_seconds)
        if audio.get("path"):
            return load_audio(audio["path"], sampling_rate, target_sampling_rate, max_seconds)
        raise ValueError(
            "An audio dict needs a waveform under 'raw' or 'array' (with 'sampling_rate'), or 'bytes' / 'path'; "
            f"got keys {sorted(audio)}."
        )

    what = "Audio input"  # what the messages below call it: a file is named
    if isinstance(audio, (str, os.PathLike)):
        if isinstance(audio, str) and not audio.strip():
            raise ValueError("Audio input is an empty string; expected a path to an audio file.")
        waveform, native_rate = _load_path(audio, max_seconds)
        waveform = _downmix_decoded(waveform)
        what = f"The file '{audio}'"
    elif isinstance(audio, (bytes, bytearray, memoryview)):
        waveform, native_rate = _load_bytes(audio, max_seconds)
        waveform = _downmix_decoded(waveform)
    elif isinstance(audio, np.ndarray) or _is_tensor(audio) or isinstance(audio, (list, tuple)):
        waveform = _array_from_value(audio)
        native_rate = sampling_rate if sampling_rate is not None else target_sampling_rate
        sampling_rate = None  # already applied
    else:
        raise ValueError(
            f"Unsupported audio input of type {type(audio).__name__}: pass a file path, file bytes, a numpy array / "
            "torch tensor waveform or a dict {'array': ..., 'sampling_rate': ...}."
        )

    if sampling_rate is not None and sampling_rate != native_rate:
        raise ValueError(
            f"`sampling_rate={sampling_rate}` was given but the audio file is sampled at {native_rate} Hz; "
            "files carry their own rate, leave `sampling_rate` unset."
        )

    waveform = _to_mono(waveform)

    if waveform.size == 0:
        raise ValueError(f"{what} is empty: it contains 0 samples.")
    check_audio_duration(waveform.size, native_rate, max_seconds, what)
    if not np.all(np.isfinite(waveform)):
        num_nan = int(np.isnan(waveform).sum())
        num_inf = int(np.isinf(waveform).sum())
        raise ValueError(f"{what} contains non-finite samples ({num_nan} NaN, {num_inf} Inf).")

    if native_rate != target_sampling_rate:
        waveform = resample(waveform, native_rate, target_sampling_rate)
        if waveform.size == 0:
            raise ValueError(
                f"Audio input is too short to resample from {native_rate} Hz to {target_sampling_rate} Hz."
            )
    return np.ascontiguousarray(waveform, dtype=np.float32)


def pcm16(audio: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> little-endian 16-bit PCM bytes (clipped, as any PCM writer does)."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_bytes(audio: np.ndarray, sampling_rate: int) -> bytes:
    """A mono 16-bit PCM WAV file of `audio` (samples,) in [-1, 1] (stdlib only)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(sampling_rate)
        writer.writeframes(pcm16(audio))
    return buffer.getvalue()


__all__ = ["MAX_CHANNELS", "AudioDecodeError", "load_audio", "pcm16", "resample", "wav_bytes"]
