"""The continuous-batching engine on the tiny model (CPU): requests that join and leave mid-flight get exactly their
single-run tokens, cancelling frees the slot, full queues and bad requests are refused."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from funaudiochat_hf import CosyVoice3Token2Wav, serving_vocoder_funaudiochat
from funaudiochat_hf.generation_vocoding_funaudiochat import decoder_speaker_kwargs, valid_speech_tokens
from funaudiochat_hf.serving_batch_funaudiochat import step_row_counts
from funaudiochat_hf.serving_engine_funaudiochat import SpeechEngine
from funaudiochat_hf.serving_requests_funaudiochat import QueueFull, SpeechRequest

from conftest import COSYVOICE3_TINY, force_recorded_prompt_pass, record_streaming_shapes
from test_modeling_cosyvoice3 import _close_wav


AUDIO_TOKEN = 346
TIMEOUT = 60  # seconds per event: a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def prompts(inputs):
    """Three conversations: the golden spoken prompt (331 tokens) and two text prompts cut from it."""
    long_ids = inputs["input_ids"]
    text_ids = long_ids[0][long_ids[0] != AUDIO_TOKEN]
    audio = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return {
        "spoken": {"input_ids": long_ids, **audio},
        "text40": {"input_ids": text_ids[-40:][None]},
        "text25": {"input_ids": text_ids[-25:][None]},
    }


def _single_run(model, inputs, max_new_tokens, **kwargs):
    out = model.generate_speech(**inputs, max_new_tokens=max_new_tokens, return_audio=False, **kwargs)
    return out.sequences[0, inputs["input_ids"].shape[1] :].tolist(), out.speech_ids[0].tolist()


def _take(handle, steps):
    """The request's events until they hold `steps` decode results (an event holds all that queued up meanwhile)."""
    events, taken = handle.events(timeout=TIMEOUT), []
    while sum(len(event.text_ids) for event in taken) < steps:
        taken.append(next(events))
    return taken


def _drain(handle):
    return list(handle.events(timeout=TIMEOUT))


def _steps_wait_for_prefills(engine, monkeypatch):
    """Each decode step waits while a request is prefilled, or waits for a free slot's prefill: a request submitted
    joins before the running ones step on. (On a busy host a long prefill beside the steps could outlast the reply
    running, and the join the test means to exercise would find an empty batch.)"""
    step = engine.batch.step

    def step_after_prefills(generators):
        with engine._lock:
            engine._lock.wait_for(
                lambda: not engine._prefilling and not (engine._waiting and None in engine._slots), TIMEOUT
            )
        return step(generators)

    monkeypatch.setattr(engine.batch, "step", step_after_prefills)


@pytest.mark.parametrize("mode", ["greedy", "seeded", "bucketed"])
def test_requests_joining_and_leaving_mid_flight_equal_their_single_runs(model, prompts, mode, monkeypatch):
    max_new = 16
    if mode == "bucketed":
        # The CUDA backends' recorded prompt pass (`plan.prefill_graph`, here without the recording): short prompts
        # are prefilled left-padded to a bucket; the slot takes only their own cache columns.
        from funaudiochat_hf import generation_loop_funaudiochat as loop

        force_recorded_prompt_pass(monkeypatch)
        lengths, bucketed = [], loop.bucketed_prefill_forward
        spy = lambda *a, length, **k: lengths.append(length) or bucketed(*a, length=length, **k)  # noqa: E731
        monkeypatch.setattr(loop, "bucketed_prefill_forward", spy)
    if mode in ("greedy", "bucketed"):
        engine_options, per_request = {"do_sample": False}, [{}, {}, {}, {}]
    else:  # each request its own seed and sampling values (a top-p and a penalty of 1 ride along exactly)
        engine_options = {}
        per_request = [
            {"seed": 1, "temperature": 0.7},
            {"seed": 2, "top_p": 1.0},
            {"seed": 3, "repetition_penalty": 1.0},
            {"seed": 4},
        ]
    order = ["text40", "spoken", "text25", "text40"]
    # 3 slots and just enough cache columns for the spoken prompt and a reply: the batch has to shift its columns
    # right (the spoken prompt is longer than the column the first request reached) and left (no room left at the
    # end) to take them all, with requests running each time.
    engine = SpeechEngine(
        model, max_batch_size=3, max_prompt_tokens=336, max_new_tokens=max_new, cache_length=352,
        generation_options=engine_options,
    )  # fmt: skip
    _steps_wait_for_prefills(engine, monkeypatch)
    try:
        handles = [engine.submit(SpeechRequest(prompts[order[0]], max_new_tokens=max_new, **per_request[0]))]
        events = {0: _take(handles[0], 3)}  # the first runs alone for 3 steps
        handles.append(engine.submit(SpeechRequest(prompts[order[1]], max_new_tokens=12, **per_request[1])))
        events[1] = _take(handles[1], 2)
        handles.append(engine.submit(SpeechRequest(prompts[order[2]], max_new_tokens=max_new, **per_request[2])))
        events[0] += _drain(handles[0])  # the first leaves while the others run
        handles.append(engine.submit(SpeechRequest(prompts[order[3]], max_new_tokens=max_new, **per_request[3])))
        for i in (1, 2, 3):
            events[i] = events.get(i, []) + _drain(handles[i])
        snapshot = engine.snapshot()
        # The host's mirror of the shared column followed every step and both shifts.
        assert engine.batch.column == int(engine.batch.ws.llm_cache.layers[0].cumulative_length)
    finally:
        engine.close()
    if mode == "bucketed":
        assert 64 in lengths, lengths  # the text prompts went through the padded pass
    assert snapshot["rebases"] >= 2, snapshot  # a right shift (the spoken prompt) and a left one (room at the end)
    assert snapshot["step_rows"][2] > snapshot["step_rows"][3]  # some steps ran several rows
    for i, handle in enumerate(handles):
        new_tokens = 12 if i == 1 else max_new
        expected_text, expected_speech = _single_run(model, prompts[order[i]], new_tokens, **engine_options,
                                                     **per_request[i])  # fmt: skip
        assert [t for e in events[i] for t in e.text_ids] == expected_text, i
        assert [t for e in events[i] for t in e.speech_ids] == expected_speech, i
        assert events[i][-1].finished and events[i][-1].finish_reason in ("stop", "length")
        assert sum(e.finished for e in events[i]) == 1


