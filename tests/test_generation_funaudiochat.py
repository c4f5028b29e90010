"""Tests of `generate_speech` / `generate_speech_stream` (the joint text + speech decoding loop) on the tiny fixture.

Golden parity: tests/fixtures/MANIFEST.md §2e (reference `generate` with text_greedy, do_sample=False,
max_new_tokens 16, eos 322, pad 320; per-step raw text logits and the 5 raw CRQ logits of every forward call).
"""

import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf.generation_funaudiochat import FunAudioChatSpeechOutput
from funaudiochat_hf.modeling_cosyvoice3 import CosyVoice3Token2Wav, CosyVoice3Token2WavOutput

from conftest import COSYVOICE3_TINY, FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY, HostReads, force_recorded_prompt_pass


GOLDEN_KWARGS = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.0, eos_token_id=322, pad_token_id=320)
# The "compiled" backend on a CPU: torch.compile with a backend that needs no C++ compiler.
CPU_COMPILE = {"backend": "aot_eager", "fullgraph": True}
AUDIO_TOKEN, AUDIO_BOS, IM_END, PAD = 346, 347, 322, 320
SPEECH_BOS, SPEECH_PAD = 36, 38
SAMPLES_PER_TOKEN = 960  # 24 kHz / 25 Hz


def _golden(rep: str):
    data = load_file(FUNAUDIOCHAT_GOLDEN / f"e_generate_rep{rep}.safetensors")
    steps = len(data["generated_text_ids"][0])
    text_logits = torch.stack([data[f"step{i:02d}.text_logits_last"][0] for i in range(steps)])
    crq_logits = torch.stack([data[f"step{i:02d}.crq_logits_last5"][0] for i in range(steps)])
    return data, text_logits, crq_logits


def _text_prompt(inputs, length: int) -> torch.Tensor:
    """A text-only prompt (no `<|AUDIO|>`): the golden prompt without its audio, cut to its last `length` ids."""
    ids = inputs["input_ids"][0]
    ids = ids[(ids != AUDIO_TOKEN)]
    return ids[-length:][None]


# --------------------------------------------------------------------------------------------------------------------
# Parity with the reference
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_implementation", ["static", "dynamic"])
@pytest.mark.parametrize("rep", ["1.0", "1.2"])
def test_greedy_matches_reference(model, inputs, rep, cache_implementation):
    golden, text_logits, crq_logits = _golden(rep)
    out = model.generate_speech(
        **inputs,
        **dict(GOLDEN_KWARGS, repetition_penalty=float(rep)),
        output_logits=True,
        cache_implementation=cache_implementation,
    )
    assert isinstance(out, FunAudioChatSpeechOutput)
    assert torch.equal(out.sequences, golden["sequences"])
    assert torch.equal(out.speech_ids, golden["speech_ids"])
    torch.testing.assert_close(out.text_logits[0], text_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.speech_logits[0], crq_logits, atol=1e-4, rtol=1e-4)
    assert out.audio is None  # no decoder attached


def test_official_generate_arguments_pass_and_beams_raise(model, inputs):
    """A call written for the official `generate` (num_beams=1, length_penalty=1.0, ...) gives the golden greedy
    tokens; values this decoder cannot honour raise a clear error naming the argument."""
    golden = _golden("1.0")[0]
    out = model.generate_speech(**inputs, **GOLDEN_KWARGS, num_beams=1, length_penalty=1.0, early_stopping=False,
                                use_cache=True, num_return_sequences=1, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, golden["sequences"]) and torch.equal(out.speech_ids, golden["speech_ids"])
    for name, value in (("num_beams", 2), ("num_return_sequences", 2), ("penalty_alpha", 0.6), ("min_new_tokens", 4),
                        ("output_scores", True), ("bad_words_ids", [[5]])):  # fmt: skip
        with pytest.raises(ValueError, match=f"`{name}="):
            model.generate_speech(**inputs, **GOLDEN_KWARGS, **{name: value})


def test_generation_config_round_trips_and_drives_the_call(model, inputs, tmp_path):
    from transformers import GenerationConfig

    from funaudiochat_hf import FunAudioChatGenerationConfig

    defaults = FunAudioChatGenerationConfig()  # the official ones
    assert (defaults.do_sample, defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (True, 0.8, 0.9, 1.2)
    assert (defaults.max_new_tokens, defaults.text_greedy, defaults.force_text_abos) == (512, True, True)
    config = FunAudioChatGenerationConfig(**GOLDEN_KWARGS, text_greedy=False, speech_top_k=7)
    config.save_pretrained(tmp_path / "config")
    loaded = FunAudioChatGenerationConfig.from_pretrained(tmp_path / "config")
    assert loaded.to_dict() == config.to_dict()
    assert loaded.speech_top_k == 7 and loaded.text_greedy is False
    # Saved with the model, it comes back as the model's generation config and drives its calls.
    model.generation_config, saved = config, model.generation_config
    try:
        model.save_pretrained(tmp_path / "model")
    finally:
        model.generation_config = saved
    reloaded = AutoModel.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    assert reloaded.speech_generation_config().to_dict() == config.to_dict()
    golden = _golden("1.0")[0]
    by_config = model.generate_speech(**inputs, generation_config=FunAudioChatGenerationConfig(**GOLDEN_KWARGS))
    assert torch.equal(by_config.sequences, golden["sequences"])
    # A plain GenerationConfig counts over the official defaults; keyword arguments update it.
    plain = model.generate_speech(**inputs, generation_config=GenerationConfig(**GOLDEN_KWARGS), max_new_tokens=4)
    assert torch.equal(plain.sequences, golden["sequences"][:, : inputs["input_ids"].shape[1] + 4])


def test_compiled_step_matches_eager(model, inputs):
    """fullgraph=True fails on any graph break, so this also proves each part of the decode step is one graph."""
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True)
    eager = model.generate_speech(**inputs, **kwargs, backend="eager")
    compiled = model.generate_speech(**inputs, **kwargs, backend="compiled", compile_config=CPU_COMPILE)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.speech_ids, eager.speech_ids)
    torch.testing.assert_close(compiled.speech_logits, eager.speech_logits, atol=1e-5, rtol=1e-5)


def test_speech_to_text_mode_matches_generate(model, inputs):
    text_only = model.generate_speech(**inputs, **GOLDEN_KWARGS, disable_speech=True, force_text_abos=False)
    reference = model.generate(**inputs, **GOLDEN_KWARGS)
    assert text_only.speech_ids.shape == (1, 0)
    assert torch.equal(text_only.sequences, reference)


# --------------------------------------------------------------------------------------------------------------------
# Batching, state isolation, sampling
# --------------------------------------------------------------------------------------------------------------------


