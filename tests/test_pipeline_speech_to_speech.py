"""The speech-to-speech pipeline: input forms, kwargs pass-through, batch isolation, streaming, errors.

Most tests use a small stand-in chat model whose reply is a pure function of its own prompt row (so any mixing of
rows, prompts or padding in the pipeline shows up), with the real tiny processor. The last tests run the real tiny
random-weight model end to end.
"""

import io
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import pipeline

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf.pipeline_speech_to_speech import SpeechToSpeechPipeline, register_pipeline
from funaudiochat_hf.processing_funaudiochat import SPOKEN_S2M_PROMPT, FunAudioChatProcessor
from funaudiochat_hf.tiny_model import ASSETS_DIR, TINY_MODEL_VERSION, build_tiny_model, synthetic_question

soundfile = pytest.importorskip("soundfile")  # librosa's audio backend (absent on bare GPU hosts)


AUDIO_TOKEN_ID = 346  # `<|AUDIO|>` in the tiny tokenizer
SR_OUT = 24000


@dataclass
class _Output:
    sequences: torch.Tensor
    speech_ids: torch.Tensor
    audio: list
    sampling_rate: int


@dataclass
class _Event:
    text: str
    text_ids: torch.Tensor
    speech_ids: torch.Tensor
    audio: torch.Tensor
    sampling_rate: int
    finished: bool


class _Decoder(torch.nn.Module):
    def __init__(self, names=("中文女", "中文男")):
        super().__init__()
        self.config = type("Cfg", (), {"speaker_names": list(names), "sampling_rate": SR_OUT})()


