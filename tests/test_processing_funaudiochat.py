"""Tests for `FunAudioChatProcessor`: exact parity with the reference processor (fixture a), every audio input form,
batching, the chat template, decoding helpers, errors and the save/load round trip."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, assert_close_to_golden_features
from safetensors.torch import load_file
from transformers import AutoProcessor

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf.audio_io import resample
from funaudiochat_hf.processing_funaudiochat import (
    AUDIO_TEMPLATE,
    DEFAULT_CHAT_TEMPLATE,
    DEFAULT_S2M_PROMPT,
    DEFAULT_S2T_PROMPT,
    SPOKEN_S2M_PROMPT,
    FunAudioChatProcessor,
)


WAV_PATH = FUNAUDIOCHAT_GOLDEN / "input_16k.wav"
KEYS = [
    "input_ids",
    "attention_mask",
    "speech_ids",
    "speech_attention_mask",
    "input_features",
    "feature_attention_mask",
    "feature_exist_mask",
]


@pytest.fixture(scope="module")
def processor() -> FunAudioChatProcessor:
    return AutoProcessor.from_pretrained(FUNAUDIOCHAT_TINY)


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")


@pytest.fixture(scope="module")
def prompt(processor) -> str:
    messages = [{"role": "system", "content": SPOKEN_S2M_PROMPT}, {"role": "user", "content": AUDIO_TEMPLATE}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# The reference processor pads every clip's features to the extractor's whole window; the default pads to the
# longest clip (same values on valid frames, see `test_compact_feature_padding_matches_on_valid_frames`).
REFERENCE_PADDING = {"feature_padding": "max_length"}


def assert_matches_golden(outputs, golden):
    assert list(outputs.keys()) == KEYS
    for key in KEYS:
        assert outputs[key].dtype == golden[key].dtype, key
        if key == "input_features":
            assert_close_to_golden_features(outputs[key], golden[key])
        else:
            assert torch.equal(outputs[key], golden[key]), key


def test_prompt_constants():
    assert DEFAULT_S2T_PROMPT == "You are asked to generate text tokens."
    assert SPOKEN_S2M_PROMPT.startswith(DEFAULT_S2M_PROMPT + " 你的名字是小云。")
    assert AUDIO_TEMPLATE == "<|audio_bos|><|AUDIO|><|audio_eos|>"


def test_auto_processor_and_config(processor):
    assert isinstance(processor, FunAudioChatProcessor)
    assert processor.audio_group_size == 5
    assert processor.sampling_rate == 16000
    assert processor.speech_tokenizer.pad_token == "<|audio_pad|>"
    assert processor.audio_token_id == 346
    assert processor.model_input_names == KEYS


def test_chat_template_render(processor, prompt):
    assert processor.chat_template == DEFAULT_CHAT_TEMPLATE == (FUNAUDIOCHAT_TINY / "chat_template.jinja").read_text()
    assert prompt == (
        f"<|im_start|>system\n{SPOKEN_S2M_PROMPT}<|im_end|>\n<|im_start|>user\n{AUDIO_TEMPLATE}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_system = processor.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_system == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_fixture_a_exact(processor, golden, prompt):
    outputs = processor(text=prompt, audio=[golden["waveform_16k"].numpy()], return_tensors="pt", **REFERENCE_PADDING)
    assert_matches_golden(outputs, golden)
    # 2.45 s -> int(61.25) = 61 speech frames -> 13 placeholders, speech padded to 65
    assert outputs["speech_attention_mask"].sum().item() == 61
    assert (outputs["input_ids"] == processor.audio_token_id).sum().item() == 13


@pytest.mark.parametrize("form", ["path", "path_str", "bytes", "tensor", "dict", "single", "json_item"])
def test_audio_input_forms_are_exact(processor, golden, prompt, form):
    waveform = golden["waveform_16k"].numpy()
    audio = {
        "path": [WAV_PATH],
        "path_str": [str(WAV_PATH)],
        "bytes": [WAV_PATH.read_bytes()],
        "tensor": [golden["waveform_16k"]],
        "dict": [{"array": waveform, "sampling_rate": 16000}],
        "single": waveform,
        "json_item": [json.dumps({"path": str(WAV_PATH), "token": "<|audio_pad|>" * 61, "text": ""})],
    }[form]
    assert_matches_golden(processor(text=prompt, audio=audio, **REFERENCE_PADDING), golden)


def test_48khz_input_is_resampled(processor, golden, prompt):
    reference = processor(text=prompt, audio=golden["waveform_16k"].numpy())
    up = resample(golden["waveform_16k"].numpy(), 16000, 48000)
    for outputs in (
        processor(text=prompt, audio=up, sampling_rate=48000),
        processor(text=prompt, audio={"array": up, "sampling_rate": 48000}),
    ):
        for key in KEYS:
            assert outputs[key].shape == reference[key].shape, key
            if key != "input_features":
                assert torch.equal(outputs[key], reference[key]), key
        valid = reference["feature_attention_mask"][0].bool()
        diff = (outputs["input_features"][0][:, valid] - reference["input_features"][0][:, valid]).abs()
        assert diff.mean() < 0.02


def test_stereo_is_downmixed(processor, golden, prompt):
    mono = golden["waveform_16k"].numpy()
    reference = processor(text=prompt, audio=mono)
    assert_matches_golden(processor(text=prompt, audio=np.stack([mono, mono]), **REFERENCE_PADDING), golden)
    other = (0.5 * mono[::-1]).copy()
    mixed = processor(text=prompt, audio=np.stack([mono, other], axis=1))
    expected = processor(text=prompt, audio=(mono + other) / 2)
    assert torch.equal(mixed["input_features"], expected["input_features"])
    assert torch.equal(mixed["input_ids"], reference["input_ids"])


def test_compact_feature_padding_matches_on_valid_frames(processor, golden, prompt):
    """The default pads features to the longest clip, not to the extractor's window as the reference does."""
    clips = [golden["waveform_16k"].numpy(), golden["waveform_16k"].numpy()[:5000], np.zeros(700, np.float32)]
    text = prompt.replace(AUDIO_TEMPLATE, AUDIO_TEMPLATE * 3)
    full = processor(text=text, audio=clips, **REFERENCE_PADDING)
    assert full["input_features"].shape == (3, 128, 3000)
    compact = processor(text=text, audio=clips)
    longest = processor(text=text, audio=clips, feature_padding="longest")
    assert torch.equal(compact["input_features"], longest["input_features"])
    assert compact["input_features"].shape == (3, 128, 245)
    assert compact["feature_attention_mask"].sum(-1).tolist() == [245, 32, 5]  # ceil(samples / 160)
    assert torch.equal(compact["feature_attention_mask"], full["feature_attention_mask"][:, :245])
    for row, valid in enumerate(compact["feature_attention_mask"].bool()):
        torch.testing.assert_close(
            compact["input_features"][row][:, valid], full["input_features"][row][:, :245][:, valid], atol=1e-6, rtol=0
        )
    for key in ("input_ids", "speech_ids", "speech_attention_mask", "feature_exist_mask"):
        assert torch.equal(compact[key], full[key])
    with pytest.raises(ValueError, match="`feature_padding` must be"):
        processor(text=prompt, audio=clips[:1], feature_padding="shortest")
    # Refused before the clips are read: a path that does not exist is not looked at.
    with pytest.raises(ValueError, match="`feature_padding` must be"):
        processor(text=prompt, audio=["/nonexistent/question.wav"], feature_padding="shortest")


