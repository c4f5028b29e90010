"""The OpenAI-compatible server on the tiny model (CPU, loopback only) through the official `openai` client."""

import base64
import io
import json
import socket
import sys
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest


openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from funaudiochat_hf.serving_openai_funaudiochat import wav_bytes  # noqa: E402
from funaudiochat_hf.serving_server_funaudiochat import _parser, build_engine, create_app  # noqa: E402
from funaudiochat_hf.tiny_model import TINY_MODEL_VERSION, build_tiny_model, synthetic_question  # noqa: E402


MAX_NEW_TOKENS = 12
KEY = "secret-key"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "cache" / f"tiny-{TINY_MODEL_VERSION}")


class _Server:
    """uvicorn serving an engine on a free loopback port, in a thread."""

    def __init__(self, path, *extra, api_key=None):
        args = _parser().parse_args(
            ["--model", str(path), "--device", "cpu", "--max-new-tokens", str(MAX_NEW_TOKENS),
             "--max-prompt-tokens", "640", *extra]
        )  # fmt: skip
        self.engine, processor, name = build_engine(args)
        self.name = name
        app = create_app(self.engine, processor, name, api_key=api_key)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="unused"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics").text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.close()


@pytest.fixture(scope="module")
def server(tiny_path):
    running = _Server(tiny_path, "--max-batch-size", "8")
    yield running
    running.close()


@pytest.fixture(scope="module")
def small_server(tiny_path):
    """One slot, no queue, an API key."""
    running = _Server(tiny_path, "--max-batch-size", "1", "--max-queue", "0", "--max-new-tokens", "400", api_key=KEY)
    yield running
    running.close()


def _question(seconds=1.0) -> str:
    return base64.b64encode(wav_bytes(synthetic_question(seconds), 16000)).decode()


def _messages(seconds=1.0):
    part = {"type": "input_audio", "input_audio": {"data": _question(seconds), "format": "wav"}}
    return [{"role": "user", "content": [part]}]


def _request(**extra):
    base = dict(modalities=["text", "audio"], audio={"voice": "default", "format": "wav"}, messages=_messages(),
                max_completion_tokens=MAX_NEW_TOKENS)  # fmt: skip
    return {**base, **extra}


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list()] == [server.name]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_non_streamed_reply_has_audio_transcript_and_usage(server):
    reply = server.client().chat.completions.create(model=server.name, seed=3, **_request())
    audio = reply.choices[0].message.audio
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as wav:
        assert wav.getframerate() == 24000 and wav.getnchannels() == 1 and wav.getsampwidth() == 2
        assert wav.getnframes() > 0
    assert isinstance(audio.transcript, str) and audio.id.startswith("audio_")
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= MAX_NEW_TOKENS and reply.usage.prompt_tokens > 0

    # The same seed gives the same reply; the earlier reply can be referred to by its audio id in a second turn. A
    # request may name the model as it likes: the reply names the served one.
    again = server.client().chat.completions.create(model="funaudiochat", seed=3, **_request())
    assert again.choices[0].message.audio.data == audio.data
    assert reply.model == again.model == server.name
    history = _messages() + [{"role": "assistant", "audio": {"id": audio.id}}] + _messages(0.5)
    second = server.client().chat.completions.create(
        model=server.name, **{**_request(), "messages": history, "audio": {"voice": "default", "format": "pcm16"}}
    )
    assert len(base64.b64decode(second.choices[0].message.audio.data)) % 2 == 0


