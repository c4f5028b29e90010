"""The speech engine's threads without a model: how the output thread forms its vocoder rounds, when the decode
thread holds its next step (a round of first chunks, the lone request's vocoding, a prefill while every stream is
ahead) and how a handle's events are taken. The engine is built with only what those methods read
(`_output_loop_alone`)."""

import threading
import time

import pytest
import torch

from funaudiochat_hf.serving_engine_funaudiochat import SpeechEngine
from funaudiochat_hf.serving_requests_funaudiochat import SpeechRequest

from test_serving_engine import TIMEOUT, _take


def _handle(request_id):
    """A request's handle as the output loop reads it."""
    from types import SimpleNamespace

    return SimpleNamespace(id=request_id, request=SimpleNamespace(voice=None))


def _output_loop_alone(streaming: set, silent: frozenset = frozenset()):
    """A `SpeechEngine` with only what its output loop reads (no model, no threads); the requests in `streaming` have
    had audio out, the others wait for their first; a round of only `silent` requests decodes no audio
    (`ServingVocoder.may_decode`)."""
    import queue as queues
    from types import SimpleNamespace

    engine = SpeechEngine.__new__(SpeechEngine)
    engine._vocoder = SimpleNamespace(in_start_up=lambda request_id: request_id not in streaming,
                                     may_decode=lambda parts: any(p.request_id not in silent for p in parts),
                                     concurrent_start_up=False)  # fmt: skip
    engine._output = queues.Queue()
    engine._lock = threading.Condition()
    engine._emission = threading.Condition(engine._lock)
    engine._handed = engine._emitted = 0
    engine._closed = engine._start_up_round = engine._prefilling = False
    return engine


def test_a_round_catches_up_and_a_first_chunk_queued_during_it_goes_first():
    """The output thread takes what the decode thread queued before every round, not once per batch of rounds, and a
    round takes every queued item of a request, merged in order: when vocoding falls behind (several steps' items
    queued), one round catches up with all of them (one round per step would stay behind for good). A reply's first
    item that arrives while a round runs is vocoded next, alone, before the steady items that came with it; a
    request's items after its last (a cancellation after its end) are not merged into it."""
    from funaudiochat_hf.serving_outputs_funaudiochat import StepOutput

    engine = _output_loop_alone(streaming={"a", "b"})  # requests with audio already out

    def item(request_id, step, finish=None):
        return StepOutput(_handle(request_id), [step], [10 + step], finish, None, float(step))

    for step in range(3):  # three steps' items of two streaming requests: one round
        engine._output.put(item("a", step))
        engine._output.put(item("b", step))
    engine._output.put(item("b", 3, finish="stop"))
    engine._output.put(item("b", 4, finish="cancelled"))
    rounds = []

    def emit_round(items):
        rounds.append([(i.handle.id, i.text_ids, i.speech_ids, i.finish, i.queued) for i in items])
        if len(rounds) == 1:  # a new reply's first item comes while the first round runs, with a's next one
            engine._output.put(item("a", 3))
            engine._output.put(item("new", 0))
        if len(rounds) == 2:
            engine._output.put(None)  # closing

    engine._emit_round = emit_round
    engine._output_loop()
    assert rounds == [
        [("a", [0, 1, 2], [10, 11, 12], None, 0.0), ("b", [0, 1, 2, 3], [10, 11, 12, 13], "stop", 0.0)],
        [("new", [0], [10], None, 0.0)],
        [("b", [4], [14], "cancelled", 4.0), ("a", [3], [13], None, 3.0)],
    ], rounds


def test_decode_steps_wait_while_a_round_of_start_up_is_vocoded(monkeypatch):
    """While the output thread vocodes a round whose requests all wait for their first audio, the decode thread
    holds its next step (the chunk gets the GPU to itself, as in `generate_speech_stream`); a round with a streaming
    request holds nothing, nor does one that decodes no audio (a reply's first ids). Before, first chunks were vocoded
    while steps were launched back to back beside them."""
    from funaudiochat_hf import serving_engine_funaudiochat as engine_module
    from funaudiochat_hf.serving_outputs_funaudiochat import StepOutput

    engine = _output_loop_alone(streaming={"a"}, silent=frozenset({"quiet"}))
    held = []
    engine._emit_round = lambda items: held.append(([i.handle.id for i in items], engine._start_up_round))

    def item(request_id):
        return StepOutput(_handle(request_id), [0], [10], None, None, 0.0)

    engine._emit_round_holding_steps([item("new"), item("other")])
    engine._emit_round_holding_steps([item("a")])
    engine._emit_round_holding_steps([item("new"), item("a")])
    engine._emit_round_holding_steps([item("quiet")])  # a reply's first ids, too few for a chunk: nothing to hold for
    assert held == [(["new", "other"], True), (["a"], False), (["new", "a"], False), (["quiet"], False)]
    assert not engine._start_up_round  # cleared after the round

    # The decode side: a held step goes as soon as the round ends ...
    monkeypatch.setattr(engine_module, "FIRST_AUDIO_HOLD_SECONDS", 10.0)
    engine._start_up_round = True

    def end_round():
        time.sleep(0.03)
        with engine._lock:
            engine._start_up_round = False
            engine._lock.notify_all()

    ender = threading.Thread(target=end_round)
    start = time.perf_counter()
    ender.start()
    engine._wait_for_start_up_round()
    waited = time.perf_counter() - start
    ender.join()
    assert 0.02 <= waited < 5.0, waited
    # ... and at the latest after `FIRST_AUDIO_HOLD_SECONDS`, however long the round takes.
    monkeypatch.setattr(engine_module, "FIRST_AUDIO_HOLD_SECONDS", 0.05)
    engine._start_up_round = True
    start = time.perf_counter()
    engine._wait_for_start_up_round()
    waited = time.perf_counter() - start
    assert 0.05 <= waited < 5.0, waited
    engine._start_up_round = False  # no start-up round: no wait at all
    monkeypatch.setattr(engine_module, "FIRST_AUDIO_HOLD_SECONDS", 10.0)
    start = time.perf_counter()
    engine._wait_for_start_up_round()
    assert time.perf_counter() - start < 5.0


