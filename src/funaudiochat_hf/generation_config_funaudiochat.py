"""`FunAudioChatGenerationConfig`: the settings of `generate_speech`, and their checks.

A `transformers.GenerationConfig` with the official speech-to-speech defaults (sampling at temperature 0.8, top-p 0.9,
repetition penalty 1.2, 512 new tokens) and the official switches (`text_greedy`, `force_text_abos`,
`disable_speech`), plus `text_` / `speech_` prefixed overrides of the five sampling settings. It is saved and loaded
like any generation config (`save_pretrained` / `from_pretrained`), also as a model's `generation_config`.

`resolve_request` merges a call's config and keyword arguments and checks everything before any expensive work: every
standard `GenerationConfig` field is accepted, values this decoder cannot honour (`num_beams > 1`,
`num_return_sequences > 1`, ...) raise, harmless ones (`num_beams=1`, `length_penalty`, ...) pass; types and ranges
(ids inside the vocabulary, finite temperatures, `max_new_tokens` within the model's context) raise a clear
`TypeError` / `ValueError` naming the argument.
"""

import copy
import math
import numbers
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from .sampling_funaudiochat import SamplingSettings


# The five settings of one token stream; `text_<name>` / `speech_<name>` override them per stream.
STREAM_SETTINGS = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")
STREAM_OVERRIDES = tuple(f"{stream}_{name}" for stream in ("text", "speech") for name in STREAM_SETTINGS)

# The official speech-to-speech defaults (spec funaudiochat.md §6.3).
SPEECH_DEFAULTS = {
    "max_new_tokens": 512,
    "do_sample": True,
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 0,
    "repetition_penalty": 1.2,
    "text_greedy": True,
    "force_text_abos": True,
    "disable_speech": False,
}

# Standard `GenerationConfig` fields this decoder cannot honour, with the values that mean "off" (None is always off).
# Fields not listed (length_penalty, early_stopping, bos_token_id, return_dict_in_generate, assistant settings, ...)
# change nothing here and pass.
_NEUTRAL_VALUES = {
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "num_return_sequences": (1,),
    "diversity_penalty": (0.0,),
    "penalty_alpha": (),
    "constraints": (),
    "force_words_ids": (),
    "min_length": (0,),
    "min_new_tokens": (0,),
    "max_time": (),
    "stop_strings": (),
    "min_p": (),
    "top_h": (),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "bad_words_ids": (),
    "renormalize_logits": (False,),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "remove_invalid_values": (False,),
    "exponential_decay_length_penalty": (),
    "suppress_tokens": (),
    "begin_suppress_tokens": (),
    "sequence_bias": (),
    "token_healing": (False,),
    "guidance_scale": (1.0,),
    "watermarking_config": (),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    "output_scores": (False,),
    "use_cache": (True,),
    "use_mtp": (False,),
    "prompt_lookup_num_tokens": (),
    "assistant_early_exit": (),
    "dola_layers": (),
    "speculation_type": (),
    "max_cache_len": (),
    "cache_config": (),
    "prefill_chunk_size": (),
}

CACHE_IMPLEMENTATIONS = ("static", "dynamic")
SAMPLING_VALUES = ("temperature", "top_p", "top_k")


class FunAudioChatGenerationConfig(GenerationConfig):
    """Generation settings of Fun-Audio-Chat's joint text + speech decoding (`generate_speech`).

    Args (besides every `GenerationConfig` argument):
        text_greedy (`bool`, defaults to True): the text token is the plain argmax of the raw text logits (the
            reference bypasses its logits processors for text); False samples text with the settings below.
        force_text_abos (`bool`, defaults to True): the first text token is `<|audio_bos|>`, which switches speech on.
        disable_speech (`bool`, defaults to False): text only (no CRQ steps, no speech tokens).
        text_do_sample, text_temperature, text_top_p, text_top_k, text_repetition_penalty,
        speech_do_sample, speech_temperature, speech_top_p, speech_top_k, speech_repetition_penalty:
            per-stream overrides of `do_sample`, `temperature`, `top_p`, `top_k`, `repetition_penalty` (None: the
            shared value; for text with `text_greedy`, greedy).

    The shared defaults are the official ones: `max_new_tokens=512`, `do_sample=True`, `temperature=0.8`,
    `top_p=0.9`, `top_k=0`, `repetition_penalty=1.2`. The speech EOS and the `<|audio_bos|>` / `<|audio_eos|>` ids
    come from the model config.
    """

    def __init__(self, **kwargs):
        for name, value in SPEECH_DEFAULTS.items():
            # Without sampling the sampling values stay unset (a greedy config that names them does not validate);
            # `resolve_request` takes the official ones for a stream that samples anyway.
            if name not in SAMPLING_VALUES or kwargs.get("do_sample", True):
                kwargs.setdefault(name, value)
        self.text_greedy = kwargs.pop("text_greedy")
        self.force_text_abos = kwargs.pop("force_text_abos")
        self.disable_speech = kwargs.pop("disable_speech")
        for name in STREAM_OVERRIDES:
            setattr(self, name, kwargs.pop(name, None))
        super().__init__(**kwargs)

    @classmethod
    def from_model_generation_config(cls, config: GenerationConfig | None) -> "FunAudioChatGenerationConfig":
        """The model's settings as a `FunAudioChatGenerationConfig`: a saved one as it is (a model loaded from a
        checkpoint holds it as a plain `GenerationConfig` with our fields), else the official defaults with the
        model's eos / pad ids."""
        if isinstance(config, cls):
            return copy.deepcopy(config)
        if config is not None and hasattr(config, "text_greedy"):
            return cls.from_dict(config.to_dict())
        ids = {} if config is None else {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}
        return cls(**{name: value for name, value in ids.items() if value is not None})


