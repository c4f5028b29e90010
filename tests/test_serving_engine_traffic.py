"""Random traffic on the continuous-batching engine (tiny model, CPU): clients that arrive at random times, with random
lengths, seeds and sampling values, some cancelling before or while they are served, some turned away by a full queue
and retrying. Whatever the interleaving, every reply equals its single run, a cancelled one is a prefix of it, each
request ends exactly once, and the engine ends idle with counts that add up."""

import random
import threading
import time

import numpy as np
import pytest
import torch

from funaudiochat_hf import CosyVoice3Token2Wav
from funaudiochat_hf.generation_vocoding_funaudiochat import valid_speech_tokens
from funaudiochat_hf.serving_engine_funaudiochat import SpeechEngine
from funaudiochat_hf.serving_requests_funaudiochat import QueueFull, SpeechRequest

from conftest import COSYVOICE3_TINY
from test_modeling_cosyvoice3 import _close_wav
from test_serving_engine import TIMEOUT, _single_run, prompts  # noqa: F401  (`prompts`: the fixture)

CLIENTS = 12
MAX_NEW_TOKENS = 10


def _plan(rng: random.Random) -> list[dict]:
    """Each client's request: prompt, length, sampling values, when it arrives and when (if ever) it cancels."""
    plan = []
    for _ in range(CLIENTS):
        sampling = rng.choice([{}, {"temperature": 0.7}, {"top_p": 0.8}, {"repetition_penalty": 1.3}])
        plan.append({
            "prompt": rng.choice(["spoken", "text40", "text25"]),
            "max_new_tokens": rng.randint(1, MAX_NEW_TOKENS),
            "request": {"seed": rng.randint(0, 10**6), **sampling},
            "arrive": rng.uniform(0.0, 0.4),  # seconds after the start
            # events to take before cancelling: 0 = at once (often still queued); None = never
            "cancel_after": rng.choice([None, None, None, None, 0, 1, 2]),
        })  # fmt: skip
    return plan


def _client(engine, prompts, spec: dict, result: dict, start: float) -> None:
    time.sleep(max(0.0, start + spec["arrive"] - time.perf_counter()))
    request = SpeechRequest(prompts[spec["prompt"]], max_new_tokens=spec["max_new_tokens"], **spec["request"])
    while True:
        try:
            handle = engine.submit(request)
            break
        except QueueFull as full:
            result["rejected"] += 1
            time.sleep(min(full.retry_after, 0.02))
    if spec["cancel_after"] == 0:
        handle.cancel()
    events = []
    for event in handle.events(timeout=TIMEOUT):
        events.append(event)
        if spec["cancel_after"] is not None and len(events) == spec["cancel_after"]:
            handle.cancel()
    result["events"] = events


@pytest.mark.parametrize("seed, vocoded", [(0, False), (1, True), (2, False), (3, True)])
def test_random_traffic_keeps_every_reply_exact_and_the_engine_clean(model, prompts, seed, vocoded):  # noqa: F811
    plan = _plan(random.Random(seed))
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY) if vocoded else None
    # 3 slots, a short queue and just enough cache columns for the spoken prompt and a reply: requests wait, are
    # turned away, and the batch shifts its columns both ways to take them.
    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=3, max_queue=2, max_prompt_tokens=340,
                          max_new_tokens=MAX_NEW_TOKENS, cache_length=360)  # fmt: skip
    results = [{"rejected": 0, "events": None} for _ in plan]
    try:
        start = time.perf_counter()
        threads = [threading.Thread(target=_client, args=(engine, prompts, spec, result, start))
                   for spec, result in zip(plan, results)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=CLIENTS * TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), "a client hung"
        snapshot = engine.snapshot()
        column = engine.batch.column
        device_column = int(engine.batch.ws.llm_cache.layers[0].cumulative_length)
        slots = list(engine._slots)
    finally:
        engine.close()

    assert column == device_column
    assert not engine._text and (decoder is None or not engine._vocoder._streams)  # no request's state left behind
    assert slots == [None] * 3 and snapshot["running"] == 0 and snapshot["queued"] == 0, snapshot
    finishes = {"stop": 0, "length": 0, "cancelled": 0}
    for spec, result in zip(plan, results):
        events = result["events"]
        assert events is not None and events[-1].finished and sum(e.finished for e in events) == 1, spec
        reason = events[-1].finish_reason
        finishes[reason] += 1
        text = [t for e in events for t in e.text_ids]
        speech = [t for e in events for t in e.speech_ids]
        expected_text, expected_speech = _single_run(model, prompts[spec["prompt"]], spec["max_new_tokens"],
                                                     **spec["request"])  # fmt: skip
        if reason == "cancelled":  # what it got before it left is its single run's beginning
            assert spec["cancel_after"] is not None, spec
            assert text == expected_text[: len(text)] and speech == expected_speech[: len(speech)], spec
        else:
            assert reason in ("stop", "length") and (text, speech) == (expected_text, expected_speech), spec
        audio = np.concatenate([event.audio for event in events])
        assert np.isfinite(audio).all()
        if decoder is not None and reason != "cancelled":  # the audio its own streaming decoder makes of its ids
            alone = decoder.streaming_decoder(**engine.stream_options)
            bos = engine.batch.cfg.speech_bos_id
            expected = [alone.push(valid_speech_tokens(torch.tensor(e.speech_ids, dtype=torch.long), bos))
                        for e in events] + [alone.finalize()]  # fmt: skip
            expected = torch.cat(expected)
            assert len(audio) == len(expected), spec
            if len(expected):  # a reply of a step or two may hold no whole chunk of speech
                _close_wav(torch.from_numpy(audio), expected)
    assert snapshot["requests"]["rejected"] == sum(result["rejected"] for result in results)
    for reason, count in finishes.items():
        assert snapshot["requests"][reason] == count, (reason, snapshot)
    assert snapshot["requests"]["error"] == 0
