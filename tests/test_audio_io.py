"""Tests for `load_audio`: every accepted input form, down-mixing, resampling and the error messages."""

import io

import numpy as np
import pytest
import torch
from conftest import FUNAUDIOCHAT_GOLDEN
from safetensors.torch import load_file

from funaudiochat_hf.audio_io import MAX_CHANNELS, load_audio, resample

sf = pytest.importorskip("soundfile")  # librosa's audio backend (absent on bare GPU hosts)


WAV_PATH = FUNAUDIOCHAT_GOLDEN / "input_16k.wav"


@pytest.fixture(scope="module")
def waveform() -> np.ndarray:
    return load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")["waveform_16k"].numpy()


def _encode(array: np.ndarray, rate: int, fmt: str = "WAV", subtype: str = "FLOAT") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, array, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def test_path_str_and_pathlib_are_exact(waveform):
    for source in (str(WAV_PATH), WAV_PATH):
        loaded = load_audio(source)
        assert loaded.dtype == np.float32 and loaded.shape == (39200,)
        np.testing.assert_array_equal(loaded, waveform)


def test_path_with_tilde_is_expanded(waveform, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "clip.wav").write_bytes(WAV_PATH.read_bytes())
    np.testing.assert_array_equal(load_audio("~/clip.wav"), waveform)


def test_file_bytes(waveform):
    for data in (WAV_PATH.read_bytes(), bytearray(WAV_PATH.read_bytes()), memoryview(WAV_PATH.read_bytes())):
        np.testing.assert_array_equal(load_audio(data), waveform)


def test_arrays_tensors_and_dicts(waveform):
    np.testing.assert_array_equal(load_audio(waveform), waveform)
    np.testing.assert_array_equal(load_audio(waveform.astype(np.float64)), waveform)
    np.testing.assert_array_equal(load_audio(torch.from_numpy(waveform)), waveform)
    np.testing.assert_array_equal(load_audio({"array": waveform, "sampling_rate": 16000}), waveform)
    np.testing.assert_array_equal(load_audio({"raw": torch.from_numpy(waveform), "sampling_rate": 16000}), waveform)
    np.testing.assert_array_equal(load_audio({"bytes": WAV_PATH.read_bytes(), "path": None}), waveform)
    np.testing.assert_array_equal(load_audio({"path": str(WAV_PATH)}), waveform)


def test_integer_pcm_is_scaled():
    pcm = np.array([0, 16384, -32768, 32767], dtype=np.int16)
    np.testing.assert_allclose(load_audio(pcm), [0.0, 0.5, -1.0, 32767 / 32768], atol=1e-7)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_stereo_array_is_averaged(waveform, layout):
    other = (0.5 * waveform[::-1]).copy()
    stereo = np.stack([waveform, other])
    if layout == "channels_last":
        stereo = stereo.T
    np.testing.assert_allclose(load_audio(stereo), (waveform + other) / 2, atol=1e-7)
    identical = np.stack([waveform, waveform])
    np.testing.assert_array_equal(load_audio(identical if layout == "channels_first" else identical.T), waveform)


def test_stereo_file_is_averaged(waveform, tmp_path):
    other = (0.25 * np.sin(np.arange(len(waveform)) / 7.0)).astype(np.float32)
    path = tmp_path / "stereo.wav"
    sf.write(path, np.stack([waveform, other], axis=1), 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(path), (waveform + other) / 2, atol=1e-7)


def test_resample_is_bit_identical_to_librosa():
    import librosa

    noise = np.random.default_rng(0).standard_normal(4001).astype(np.float32)
    for orig, target in [(16000, 48000), (44100, 16000), (22050, 16000), (8000, 16000)]:
        expected = librosa.resample(noise, orig_sr=orig, target_sr=target)
        got = resample(noise, orig, target)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def test_other_rates_are_resampled(waveform):
    up = resample(waveform, 16000, 48000)
    from_array = load_audio(up, sampling_rate=48000)
    from_file = load_audio(_encode(up, 48000))
    assert from_array.shape == from_file.shape == waveform.shape
    np.testing.assert_array_equal(from_array, from_file)
    assert np.abs(from_array - waveform).max() < 0.02  # only the band edge near 8 kHz is lost
    assert load_audio(waveform, sampling_rate=16000, target_sampling_rate=24000).shape == (58800,)


@pytest.mark.parametrize(
    ("fmt", "subtype", "atol"), [("FLAC", "PCM_24", 1e-6), ("OGG", "VORBIS", 0.1), ("MP3", "MPEG_LAYER_III", 0.1)]
)
def test_compressed_formats(waveform, tmp_path, fmt, subtype, atol):
    if fmt not in sf.available_formats():
        pytest.skip(f"libsndfile without {fmt}")
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(_encode(waveform, 16000, fmt, subtype))
    loaded = load_audio(path)
    assert abs(len(loaded) - len(waveform)) <= 1152  # mp3 may add a frame of padding
    n = min(len(loaded), len(waveform))
    assert np.abs(loaded[:n] - waveform[:n]).max() < atol


@pytest.mark.parametrize(
    ("audio", "message"),
    [
        (np.zeros(0, dtype=np.float32), "empty"),
        (b"", "empty"),
        ("", "empty string"),
        (np.array([0.0, np.nan, 0.1], dtype=np.float32), "1 NaN"),
        (np.array([0.0, np.inf, -np.inf], dtype=np.float32), "2 Inf"),
        (torch.tensor([0.0, float("nan")]), "NaN"),
        (np.zeros((2, 3, 100), dtype=np.float32), "3 dimensions"),
        (np.zeros((MAX_CHANNELS + 1, 16000), dtype=np.float32), "channels"),
        (np.array(["a", "b"]), "dtype"),
        (12345, "Unsupported audio input of type int"),
        ({"sampling_rate": 16000}, "needs a waveform"),
        (b"this is not audio at all" * 10, "Could not decode"),
        ("/definitely/not/here.wav", "not found"),
    ],
)
def test_errors_name_the_problem(audio, message):
    with pytest.raises(ValueError, match=message):
        load_audio(audio)


def test_non_audio_file_and_directory(tmp_path):
    text_file = tmp_path / "notes.wav"
    text_file.write_text("hello, I am not a wav file")
    with pytest.raises(ValueError, match="Could not decode the file"):
        load_audio(text_file)
    with pytest.raises(ValueError, match="is a directory"):
        load_audio(tmp_path)


def test_bad_sampling_rates(waveform):
    with pytest.raises(ValueError, match="sampling_rate"):
        load_audio(waveform, sampling_rate=0)
    with pytest.raises(ValueError, match="sampling_rate"):
        load_audio(waveform, sampling_rate=-16000)
    with pytest.raises(ValueError, match="sampled at 16000 Hz"):
        load_audio(WAV_PATH, sampling_rate=48000)
