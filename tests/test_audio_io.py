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


def test_a_waveform_dict_needs_one_sampling_rate(waveform):
    """A dict's waveform was taken as 16 kHz when it named no rate, and its rate silently won over `sampling_rate=`:
    only bare arrays default to the target rate (a dict follows the transformers ASR pipeline: it names its rate),
    and two different rates for one waveform are refused."""
    for key in ("array", "raw"):
        with pytest.raises(ValueError, match="needs its rate under 'sampling_rate'"):
            load_audio({key: waveform})
        with pytest.raises(ValueError, match="needs its rate"):
            load_audio({key: waveform, "sampling_rate": None})
        with pytest.raises(ValueError, match=r"'sampling_rate': 48000 but `sampling_rate=16000` was also given"):
            load_audio({key: waveform, "sampling_rate": 48000}, sampling_rate=16000)
        # One rate, in the dict or as the argument, or the same in both.
        np.testing.assert_array_equal(load_audio({key: waveform}, sampling_rate=16000), waveform)
        both = load_audio({key: waveform, "sampling_rate": 16000}, sampling_rate=16000)
        np.testing.assert_array_equal(both, waveform)
    up = resample(waveform, 16000, 48000)
    np.testing.assert_array_equal(load_audio({"array": up}, sampling_rate=48000), load_audio(up, sampling_rate=48000))


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
        (np.zeros((2, 0), dtype=np.float32), r"empty: a waveform of shape \(2, 0\)"),  # once averaged into 2 NaNs
        (np.zeros((0, 2), dtype=np.float32), r"empty: a waveform of shape \(0, 2\)"),
        (torch.zeros(2, 0), "empty"),
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


def test_only_undecodable_input_is_an_audio_decode_error(tmp_path):
    """`AudioDecodeError` (a ValueError) says "not audio at all", so that a caller (the CLI) can tell it from audio
    that decodes but is refused (empty, too long, an unsupported rate), whose messages name the file."""
    from funaudiochat_hf.audio_io import AudioDecodeError

    text_file = tmp_path / "notes.wav"
    text_file.write_text("hello, I am not a wav file")
    for undecodable in (text_file, b"this is not audio at all" * 10):
        with pytest.raises(AudioDecodeError, match="Could not decode"):
            load_audio(undecodable)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    refused = [(empty, "The file '.*empty.wav' is empty: it contains 0 samples"),
               (_wav_with_header_rate(4000), "sampled at 4000 Hz")]  # fmt: skip
    for audio, message in refused:
        with pytest.raises(ValueError, match=message) as caught:
            load_audio(audio)
        assert not isinstance(caught.value, AudioDecodeError)


def test_bad_sampling_rates(waveform):
    with pytest.raises(ValueError, match="sampling_rate"):
        load_audio(waveform, sampling_rate=0)
    with pytest.raises(ValueError, match="sampling_rate"):
        load_audio(waveform, sampling_rate=-16000)
    with pytest.raises(ValueError, match="sampled at 16000 Hz"):
        load_audio(WAV_PATH, sampling_rate=48000)


def _wav_with_header_rate(rate: int, seconds: float = 1.0) -> bytes:
    """A 16 kHz PCM-16 wav whose header claims `rate` (the data is unchanged: 32 KB per second)."""
    data = bytearray(_encode(np.zeros(int(16000 * seconds), np.float32), 16000, subtype="PCM_16"))
    data[24:28] = rate.to_bytes(4, "little")
    data[28:32] = (2 * rate).to_bytes(4, "little")
    return bytes(data)


@pytest.mark.parametrize("rate", [1, 2, 4000, 400_000])
def test_file_header_rate_outside_the_range_is_refused_before_decoding(rate, tmp_path, monkeypatch):
    """A 32 KB wav claiming 1 Hz became an 80,328-token prompt and a 25.8 GB allocation."""
    import soxr

    monkeypatch.setattr(soxr, "resample", lambda *a, **k: pytest.fail("resampled a refused file"))
    data = _wav_with_header_rate(rate)
    with pytest.raises(ValueError, match=f"sampled at {rate} Hz; supported rates are 8000-384000 Hz"):
        load_audio(data)
    (tmp_path / "claims.wav").write_bytes(data)
    with pytest.raises(ValueError, match=f"The file '.*claims.wav' is sampled at {rate} Hz"):
        load_audio(tmp_path / "claims.wav")


