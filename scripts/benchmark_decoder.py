"""The CosyVoice3 decoder part of `scripts/benchmark.py`: the full-size (or tiny) `CosyVoice3Token2Wav` with random
weights, its inputs (random speech tokens, a speaker embedding), its precision (`--decoder-precision`, and how far it
moves the output from float32) and compile helper, and the rows: offline decoding and streaming."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from benchmark_common import (
    COSYVOICE3_TINY,
    OFFICIAL_DECODER,
    SPEECH_VOCAB,
    TOKENS_PER_SECOND,
    check_buffers_finite,
    is_cuda,
    peak_gb,
    reset_peak,
    synchronize,
    timed,
)


def build_decoder(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    from funaudiochat_hf import CosyVoice3Config, CosyVoice3Token2Wav

    start = time.perf_counter()
    if args.tiny:
        try:
            from funaudiochat_hf.tiny_model import tiny_token2wav_config

            with torch.device(args.device):
                model = CosyVoice3Token2Wav._from_config(tiny_token2wav_config(SPEECH_VOCAB), dtype=torch.float32)
            source = "tiny_model.tiny_token2wav_config, random init"
        except ImportError:
            model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).to(args.device)
            source = "tests/fixtures/cosyvoice3_tiny"
    else:
        with torch.device(args.device):
            model = CosyVoice3Token2Wav._from_config(CosyVoice3Config(), dtype=torch.float32)
        source = "CosyVoice3Config() defaults, random init"
    if not args.tiny or source.endswith("random init"):
        init_fixed_tables_(model)
    model.eval()
    model.requires_grad_(False)
    synchronize(args.device)
    info = {
        "build_s": round(time.perf_counter() - start, 1),
        "source": source,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "precision": args.decoder_precision,
    }
    bad = check_buffers_finite(model)
    if bad:
        info["non_finite_buffers"] = bad[:10]
    return model, info


def init_fixed_tables_(model: torch.nn.Module) -> None:
    """Fill the decoder's fixed non-persistent tables (ODE start noise, HiFT source tables) explicitly: a model built
    from a config must not depend on whether the constructor's weight initialisation reached them."""
    for module in model.modules():
        for name in ("init_noise", "init_source_tables"):
            fill = getattr(module, name, None)
            if callable(fill):
                fill()


