"""`funaudiochat-s2s`: answer a spoken question with a spoken reply.

    funaudiochat-s2s question.wav -o reply.wav                       # tiny offline model (noise!), no download
    funaudiochat-s2s question.wav -o reply.wav \\
        --model FunAudioLLM/Fun-Audio-Chat-8B --decoder path/to/Fun-CosyVoice3-0.5B-2512 --stream

Prints the text reply on stdout; progress and notes go to stderr. Errors are one line with a non-zero exit code
(`--debug` shows the traceback). Also runnable as `python -m funaudiochat_hf.cli`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np


# The random tiny model rarely stops by itself: its replies (CLI, server) end here, 9.6 s of speech at most.
TINY_MODEL_MAX_NEW_TOKENS = 48
# Characters a terminal acts on instead of showing: C0/C1 controls (not tab and newline; a carriage return would let
# text overwrite itself) and the bidirectional overrides that reorder what is shown. Printed escaped (`\x1b`).
_TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="funaudiochat-s2s",
        description="Fun-Audio-Chat speech-to-speech: reply to a spoken question with text and 24 kHz speech.",
        epilog="The first run waits longer: it builds the tiny offline model (or downloads --model and --decoder) "
        "into a cache that later runs reuse. Every run then loads the models and generates on the chosen device; "
        "progress and notes go to stderr.",
    )
    add = parser.add_argument
    add("input", nargs="?", help="the spoken question: an audio file (wav, flac, mp3, ogg; any rate, mono or stereo)")
    add("-o", "--output", default="reply.wav",
        help="where to write the spoken reply: a .wav, .flac, .ogg or .mp3 file (default: %(default)s)")
    add(
        "--model",
        help="chat model folder or Hub id, e.g. FunAudioLLM/Fun-Audio-Chat-8B or a one-folder repo from "
        "scripts/build_hub_repo.py (default: a tiny random-weight offline model whose output is noise)",
    )
    add(
        "--decoder",
        help="CosyVoice3 speech decoder (official Fun-CosyVoice3-0.5B-2512 folder, a converted folder or a Hub id); "
        "needed when the chat model has none, as in the official two-repo layout",
    )
    add("--speakers", help="speaker embeddings file (spk2info.pt) for an official decoder folder")
    add("--voice", help="voice name stored in the decoder, e.g. 中文女 (see --list-voices)")
    add("--list-voices", action="store_true", help="print the available voices and exit")
    add("--stream", action="store_true", help="print text and write audio while they are generated")
    add(
        "--max-new-tokens",
        type=int,
        help=f"reply length limit in LLM steps, 0.2 s of speech each (default: 512; {TINY_MODEL_MAX_NEW_TOKENS} with "
        "the tiny offline model)",
    )
    add("--temperature", type=float, help="speech sampling temperature (default: 0.8)")
    add("--top-p", type=float, help="speech nucleus sampling threshold (default: 0.9)")
    add("--greedy", action="store_true", help="greedy decoding, deterministic (default: sampling)")
    add("--seed", type=int, help="random seed for reproducible sampling (default: none)")
    add("--system-prompt", help="system prompt (default: the official spoken-chat prompt)")
    add("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, ... (default: %(default)s)")
    add(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="chat model dtype (default: %(default)s)",
    )
    add("--trust-remote-code", action="store_true", help="allow code shipped in a Hub repo")
    add("--debug", action="store_true", help="show full tracebacks")
    return parser


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _printable(text: str) -> str:
    """`text` with the characters a terminal would act on (escape sequences, carriage returns, bidi overrides) shown
    as escapes: model text is printed, never interpreted."""
    return _TERMINAL_CONTROLS.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)


def one_line_error(error: BaseException) -> str:
    """The first line of an error's message (its type's name where it has none): what a command prints."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _looks_local(source: str) -> bool:
    """A path rather than a Hub id (`owner/name` or `name`)."""
    return source.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(source)) or source.count("/") > 1


def _check_input(path: str | None) -> None:
    """The question exists, is a file, decodes as audio and holds a speech frame: checked before any model loads."""
    from .audio_io import AudioDecodeError, load_audio
    from .limits_funaudiochat import MIN_AUDIO_SECONDS

    if path is None:
        raise ValueError("no input: pass the spoken question as an audio file (funaudiochat-s2s question.wav)")
    expanded = Path(path).expanduser()
    if expanded.is_dir():
        raise ValueError(f"input is a directory, not an audio file: {path}")
    if not expanded.is_file():
        raise ValueError(f"input file not found: {path}")
    try:
        waveform = load_audio(str(expanded), target_sampling_rate=16000)
    except AudioDecodeError as error:
        raise ValueError(f"input is not an audio file: {path} ({error})") from None
    # Audio that decodes but is refused (too long, empty, an unsupported rate) keeps its own message, naming the file.
    if len(waveform) < MIN_AUDIO_SECONDS * 16000:
        raise ValueError(
            f"input is too short: {path} lasts {len(waveform) / 16000 * 1000:.0f} ms; the model hears speech in "
            f"frames of {MIN_AUDIO_SECONDS * 1000:.0f} ms"
        )


