"""Fuzzing the input surfaces (issue 50): the audio loader, the processor, the speech decoder's inputs and the decoder
yaml reader. Every generated input must end in a result of the documented form or a clear `ValueError` /
`TypeError`, within a per-example deadline and a bounded allocation, and the surfaces must give their fixed result
again afterwards (no state corrupted by a failed call).

Examples are few and derandomized (the same every run, no example database), so the file runs in well under a minute
on two cores. `generate_speech` arguments are fuzzed with the generation tests.
"""

import io
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from conftest import COSYVOICE3_TINY, FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from funaudiochat_hf import CosyVoice3Token2Wav  # noqa: E402
from funaudiochat_hf.audio_io import load_audio  # noqa: E402
from funaudiochat_hf.conversion_cosyvoice3 import read_cosyvoice3_yaml  # noqa: E402


sf = pytest.importorskip("soundfile")

FUZZ = settings(
    max_examples=40,
    deadline=5000,  # ms per example: far above the slowest example, far below a hang
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_PEAK_BYTES = 256 << 20  # numpy / Python allocations of one example (the inputs themselves are a few MB at most)
WAV_PATH = FUNAUDIOCHAT_GOLDEN / "input_16k.wav"


class _PeakAllocation:
    """Peak of the numpy / Python allocations (tracemalloc) inside the block."""

    def __enter__(self):
        tracemalloc.start()
        return self

    def __exit__(self, *exc):
        self.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return False


def _assert_waveform(result, max_seconds=300.0, rate=16000):
    assert isinstance(result, np.ndarray) and result.dtype == np.float32 and result.ndim == 1
    assert 0 < result.size <= int(np.ceil(max_seconds * rate)) + 1
    assert np.isfinite(result).all()


def _wav_bytes(seconds: float, rate: int, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros(max(int(seconds * rate), 1), np.float32), rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


# -- audio loader ---------------------------------------------------------------------------------------------------

RATES = st.one_of(
    st.sampled_from([None, 8000, 16000, 22050, 48000]),
    st.integers(-10, 10),
    st.integers(7000, 400_000),
    st.sampled_from([float("nan"), float("inf"), -1.5, 16000.0, 22050.5, True]),
)
WAVEFORMS = st.one_of(
    hnp.arrays(np.float32, st.integers(1, 8000), elements=st.floats(-1, 1, width=32)),  # plausible clips
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64, np.int16, np.int32, np.uint8, np.bool_, np.complex64]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
    ),
)


def _mutated_wav(data: bytes, position: int, value: int, cut: int) -> bytes:
    """A valid wav with one header byte changed and the tail cut: rates, sizes and chunk ids go wrong."""
    out = bytearray(data)
    out[position % 44] = value
    return bytes(out[: max(cut, 0) or None])


@FUZZ
@given(
    source=st.one_of(
        st.binary(max_size=2048),
        st.builds(
            _mutated_wav,
            st.sampled_from([_wav_bytes(0.5, 16000), _wav_bytes(0.2, 8000, "FLOAT"), _wav_bytes(0.1, 48000)]),
            st.integers(0, 43),
            st.integers(0, 255),
            st.integers(-1, 20000),
        ),
    )
)
def test_fuzz_audio_bytes(source):
    with _PeakAllocation() as memory, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # truncated files warn; they must still decode or fail clearly
        try:
            result = load_audio(source, max_seconds=30)
        except ValueError:
            result = None
    event("decoded" if result is not None else "ValueError")
    if result is not None:
        _assert_waveform(result, max_seconds=30)
    assert memory.peak < MAX_PEAK_BYTES


@FUZZ
@given(waveform=WAVEFORMS, rate=RATES, as_dict=st.booleans())
def test_fuzz_audio_arrays(waveform, rate, as_dict):
    with _PeakAllocation() as memory:
        try:
            if as_dict:
                result = load_audio({"array": waveform, "sampling_rate": rate}, max_seconds=30)
            else:
                result = load_audio(waveform, sampling_rate=rate, max_seconds=30)
        except ValueError:
            result = None
    event("loaded" if result is not None else "ValueError")
    if result is not None:
        _assert_waveform(result, max_seconds=30)
    assert memory.peak < MAX_PEAK_BYTES