def test_concurrent_requests_get_the_audio_each_would_get_alone(model, prompts, monkeypatch):
    """The output thread decodes the chunks ready across requests together (one flow call per round): each request's
    audio, event by event, equals its own streaming decoder's fed the same speech ids (up to float rounding)."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    batches = []
    decode_ready = serving_vocoder_funaudiochat.decode_ready
    monkeypatch.setattr(serving_vocoder_funaudiochat, "decode_ready", lambda streams, **options: batches.append(
        len(streams)) or decode_ready(streams, **options))  # fmt: skip
    voices = ["中文女", "中文男", torch.randn(192, generator=torch.Generator().manual_seed(0))]
    events = [[] for _ in voices]
    release = threading.Event()

    def sink(index):
        return events[index].append

    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=4, max_prompt_tokens=48, max_new_tokens=16)
    try:
        # A one-step request first, whose only event holds the output thread until every other step has queued up.
        engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=1), sink=lambda event: release.wait(TIMEOUT))
        for index, voice in enumerate(voices):
            request = SpeechRequest(prompts["text40"], max_new_tokens=16, seed=index, voice=voice)
            engine.submit(request, sink=sink(index))
        deadline = time.monotonic() + TIMEOUT
        while engine.snapshot()["running"] or engine.snapshot()["queued"]:  # every step decoded
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        while not all(reply and reply[-1].finished for reply in events):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        release.set()
        engine.close()
    assert max(batches) == 3, batches  # rounds with the chunks of all three requests
    bos = engine.batch.cfg.speech_bos_id
    for voice, reply in zip(voices, events):
        assert reply[-1].finish_reason in ("stop", "length"), reply[-1].error
        alone = decoder.streaming_decoder(**decoder_speaker_kwargs(voice), **engine.stream_options)
        ids = [torch.tensor(event.speech_ids, dtype=torch.long) for event in reply]
        expected = [alone.push(valid_speech_tokens(speech, bos)) for speech in ids]
        expected[-1] = torch.cat([expected[-1], alone.finalize()])
        assert [len(event.audio) for event in reply] == [len(audio) for audio in expected]
        assert sum(len(audio) for audio in expected) > 3 * 960  # several chunks
        _close_wav(torch.cat([torch.from_numpy(event.audio) for event in reply]), torch.cat(expected))


def _spy_on_vocoder_rounds(monkeypatch, record) -> None:
    """Make each `ServingVocoder.start` call finish its round at once and pass `record(vocoder, items, start_up,
    results)` what it returned (before the engine takes it)."""
    start = serving_vocoder_funaudiochat.ServingVocoder.start

    def recorded(self, items, start_up=False):
        results = start(self, items, start_up).result()
        record(self, items, start_up, results)
        return SimpleNamespace(done=lambda: True, result=lambda: results)

    monkeypatch.setattr(serving_vocoder_funaudiochat.ServingVocoder, "start", recorded)


def test_a_replys_first_chunk_is_vocoded_apart_from_the_steady_chunks(model, prompts, monkeypatch):
    """A request that joins while another streams gets its first audio from a vocoder call of its own, delivered
    before the round's steady chunks are decoded: their shared flow call grows with its rows and windows."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    calls = []  # per vocoder call: [(request id, in its start-up)]
    start = serving_vocoder_funaudiochat.ServingVocoder.start

    def recorded(self, items, start_up=False):
        calls.append([(item.request_id, self.in_start_up(item.request_id)) for item in items])
        assert start_up == all(starting for _, starting in calls[-1])  # a start-up round is said to be one
        return start(self, items, start_up)

    monkeypatch.setattr(serving_vocoder_funaudiochat.ServingVocoder, "start", recorded)
    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=40)
    try:
        streaming = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=40, seed=0))
        events = streaming.events(timeout=TIMEOUT)
        while not len(next(events).audio):  # until it streams
            pass
        joining = engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=12, seed=1))
        assert _drain(joining)[-1].finished and list(events)[-1].finished
    finally:
        engine.close()
    mixed = [call for call in calls if len({starting for _, starting in call}) > 1]
    assert not mixed, mixed
    together = [call for call in calls if {streaming.id, joining.id} <= {rid for rid, _ in call}]
    assert together, calls  # the two streamed side by side after the joining one's first chunk