def test_the_wait_for_the_output_thread_ends_when_it_emitted_or_after_the_hold(monkeypatch):
    """`_wait_for_output_thread` (a lone request's step waiting for its outputs' vocoding) returns once the output
    thread has emitted everything handed to it, at the latest after `FIRST_AUDIO_HOLD_SECONDS`, and at once when the
    engine closes: a slow or stuck round never stalls the decode thread for long."""
    from funaudiochat_hf import serving_engine_funaudiochat as engine_module
    from funaudiochat_hf.serving_outputs_funaudiochat import StepOutput

    engine = _output_loop_alone(streaming=set())
    engine._emit_round = lambda items: time.sleep(0.05)  # a round of vocoding
    monkeypatch.setattr(engine_module, "FIRST_AUDIO_HOLD_SECONDS", 10.0)
    engine._hand(StepOutput(_handle("a"), [0], [10], None, None, 0.0))
    output = threading.Thread(target=engine._output_loop)
    start = time.perf_counter()
    output.start()
    engine._wait_for_output_thread()
    waited = time.perf_counter() - start
    assert engine._emitted == engine._handed == 1 and 0.04 <= waited < 5.0, waited
    engine._output.put(None)  # closing: the output loop ends
    output.join(TIMEOUT)
    assert not output.is_alive()

    engine._handed += 1  # an item the output thread never emits
    monkeypatch.setattr(engine_module, "FIRST_AUDIO_HOLD_SECONDS", 0.05)
    start = time.perf_counter()
    engine._wait_for_output_thread()
    assert 0.05 <= time.perf_counter() - start < 5.0
    engine._closed = True
    monkeypatch.setattr(engine_module, "FIRST_AUDIO_HOLD_SECONDS", 10.0)
    start = time.perf_counter()
    engine._wait_for_output_thread()
    assert time.perf_counter() - start < 5.0


def test_steps_and_rounds_wait_for_a_prefill_unless_a_request_needs_them_now(monkeypatch):
    """`_hold_for_prefill`: while a prefill runs, a decode step or vocoder round waits until it ends (at the latest
    after `PREFILL_HOLD_SECONDS`) unless one of its requests needs it now: one whose playback has caught up with its
    audio, or one waiting for its first audio; a step's row waits for it only until its first chunk's speech ids are
    out (the round then vocodes them). Nothing waits when no prefill runs."""
    from types import SimpleNamespace

    from funaudiochat_hf import serving_engine_funaudiochat as engine_module

    engine = _output_loop_alone(streaming=set())
    engine.sampling_rate = 100
    engine._vocoder.first_chunk_tokens = 9
    engine.batch = SimpleNamespace(k=5)
    monkeypatch.setattr(engine_module, "PREFILL_HOLD_SECONDS", 10.0)
    now = time.perf_counter()

    def request(first_audio_ago, audio_seconds):  # its first audio came `first_audio_ago` s ago
        first_audio = None if first_audio_ago is None else 1.0
        submitted = now - 1.0 - (first_audio_ago or 0.0)
        return SimpleNamespace(submitted=submitted, first_audio=first_audio, audio_samples=int(100 * audio_seconds))

    ahead = request(first_audio_ago=1.0, audio_seconds=1.2)  # 0.2 s ahead of its playback
    starved = request(first_audio_ago=3.0, audio_seconds=2.8)  # its playback caught up 0.2 s ago
    new = request(first_audio_ago=None, audio_seconds=0.0)
    slot = SimpleNamespace
    ahead_row, starved_row = slot(handle=ahead, groups=20), slot(handle=starved, groups=20)
    new_row, new_row_with_ids = slot(handle=new, groups=1), slot(handle=new, groups=2)  # 5, then 10 speech ids

    def waited(**step_or_round):
        start = time.perf_counter()
        engine._hold_for_prefill(**step_or_round)
        return time.perf_counter() - start

    def held(**step_or_round):  # it waits for the prefill, which ends 50 ms later
        engine._prefilling = True
        ender = threading.Timer(0.05, engine._set_prefilling, (False,))
        ender.start()
        seconds = waited(**step_or_round)
        ender.join()
        return 0.04 <= seconds < 5.0

    engine._prefilling = True
    for step_or_round in ({"handles": [ahead, starved]}, {"handles": [ahead, new]}, {"handles": []},
                          {"slots": [ahead_row, starved_row]}, {"slots": [ahead_row, new_row]}, {"slots": []}):
        assert waited(**step_or_round) < 5.0, step_or_round
    assert held(handles=[ahead]) and held(slots=[ahead_row, new_row_with_ids])
    assert not engine._prefilling and waited(handles=[ahead]) < 5.0  # no prefill: no wait
    monkeypatch.setattr(engine_module, "PREFILL_HOLD_SECONDS", 0.05)
    engine._prefilling = True
    assert 0.05 <= waited(slots=[ahead_row]) < 5.0  # a prefill that does not end: the bound