def test_a_non_streamed_reply_comes_in_each_of_openais_audio_formats(server):
    """wav, pcm16, mp3, flac and opus (only the first two before): the same seeded reply, the same sample count; flac
    is lossless, so its samples are the wav's."""
    soundfile = pytest.importorskip("soundfile")
    client = server.client()

    def reply(audio_format):
        options = _request(audio={"voice": "default", "format": audio_format})
        return base64.b64decode(client.chat.completions.create(model=server.name, seed=5, **options)
                                .choices[0].message.audio.data)  # fmt: skip

    with wave.open(io.BytesIO(reply("wav"))) as wav:
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
    assert pcm.size > 0 and np.array_equal(np.frombuffer(reply("pcm16"), "<i2"), pcm)
    from funaudiochat_hf.serving_openai_funaudiochat import output_audio_formats, reply_audio_bytes

    # Those this libsndfile writes (soundfile's wheels: all three; flac any libsndfile).
    encoded = [audio_format for audio_format in ("mp3", "flac", "opus") if audio_format in output_audio_formats()]
    assert "flac" in encoded
    for audio_format in encoded:
        samples, rate = soundfile.read(io.BytesIO(reply(audio_format)), dtype="int16")
        assert rate == 24000 and samples.shape == pcm.shape, audio_format
    assert np.array_equal(soundfile.read(io.BytesIO(reply("flac")), dtype="int16")[0], pcm)
    # An empty reply is a readable file too (one silent sample: these formats cannot hold no frames).
    for audio_format in encoded:
        empty = reply_audio_bytes(np.zeros(0, np.float32), 24000, audio_format)
        assert soundfile.read(io.BytesIO(empty), dtype="int16")[0].tolist() == [0], audio_format


def test_streamed_reply_sends_pcm16_chunks_and_transcript_deltas(server):
    stream = server.client().chat.completions.create(
        model="funaudiochat", stream=True, stream_options={"include_usage": True},
        **{**_request(), "audio": {"voice": "default", "format": "pcm16"}},
    )  # fmt: skip
    pcm, transcript, finish, usage = b"", "", None, None
    for chunk in stream:
        assert chunk.model == server.name
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")  # typed in newer clients
        if audio:
            audio = audio if isinstance(audio, dict) else audio.model_dump()
            pcm += base64.b64decode(audio["data"])
            transcript += audio["transcript"]
        finish = chunk.choices[0].finish_reason or finish
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    assert finish in ("stop", "length") and usage is not None and usage.completion_tokens >= 1
    assert np.abs(np.frombuffer(pcm, "<i2")).max() > 0


def test_temperature_zero_takes_the_most_likely_speech_tokens(server):
    """`temperature: 0` or `top_p: 0` (refused before) give the same reply whatever the seed; sampled replies differ
    by seed."""
    client = server.client()

    def audio(**options):
        reply = client.chat.completions.create(model=server.name, **_request(**options))
        return reply.choices[0].message.audio.data

    greedy = audio(seed=1, temperature=0)
    assert greedy == audio(seed=2, temperature=0) == audio(seed=2, temperature=0, top_p=0.5) == audio(seed=3, top_p=0)
    assert audio(seed=1) != audio(seed=2)


def test_concurrent_requests_share_decode_steps(server):
    before = server.metrics()
    client = server.client()
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda seed: client.chat.completions.create(model=server.name, seed=seed,
                                                                           **_request()), range(8)))  # fmt: skip
    assert all(r.choices[0].message.audio.data for r in replies)
    after = server.metrics()
    rows = after["funaudiochat_decode_step_rows_sum"] - before["funaudiochat_decode_step_rows_sum"]
    steps = after["funaudiochat_decode_step_rows_count"] - before["funaudiochat_decode_step_rows_count"]
    assert steps > 0 and rows / steps > 1  # more than one row per decode step on average
    assert after["funaudiochat_generated_audio_seconds_total"] > before["funaudiochat_generated_audio_seconds_total"]
    assert after["funaudiochat_time_to_first_audio_seconds_count"] >= before[
        "funaudiochat_time_to_first_audio_seconds_count"] + 8  # fmt: skip


