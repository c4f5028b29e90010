"""tiny_model.py: the deterministic tiny random-weight speech-to-speech model (the offline default)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoProcessor

import funaudiochat_hf  # noqa: F401
from funaudiochat_hf.tiny_model import (
    NOISE_WARNING,
    REPLY_PEAK_DBFS,
    TINY_MODEL_VERSION,
    _prompt,
    _redraw_weights,
    build_tiny_model,
    synthetic_question,
    tiny_model_cache_dir,
    tiny_model_config,
)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    # shared by every test module of the session (same base temp dir)
    return build_tiny_model(tmp_path_factory.getbasetemp() / "cache" / f"tiny-{TINY_MODEL_VERSION}")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    for name in ("FUNAUDIOCHAT_HF_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tiny_model_cache_dir() == tmp_path / ".cache" / "funaudiochat_hf"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny_model_cache_dir() == tmp_path / "xdg" / "funaudiochat_hf"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert tiny_model_cache_dir() == tmp_path / "hf" / "funaudiochat_hf"
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(tmp_path / "mine"))
    assert tiny_model_cache_dir() == tmp_path / "mine"


def test_default_path_is_the_versioned_cache_folder(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(tiny_model_dir.parent))
    assert build_tiny_model() == tiny_model_dir  # reused, not rebuilt


def test_reuse_does_not_rebuild(tiny_model_dir):
    weights = tiny_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir
    assert weights.stat().st_mtime_ns == before


def test_folder_is_complete_and_says_it_is_noise(tiny_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "speech_tokenizer/tokenizer.json",
                 "preprocessor_config.json", "processor_config.json", "README.md"):
        assert (tiny_model_dir / name).is_file(), name
    assert NOISE_WARNING in (tiny_model_dir / "README.md").read_text()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "funaudiochat" and config["text_config"]["hidden_size"] == 64
    keys = load_file(tiny_model_dir / "model.safetensors").keys()
    assert any(k.startswith("token2wav.") for k in keys), "the decoder must be saved in the same folder"


def test_weights_are_deterministic(tiny_model_dir):
    """The stored weights are exactly the recipe's draw for the recorded seed."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    seed = config["tiny_weight_seed"]
    stored = load_file(tiny_model_dir / "model.safetensors")
    model = funaudiochat_hf.FunAudioChatForConditionalGeneration(tiny_model_config())
    _redraw_weights(model, seed)
    redrawn = dict(model.named_parameters())
    for name, tensor in stored.items():
        if name in redrawn and not name.startswith("token2wav."):
            torch.testing.assert_close(redrawn[name].detach(), tensor, rtol=0, atol=0, msg=name)


def test_loads_and_speaks(tiny_model_dir):
    model = AutoModel.from_pretrained(tiny_model_dir).eval()
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    assert model.token2wav is not None and model.token2wav.config.speaker_names == ["中文女", "中文男"]
    inputs = processor(text=_prompt(processor), audio=[synthetic_question()], return_tensors="pt")
    output = model.generate_speech(**inputs, max_new_tokens=12, do_sample=False)
    speech = output.speech_ids[0]
    assert int((speech < model.config.audio_config.bos_token_id).sum()) > 0  # the speech path runs
    assert output.sampling_rate == 24000
    audio = output.audio[0]
    assert audio.ndim == 1 and audio.numel() > 0 and torch.isfinite(audio).all()


def _dbfs(audio) -> float:
    return float(20 * np.log10(np.abs(np.asarray(audio)).max()))


def test_replies_are_audible_at_a_normal_level(tiny_model_dir):
    """The random decoder is leveled at build time: its greedy reply to the synthetic question (the tokens it was
    leveled on) peaks at REPLY_PEAK_DBFS, and a sampled reply to a recording (the README's offline command) at a normal
    level too, loud enough to hear (it once peaked at -71 dBFS: an impulse per STFT frame cancelled by the window)."""
    from conftest import FUNAUDIOCHAT_GOLDEN
    from funaudiochat_hf.audio_io import load_audio

    model = AutoModel.from_pretrained(tiny_model_dir).eval()
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    prompt = _prompt(processor)
    leveled = model.generate_speech(
        **processor(text=prompt, audio=[synthetic_question()], return_tensors="pt"), max_new_tokens=40, do_sample=False
    ).audio[0]
    assert abs(_dbfs(leveled) - REPLY_PEAK_DBFS) < 0.5
    recording = load_audio(str(FUNAUDIOCHAT_GOLDEN / "input_16k.wav"))
    sampled = model.generate_speech(
        **processor(text=prompt, audio=[recording], return_tensors="pt"), max_new_tokens=24, seed=1
    ).audio[0].numpy()
    assert sampled.size > 24000 // 2  # half a second at least
    rms = float(20 * np.log10(np.sqrt(np.mean(sampled.astype(np.float64) ** 2))))
    assert -15 < _dbfs(sampled) < -2 and -40 < rms < -15, (_dbfs(sampled), rms)


def test_synthetic_question():
    clip = synthetic_question(1.0)
    assert clip.dtype == np.float32 and clip.shape == (16000,)
    np.testing.assert_array_equal(clip, synthetic_question(1.0))
    assert 0.05 < np.abs(clip).max() <= 1.0
    with pytest.raises(ValueError, match="positive"):
        synthetic_question(0)


def test_bad_seed_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="seed"):
        build_tiny_model(tmp_path / "x", seed=-1)


def test_a_build_leaves_the_global_rng_as_it_was(tmp_path):
    """A build runs in the caller's process (CLI, demo, server): it used to reseed the global RNG with its seed, so the
    seeds that later unseeded requests draw from it were the same in every process that built the model."""
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    build_tiny_model(tmp_path / "fresh")
    assert torch.equal(torch.random.get_rng_state(), before)
