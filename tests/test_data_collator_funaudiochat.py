"""Tests for `FunAudioChatDataCollator`: the reference training batch (fixture d), multi-sample padding, multi-turn
conversations, the reference LLaMA-Factory sample format and input validation."""

import json
import re

import numpy as np
import pytest
import torch
from conftest import FIXTURES, FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, assert_close_to_golden_features
from safetensors.torch import load_file
from transformers import AutoProcessor

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf.data_collator_funaudiochat import IGNORE_INDEX, FunAudioChatDataCollator
from funaudiochat_hf.processing_funaudiochat import AUDIO_TEMPLATE, DEFAULT_S2M_PROMPT


WAV_PATH = FUNAUDIOCHAT_GOLDEN / "input_16k.wav"
REPLY = "Sure! The weather today is sunny and warm."
BATCH_KEYS = [
    "input_ids",
    "attention_mask",
    "labels",
    "speech_ids",
    "speech_attention_mask",
    "input_features",
    "feature_attention_mask",
    "feature_exist_mask",
    "text_ids",
    "text_attention_mask",
]


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(FUNAUDIOCHAT_TINY)


@pytest.fixture(scope="module")
def collator(processor):
    return FunAudioChatDataCollator(processor)


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_file(FUNAUDIOCHAT_GOLDEN / "d_train.safetensors")


@pytest.fixture(scope="module")
def assistant_json() -> str:
    """The assistant audio item of the reference sample, as printed in the MANIFEST."""
    manifest = (FIXTURES / "MANIFEST.md").read_text()
    return re.search(r"audio json 1 \(assistant\): `(\{.*?\})`", manifest).group(1)


@pytest.fixture(scope="module")
def reply_tokens(assistant_json) -> list[int]:
    return [int(t) for t in re.findall(r"\[AU(\d+)\]", json.loads(assistant_json)["token"])]


def reference_sample(reply_tokens, **overrides):
    sample = {
        "system": DEFAULT_S2M_PROMPT,
        "messages": [
            {"role": "user", "audio": str(WAV_PATH)},
            {"role": "assistant", "text": REPLY, "speech_tokens": reply_tokens},
        ],
    }
    sample.update(overrides)
    return sample


def assert_matches_golden(batch, golden):
    assert list(batch.keys()) == BATCH_KEYS
    for key in BATCH_KEYS:
        expected = golden[f"batch.{key}"]
        assert batch[key].dtype == expected.dtype, key
        if key == "input_features":
            assert_close_to_golden_features(batch[key], expected)
        else:
            assert torch.equal(batch[key], expected), key


def test_reference_training_batch_exact(collator, golden, reply_tokens):
    assert len(reply_tokens) == 27
    assert_matches_golden(collator([reference_sample(reply_tokens)]), golden)


def test_default_system_prompt_is_s2m(collator, golden, reply_tokens):
    sample = reference_sample(reply_tokens)
    del sample["system"]
    assert_matches_golden(collator([sample]), golden)


def test_reference_llamafactory_format_exact(collator, golden, assistant_json):
    user_item = {"path": str(WAV_PATH), "text": "", "token": "<|audio_pad|>" * 61}
    sample = {
        "system": DEFAULT_S2M_PROMPT,
        "messages": [{"role": "user", "content": AUDIO_TEMPLATE}, {"role": "assistant", "content": AUDIO_TEMPLATE}],
        "audio": [json.dumps(user_item), assistant_json],
    }
    assert_matches_golden(collator([sample]), golden)


def test_audio_as_array_or_dict(collator, golden, reply_tokens):
    waveform = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")["waveform_16k"].numpy()
    for audio in (waveform, {"array": waveform.tolist(), "sampling_rate": 16000}):
        sample = reference_sample(reply_tokens)
        sample["messages"][0]["audio"] = audio
        assert_matches_golden(collator([sample]), golden)


