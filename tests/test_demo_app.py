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
    """The tiny offline pipeline and its `LoadedModel`."""
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
    pipe, loaded = _tiny_pipe(app, monkeypatch, FUNAUDIOCHAT_FAST="true")  # "true" once counted as off
    assert loaded == app.LoadedModel(is_tiny=True, fast_generate_kwargs={})
    err = capsys.readouterr().err
    assert "FUNAUDIOCHAT_FAST needs a CUDA device" in err
    assert pipe.decoder.config.estimator_autocast_dtype is None and not pipe.decoder.flow_is_compiled
    # The settings travel in `loaded`, not as attributes set on the transformers Pipeline.
    assert not hasattr(pipe, "is_tiny_model") and not hasattr(pipe, "fast_generate_kwargs")
    # The wait for loading is announced before it starts, as the CLI does.
    assert "note: loading chat model" in err and err.index("loading chat model") < err.index("models loaded in")


def test_enable_fast_decoding_compiles_both_models_and_replies(app, monkeypatch, capsys):
    pipe, _ = _tiny_pipe(app, monkeypatch)
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
        return _tiny_pipe(app, monkeypatch)[0]


def _question(tmp_path, name, seconds=1.0):
    import soundfile

    path = tmp_path / name
    soundfile.write(path, synthetic_question(seconds), 16000)
    return str(path)


def test_building_the_app_warms_up_before_returning(app, tiny_pipe, capsys):
    """The Space warmed up on the first visitor's request: now one synthetic reply runs through the engine (and the
    decoder) while the app is built, before it says it is ready."""
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
        app.create_app(tiny_pipe, engine, stream_audio=False, warmup=False)  # FUNAUDIOCHAT_WARMUP=0
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