def _output_subtype(path: Path) -> str:
    """The sample format to write `path` in: 16-bit PCM where its container (from the extension) holds it, else the
    container's own (Vorbis for .ogg, MPEG layer III for .mp3). Raises ValueError for an extension soundfile cannot
    write."""
    import soundfile

    container = path.suffix[1:].upper()
    if container not in soundfile.available_formats():
        raise ValueError(f"cannot write audio to {path}: name a .wav file (or .flac, .ogg, .mp3)")
    return "PCM_16" if soundfile.check_format(container, "PCM_16") else soundfile.default_subtype(container)


def _check_output(output: str) -> None:
    """The reply can be written where -o says: checked before any model loads, so a bad path costs no generation."""
    path = Path(output).expanduser()
    if path.is_dir():
        raise ValueError(f"-o {output} is a directory: name the file, e.g. {Path(output) / 'reply.wav'}")
    _output_subtype(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "ab"):  # opened to append: an existing file is left as it is until the reply is written
            pass
        if not existed:
            path.unlink()
    except OSError as error:
        raise ValueError(f"cannot write the reply to {output}: {error.strerror or error}") from None


def _check_sources(args, options: tuple[str, str, str] = ("--model", "--decoder", "--speakers")) -> None:
    """--model / --decoder name an existing folder or a Hub id, --speakers an existing file: checked before loading,
    so that a mistyped path reads "not found" rather than a Hub id format error. `options`: how the caller's user
    names the three (e.g. the demo's environment variables)."""
    model_option, decoder_option, speakers_option = options
    for option, source in ((model_option, args.model), (decoder_option, args.decoder)):
        if source is None:
            continue
        path = Path(source).expanduser()
        if path.is_file():
            raise ValueError(f"{option} {source} is a file: pass the model's folder or a Hub id")
        if not path.is_dir() and _looks_local(source):
            raise ValueError(f"{option} folder not found: {source}")
    if args.speakers is not None and not Path(args.speakers).expanduser().is_file():
        raise ValueError(f"{speakers_option} file not found: {args.speakers}")


def _config_json(source: str, fetch: bool = False) -> dict | None:
    """A model's config.json from its folder or the local Hub cache; None where not at hand. With `fetch`, a Hub id's
    config.json is downloaded when not cached (a few KB, the first file loading fetches anyway; ValueError where it
    cannot be: offline, no such repository, a gated one)."""
    path = Path(source).expanduser() / "config.json"
    if not path.is_file() and not _looks_local(source):
        import huggingface_hub

        cached = huggingface_hub.try_to_load_from_cache(source, "config.json")
        if not isinstance(cached, str) and fetch:
            try:
                cached = huggingface_hub.hf_hub_download(source, "config.json")
            except Exception as error:  # loading would fail the same way, after a second wait
                raise ValueError(f"{source}: its config.json could not be fetched from the Hub ({error})") from None
        path = Path(cached) if isinstance(cached, str) else path
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _weights_cached(source: str) -> bool:
    """Whether a Hub id's weights (one file or a sharded index) are in the local Hub cache."""
    from huggingface_hub import try_to_load_from_cache

    names = ("model.safetensors", "model.safetensors.index.json")
    return any(isinstance(try_to_load_from_cache(source, name), str) for name in names)


def _voices_before_loading(args) -> list[str] | None:
    """The decoder's voice names, read from config / speaker files without loading any weights; None where that is not
    possible (then they are checked once the decoder has loaded)."""
    if args.model is None and args.decoder is None:
        from .tiny_model import tiny_token2wav_config

        return list(tiny_token2wav_config(speech_vocab_size=1).speaker_names)
    if args.decoder is not None:
        decoder = Path(args.decoder).expanduser()
        if (decoder / "config.json").is_file():
            return list(_config_json(str(decoder)).get("speaker_names") or [])
        from .conversion_cosyvoice3 import SPEAKER_FILES, read_speakers

        found = [args.speakers] if args.speakers else [decoder / n for n in SPEAKER_FILES if (decoder / n).is_file()]
        return read_speakers(found[0])[0] if found else None
    config = _config_json(args.model)
    token2wav = (config or {}).get("token2wav_config")
    return list(token2wav.get("speaker_names") or []) if token2wav else None