def speaker_embedding(device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(1, 192, generator=g)
    return (emb / emb.norm(dim=-1, keepdim=True)).to(device)


def random_speech_tokens(seconds: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEECH_VOCAB, (1, int(seconds * TOKENS_PER_SECOND)), generator=g)


def waveform_of(output) -> torch.Tensor:
    for name in ("waveform", "audio", "waveforms"):
        value = getattr(output, name, None)
        if value is not None:
            output = value
            break
    if isinstance(output, (list, tuple)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"decoder returned {type(output).__name__}, expected a waveform tensor")
    return output


@contextlib.contextmanager
def decoder_precision(decoder, precision: str):
    """Run the DiT estimator in `precision` (float32 / tf32 / bfloat16 / float16) inside the block: autocast over
    its float32 weights, which gives the numbers of weights stored in that dtype (tested bit for bit)."""
    config = decoder.config
    saved = (config.estimator_autocast_dtype, torch.backends.cuda.matmul.allow_tf32)
    config.estimator_autocast_dtype = precision if precision in ("bfloat16", "float16") else None
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        config.estimator_autocast_dtype, torch.backends.cuda.matmul.allow_tf32 = saved


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (other.double() - reference.double()).pow(2).sum()
    return float(10 * torch.log10(reference.double().pow(2).sum() / noise.clamp_min(1e-30)))


def decoder_precision_row(
    decoder, args: argparse.Namespace, tokens: torch.Tensor | None = None, emb: torch.Tensor | None = None
) -> dict:
    """How far `--decoder-precision` moves the decoder's output from float32 (offline, eager; default 10 s of random
    tokens and a random speaker). Run it before `apply_decoder_precision`: it keeps the estimator's weights float32
    (`estimator_precision="float32"`, the device's other defaults applied) and switches precision by autocast.

    mel / waveform SNR in dB, and two that separate HiFT's parts: F0 (the excitation's pitch) and the waveform
    vocoded with float32's excitation (the filter's response to the mel's change). The waveform's SNR also holds
    the excitation's phase, the running sum of F0 over the whole reply: a tiny random HiFT with large F0 weights
    turns small F0 changes into unrelated phases, and that SNR near 0 dB (the fixtures); the other two stay
    meaningful there.
    """
    device = args.device
    tokens = random_speech_tokens(10.0, seed=7) if tokens is None else tokens
    tokens = tokens.to(device)
    emb = speaker_embedding(device) if emb is None else emb.to(device)
    decoder.config.estimator_precision = "float32"
    decoder.apply_device_defaults()
    if decoder.flow.decoder.estimator.proj_out.weight.dtype != torch.float32:
        raise RuntimeError("the precision check needs the decoder's float32 weights (run it before switching)")
    outputs = {}
    with torch.no_grad():
        for precision in ("float32", args.decoder_precision):
            with decoder_precision(decoder, precision):
                mel = decoder.tokens_to_mel(tokens, emb)
            outputs[precision] = (mel, *decoder.hift(mel), decoder.hift.predict_f0(mel))
        (mel_ref, wav_ref, source_ref, f0_ref), (mel, wav, _, f0) = outputs["float32"], outputs[args.decoder_precision]
        wav_same_source, _ = decoder.hift(mel, source=source_ref)
    notes = [] if bool(torch.isfinite(wav).all()) else ["non-finite audio"]
    return {
        "precision": args.decoder_precision,
        "tokens": tokens.shape[-1],
        "mel_snr_db": snr_db(mel_ref, mel),
        "mel_max_abs_diff": float((mel - mel_ref).abs().max()),
        "mel_std": float(mel_ref.std()),
        "wav_snr_db": snr_db(wav_ref, wav),
        "f0_snr_db": snr_db(f0_ref, f0),
        "wav_same_excitation_snr_db": snr_db(wav_ref, wav_same_source),
        "notes": notes,
    }


def apply_decoder_precision(decoder, precision: str) -> None:
    """Switch the built (float32) decoder to `--decoder-precision`, as a user would (before its first call)."""
    if precision in ("bfloat16", "float16"):
        decoder.use_low_precision_estimator(precision)  # 16-bit weights: autocast's numbers without per-call casts
        return
    decoder.config.estimator_precision = "float32"  # otherwise bfloat16 on CUDA on its first call
    if precision == "tf32":
        # Process-wide (the chat model runs in bfloat16, unaffected): a flag toggled around each flow call made
        # every compiled chunk re-dispatch (~1 s per chunk measured on the H200), so it is set once, like a user would.
        torch.backends.cuda.matmul.allow_tf32 = True


def compile_decoder(decoder, args: argparse.Namespace) -> str:
    """Uses the decoder's own compile helper; returns its name (raises if it has none)."""
    kwargs = json.loads(args.decoder_compile_config) if args.decoder_compile_config else {}
    if not is_cuda(args.device) and not kwargs:
        kwargs = {"backend": "eager"}
    if args.compile_vocoder:
        decoder.compile_vocoder(**({} if is_cuda(args.device) else {"backend": "eager"}))
    for name in ("compile_estimator", "compile_decoder", "compile_flow", "setup_compile"):
        helper = getattr(decoder, name, None)
        if callable(helper):
            helper(**kwargs)
            return name + ("() + compile_vocoder" if args.compile_vocoder else "")
    raise RuntimeError("decoder offers no compile helper (compile_estimator / compile_decoder / ...)")


def decoder_offline_row(decoder, mode: str, seconds: float, args: argparse.Namespace) -> dict:
    device = args.device
    tokens = random_speech_tokens(seconds, seed=int(seconds)).to(device)
    emb = speaker_embedding(device)
    reset_peak(device)

    def run():
        with torch.no_grad():
            return waveform_of(decoder(tokens, speaker_embedding=emb))

    first_s, wav = timed(run, device)
    times = [timed(run, device)[0] for _ in range(max(1, args.repeats))]
    wall = statistics.median(times)
    expected = tokens.shape[1] * 960
    notes = []
    if wav.shape[-1] != expected:
        notes.append(f"{wav.shape[-1]} samples, expected {expected}")
    if not bool(torch.isfinite(wav).all()):
        notes.append("non-finite audio")
    name = f"offline {seconds:g} s"
    row = {
        "mode": mode,
        "test": name,
        "audio_s": seconds,
        "wall_s": wall,
        "first_call_s": first_s,
        "rtf": wall / seconds,
        "peak_gb": peak_gb(device),
        "notes": notes,
    }
    if name in OFFICIAL_DECODER:
        row["x_vs_official"] = OFFICIAL_DECODER[name]["wall_s"] / wall
    return row


def stream_once(
    decoder, tokens: torch.Tensor, emb: torch.Tensor, hop: int, device: str, arrival: int, stream_options: dict
) -> dict:
    """Pushes tokens `arrival` at a time (the chat loop emits 5 per LLM step); times every push that returns audio."""
    with torch.no_grad():
        stream = decoder.streaming_decoder(speaker_embedding=emb, token_hop_len=hop, **stream_options)
        chunk_ms, idle_ms, total, samples = [], [], 0.0, 0
        flat = tokens.reshape(-1)
        for i in range(0, flat.numel(), arrival):
            seconds, audio = timed(lambda: stream.push(flat[i : i + arrival]), device)
            total += seconds
            if audio is not None and audio.numel() > 0:
                chunk_ms.append(seconds * 1e3)
                samples += audio.numel()
            else:
                idle_ms.append(seconds * 1e3)
        seconds, audio = timed(stream.finalize, device)
        total += seconds
        samples += audio.numel() if audio is not None else 0
    return {
        "total_s": total,
        "chunk_ms": chunk_ms,
        "idle_ms": idle_ms,
        "finalize_ms": seconds * 1e3,
        "samples": samples,
        "cuda_graphs": bool(getattr(stream, "cuda_graphs", False)),
        "flow_window_sizes": getattr(stream, "flow_window_sizes", None),
    }


def decoder_stream_row(decoder, mode: str, seconds: float, args: argparse.Namespace) -> dict:
    device = args.device
    tokens = random_speech_tokens(seconds, seed=100 + int(seconds)).to(device)
    emb = speaker_embedding(device)
    reset_peak(device)
    # A whole warm-up reply first: compilation, the allocator, and the CUDA graphs of every window shape (recorded
    # once per model, shared by later streams; the windows grow over the first chunks), so that the timed reply
    # shows the steady cost. The warm-up's first chunk is reported separately.
    options = json.loads(args.stream_options) if args.stream_options else {}
    warm = stream_once(decoder, tokens, emb, args.hop, device, 5, options)
    run = stream_once(decoder, tokens, emb, args.hop, device, 5, options)
    chunks = run["chunk_ms"]
    if not chunks:
        raise RuntimeError("streaming decoder returned no audio before finalize()")
    expected = tokens.shape[1] * 960
    notes = []
    if run["samples"] != expected:
        notes.append(f"{run['samples']} samples, expected {expected}")
    if run["cuda_graphs"]:
        notes.append("flow solver + HiFT replayed as CUDA graphs")
    if run["flow_window_sizes"]:
        notes.append(f"flow windows padded to {'/'.join(map(str, run['flow_window_sizes']))} tokens")
    if warm["chunk_ms"]:
        notes.append(f"after a warm-up reply (its first chunk {warm['chunk_ms'][0]:.0f} ms)")
    if run["idle_ms"]:  # the rest of the wall time besides the chunks: pushes that return no audio, the final flush
        notes.append(f"{len(run['idle_ms'])} pushes without audio: {sum(run['idle_ms']):.1f} ms in all; "
                     f"finalize {run['finalize_ms']:.1f} ms")
    name = f"stream {seconds:g} s"
    row = {
        "mode": mode,
        "test": name,
        "hop": args.hop,
        "audio_s": seconds,
        "wall_s": run["total_s"],
        "rtf": run["total_s"] / seconds,
        "first_chunk_ms": chunks[0],
        "max_chunk_ms": max(chunks),
        "last_chunk_ms": chunks[-1],
        "chunks": len(chunks),
        "finalize_ms": run["finalize_ms"],
        "warmup_first_chunk_ms": warm["chunk_ms"][0] if warm["chunk_ms"] else None,
        "peak_gb": peak_gb(device),
        "notes": notes,
    }
    if name in OFFICIAL_DECODER:
        row["x_vs_official"] = OFFICIAL_DECODER[name]["wall_s"] / run["total_s"]
    return row