def test_labels_cover_exactly_the_assistant_turn(collator, processor, reply_tokens):
    batch = collator([reference_sample(reply_tokens)])
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    supervised = labels != IGNORE_INDEX
    start = int(supervised.nonzero()[0])
    assert supervised[start:].all() and not supervised[:start].any()
    assert torch.equal(labels[start:], ids[start:])
    assert processor.decode(ids[start:]) == (
        "<|audio_bos|>" + "<|AUDIO|>" * 8 + "<|audio_eos|><|im_end|>\n"  # ceil((10 + 27) / 5) = 8
    )
    assert processor.decode(ids[:start]).endswith("<|im_start|>assistant\n")


def test_two_samples_right_padded(collator, processor, reply_tokens):
    first = reference_sample(reply_tokens)
    waveform = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")["waveform_16k"].numpy()
    second = {
        "messages": [
            {"role": "user", "audio": waveform[:9000], "text": "Answer briefly."},
            {"role": "assistant", "text": "Yes.", "speech_tokens": [5, 6, 7]},
        ]
    }
    batch = collator([first, second])
    singles = [collator([first]), collator([second])]
    assert batch["input_ids"].shape[0] == 2
    assert batch["feature_exist_mask"].tolist() == [True, False, True, False]
    assert batch["text_attention_mask"].tolist() == [False, True, False, True]
    assert batch["speech_attention_mask"].sum(-1).tolist() == [61, 37, 14, 13]  # int(9000/16000*25) = 14
    assert batch["input_features"].shape == (2, 128, 245)
    assert batch["feature_attention_mask"].sum(-1).tolist() == [245, 57]  # ceil(9000 / 160)
    pad_id = processor.tokenizer.pad_token_id
    for row, single in enumerate(singles):
        length = single["input_ids"].shape[1]
        assert torch.equal(batch["input_ids"][row, :length], single["input_ids"][0])
        assert torch.equal(batch["labels"][row, :length], single["labels"][0])
        assert (batch["input_ids"][row, length:] == pad_id).all()
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].sum() == length
    assert torch.equal(batch["speech_ids"][2:, :14], singles[1]["speech_ids"][:, :14])
    assert (batch["speech_ids"][3, 13:] == processor.speech_tokenizer.pad_token_id).all()
    assert batch["speech_ids"][3, :13].tolist() == [36] * 10 + [5, 6, 7]
    assert "Answer briefly." in processor.decode(batch["input_ids"][1])
    # text_ids: both replies, right padded with the text pad id
    reply_ids = processor.tokenizer(REPLY)["input_ids"]
    assert batch["text_ids"][1, : len(reply_ids)].tolist() == reply_ids
    assert (batch["text_ids"][[0, 2]] == pad_id).all()


def test_pad_to_multiple_of(processor, reply_tokens):
    batch = FunAudioChatDataCollator(processor, pad_to_multiple_of=8)([reference_sample(reply_tokens)])
    assert batch["input_ids"].shape == (1, 88)
    assert batch["attention_mask"].sum() == 82
    assert (batch["labels"][0, 82:] == IGNORE_INDEX).all()


def test_multi_turn_with_text_only_turn(collator, processor, reply_tokens):
    sample = {
        "messages": [
            {"role": "user", "audio": str(WAV_PATH)},
            {"role": "assistant", "text": "A text-only answer."},
            {"role": "user", "text": "And now speak."},
            {"role": "assistant", "text": REPLY, "speech_tokens": reply_tokens},
        ]
    }
    batch = collator([sample])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    text = processor.decode(ids)
    assert text.count("<|im_start|>system") == 1
    assert "A text-only answer.<|im_end|>\n<|im_start|>user\nAnd now speak.<|im_end|>" in text
    supervised = processor.decode(ids[labels != IGNORE_INDEX])
    assert supervised == "A text-only answer.<|im_end|>\n<|audio_bos|>" + "<|AUDIO|>" * 8 + "<|audio_eos|><|im_end|>\n"
    assert batch["speech_ids"].shape[0] == 2 and batch["feature_exist_mask"].tolist() == [True, False]