def test_client_that_disconnects_mid_stream_frees_its_slot(server):
    before = server.metrics()['funaudiochat_requests_total{outcome="cancelled"}']
    body = {**_request(), "stream": True, "model": server.name, "max_completion_tokens": MAX_NEW_TOKENS}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # Closed after the first chunk: the request is cancelled and its slot freed.
    deadline = time.time() + 30
    while True:
        values = server.metrics()
        if values['funaudiochat_requests_total{outcome="cancelled"}'] > before:
            break
        assert time.time() < deadline, values
        time.sleep(0.1)
    while server.metrics()["funaudiochat_requests_running"] != 0:
        assert time.time() < deadline
        time.sleep(0.1)


@pytest.mark.parametrize(
    "change, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                     "input_audio": {"data": "%%%", "format": "wav"}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
            "data": base64.b64encode(b"not audio at all" * 10).decode(), "format": "wav"}}]}]},
         "messages[0].content[0]"),
        ({"audio": {"voice": "no-such-voice", "format": "wav"}}, "audio.voice"),
        ({"audio": {"voice": "default", "format": "aac"}}, "audio.format"),
        ({"temperature": 5}, "temperature"),
        ({"stop": ["\n"]}, "stop"),
        ({"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"max_completion_tokens": MAX_NEW_TOKENS + 1}, "max_completion_tokens"),
        ({"max_completion_tokens": None, "max_tokens": MAX_NEW_TOKENS + 1}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 20000}]}, "messages"),
        ({"messages": [{"role": "system", "content": "s" * 5000}, {"role": "user", "content": "hi"}]}, "messages[0]"),
        # values of the wrong JSON type (a 500 before: `audio.get` on a string, `set()` of unhashable modalities)
        ({"modalities": ["text"], "audio": "wav"}, "audio"),
        ({"modalities": [{}]}, "modalities"),
        ({"messages": [{"role": "system", "content": [{"type": "text", "text": {"a": 1}}]},
                       {"role": "user", "content": "hi"}]}, "messages[0].content[0]"),
    ],
)  # fmt: skip
def test_bad_input_gets_a_4xx_error_and_the_server_keeps_serving(server, change, param):
    with pytest.raises(openai.BadRequestError) as bad:
        server.client().chat.completions.create(model=server.name, **{**_request(), **change})
    error = bad.value.body
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    reply = server.client().chat.completions.create(model=server.name, **_request(max_completion_tokens=2))
    assert reply.choices[0].message.audio is not None


def test_not_json_and_missing_key(server, small_server):
    response = httpx.post(server.url + "/v1/chat/completions", content=b"{", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        small_server.client("wrong").models.list()
    response = httpx.post(small_server.url + "/v1/chat/completions", json=_request(), timeout=30)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(small_server.url + "/health").status_code == 200  # open: load balancers probe it


@pytest.fixture(scope="module")
def processor(tiny_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_path)


def _parse(body, processor):
    from funaudiochat_hf.serving_openai_funaudiochat import TranscriptMemory, parse_chat_request

    return parse_chat_request(body, processor, TranscriptMemory(), [], "m")


@pytest.mark.parametrize(
    "change, param",
    [
        ({"audio": "wav"}, "audio"),
        ({"audio": ["wav"], "modalities": ["text", "audio"]}, "audio"),
        ({"modalities": [{}]}, "modalities"),
        ({"modalities": [["audio"]]}, "modalities"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
        ({"stream_options": ["include_usage"]}, "stream_options"),
        ({"n": True}, "n"),
        ({"messages": {"role": "user", "content": "hi"}}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [["hi"]]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "developer", "content": [{"type": "text", "text": 5}]},
                       {"role": "user", "content": "hi"}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text"}]},
                       {"role": "user", "content": "and?"}]}, "messages[1].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": "wav"}]}]},
         "messages[0].content[0]"),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_a_request_error_naming_it(processor, change, param):
    """Every request field's type is checked before it is used: a JSON value of another type raises `RequestError`
    naming the parameter (the server's 400), never an AttributeError or a TypeError (a 500), nor is it taken as text."""
    from funaudiochat_hf.serving_openai_funaudiochat import RequestError

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text"]}
    with pytest.raises(RequestError) as bad:
        _parse({**body, **change}, processor)
    assert bad.value.param == param and bad.value.status == 400, bad.value
    assert bad.value.body()["error"]["type"] == "invalid_request_error"
    # The defaults that OpenAI's API documents as nullable are taken as such.
    plain = _parse({**body, "stream": None, "n": None, "audio": None, "stream_options": None}, processor)
    assert plain.stream is False and plain.include_usage is False


