"""Bad input gets one clear error at the public entry, in bounded time and memory (issue 50): hostile decoder yaml,
non-finite or mis-shaped decoder and model inputs, unreadable weights files.

The audio loader, processor, collator, pipeline, CLI and Space limits are tested next to their modules; the fuzz
suite is tests/test_fuzz_inputs.py."""

import time

import pytest
import torch
from conftest import COSYVOICE3_TINY

from funaudiochat_hf import CosyVoice3Token2Wav
from funaudiochat_hf.conversion_cosyvoice3 import read_cosyvoice3_yaml


@pytest.fixture(scope="module")
def decoder():
    return CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()


# -- cosyvoice3.yaml ------------------------------------------------------------------------------------------------


def _alias_chain(levels: int, width: int = 10) -> str:
    lines = ["a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nflow: {{x: *a{levels}}}\nhift: {{}}\n"


HOSTILE_YAMLS = {
    # 10**6 values from 0.5 KB (the 9-level chain ran > 60 s at 3.3 GB)
    "alias chain": (_alias_chain(5), "more than 100000 values"),
    "ref product": (
        "a: 1000000000\nb: !ref <a> * <a>\nc: !ref <b> * <b>\nd: !ref <c> * <c>\nflow: {x: !ref <d> * <d>}\nhift: {}\n",
        "gives a value out of range",
    ),
    "string product": ("s: xxxxxxxx\nn: 1000\nflow: {x: !ref <s> * <n>}\nhift: {}\n", "arithmetic needs numbers"),
    "self reference": ("a: !ref <a>\nflow: {x: !ref <a>}\nhift: {}\n", r"circular `!ref` \(a -> a\)"),
    "reference cycle": ("a: !ref <b>\nb: !ref <a> + 1\nflow: {x: 1}\nhift: {}\n", "circular `!ref`"),
    "recursive alias": ("flow: &f {x: *f}\nhift: {}\n", "nests deeper than"),
    "deep nesting": ("flow: " + "[" * 100 + "]" * 100 + "\nhift: {}\n", "nests deeper than"),
    "long reference chain": (
        "".join(f"a{i}: !ref <a{i + 1}> + 1\n" for i in range(5000)) + "a5000: 1\nflow: {x: !ref <a0>}\nhift: {}\n",
        "chains longer than 32",
    ),
    "division by zero": ("a: 0\nflow: {x: !ref 1 / <a>}\nhift: {}\n", "divides by zero"),
    "unknown name": ("flow: {x: !ref <nowhere>}\nhift: {}\n", "names no top-level value"),
    "function call": ("a: 1\nflow: {x: !ref <a>.__class__}\nhift: {}\n", "names no top-level value|cannot resolve"),
    "syntax error": ("flow: [\nhift", "not a readable yaml file"),
}


@pytest.mark.parametrize("name", list(HOSTILE_YAMLS))
def test_hostile_yaml_gets_a_clear_error_quickly(name, tmp_path):
    text, message = HOSTILE_YAMLS[name]
    path = tmp_path / "cosyvoice3.yaml"
    path.write_text(text)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        read_cosyvoice3_yaml(path)
    assert time.perf_counter() - started < 5


def test_oversized_or_binary_yaml_is_refused(tmp_path):
    path = tmp_path / "cosyvoice3.yaml"
    path.write_text("flow: {}\nhift: {}\n#" + "x" * (1 << 20))
    with pytest.raises(ValueError, match="more than a CosyVoice3 yaml"):
        read_cosyvoice3_yaml(path)
    path.write_bytes(b"\xff\xfe\x00 flow")
    with pytest.raises(ValueError, match="not a readable yaml file"):
        read_cosyvoice3_yaml(path)


def test_the_official_layout_still_resolves():
    sections = read_cosyvoice3_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml")
    assert sections["flow"]["decoder"]["estimator"]["static_chunk_size"] == 50


# -- decoder inputs -------------------------------------------------------------------------------------------------


TOKENS = torch.arange(20).reshape(1, 20)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_speaker_embedding_is_refused_on_every_surface(decoder, bad):
    embedding = decoder.speaker_embeddings[0].clone()
    embedding[3] = bad
    with pytest.raises(ValueError, match="speaker_embedding contains NaN or infinite"):
        decoder(TOKENS, speaker_embedding=embedding)
    with pytest.raises(ValueError, match="speaker_embedding contains NaN or infinite"):
        decoder.tokens_to_mel(TOKENS, embedding)
    with pytest.raises(ValueError, match="speaker_embedding contains NaN or infinite"):
        decoder.streaming_decoder(speaker_embedding=embedding)
    with pytest.raises(TypeError, match="floating-point"):
        decoder(TOKENS, speaker_embedding=torch.ones(decoder.config.spk_embed_dim, dtype=torch.long))


def test_a_speaker_is_a_stored_name_or_an_x_vector(decoder):
    """A numpy x-vector is the same voice as the tensor (it used to be taken for a list of names: "Unknown speaker(s)
    [np.float32(0.0), ...]"); anything else that is not a name is refused by name."""
    from funaudiochat_hf.generation_vocoding_funaudiochat import decoder_speaker_kwargs

    embedding = decoder.speaker_embeddings[1].clone()
    expected = decoder(TOKENS, speaker_embedding=embedding).waveform
    assert torch.equal(decoder(TOKENS, **decoder_speaker_kwargs(embedding.numpy())).waveform, expected)
    assert torch.equal(decoder(TOKENS, **decoder_speaker_kwargs(decoder.config.speaker_names[1])).waveform, expected)
    for bad in (3, [0.5, 1.5], {"name": "x"}):
        with pytest.raises(ValueError, match="must be a stored speaker's name or a list of names"):
            decoder(TOKENS, **decoder_speaker_kwargs(bad))
    with pytest.raises(ValueError, match="Unknown speaker"):
        decoder(TOKENS, speaker="nobody")


def test_non_finite_or_misshaped_mel_is_refused(decoder):
    mel = torch.zeros(1, decoder.config.mel_bins, 16)
    assert torch.isfinite(decoder.mel_to_wav(mel)).all()
    mel[0, 2, 5] = float("nan")
    with pytest.raises(ValueError, match="mel contains NaN or infinite"):
        decoder.mel_to_wav(mel)
    with pytest.raises(ValueError, match=r"mel must have shape \(batch, 80, frames\)"):
        decoder.mel_to_wav(torch.zeros(1, 128, 16))
    prompt_tokens = torch.arange(4).reshape(1, 4)
    prompt_mel = torch.full((1, decoder.config.mel_bins, 4 * decoder.config.token_mel_ratio), float("inf"))
    speaker = decoder.speaker_embeddings[0]
    with pytest.raises(ValueError, match="prompt_mel contains NaN or infinite"):
        decoder.tokens_to_mel(TOKENS, speaker, prompt_tokens=prompt_tokens, prompt_mel=prompt_mel)


def test_zero_row_batches_are_refused_by_name(decoder):
    """A (0, n) batch used to fail with "Got 1 speaker embeddings for a batch of 0"."""
    for call in (lambda t: decoder(t), lambda t: decoder.tokens_to_mel(t, decoder.speaker_embeddings[0])):
        with pytest.raises(ValueError, match="speech_tokens has 0 rows"):
            call(torch.zeros(0, 5, dtype=torch.long))


def test_tokens_to_mel_checks_its_lengths(decoder):
    speaker = decoder.speaker_embeddings[0]
    tokens = TOKENS.repeat(2, 1)
    for lengths, message in (
        ([20, 21], r"2 values in \[0, 20\]"),
        ([20], r"2 values in \[0, 20\]"),
        ([-1, 20], r"2 values in \[0, 20\]"),
        (torch.tensor([20.0, 10.0]), "integers"),
    ):
        with pytest.raises((ValueError, TypeError), match=message):
            decoder.tokens_to_mel(tokens, speaker, speech_token_lengths=lengths)
    mel = decoder.tokens_to_mel(tokens, speaker, speech_token_lengths=[20, 10])
    assert mel.shape == (2, decoder.config.mel_bins, 20 * decoder.config.token_mel_ratio)


def test_streaming_push_refuses_several_rows(decoder):
    """A (2, n) tensor was flattened into one stream (the two rows concatenated)."""
    stream = decoder.streaming_decoder(token_hop_len=5)
    with pytest.raises(ValueError, match=r"one stream, shape \(n,\) or \(1, n\); got \(2, 4\)"):
        stream.push(torch.arange(8).reshape(2, 4))
    with pytest.raises(ValueError, match="got"):
        stream.push(torch.arange(8).reshape(1, 2, 4))
    assert stream.push(torch.arange(4).reshape(1, 4)).numel() == 0  # one row is one stream
    assert stream.finalize().numel() == 4 * decoder.config.samples_per_token


# -- chat model inputs ----------------------------------------------------------------------------------------------


def test_audio_features_of_the_wrong_kind_are_refused(model, inputs):
    features, mask = inputs["input_features"], inputs["feature_attention_mask"]
    speech_len = inputs["speech_ids"].shape[1]
    reference = model.get_audio_features(features, mask, speech_len).last_hidden_state
    with pytest.raises(ValueError, match=r"input_features must have shape \(clips, 128, frames\)"):
        model.get_audio_features(features[:, :80], mask, speech_len)
    with pytest.raises(ValueError, match="input_features must have shape"):
        model.get_audio_features(features[0], mask, speech_len)
    with pytest.raises(TypeError, match="floating-point"):
        model.get_audio_features(features.long(), mask, speech_len)
    for bad in (float("nan"), float("inf")):
        poisoned = features.clone()
        poisoned[0, 5, 10] = bad
        with pytest.raises(ValueError, match="input_features contain NaN or infinite"):
            model(**{**inputs, "input_features": poisoned})
    # nothing was changed by the failed calls
    after = model.get_audio_features(features, mask, speech_len).last_hidden_state
    torch.testing.assert_close(after, reference, atol=0, rtol=0)


# -- weights files --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_unreadable_safetensors_error_names_the_file(decoder, tmp_path, damage):
    decoder.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a safetensors file")
    with pytest.raises(OSError, match=f"Could not read the weights file {weights}: .*truncated or corrupt"):
        CosyVoice3Token2Wav.from_pretrained(tmp_path)


def test_unreadable_chat_model_weights_name_the_file(tmp_path):
    import shutil

    from conftest import FUNAUDIOCHAT_TINY
    from transformers import AutoModel

    shutil.copytree(FUNAUDIOCHAT_TINY, tmp_path / "chat")
    weights = sorted((tmp_path / "chat").glob("*.safetensors"))[-1]
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(OSError, match=f"Could not read the weights file {weights}"):
        AutoModel.from_pretrained(tmp_path / "chat")