def check_decoder_before_loading(model: str | None, decoder: str | None, model_option: str = "--model",
                                 decoder_option: str = "--decoder") -> None:  # fmt: skip
    """A chat model with no speech decoder inside needs a decoder: said from its config.json before its weights are
    downloaded or loaded (the 8B model takes long), where that file can be had. `model_option`, `decoder_option`:
    how the caller's user names them (e.g. the Space's environment variables)."""
    if model is None or decoder is not None:
        return
    config = _config_json(model, fetch=True)  # before the weights' download, for a Hub id
    if config is not None and config.get("model_type") == "funaudiochat" and not config.get("token2wav_config"):
        raise ValueError(
            f"{model_option} {model} has no speech decoder inside: set {decoder_option} to a CosyVoice3 folder or Hub "
            "id (the official two-repo layout: Fun-CosyVoice3-0.5B-2512), or use a one-folder repo built by "
            "scripts/build_hub_repo.py"
        )


def _device(name: str, option: str = "--device") -> str:
    """The device `--device name` means, checked before any model loads: a malformed name or a GPU this machine does
    not have would otherwise fail only once the (possibly 16 GB) model has loaded. `option`: how the caller's user
    names the setting (e.g. the demo's environment variable)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{option} {name} is not a device name: use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{option} {name}: CUDA is not available on this machine; use {option} cpu.")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{option} {name}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0 to cuda:{count - 1})."
            )
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)  # torch.mps, torch.xpu, ...: "meta" and the like have none
        if not callable(getattr(backend, "is_available", None)) or not backend.is_available():
            raise ValueError(f"{option} {name}: not available on this machine; use auto, cpu, cuda or cuda:N.")
    return name


def _generate_kwargs(args) -> dict:
    """generate_speech's keyword arguments, each option checked here: generate_speech would refuse a bad one only
    after the (possibly 16 GB) model has loaded."""
    kwargs = {}
    if args.max_new_tokens is not None:
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}.")
        kwargs["max_new_tokens"] = args.max_new_tokens
    # The sampling options default to None (not to their values), so an explicit one is told from the default.
    sampling = [option for option, value in (("--temperature", args.temperature), ("--top-p", args.top_p))
                if value is not None]  # fmt: skip
    if args.greedy and sampling:
        raise ValueError(f"--greedy takes no sampling options: drop {' and '.join(sampling)} or --greedy.")
    if args.temperature is not None:
        if not 0 < args.temperature < math.inf:  # also refuses nan
            raise ValueError(
                f"--temperature must be positive and finite, got {args.temperature} (use --greedy for greedy)."
            )
        kwargs["temperature"] = args.temperature
    if args.top_p is not None:
        if not 0 < args.top_p <= 1:  # also refuses nan
            raise ValueError(f"--top-p must be in (0, 1], got {args.top_p} (1 turns the filter off).")
        kwargs["top_p"] = args.top_p
    if args.greedy:
        kwargs["do_sample"] = False
    if args.seed is not None:
        if not -(2**63) <= args.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"--seed must fit in 64 bits (-2**63 to 2**64 - 1), got {args.seed}.")
        kwargs["seed"] = args.seed
    if args.voice is not None:
        kwargs["speaker"] = args.voice
    if args.system_prompt is not None:
        from .limits_funaudiochat import MAX_SYSTEM_PROMPT_CHARS, check_text_length

        check_text_length(args.system_prompt, "--system-prompt", MAX_SYSTEM_PROMPT_CHARS)
        kwargs["system_prompt"] = args.system_prompt
    return kwargs


def _load_pipeline(args):
    from transformers import pipeline
    from transformers.utils import logging as hf_logging

    from .pipeline_speech_to_speech import register_pipeline
    from .tiny_model import NOISE_WARNING, build_tiny_model

    hf_logging.enable_progress_bar()  # "Loading checkpoint shards" / download bars on stderr
    register_pipeline()
    model = args.model
    if model is None:
        _note("note: no --model given: using the tiny offline model (built on the first run, then cached).")
        _note(f"note: {NOISE_WARNING}")
        started = time.perf_counter()
        model = str(build_tiny_model())
        _note(f"tiny model ready at {model} ({time.perf_counter() - started:.1f} s)")
    elif not _looks_local(model) and not _weights_cached(model):
        _note(f"note: downloading {model} from the Hub: the first run only, later runs read the local cache.")
    device = _device(args.device)
    _note(f"loading chat model {model} on {device} ...")
    if args.decoder is not None:
        _note(f"loading speech decoder {args.decoder} ...")
    started = time.perf_counter()
    pipe = pipeline(
        "speech-to-speech",
        model=model,
        decoder=args.decoder,
        speakers_file=args.speakers,
        device=device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code or None,
    )
    _note(f"models loaded in {time.perf_counter() - started:.1f} s")
    return pipe


def _check_voice(voices: list[str], voice: str | None) -> None:
    if voice is None or not voices:
        return
    if voice not in voices:
        raise ValueError(f"unknown voice {voice!r}; this decoder has: {', '.join(voices)}.")


def _write_wav(path: Path, audio: np.ndarray, sampling_rate: int) -> None:
    import soundfile

    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), audio, sampling_rate, subtype=_output_subtype(path))


def _generating_note(device) -> str:
    """The line said before the reply: on a GPU a new process's first reply also builds the decode kernels (from the
    on-disk cache once warm) and records its CUDA graphs, which takes seconds the later replies do not pay."""
    note = f"generating the reply on {device} ..."
    if str(device).startswith("cuda"):
        note += " (a new process's first reply on a GPU also loads or builds the decode kernels and records CUDA graphs)"
    return note


def _run_offline(pipe, args, kwargs) -> None:
    started = time.perf_counter()
    reply = pipe(args.input, **kwargs)
    elapsed = time.perf_counter() - started
    print(_printable(reply["text"]), flush=True)
    _write_wav(Path(args.output).expanduser(), reply["audio"], reply["sampling_rate"])
    seconds = len(reply["audio"]) / reply["sampling_rate"]
    _note(f"wrote {args.output}: {seconds:.2f} s of audio at {reply['sampling_rate']} Hz in {elapsed:.1f} s")


def _run_streaming(pipe, args, kwargs) -> None:
    import soundfile

    output = Path(args.output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    first_audio = None
    samples = 0
    sink = None
    try:
        for event in pipe.stream(args.input, **kwargs):
            if event["text"]:
                print(_printable(event["text"]), end="", flush=True)
            if event["audio"].size:
                if sink is None:  # the file is created with the first chunk, so the sampling rate is known
                    sink = soundfile.SoundFile(
                        str(output), mode="w", samplerate=event["sampling_rate"], channels=1,
                        subtype=_output_subtype(output),
                    )
                    first_audio = time.perf_counter() - started
                sink.write(event["audio"])
                sink.flush()
                samples += event["audio"].size
        print(flush=True)
    finally:
        if sink is not None:
            sink.close()
    if sink is None:  # no speech at all: still leave a valid (empty) wav behind
        _write_wav(output, np.zeros(0, dtype=np.float32), pipe.sampling_rate)
    elapsed = time.perf_counter() - started
    first = f", first audio after {first_audio:.2f} s" if first_audio is not None else ""
    _note(f"wrote {output}: {samples / pipe.sampling_rate:.2f} s of audio in {elapsed:.1f} s{first}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        # Everything that can be checked without the models is checked first: loading them takes long.
        if not args.list_voices:
            _check_input(args.input)
            _check_output(args.output)
        kwargs = _generate_kwargs(args)
        _device(args.device)
        if args.model is None:
            # The random tiny model rarely decides to stop: bound its reply so the offline run takes seconds.
            kwargs.setdefault("max_new_tokens", TINY_MODEL_MAX_NEW_TOKENS)
        _check_sources(args)
        check_decoder_before_loading(args.model, args.decoder)
        voices = _voices_before_loading(args)
        if args.list_voices and voices is not None:
            print("\n".join(voices) if voices else "(this decoder stores no named voices)")
            return 0
        if voices:
            _check_voice(voices, args.voice)
        pipe = _load_pipeline(args)
        if args.list_voices:
            print("\n".join(pipe.speakers) if pipe.speakers else "(this decoder stores no named voices)")
            return 0
        _check_voice(pipe.speakers, args.voice)
        _note(_generating_note(pipe.device))
        if args.stream:
            _run_streaming(pipe, args, kwargs)
        else:
            _run_offline(pipe, args, kwargs)
        if args.model is None:
            _note("note: the reply above came from the tiny random-weight model: noise by design.")
        return 0
    except KeyboardInterrupt:
        _note("interrupted")
        return 130
    except Exception as error:  # one line for users; --debug for developers
        if args.debug:
            raise
        _note(f"error: {one_line_error(error)}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