def _encoded_question(audio_format: str, folder) -> bytes:
    """A 1.5 s spoken question encoded by ffmpeg as m4a (AAC) or webm (Opus)."""
    import subprocess

    source, encoded = folder / "question.wav", folder / f"question.{audio_format}"
    source.write_bytes(wav_bytes(synthetic_question(1.5), 16000))
    codec = {"m4a": "aac", "webm": "libopus"}[audio_format]
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-i", str(source), "-c:a", codec, str(encoded)],
                   capture_output=True, check=True)  # fmt: skip
    return encoded.read_bytes()


@pytest.mark.parametrize("audio_format", ["m4a", "webm"])
def test_m4a_and_webm_uploads_are_decoded_with_ffmpeg(processor, audio_format, monkeypatch, tmp_path):
    """soundfile reads neither m4a nor webm, and audio_io's ffmpeg fallback reads files only: the server decodes
    these uploads from a temporary file (every such request failed before). Data that is not of its format is refused
    before ffmpeg sees it, and a server without ffmpeg names the formats it takes."""
    import shutil

    from funaudiochat_hf import serving_openai_funaudiochat as openai_format

    if shutil.which("ffmpeg") is None or not openai_format.ffmpeg_decodes():
        pytest.skip("needs ffmpeg (and librosa) to encode and decode m4a / webm")
    try:
        encoded = _encoded_question(audio_format, tmp_path)
    except Exception as error:  # an ffmpeg built without the encoder
        pytest.skip(f"this ffmpeg cannot encode {audio_format}: {error}")

    def body(data: bytes) -> dict:
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": audio_format}}
        return {"model": "m", "messages": [{"role": "user", "content": [part]}], "modalities": ["text"]}

    features = _parse(body(encoded), processor).speech.inputs["input_features"]
    assert abs(features.shape[-1] - 150) <= 8, features.shape  # 1.5 s at 100 frames a second (and codec padding)
    playlist = b"#EXTM3U\n#EXTINF:1,\nfile:///etc/hostname\n"  # ffmpeg would follow it, whatever the file's name
    with pytest.raises(openai_format.RequestError, match=f"is not {audio_format} audio") as refused:
        _parse(body(playlist), processor)
    assert refused.value.param == "messages[0].content[0]"
    with pytest.raises(openai_format.RequestError) as corrupt:  # the right magic, then garbage
        _parse(body(encoded[:40] + b"\0" * 64), processor)
    assert "could not be read as audio" in str(corrupt.value) and "funaudiochat-upload" not in str(corrupt.value)
    monkeypatch.setattr(openai_format, "ffmpeg_decodes", lambda: False)
    with pytest.raises(openai_format.RequestError, match="needs ffmpeg.*wav, mp3, flac, ogg") as unsupported:
        _parse(body(encoded), processor)
    assert unsupported.value.param == "messages[0].content[0].input_audio.format"


