"""The demo's settings (`demo/app.py`) without a browser: `FUNAUDIOCHAT_FAST`, the tiny offline pipeline, its
serving engine (concurrent visitors share decode steps) and the start-up warm-up."""

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from funaudiochat_hf.tiny_model import synthetic_question
from conftest import load_module


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def app():
    pytest.importorskip("gradio")
    return load_module(REPO / "demo" / "app.py", "demo_app")


def _tiny_pipe(app, monkeypatch, **env):
    monkeypatch.delenv("FUNAUDIOCHAT_MODEL", raising=False)
    monkeypatch.setenv("FUNAUDIOCHAT_DEVICE", "cpu")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return app.load_pipeline()


def test_a_chat_model_without_its_decoder_is_refused_before_loading(app, monkeypatch):
    """FUNAUDIOCHAT_MODEL of the official layout without FUNAUDIOCHAT_DECODER: said from its config before the
    weights load (or, for a Hub id, download)."""
    import transformers
    from conftest import FUNAUDIOCHAT_TINY

    monkeypatch.setenv("FUNAUDIOCHAT_MODEL", str(FUNAUDIOCHAT_TINY))
    monkeypatch.delenv("FUNAUDIOCHAT_DECODER", raising=False)
    monkeypatch.setattr(transformers, "pipeline", lambda *a, **k: pytest.fail("the models were loaded"))
    with pytest.raises(ValueError, match="FUNAUDIOCHAT_MODEL .* has no speech decoder inside: set FUNAUDIOCHAT_DECODER"):
        app.load_pipeline()


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
        assert "start-up compiles the chat loop and the decoder" in capsys.readouterr().err
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


@pytest.fixture(scope="module")
def tiny_pipe(app):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _tiny_pipe(app, monkeypatch)


def _question(tmp_path, name, seconds=1.0):
    import soundfile

    path = tmp_path / name
    soundfile.write(path, synthetic_question(seconds), 16000)
    return str(path)


def test_building_the_app_warms_up_before_returning(app, tiny_pipe, monkeypatch, capsys):
    """The Space warmed up on the first visitor's request: now one synthetic reply runs through the engine (and the
    decoder) while the app is built, before it says it is ready."""
    monkeypatch.delenv("FUNAUDIOCHAT_WARMUP", raising=False)
    engine = app.start_engine(tiny_pipe, batch_size=1, max_prompt_tokens=512)
    try:
        assert engine.snapshot()["requests"]["stop"] + engine.snapshot()["requests"]["length"] == 0
        app.create_app(tiny_pipe, engine, stream_audio=False)
        snapshot = engine.snapshot()
    finally:
        engine.close()
    assert snapshot["requests"]["stop"] + snapshot["requests"]["length"] == 1
    assert snapshot["steps"] >= 1 and snapshot["audio_seconds"] > 0  # the decoder ran too
    err = capsys.readouterr().err
    assert "warming up" in err and "warm-up done" in err
    assert err.index("warming up") < err.index("warm-up done")

    engine = app.start_engine(tiny_pipe, batch_size=1, max_prompt_tokens=512)
    try:
        monkeypatch.setenv("FUNAUDIOCHAT_WARMUP", "0")
        app.create_app(tiny_pipe, engine, stream_audio=False)
        assert engine.snapshot()["steps"] == 0
    finally:
        engine.close()


def test_concurrent_replies_share_the_engine_decode_steps(app, tiny_pipe, tmp_path, monkeypatch):
    """The Space ran one reply at a time (`pipe.stream` per visitor): two visitors' replies now run in the same decode
    steps of one engine, each streaming its own text and audio."""
    engine = app.start_engine(tiny_pipe, batch_size=2, max_prompt_tokens=512)
    both_submitted = threading.Barrier(2, timeout=60)
    submit = engine.submit

    def submit_together(*args, **kwargs):  # the two visitors' requests reach the engine at the same time
        both_submitted.wait()
        return submit(*args, **kwargs)

    monkeypatch.setattr(engine, "submit", submit_together)
    respond = app.make_responder(tiny_pipe, engine, max_input_seconds=30, stream_audio=False)
    results, errors = {}, []

    def visitor(name):
        try:
            updates = list(respond(_question(tmp_path, f"{name}.wav"), [], [], None, 0.8, 0.9, 32, ""))
            results[name] = updates[-1]
        except Exception as error:  # reported by the assertion below
            errors.append(error)

    try:
        threads = [threading.Thread(target=visitor, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        snapshot = engine.snapshot()
    finally:
        engine.close()
    assert not errors, errors
    assert sorted(results) == ["a", "b"]
    buckets, counts, _, steps = snapshot["step_rows"]
    assert buckets[0] == 1 and steps - counts[0] > 0, snapshot  # some steps ran both rows
    assert snapshot["requests"]["stop"] + snapshot["requests"]["length"] == 2
    for (sampling_rate, audio), text, messages, history in results.values():
        assert sampling_rate == tiny_pipe.sampling_rate and audio.dtype == np.int16 and audio.size > 0
        assert messages[-1] == {"role": "assistant", "content": text}
        assert [turn["role"] for turn in history] == ["user", "assistant"]


def test_old_turns_are_dropped_to_fit_the_prompt_limit(app, tiny_pipe):
    import gradio as gr

    engine = app.start_engine(tiny_pipe, batch_size=1, max_prompt_tokens=360)
    try:
        clip = synthetic_question(2.0)
        turn = {"role": "user", "content": [{"type": "audio", "audio": clip}]}
        history = [turn, {"role": "assistant", "content": "hello there"}] * 3
        inputs, chat = app.prepare_inputs(tiny_pipe, engine, history, turn, None)
        assert inputs["input_ids"].shape[1] <= 360 and chat[-1] is turn and 1 <= len(chat) < 7
        long_turn = {"role": "user", "content": [{"type": "audio", "audio": synthetic_question(20.0)}]}
        with pytest.raises(gr.Error, match="at most 360"):
            app.prepare_inputs(tiny_pipe, engine, [], long_turn, None)
    finally:
        engine.close()


def test_gpu_warm_up_runs_every_prompt_bucket_twice(app, monkeypatch):
    """On a GPU the prompt pass of each 64-token bucket is recorded on its second run: the warm-up asks questions of
    each configured length twice (on a CPU, one short reply)."""
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(app, "prepare_inputs", lambda pipe, engine, history, turn, system: (len(turn["content"][0]["audio"]), None))
    monkeypatch.setattr(app, "stream_reply", lambda engine, inputs, **kwargs: asked.append(inputs) or iter(()))
    gpu_pipe = SimpleNamespace(model=SimpleNamespace(device=SimpleNamespace(type="cuda")))
    app.warm_up(gpu_pipe, engine=None)
    rate = app.INPUT_SAMPLING_RATE
    assert asked == [int(seconds * rate) for seconds in app.WARMUP_GPU_QUESTION_SECONDS for _ in range(2)]
    asked.clear()
    app.warm_up(SimpleNamespace(model=SimpleNamespace(device=SimpleNamespace(type="cpu"))), engine=None)
    assert asked == [int(app.WARMUP_QUESTION_SECONDS * rate)]