def test_json_item_without_path_has_no_features(processor):
    speech = "<|audio_bos|>" * 2 + "".join(f"[AU{t:04d}]" for t in [3, 1, 4, 1, 5, 9, 2])
    outputs = processor(text=f"<|im_start|>assistant\n{AUDIO_TEMPLATE}", audio=[{"path": "", "token": speech}])
    assert outputs["speech_ids"].tolist() == [[36, 36, 3, 1, 4, 1, 5, 9, 2, 38]]
    assert outputs["speech_attention_mask"].tolist() == [[1] * 9 + [0]]
    assert "input_features" not in outputs and "feature_exist_mask" not in outputs
    assert (outputs["input_ids"] == processor.audio_token_id).sum().item() == 2  # ceil(9 / 5)


def test_placeholder_wrapping_rule(processor):
    clip = np.zeros(16000, dtype=np.float32)  # 25 frames -> 5 placeholders
    bare = processor(text="<|AUDIO|>", audio=clip)["input_ids"][0].tolist()
    wrapped = processor(text=AUDIO_TEMPLATE, audio=clip)["input_ids"][0].tolist()
    assert bare == wrapped == [347] + [346] * 5 + [348]


def test_batch_of_two_prompts_with_different_clip_lengths(processor, golden):
    long_clip = golden["waveform_16k"].numpy()
    short_clip = long_clip[:12000].copy()  # 0.75 s -> 18 frames -> 4 placeholders
    texts = [
        processor.apply_chat_template([{"role": "user", "content": AUDIO_TEMPLATE}], add_generation_prompt=True),
        processor.apply_chat_template(
            [{"role": "system", "content": DEFAULT_S2M_PROMPT}, {"role": "user", "content": AUDIO_TEMPLATE}],
            add_generation_prompt=True,
        ),
    ]
    singles = [processor(text=texts[0], audio=long_clip), processor(text=texts[1], audio=short_clip)]
    for side in ("right", "left"):
        batch = processor(text=texts, audio=[long_clip, short_clip], padding_side=side)
        assert batch["speech_ids"].shape == (2, 65)
        assert batch["speech_attention_mask"].sum(-1).tolist() == [61, 18]
        assert batch["feature_exist_mask"].tolist() == [True, True]
        assert ((batch["input_ids"] == 346).sum(-1)).tolist() == [13, 4]
        for row, single in enumerate(singles):
            mask = batch["attention_mask"][row].bool()
            assert torch.equal(batch["input_ids"][row][mask], single["input_ids"][0])
            frames = single["input_features"].shape[-1]  # features padded to the batch's longest clip
            assert torch.equal(batch["input_features"][row][:, :frames], single["input_features"][0])
            assert torch.equal(batch["feature_attention_mask"][row][:frames], single["feature_attention_mask"][0])
            assert not batch["feature_attention_mask"][row][frames:].any()
            valid = single["speech_attention_mask"].shape[1]
            assert torch.equal(batch["speech_ids"][row, :valid], single["speech_ids"][0])
        nested = processor(text=texts, audio=[[long_clip], [short_clip]], padding_side=side)  # one list per prompt
        assert all(torch.equal(nested[key], batch[key]) for key in KEYS)
        lengths = batch["attention_mask"].sum(-1)
        shorter = int(lengths.argmin())
        pad_position = 0 if side == "left" else -1
        assert batch["attention_mask"][shorter, pad_position] == 0
        assert batch["input_ids"][shorter, pad_position] == processor.tokenizer.pad_token_id