class StubChatModel(torch.nn.Module):
    """Replies `n<G>` where G = the number of `<|AUDIO|>` tokens of the row, and audio of G*100 samples of value G."""

    def __init__(self, tokenizer, with_decoder=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer = tokenizer
        self.token2wav = _Decoder() if with_decoder else None
        self.config = type("Cfg", (), {"_name_or_path": str(ASSETS_DIR)})()
        self.calls = []

    @property
    def device(self):
        return self.weight.device

    @property
    def dtype(self):
        return self.weight.dtype

    def _reply(self, row_ids, row_mask):
        groups = int((row_ids[row_mask.bool()] == AUDIO_TOKEN_ID).sum())
        text_ids = self.tokenizer(f"n{groups}", add_special_tokens=False)["input_ids"]
        text_ids = text_ids + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return groups, text_ids

    def generate_speech(self, input_ids, attention_mask=None, **kwargs):
        self.calls.append({"input_ids": input_ids, "attention_mask": attention_mask, **kwargs})
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        replies = [self._reply(ids, m) for ids, m in zip(input_ids, mask)]
        width = max(len(t) for _, t in replies)
        pad = self.tokenizer.pad_token_id
        new = torch.tensor([t + [pad] * (width - len(t)) for _, t in replies])
        audio = [torch.full((g * 100,), float(g)) for g, _ in replies]
        return _Output(torch.cat([input_ids, new], 1), torch.zeros(len(replies), 1, dtype=torch.long), audio, SR_OUT)

    def generate_speech_stream(self, input_ids, attention_mask=None, tokenizer=None, **kwargs):
        self.calls.append({"input_ids": input_ids, "tokenizer": tokenizer, **kwargs})
        groups, text_ids = self._reply(input_ids[0], torch.ones_like(input_ids[0]))
        for i, token in enumerate(text_ids):
            last = i == len(text_ids) - 1
            delta = tokenizer.decode([token], skip_special_tokens=True)
            yield _Event(delta, torch.tensor([token]), torch.zeros(0), torch.full((50,), float(groups)), SR_OUT, last)


@pytest.fixture(scope="module")
def processor():
    return FunAudioChatProcessor.from_pretrained(ASSETS_DIR)


@pytest.fixture()
def stub_pipe(processor):
    model = StubChatModel(processor.tokenizer)
    return SpeechToSpeechPipeline(model=model, processor=processor, device="cpu")


def _groups(seconds):
    # 25 speech frames per second, one `<|AUDIO|>` per 5 frames (ceil)
    return -(-int(seconds * 25) // 5)


def test_register_pipeline_is_idempotent():
    register_pipeline()
    register_pipeline()
    from transformers.pipelines import PIPELINE_REGISTRY

    assert PIPELINE_REGISTRY.supported_tasks["speech-to-speech"]["impl"] is SpeechToSpeechPipeline


@pytest.mark.parametrize("form", ["path", "bytes", "array", "tensor", "dict_raw", "dict_array", "chat", "chat_bare"])
def test_every_input_form_gives_the_same_prompt_and_reply(stub_pipe, tmp_path, form):
    clip = synthetic_question(2.0)
    path = tmp_path / "q.wav"
    soundfile.write(path, clip, 16000, subtype="FLOAT")
    inputs = {
        "path": str(path),
        "bytes": path.read_bytes(),
        "array": clip,
        "tensor": torch.from_numpy(clip),
        "dict_raw": {"raw": clip, "sampling_rate": 16000},
        "dict_array": {"array": clip, "sampling_rate": 16000},
        "chat": [{"role": "user", "content": [{"type": "audio", "audio": str(path)}]}],
        "chat_bare": [{"role": "user", "content": clip}],
    }[form]
    reply = stub_pipe(inputs)
    assert set(reply) == {"text", "audio", "sampling_rate"}
    assert reply["text"] == f"n{_groups(2.0)}"
    assert reply["sampling_rate"] == SR_OUT
    assert reply["audio"].dtype == np.float32 and reply["audio"].ndim == 1
    assert reply["audio"].shape == (_groups(2.0) * 100,)
    prompt = stub_pipe.processor.tokenizer.decode(stub_pipe.model.calls[-1]["input_ids"][0])
    # Features of the clip's own 2 s (100 frames a second), not the extractor's whole window: the same embeddings
    assert stub_pipe.model.calls[-1]["input_features"].shape[-1] == 200
    assert prompt.startswith(f"<|im_start|>system\n{SPOKEN_S2M_PROMPT}<|im_end|>\n<|im_start|>user\n<|audio_bos|>")
    assert prompt.endswith("<|audio_eos|><|im_end|>\n<|im_start|>assistant\n")


def test_other_rates_and_stereo_are_converted(stub_pipe):
    clip48 = np.repeat(synthetic_question(2.0), 3)  # 2 s at 48 kHz (crudely upsampled)
    assert stub_pipe(clip48, sampling_rate=48000)["text"] == f"n{_groups(2.0)}"
    stereo = np.stack([synthetic_question(1.0), synthetic_question(1.0)])
    assert stub_pipe({"array": stereo, "sampling_rate": 16000})["text"] == f"n{_groups(1.0)}"


def test_generation_kwargs_pass_through(stub_pipe):
    stub_pipe(synthetic_question(1.0), max_new_tokens=7, temperature=0.5, top_p=0.8, speaker="中文男", seed=3)
    call = stub_pipe.model.calls[-1]
    assert (call["max_new_tokens"], call["temperature"], call["top_p"], call["speaker"], call["seed"]) == (
        7, 0.5, 0.8, "中文男", 3
    )
    assert "system_prompt" not in call and "sampling_rate" not in call


def test_replies_stop_at_im_end_by_default(stub_pipe, processor):
    # Regression: without an explicit eos the loop stopped only at the generation config's eos (<|endoftext|> in the
    # official checkpoint), so real replies ran on past <|im_end|> up to max_new_tokens.
    stub_pipe.model.generation_config = type("GenerationConfig", (), {"eos_token_id": 320})()
    stub_pipe(synthetic_question(1.0))
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stub_pipe.model.calls[-1]["eos_token_id"] == [im_end, 320]
    stub_pipe(synthetic_question(1.0), eos_token_id=7)
    assert stub_pipe.model.calls[-1]["eos_token_id"] == 7


def test_system_prompt_and_multi_turn_history(stub_pipe):
    chat = [
        {"role": "user", "content": [{"type": "audio", "audio": synthetic_question(1.0)}]},
        {"role": "assistant", "content": "first answer"},
        {
            "role": "user",
            "content": [{"type": "audio", "audio": synthetic_question(2.0)}, {"type": "text", "text": "Be brief."}],
        },
    ]
    reply = stub_pipe(chat, system_prompt="You are terse.")
    call = stub_pipe.model.calls[-1]
    prompt = stub_pipe.processor.tokenizer.decode(call["input_ids"][0])
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert "<|im_start|>assistant\nfirst answer<|im_end|>\n" in prompt
    assert "<|audio_eos|>\nBe brief.<|im_end|>" in prompt
    assert prompt.count("<|audio_bos|>") == 2
    assert call["speech_ids"].shape[0] == 2  # both user clips
    assert reply["text"] == f"n{_groups(1.0) + _groups(2.0)}"


def test_chat_with_own_system_turn_keeps_it(stub_pipe):
    chat = [{"role": "system", "content": "Custom."}, {"role": "user", "content": synthetic_question(1.0)}]
    stub_pipe(chat)
    prompt = stub_pipe.processor.tokenizer.decode(stub_pipe.model.calls[-1]["input_ids"][0])
    assert prompt.startswith("<|im_start|>system\nCustom.<|im_end|>\n") and SPOKEN_S2M_PROMPT not in prompt


def test_batch_outputs_are_isolated_and_ordered(stub_pipe):
    seconds = [1.0, 3.0, 0.4, 2.0]
    batch = [synthetic_question(s) for s in seconds]
    replies = stub_pipe(batch, batch_size=3)
    assert isinstance(replies, list) and len(replies) == 4
    # 2 calls: 3 rows left-padded together, then 1
    assert [c["input_ids"].shape[0] for c in stub_pipe.model.calls] == [3, 1]
    assert stub_pipe.model.calls[0]["attention_mask"][:, 0].tolist() == [0, 1, 0]  # left padding
    for s, reply in zip(seconds, replies):
        single = stub_pipe(synthetic_question(s))
        assert reply["text"] == single["text"] == f"n{_groups(s)}"
        np.testing.assert_array_equal(reply["audio"], single["audio"])
    # every row's arrays are its own (mutating one output never changes another)
    replies[0]["audio"][:] = -1
    assert (replies[1]["audio"] == _groups(3.0)).all()


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True])
def test_a_bad_batch_size_is_refused(stub_pipe, batch_size):
    with pytest.raises(ValueError, match="`batch_size` must be a positive integer"):
        stub_pipe([synthetic_question(1.0)] * 2, batch_size=batch_size)