def test_the_output_thread_vocodes_a_first_chunk_round_with_the_steps_held():
    """`_output_loop` sends every round through the hold: a new reply's round holds the steps, a steady one does not."""
    from funaudiochat_hf.serving_outputs_funaudiochat import StepOutput

    engine = _output_loop_alone(streaming={"a"})
    rounds = []

    def emit_round(items):
        rounds.append(([i.handle.id for i in items], engine._start_up_round))
        if len(rounds) == 2:
            engine._output.put(None)  # closing

    engine._emit_round = emit_round
    for request_id in ("a", "new"):
        engine._output.put(StepOutput(_handle(request_id), [0], [10], None, None, 0.0))
    engine._output_loop()
    assert rounds == [(["new"], True), (["a"], False)], rounds


def test_events_taken_again_go_on_where_the_last_call_stopped():
    """A second `events()` call yields what the first left and returns once the last event was taken: before, it
    waited for events that never come (an event may hold all of a short reply)."""
    from funaudiochat_hf.serving_requests_funaudiochat import RequestHandle, SpeechEvent

    handle = RequestHandle(SpeechRequest({"input_ids": torch.zeros(1, 3, dtype=torch.long)}), None)
    handle._emit(SpeechEvent(text_ids=[1]))
    handle._emit(SpeechEvent(text_ids=[2], finished=True, finish_reason="stop"))
    assert [event.text_ids for event in _take(handle, 1)] == [[1]]
    assert [event.text_ids for event in handle.events(timeout=0.5)] == [[2]]
    assert list(handle.events(timeout=0.5)) == []


@pytest.mark.parametrize("close_during_round", [False, True], ids=["open", "closing-during-the-round"])
def test_start_up_chunks_that_come_during_a_steady_round_are_vocoded_beside_it(close_during_round):
    """Where the vocoder runs start-up chunks beside steady rounds (`concurrent_start_up`, CUDA), a new reply's first
    item that arrives while a steady round is on the GPU is vocoded and emitted before that round ends (with the
    steps held, as for any start-up round); a streaming request's item that came with it waits for the next round,
    after the running one: each request's events stay in order. Before, the first chunk waited for the whole steady
    round. The engine closing meanwhile (the decode thread's last item comes with them) changes none of that, and the
    loop ends once everything is emitted."""
    from types import SimpleNamespace

    from funaudiochat_hf.serving_outputs_funaudiochat import StepOutput, VocoderRound

    engine = _output_loop_alone(streaming={"a"})
    engine._vocoder.concurrent_start_up = True
    log = []

    def item(request_id, step):
        return StepOutput(_handle(request_id), [step], [10 + step], None, None, float(step))

    def start_round(items):
        names = [(i.handle.id, i.text_ids[0]) for i in items]
        log.append(("start", names))
        if names == [("a", 0)]:  # while this round runs, a's next item and a new reply's first come
            engine._output.put(item("a", 1))
            engine._output.put(item("new", 0))
            if close_during_round:
                engine._output.put(None)
        polls = iter(range(2000))  # the round "ends" once the new reply was emitted (or after ~2 s of polls)

        def done():
            return ("emit", [("new", 0)], True) in log or names != [("a", 0)] or next(polls, None) is None

        return VocoderRound(items, SimpleNamespace(done=done), None, 0.0)

    def finish_round(running):
        log.append(("finish", [(i.handle.id, i.text_ids[0]) for i in running.items]))
        if len([entry for entry in log if entry[0] == "finish"]) == 2 and not close_during_round:
            engine._output.put(None)  # closing

    engine._start_round = start_round
    engine._finish_round = finish_round
    engine._emit_round = lambda items: log.append(
        ("emit", [(i.handle.id, i.text_ids[0]) for i in items], engine._start_up_round))
    engine._output.put(item("a", 0))
    engine._output_loop()
    assert log == [
        ("start", [("a", 0)]),
        ("emit", [("new", 0)], True),  # beside the running round, the steps held
        ("finish", [("a", 0)]),
        ("start", [("a", 1)]),
        ("finish", [("a", 1)]),
    ], log
    assert engine._emitted == 3 and not engine._start_up_round
