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
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any, Union

import numpy as np


try:  # torch is a hard dependency of the package, but keep this module importable on its own
    import torch
except ImportError:  # pragma: no cover
    torch = None


MAX_CHANNELS = 8

AudioInput = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, "torch.Tensor", dict]


def _is_tensor(value: Any) -> bool:
    return torch is not None and isinstance(value, torch.Tensor)


def _decode_file(source: Any, description: str) -> tuple[np.ndarray, int]:
    """Decode an audio file (a path or a file-like object) to `(samples, channels)` float32 and its sampling rate."""
    import soundfile as sf

    try:
        data, sr = sf.read(source, dtype="float32", always_2d=True)
        return data, int(sr)
    except Exception as sf_error:  # soundfile raises several types (LibsndfileError, RuntimeError, TypeError, ...)
        first_error = sf_error
    # soundfile cannot read some containers (m4a, webm, ...); librosa falls back to audioread/ffmpeg for paths.
    if isinstance(source, (str, os.PathLike)):
        try:
            import librosa

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                data, sr = librosa.load(source, sr=None, mono=False, dtype=np.float32)
            data = np.atleast_2d(data).T  # librosa returns (channels, samples)
            return np.ascontiguousarray(data), int(sr)
        except Exception:
            pass
    raise ValueError(f"Could not decode {description} as audio ({type(first_error).__name__}: {first_error}).")


def _load_path(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    expanded = Path(os.path.expanduser(os.fspath(path)))
    if not expanded.exists():
        raise ValueError(f"Audio file not found: '{path}'.")
    if expanded.is_dir():
        raise ValueError(f"Expected an audio file but '{path}' is a directory.")
    return _decode_file(str(expanded), f"the file '{path}'")


def _load_bytes(data: bytes | bytearray | memoryview) -> tuple[np.ndarray, int]:
    if len(data) == 0:
        raise ValueError("Audio input is empty: got 0 bytes.")
    return _decode_file(io.BytesIO(bytes(data)), f"the {len(data)} bytes given")


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
    return value.astype(np.float32, copy=False)


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
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer, float)):
        raise ValueError(f"`{name}` must be a positive number of samples per second, got {sampling_rate!r}.")
    if sampling_rate <= 0 or int(sampling_rate) != sampling_rate:
        raise ValueError(f"`{name}` must be a positive integer number of samples per second, got {sampling_rate!r}.")
    return int(sampling_rate)


def load_audio(
    audio: AudioInput,
    sampling_rate: int | None = None,
    target_sampling_rate: int = 16000,
) -> np.ndarray:
    """Load / convert `audio` to a mono float32 waveform `(samples,)` at `target_sampling_rate`.

    Args:
        audio: a file path (`~` expanded), the bytes of an audio file, a waveform (numpy array or torch tensor,
            `(samples,)`, `(channels, samples)` or `(samples, channels)`), or a dict `{"raw" | "array": waveform,
            "sampling_rate": sr}` / `{"bytes": ...}` / `{"path": ...}`. See the module docstring for the rules.
        sampling_rate: rate of a waveform given as an array/tensor; defaults to `target_sampling_rate`. Files carry
            their own rate, and passing a different one here is an error.
        target_sampling_rate: rate of the returned waveform.

    Returns:
        `np.ndarray` of dtype float32 and shape `(samples,)`.

    Raises:
        ValueError: missing or undecodable file/bytes, empty audio, NaN/Inf samples, unsupported shape or type.
    """
    target_sampling_rate = _check_sampling_rate(target_sampling_rate, "target_sampling_rate")
    if sampling_rate is not None:
        sampling_rate = _check_sampling_rate(sampling_rate, "sampling_rate")

    if isinstance(audio, dict):
        if "raw" in audio or "array" in audio:
            waveform = audio["raw"] if "raw" in audio else audio["array"]
            dict_rate = audio.get("sampling_rate", sampling_rate)
            return load_audio(waveform, sampling_rate=dict_rate, target_sampling_rate=target_sampling_rate)
        if audio.get("bytes") is not None:
            return load_audio(audio["bytes"], sampling_rate=sampling_rate, target_sampling_rate=target_sampling_rate)
        if audio.get("path"):
            return load_audio(audio["path"], sampling_rate=sampling_rate, target_sampling_rate=target_sampling_rate)
        raise ValueError(
            "An audio dict needs a waveform under 'raw' or 'array' (with 'sampling_rate'), or 'bytes' / 'path'; "
            f"got keys {sorted(audio)}."
        )

    if isinstance(audio, (str, os.PathLike)):
        if isinstance(audio, str) and not audio.strip():
            raise ValueError("Audio input is an empty string; expected a path to an audio file.")
        waveform, native_rate = _load_path(audio)
        waveform = _downmix_decoded(waveform)
    elif isinstance(audio, (bytes, bytearray, memoryview)):
        waveform, native_rate = _load_bytes(audio)
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
        raise ValueError("Audio input is empty: it contains 0 samples.")
    if not np.all(np.isfinite(waveform)):
        num_nan = int(np.isnan(waveform).sum())
        num_inf = int(np.isinf(waveform).sum())
        raise ValueError(f"Audio input contains non-finite samples ({num_nan} NaN, {num_inf} Inf).")

    if native_rate != target_sampling_rate:
        waveform = resample(waveform, native_rate, target_sampling_rate)
        if waveform.size == 0:
            raise ValueError(
                f"Audio input is too short to resample from {native_rate} Hz to {target_sampling_rate} Hz."
            )
    return np.ascontiguousarray(waveform, dtype=np.float32)


__all__ = ["MAX_CHANNELS", "load_audio", "resample"]
