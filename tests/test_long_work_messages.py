"""Long one-off work says so before it starts: compiling the decoding loop and the decoder, building the tiny model.
(The demo's FUNAUDIOCHAT_FAST note is checked in test_demo_app.py, the CLI's first-run notes in test_cli.py.)"""

import logging

import torch

from funaudiochat_hf import tiny_model


def _messages(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and needle in r.getMessage()]


def test_compiling_the_decoding_loop_says_so_once(model, inputs, monkeypatch, caplog):
    model.clear_speech_caches()  # its compiled functions belong to the model's default generator: as in a fresh process
    torch._dynamo.reset()
    kwargs = dict(
        max_new_tokens=2, do_sample=False, return_audio=False, backend="compiled", compile_config={"backend": "eager"}
    )
    try:
        with caplog.at_level(logging.WARNING):
            model.generate_speech(**inputs, **kwargs)
            first = _messages(caplog, "the first call compiles")
            caplog.clear()
            model.generate_speech(**inputs, **kwargs)
            again = _messages(caplog, "the first call compiles")
    finally:
        torch._dynamo.reset()
    # The decode step's parts (one message for their shared options) and the prompt's layers (options of their own).
    assert 1 <= len(first) <= 2 and all("'backend': 'eager'" in message for message in first), first
    assert again == []


def test_compiling_the_decoder_says_so(caplog):
    from conftest import COSYVOICE3_TINY
    from funaudiochat_hf import CosyVoice3Token2Wav

    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    with caplog.at_level(logging.WARNING):
        decoder.compile_estimator(backend="eager")
        decoder.compile_vocoder(backend="eager")
    assert len(_messages(caplog, "the decoder's next call compiles")) == 2


def test_building_the_tiny_model_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tiny_model, "_build", lambda folder, seed: None)  # the announcement, not the build
    with caplog.at_level(logging.WARNING):
        tiny_model.build_tiny_model(tmp_path / "tiny")
        assert len(_messages(caplog, "Building the tiny random-weight model")) == 1
        caplog.clear()
        tiny_model.build_tiny_model(tmp_path / "tiny")  # cached: nothing to announce
    assert _messages(caplog, "Building the tiny") == []