def test_queued_start_up_chunks_are_vocoded_before_queued_steady_ones(model, prompts, monkeypatch):
    """When vocoding falls behind the decode steps, the queued items of a request in its start-up (its first
    `START_UP_CHUNKS` chunks) are vocoded before those of requests past it (each request's items in order)."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    calls = []  # per vocoder call: [(request id, audio returned)]
    _spy_on_vocoder_rounds(monkeypatch, lambda vocoder, items, start_up, results: calls.append(
        [(item.request_id, not isinstance(out, Exception) and len(out) > 0) for item, out in zip(items, results)]
    ))  # fmt: skip
    streamed, hold, held, release = [], threading.Event(), threading.Event(), threading.Event()

    def holding_sink(event):  # once `hold` is set, the streaming request's next event stops the output thread
        streamed.append(event)
        if hold.is_set() and not release.is_set():
            held.set()
            release.wait(TIMEOUT)

    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=40)
    try:
        streaming = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=40, seed=0), sink=holding_sink)
        deadline = time.monotonic() + TIMEOUT
        while sum(len(event.audio) > 0 for event in streamed) < serving_vocoder_funaudiochat.START_UP_CHUNKS:
            assert time.monotonic() < deadline  # until it is past its start-up
            time.sleep(0.01)
        hold.set()
        assert held.wait(TIMEOUT)
        joining = engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=12, seed=1))
        while engine.snapshot()["running"] < 2 and not joining.finished.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while engine.snapshot()["running"] > 1:  # the joining request's steps are all queued behind the held event
            assert time.monotonic() < deadline
            time.sleep(0.01)
        mark = len(calls)
        release.set()
        assert _drain(joining)[-1].finished
        while not streamed[-1].finished:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        release.set()
        engine.close()
    # From the joining request's first queued item on (the held thread may first finish items taken before it joined).
    after = calls[mark:]
    start = next(i for i, call in enumerate(after) if any(rid == joining.id for rid, _ in call))
    after = after[start:]
    first_audio = next(i for i, call in enumerate(after) if (joining.id, True) in call)
    first_streaming = next(i for i, call in enumerate(after) if any(rid == streaming.id for rid, _ in call))
    assert first_audio < first_streaming, after


def test_cancel_frees_the_slot_for_the_next_request(model, prompts):
    engine = SpeechEngine(model, max_batch_size=1, max_queue=1, max_prompt_tokens=48, max_new_tokens=64)
    try:
        first = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=64, seed=0))
        _take(first, 2)  # running in the only slot
        waiting = engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=4, seed=0))
        with pytest.raises(QueueFull) as full:
            engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=4))
        assert full.value.retry_after > 0
        first.cancel()
        rest = _drain(first)
        assert rest[-1].finish_reason == "cancelled" and len(rest) < 62
        done = _drain(waiting)  # took the freed slot
        assert done[-1].finish_reason in ("stop", "length")
        snapshot = engine.snapshot()
        assert snapshot["running"] == 0 and snapshot["queued"] == 0
        assert snapshot["requests"]["cancelled"] == 1 and snapshot["requests"]["rejected"] == 1
    finally:
        engine.close()


def test_bad_requests_are_refused_before_queueing(model, prompts):
    engine = SpeechEngine(model, max_batch_size=1, max_prompt_tokens=48, max_new_tokens=8)
    try:
        with pytest.raises(ValueError, match="at most 48"):
            engine.submit(SpeechRequest(prompts["spoken"]))
        with pytest.raises(ValueError, match="temperature"):
            engine.submit(SpeechRequest(prompts["text25"], temperature=-1.0))
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=9))
        with pytest.raises(ValueError, match="top_p"):
            engine.submit(SpeechRequest(prompts["text25"], top_p=1.5))
        # the engine keeps serving
        assert _drain(engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=3)))[-1].finished
    finally:
        engine.close()
    assert not engine.healthy


def test_idle_slots_never_attend_to_nothing(model, prompts):
    """A freed row's masks are opened, so an idle row never softmaxes an all-masked row into NaN that a later request
    of that slot would read."""
    engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=8)
    try:
        _drain(engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=8, seed=0)))
        ws = engine.batch.ws
        assert bool(ws.llm_mask.all()) and bool(ws.crq_mask.all()) and bool(ws.done.all())
        for cache in (ws.llm_cache, ws.crq_cache):
            assert all(torch.isfinite(layer.keys).all() for layer in cache.layers)
    finally:
        engine.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_idle_rows_positions_stay_inside_the_cache(model, prompts, device):
    """An idle row below a busy one is stepped with it, and so was the never-used last row of a 4-row step, for as
    long as the engine ran: its rotary positions grew past the cache's, and on a GPU (the fast step looks the rotary
    tables up by position) that was a device-side assert that stopped the engine (open load, 32 conversations at 4 a
    second, an H100: the fifth run on one engine). Eight rounds of three requests (rows 0-2; row 3 idle, stepped) are
    twice as many steps as the cache has positions; every row's positions stay inside it and every request ends."""
    if device == "cuda":
        from transformers import AutoModel

        from conftest import FUNAUDIOCHAT_TINY

        model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    cache_length, max_new = 64, 16
    engine = SpeechEngine(model, max_batch_size=4, max_prompt_tokens=48, max_new_tokens=max_new,
                          cache_length=cache_length, generation_options={"do_sample": False})  # fmt: skip
    try:
        highest = []
        for _ in range(8):
            handles = [engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=max_new)) for _ in range(3)]
            replies = [_drain(handle) for handle in handles]
            assert all(reply[-1].finish_reason == "length" for reply in replies), [r[-1].error for r in replies]
            ws = engine.batch.ws
            highest.append((int(ws.llm_position.max()), int(ws.crq_position.max())))
        steps = engine.snapshot()["steps"]
    finally:
        engine.close()
    assert steps >= 2 * cache_length, steps
    k = engine.batch.k
    assert all(llm < cache_length and crq < k * cache_length for llm, crq in highest), highest


def test_an_empty_batch_starts_over_at_the_prompts_length(model, prompts, monkeypatch):
    """A request that joins an empty batch gets the columns `[0, prompt length)`, whatever column the last one left
    (nothing copied, no rebase counted): the same request on an idle engine gets the same columns every time, so it
    repeats its computation exactly (on a GPU the decode attention splits the columns by their position), and no step
    attends over columns no row reads. Before, it joined at the column the batch had reached."""
    engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=8)
    columns = []  # (row, the batch's column) at each admission
    admit = engine.batch.admit
    monkeypatch.setattr(
        engine.batch, "admit", lambda row, run: (columns.append((row, engine.batch.column)), admit(row, run))[1]
    )
    try:
        replies = [_drain(engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=8, seed=0))) for _ in range(3)]
        snapshot = engine.snapshot()
    finally:
        engine.close()
    length = prompts["text25"]["input_ids"].shape[1]
    assert columns == [(0, length)] * 3, columns
    assert snapshot["rebases"] == 0, snapshot
    tokens = [[token for event in reply for token in event.text_ids] for reply in replies]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 8