@pytest.mark.parametrize("rate", [2, 7999, 384_001, float("nan"), float("inf"), 16000.5])
def test_waveform_rate_outside_the_range_is_refused(waveform, rate):
    """`{"raw": ..., "sampling_rate": 2}` tried to allocate 40.7 GB; NaN failed with int()'s message."""
    with pytest.raises(ValueError, match="`sampling_rate"):
        load_audio({"raw": waveform, "sampling_rate": rate})
    with pytest.raises(ValueError, match="`sampling_rate"):
        load_audio(waveform, sampling_rate=rate)


def test_duration_limit_is_checked_on_the_header_before_decoding(monkeypatch):
    sf_module = pytest.importorskip("soundfile")
    data = _encode(np.zeros(3 * 16000, np.float32), 16000, subtype="PCM_16")
    assert load_audio(data, max_seconds=3).shape == (48000,)

    def no_read(*args, **kwargs):
        raise AssertionError("decoded a file that is over the limit")

    monkeypatch.setattr(sf_module.SoundFile, "read", no_read)
    with pytest.raises(ValueError, match=r"lasts 3.0 s \(48000 samples at 16000 Hz\), longer than the 2.5 s limit"):
        load_audio(data, max_seconds=2.5)


def test_duration_limit_for_waveforms_and_the_default(waveform):
    with pytest.raises(ValueError, match="longer than the 2 s limit"):
        load_audio(np.zeros(32001, np.float32), max_seconds=2)
    # 48 kHz input: the limit is on the real duration, checked before resampling
    with pytest.raises(ValueError, match=r"lasts 2.0 s \(96048 samples at 48000 Hz\)"):
        load_audio(np.zeros(96048, np.float32), sampling_rate=48000, max_seconds=2)
    with pytest.raises(ValueError, match="longer than the 300 s limit"):
        load_audio(np.zeros(300 * 8000 + 1, np.int16), sampling_rate=8000)
    for bad in (0, -1, float("nan"), "10", True):
        with pytest.raises(ValueError, match="max_seconds"):
            load_audio(waveform, max_seconds=bad)


def test_truncated_wav_warns_and_decodes_what_is_there(tmp_path):
    data = _encode(np.full(16000, 0.25, np.float32), 16000, subtype="PCM_16")
    cut = data[: len(data) // 2]
    with pytest.warns(UserWarning, match=r"looks truncated.*decoded the 7989 samples present"):
        loaded = load_audio(cut)
    np.testing.assert_allclose(loaded, 0.25, atol=1e-4)
    (tmp_path / "cut.wav").write_bytes(cut)
    with pytest.warns(UserWarning, match="The file '.*cut.wav' looks truncated"):
        load_audio(tmp_path / "cut.wav")
    noise = (0.1 * np.random.default_rng(0).standard_normal(5 * 16000)).astype(np.float32)
    ogg = _encode(noise, 16000, fmt="OGG", subtype="VORBIS")
    with pytest.warns(UserWarning, match="looks truncated"):
        assert 0 < len(load_audio(ogg[: len(ogg) // 2])) < len(noise)


def test_complete_files_do_not_warn(waveform):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fmt, subtype in (("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("OGG", "VORBIS")):
            load_audio(_encode(waveform, 16000, fmt=fmt, subtype=subtype))
        load_audio(WAV_PATH)


def test_float64_beyond_float32_range_is_named():
    with pytest.raises(ValueError, match="reach 1e"):
        load_audio(np.array([0.0, 1e300, 0.5]))
    with pytest.raises(ValueError, match="1 Inf"):  # a real Inf stays named as such
        load_audio(np.array([0.0, np.inf, 0.5]))