def test_full_queue_gets_429_with_retry_after(small_server):
    client = small_server.client(KEY)
    # Holds the only slot: a seed whose reply runs to the length limit.
    body = {**_request(max_completion_tokens=400, seed=1), "stream": True, "model": small_server.name}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", small_server.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as running:  # fmt: skip
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a collected iterator would close the connection (a disconnect)
        assert next(lines).startswith("data:")
        values = small_server.metrics()
        assert values["funaudiochat_requests_running"] == 1, values
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model=small_server.name, **_request())
        assert int(limited.value.response.headers["Retry-After"]) >= 1
        assert json.loads(limited.value.response.text)["error"]["type"] == "rate_limit_exceeded"
    deadline = time.time() + 30
    while small_server.metrics()["funaudiochat_requests_running"] != 0:  # the closed stream leaves its slot
        assert time.time() < deadline
        time.sleep(0.1)
    reply = client.chat.completions.create(model=small_server.name, **_request(max_completion_tokens=2))
    assert reply.choices[0].message.audio is not None


def _loadgen():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "loadgen.py"
    spec = importlib.util.spec_from_file_location("loadgen", path)
    loadgen = importlib.util.module_from_spec(spec)
    sys.modules["loadgen"] = loadgen  # its dataclasses look their module up
    spec.loader.exec_module(loadgen)
    return loadgen


def test_load_generator_smoke(server, tmp_path):
    """scripts/loadgen.py against the running server: 3 Poisson-spaced streamed conversations, all with audio."""
    loadgen = _loadgen()
    report_path = tmp_path / "report.json"
    code = loadgen.main(["--url", server.url, "--conversations", "3", "--rate", "20", "--max-tokens",
                         str(MAX_NEW_TOKENS), "--json", str(report_path)])  # fmt: skip
    report = json.loads(report_path.read_text())
    assert code == 0 and report["errors"] == 0, report
    assert report["ttfa_p50_ms"] > 0 and report["ttfa_p95_ms"] >= report["ttfa_p50_ms"]
    assert report["rtf_p95"] > 0 and report["aggregate_x_real_time"] > 0 and report["audio_seconds"] > 0
    assert 0 <= report["stall_p50_ms"] <= report["stall_p95_ms"] and 0 <= report["streams_stalled"] <= 3


def test_playback_stall_is_the_wait_of_a_real_time_player():
    """A player starts at the first chunk and plays in real time: a chunk that comes after the audio before it ran
    out adds its lateness, and the stall pushes every later due time back."""
    stall = _loadgen().playback_stall
    assert stall([]) == 0.0 and stall([(5.0, 0.1)]) == 0.0
    assert stall([(0.0, 0.08), (0.05, 0.6), (0.6, 0.6)]) == 0.0  # each came before the audio ran out
    assert stall([(0.0, 0.04), (0.1, 0.6)]) == pytest.approx(0.06)  # 40 ms played, then 60 ms waiting
    # the second chunk 0.06 s late: the third is due at 0.04 + 0.6 + 0.06 = 0.7 s, and comes 0.1 s after that
    assert stall([(0.0, 0.04), (0.1, 0.6), (0.8, 0.6)]) == pytest.approx(0.16)


def test_load_generator_closed_load_keeps_its_concurrency(monkeypatch):
    """loadgen --concurrency C: C streams in flight once all users arrived, never more, each conversation sent once
    (its seed), the next one sent as soon as one ended; the open load (no --concurrency) has every conversation in
    flight at once when replies outlast the arrivals."""
    import asyncio

    loadgen = _loadgen()
    for concurrency, expected in ((3, 3), (None, 7)):
        in_flight, peak, seeds = 0, 0, []

        async def fake_one(client, url, body, headers, sampling_rate):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            seeds.append(body["seed"])
            await asyncio.sleep(0.05)
            in_flight -= 1
            return loadgen.StreamResult(ok=True, ttfa=0.01, wall=0.05, audio_seconds=1.0)

        monkeypatch.setattr(loadgen, "_one", fake_one)
        extra = ["--concurrency", str(concurrency)] if concurrency else []
        args = loadgen._parser().parse_args(["--conversations", "7", "--rate", "1000", *extra])
        report = asyncio.run(loadgen.run(args))
        assert peak == expected and sorted(seeds) == list(range(7)), (concurrency, peak, seeds)
        assert report["errors"] == 0 and report["audio_seconds"] == 7.0 and report["concurrency"] == concurrency
    assert loadgen.main(["--conversations", "2", "--concurrency", "3"]) == 2  # more users than conversations