def test_the_shared_column_is_read_without_touching_the_device(model, prompts, monkeypatch):
    # The decode thread reads the column before each admission: a device read there would wait for the step in flight.
    engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=340, max_new_tokens=4)
    try:
        _drain(engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=4)))
        expected = int(engine.batch.ws.llm_cache.layers[0].cumulative_length)

        def no_device_read(*args, **kwargs):
            raise AssertionError("the column was read from a tensor")

        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "__int__", no_device_read)
            patch.setattr(torch.Tensor, "item", no_device_read)
            patch.setattr(torch.Tensor, "tolist", no_device_read)
            assert engine.batch.column == expected
    finally:
        engine.close()


def test_the_engine_lowers_the_thread_switch_interval(model, monkeypatch):
    """The decode thread must get the GIL back as soon as a step's outputs arrive, also while the output thread
    vocodes: CPython's default 5 ms switch interval would add up to 5 ms to each of its waits under load. The setting
    is process-wide: it is set back when the last running engine closes (it stayed lowered for good before)."""
    import sys

    from funaudiochat_hf import serving_engine_funaudiochat as engine_module
    from funaudiochat_hf.serving_engine_funaudiochat import THREAD_SWITCH_INTERVAL_SECONDS

    monkeypatch.setattr(engine_module, "_SWITCH_INTERVAL", engine_module._SwitchInterval())  # no other engine runs
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)
    intervals = []
    monkeypatch.setattr(sys, "setswitchinterval", intervals.append)
    first = SpeechEngine(model, max_batch_size=1, max_prompt_tokens=48, max_new_tokens=8)
    second = SpeechEngine(model, max_batch_size=1, max_prompt_tokens=48, max_new_tokens=8)
    try:
        assert intervals == [THREAD_SWITCH_INTERVAL_SECONDS] and THREAD_SWITCH_INTERVAL_SECONDS <= 5e-4
        first.close()
        first.close()  # a second close sets nothing back twice
        assert intervals == [THREAD_SWITCH_INTERVAL_SECONDS]  # the second engine still runs
    finally:
        second.close()
    assert intervals == [THREAD_SWITCH_INTERVAL_SECONDS, 0.005]


def test_the_engines_start_up_work_is_said_at_the_default_log_level(model, monkeypatch, caplog):
    """The engine's long start-up work (allocating and warming up its batch, recording the decoder's graphs) is logged
    as a warning, as the package's compile notes are: at INFO a default logger (`funaudiochat-serve`'s) said nothing
    for minutes."""
    import logging

    from funaudiochat_hf.serving_engine_funaudiochat import logger

    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    monkeypatch.setattr(serving_vocoder_funaudiochat.ServingVocoder, "fixed_shapes", property(lambda self: True))
    monkeypatch.setattr(serving_vocoder_funaudiochat.ServingVocoder, "warm_up", lambda self, batch_size: None)
    with caplog.at_level(logging.NOTSET):  # what the records' levels are, whatever the loggers let through
        SpeechEngine(model, speech_decoder=decoder, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=4).close()
    said = {record.getMessage().split(";")[-1].strip(): record.levelno for record in caplog.records
            if record.name == logger.name and record.getMessage().endswith("...")}  # fmt: skip
    assert len(said) == 2 and all(level >= logging.WARNING for level in said.values()), said
    assert any("allocating and warming up" in message for message in said), said
    assert any("recording the speech decoder's graphs" in message for message in said), said


@pytest.mark.parametrize(
    "options, message",
    [
        ({"token_hop_len": 0}, "token_hop_len must be an int >= 1"),
        ({"hift_left_context_frames": 0}, "hift_left_context_frames must be an int >= 8"),
        ({"flow_left_context_tokens": 1.5}, "flow_left_context_tokens must be an int >= 0"),
        ({"stream_scale_factor": float("nan")}, "stream_scale_factor must be a finite number"),
        ({"token_hop_len": 150}, "token_max_hop_len must be None or an int >= token_hop_len"),
        ({"hop_len": 5}, "Unknown stream option hop_len"),
    ],
)  # fmt: skip
def test_bad_stream_options_are_refused_before_the_engine_allocates(model, monkeypatch, options, message):
    """The streaming decoder's rules that need no decoder are checked before the batch allocates its caches and
    records its graphs (they were checked only once its first streaming decoder was made, after all that)."""
    from funaudiochat_hf import serving_engine_funaudiochat as engine_module

    monkeypatch.setattr(engine_module, "ServingBatch", lambda *args: pytest.fail("the batch was allocated"))
    with pytest.raises(ValueError, match=message):
        SpeechEngine(model, max_batch_size=1, max_prompt_tokens=48, max_new_tokens=4, stream_options=options)


def test_an_engine_that_fails_to_start_frees_its_batch(model, monkeypatch):
    """An option only the decoder can check (its pre-lookahead) fails the start after the batch is allocated: the
    batch's caches and graphs are freed then, not held by an engine nobody can close."""
    from funaudiochat_hf.serving_batch_funaudiochat import ServingBatch

    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    closed, close = [], ServingBatch.close
    monkeypatch.setattr(ServingBatch, "close", lambda batch: closed.append(batch) or close(batch))
    wrong = {"pre_lookahead_len": decoder.config.pre_lookahead_len + 1}
    with pytest.raises(ValueError, match="pre_lookahead_len must equal the model's pre-lookahead"):
        SpeechEngine(model, speech_decoder=decoder, max_batch_size=1, max_prompt_tokens=48, max_new_tokens=4,
                     stream_options=wrong)  # fmt: skip
    assert len(closed) == 1 and closed[0].generator is None


