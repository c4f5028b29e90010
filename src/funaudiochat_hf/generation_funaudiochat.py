"""Speech-to-speech generation for Fun-Audio-Chat: `generate_speech` and `generate_speech_stream`.

One LLM step emits one text token and, from the same final hidden state, the CRQ ("Speech Refined Head") emits a group
of `group_size` (K = 5) speech tokens autoregressively with its own KV cache spanning the whole conversation. The
group and the text token are fed back (averaged) as the next LLM input (`generation_loop_funaudiochat`).

The pieces, one job per file:

- `generation_config_funaudiochat`: `FunAudioChatGenerationConfig` (the settings, saved with a checkpoint) and the
  checks of a call's arguments;
- `generation_plan_funaudiochat`: which parts of the loop run for a backend on a device (a pure function);
- `generation_state_funaudiochat`: `SpeechGenerator`, the owner of caches, weight copies, CUDA graphs and compiled
  functions;
- `generation_workspace_funaudiochat` / `generation_step_funaudiochat`: the fixed-address state of a run and the step
  functions over it; `generation_loop_funaudiochat`: one call's loop;
- `generation_vocoding_funaudiochat`: speech tokens to audio; `generation_output_funaudiochat`: the outputs.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from .generation_config_funaudiochat import (
    FunAudioChatGenerationConfig,
    SpeechRequest,
    check_input_ids,
    resolve_request,
)
from .generation_loop_funaudiochat import SpeechRun
from .generation_output_funaudiochat import FunAudioChatSpeechOutput, SpeechStreamEvent, TextDeltas
from .generation_state_funaudiochat import SpeechGenerator
from .generation_vocoding_funaudiochat import (
    check_decoder_speaker,
    decode_speech_offline,
    decoder_sampling_rate,
    decoder_speaker_kwargs,
    valid_speech_tokens,
)


class _DefaultGeneratorSlot:
    """Holds a model's default `SpeechGenerator`. Not copied with the model (`copy.deepcopy`, pickling): a copy
    starts without one."""

    def __init__(self):
        self.generator: SpeechGenerator | None = None
        self.lock = threading.Lock()

    def __deepcopy__(self, memo) -> "_DefaultGeneratorSlot":
        return _DefaultGeneratorSlot()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state) -> None:
        self.__init__()


class FunAudioChatSpeechGenerationMixin:
    """Adds `generate_speech` (text + speech tokens + optional audio), `generate_speech_stream` and
    `speech_generator` (an owner of decoding state) to the model."""

    def speech_generator(
        self,
        max_batch_size: int = 1,
        max_length: int | None = None,
        backend: str = "auto",
        kernel_config=None,
        plan_overrides=None,
    ) -> SpeechGenerator:
        """A new [`SpeechGenerator`] for this model: it owns the static caches (`max_batch_size` rows,
        `max_length` LLM positions, None: sized by each call), weight copies, CUDA graphs and compiled functions of
        its calls, reports their size (`memory_bytes()`) and frees them (`close()`, or use it as a context manager).
        `backend`: "auto" | "eager" | "cuda_graphs" | "compiled" (see `generation_plan_funaudiochat`);
        `kernel_config`: the Triton kernels' tuning; `plan_overrides`: `{part: False}` turns parts of the fast
        backends off (debugging).

        Use it with `gen.generate(**inputs, ...)` / `gen.stream(...)` or `generate_speech(speech_generator=gen)`.
        """
        return SpeechGenerator(self, max_batch_size, max_length, backend, kernel_config, plan_overrides)

    def clear_speech_caches(self) -> None:
        """Close the default `SpeechGenerator` (its caches, weight copies and CUDA graphs); the next call builds a
        new one."""
        slot = self.__dict__.get("_speech_generator_slot")
        if slot is not None:
            with slot.lock:
                generator, slot.generator = slot.generator, None
            if generator is not None:
                generator.close()

    @property
    def default_speech_generator(self) -> SpeechGenerator:
        """The generator `generate_speech` uses when none is passed (made on first use, grows as calls need)."""
        slot = self.__dict__.setdefault("_speech_generator_slot", _DefaultGeneratorSlot())
        with slot.lock:
            if slot.generator is None:
                slot.generator = SpeechGenerator(self, growable=True)
            return slot.generator

    def speech_generation_config(self) -> FunAudioChatGenerationConfig:
        """The model's generation settings as a [`FunAudioChatGenerationConfig`] (a copy)."""
        return FunAudioChatGenerationConfig.from_model_generation_config(getattr(self, "generation_config", None))

    def _speech_decoder(self, speech_decoder, return_audio):
        if return_audio not in (None, True, False):
            raise TypeError(f"`return_audio` must be None, True or False, got {return_audio!r}.")
        decoder = speech_decoder if speech_decoder is not None else getattr(self, "token2wav", None)
        if return_audio is True and decoder is None:
            raise ValueError(
                "`return_audio=True` needs a speech decoder: pass `speech_decoder=` or set `model.token2wav`."
            )
        if return_audio is False:
            return None
        # The decoder's one-time device settings (on CUDA: its estimator cast to bfloat16) before this call allocates
        # its caches and weight copies, so that the float32 weights are released first.
        apply_defaults = getattr(decoder, "apply_device_defaults", None)
        if apply_defaults is not None:
            apply_defaults()
        return decoder

    def resolve_speech_request(
        self, input_ids, attention_mask=None, generation_config: GenerationConfig | None = None, kwargs=None
    ) -> SpeechRequest:
        """Check a call's prompt ids and settings as `generate_speech` does (same errors) and return them resolved:
        `generation_config` (default: the model's) updated with `kwargs`. Touches no tensor of the model."""
        embeddings = self.language_model.get_input_embeddings().weight.shape[0]
        vocab_size = min(embeddings, self.language_model.get_output_embeddings().weight.shape[0])
        check_input_ids(input_ids, attention_mask, embeddings)
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise TypeError(
                f"`generation_config` must be a GenerationConfig, got {type(generation_config).__name__}."
            )
        return resolve_request(
            self.speech_generation_config(),
            generation_config,
            kwargs or {},
            vocab_size=vocab_size,
            context_length=self.config.text_config.max_position_embeddings,
            prompt_length=input_ids.shape[1],
        )

    @contextmanager
    def _speech_run(
        self, input_ids, attention_mask, prompt_inputs, generation_config, backend, generator, kwargs, decoder, speaker
    ):
        """A validated [`SpeechRun`] on a generator held for the run (`generator`, else the default one, else, when
        that one is busy in another thread, a temporary one closed afterwards). `speaker` is checked against
        `decoder` (the call's vocoder, None: no audio) first: a bad one raises before anything is allocated or
        decoded."""
        request = self.resolve_speech_request(input_ids, attention_mask, generation_config, kwargs)
        if decoder is not None and not request.disable_speech:
            check_decoder_speaker(decoder, speaker, input_ids.shape[0])
        if generator is not None and not isinstance(generator, SpeechGenerator):
            raise TypeError(f"`speech_generator` must be a SpeechGenerator, got {type(generator).__name__}.")
        if generator is not None and generator.model is not self:
            raise ValueError("`speech_generator` belongs to another model.")
        temporary = False
        if generator is not None:
            generator.acquire()
        else:
            generator = self.default_speech_generator
            if not generator.acquire(blocking=False):  # busy in another thread: a generator of this call's own
                generator, temporary = generator.temporary_copy(), True
                generator.acquire()
        try:
            yield SpeechRun(self, generator, request, input_ids, attention_mask, prompt_inputs, backend)
        finally:
            if temporary:
                generator._release_all()
            generator.release()

    @torch.no_grad()
    def generate_speech(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        speech_ids: torch.LongTensor | None = None,
        speech_attention_mask: torch.Tensor | None = None,
        input_features: torch.FloatTensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        feature_exist_mask: torch.Tensor | None = None,
        *,
        generation_config: GenerationConfig | None = None,
        backend: str | None = None,
        speech_generator: SpeechGenerator | None = None,
        speech_decoder=None,
        speaker=None,
        return_audio: bool | None = None,
        streamer=None,
        **kwargs,
    ) -> FunAudioChatSpeechOutput:
        """Answer a (spoken) prompt with text and speech tokens, and optionally the vocoded waveform.

        Args:
            input_ids: `(batch, length)` prompt ids, left-padded for batches (the processor's output).
            attention_mask: `(batch, length)`, 0 on left padding.
            speech_ids, speech_attention_mask, input_features, feature_attention_mask, feature_exist_mask:
                user-audio inputs exactly as the processor returns them.
            generation_config: a [`FunAudioChatGenerationConfig`] (or a plain `GenerationConfig`, over the official
                defaults); default: the model's `generation_config`'s settings. `kwargs` update it.
            backend: "auto" (default: eager on a CPU, the fast CUDA backend on a GPU), "eager", "cuda_graphs" or
                "compiled" (`generation_plan_funaudiochat`); None: the generator's. "compiled" takes its
                torch.compile options from `generation_config.compile_config`.
            speech_generator: the [`SpeechGenerator`] holding the decoding state (`model.speech_generator(...)`);
                default: the model's own (`clear_speech_caches()` frees it).
            speech_decoder: a `CosyVoice3Token2Wav` (defaults to `self.token2wav`); may live on another device.
            speaker: a stored speaker's name (a list: one per row) or a `(192,)` x-vector (tensor or numpy
                array; `(batch, 192)`: one per row) for the decoder. Checked before decoding: an unknown name, a
                list whose length is not the batch's or an x-vector of the wrong shape raises at once.
            return_audio: None = vocode when a decoder is available; False = never; True = required.
            streamer: transformers-style streamer (`put`/`end`) receiving the prompt then each text token (batch 1).
            **kwargs: `GenerationConfig` fields (`max_new_tokens`, `do_sample`, `temperature`, `top_p`, `top_k`,
                `repetition_penalty`, `eos_token_id`, `pad_token_id`, `output_logits`, `cache_implementation`, ...;
                values this decoder cannot honour, such as `num_beams=2`, raise), the fields of
                [`FunAudioChatGenerationConfig`] (`text_greedy`, `force_text_abos`, `disable_speech`, `text_` /
                `speech_` prefixed sampling overrides), and `seed` or `generator` (a `torch.Generator`).

        Returns:
            [`FunAudioChatSpeechOutput`]: `sequences` `(batch, length + new)`, `speech_ids` `(batch, K * groups)`,
            `audio` (list of 1-D tensors or None) and `sampling_rate`.
        """
        decoder = self._speech_decoder(speech_decoder, return_audio)
        if streamer is not None and isinstance(input_ids, torch.Tensor) and input_ids.shape[0] != 1:
            raise ValueError("`streamer` supports batch size 1 only.")
        prompt_inputs = dict(
            speech_ids=speech_ids,
            speech_attention_mask=speech_attention_mask,
            input_features=input_features,
            feature_attention_mask=feature_attention_mask,
            feature_exist_mask=feature_exist_mask,
        )
        with self._speech_run(
            input_ids, attention_mask, prompt_inputs, generation_config, backend, speech_generator, kwargs, decoder,
            speaker,
        ) as run:
            ws = run.prefill()
            if streamer is None:
                run.decode_until_done()
            else:  # each step's token is read at once, for the streamer
                streamer.put(input_ids.cpu())
                streamer.put(ws.text_out[:, 0].cpu())
                while run.steps < run.max_new_tokens and not run.all_done():
                    run.decode()
                    if not bool(ws.finish_step[0] < run.steps - 1):
                        streamer.put(ws.text_out[:, run.steps - 1].cpu())
            output = run.result()
            disable_speech, speech_bos_id = run.cfg.disable_speech, run.cfg.speech_bos_id
        if streamer is not None:
            streamer.end()
        if decoder is not None and not disable_speech:
            output.audio = decode_speech_offline(decoder, output.speech_ids, speech_bos_id, speaker)
            output.sampling_rate = decoder_sampling_rate(decoder)
        return output

    @torch.no_grad()
    def generate_speech_stream(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        speech_ids: torch.LongTensor | None = None,
        speech_attention_mask: torch.Tensor | None = None,
        input_features: torch.FloatTensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        feature_exist_mask: torch.Tensor | None = None,
        *,
        generation_config: GenerationConfig | None = None,
        backend: str | None = None,
        speech_generator: SpeechGenerator | None = None,
        tokenizer=None,
        speech_decoder=None,
        speaker=None,
        return_audio: bool | None = None,
        token_hop_len: int = 15,
        pre_lookahead_len: int = 3,
        first_token_hop_len: int | None = 6,
        stream_options: dict | None = None,
        **kwargs,
    ) -> Iterator[SpeechStreamEvent]:
        """Like `generate_speech`, but yields a [`SpeechStreamEvent`] after every LLM step (0.2 s of speech).

        Audio is vocoded while decoding by the decoder's `streaming_decoder(speaker, token_hop_len,
        pre_lookahead_len, first_token_hop_len)`: the first chunk covers `first_token_hop_len` speech tokens and is
        decoded once that many + `pre_lookahead_len` + 1 tokens have come: with the default 6, the prompt pass's 5
        and one LLM step's (6 is the longest first hop after one step, with 80 ms of audio, the rest held back for
        HiFT's look-ahead; a first chunk of `token_hop_len` = 15 tokens needs 4 steps; None = the reference's
        chunking), later chunks `token_hop_len` tokens each. Batch size 1 only.
        `tokenizer` (the processor's tokenizer) turns the text ids into `text`. `stream_options` go to
        `streaming_decoder` as well and take precedence (e.g. `{"flow_left_context_tokens": 50}`: a shorter flow
        look-back, cheaper chunks; `{"token_max_hop_len": 100}`: hops that grow after the first chunks, 6, 15, 30,
        60, 100, ..., less flow work per second of audio; `{"cuda_graphs": False}`). The generator is held until the
        iterator finishes or is closed.
        """
        if isinstance(input_ids, torch.Tensor) and (input_ids.ndim != 2 or input_ids.shape[0] != 1):
            raise ValueError(
                f"generate_speech_stream supports batch size 1, got input_ids of shape {tuple(input_ids.shape)}."
            )
        decoder = self._speech_decoder(speech_decoder, return_audio)
        prompt_inputs = dict(
            speech_ids=speech_ids,
            speech_attention_mask=speech_attention_mask,
            input_features=input_features,
            feature_attention_mask=feature_attention_mask,
            feature_exist_mask=feature_exist_mask,
        )
        with self._speech_run(
            input_ids, attention_mask, prompt_inputs, generation_config, backend, speech_generator, kwargs, decoder,
            speaker,
        ) as run:
            if run.cfg.disable_speech:
                decoder = None
            if decoder is not None:
                sampling_rate = decoder_sampling_rate(decoder)
            else:
                sampling_rate = int(getattr(self.config, "sampling_rate", 24000))
            stream = None
            if decoder is not None:
                stream = decoder.streaming_decoder(
                    **decoder_speaker_kwargs(speaker),
                    token_hop_len=token_hop_len,
                    pre_lookahead_len=pre_lookahead_len,
                    **{"first_token_hop_len": first_token_hop_len, **(stream_options or {})},
                )
            yield from _stream_events(run, stream, tokenizer, sampling_rate)