def test_load_generator_reports_a_closed_loads_steady_aggregate(monkeypatch):
    """A closed load's steady aggregate counts the audio that arrived while all its users were in flight: from the
    last user's first request to the last conversation's; an open load has none."""
    import asyncio

    loadgen = _loadgen()
    assert loadgen.audio_between([[(0.5, 1.0), (1.5, 2.0)], [(1.0, 0.25), (3.0, 4.0)]], 1.0, 2.0) == 2.25
    assert loadgen.audio_between([], 0.0, 1.0) == 0.0

    async def fake_one(client, url, body, headers, sampling_rate):
        await asyncio.sleep(0.05)
        arrival = time.perf_counter()
        return loadgen.StreamResult(ok=True, ttfa=0.01, wall=0.05, audio_seconds=1.0, chunks=[(arrival, 1.0)])

    monkeypatch.setattr(loadgen, "_one", fake_one)
    for extra in (["--concurrency", "3"], [], ["--concurrency", "7"]):  # closed, open, one conversation per user
        args = loadgen._parser().parse_args(["--conversations", "7", "--rate", "1000", *extra])
        report = asyncio.run(loadgen.run(args))
        if extra != ["--concurrency", "3"]:
            assert report["steady_window"] is None and report["steady_aggregate_x_real_time"] is None
            continue
        start, end = report["steady_window"]
        # 3 sent at once, 3 more as they end (~50 ms), the last as one of those ends (~100 ms): the first three
        # replies' audio arrives inside the window, the last one's after it
        assert 0.08 < end - start < 0.5, (start, end)
        assert 3.0 <= report["steady_audio_seconds"] <= 6.0
        assert report["steady_aggregate_x_real_time"] == pytest.approx(report["steady_audio_seconds"] / (end - start))


def test_request_features_cover_the_clip_not_the_whole_window(tiny_path):
    """The server's processor call pads the features to the clip (100 frames a second), not to the extractor's
    window: the same embeddings, much less feature work before a request starts."""
    from transformers import AutoProcessor

    from funaudiochat_hf.serving_openai_funaudiochat import TranscriptMemory, parse_chat_request

    processor = AutoProcessor.from_pretrained(tiny_path)
    body = {"model": "m", "messages": _messages(1.5), "modalities": ["text"]}
    parsed = parse_chat_request(body, processor, TranscriptMemory(), [], "m")
    assert parsed.speech.inputs["input_features"].shape[-1] == 150


def test_parameters_that_ask_for_nothing_are_accepted(tiny_path):
    """Clients send unsupported parameters with values that ask for nothing (null, false, 0, empty, a text response
    format): the request is served as without them, where values that ask for something are refused."""
    from transformers import AutoProcessor

    from funaudiochat_hf.serving_openai_funaudiochat import RequestError, TranscriptMemory, parse_chat_request

    processor = AutoProcessor.from_pretrained(tiny_path)
    inert = {"stop": None, "tools": [], "tool_choice": "none", "logprobs": False, "top_logprobs": 0,
             "frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"},
             "user": "someone"}  # fmt: skip
    body = {"model": "m", "messages": _messages(0.5), "modalities": ["text"]}
    plain = parse_chat_request(body, processor, TranscriptMemory(), [], "m")
    parsed = parse_chat_request({**body, **inert}, processor, TranscriptMemory(), [], "m")
    assert parsed.speech.inputs["input_ids"].equal(plain.speech.inputs["input_ids"])
    with pytest.raises(RequestError, match="`presence_penalty` is not supported") as refused:
        parse_chat_request({**body, "presence_penalty": -0.5}, processor, TranscriptMemory(), [], "m")
    assert refused.value.param == "presence_penalty" and refused.value.code == "unsupported_parameter"