def test_more_steps_than_cache_columns(model, prompts):
    """The batch runs on for many more steps than its caches have columns (the step's own text-token column is
    wrapped, the shared cache column shifted back)."""
    engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=40, max_new_tokens=12, cache_length=64)
    try:
        for seed in range(7):
            events = _drain(engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=12, seed=seed)))
            assert events[-1].finish_reason in ("stop", "length"), events[-1].error
        assert engine.snapshot()["steps"] > 64 and engine.healthy
    finally:
        engine.close()


def test_backend_and_settings_are_checked_as_generate_speech_checks_them(model, prompts):
    """The engine's backend and its settings go through the same plan and request checks as `generate_speech`: the
    same errors, before any request runs."""
    sizes = dict(max_batch_size=1, max_prompt_tokens=48, max_new_tokens=8)
    with pytest.raises(ValueError, match="backend"):
        SpeechEngine(model, backend="fast", **sizes)
    with pytest.raises(ValueError, match="cuda_graphs"):  # a CPU model: no CUDA graphs
        SpeechEngine(model, backend="cuda_graphs", **sizes)
    with pytest.raises(ValueError, match="num_beams"):
        SpeechEngine(model, generation_options={"num_beams": 2}, **sizes)
    with pytest.raises(ValueError, match="static caches"):
        SpeechEngine(model, generation_options={"cache_implementation": "dynamic"}, **sizes)
    engine = SpeechEngine(model, **sizes)
    try:
        assert engine.batch.cfg.plan.backend == "eager"  # "auto" on a CPU
        with pytest.raises(ValueError) as from_engine:
            engine.submit(SpeechRequest(prompts["text25"], temperature=float("nan")))
        with pytest.raises(ValueError) as from_generate:
            model.generate_speech(**prompts["text25"], temperature=float("nan"), max_new_tokens=2, return_audio=False)
        assert str(from_engine.value) == str(from_generate.value)
    finally:
        engine.close()


def _no_hold_bound(monkeypatch) -> None:
    """The decode thread waits for the output thread's vocoding of each step until it is done, however long that takes
    (`FIRST_AUDIO_HOLD_SECONDS` bounds it at 50 ms): on a busy CPU host a vocoder call can outlast the bound, and the
    next step's outputs then join the same round (one event for two decode results)."""
    from funaudiochat_hf import serving_engine_funaudiochat as engine_module

    monkeypatch.setattr(engine_module, "FIRST_AUDIO_HOLD_SECONDS", 60.0)


def test_an_idle_engines_first_audio_comes_when_the_direct_streams_does(model, prompts, monkeypatch):
    """One request on an idle engine: its first audio comes after as many decode results as `generate_speech_stream`'s
    (same first-chunk hop), with as many samples, and its timeline says where the time went, stage by stage."""
    _no_hold_bound(monkeypatch)
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=12)
    try:
        handle = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=12, seed=0))
        served = _drain(handle)
    finally:
        engine.close()
    direct = list(model.generate_speech_stream(**prompts["text40"], speech_decoder=decoder, max_new_tokens=12, seed=0))
    direct_first = next(i for i, event in enumerate(direct) if event.audio.numel())
    served_first = next(i for i, event in enumerate(served) if len(event.audio))
    assert handle.first_audio_steps == served_first + 1 == direct_first + 1
    assert len(served[served_first].audio) == direct[direct_first].audio.numel() > 0
    stages = list(handle.timeline)
    assert stages == ["admitted", "prefilled", "ready", "vocoding", "first_audio"]
    assert sorted(handle.timeline.values()) == list(handle.timeline.values())
    assert handle.first_audio == handle.timeline["first_audio"] > 0