_ENVIRONMENT = ("FUNAUDIOCHAT_MODEL", "FUNAUDIOCHAT_DECODER", "FUNAUDIOCHAT_SPEAKERS", "FUNAUDIOCHAT_DEVICE",
                "FUNAUDIOCHAT_MAX_INPUT_SECONDS", "FUNAUDIOCHAT_BATCH_SIZE", "FUNAUDIOCHAT_CONCURRENCY",
                "FUNAUDIOCHAT_MAX_PROMPT_TOKENS", "FUNAUDIOCHAT_WARMUP", "FUNAUDIOCHAT_TRUST_REMOTE_CODE",
                "FUNAUDIOCHAT_STREAM_AUDIO", "FUNAUDIOCHAT_FAST")  # fmt: skip


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("FUNAUDIOCHAT_MAX_INPUT_SECONDS", "0", "FUNAUDIOCHAT_MAX_INPUT_SECONDS must be a number of seconds above 0"),
        ("FUNAUDIOCHAT_MAX_INPUT_SECONDS", "-5", "FUNAUDIOCHAT_MAX_INPUT_SECONDS must be"),
        ("FUNAUDIOCHAT_MAX_INPUT_SECONDS", "nan", "FUNAUDIOCHAT_MAX_INPUT_SECONDS must be"),
        ("FUNAUDIOCHAT_MAX_INPUT_SECONDS", "600", "at most 300 (the longest audio the model hears), got '600'"),
        ("FUNAUDIOCHAT_BATCH_SIZE", "0", "FUNAUDIOCHAT_BATCH_SIZE must be a positive integer, got '0'"),
        ("FUNAUDIOCHAT_BATCH_SIZE", "four", "FUNAUDIOCHAT_BATCH_SIZE must be a positive integer, got 'four'"),
        ("FUNAUDIOCHAT_CONCURRENCY", "-1", "FUNAUDIOCHAT_CONCURRENCY must be a positive integer"),
        ("FUNAUDIOCHAT_MAX_PROMPT_TOKENS", "2.5", "FUNAUDIOCHAT_MAX_PROMPT_TOKENS must be a positive integer"),
        ("FUNAUDIOCHAT_FAST", "on please", "FUNAUDIOCHAT_FAST must be 1, true or yes (on) or 0, false or no (off)"),
        ("FUNAUDIOCHAT_STREAM_AUDIO", "2", "FUNAUDIOCHAT_STREAM_AUDIO must be 1, true or yes"),
        ("FUNAUDIOCHAT_WARMUP", "off", "FUNAUDIOCHAT_WARMUP must be"),
        ("FUNAUDIOCHAT_TRUST_REMOTE_CODE", "y", "FUNAUDIOCHAT_TRUST_REMOTE_CODE must be"),
        ("FUNAUDIOCHAT_DEVICE", "gpu", "FUNAUDIOCHAT_DEVICE gpu is not a device name"),
        ("FUNAUDIOCHAT_MODEL", "./no/such/model", "FUNAUDIOCHAT_MODEL folder not found: ./no/such/model"),
        ("FUNAUDIOCHAT_SPEAKERS", "/no/such/spk2info.pt", "FUNAUDIOCHAT_SPEAKERS file not found"),
    ],
)
def test_a_bad_variable_stops_the_app_before_loading_naming_it(app, monkeypatch, name, value, message):
    """The variables were read after the model loaded, some wrongly: 0 s accepted (then every question failed),
    batch size 0 failed inside the engine naming `max_batch_size`, "true" counted as off."""
    for other in _ENVIRONMENT:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(app, "load_pipeline", lambda *args: pytest.fail("the models were loaded"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        app.main()


def test_switches_and_numbers_are_parsed(app):
    on = {name: value for name, value in zip(("FUNAUDIOCHAT_FAST", "FUNAUDIOCHAT_STREAM_AUDIO",
                                              "FUNAUDIOCHAT_TRUST_REMOTE_CODE", "FUNAUDIOCHAT_WARMUP"),
                                             ("1", "TRUE", "Yes", " true "))}  # fmt: skip
    settings = app.read_settings({**on, "FUNAUDIOCHAT_BATCH_SIZE": "2", "FUNAUDIOCHAT_MAX_INPUT_SECONDS": "12.5",
                                  "FUNAUDIOCHAT_DEVICE": "cpu"})  # fmt: skip
    assert settings.fast and settings.stream_audio and settings.trust_remote_code and settings.warmup
    assert settings.batch_size == 2 and settings.max_input_seconds == 12.5 and settings.device == "cpu"
    off = dict.fromkeys(on, "0") | {"FUNAUDIOCHAT_FAST": "false", "FUNAUDIOCHAT_STREAM_AUDIO": "NO"}
    settings = app.read_settings(off)
    assert not (settings.fast or settings.stream_audio or settings.trust_remote_code or settings.warmup)
    defaults = app.read_settings({"FUNAUDIOCHAT_BATCH_SIZE": ""})  # empty: unset
    assert defaults._replace(device=None) == app.Settings()
    assert defaults.stream_audio is None and defaults.batch_size == 4 and defaults.concurrency is None


def test_question_length_over_the_models_window_is_refused_not_lowered(app, monkeypatch):
    """FUNAUDIOCHAT_MAX_INPUT_SECONDS=60 with a 30-s model was lowered to 30 without a word: refused right after
    loading (the window is the model's), naming the variable; only the default is capped at it."""
    from types import SimpleNamespace

    pipe = SimpleNamespace(processor=SimpleNamespace(max_audio_seconds=30.0))
    assert app.max_input_seconds_for(pipe, None) == 30 and app.max_input_seconds_for(pipe, 12.5) == 12.5
    assert app.max_input_seconds_for(SimpleNamespace(processor=SimpleNamespace(max_audio_seconds=10.0)), None) == 10
    with pytest.raises(ValueError, match="FUNAUDIOCHAT_MAX_INPUT_SECONDS=60 is more than this model takes: its "
                                         "processor hears at most 30 s of audio; set 30 or less"):  # fmt: skip
        app.max_input_seconds_for(pipe, 60)
    for other in _ENVIRONMENT:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv("FUNAUDIOCHAT_MAX_INPUT_SECONDS", "60")
    monkeypatch.setattr(app, "load_pipeline", lambda settings: (pipe, app.LoadedModel(False, {})))
    monkeypatch.setattr(app, "start_engine", lambda *args: pytest.fail("the engine started"))
    with pytest.raises(ValueError, match="FUNAUDIOCHAT_MAX_INPUT_SECONDS=60"):
        app.main()


def test_main_passes_the_settings_down(app, monkeypatch):
    """The engine gets the variables' batch size and prompt limit and the loaded model's fast settings; the app its
    question limit, audio streaming, warm-up and whether the model is the tiny one."""
    from types import SimpleNamespace

    for other in _ENVIRONMENT:
        monkeypatch.delenv(other, raising=False)
    env = {"FUNAUDIOCHAT_BATCH_SIZE": "2", "FUNAUDIOCHAT_MAX_PROMPT_TOKENS": "512", "FUNAUDIOCHAT_WARMUP": "no",
           "FUNAUDIOCHAT_STREAM_AUDIO": "false", "FUNAUDIOCHAT_MAX_INPUT_SECONDS": "20",
           "FUNAUDIOCHAT_CONCURRENCY": "3"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pipe = SimpleNamespace(processor=SimpleNamespace(max_audio_seconds=30.0))
    loaded = app.LoadedModel(is_tiny=True, fast_generate_kwargs={"backend": "compiled"})
    calls = {}
    monkeypatch.setattr(app, "load_pipeline", lambda settings: (pipe, loaded))
    engine = SimpleNamespace(max_batch_size=2, close=lambda: calls.setdefault("closed", True))
    monkeypatch.setattr(app, "start_engine", lambda *args: calls.setdefault("engine", args) and engine)

    class App:
        def queue(self, **kwargs):
            calls["queue"] = kwargs

        def launch(self, **kwargs):
            pass

    monkeypatch.setattr(app, "create_app", lambda *args: calls.setdefault("app", args) and App())
    app.main()
    assert calls["engine"] == (pipe, 2, 512, {"backend": "compiled"})
    assert calls["app"] == (pipe, engine, 20.0, False, False, True)
    assert calls["queue"]["default_concurrency_limit"] == 3 and calls["closed"]