def test_speech_delay_tokens(processor, reply_tokens):
    batch = FunAudioChatDataCollator(processor, speech_delay_tokens=0)([reference_sample(reply_tokens)])
    assert batch["speech_ids"][1, :27].tolist() == reply_tokens
    assert (batch["input_ids"][0] == 346).sum() == 13 + 6  # ceil(27 / 5)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["messages"].pop(), "ending with an assistant turn"),
        (lambda s: s["messages"].reverse(), "expected role 'user'"),
        (lambda s: s["messages"][1].update(speech_tokens=[1, -2]), "non-negative ints"),
        (lambda s: s["messages"][1].update(speech_tokens=[]), "non-empty"),
        (lambda s: s["messages"][1].update(speech_tokens=[999]), "not in the speech tokenizer vocabulary"),
        (lambda s: s["messages"][0].update(audio="/no/such.wav"), "not found"),
        (lambda s: s["messages"][0].update(audio=np.zeros(100, np.float32)), "at least 40 ms"),
        (lambda s: s["messages"][0].pop("audio"), "needs 'audio' and/or 'text'"),
        (lambda s: s.pop("messages"), "'messages' list"),
    ],
)
def test_invalid_samples(collator, reply_tokens, mutate, message):
    sample = reference_sample(list(reply_tokens))
    sample["messages"] = [dict(m) for m in sample["messages"]]
    mutate(sample)
    with pytest.raises(ValueError, match=message):
        collator([sample])


def test_empty_batch(collator):
    with pytest.raises(ValueError, match="empty"):
        collator([])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s["messages"][0].update(text="transcribe " + AUDIO_TEMPLATE),
        lambda s: s["messages"][0].update(text="<|AUDIO|>"),
        lambda s: s["messages"][1].update(text="Sure " + AUDIO_TEMPLATE),
        lambda s: s.update(system="be brief <|audio_bos|>"),
    ],
)
def test_audio_tokens_in_text_raise_naming_the_sample(collator, reply_tokens, mutate):
    """A sample whose text holds the audio template used to raise StopIteration inside the collator, which a
    DataLoader takes as the end of the data: training stopped after 0 steps without a word."""
    good = reference_sample(list(reply_tokens))
    bad = reference_sample(list(reply_tokens))
    bad["messages"] = [dict(m) for m in bad["messages"]]
    mutate(bad)
    loader = torch.utils.data.DataLoader([good, bad, good], batch_size=1, collate_fn=collator)
    batches = iter(loader)
    next(batches)
    with pytest.raises(ValueError, match=r"Sample 0, (message \d|system prompt): the text contains the audio token"):
        next(batches)


def test_reference_sample_with_a_bare_audio_token_is_refused(collator, assistant_json):
    sample = {
        "messages": [
            {"role": "user", "content": "<|AUDIO|> and " + AUDIO_TEMPLATE},
            {"role": "assistant", "content": AUDIO_TEMPLATE},
        ],
        "audio": [json.dumps({"path": str(WAV_PATH), "token": "<|audio_pad|>" * 30, "text": ""}), assistant_json],
    }
    with pytest.raises(ValueError, match="Sample 0, message 0: the text contains the audio token"):
        collator([sample])


def test_overlong_text_and_audio_are_refused(collator, reply_tokens, processor):
    sample = reference_sample(list(reply_tokens), system="x" * 20000)
    with pytest.raises(ValueError, match="system prompt: the text has 20000 characters"):
        collator([sample])
    too_long = np.zeros(int(processor.max_audio_seconds * 16000) + 16, np.float32)
    sample = reference_sample(list(reply_tokens))
    sample["messages"][0] = {"role": "user", "audio": too_long}
    with pytest.raises(ValueError, match="longer than the 30 s limit"):
        collator([sample])