def test_until_a_request_streams_each_step_is_vocoded_before_the_next_is_queued(model, prompts, monkeypatch):
    """While no request streams audio yet (one request on an idle engine), the decode thread reads each step's
    outputs and waits for the output thread to vocode them before it queues the next step: the first chunk is then
    vocoded with no step beside it, as in `generate_speech_stream` (on a GPU a step queued ahead shared the GPU with
    it and slowed it). Once audio streams, steps are queued ahead of the reads again. Before, every step was queued
    before the previous one's outputs were read."""
    _no_hold_bound(monkeypatch)
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    log = []  # "step" (queued), "read" (outputs taken), "audio" (a vocoder call returned audio)

    def recorded_audio(vocoder, items, start_up, results):
        if any(not isinstance(out, Exception) and len(out) for out in results):
            log.append("audio")

    _spy_on_vocoder_rounds(monkeypatch, recorded_audio)
    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=12)
    step, read = engine.batch.step, engine.batch.read_results
    monkeypatch.setattr(engine.batch, "step", lambda generators: (log.append("step"), step(generators))[1])
    monkeypatch.setattr(engine.batch, "read_results", lambda copy: (log.append("read"), read(copy))[1])
    try:
        served = _drain(engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=12, seed=0)))
    finally:
        engine.close()
    assert served[-1].finished and "audio" in log, log
    first_audio = log.index("audio")
    before, after = log[:first_audio], log[first_audio + 1 :]
    assert before and before == ["step", "read"] * (len(before) // 2), log  # one step at a time, up to its audio
    assert after[0] == "step", log  # the next step waited for the first chunk
    pairs = list(zip(after, after[1:]))
    assert ("step", "step") in pairs, log  # then queued ahead again


def test_the_engine_streams_with_a_growing_hop_by_default(model):
    """Serving's decoder default: `generate_speech_stream`'s first chunks (6 tokens, then 15: the first audio is as
    early), then hops doubling to 100. A fixed hop of 15 recomputes the 200-token left context 14.5 times over and
    caps the conversations a GPU serves; an explicit setting still wins."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    hops = {}
    for name, options in (("default", None), ("fixed", {"token_max_hop_len": 15})):
        engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=1, max_prompt_tokens=48, max_new_tokens=4,
                              stream_options=options)  # fmt: skip
        try:
            stream = engine._vocoder._new_stream(None)
        finally:
            engine.close()
        hops[name] = [stream.chunk_hop(index) for index in range(7)]
    assert hops["default"] == [6, 15, 30, 60, 100, 100, 100]
    assert hops["fixed"] == [6] + [15] * 6
    direct = decoder.streaming_decoder(token_hop_len=15, first_token_hop_len=6)  # generate_speech_stream's
    assert [direct.chunk_hop(index) for index in range(2)] == hops["default"][:2]


@pytest.mark.parametrize(
    "options",
    [
        # the default hops (5, 15, 30, 60, 100): a last chunk's window can fall between two chunks' windows
        {"flow_left_context_tokens": 20, "flow_window_bucket_tokens": 16},
        {"token_max_hop_len": 15, "flow_left_context_tokens": 20, "flow_window_bucket_tokens": 16},
        # hops 5, 5, 10, 20: the windows are full after the second chunk, the hop grows on for two more
        {"token_hop_len": 5, "token_max_hop_len": 20, "flow_left_context_tokens": 5, "hift_left_context_frames": 8,
         "flow_window_bucket_tokens": 8},
    ],
    ids=["default-hops", "fixed-hop", "hop-growth"],
)
def test_the_warm_up_decodes_every_shape_a_load_decodes(model, prompts, monkeypatch, options):
    """Where the decoders run fixed shapes (CUDA graphs: each new shape records a graph that keeps its memory), the
    engine decodes every batch size and window shape before it takes requests: concurrent replies then decode no
    shape the warm-up did not (so memory after a load equals memory after the warm-up). On a CPU: fixed shapes
    forced (padded batch sizes and flow windows), every call's shapes recorded."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    monkeypatch.setattr(serving_vocoder_funaudiochat.ServingVocoder, "fixed_shapes", property(lambda self: True))
    shapes = record_streaming_shapes(monkeypatch, decoder)
    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=3, max_prompt_tokens=48, max_new_tokens=16,
                          stream_options=options)  # fmt: skip
    warmed = set(shapes)
    shapes.clear()
    try:
        handles, taken = [], []
        for index, (prompt, steps) in enumerate([("text40", 16), ("text25", 11), ("text40", 14)]):
            handles.append(engine.submit(SpeechRequest(prompts[prompt], max_new_tokens=steps, seed=index)))
            taken.append(_take(handles[-1], 2 + index))  # out of phase: their chunks fall in different rounds
        replies = [events + _drain(handle) for events, handle in zip(taken, handles)]
    finally:
        engine.close()
    assert all(reply[-1].finish_reason == "length" for reply in replies)
    assert {shape[1][0] for shape in warmed if shape[0] == "flow"} == {1, 2, 4}
    assert len(shapes) > 3 and shapes <= warmed, shapes - warmed


def test_a_request_is_prefilled_with_the_caches_generate_speech_uses(model, prompts, monkeypatch):
    """Only the batch's caches must be static (rows join at a shared column): a request's prefill uses the caches its
    plan uses in `generate_speech` (dynamic on a CPU), not a static cache as long as the batch's, whose every column
    its prompt pass would attend over and build masks for."""
    from funaudiochat_hf import generation_loop_funaudiochat as loop

    kinds = []
    prefill = loop.SpeechRun.prefill
    monkeypatch.setattr(loop.SpeechRun, "prefill", lambda run: kinds.append(run.ws.static) or prefill(run))
    model.generate_speech(**prompts["text40"], max_new_tokens=2, return_audio=False)
    engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=8)
    try:
        assert _drain(engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=8)))[-1].finished
        assert engine.batch.ws.static  # the batch's
    finally:
        engine.close()
    direct, batch, request = kinds
    assert batch and request == direct


def test_step_row_counts():
    assert step_row_counts(16) == (1, 2, 4, 8, 16)
    assert step_row_counts(12) == (1, 2, 4, 8, 12)
    assert step_row_counts(3) == (1, 2, 3)
    assert step_row_counts(1) == (1,)


def test_a_step_runs_the_first_rows_that_hold_every_busy_one(model, prompts, monkeypatch):
    """One request on an idle engine is stepped as a batch of one (its first slot), not with every idle row; two
    running requests as a batch of two. The rows are views of the batch's workspace: the tokens are the single runs'
    (the mid-flight test checks that while rows join and leave)."""
    from funaudiochat_hf import generation_state_funaudiochat

    rows = []
    step = generation_state_funaudiochat.decode_step
    monkeypatch.setattr(generation_state_funaudiochat, "decode_step",
                        lambda model, ws, cfg: rows.append(ws.batch_size) or step(model, ws, cfg))  # fmt: skip
    engine = SpeechEngine(model, max_batch_size=4, max_prompt_tokens=48, max_new_tokens=8,
                          generation_options={"do_sample": False})  # fmt: skip
    try:
        assert rows == [1, 1, 2, 2, 4, 4]  # each row count's step warmed up (and recorded, on CUDA) at the start
        rows.clear()
        alone = _drain(engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=8)))
        assert rows and set(rows) == {1}
        assert [t for e in alone for t in e.text_ids] == _single_run(model, prompts["text40"], 8, do_sample=False)[0]
        rows.clear()
        first = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=8))
        _take(first, 2)
        second = engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=4))
        assert _drain(second)[-1].finished and _drain(first)[-1].finished
        assert 2 in rows and max(rows) == 2
    finally:
        engine.close()


