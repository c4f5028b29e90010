"""`to_host`: the engine's device-to-host reads (each step's tokens, each vocoder call's audio) that do not stall the
other thread's kernel launches; the engine and the vocoder read through it, once per step and once per call."""

import threading
import time

import pytest
import torch

from funaudiochat_hf import CosyVoice3Token2Wav, serving_batch_funaudiochat, serving_vocoder_funaudiochat
from funaudiochat_hf.serving_engine_funaudiochat import SpeechEngine
from funaudiochat_hf.serving_host_copy_funaudiochat import HostCopy, to_host
from funaudiochat_hf.serving_requests_funaudiochat import SpeechRequest

from conftest import COSYVOICE3_TINY


def test_to_host_of_a_cpu_tensor_is_the_tensor():
    tensor = torch.arange(6).reshape(2, 3)
    assert to_host(tensor) is tensor


def test_the_engine_reads_each_step_and_each_vocoder_call_with_one_copy(model, inputs, monkeypatch):
    """One `HostCopy` per decode step (the step's outputs, started when it is queued), one `to_host` per prefill, one
    `HostCopy` per vocoder call that has audio: no pageable copy (`.tolist()` / `.cpu()` of a device tensor) is left
    on the engine's threads."""
    copies = {"batch": 0, "vocoder": 0, "steps": 0, "step_reads": 0}

    def counting(name):
        def copy(tensor):
            copies[name] += 1
            return to_host(tensor)

        return copy

    def counting_host_copy(name):
        class CountingHostCopy(HostCopy):
            def __init__(self, tensor):
                copies[name] += 1
                super().__init__(tensor)

        return CountingHostCopy

    step = serving_batch_funaudiochat.ServingBatch.step
    monkeypatch.setattr(serving_batch_funaudiochat.ServingBatch, "step",
                        lambda self, generators: copies.update(steps=copies["steps"] + 1) or step(self, generators))
    monkeypatch.setattr(serving_batch_funaudiochat, "HostCopy", counting_host_copy("step_reads"))
    monkeypatch.setattr(serving_batch_funaudiochat, "to_host", counting("batch"))
    monkeypatch.setattr(serving_vocoder_funaudiochat, "HostCopy", counting_host_copy("vocoder"))
    calls = []
    start = serving_vocoder_funaudiochat.ServingVocoder._start
    monkeypatch.setattr(serving_vocoder_funaudiochat.ServingVocoder, "_start",
                        lambda self, *args: calls.append(result := start(self, *args)) or result)  # fmt: skip
    text_ids = inputs["input_ids"][0][inputs["input_ids"][0] != 346][-30:][None]
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    engine = SpeechEngine(model, speech_decoder=decoder, max_batch_size=2, max_prompt_tokens=48, max_new_tokens=8)
    copies.update(batch=0, vocoder=0, steps=0, step_reads=0)  # the start-up's warm-up steps and calls
    calls.clear()
    try:
        events = list(engine.submit(SpeechRequest({"input_ids": text_ids}, max_new_tokens=8)).events(timeout=60))
    finally:
        engine.close()
    assert events[-1].finish_reason == "length"
    assert sum(len(event.audio) for event in events) > 0
    assert copies["batch"] == 1  # the prefill
    assert copies["step_reads"] == copies["steps"] >= 7  # each step queued
    assert copies["vocoder"] == len(calls) > 0


# -- GPU -------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_to_host_waits_without_stalling_another_threads_launches():
    """While one thread waits for a busy stream's copy, another thread's launches on its own stream go through (a
    pageable copy would hold them for the whole wait)."""
    busy = torch.cuda.Stream()
    side = torch.cuda.Stream()
    data = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    cycles_per_ms = 2_000_000  # well over 1 ms of sleep per unit on any recent GPU clock
    waited = {}

    def wait_for_copy():
        with torch.cuda.stream(busy):
            torch.cuda._sleep(200 * cycles_per_ms)  # ~100+ ms of GPU time
            started = time.perf_counter()
            host = to_host(data * 2)
            waited["seconds"] = time.perf_counter() - started
            waited["ok"] = bool(torch.equal(host, (data * 2).cpu()))

    thread = threading.Thread(target=wait_for_copy)
    thread.start()
    time.sleep(0.02)  # the copy is queued behind the sleep
    with torch.cuda.stream(side):
        started = time.perf_counter()
        for _ in range(50):
            torch.add(data[:16], 1)
        launching = time.perf_counter() - started
    thread.join()
    assert waited["ok"]
    assert waited["seconds"] > 0.05  # the copy did wait for the busy stream
    assert launching < waited["seconds"] / 4, (launching, waited)