def test_chat_template_with_audio_items_and_history(processor, golden):
    waveform = golden["waveform_16k"].numpy()
    conversation = [
        {"role": "system", "content": DEFAULT_S2M_PROMPT},
        {"role": "user", "content": [{"type": "audio", "audio": str(WAV_PATH)}]},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": [{"type": "audio", "audio": waveform[:8000]}, {"type": "text", "text": "Why?"}]},
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    assert text.count("<|AUDIO|>") == 2 and "It is sunny.<|im_end|>" in text and "Why?" in text
    outputs = processor.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True, **REFERENCE_PADDING
    )
    assert outputs["speech_attention_mask"].sum(-1).tolist() == [61, 12]
    assert (outputs["input_ids"] == 346).sum().item() == 13 + 3
    assert_close_to_golden_features(outputs["input_features"][0], golden["input_features"][0])
    compact = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert compact["input_features"].shape == (2, 128, 245)  # the default: the longest clip's frames
    ids_only = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert torch.equal(ids_only, outputs["input_ids"])

    # string content: clips come from `audio=`, in order
    string_history = [
        {"role": "user", "content": AUDIO_TEMPLATE},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": AUDIO_TEMPLATE},
    ]
    outputs = processor.apply_chat_template(
        string_history, add_generation_prompt=True, tokenize=True, return_dict=True, audio=[waveform, waveform[:8000]]
    )
    assert outputs["speech_attention_mask"].sum(-1).tolist() == [61, 12]
    with pytest.raises(ValueError, match="2 audio placeholder"):
        processor.apply_chat_template(string_history, tokenize=True, audio=[waveform])