def _stream_events(run: SpeechRun, stream, tokenizer, sampling_rate: int) -> Iterator[SpeechStreamEvent]:
    """The events of a streaming run: one per LLM step (the prefill's included), the last with the stream's tail."""
    k = run.cfg.group_size
    text = TextDeltas(tokenizer)
    empty_audio = torch.zeros(0)

    ws = run.prefill()
    groups_seen = 0
    while True:
        step = run.steps - 1
        done_before = bool(ws.finish_step[0] < step)
        new_text = ws.text_out[0, step : step + 1].cpu()
        if done_before:
            new_text = new_text[:0]
        groups = int(ws.groups[0])
        new_speech = ws.speech_out[0, groups_seen * k : groups * k].cpu()
        groups_seen = groups
        audio = empty_audio
        if stream is not None:
            valid = valid_speech_tokens(new_speech, run.cfg.speech_bos_id)
            if len(valid):
                audio = stream.push(valid).reshape(-1).float().cpu()  # CPU ids: checked without a sync
        finished = run.all_done() or run.steps >= run.max_new_tokens
        if not finished:
            yield SpeechStreamEvent(text.push(new_text.tolist()), new_text, new_speech, audio, sampling_rate, False)
            run.decode()
            continue
        tail = stream.finalize().reshape(-1).float().cpu() if stream is not None else empty_audio
        audio = torch.cat([audio, tail])
        delta = text.push(new_text.tolist(), final=True)
        yield SpeechStreamEvent(delta, new_text, new_speech, audio, sampling_rate, True)
        break


__all__ = [
    "FunAudioChatGenerationConfig",
    "FunAudioChatSpeechGenerationMixin",
    "FunAudioChatSpeechOutput",
    "SpeechGenerator",
    "SpeechStreamEvent",
    "decode_speech_offline",
]