def _left_padded_batch(inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Two rows: the spoken fixture prompt and a 40-token text prompt left-padded to its length; returns the batch's
    ids and mask, the short prompt, and the audio inputs."""
    long_ids = inputs["input_ids"]
    short_ids = _text_prompt(inputs, 40)
    batch_ids = torch.full((2, long_ids.shape[1]), PAD)
    batch_ids[0] = long_ids[0]
    batch_ids[1, -short_ids.shape[1] :] = short_ids[0]
    mask = torch.ones_like(batch_ids)
    mask[1, : -short_ids.shape[1]] = 0
    audio = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return batch_ids, mask, short_ids, audio


def test_left_padded_batch_rows_equal_single_runs(model, inputs):
    long_ids = inputs["input_ids"]
    batch_ids, mask, short_ids, audio = _left_padded_batch(inputs)
    # eos 152 stops the audio row early (its 3rd token), so per-row stopping and padding are exercised too.
    kwargs = dict(GOLDEN_KWARGS, eos_token_id=[IM_END, 152], repetition_penalty=1.2, output_logits=True)

    batch = model.generate_speech(batch_ids, mask, **audio, **kwargs)
    single_long = model.generate_speech(long_ids, **audio, **kwargs)
    single_short = model.generate_speech(short_ids, **kwargs)

    for row, (single, prompt_len) in enumerate([(single_long, long_ids.shape[1]), (single_short, 40)]):
        new = single.sequences[0, prompt_len:]
        assert torch.equal(batch.sequences[row, long_ids.shape[1] : long_ids.shape[1] + len(new)], new)
        assert (batch.sequences[row, long_ids.shape[1] + len(new) :] == PAD).all()
        groups = single.speech_ids.shape[1]
        assert torch.equal(batch.speech_ids[row, :groups], single.speech_ids[0])
        assert (batch.speech_ids[row, groups:] == SPEECH_PAD).all()
        torch.testing.assert_close(batch.text_logits[row, : len(new)], single.text_logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(batch.speech_logits[row, : len(new)], single.speech_logits[0], atol=1e-4, rtol=1e-4)
    assert single_long.sequences.shape[1] == long_ids.shape[1] + 3  # stopped on the eos 152 ...
    assert single_long.sequences[0, -1] == 152
    # ... and the batch runs until its last row stops.
    assert single_short.sequences.shape[1] - 40 > 3
    assert batch.sequences.shape[1] == long_ids.shape[1] + single_short.sequences.shape[1] - 40


def test_consecutive_calls_and_threads_do_not_interfere(model, inputs):
    """Calls from two threads at once: the second finds the default generator busy and decodes with a temporary one
    (checked below with a generator held by the test), with the same results as alone."""
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2)
    first = model.generate_speech(**inputs, **kwargs)
    other = model.generate_speech(_text_prompt(inputs, 30), **kwargs)  # different size in between
    second = model.generate_speech(**inputs, **kwargs)
    assert torch.equal(first.sequences, second.sequences) and torch.equal(first.speech_ids, second.speech_ids)

    results = {}

    def run(name, prompt_inputs):
        results[name] = model.generate_speech(**prompt_inputs, **kwargs)

    threads = [
        threading.Thread(target=run, args=("audio", inputs)),
        threading.Thread(target=run, args=("text", {"input_ids": _text_prompt(inputs, 30)})),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.equal(results["audio"].speech_ids, first.speech_ids)
    assert torch.equal(results["text"].sequences, other.sequences)
    model.clear_speech_caches()  # freed buffers are rebuilt on demand
    assert torch.equal(model.generate_speech(**inputs, **kwargs).speech_ids, first.speech_ids)
    default = model.default_speech_generator
    assert default.acquire(blocking=False)  # as if another thread were decoding with it
    try:
        busy = model.generate_speech(**inputs, **kwargs, cache_implementation="static")
    finally:
        default.release()
    assert torch.equal(busy.speech_ids, first.speech_ids)
    assert default.memory_bytes() == 0  # the call did not touch it


def test_seeded_sampling_is_reproducible(model, inputs):
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2)
    first = model.generate_speech(**inputs, **kwargs, seed=1234)
    again = model.generate_speech(**inputs, **kwargs, seed=1234)
    other = model.generate_speech(**inputs, **kwargs, seed=4321)
    assert torch.equal(first.speech_ids, again.speech_ids) and torch.equal(first.sequences, again.sequences)
    assert not torch.equal(first.speech_ids, other.speech_ids)
    # The global seed drives the run when no seed/generator is given.
    torch.manual_seed(7)
    global_a = model.generate_speech(**inputs, **kwargs)
    torch.manual_seed(7)
    global_b = model.generate_speech(**inputs, **kwargs)
    assert torch.equal(global_a.speech_ids, global_b.speech_ids)
    # Text is greedy by default (text_greedy=True): sampling only changes speech, and so only its feedback.
    greedy_text = model.generate_speech(**inputs, **kwargs, text_do_sample=False, seed=1234)
    assert torch.equal(greedy_text.speech_ids, first.speech_ids)


def test_text_sampling_overrides(model, inputs):
    out = model.generate_speech(
        **inputs, max_new_tokens=6, text_greedy=False, text_temperature=1.5, speech_do_sample=False, seed=0
    )
    greedy = model.generate_speech(**inputs, max_new_tokens=6, do_sample=False)
    assert out.sequences.shape == greedy.sequences.shape
    assert out.sequences[0, inputs["input_ids"].shape[1]] == AUDIO_BOS  # still forced


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


def test_cache_overflow_raises(model, inputs):
    length = inputs["input_ids"].shape[1]
    with model.speech_generator(max_length=length + 15) as generator:
        with pytest.raises(ValueError, match="max_length"):
            generator.generate(**inputs, max_new_tokens=16, cache_implementation="static")
    with model.speech_generator(max_length=length + 16) as generator:
        out = generator.generate(**inputs, **GOLDEN_KWARGS, cache_implementation="static")
        assert generator._workspaces and all(key[1] == length + 16 for key in generator._workspaces)
    assert torch.equal(out.sequences, _golden("1.0")[0]["sequences"])


def test_max_new_tokens_is_bounded_by_the_context(model, inputs):
    """Issue #50 (4): a cap beyond the model's context is a clear error naming both numbers, not an allocator
    error; a cap that fits sizes the static caches by prompt + cap (rounded), never beyond."""
    length = inputs["input_ids"].shape[1]
    context = model.config.text_config.max_position_embeddings
    with pytest.raises(ValueError, match=f"holds {context} positions and the prompt takes {length}"):
        model.generate_speech(**inputs, max_new_tokens=context - length + 1)
    with pytest.raises(ValueError, match="does not fit"):
        model.generate_speech(**inputs, max_new_tokens=10**9)
    with model.speech_generator(backend="eager") as generator:
        out = generator.generate(**inputs, **dict(GOLDEN_KWARGS, max_new_tokens=20), cache_implementation="static")
        ((batch, cache_length, *_),) = generator._workspaces
    assert cache_length == -(-(length + 20) // 128) * 128 and out.sequences.shape[1] <= length + 20


def test_finished_rows_are_noticed_one_launched_step_late(monkeypatch):
    """The loop reads each "all rows finished" check only after launching the next step (`LaggedCheck`), so the GPU
    always has a step queued while the host waits for the check; one step runs after the last row finishes, and
    never more than `max_new_tokens` in all."""
    from funaudiochat_hf import generation_loop_funaudiochat as generation

    log = []
    read = generation.LaggedCheck.read

    def logged_read(check):
        log.append(("read", check.step))
        return read(check)

    monkeypatch.setattr(generation.LaggedCheck, "read", logged_read)

    def run_until(finish_step, max_new_tokens=40):
        log.clear()
        run = SimpleNamespace(ws=SimpleNamespace(done=torch.zeros(2, dtype=torch.bool)), steps=1,
                              max_new_tokens=max_new_tokens)  # fmt: skip

        def decode():
            log.append(("decode", run.steps))
            run.steps += 1
            run.ws.done[0] = True  # one row finishes at once, the other at `finish_step`
            run.ws.done[1] = run.steps >= finish_step

        run.decode = decode
        generation.SpeechRun.decode_until_done(run)
        return run.steps

    assert run_until(finish_step=5) == 6  # noticed after the step launched next
    assert log[:4] == [("decode", 1), ("read", 1), ("decode", 2), ("read", 2)]  # each check after the next launch
    assert log[-2:] == [("decode", 5), ("read", 5)]
    assert run_until(finish_step=99, max_new_tokens=7) == 7  # the budget ends the loop


def test_bad_inputs_raise(model, inputs):
    ids = _text_prompt(inputs, 10)
    right_padded = torch.ones(1, 10, dtype=torch.long)
    right_padded[0, -2:] = 0
    with pytest.raises(ValueError, match="left"):
        model.generate_speech(ids, right_padded, max_new_tokens=2)
    with pytest.raises(ValueError, match="Unknown"):
        model.generate_speech(ids, max_new_tokens=2, temprature=0.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_speech(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate_speech(ids, max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="speech decoder"):
        model.generate_speech(ids, max_new_tokens=2, return_audio=True)
    with pytest.raises(ValueError, match="batch size 1"):
        next(model.generate_speech_stream(torch.cat([ids, ids]), max_new_tokens=2))
    with pytest.raises(ValueError, match="backend"):
        model.generate_speech(ids, max_new_tokens=2, backend="flashy")
    with pytest.raises(ValueError, match="CUDA"):
        model.generate_speech(ids, max_new_tokens=2, backend="cuda_graphs")
    with pytest.raises(ValueError, match="Unknown"):  # the backend knobs are gone from the call
        model.generate_speech(ids, max_new_tokens=2, compile=True)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(eos_token_id="<|im_end|>"), TypeError, "eos_token_id"),
        (dict(eos_token_id=10**6), ValueError, "eos_token_id"),
        (dict(eos_token_id=[322, -1]), ValueError, "eos_token_id"),
        (dict(pad_token_id=10**6), ValueError, "pad_token_id"),
        (dict(pad_token_id=1.5), TypeError, "pad_token_id"),
        (dict(seed="42"), TypeError, "seed"),
        (dict(seed=True), TypeError, "seed"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
        (dict(max_new_tokens=-3), ValueError, r"`max_new_tokens` must be at least 1, got -3"),
        (dict(top_k=5.5), TypeError, "top_k"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(temperature="hot"), TypeError, "temperature"),
        (dict(repetition_penalty=float("inf")), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), ValueError, "repetition_penalty"),
        (dict(speech_temperature=0.0), ValueError, "temperature"),
        (dict(do_sample="yes"), TypeError, "do_sample"),
        (dict(text_greedy=1), TypeError, "text_greedy"),
        (dict(cache_implementation="offloaded"), ValueError, "cache_implementation"),
        (dict(generator=42), TypeError, "generator"),
        (dict(seed=3, generator=torch.Generator()), ValueError, "`seed` or `generator`, not both"),
        (dict(generation_config={"max_new_tokens": 2}), TypeError, "generation_config"),
        (dict(return_audio="yes"), TypeError, "return_audio"),
    ],
)
def test_bad_arguments_raise_one_clear_error(model, inputs, kwargs, error, match):
    """Issue #50 (7): each bad argument gets one TypeError / ValueError naming it, before any decoding."""
    ids = _text_prompt(inputs, 10)
    with pytest.raises(error, match=match):
        model.generate_speech(ids, **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize(
    "ids, error",
    [
        (torch.ones(1, 5), TypeError),  # float ids
        (torch.ones(1, 5, dtype=torch.bool), TypeError),
        (torch.ones(5, dtype=torch.long), ValueError),  # 1-D
        (torch.ones(1, 0, dtype=torch.long), ValueError),  # empty
        (torch.full((1, 5), 10**6), ValueError),  # outside the vocabulary
        ([[1, 2, 3]], TypeError),
    ],
)
def test_bad_input_ids_raise(model, ids, error):
    with pytest.raises(error, match="input_ids"):
        model.generate_speech(ids, max_new_tokens=2)


def test_out_of_range_pad_is_refused_before_a_row_finishes_early(model, inputs):
    """Issue #50 (7): a pad id outside the vocabulary used to end in an IndexError once a batch row finished early
    (the pad token is embedded as that row's next input); it is refused up front now, and a valid one pads."""
    batch_ids, mask, _, audio = _left_padded_batch(inputs)
    kwargs = dict(GOLDEN_KWARGS, eos_token_id=[IM_END, 152])  # the audio row stops early
    with pytest.raises(ValueError, match="pad_token_id"):
        model.generate_speech(batch_ids, mask, **audio, **dict(kwargs, pad_token_id=5000))
    out = model.generate_speech(batch_ids, mask, **audio, **dict(kwargs, pad_token_id=7))
    assert (out.sequences[0, -2:] == 7).all()


# --------------------------------------------------------------------------------------------------------------------
# Audio: offline and streaming, with a stub decoder that has the CosyVoice3Token2Wav interface
# --------------------------------------------------------------------------------------------------------------------


class StubDecoder(torch.nn.Module):
    """`forward(tokens (1, T)) -> (1, 960 T)`; its streaming decoder emits `token_hop_len` tokens of audio once
    `token_hop_len + pre_lookahead_len` new tokens are buffered, like the CosyVoice3 chunk loop."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(sampling_rate=24000)
        self.calls = []

    def forward(
        self, speech_tokens, speaker=None, speaker_embedding=None, speech_token_lengths=None, segment_tokens=None
    ):
        # Its audio is the same whole or in segments: `segment_tokens` is only recorded.
        self.calls.append((speech_tokens.clone(), speaker, speech_token_lengths, segment_tokens))
        if speech_token_lengths is None:
            speech_token_lengths = torch.full((len(speech_tokens),), speech_tokens.shape[1])
        # Same output type as CosyVoice3Token2Wav: zero-padded (batch, samples) waveform + valid lengths.
        waveform = torch.nn.functional.pad(speech_tokens.float().repeat_interleave(SAMPLES_PER_TOKEN, dim=-1), (0, 7))
        return CosyVoice3Token2WavOutput(waveform=waveform, waveform_lengths=SAMPLES_PER_TOKEN * speech_token_lengths)

    def streaming_decoder(
        self, speaker=None, speaker_embedding=None, token_hop_len=15, pre_lookahead_len=3, first_token_hop_len=None
    ):
        decoder = self

        class Stream:
            def __init__(self):
                self.tokens, self.offset = torch.zeros(0, dtype=torch.long), 0

            def push(self, tokens):
                self.tokens = torch.cat([self.tokens, tokens])
                pieces = []
                while len(self.tokens) >= self.offset + self.hop() + pre_lookahead_len:
                    hop = self.hop()
                    chunk = self.tokens[None, self.offset : self.offset + hop]
                    pieces.append(decoder(chunk).waveform[0, :-7])
                    self.offset += hop
                return torch.cat(pieces) if pieces else torch.zeros(0)

            def hop(self):
                return first_token_hop_len if self.offset == 0 and first_token_hop_len else token_hop_len

            def finalize(self):
                rest = self.tokens[self.offset :]
                self.offset = len(self.tokens)
                return decoder(rest[None]).waveform[0, :-7] if len(rest) else torch.zeros(0)

        return Stream()


@pytest.mark.parametrize("streaming", [False, True])
def test_decoder_device_defaults_apply_before_the_call_allocates(model, inputs, monkeypatch, streaming):
    """The decoder's one-time device settings (a bfloat16 estimator on CUDA, releasing the float32 weights) run before
    the call builds its decoding workspace, so that both copies of the estimator never coexist with the caches."""
    events = []
    decoder = StubDecoder()
    decoder.apply_device_defaults = lambda: events.append("decoder defaults")
    generator = model.speech_generator()
    workspace = generator.workspace
    monkeypatch.setattr(generator, "workspace", lambda *args, **kw: events.append("workspace") or workspace(*args, **kw))
    kwargs = dict(GOLDEN_KWARGS, speech_decoder=decoder, speech_generator=generator)
    if streaming:
        list(model.generate_speech_stream(**inputs, **kwargs))
    else:
        model.generate_speech(**inputs, **kwargs)
    assert events[:2] == ["decoder defaults", "workspace"]
    generator.close()


def test_offline_audio_with_decoder(model, inputs):
    decoder = StubDecoder()
    out = model.generate_speech(**inputs, **GOLDEN_KWARGS, speech_decoder=decoder, speaker="中文女")
    golden = _golden("1.0")[0]["speech_ids"][0]
    valid = golden[(golden >= 0) & (golden < SPEECH_BOS)]
    assert out.sampling_rate == 24000
    assert len(out.audio) == 1 and out.audio[0].ndim == 1
    torch.testing.assert_close(out.audio[0], valid.float().repeat_interleave(SAMPLES_PER_TOKEN))
    assert decoder.calls[0][1] == "中文女"
    assert model.generate_speech(**inputs, **GOLDEN_KWARGS, speech_decoder=decoder, return_audio=False).audio is None


def test_stream_matches_offline_and_arrives_in_chunks(model, inputs):
    decoder = StubDecoder()
    offline = model.generate_speech(**inputs, **GOLDEN_KWARGS, speech_decoder=decoder)

    class ToyTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i >= 320))

    events = list(
        model.generate_speech_stream(**inputs, **GOLDEN_KWARGS, speech_decoder=decoder, tokenizer=ToyTokenizer())
    )
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    prompt_len = inputs["input_ids"].shape[1]
    assert torch.equal(torch.cat([e.text_ids for e in events]), offline.sequences[0, prompt_len:])
    assert torch.equal(torch.cat([e.speech_ids for e in events]), offline.speech_ids[0])
    audio = torch.cat([e.audio for e in events])
    assert len(audio) == SAMPLES_PER_TOKEN * int(((offline.speech_ids >= 0) & (offline.speech_ids < SPEECH_BOS)).sum())
    torch.testing.assert_close(audio, offline.audio[0])
    chunks = [i for i, e in enumerate(events) if len(e.audio)]
    assert len(chunks) >= 3
    assert chunks[0] <= 3  # first audio after a few LLM steps (a first chunk of 6 + 3 tokens), not at the end
    reference_chunking = list(
        model.generate_speech_stream(**inputs, **GOLDEN_KWARGS, speech_decoder=decoder, first_token_hop_len=None)
    )
    first_of_15 = next(i for i, e in enumerate(reference_chunking) if len(e.audio))
    assert chunks[0] < first_of_15 <= 6  # a first chunk of 15 + 3 tokens needs 2 more steps
    torch.testing.assert_close(torch.cat([e.audio for e in reference_chunking]), audio)
    assert "".join(e.text for e in events) == ToyTokenizer().decode(offline.sequences[0, prompt_len:].tolist())


def test_transformers_streamer_receives_prompt_and_tokens(model, inputs):
    class Recorder:
        def __init__(self):
            self.values, self.ended = [], False

        def put(self, value):
            self.values.append(value.clone())

        def end(self):
            self.ended = True

    recorder = Recorder()
    out = model.generate_speech(**inputs, **GOLDEN_KWARGS, streamer=recorder)
    assert recorder.ended
    assert torch.equal(recorder.values[0], inputs["input_ids"])
    streamed = torch.cat([v.reshape(-1) for v in recorder.values[1:]])
    assert torch.equal(streamed, out.sequences[0, inputs["input_ids"].shape[1] :])


def test_two_turn_prompt(model, inputs):
    """A second user turn after an earlier spoken answer (earlier assistant turn as text), built by hand."""
    first = model.generate_speech(**inputs, **GOLDEN_KWARGS)
    follow_up = _text_prompt(inputs, 12)  # "...<|im_end|>\n<|im_start|>user ...<|im_start|>assistant\n"
    two_turn = torch.cat([first.sequences, torch.tensor([[IM_END, 198]]), follow_up], dim=1)
    audio = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    static = model.generate_speech(two_turn, **audio, **GOLDEN_KWARGS)
    dynamic = model.generate_speech(two_turn, **audio, **GOLDEN_KWARGS, cache_implementation="dynamic")
    assert static.sequences[0, two_turn.shape[1]] == AUDIO_BOS
    assert torch.equal(static.sequences, dynamic.sequences) and torch.equal(static.speech_ids, dynamic.speech_ids)


def test_compiled_loop_survives_many_distinct_sampling_settings(model, inputs):
    # Regression: every structural sampling switch combination (sampling on/off, top-k / top-p / repetition penalty
    # on/off) is its own graph, and with fullgraph=True dynamo's default limit of 8 graphs per function made the 9th
    # distinct combination of a long-running process a hard error. (Values alone reuse one graph: see below.)
    ids = _text_prompt(inputs, 12)
    combos = [(True, k, p, r) for k in (0, 5) for p in (1.0, 0.9) for r in (1.0, 1.2)]
    combos += [(False, 0, 1.0, r) for r in (1.0, 1.2)]  # 10 distinct graphs
    compile_options = {"backend": "eager", "fullgraph": True, "dynamic": False}
    limit = torch._dynamo.config.recompile_limit
    for do_sample, top_k, top_p, penalty in combos:
        out = model.generate_speech(
            ids, max_new_tokens=2, do_sample=do_sample, top_k=top_k, top_p=top_p, repetition_penalty=penalty, seed=0,
            backend="compiled", compile_config=compile_options,
        )
        assert out.sequences.shape == (1, 14)
    assert torch._dynamo.config.recompile_limit == limit  # raised around the compiled calls only


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_graphs", "compiled"])
def test_cuda_graph_step_matches_eager_on_gpu(inputs, backend):
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    kwargs = dict(GOLDEN_KWARGS)  # rep 1.0: the widest greedy margins (MANIFEST §2e)
    eager = model.generate_speech(**inputs, **kwargs, backend="eager")
    assert torch.equal(eager.sequences.cpu(), _golden("1.0")[0]["sequences"])
    for _ in range(3):  # the second call records the step's CUDA graph, the third replays it
        graphed = model.generate_speech(**inputs, **kwargs, backend=backend)
        assert torch.equal(graphed.sequences, eager.sequences)
        assert torch.equal(graphed.speech_ids, eager.speech_ids)
    sampled = [
        model.generate_speech(**inputs, max_new_tokens=16, seed=3, backend=b).speech_ids for b in ("eager", backend)
    ]
    assert torch.equal(sampled[0], sampled[1])


@pytest.mark.gpu
def test_text_only_reply_at_the_defaults_on_gpu(inputs):
    """`disable_speech=True` at the defaults (CUDA graphs, no finish kernel for a text-only step) gives the eager
    loop's text; its step's capture failed on a host read before (`masked_fill_` with a tensor value)."""
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    kwargs = dict(GOLDEN_KWARGS, disable_speech=True, force_text_abos=False)
    eager = model.generate_speech(**inputs, **kwargs, backend="eager")
    for _ in range(3):  # the second call records the step's CUDA graph, the third replays it
        assert torch.equal(model.generate_speech(**inputs, **kwargs).sequences, eager.sequences)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["eager", "cuda_graphs"])
def test_speech_generator_frees_its_memory_on_close_on_gpu(inputs, backend):
    """The generator's caches, weight copies and CUDA graphs are all it keeps: after `close()` the allocated memory
    is back to its level before the call. The process's own state, made once, is not the generator's: the cuBLAS
    workspaces of each stream that runs a GEMM (the default one, the capture stream of `cuda_graph_capture`), made by
    a first generator's calls. (Each capture on a new stream left new workspaces behind: 69 MB a generator, H100.)"""
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    with model.speech_generator(backend=backend) as first:
        for _ in range(2):  # the second call records the graphs
            first.generate(**inputs, **GOLDEN_KWARGS, cache_implementation="static")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    generator = model.speech_generator(backend=backend)
    for _ in range(3):
        generator.generate(**inputs, **GOLDEN_KWARGS, cache_implementation="static")
    assert generator.memory_bytes() > 0
    assert torch.cuda.memory_allocated() > before
    generator.close()
    assert generator.memory_bytes() == 0
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_graphs", "compiled"])
def test_cuda_graph_batch_matches_eager_batch_on_gpu(inputs, backend):
    """A left-padded batch through a fast backend on CUDA (cuBLAS projections, the Triton attention with the q/k
    norms, rotary and cache write in its kernels) gives the eager batch's tokens."""
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    batch_ids, mask, _, audio = _left_padded_batch(inputs)
    batch = {"input_ids": batch_ids.cuda(), "attention_mask": mask.cuda(), **{k: v.cuda() for k, v in audio.items()}}
    kwargs = dict(GOLDEN_KWARGS, output_logits=True)  # rep 1.0: the widest greedy margins (MANIFEST §2e)
    eager = model.generate_speech(**batch, **kwargs, backend="eager")
    for _ in range(3):  # the second call records the CUDA graphs, the third replays them
        graphed = model.generate_speech(**batch, **kwargs, backend=backend)
        torch.testing.assert_close(graphed.text_logits, eager.text_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(graphed.speech_logits, eager.speech_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(graphed.sequences, eager.sequences)
        assert torch.equal(graphed.speech_ids, eager.speech_ids)


def test_real_cosyvoice3_decoder_offline_and_streaming(model, inputs):
    """With the tiny random CosyVoice3: offline audio has 960 samples per codec token and the stream arrives in
    several chunks whose concatenation has the same length."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    offline = model.generate_speech(**inputs, **GOLDEN_KWARGS, speech_decoder=decoder)
    valid = int(((offline.speech_ids >= 0) & (offline.speech_ids < SPEECH_BOS)).sum())
    assert offline.sampling_rate == 24000
    assert offline.audio[0].shape == (SAMPLES_PER_TOKEN * valid,) and offline.audio[0].abs().max() > 0
    events = list(model.generate_speech_stream(**inputs, **GOLDEN_KWARGS, speech_decoder=decoder))
    audio = torch.cat([e.audio for e in events])
    assert audio.shape == offline.audio[0].shape
    assert sum(len(e.audio) > 0 for e in events) >= 3


def test_stream_options_reach_the_streaming_decoder(model, inputs):
    """generate_speech_stream(stream_options=...) configures the decoder's streaming object (window sizes etc.)."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    made = []
    original = decoder.streaming_decoder

    def recording_streaming_decoder(**kwargs):
        made.append(original(**kwargs))
        return made[-1]

    decoder.streaming_decoder = recording_streaming_decoder
    options = {"flow_left_context_tokens": 10, "hift_left_context_frames": 16, "token_max_hop_len": 40}
    stream_kwargs = dict(GOLDEN_KWARGS, speech_decoder=decoder, stream_options=options)
    events = list(model.generate_speech_stream(**inputs, **stream_kwargs))
    (stream,) = made
    assert stream.flow_left_context == 10 and stream.hift_left_context == 16
    assert stream.hop_schedule == (6, 15, 30, 40)  # first_token_hop_len, token_hop_len, then growth
    assert sum(len(e.audio) for e in events) > 0
    with pytest.raises(TypeError, match="no_such_option"):
        list(model.generate_speech_stream(**inputs, **GOLDEN_KWARGS, speech_decoder=decoder,
                                          stream_options={"no_such_option": 1}))


def test_offline_audio_of_a_batch_is_one_decoder_call_with_30s_segments():
    """One decoder call for the whole batch: the rows' codec tokens right-padded, the decoder cutting them into 30-s
    segments (750 tokens, its `segment_tokens`)."""
    from funaudiochat_hf.generation_funaudiochat import decode_speech_offline

    decoder = StubDecoder()
    rows = torch.full((2, 1700), SPEECH_PAD)
    rows[0, :1600] = torch.arange(1600) % SPEECH_BOS  # 750 + 750 + 100 tokens
    rows[1, :5] = SPEECH_BOS  # delay tokens only: no audio
    rows[1, 5:45] = 7
    audio = decode_speech_offline(decoder, rows, SPEECH_BOS, speaker="x")
    ((tokens, speaker, lengths, segment_tokens),) = decoder.calls
    assert lengths.tolist() == [1600, 40] and tokens.shape == (2, 1600) and (speaker, segment_tokens) == ("x", 750)
    assert torch.equal(tokens[1, :40], torch.full((40,), 7))
    expected = (torch.arange(1600) % SPEECH_BOS).float().repeat_interleave(SAMPLES_PER_TOKEN)
    torch.testing.assert_close(audio[0], expected)
    torch.testing.assert_close(audio[1], torch.full((40 * SAMPLES_PER_TOKEN,), 7.0))
    assert [a.numel() for a in decode_speech_offline(decoder, torch.full((1, 10), SPEECH_BOS), SPEECH_BOS)] == [0]


@pytest.fixture(scope="module")
def tiny_decoder():
    """The tiny random CosyVoice3 with its two stored voices, "中文女" and "中文男"."""
    return CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()


def _speech_rows(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Raw speech streams `(rows, 5 + max length + 2)` like `generate_speech`'s: 5 delay tokens, `lengths[i]` random
    codec ids, then padding; and each row's codec ids."""
    generator = torch.Generator().manual_seed(seed)
    codes = [torch.randint(0, SPEECH_BOS, (n,), generator=generator) for n in lengths]
    rows = torch.full((len(lengths), 5 + max(lengths) + 2), SPEECH_PAD)
    rows[:, :5] = SPEECH_BOS
    for row, row_codes in zip(rows, codes):
        row[5 : 5 + len(row_codes)] = row_codes
    return rows, codes


def _relative_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def _assert_same_voice(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Audio of a batched decoder call vs the same tokens decoded alone: the batched matmuls round the mel differently
    (~1e-6) and the tiny random HiFT amplifies that (see test_modeling_cosyvoice3's batch test), here to <= 1.3e-2 at a
    few samples and a relative RMS error <= 2.5e-3; the other stored voice is ~1.0 off by both measures."""
    assert actual.shape == expected.shape
    assert _relative_rms_error(actual, expected) <= 1e-2
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=0)


def test_offline_audio_voices_every_segment_with_its_rows_speaker(tiny_decoder):
    """Per-row speakers with rows of 2 segments and of no speech: every row sounds as decoded alone with its own voice,
    segment by segment (the batch used to be flattened into segments with the speakers unchanged: with these rows,
    row 0's second segment was voiced by row 1's speaker)."""
    from funaudiochat_hf.generation_vocoding_funaudiochat import decode_speech_offline

    rows, codes = _speech_rows([760, 0, 40])  # 760 tokens: segments of 380 + 380 (a short last one is merged, halved)
    assert CosyVoice3Token2Wav.segment_bounds(760) == [(0, 380), (380, 760)]
    speakers = ["中文女", "中文男", "中文男"]
    audio = decode_speech_offline(tiny_decoder, rows, SPEECH_BOS, speaker=speakers)
    assert [a.shape[0] for a in audio] == [SAMPLES_PER_TOKEN * n for n in (760, 0, 40)]

    def alone(tokens, speaker):
        return tiny_decoder(tokens[None], speaker=speaker).waveform[0]

    expected = torch.cat([alone(codes[0][:380], "中文女"), alone(codes[0][380:], "中文女")])
    _assert_same_voice(audio[0], expected)
    _assert_same_voice(audio[2], alone(codes[2], "中文男"))
    assert _relative_rms_error(alone(codes[2], "中文女"), audio[2]) > 0.5  # the other voice is far off (~1)


def test_offline_audio_takes_one_x_vector_per_row(tiny_decoder):
    """x-vectors `(batch, 192)` (a tensor or a numpy array) are one per row too, a row without speech included; one
    `(192,)` x-vector voices every row."""
    from funaudiochat_hf.generation_vocoding_funaudiochat import decode_speech_offline

    rows, codes = _speech_rows([20, 0, 30], seed=1)
    voices = tiny_decoder.speaker_embeddings  # ("中文女", "中文男")
    names = ["中文男", "中文女", "中文女"]
    by_name = decode_speech_offline(tiny_decoder, rows, SPEECH_BOS, speaker=names)
    for speaker in (voices[[1, 0, 0]], voices[[1, 0, 0]].numpy()):
        by_vector = decode_speech_offline(tiny_decoder, rows, SPEECH_BOS, speaker=speaker)
        for row in range(3):
            torch.testing.assert_close(by_vector[row], by_name[row], atol=0, rtol=0)
    _assert_same_voice(by_name[0], tiny_decoder(codes[0][None], speaker="中文男").waveform[0])
    shared = decode_speech_offline(tiny_decoder, rows, SPEECH_BOS, speaker=voices[0])
    torch.testing.assert_close(shared[2], by_name[2], atol=0, rtol=0)
    assert _relative_rms_error(shared[0], by_name[0]) > 0.5


@pytest.mark.parametrize(
    "speaker, error, match",
    [
        ("typo", ValueError, r"`speaker`: Unknown speaker\(s\) \['typo'\]"),
        (["中文女", "中文男"], ValueError, "`speaker` has 2 names for a batch of 1 rows"),
        (torch.zeros(100), ValueError, r"`speaker`: speaker_embedding must have shape \(192,\)"),
        (torch.zeros(3, 192), ValueError, "`speaker`: Got 3 speaker embeddings for a batch of 1"),
        (torch.zeros(192, dtype=torch.long), TypeError, "`speaker`: speaker_embedding must be a floating-point"),
        (7, ValueError, "`speaker` must be a stored speaker's name"),
    ],
)
@pytest.mark.parametrize("streaming", [False, True])
def test_a_bad_speaker_raises_before_anything_is_decoded(model, inputs, tiny_decoder, monkeypatch, speaker, error,
                                                         match, streaming):  # fmt: skip
    """The speaker is looked up in the decoder when the call starts, not when it vocodes after the whole decode."""
    from funaudiochat_hf import generation_funaudiochat

    runs = []
    monkeypatch.setattr(generation_funaudiochat, "SpeechRun", lambda *args, **kw: runs.append(args))
    kwargs = dict(GOLDEN_KWARGS, speech_decoder=tiny_decoder, speaker=speaker)
    with pytest.raises(error, match=match):
        if streaming:
            next(model.generate_speech_stream(**inputs, **kwargs))
        else:
            model.generate_speech(**inputs, **kwargs)
    assert runs == []  # no run was made: nothing allocated, no step decoded
    assert model.default_speech_generator.acquire(blocking=False)  # and the generator was not left held
    model.default_speech_generator.release()


def test_speaker_check_passes_good_speakers_and_skips_unused_ones(model, inputs, tiny_decoder, monkeypatch):
    """A list of one name per row (or one for all) and an x-vector pass the check; a speaker no one voices (no audio
    asked for, or no speech decoded) is not looked up."""
    from funaudiochat_hf import generation_funaudiochat

    class Checked(Exception):
        pass

    def stop(*args, **kw):  # the run starts: the speaker passed its check
        raise Checked

    monkeypatch.setattr(generation_funaudiochat, "SpeechRun", stop)
    batch_ids, mask, _, audio = _left_padded_batch(inputs)
    for speaker in (["中文男", "中文女"], ["中文男"], "中文女", None, tiny_decoder.speaker_embeddings):
        with pytest.raises(Checked):
            model.generate_speech(batch_ids, mask, **audio, **GOLDEN_KWARGS, speech_decoder=tiny_decoder,
                                  speaker=speaker)  # fmt: skip
    for kwargs in (dict(return_audio=False), dict(disable_speech=True)):
        with pytest.raises(Checked):
            model.generate_speech(**inputs, **GOLDEN_KWARGS, speech_decoder=tiny_decoder, speaker="typo", **kwargs)


def test_new_sampling_values_reuse_the_compiled_step(model, inputs):
    """Issue 4: temperature / top_p / top_k / penalty values are workspace tensors, not graph constants, so only the
    first call with a given set of switches compiles; every call still matches the eager loop token for token."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compile_options = {"backend": counter, "fullgraph": True, "dynamic": False}
    ids = _text_prompt(inputs, 12)
    values = [
        dict(temperature=0.7, top_p=0.8, top_k=5, repetition_penalty=1.1),
        dict(temperature=1.3, top_p=0.95, top_k=50, repetition_penalty=1.3),
        dict(temperature=0.2, top_p=0.5, top_k=1, repetition_penalty=0.9),
    ]
    frames = []
    with model.speech_generator(backend="compiled") as generator:
        for i, settings in enumerate(values):
            kwargs = dict(max_new_tokens=4, do_sample=True, seed=i, **settings)
            compiled = generator.generate(ids, **kwargs, compile_config=compile_options)
            eager = model.generate_speech(ids, **kwargs, backend="eager")
            assert torch.equal(compiled.sequences, eager.sequences)
            assert torch.equal(compiled.speech_ids, eager.speech_ids)
            frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == [frames[0]] * len(values)


def _counting_backend(graphs: list, calls: list | None = None):
    """A torch.compile backend that records each graph (and, given `calls`, each call of one) and runs it as is."""

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        if calls is None:
            return graph_module.forward

        def run(*args):
            calls.append(graph_module)
            return graph_module.forward(*args)

        return run

    return backend


def test_prefill_runs_its_last_crq_sub_steps_through_the_compiled_sub_step(model, inputs, monkeypatch):
    """Issue 4 (time to first audio): after the one-pass CRQ prefill, the K - 1 remaining sub-steps of the first
    group have decode shapes, so the compiled backend runs them through its compiled CRQ sub-step."""
    from funaudiochat_hf import generation_state_funaudiochat as state

    # The prefill's layer halves compiled apart (counted in test_compiled_prefill_graphs_serve_every_layer...).
    monkeypatch.setattr(state, "prefill_compile_options", lambda options: {"backend": "eager", "dynamic": True})
    graphs, graph_calls = [], []
    kwargs = dict(GOLDEN_KWARGS, max_new_tokens=1)  # the prefill step only
    eager = model.generate_speech(**inputs, **kwargs, backend="eager")
    with model.speech_generator(backend="compiled") as generator:
        compiled = generator.generate(
            **inputs, **kwargs, compile_config={"backend": _counting_backend(graphs, graph_calls), "fullgraph": True}
        )
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.speech_ids, eager.speech_ids)
    group_size = model.config.audio_config.group_size
    assert len(graphs) == 1 and len(graph_calls) == group_size - 1  # the CRQ sub-step graph, K - 1 calls


def test_compiled_prefill_graphs_serve_every_layer_and_prompt_length(model, inputs, monkeypatch):
    """Issue 4 (time to first audio): the compiled backend compiles the two halves of a decoder layer around its
    attention with dynamic shapes (fullgraph: no graph breaks). One graph per half and stack serves every layer and
    every prompt length, so the compile cost does not grow with the depth; prompts of several lengths and a
    left-padded batch give the eager result."""
    from funaudiochat_hf import generation_state_funaudiochat as state

    graphs = []
    prefill_options = {"backend": _counting_backend(graphs), "fullgraph": True, "dynamic": True}
    monkeypatch.setattr(state, "prefill_compile_options", lambda options: prefill_options)
    kwargs = dict(GOLDEN_KWARGS, repetition_penalty=1.2, output_logits=True)
    audio = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    long_ids = inputs["input_ids"]
    short_ids = _text_prompt(inputs, 40)
    batch_ids = torch.full((2, long_ids.shape[1]), PAD)
    batch_ids[0], batch_ids[1, -40:] = long_ids[0], short_ids[0]
    batch_mask = torch.ones_like(batch_ids)
    batch_mask[1, :-40] = 0
    prompts = [
        dict(input_ids=long_ids, **audio),
        dict(input_ids=short_ids),
        dict(input_ids=_text_prompt(inputs, 33)),
        dict(input_ids=batch_ids, attention_mask=batch_mask, **audio),
    ]
    # One cache size for all (a workspace of another batch size or cache length is a graph of its own, as for the
    # decode step).
    with model.speech_generator(max_batch_size=2, max_length=384, backend="compiled") as generator:
        for prompt in prompts:
            eager = model.generate_speech(**prompt, **kwargs, backend="eager")
            compiled = generator.generate(**prompt, **kwargs, compile_config={"backend": "eager", "fullgraph": True})
            assert torch.equal(compiled.sequences, eager.sequences)
            assert torch.equal(compiled.speech_ids, eager.speech_ids)
            # The compiled step also runs the fused / folded weight copies: float rounding moves a little.
            torch.testing.assert_close(compiled.text_logits, eager.text_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(compiled.speech_logits, eager.speech_logits, atol=1e-4, rtol=1e-4)
    # 2 halves x 2 stacks (LLM, CRQ: different widths) x 2 batch classes (dynamo specialises a batch of 1), whatever
    # the number of layers and prompt lengths.
    crq_config = model.config.audio_config.crq_transformer_config
    assert model.config.text_config.num_hidden_layers > 1 and crq_config.num_hidden_layers > 1
    assert len(graphs) == 2 * 2 * 2


def test_compiled_backend_with_fused_and_folded_copies_matches_eager(model, inputs):
    """The compiled backend on a CPU runs the fused CRQ projections and the folded CRQ matching (its plan) and
    compiles the prefill's halves with the `compile_config` backend; same tokens as eager, logits within rounding."""
    graphs = []
    kwargs = dict(GOLDEN_KWARGS, max_new_tokens=8, output_logits=True)
    eager = model.generate_speech(**inputs, **kwargs, backend="eager")
    with model.speech_generator(backend="compiled") as generator:
        plan = generator.plan(None, 1, False, None)
        assert plan.fuse_crq_projections and plan.fold_crq_matching and plan.compile_prefill
        assert plan.attention == "gqa_matmul" and not plan.step_graph  # no CUDA here
        compiled = generator.generate(**inputs, **kwargs, compile_config={"backend": _counting_backend(graphs)})
        assert generator._weights.fused is not None and generator._weights.folded is not None
    assert torch.equal(compiled.sequences, eager.sequences) and torch.equal(compiled.speech_ids, eager.speech_ids)
    torch.testing.assert_close(compiled.text_logits, eager.text_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(compiled.speech_logits, eager.speech_logits, atol=1e-4, rtol=1e-4)
    assert len(graphs) >= 3 + 2 * 2  # the three step parts, 2 halves x 2 stacks


def test_compiled_backend_needs_a_static_cache(model, inputs):
    """An explicit fast backend that cannot run says why; "auto" on a CPU is the eager loop, also with a dynamic
    cache."""
    with pytest.raises(ValueError, match="static"):
        model.generate_speech(**inputs, **GOLDEN_KWARGS, backend="compiled", cache_implementation="dynamic")
    out = model.generate_speech(**inputs, **GOLDEN_KWARGS, backend="auto", cache_implementation="dynamic")
    assert torch.equal(out.sequences, _golden("1.0")[0]["sequences"])


def test_decode_attention_is_passed_down_not_set_on_the_config(model, inputs, monkeypatch):
    """The decode steps' one-query attention reaches the layers as an argument: the configs' `_attn_implementation`
    is never changed during a call (it used to be rewritten around every step, visible to other threads)."""
    from funaudiochat_hf import decoder_stack_funaudiochat as stack_module
    from funaudiochat_hf import generation_state_funaudiochat as state
    from funaudiochat_hf import generation_step_funaudiochat as step

    class EagerParts(step.CompiledParts):  # the compiled backend's plan, its parts run eagerly (observable)
        def __init__(self, options):
            self.llm_part, self.crq_part, self.finish_part = step.llm_part, step.crq_part, step.finish_part

    monkeypatch.setattr(state, "CompiledParts", EagerParts)
    monkeypatch.setattr(state, "prefill_compile_options", lambda options: {"backend": "eager", "dynamic": True})
    configs = [model.language_model.config, model.audio_invert_tower.crq_transformer.config]
    original = [config._attn_implementation for config in configs]
    seen = []
    get_interface = stack_module.ALL_ATTENTION_FUNCTIONS.get_interface

    def spy(name, default):
        seen.append((name, tuple(config._attn_implementation for config in configs)))
        return get_interface(name, default)

    monkeypatch.setattr(stack_module.ALL_ATTENTION_FUNCTIONS, "get_interface", spy)
    eager = model.generate_speech(**inputs, **GOLDEN_KWARGS, backend="eager")
    with model.speech_generator(backend="compiled") as generator:
        out = generator.generate(**inputs, **GOLDEN_KWARGS)
    assert torch.equal(out.sequences, eager.sequences) and torch.equal(out.speech_ids, eager.speech_ids)
    assert {name for name, _ in seen} >= {"funaudiochat_gqa_decode"}
    assert all(implementations == tuple(original) for _, implementations in seen)


@pytest.mark.parametrize("prompt_pass", ["eager", "bucketed"])
def test_the_prompt_pass_attends_over_its_own_cache_columns_only(model, inputs, monkeypatch, prompt_pass):
    """Over a static cache the prompt pass hands its attention the columns the prompt wrote, not the whole cache: SDPA
    with a mask computes every column it is given, and a cache sized for a long reply (the speech engine's prefill
    workspace: 2048 LLM columns, five times that for the CRQ) made the CRQ's prompt attention several times the work
    it needs. The CUDA backends' bucketed pass (`plan.prefill_graph`, here without the recording) builds its masks
    that narrow too. The reply is unchanged (the other columns were masked out for every query)."""
    from transformers.modeling_utils import AttentionInterface

    from funaudiochat_hf import generation_step_funaudiochat as step
    from funaudiochat_hf.generation_plan_funaudiochat import PROMPT_BUCKET

    masks = []
    if prompt_pass == "bucketed":
        force_recorded_prompt_pass(monkeypatch)
        prepared = step.prompt_masks
        monkeypatch.setattr(step, "prompt_masks", lambda *a: masks.append(prepared(*a)) or masks[-1])

    sdpa = AttentionInterface._global_mapping["sdpa"]
    stacks = (model.language_model.model, model.audio_invert_tower.crq_transformer)  # the two with caches
    cached = {id(layer.self_attn) for stack in stacks for layer in stack.layers}
    calls = []  # (query positions, key columns) of their attention calls over more than one query

    def spy(module, query, key, value, attention_mask, **kwargs):
        if id(module) in cached and query.shape[-2] > 1:
            calls.append((query.shape[-2], key.shape[-2]))
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    assert model.language_model.config._attn_implementation == "sdpa"
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", spy)
    with model.speech_generator(max_length=1024) as generator:  # a cache far longer than the prompt
        out = generator.generate(**inputs, **GOLDEN_KWARGS, cache_implementation="static")
    length, k = inputs["input_ids"].shape[1], model.config.audio_config.group_size
    if prompt_pass == "bucketed":  # left-padded to a multiple of PROMPT_BUCKET positions
        length = -(-length // PROMPT_BUCKET) * PROMPT_BUCKET
        llm, crq = masks[0]
        assert llm["full_attention"].shape[-2:] == (length, length)
        assert crq["full_attention"].shape[-2:] == (k * length - (k - 1),) * 2
    assert sorted(set(calls)) == [(length, length), (k * length - (k - 1), k * length - (k - 1))], sorted(set(calls))
    golden, _, _ = _golden("1.0")
    assert torch.equal(out.sequences, golden["sequences"]) and torch.equal(out.speech_ids, golden["speech_ids"])


def test_speech_generator_owns_and_frees_its_state(model, inputs):
    """The generator holds the caches and weight copies (reported by `memory_bytes`) and frees them on `close()` /
    leaving a `with` block: nothing of it is left in module state (the weight copies die with it)."""
    import gc
    import weakref

    with model.speech_generator(backend="compiled") as generator:
        generator.generate(**inputs, **dict(GOLDEN_KWARGS, max_new_tokens=3), compile_config={"backend": "eager"})
        workspace = weakref.ref(next(iter(generator._workspaces.values())))
        fused = weakref.ref(generator._weights.fused.layers[0].qkv_weight)
        caches = sum(t.numel() * t.element_size() for t in workspace()._cache_tensors())
        assert generator.memory_bytes() >= caches > 0
    assert generator.memory_bytes() == 0
    gc.collect()
    assert workspace() is None and fused() is None
    model.clear_speech_caches()
    model.generate_speech(**inputs, **dict(GOLDEN_KWARGS, max_new_tokens=3), cache_implementation="static")
    assert model.default_speech_generator.memory_bytes() > 0
    model.clear_speech_caches()
    assert model.__dict__["_speech_generator_slot"].generator is None


def _in_a_thread(function, timeout: float = 60.0):
    """`function()` run in a daemon thread: `(result, exception)`; fails (rather than hangs) if it does not return
    within `timeout` seconds."""
    outcome = {}

    def call():
        try:
            outcome["result"] = function()
        except BaseException as error:  # noqa: BLE001  (handed to the test)
            outcome["error"] = error

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{function} still waits after {timeout} s"
    return outcome.get("result"), outcome.get("error")


def test_a_call_on_a_generator_held_by_this_threads_stream_raises_instead_of_hanging(model, inputs):
    """A stream holds its generator until exhausted or closed: a call (or `close()`) on that generator from the same
    thread used to wait for it forever; it raises now, and once the stream is closed the generator serves again."""
    kwargs = dict(GOLDEN_KWARGS, max_new_tokens=4)
    # Not a `with` block: where the call hung, its thread holds the generator and leaving the block would hang too.
    generator = model.speech_generator()
    alone = generator.generate(**inputs, **kwargs)

    def same_thread():
        stream = generator.stream(**inputs, **kwargs)
        next(stream)
        errors = []
        for call in (lambda: generator.generate(**inputs, **kwargs), generator.close):
            with pytest.raises(RuntimeError, match="in use by an unfinished stream in this thread") as raised:
                call()
            errors.append(raised.value)
        assert not generator.acquire(blocking=False)  # a non-blocking try just fails
        stream.close()  # frees the generator
        return generator.generate(**inputs, **kwargs), errors

    result, error = _in_a_thread(same_thread)
    assert error is None, error
    after, errors = result
    assert len(errors) == 2
    assert torch.equal(after.sequences, alone.sequences) and torch.equal(after.speech_ids, alone.speech_ids)

    # The model's default generator in the same situation: the call decodes with a temporary one, as before.
    def default_generator():
        stream = model.generate_speech_stream(**inputs, **kwargs)
        next(stream)
        try:
            return model.generate_speech(**inputs, **kwargs)
        finally:
            stream.close()

    result, error = _in_a_thread(default_generator)
    assert error is None, error
    assert torch.equal(result.speech_ids, alone.speech_ids)

    # Another thread still waits for the stream to end, then runs.
    stream = generator.stream(**inputs, **kwargs)
    next(stream)
    results = []
    waiter = threading.Thread(target=lambda: results.append(generator.generate(**inputs, **kwargs)), daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not results  # waiting, not raising
    stream.close()
    waiter.join(60)
    assert not waiter.is_alive() and torch.equal(results[0].speech_ids, alone.speech_ids)
    generator.close()


@pytest.mark.parametrize("rep", ["1.0", "1.2"])
def test_bucket_padded_prompt_pass_matches_reference(model, inputs, rep, monkeypatch):
    """The recorded prompt pass of the CUDA backends (`plan.prefill_graph`): the prompt left-padded to a multiple of
    `PROMPT_BUCKET` columns and run over fixed buffers with prepared masks. Run here without the recording (CPU): the
    tokens are the reference's, the logits within float rounding, the output sequences without the padding."""
    from funaudiochat_hf import generation_loop_funaudiochat as loop
    from funaudiochat_hf.generation_plan_funaudiochat import PROMPT_BUCKET

    force_recorded_prompt_pass(monkeypatch)
    lengths = []
    bucketed = loop.bucketed_prefill_forward
    spy = lambda *a, length, **k: lengths.append(length) or bucketed(*a, length=length, **k)  # noqa: E731
    monkeypatch.setattr(loop, "bucketed_prefill_forward", spy)
    golden, text_logits, crq_logits = _golden(rep)
    out = model.generate_speech(
        **inputs, **dict(GOLDEN_KWARGS, repetition_penalty=float(rep)), output_logits=True,
        cache_implementation="static", speech_generator=model.speech_generator(max_batch_size=1, max_length=512),
    )  # fmt: skip
    prompt = inputs["input_ids"].shape[1]
    assert lengths == [-(-prompt // PROMPT_BUCKET) * PROMPT_BUCKET] and lengths[0] > prompt
    assert torch.equal(out.sequences, golden["sequences"])
    assert torch.equal(out.speech_ids, golden["speech_ids"])
    torch.testing.assert_close(out.text_logits[0], text_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.speech_logits[0], crq_logits, atol=1e-4, rtol=1e-4)


def test_prompt_pass_runs_unpadded_when_the_padded_prompt_does_not_fit(model, inputs, monkeypatch):
    """A generator that holds the prompt and reply but not the bucket padding: the prompt pass runs as it is (no
    padding, no recording), with the reference's tokens."""
    from funaudiochat_hf import generation_loop_funaudiochat as loop

    force_recorded_prompt_pass(monkeypatch)
    calls = []
    monkeypatch.setattr(loop, "bucketed_prefill_forward", lambda *a, **k: calls.append(k))
    golden = _golden("1.0")[0]
    needed = inputs["input_ids"].shape[1] + GOLDEN_KWARGS["max_new_tokens"]  # 347: the padded call needs 400
    generator = model.speech_generator(max_batch_size=1, max_length=needed)
    out = model.generate_speech(**inputs, **GOLDEN_KWARGS, cache_implementation="static", speech_generator=generator)
    assert calls == []
    assert torch.equal(out.sequences, golden["sequences"]) and torch.equal(out.speech_ids, golden["speech_ids"])


def test_prompt_masks_give_every_query_a_key():
    """The prepared prompt masks: causal over the unpadded keys, and a padding query attends to itself (a row of
    nothing would give NaN that its cache entries carry into later reads)."""
    from funaudiochat_hf.generation_step_funaudiochat import _prompt_mask

    key_mask = torch.tensor([[False, False, True, True, True, True]])  # 2 padding columns, 4 tokens, 6 cache columns
    mask = _prompt_mask(key_mask, queries=4)["full_attention"]
    assert mask.shape == (1, 1, 4, 6)
    expected = torch.tensor(
        [
            [True, False, False, False, False, False],  # padding query 0: itself only
            [False, True, False, False, False, False],  # padding query 1: itself only
            [False, False, True, False, False, False],
            [False, False, True, True, False, False],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


def test_a_view_of_a_workspaces_first_rows_shares_its_state(model):
    """`DecodeWorkspace.first_rows`: per-row buffers, sampling values and cache tensors are views of the workspace's
    first rows (a step of the view writes there), the run's tensors and each cache layer's column are the same
    tensors, and the view records graphs of its own."""
    from funaudiochat_hf.generation_workspace_funaudiochat import DecodeWorkspace

    ws = DecodeWorkspace(model, 3, 64, True, False, per_row_sampling=True)
    with pytest.raises(RuntimeError, match="after the prefill"):
        ws.first_rows(2)
    for cache in (ws.llm_cache, ws.crq_cache):  # as a prefill allocates them
        for layer in cache.layers:
            layer.lazy_initialization(torch.zeros(3, 2, 1, 8), torch.zeros(3, 2, 1, 8))
    view = ws.first_rows(2)
    assert view.batch_size == 2 and view.next_ids.shape == (2,) and view.llm_mask.shape == (2, 64)
    view.next_ids.fill_(7)
    view.text_sampling.temperature.fill_(0.5)
    view.llm_cache.layers[0].keys.fill_(1.0)
    assert ws.next_ids.tolist() == [7, 7, 0]
    assert ws.text_sampling.temperature.flatten().tolist() == [0.5, 0.5, 1.0]
    assert ws.llm_cache.layers[0].keys[:2].eq(1).all() and ws.llm_cache.layers[0].keys[2].eq(0).all()
    assert view.step is ws.step and view.eos_ids is ws.eos_ids
    assert all(a.cumulative_length is b.cumulative_length for a, b in zip(view.crq_cache.layers, ws.crq_cache.layers))
    assert view.step_graphs is not ws.step_graphs
    with pytest.raises(ValueError, match="between 1 and"):
        ws.first_rows(4)


@pytest.mark.parametrize("disable_speech", [False, True])
def test_the_decode_step_reads_no_device_value_on_the_host(model, inputs, monkeypatch, disable_speech):
    """The decode step is recorded as one CUDA graph: an op that reads a tensor's value on the host (a sync) breaks the
    capture. `masked_fill_` with a tensor fill value is one (CUDA reads the value with `.item()`); the text-only step
    (`disable_speech`, where the finish kernel does not run) used it and failed on a GPU at its first call."""
    from funaudiochat_hf import generation_state_funaudiochat as state_module

    steps = []
    real_step = state_module.decode_step

    def flagged_step(*args, **kwargs):
        steps.append(True)
        try:
            return real_step(*args, **kwargs)
        finally:
            steps[-1] = False

    monkeypatch.setattr(state_module, "decode_step", flagged_step)
    # Static caches, as on a GPU (with dynamic ones transformers builds the masks, reading values on the host).
    kwargs = dict(GOLDEN_KWARGS, max_new_tokens=6, eos_token_id=[], cache_implementation="static")
    if disable_speech:
        kwargs.update(disable_speech=True, force_text_abos=False)
    with HostReads(lambda: bool(steps and steps[-1])) as mode:
        model.generate_speech(**inputs, **kwargs)
    assert len(steps) >= 4, "the decode steps did not run"
    assert mode.found == []


def test_the_step_outside_the_stacks_launches_no_index_or_history_copies(model, inputs, monkeypatch):
    """A CUDA-graphed step launches each of its small bookkeeping ops as a kernel of its own (no Inductor to fuse
    them): the eager / "cuda_graphs" step indexes its K CRQ sub-steps by Python ints (views: no index_select /
    index_copy_, no sub-step counter) and marks the speech history in place (no history-sized mask made and or'ed
    in). Counted per decode step outside the stacks' forwards and the linears around the CRQ; the tokens stay the
    golden ones (test_greedy_matches_reference)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from funaudiochat_hf import generation_step_funaudiochat as step_module

    outside = [True]

    def opaque(function):
        def call(*args, **kwargs):
            outside.append(False)
            try:
                return function(*args, **kwargs)
            finally:
                outside.pop()

        return call

    monkeypatch.setattr(step_module, "_stack_forward", opaque(step_module._stack_forward))
    monkeypatch.setattr(step_module, "_matching", opaque(step_module._matching))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if outside[-1]:
                self.counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for steps in (4, 8):
        with Ops() as ops:
            # No end of text (every call runs its steps); the speech history in use (repetition penalty).
            model.generate_speech(**inputs, **dict(GOLDEN_KWARGS, max_new_tokens=steps, eos_token_id=[], repetition_penalty=1.2))
        counts[steps] = ops.counts
    per_step = {name: (counts[8][name] - counts[4][name]) / 4 for name in counts[8] | counts[4]}
    # index_copy_: the text token into the output at the step counter; add_: that counter, the rows' group counts and
    # the LLM's position.
    expected = {"index_select": 0, "index_copy_": 1, "zeros_like": 0, "add_": 3}
    assert {name: per_step.get(name, 0) for name in expected} == expected, per_step
    group_size = model.config.audio_config.group_size
    assert per_step["scatter_"] == 1 + group_size + 1  # the speech output; the history at each sub-step, per group