def test_decoding_helpers(processor):
    tokenizer = processor.tokenizer
    hello = tokenizer.encode("Hello world", add_special_tokens=False)
    ids = [347, 350, *hello, 350, 348, 322, 320, 320]
    assert processor.decode_reply(ids) == "Hello world"
    batch = torch.tensor([ids, [320, 320, 347, *hello, 322, 320, 320, 320]])
    assert processor.decode_reply(batch) == ["Hello world"] * 2
    assert processor.decode(hello) == tokenizer.decode(hello) == "Hello world"
    assert processor.batch_decode([hello, hello]) == ["Hello world", "Hello world"]
    assert processor.decode([347, *hello, 348], skip_special_tokens=True) == "Hello world"


@pytest.mark.parametrize(
    ("text", "audio", "message"),
    [
        ("<|AUDIO|><|AUDIO|>", [np.zeros(16000, np.float32)], "2 <\\|AUDIO\\|> placeholder\\(s\\) but 1 audio"),
        ("no placeholder", [np.zeros(16000, np.float32)], "0 <\\|AUDIO\\|> placeholder\\(s\\) but 1 audio"),
        ("<|AUDIO|>", None, "no audio was given"),
        ("<|AUDIO|>", [np.zeros(0, np.float32)], "empty"),
        ("<|AUDIO|>", [np.full(16000, np.nan, np.float32)], "NaN"),
        ("<|AUDIO|>", [np.full(16000, np.inf, np.float32)], "Inf"),
        ("<|AUDIO|>", [np.zeros(100, np.float32)], "shorter than one speech frame"),
        ("<|AUDIO|>", ["/no/such/file.wav"], "not found"),
        ("<|AUDIO|>", ['{"path": "", "token": '], "could not be parsed"),
        (None, None, "`text` is required"),
        ("", None, "Prompt 0 is empty"),
        (["hi", ""], None, "Prompt 1 is empty"),
    ],
)
def test_errors(processor, text, audio, message):
    with pytest.raises(ValueError, match=message):
        processor(text=text, audio=audio)


def test_non_audio_file_is_rejected(processor, tmp_path):
    fake = tmp_path / "fake.wav"
    fake.write_text("not audio")
    with pytest.raises(ValueError, match="Could not decode"):
        processor(text="<|AUDIO|>", audio=[fake])