@pytest.mark.gpu
def test_row_counts_replay_the_graphs_recorded_at_the_start_on_gpu(prompts):
    """On CUDA each row count's step is recorded at the start (one graph on each view of the batch's workspace) and
    only replayed while requests join and leave; a request's first step (its prefill, `generate_speech`'s recorded
    prompt pass) gives its single run's first tokens.

    Later tokens equal the single run's only up to rounding on a GPU: the decode attention splits the cache by the
    step's rows and the cache's length (`triton_attention_funaudiochat._num_splits`), so its float32 sums run in
    another order than the single run's, and a near-tie can resolve differently (the CPU tests above check exact
    equality, where every row count computes alike)."""
    from transformers import AutoModel

    from conftest import FUNAUDIOCHAT_TINY

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    options = {"do_sample": False, "repetition_penalty": 1.0}
    engine = SpeechEngine(model, max_batch_size=4, max_prompt_tokens=48, max_new_tokens=12, backend="cuda_graphs",
                          generation_options=options)  # fmt: skip
    try:
        runs = engine.batch.row_runs
        assert list(runs) == [1, 2, 4]
        graphs = {rows: list(run.ws.step_graphs.graphs.values()) for rows, run in runs.items()}
        assert all(len(recorded) == 1 for recorded in graphs.values()), graphs
        first = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=12))
        events = {0: _take(first, 3)}  # alone: one row
        second = engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=6))  # two rows
        events[1] = _drain(second)
        events[0] += _drain(first)
        # replayed, never recorded again
        assert {rows: list(run.ws.step_graphs.graphs.values()) for rows, run in runs.items()} == graphs
    finally:
        engine.close()
    for index, (name, steps) in enumerate([("text40", 12), ("text25", 6)]):
        expected = model.generate_speech(**prompts[name], max_new_tokens=steps, return_audio=False,
                                         backend="cuda_graphs", **options)  # fmt: skip
        length = prompts[name]["input_ids"].shape[1]
        assert events[index][-1].finish_reason == "length"
        assert sum(len(event.text_ids) for event in events[index]) == steps
        assert events[index][0].text_ids == expected.sequences[0, length : length + 1].tolist()
        group = len(events[index][0].speech_ids)
        assert events[index][0].speech_ids == expected.speech_ids[0, :group].tolist()


def test_the_next_step_is_queued_before_the_previous_steps_outputs_are_read(model, prompts, monkeypatch):
    """The decode thread queues step n + 1 before it waits for step n's outputs (the GPU runs it while the host hands
    them on), and still gives every request exactly its tokens: a reply of 8 tokens (the prefill's and 7 steps')
    ends after one step more than it needs, whose outputs are dropped."""
    from funaudiochat_hf.serving_batch_funaudiochat import ServingBatch

    order = []
    step, read = ServingBatch.step, ServingBatch.read_results
    monkeypatch.setattr(ServingBatch, "step", lambda self, generators: order.append("step") or step(self, generators))
    monkeypatch.setattr(ServingBatch, "read_results", lambda self, copy: order.append("read") or read(self, copy))
    engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=8,
                          generation_options={"do_sample": False})  # fmt: skip
    try:
        order.clear()  # the start-up's warm-up
        events = _drain(engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=8)))
        deadline = time.monotonic() + TIMEOUT
        while order.count("read") < order.count("step") and time.monotonic() < deadline:
            time.sleep(0.01)  # the dropped step's outputs are taken on the decode thread's next pass
    finally:
        engine.close()
    assert order == ["step", "step"] + ["read", "step"] * 6 + ["read", "read"], order
    expected_text, _ = _single_run(model, prompts["text40"], 8, do_sample=False)
    assert [t for e in events for t in e.text_ids] == expected_text


def _hold_prefills_of(prompt, monkeypatch):
    """`(entered, release)`: the prefill of a request of `prompt`'s length sets `entered` and waits for `release`."""
    from funaudiochat_hf.serving_batch_funaudiochat import ServingBatch

    prefill, entered, release = ServingBatch.prefill, threading.Event(), threading.Event()

    def held_prefill(self, request, resolved):
        if request.inputs["input_ids"].shape[1] == prompt["input_ids"].shape[1]:
            entered.set()
            assert release.wait(TIMEOUT)
        return prefill(self, request, resolved)

    monkeypatch.setattr(ServingBatch, "prefill", held_prefill)
    return entered, release


def _join_during_held_prefill(engine, prompts, events, entered, release, observe):
    """Submit the joining request ("text25", 6 steps), call `observe()` while its prefill is held (`_hold_prefills_of`),
    then let it go: `(what observe returned, the joining request's events, the rest of the running one's events)`."""
    joining = engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=6))
    assert entered.wait(TIMEOUT)
    observed = observe()
    release.set()
    return observed, _drain(joining), list(events)


def _assert_single_runs(model, prompts, running, running_steps, joined):
    """The running request's ("text40") and the joining one's ("text25", 6 steps) events hold their single runs'
    greedy tokens."""
    expected, _ = _single_run(model, prompts["text40"], running_steps, do_sample=False)
    assert [t for event in running for t in event.text_ids] == expected
    expected, _ = _single_run(model, prompts["text25"], 6, do_sample=False)
    assert [t for event in joined for t in event.text_ids] == expected


def test_the_decode_steps_go_on_while_a_request_is_prefilled(model, prompts, monkeypatch):
    """A joining request is prefilled on the prefill thread: the running requests keep getting decode steps while its
    prefill runs (on the decode thread, every row waited for every prefill), and it still gets its single run's
    tokens."""
    entered, release = _hold_prefills_of(prompts["text25"], monkeypatch)
    engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=24,
                          generation_options={"do_sample": False})  # fmt: skip
    try:
        running = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=24))
        events = running.events(timeout=TIMEOUT)
        before = [next(events) for _ in range(2)]
        # steps while the joining request's prefill is held
        during, joined, rest = _join_during_held_prefill(engine, prompts, events, entered, release,
                                                         lambda: [next(events) for _ in range(5)])  # fmt: skip
    finally:
        release.set()
        engine.close()
    assert len(during) == 5 and not any(event.finished for event in during)
    _assert_single_runs(model, prompts, before + during + rest, 24, joined)


