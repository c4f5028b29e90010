"""The demo's settings (`demo/app.py`) without a browser: `FUNAUDIOCHAT_FAST` and the tiny offline pipeline."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from funaudiochat_hf.tiny_model import synthetic_question


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def app():
    pytest.importorskip("gradio")
    spec = importlib.util.spec_from_file_location("demo_app", REPO / "demo" / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_pipe(app, monkeypatch, **env):
    monkeypatch.delenv("FUNAUDIOCHAT_MODEL", raising=False)
    monkeypatch.setenv("FUNAUDIOCHAT_DEVICE", "cpu")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return app.load_pipeline()


def test_fast_setting_is_ignored_with_a_note_off_the_gpu(app, monkeypatch, capsys):
    pipe = _tiny_pipe(app, monkeypatch, FUNAUDIOCHAT_FAST="1")
    assert pipe.fast_generate_kwargs == {}
    assert "FUNAUDIOCHAT_FAST=1 needs a CUDA device" in capsys.readouterr().err
    assert pipe.decoder.config.estimator_autocast_dtype is None and not pipe.decoder.flow_is_compiled


def test_enable_fast_decoding_compiles_both_models_and_replies(app, monkeypatch, capsys):
    pipe = _tiny_pipe(app, monkeypatch)
    decoder = pipe.decoder
    torch._dynamo.reset()
    try:
        kwargs = app.enable_fast_decoding(pipe, backend="eager")
        assert "the first reply compiles the chat loop and the decoder" in capsys.readouterr().err
        assert kwargs == {"backend": "compiled", "compile_config": {"backend": "eager"}}
        assert decoder.config.estimator_autocast_dtype == "bfloat16" and decoder.flow_is_compiled
        assert decoder.qkv_projections_fused
        events = list(pipe.stream(synthetic_question(1.0), max_new_tokens=8, do_sample=False, **kwargs))
    finally:
        torch._dynamo.reset()
    audio = np.concatenate([event["audio"] for event in events])
    assert audio.size > 0 and np.isfinite(audio).all()


def test_question_length_is_checked_on_the_header_before_decoding(app, tmp_path, monkeypatch):
    """The Space decoded and resampled a whole upload before checking its 30 s limit."""
    import gradio as gr
    import soundfile

    path = tmp_path / "long.wav"
    soundfile.write(path, np.zeros(31 * 8000, np.float32), 8000)
    short = tmp_path / "short.wav"
    soundfile.write(short, synthetic_question(1.0), 16000)
    assert app.read_question(str(short), 30).shape == (16000,)
    monkeypatch.setattr(soundfile.SoundFile, "read", lambda *a, **k: pytest.fail("decoded an over-long upload"))
    with pytest.raises(gr.Error, match="please keep questions under 30 s"):
        app.read_question(str(path), 30)


def test_system_prompt_box_is_bounded(app):
    import gradio as gr

    from funaudiochat_hf.limits_funaudiochat import MAX_SYSTEM_PROMPT_CHARS

    assert app.check_system_prompt("") is None
    assert app.check_system_prompt("Be brief.") == "Be brief."
    with pytest.raises(gr.Error, match=f"{MAX_SYSTEM_PROMPT_CHARS + 1} characters"):
        app.check_system_prompt("x" * (MAX_SYSTEM_PROMPT_CHARS + 1))