def test_batch_of_chats(stub_pipe):
    chats = [[{"role": "user", "content": synthetic_question(s)}] for s in (1.0, 2.0)]
    replies = stub_pipe(chats)
    assert [r["text"] for r in replies] == [f"n{_groups(1.0)}", f"n{_groups(2.0)}"]


def test_stream_yields_deltas_and_audio_chunks(stub_pipe):
    events = list(stub_pipe.stream(synthetic_question(2.0), max_new_tokens=5))
    assert events[-1]["finished"] and not any(e["finished"] for e in events[:-1])
    assert "".join(e["text"] for e in events) == f"n{_groups(2.0)}"
    audio = np.concatenate([e["audio"] for e in events])
    assert audio.dtype == np.float32 and audio.shape == (50 * len(events),)
    assert stub_pipe.model.calls[-1]["max_new_tokens"] == 5
    assert stub_pipe.model.calls[-1]["tokenizer"] is stub_pipe.processor.tokenizer


def test_speakers_and_default_voice(processor):
    model = StubChatModel(processor.tokenizer)
    pipe = SpeechToSpeechPipeline(model=model, processor=processor, device="cpu", speaker="中文男")
    assert pipe.speakers == ["中文女", "中文男"]
    pipe(synthetic_question(1.0))
    assert pipe.model.calls[-1]["speaker"] == "中文男"
    pipe(synthetic_question(1.0), speaker="中文女")
    assert pipe.model.calls[-1]["speaker"] == "中文女"


def test_unknown_default_speaker_is_a_clear_error(processor):
    with pytest.raises(ValueError, match="Unknown speaker 'nobody'"):
        SpeechToSpeechPipeline(
            model=StubChatModel(processor.tokenizer), processor=processor, device="cpu", speaker="nobody"
        )


def test_separate_decoder_is_passed_to_generation(processor):
    decoder = _Decoder(names=("voice_a",))
    pipe = SpeechToSpeechPipeline(
        model=StubChatModel(processor.tokenizer, with_decoder=False), processor=processor, device="cpu", decoder=decoder
    )
    assert pipe.speakers == ["voice_a"]
    pipe(synthetic_question(1.0))
    assert pipe.model.calls[-1]["speech_decoder"] is decoder


def test_model_without_decoder_is_a_clear_error(processor):
    with pytest.raises(ValueError, match="no speech decoder"):
        SpeechToSpeechPipeline(
            model=StubChatModel(processor.tokenizer, with_decoder=False), processor=processor, device="cpu"
        )


def test_bad_decoder_folder_is_a_clear_error(processor, tmp_path):
    with pytest.raises(ValueError, match="not a CosyVoice3 folder"):
        SpeechToSpeechPipeline(
            model=StubChatModel(processor.tokenizer, with_decoder=False), processor=processor, device="cpu",
            decoder=str(tmp_path),
        )


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "empty list"),
        ([0.1, 0.2, 0.3], "list of numbers"),
        (None, "None"),
        ("/no/such/file.wav", "not found|does not exist|No such"),
        (b"not audio at all", "decode|audio"),
        ([{"role": "user", "content": "hello there"}], "text only"),
        ([{"role": "user", "content": synthetic_question(1.0)}, {"role": "assistant", "content": "x"}], "last turn"),
        ([{"role": "robot", "content": "x"}], "Unknown chat role"),
        ([{"role": "system", "content": "x"}], "no user audio"),
    ],
)
def test_bad_inputs_raise_clear_value_errors(stub_pipe, bad, match):
    with pytest.raises(ValueError, match=match):
        stub_pipe(bad)