def test_a_request_prefilled_while_the_engine_fails_gets_an_error_at_once(model, prompts, monkeypatch):
    """The decode thread fails while a request is being prefilled (then in none of the engine's lists, so the failure
    does not reach it): it gets an error event when its prefill ends, not only when the engine is closed."""
    entered, release = _hold_prefills_of(prompts["text25"], monkeypatch)
    engine = SpeechEngine(model, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=24,
                          generation_options={"do_sample": False})  # fmt: skip
    step, fail = engine.batch.step, threading.Event()

    def failing_step(generators):
        if fail.is_set():
            raise RuntimeError("a broken step")
        return step(generators)

    monkeypatch.setattr(engine.batch, "step", failing_step)
    try:
        running = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=24))
        next(running.events(timeout=TIMEOUT))
        joining = engine.submit(SpeechRequest(prompts["text25"], max_new_tokens=6))
        assert entered.wait(TIMEOUT)
        fail.set()
        assert _drain(running)[-1].finish_reason == "error"
        release.set()
        last = list(joining.events(timeout=10))[-1]
        assert last.finished and last.finish_reason == "error" and "a broken step" in last.error
    finally:
        release.set()
        engine.close()


def test_a_prefill_has_the_gpu_to_itself_while_no_stream_needs_audio_now(model, prompts, monkeypatch):
    """While a joining request is prefilled and no running request needs audio now (its playback has not caught up
    with its audio), no decode step is queued and no vocoder round runs (on a GPU, beside them a prefill took about
    twice as long); then both requests get their single runs' tokens."""
    from funaudiochat_hf import serving_engine_funaudiochat as engine_module

    monkeypatch.setattr(SpeechEngine, "_starved", lambda self, handle, now: False)  # no stream needs audio now
    monkeypatch.setattr(engine_module, "PREFILL_HOLD_SECONDS", TIMEOUT)
    entered, release = _hold_prefills_of(prompts["text25"], monkeypatch)
    counts = {"step": 0, "round": 0}
    _spy_on_vocoder_rounds(monkeypatch, lambda *round_: counts.update(round=counts["round"] + 1))
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=100,
                          generation_options={"do_sample": False})  # fmt: skip
    step = engine.batch.step

    def slow_counted_step(generators):  # steps of 20 ms: the running request outlasts the prefill
        counts["step"] += 1
        time.sleep(0.02)
        return step(generators)

    monkeypatch.setattr(engine.batch, "step", slow_counted_step)
    try:
        running = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=100))
        events, before = running.events(timeout=TIMEOUT), []
        while not any(len(event.audio) for event in before):  # it streams
            before.append(next(events))

        def observe():
            time.sleep(0.2)  # a step or round begun before the prefill ends
            held = dict(counts)
            time.sleep(0.3)
            return held, dict(counts), not running.finished.is_set()

        (held, during, unfinished), joined, rest = _join_during_held_prefill(
            engine, prompts, events, entered, release, observe
        )
    finally:
        release.set()
        engine.close()
    assert unfinished and during == held, (held, during)  # nothing ran while the prefill did
    assert counts["step"] > held["step"] and counts["round"] > held["round"]  # and it all went on after it
    assert sum(len(event.text_ids) for event in before + rest) > 30  # it outlasted the prefill's hold
    _assert_single_runs(model, prompts, before + rest, 100, joined)


def test_an_idle_engine_waits_for_the_vocoder_only_after_a_step_that_may_give_a_first_chunk(model, prompts, monkeypatch):
    """While no request streams audio yet, the decode thread waits for the output thread only after a step whose
    outputs may complete a request's first chunk (`ServingVocoder.first_chunk_tokens` speech ids): before that the
    output thread has only host work (a new decoder, adding the ids) and the next step goes at once. Before, it waited
    after every step (on an H100 ~3.5 ms of an idle server's time to first audio, after the first step alone)."""
    _no_hold_bound(monkeypatch)
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    events, ids = [], [0]  # ("round", the request's speech ids with this round's) / ("end",) / ("step",)
    start = serving_vocoder_funaudiochat.ServingVocoder.start

    def slow_round(self, items, start_up=False):
        ids[0] += sum(len(item.speech_ids) for item in items)
        events.append(("round", ids[0]))
        time.sleep(0.2)  # a step launched meanwhile did not wait for this round
        pending = start(self, items, start_up)
        events.append(("end",))
        return pending

    monkeypatch.setattr(serving_vocoder_funaudiochat.ServingVocoder, "start", slow_round)
    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=12)
    step = engine.batch.step
    monkeypatch.setattr(engine.batch, "step", lambda generators: (events.append(("step",)), step(generators))[1])
    needed = engine._vocoder.first_chunk_tokens
    try:
        handle = engine.submit(SpeechRequest(prompts["text40"], max_new_tokens=12, seed=0))
        served = _drain(handle)
    finally:
        engine.close()
    assert served[-1].finished and handle.first_audio is not None
    rounds = []  # per round up to the first chunk's: (speech ids with it, whether a step was launched during it)
    for index, event in enumerate(events):
        if event[0] == "round":
            end = events.index(("end",), index)
            rounds.append((event[1], ("step",) in events[index:end]))
            if event[1] >= needed:
                break
    assert rounds[-1][0] >= needed and not rounds[-1][1], events  # the first chunk's round: the next step waited
    # An earlier round (the prefill's result, the first step's) let the next step go (items handed meanwhile join the
    # next round).
    assert any(stepped for _, stepped in rounds[:-1]), events