def test_stream_options_reach_the_engine_and_bad_ones_are_refused(tiny_path, capsys):
    """--stream-options: the streaming decoder's window settings (the lever between quality and conversations per
    GPU) reach the engine; unknown names and non-integers are refused before anything loads."""
    options = json.dumps({"flow_left_context_tokens": 50, "token_hop_len": 25, "token_max_hop_len": 100,
                          "stream_scale_factor": 1.5})  # fmt: skip
    args = _parser().parse_args(["--model", str(tiny_path), "--device", "cpu", "--max-new-tokens", "8",
                                 "--stream-options", options])  # fmt: skip
    engine, _, _ = build_engine(args)
    try:
        assert engine.stream_options["flow_left_context_tokens"] == 50 and engine.stream_options["token_hop_len"] == 25
        assert engine.stream_options["first_token_hop_len"] == 6  # the other defaults stay
        stream = engine.decoder.streaming_decoder(**engine.stream_options)
        assert stream.hop_schedule == (6, 25, 37, 55, 82, 100)  # hop growth
    finally:
        engine.close()
    bad_options = ('{"voice": 1}', '{"token_hop_len": "25"}', '{"token_max_hop_len": 1.5}',
                   '{"stream_scale_factor": true}', "[25]", "{")  # fmt: skip
    for bad in bad_options:
        with pytest.raises(SystemExit):
            _parser().parse_args(["--stream-options", bad])
        assert "--stream-options" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, message",
    [
        ('{"token_hop_len": 0}', "token_hop_len must be an int >= 1, got 0"),
        ('{"first_token_hop_len": 0}', "first_token_hop_len must be None or an int >= 1, got 0"),
        ('{"hift_left_context_frames": 0}', "hift_left_context_frames must be an int >= 8, got 0"),
        ('{"flow_left_context_tokens": -1}', "flow_left_context_tokens must be an int >= 0, got -1"),
        ('{"stream_scale_factor": NaN}', "stream_scale_factor must be a finite number >= 1, got nan"),
        ('{"stream_scale_factor": 0.5}', "stream_scale_factor must be a finite number >= 1"),
        ('{"stream_scale_factor": 1.01}', "does not grow token_hop_len=15"),
        ('{"token_hop_len": 150}', "token_max_hop_len must be None or an int >= token_hop_len (150), got 100"),
    ],
)
def test_stream_options_are_checked_by_the_decoders_rules_before_loading(options, message, monkeypatch, capsys):
    """--stream-options values the streaming decoder refuses (ranges, hop growth, also against the engine's default
    hops) are refused when the options are parsed: before, several passed and failed only once the engine had
    allocated its caches and recorded its graphs."""
    from funaudiochat_hf import serving_server_funaudiochat as server

    monkeypatch.setattr(server, "build_engine", lambda args: pytest.fail("the models were loaded"))
    with pytest.raises(SystemExit):
        server.main(["--stream-options", options])
    err = capsys.readouterr().err
    assert "--stream-options" in err and message in err, err