@dataclass(frozen=True)
class SpeechRequest:
    """One call's validated settings (what `resolve_request` returns)."""

    max_new_tokens: int
    text: SamplingSettings
    speech: SamplingSettings
    force_text_abos: bool
    disable_speech: bool
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    output_logits: bool
    cache_implementation: str | None  # None: the backend's choice
    compile_options: dict | None  # from `compile_config`, for the "compiled" backend
    seed: int | None
    generator: torch.Generator | None


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value, minimum: int) -> int:
    """An int of at least `minimum` that fits in 64 bits (token counts and ids go to int64 tensors)."""
    if not _is_int(value):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be at least {minimum}, got {value}.")
    if value > 2**63 - 1:
        raise ValueError(f"`{name}` must fit in 64 bits, got {value}.")
    return int(value)


def _check_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value}.")
    return float(value)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {type(value).__name__} {value!r}.")
    return value


def _check_token_ids(name: str, value, vocab_size: int) -> tuple[int, ...]:
    """An id or a list of ids, each in [0, vocab_size)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.dtype == torch.bool or value.ndim > 1:
            raise TypeError(f"`{name}` must be an int or a list of ints, got a {value.dtype} tensor.")
        value = value.tolist()
    ids = [value] if not isinstance(value, (list, tuple)) else list(value)
    for token in ids:
        if not _is_int(token):
            raise TypeError(f"`{name}` must be an int or a list of ints, got {value!r}.")
        if not 0 <= token < vocab_size:
            raise ValueError(f"`{name}` {token} is outside the text vocabulary [0, {vocab_size}).")
    return tuple(int(token) for token in ids)


def _check_unsupported(config: GenerationConfig) -> None:
    for name, neutral in _NEUTRAL_VALUES.items():
        value = getattr(config, name, None)
        if value is None or (value in neutral if isinstance(value, (bool, numbers.Number)) else False):
            continue
        allowed = f" (only {', '.join(map(repr, neutral))} or None)" if neutral else " (only None)"
        raise ValueError(
            f"generate_speech cannot honour `{name}={value!r}`{allowed}: it decodes one sequence per prompt with "
            "its own text and speech samplers."
        )


def _stream_settings(config: FunAudioChatGenerationConfig, prefix: str, base: dict) -> SamplingSettings:
    values = {}
    for name in STREAM_SETTINGS:
        override = getattr(config, f"{prefix}_{name}", None)
        values[name] = base[name] if override is None else override
        argument = f"{prefix}_{name}" if override is not None else name
        if name == "do_sample":
            values[name] = _check_bool(argument, values[name])
        elif name == "top_k":
            values[name] = _check_int(argument, values[name], 0)
        else:
            values[name] = _check_real(argument, values[name])
    return SamplingSettings(**values)


def resolve_request(
    model_config: FunAudioChatGenerationConfig,
    generation_config: GenerationConfig | None,
    kwargs: dict,
    *,
    vocab_size: int,
    context_length: int,
    prompt_length: int,
) -> SpeechRequest:
    """Merge and check one call's settings: `generation_config` (or the model's, `model_config`) updated with
    `kwargs` (`GenerationConfig` fields, the fields of [`FunAudioChatGenerationConfig`], `seed`, `generator`).

    Raises:
        ValueError / TypeError: an unknown argument, a value this decoder cannot honour, a wrong type or range,
            `max_new_tokens` beyond the `context_length` left after a prompt of `prompt_length` ids.
    """
    if generation_config is None:
        config = copy.deepcopy(model_config)
    elif isinstance(generation_config, FunAudioChatGenerationConfig):
        config = copy.deepcopy(generation_config)
    elif isinstance(generation_config, GenerationConfig):
        # A plain config: its fields over the official defaults (unset fields are None in transformers 5).
        values = {name: value for name, value in generation_config.to_dict().items() if value is not None}
        config = FunAudioChatGenerationConfig(**{**model_config.to_dict(), **values})
    else:
        raise TypeError(
            f"`generation_config` must be a GenerationConfig, got {type(generation_config).__name__}."
        )
    kwargs = dict(kwargs)
    seed, generator = kwargs.pop("seed", None), kwargs.pop("generator", None)
    unknown = sorted(name for name in kwargs if name not in vars(config) or name.startswith("_"))
    if unknown:
        raise ValueError(
            f"Unknown generate_speech arguments: {unknown}. It takes `GenerationConfig` fields, the fields of "
            f"`FunAudioChatGenerationConfig` ({', '.join(['text_greedy', 'force_text_abos', 'disable_speech'])}, "
            f"{', '.join(STREAM_OVERRIDES)}), `seed` and `generator`."
        )
    for name, value in kwargs.items():
        setattr(config, name, value)
    _check_unsupported(config)

    max_new_tokens = config.max_new_tokens
    if max_new_tokens is None and config.max_length is not None:
        max_new_tokens = _check_int("max_length", config.max_length, prompt_length + 1) - prompt_length
    if max_new_tokens is None:
        raise ValueError("Set `max_new_tokens` (or `max_length`).")
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    room = context_length - prompt_length
    if max_new_tokens > room:
        raise ValueError(
            f"`max_new_tokens`={max_new_tokens} does not fit: the model's context holds {context_length} positions "
            f"and the prompt takes {prompt_length}, which leaves at most {max(room, 0)} new tokens."
        )

    text_greedy = _check_bool("text_greedy", config.text_greedy)
    shared = {name: getattr(config, name) for name in STREAM_SETTINGS}
    shared = {name: SPEECH_DEFAULTS[name] if value is None else value for name, value in shared.items()}
    speech = _stream_settings(config, "speech", shared)
    # text_greedy: plain argmax of the raw text logits (the reference bypasses its processors for text).
    text_base = dict(shared, do_sample=False, repetition_penalty=1.0) if text_greedy else shared
    text = _stream_settings(config, "text", text_base)

    eos = () if config.eos_token_id is None else _check_token_ids("eos_token_id", config.eos_token_id, vocab_size)
    pad = config.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    if not _is_int(pad):
        raise TypeError(f"`pad_token_id` must be an int, got {type(pad).__name__} {pad!r}.")
    if not 0 <= pad < vocab_size:
        raise ValueError(f"`pad_token_id` {pad} is outside the text vocabulary [0, {vocab_size}).")

    cache_implementation = config.cache_implementation
    if cache_implementation is not None and cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"`cache_implementation` must be one of {CACHE_IMPLEMENTATIONS} or None, got {cache_implementation!r}."
        )
    if seed is not None and not _is_int(seed):
        raise TypeError(f"`seed` must be an int, got {type(seed).__name__} {seed!r}.")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise ValueError(f"`seed` must fit in 64 bits, got {seed}.")
    if seed is not None and generator is not None:
        raise ValueError("Pass `seed` or `generator`, not both: each alone says where the sampling noise comes from.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"`generator` must be a torch.Generator, got {type(generator).__name__}.")
    output_logits = config.output_logits
    return SpeechRequest(
        max_new_tokens=max_new_tokens,
        text=text,
        speech=speech,
        force_text_abos=_check_bool("force_text_abos", config.force_text_abos),
        disable_speech=_check_bool("disable_speech", config.disable_speech),
        eos_token_ids=eos,
        pad_token_id=int(pad),
        output_logits=False if output_logits is None else _check_bool("output_logits", output_logits),
        cache_implementation=cache_implementation,
        compile_options=_compile_options(config.compile_config),
        seed=None if seed is None else int(seed),
        generator=generator,
    )


def _compile_options(compile_config) -> dict | None:
    """`torch.compile` options of a `CompileConfig` (or a dict of them), or None."""
    if compile_config is None:
        return None
    if isinstance(compile_config, dict):
        return dict(compile_config)
    if hasattr(compile_config, "to_dict"):
        return {name: value for name, value in compile_config.to_dict().items() if value is not None}
    raise TypeError(f"`compile_config` must be a CompileConfig or a dict, got {type(compile_config).__name__}.")


def check_input_ids(input_ids, attention_mask, vocab_size: int) -> None:
    """`input_ids` a non-empty `(batch, length)` integer tensor of ids in [0, vocab_size); `attention_mask` None or
    of the same shape."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"`input_ids` must be a (batch, length) LongTensor, got {type(input_ids).__name__}.")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"`input_ids` must be an integer tensor, got dtype {input_ids.dtype}.")
    if input_ids.ndim != 2:
        raise ValueError(f"`input_ids` must be a (batch, length) LongTensor, got shape {tuple(input_ids.shape)}.")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"`input_ids` is empty (shape {tuple(input_ids.shape)}): the prompt needs at least one token.")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"`input_ids` has ids outside the text vocabulary [0, {vocab_size}): {low}..{high}.")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"`attention_mask` must be a tensor, got {type(attention_mask).__name__}.")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"`attention_mask` shape {tuple(attention_mask.shape)} != `input_ids` shape {tuple(input_ids.shape)}."
            )


__all__ = ["FunAudioChatGenerationConfig", "SpeechRequest", "check_input_ids", "resolve_request"]