def test_save_and_reload_round_trip(processor, golden, prompt, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    processor.save_pretrained("~/saved")
    saved = tmp_path / "saved"
    for name in ("processor_config.json", "preprocessor_config.json", "chat_template.jinja", "tokenizer_config.json"):
        assert (saved / name).is_file(), name
    assert (saved / "speech_tokenizer" / "tokenizer_config.json").is_file()
    assert json.loads((saved / "processor_config.json").read_text())["audio_group_size"] == 5

    for reloaded in (AutoProcessor.from_pretrained(saved), FunAudioChatProcessor.from_pretrained("~/saved")):
        assert isinstance(reloaded, FunAudioChatProcessor)
        assert reloaded.chat_template == processor.chat_template
        assert reloaded.speech_tokenizer.get_vocab() == processor.speech_tokenizer.get_vocab()
        assert_matches_golden(reloaded(text=prompt, audio=golden["waveform_16k"].numpy(), **REFERENCE_PADDING), golden)


def test_custom_group_size_and_chat_template(tmp_path):
    shutil.copytree(FUNAUDIOCHAT_TINY, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "processor_config.json").read_text())
    config["audio_group_size"] = 4
    (tmp_path / "ckpt" / "processor_config.json").write_text(json.dumps(config))
    (tmp_path / "ckpt" / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    custom = AutoProcessor.from_pretrained(tmp_path / "ckpt")
    assert custom.audio_group_size == 4
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    outputs = custom(text="<|AUDIO|>", audio=np.zeros(16000, np.float32))  # 25 frames -> ceil(25/4) = 7
    assert outputs["speech_ids"].shape == (1, 28)
    assert (outputs["input_ids"] == 346).sum().item() == 7


def test_audio_longer_than_the_feature_window_is_refused(processor, tmp_path):
    """The extractor cuts features at its window (30 s here) while the prompt kept placeholders for the whole clip, so
    two clips differing only after 30 s gave identical replies. Such clips are refused, naming the limit."""
    assert processor.max_audio_seconds == 30.0
    rng = np.random.default_rng(0)
    at_limit = (0.1 * rng.standard_normal(30 * 16000)).astype(np.float32)
    inputs = processor(text="<|AUDIO|>", audio=at_limit, feature_padding="longest")
    assert inputs["feature_attention_mask"].sum() == 3000
    over = np.concatenate([at_limit, at_limit[:160]])
    with pytest.raises(ValueError, match=r"30.0 s \(480160 samples at 16000 Hz\), longer than the 30 s limit"):
        processor(text="<|AUDIO|>", audio=over)
    # a file is refused on its header, before decoding; the same for the JSON path
    sf = pytest.importorskip("soundfile")
    path = tmp_path / "long.wav"
    sf.write(path, over, 16000)
    with pytest.raises(ValueError, match="longer than the 30 s limit"):
        processor(text="<|AUDIO|>", audio=str(path))
    item = json.dumps({"path": str(path), "token": "<|audio_pad|>" * 10, "text": ""})
    with pytest.raises(ValueError, match="longer than the 30 s limit"):
        processor(text="<|AUDIO|>", audio=[item])
    for padding in ("max_length", "longest"):
        with pytest.raises(ValueError, match="Audio clip 1 lasts"):
            processor.extract_features([at_limit, over], padding=padding)


def test_overlong_prompt_text_is_refused(processor):
    from funaudiochat_hf.limits_funaudiochat import MAX_TEXT_CHARS

    clip = np.zeros(16000, np.float32)
    processor(text="x" * (MAX_TEXT_CHARS - 9) + "<|AUDIO|>", audio=clip)
    with pytest.raises(ValueError, match=f"Prompt 1 has {MAX_TEXT_CHARS + 1} characters"):
        processor(text=["<|AUDIO|>", "x" * (MAX_TEXT_CHARS - 8) + "<|AUDIO|>"], audio=[clip, clip])


@pytest.mark.parametrize("rate", [2, 1.0, float("nan"), float("inf"), 10**9])
def test_implausible_sampling_rates_are_refused_before_resampling(processor, rate):
    with pytest.raises(ValueError, match="sampling_rate"):
        processor(text="<|AUDIO|>", audio=np.zeros(32000, np.float32), sampling_rate=rate)
    with pytest.raises(ValueError, match="sampling_rate"):
        processor(text="<|AUDIO|>", audio={"raw": np.zeros(32000, np.float32), "sampling_rate": rate})