def test_the_server_warms_up_with_spoken_requests_before_it_listens(tiny_path):
    """`funaudiochat-serve` sends spoken synthetic requests through its own request path before it listens (the
    audio encoder's first use, the prompt bucket's pass and its recording on a GPU, the decoder's first chunks), and
    `--no-warmup` skips them."""
    from funaudiochat_hf.serving_server_funaudiochat import WARMUP_REPLIES, warm_up

    args = _parser().parse_args(["--model", str(tiny_path), "--device", "cpu", "--max-new-tokens", "8"])
    assert args.warmup and not _parser().parse_args(["--no-warmup"]).warmup
    engine, processor, name = build_engine(args)
    try:
        seconds = warm_up(engine, processor, name)
        snapshot = engine.snapshot()
        engine.reset_metrics()
        assert engine.snapshot()["requests"]["length"] == 0 and engine.snapshot()["audio_seconds"] == 0
    finally:
        engine.close()
    assert seconds > 0
    assert snapshot["requests"]["length"] + snapshot["requests"]["stop"] == WARMUP_REPLIES
    assert snapshot["audio_seconds"] > 0 and snapshot["running"] == snapshot["queued"] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-batch-size", "0"], "--max-batch-size must be at least 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (["--model", "/no/such/folder"], "--model folder not found: /no/such/folder"),
        (["--model", "NO_DECODER"], "has no speech decoder inside: set --decoder"),
        (["--port", "BUSY"], "cannot listen on 127.0.0.1:"),
        (["--api-key", ""], "--api-key is empty"),  # an empty bearer token authenticated before
        (["--api-key", "  "], "--api-key is empty"),
        (["--api-key", "key "], "--api-key starts or ends with whitespace"),  # a key no client could send
    ],
)
def test_bad_options_and_a_busy_port_are_one_line_errors_before_loading(monkeypatch, capsys, argv, message):
    """`funaudiochat-serve` says what is wrong in one line before any model loads (an 8B model takes long to load,
    only to find its port taken)."""
    from conftest import FUNAUDIOCHAT_TINY

    from funaudiochat_hf import serving_server_funaudiochat as server

    monkeypatch.setattr(server, "build_engine", lambda args: pytest.fail("the models were loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        values = {"NO_DECODER": str(FUNAUDIOCHAT_TINY), "BUSY": str(busy.getsockname()[1])}
        assert server.main([values.get(a, a) for a in argv]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and message in err[0], err


def test_an_empty_api_key_is_refused():
    """`create_app(api_key="")` would have let `Authorization: Bearer ` (an empty token) in."""
    from types import SimpleNamespace

    for key in ("", " "):
        with pytest.raises(ValueError, match="`api_key` is empty"):
            create_app(SimpleNamespace(model=None), None, "m", api_key=key)


def test_a_prompt_limit_below_the_default_prompt_is_refused_before_the_engine_starts(tiny_path, monkeypatch, capsys):
    """--max-prompt-tokens 256 with the tiny model (its default system prompt alone is ~290 tokens) refused no
    request until the warm-up's, which then ended in a raw traceback: it is now a one-line error naming the option
    and the size it needs, before the engine allocates anything."""
    from funaudiochat_hf import serving_server_funaudiochat as server

    monkeypatch.setattr(server, "SpeechEngine", lambda *args, **kwargs: pytest.fail("the engine was started"))
    argv = ["--model", str(tiny_path), "--device", "cpu", "--port", "0", "--max-prompt-tokens", "256"]
    assert server.main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "--max-prompt-tokens 256 cannot hold the default system prompt" in err[0], err
    needed = int(err[0].rsplit(" ", 1)[1])
    assert needed > 256 and f"raise it to at least {needed}" in err[0]


def test_a_failed_warm_up_is_a_one_line_error_and_closes_the_engine(monkeypatch, capsys):
    """Errors of the warm-up (after the models loaded) end as the errors before loading do: one `error:` line, a
    non-zero exit, the engine closed, nothing served."""
    from types import SimpleNamespace

    from funaudiochat_hf import serving_server_funaudiochat as server

    closed = []
    engine = SimpleNamespace(close=lambda: closed.append(True), voices=[])
    monkeypatch.setattr(server, "build_engine", lambda args: (engine, None, "m"))

    def failing_warm_up(*args):
        raise RuntimeError("The warm-up request failed: vocoding failed: out of memory\n(details)")

    monkeypatch.setattr(server, "warm_up", failing_warm_up)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: pytest.fail("the server started"))
    assert server.main(["--port", "0"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: The warm-up request failed: vocoding failed: out of memory", err
    assert closed == [True]