def test_audio_loader_gives_its_fixed_result_after_fuzzing():
    from safetensors.torch import load_file

    expected = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")["waveform_16k"].numpy()
    np.testing.assert_array_equal(load_audio(WAV_PATH), expected)


# -- processor ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    import funaudiochat_hf  # noqa: F401  (registers the Auto classes)

    return AutoProcessor.from_pretrained(FUNAUDIOCHAT_TINY)


TEXT_PIECES = st.sampled_from(
    ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|audio_pad|>", "<|im_start|>", "hello ", "\n", "你好"]
    + ["x" * 5000]
)
CLIPS = st.one_of(
    hnp.arrays(np.float32, st.integers(0, 40_000), elements=st.floats(-1, 1, width=32)),
    st.sampled_from([np.full(1600, np.nan, np.float32), np.zeros((2, 800), np.float32), "", "/no/such.wav", 7]),
    st.builds(lambda s: '{"path": "", "token": "' + s + '"}', st.sampled_from(["", "<|audio_pad|>" * 3, "[AU0001]"])),
)


@FUZZ
@given(
    texts=st.lists(st.lists(TEXT_PIECES, max_size=6).map("".join), min_size=1, max_size=3),
    clips=st.lists(CLIPS, max_size=3),
    rate=st.sampled_from([None, 8000, 16000, 44100, 1, float("nan")]),
    padding=st.sampled_from(["max_length", "longest"]),
)
def test_fuzz_processor(processor, texts, clips, rate, padding):
    with _PeakAllocation() as memory:
        try:
            outputs = processor(text=texts, audio=clips or None, sampling_rate=rate, feature_padding=padding)
        except ValueError:
            outputs = None
    event("processed" if outputs is not None else "ValueError")
    assert memory.peak < MAX_PEAK_BYTES
    if outputs is None:
        return
    ids = outputs["input_ids"]
    assert ids.shape[0] == len(texts) and ids.dtype == torch.long
    num_placeholders = int((ids == processor.audio_token_id).sum())
    if "speech_ids" in outputs:
        valid = outputs["speech_attention_mask"].sum(-1)
        assert num_placeholders == int(((valid + 4) // 5).sum())
        if "input_features" in outputs:
            assert torch.isfinite(outputs["input_features"]).all()
            assert outputs["input_features"].shape[-1] <= 3000
    else:
        assert num_placeholders == 0


def test_processor_gives_its_fixed_result_after_fuzzing(processor):
    from safetensors.torch import load_file

    from funaudiochat_hf.processing_funaudiochat import AUDIO_TEMPLATE, SPOKEN_S2M_PROMPT

    golden = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")
    messages = [{"role": "system", "content": SPOKEN_S2M_PROMPT}, {"role": "user", "content": AUDIO_TEMPLATE}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    outputs = processor(text=prompt, audio=str(WAV_PATH), feature_padding="max_length")  # the reference's tensors
    for key in ("input_ids", "attention_mask", "speech_ids", "speech_attention_mask", "feature_attention_mask"):
        assert torch.equal(outputs[key], golden[key]), key


# -- speech decoder inputs ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder():
    return CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()


@pytest.fixture(scope="module")
def decoder_reference(decoder):
    """Offline and streamed audio of fixed tokens, computed before any fuzzing."""
    return _decode_fixed(decoder)


def _decode_fixed(decoder):
    tokens = torch.arange(0, 600, 20).reshape(1, -1)
    offline = decoder(tokens).waveform
    stream = decoder.streaming_decoder(token_hop_len=10)
    pieces = [stream.push(tokens[0, i : i + 7]) for i in range(0, tokens.shape[1], 7)]
    streamed = torch.cat(pieces + [stream.finalize()])
    return offline, streamed


TOKEN_SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=24)
TOKEN_ARRAYS = st.one_of(
    hnp.arrays(np.int64, st.sampled_from([(24,), (1, 24)]), elements=st.integers(0, 6560)),  # valid ids
    hnp.arrays(np.int64, TOKEN_SHAPES, elements=st.integers(-2, 6600)),  # mostly valid ids (vocabulary: 6561)
    hnp.arrays(st.sampled_from([np.int32, np.int16, np.uint8, np.float32, np.bool_]), TOKEN_SHAPES),
)
EMBEDDINGS = st.one_of(
    st.none(),
    hnp.arrays(np.float32, st.sampled_from([(192,), (1, 192), (2, 192), (3, 192), (191,), (0, 192)]),
               elements=st.floats(-10, 10, width=32) | st.sampled_from([np.nan, np.inf])),
    hnp.arrays(np.int64, (192,)),
)


@FUZZ
@given(
    tokens=TOKEN_ARRAYS,
    embedding=EMBEDDINGS,
    lengths=st.one_of(st.none(), st.just([24]), st.lists(st.integers(-2, 30), max_size=3)),
    entry=st.sampled_from(["forward", "tokens_to_mel", "push"]),
)
def test_fuzz_decoder_inputs(decoder, decoder_reference, tokens, embedding, lengths, entry):
    tokens = torch.from_numpy(np.ascontiguousarray(tokens))
    embedding = None if embedding is None else torch.from_numpy(embedding)
    try:
        if entry == "forward":
            output = decoder(tokens, speaker_embedding=embedding, speech_token_lengths=lengths)
            audio = output.waveform
            assert audio.shape[0] == output.waveform_lengths.shape[0] >= 1
        elif entry == "tokens_to_mel":
            speaker = decoder.speaker_embeddings[0] if embedding is None else embedding
            audio = decoder.tokens_to_mel(tokens, speaker, speech_token_lengths=lengths)
            assert audio.shape[1] == decoder.config.mel_bins
        else:
            stream = decoder.streaming_decoder(speaker_embedding=embedding, token_hop_len=5)
            audio = torch.cat([stream.push(tokens), stream.finalize()])
            assert audio.dim() == 1
    except (ValueError, TypeError) as error:
        event(f"{entry}: {type(error).__name__}")
        return
    event(f"{entry}: decoded")
    assert torch.isfinite(audio).all()


def test_decoder_gives_its_fixed_result_after_fuzzing(decoder, decoder_reference):
    offline, streamed = _decode_fixed(decoder)
    torch.testing.assert_close(offline, decoder_reference[0], atol=0, rtol=0)
    torch.testing.assert_close(streamed, decoder_reference[1], atol=0, rtol=0)


# -- decoder yaml ---------------------------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "d"])
SCALARS = st.one_of(
    st.integers(-(10**12), 10**12),
    st.sampled_from(["1.5", "'text'", "null", "true", ".inf", ".nan", "[]", "{}"]),
)
REFS = st.builds(
    lambda left, op, right: f"!ref <{left}> {op} {right}",
    NAMES,
    st.sampled_from(["+", "-", "*", "/", "//", "**", "%", "and"]),
    st.one_of(NAMES.map(lambda n: f"<{n}>"), st.integers(-3, 10**9).map(str), st.just("'x'")),
)


def _yaml_document(values, flow_value, alias_levels, width):
    lines = [f"{name}: {value}" for name, value in zip("abcd", values)]
    if alias_levels:
        lines.append("z0: &z0 [1, 2, 3]")
        lines += [f"z{i}: &z{i} [" + ", ".join([f"*z{i - 1}"] * width) + "]" for i in range(1, alias_levels + 1)]
        flow_value = f"*z{alias_levels}"
    lines.append(f"flow: {{x: {flow_value}, y: !ref <a>}}")
    lines.append("hift: {sampling_rate: !ref <b>}")
    return "\n".join(lines) + "\n"


@FUZZ
@given(
    values=st.lists(st.one_of(SCALARS.map(str), REFS), min_size=4, max_size=4),
    flow_value=st.one_of(SCALARS.map(str), REFS),
    alias_levels=st.integers(0, 12),
    width=st.integers(1, 12),
)
def test_fuzz_decoder_yaml(tmp_path_factory, values, flow_value, alias_levels, width):
    path = tmp_path_factory.mktemp("yaml") / "cosyvoice3.yaml"
    path.write_text(_yaml_document(values, flow_value, alias_levels, width))
    with _PeakAllocation() as memory:
        try:
            sections = read_cosyvoice3_yaml(path)
        except ValueError:
            sections = None
    event("read" if sections is not None else "ValueError")
    assert memory.peak < MAX_PEAK_BYTES
    if sections is not None:
        assert set(sections) == {"top", "flow", "hift"}


def test_yaml_reader_gives_its_fixed_result_after_fuzzing():
    sections = read_cosyvoice3_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml")
    assert sections["flow"]["decoder"]["estimator"]["static_chunk_size"] == 50
    assert sections["hift"]["sampling_rate"] == 24000