def test_bytes_of_a_wav_file_roundtrip(stub_pipe):
    buffer = io.BytesIO()
    soundfile.write(buffer, synthetic_question(1.2), 16000, format="WAV")
    assert stub_pipe(buffer.getvalue())["text"] == f"n{_groups(1.2)}"


# ---------------------------------------------------------------------------------------------------------------------
# The real tiny model, through `pipeline()`


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    # one build per test session (the session's base temp dir is shared by all modules)
    return build_tiny_model(tmp_path_factory.getbasetemp() / "cache" / f"tiny-{TINY_MODEL_VERSION}")


@pytest.fixture(scope="module")
def tiny_pipe(tiny_model_dir):
    return pipeline("speech-to-speech", model=str(tiny_model_dir), device="cpu")


def test_pipeline_factory_with_the_tiny_model(tiny_pipe):
    assert isinstance(tiny_pipe, SpeechToSpeechPipeline)
    reply = tiny_pipe(synthetic_question(1.0), max_new_tokens=12, do_sample=False)
    assert isinstance(reply["text"], str)
    assert reply["sampling_rate"] == 24000
    assert reply["audio"].dtype == np.float32 and reply["audio"].ndim == 1 and reply["audio"].size > 0
    assert np.isfinite(reply["audio"]).all() and np.abs(reply["audio"]).max() <= 1.0


def test_the_tiny_model_says_it_is_noise(tiny_pipe, monkeypatch):
    from transformers.testing_utils import CaptureLogger

    from funaudiochat_hf import pipeline_speech_to_speech

    with CaptureLogger(pipeline_speech_to_speech.logger) as captured:
        SpeechToSpeechPipeline(model=tiny_pipe.model, processor=tiny_pipe.processor)
    assert "RANDOM-WEIGHT" in captured.out and "noise, not speech" in captured.out
    monkeypatch.delattr(tiny_pipe.model.config, "tiny_weight_seed")  # as a trained model: no such warning
    with CaptureLogger(pipeline_speech_to_speech.logger) as captured:
        SpeechToSpeechPipeline(model=tiny_pipe.model, processor=tiny_pipe.processor)
    assert "RANDOM-WEIGHT" not in captured.out


def test_tiny_model_batch_equals_single_runs(tiny_pipe):
    clips = [synthetic_question(1.0), synthetic_question(2.2)]
    batch = tiny_pipe(clips, max_new_tokens=10, do_sample=False)
    for clip, reply in zip(clips, batch):
        single = tiny_pipe(clip, max_new_tokens=10, do_sample=False)
        assert reply["text"] == single["text"]
        np.testing.assert_allclose(reply["audio"], single["audio"], atol=1e-4)


def test_official_two_repo_layout():
    """Chat checkpoint without a decoder + an official CosyVoice3 folder, combined in one call."""
    from conftest import COSYVOICE3_TINY, FUNAUDIOCHAT_TINY

    pipe = pipeline(
        "speech-to-speech", model=str(FUNAUDIOCHAT_TINY), decoder=str(COSYVOICE3_TINY),
        speakers_file=str(COSYVOICE3_TINY / "spk2info.pt"), device="cpu",
    )
    assert getattr(pipe.model, "token2wav", None) is None and pipe.speech_decoder is not None
    assert pipe.speakers  # read from the speaker file
    reply = pipe(synthetic_question(1.0), max_new_tokens=10, do_sample=False, speaker=pipe.speakers[0])
    assert reply["sampling_rate"] == 24000 and reply["audio"].size > 0 and np.isfinite(reply["audio"]).all()


def test_limits_are_checked_before_decoding(tmp_path):
    """The pipeline loads clips with the processor's limit (the feature window) and bounds the system prompt."""
    import soundfile

    from funaudiochat_hf.limits_funaudiochat import MAX_TEXT_CHARS, InputTooLongError
    from funaudiochat_hf.pipeline_speech_to_speech import SpeechToSpeechPipeline

    path = tmp_path / "long.wav"
    soundfile.write(path, np.zeros(31 * 8000, np.float32), 8000)
    with pytest.raises(InputTooLongError, match="longer than the 30 s limit"):
        SpeechToSpeechPipeline._user_content([{"type": "audio", "audio": str(path)}], None, 30.0)
    with pytest.raises(InputTooLongError, match="longer than the 30 s limit"):
        SpeechToSpeechPipeline._user_content([{"type": "audio", "audio": np.zeros(31 * 16000, np.float32)}], None, 30)
    pipe = SpeechToSpeechPipeline.__new__(SpeechToSpeechPipeline)  # only `_render` is exercised
    pipe.processor = None
    turn = {"role": "user", "content": [{"type": "audio", "audio": np.zeros(16000, np.float32)}]}
    with pytest.raises(InputTooLongError, match="The system prompt has"):
        pipe._render([turn], "x" * (MAX_TEXT_CHARS + 1), None)
