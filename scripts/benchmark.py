#!/usr/bin/env python
"""Speed benchmark for Fun-Audio-Chat speech-to-speech: the chat loop (LLM + CRQ) and the CosyVoice3 decoder.

Builds the full-size architectures with random weights directly on the device (weight values do not change the cost of
a step), feeds processor-shaped random inputs (a spoken "question" of `--input-seconds`), and measures:

chat part (`FunAudioChatForConditionalGeneration.generate_speech`), per mode (eager / compiled) x batch size:
    * ms per LLM step = slope between two runs with different `max_new_tokens` (prefill, compile and other one-off costs
      cancel), text EOS disabled so every run does the full number of steps; one LLM step = 1 text + 5 speech tokens =
      0.2 s of output audio, so real-time factor = step ms / 200 ms and aggregate x real time = batch * 200 / step ms;
    * the floor = bytes read per step (LLM weights without the input embedding + 5 x (CRQ body + input/output matching
      + speech head) + pre_matching + the KV cache read at the mean context) / measured device copy bandwidth (the
      gpt-fast KPI: achieved GB/s = weight bytes / step time);
    * compile time (first call minus a warm call), peak memory, the CRQ share of a step (`disable_speech=True` vs
      normal), time to the first audio chunk of `generate_speech_stream` with the full-size decoder (hop 15), and
      memory before/after 100 consecutive short calls.
decoder part (`CosyVoice3Token2Wav`, float32): offline RTF for 10 s and 30 s of tokens (25 tokens/s), streaming at hop
15 (RTF, first chunk latency after its tokens arrive, max per-chunk time), peak memory; eager and compiled.

Every measurement is isolated: a failure is recorded in the table as "failed: <reason>" and the run goes on. Work is
ordered by importance and stops when `--time-budget` seconds are spent. Results are printed as markdown tables, written
to `--markdown PATH` when given, and written as JSON + markdown to $OUT/benchmark.{json,md} when OUT is set.
`--from-json FILE` renders the tables of a JSON written on another machine (printed, and to `--markdown PATH`). How to
read the numbers and the recorded results: docs/performance.md.

    python scripts/benchmark.py --markdown results.md            # full size, on cuda
    python scripts/benchmark.py --tiny --device cpu --steps 4    # smoke test of the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import math
import os
import platform
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable


REPO = Path(__file__).resolve().parents[1]
# Benchmark the working tree's package even where it is not pip-installed (the GPU machine runs a plain copy).
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import transformers  # noqa: E402


FUNAUDIOCHAT_TINY = REPO / "tests" / "fixtures" / "funaudiochat_tiny"
COSYVOICE3_TINY = REPO / "tests" / "fixtures" / "cosyvoice3_tiny"

STEP_SECONDS = 0.2  # one LLM step = 5 speech tokens at 25 Hz
TOKENS_PER_SECOND = 25  # CosyVoice3 speech tokens
SPEECH_VOCAB = 6561  # valid CosyVoice3 token ids are [0, 6561)

# Official numbers (spec/performance.md, one H200, batch 1), quoted as context for the ratios.
OFFICIAL_CHAT_MS = {"default SDPA": 390.0, "cuDNN SDPA off": 189.0}
OFFICIAL_DECODER = {
    "offline 10 s": {"wall_s": 0.32, "rtf": 0.032},
    "offline 30 s": {"wall_s": 0.65, "rtf": 0.022},
    "stream 10 s": {"wall_s": 9.4, "rtf": 0.94, "first_chunk_ms": 600.0},
    "stream 30 s": {"wall_s": 24.6, "rtf": 0.82, "first_chunk_ms": 460.0},
}


def log(*parts: Any) -> None:
    print(*parts, flush=True)


# ----------------------------------------------------------------------------------------------------------------------
# Time budget and results
# ----------------------------------------------------------------------------------------------------------------------


class BudgetExceeded(BaseException):
    """Raised by the hard-stop alarm; a BaseException so library code catching `Exception` cannot swallow it."""


class Budget:
    """Wall-clock budget of the whole run; a SIGALRM hard stop interrupts a measurement that overruns it."""

    def __init__(self, seconds: float, hard_margin: float = 20.0):
        self.start = time.perf_counter()
        self.seconds = seconds
        if hasattr(signal, "SIGALRM") and seconds > 0:
            signal.signal(signal.SIGALRM, self._alarm)
            signal.alarm(int(math.ceil(seconds + hard_margin)))

    @staticmethod
    def _alarm(signum, frame):
        raise BudgetExceeded("hard time limit hit (time budget + margin)")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def cancel_alarm(self) -> None:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)


class Results:
    """Everything measured, kept JSON-serialisable so it can be rendered on another machine."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.data: dict[str, Any] = {
            "meta": environment_info(args, argv),
            "bandwidth": {},
            "chat_model": {},
            "chat": [],
            "compare": [],
            "crq_share": [],
            "ttfa": [],
            "repeat_calls": [],
            "decoder_model": {},
            "decoder": [],
            "decoder_precision": [],
            "log": [],
        }

    def add(self, section: str, row: dict) -> dict:
        self.data[section].append(row)
        self.save()
        return row

    def save(self) -> None:
        out = os.environ.get("OUT")
        if not out:
            return
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "benchmark.json").write_text(json.dumps(self.data, indent=1, default=str))
            (Path(out) / "benchmark.md").write_text(render_markdown(self.data))
        except OSError as error:  # never let bookkeeping abort the benchmark
            log(f"[warn] could not write $OUT: {error}")


def environment_info(args: argparse.Namespace, argv: list[str]) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python scripts/benchmark.py " + " ".join(shlex.quote(a) for a in argv),
        "device": args.device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "tiny": args.tiny,
        "chat_compile": (
            f"backend={args.chat_backend!r}, compile_config={compile_argument('compiled', args)!r}, "
            f"plan_overrides={plan_overrides(args)!r}"
            + (f"; kernel_config {json.dumps(args.kernel_config)}" if args.kernel_config else "")
            + ("; time to first audio also with backend='cuda_graphs' (eager prefill)" if args.eager_prefill else "")
        ),
        "decoder_compile": (args.decoder_compile_config or "compile_estimator() defaults")
        + (" + compile_vocoder()" if args.compile_vocoder else ""),
        "decoder_precision": args.decoder_precision,
        "stream_options": args.stream_options or "streaming_decoder() defaults",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(args.device)
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = f"none (cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        import funaudiochat_hf

        info["funaudiochat_hf"] = getattr(funaudiochat_hf, "__version__", "?")
    except Exception as error:  # recorded, the measurements will fail with the real reason
        info["funaudiochat_hf"] = f"import failed: {one_line(error)}"
    try:
        import subprocess

        info["git"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except Exception:
        info["git"] = "?"
    return info


def one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line[:200]


def run_measurement(results: Results, budget: Budget, label: str, fn: Callable[[], Any], device: str) -> Any:
    """Runs one measurement; returns its value, or a dict with "status" on skip/failure (never raises)."""
    if budget.left() <= 0:
        status = f"skipped: time budget ({budget.seconds:.0f} s) spent"
        log(f"[skip] {label}: {status}")
        results.data["log"].append({"label": label, "status": status})
        return {"status": status}
    log(f"[run ] {label} (t={budget.elapsed():.0f}s)")
    start = time.perf_counter()
    try:
        value = fn()
        status = "ok"
    except BudgetExceeded as error:
        value, status = {"status": f"failed: {one_line(error)}"}, "timeout"
    except Exception as error:  # record and continue with the next measurement
        import traceback

        traceback.print_exc(limit=-8)  # the innermost frames: enough to find the cause, short enough for the log
        value, status = {"status": f"failed: {one_line(error)}"}, "failed"
    finally:
        cleanup(device)
    took = time.perf_counter() - start
    log(f"[done] {label}: {status} in {took:.1f}s")
    results.data["log"].append({"label": label, "status": status, "seconds": round(took, 1)})
    results.save()
    return value


# ----------------------------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------------------------


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def synchronize(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def cleanup(device: str) -> None:
    gc.collect()
    if is_cuda(device):
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    """Wall-clock seconds of `fn()` with the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def reset_peak(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: str) -> float | None:
    if is_cuda(device):
        return torch.cuda.max_memory_allocated(device) / 1e9
    return None


def allocated_gb(device: str) -> float | None:
    if is_cuda(device):
        return torch.cuda.memory_allocated(device) / 1e9
    return None


def measure_copy_bandwidth(device: str, megabytes: int, iterations: int = 20) -> dict:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + bytes written (the METHOD.md ceiling)."""
    n = megabytes * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds, _ = timed(lambda: [dst.copy_(src) for _ in range(iterations)], device)
    del src, dst
    return {"copy_gb_per_s": 2 * n * iterations / seconds / 1e9, "buffer_mb": megabytes, "iterations": iterations}


def call_with_supported_kwargs(fn: Callable, kwargs: dict, notes: list[str] | None = None):
    """Calls `fn(**kwargs)`, dropping (and noting) kwargs its signature does not accept, unless it takes **kwargs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    dropped = [k for k in kwargs if k not in params]
    if dropped and notes is not None:
        note = "unsupported kwargs dropped: " + ", ".join(dropped)
        if note not in notes:
            notes.append(note)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


# ----------------------------------------------------------------------------------------------------------------------
# Chat model
# ----------------------------------------------------------------------------------------------------------------------


def reinit_small_(model: torch.nn.Module, std: float = 0.02) -> None:
    """Random weights drawn small so activations stay finite through 36 + 28 layers (values do not change step cost).

    Matrices/convs/embeddings ~ N(0, std); 1-D norm weights = 1, biases = 0; other 1-D parameters ~ N(0, std).
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, std)
            elif name.endswith("bias"):
                param.zero_()
            elif "norm" in name or "ln_" in name or name.endswith("layer_norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)


def check_buffers_finite(model: torch.nn.Module) -> list[str]:
    bad = []
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.numel() and not bool(torch.isfinite(buf).all()):
            bad.append(name)
    return bad


def build_chat_model(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    from funaudiochat_hf import FunAudioChatConfig, FunAudioChatForConditionalGeneration

    if args.tiny:
        config = FunAudioChatConfig.from_pretrained(FUNAUDIOCHAT_TINY)
    else:
        config = FunAudioChatConfig()
    dtype = resolve_dtype(args.chat_dtype, args.device)
    start = time.perf_counter()
    # Construct directly on the device: no CPU copy, and non-persistent buffers (rotary inv_freq, the encoder sinusoid)
    # are computed by the constructors as usual (a meta-device build would leave them empty).
    with torch.device(args.device):
        model = FunAudioChatForConditionalGeneration._from_config(config, dtype=dtype)
    model.to(args.device)  # no-op unless a constructor pinned something to another device
    reinit_small_(model)
    model.eval()
    model.requires_grad_(False)
    synchronize(args.device)
    info = {
        "build_s": round(time.perf_counter() - start, 1),
        "dtype": str(dtype).replace("torch.", ""),
        "parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    bad = check_buffers_finite(model)
    if bad:
        info["non_finite_buffers"] = bad[:10]
    info.update(step_bytes(model))
    return model, info


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if is_cuda(device) else torch.float32
    return getattr(torch, name)


def nbytes(module_or_tensor) -> int:
    if module_or_tensor is None:
        return 0
    if isinstance(module_or_tensor, torch.Tensor):
        return module_or_tensor.numel() * module_or_tensor.element_size()
    seen, total = set(), 0
    for p in module_or_tensor.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def step_bytes(model: torch.nn.Module) -> dict:
    """Weight bytes one LLM step must read (gpt-fast style: the input embedding is gathered, not read) + KV sizes."""
    cfg = model.config
    text_cfg = cfg.text_config
    audio_cfg = cfg.audio_config
    crq_cfg = audio_cfg.crq_transformer_config
    group = int(audio_cfg.group_size)
    lm = model.language_model
    embed = lm.get_input_embeddings().weight
    head = lm.get_output_embeddings().weight if lm.get_output_embeddings() is not None else None
    # An untied input embedding is only gathered (one row per token); a tied one is read in full as the LM head.
    llm = nbytes(lm) - (nbytes(embed) if head is not embed else 0)
    crq = model.audio_invert_tower
    crq_sub = nbytes(crq.crq_transformer) + nbytes(crq.input_matching) + nbytes(crq.output_matching)
    crq_sub += nbytes(crq.lm_head.weight)
    pre = nbytes(crq.pre_matching)
    elem = embed.element_size()

    def kv_per_position(c) -> int:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * elem

    return {
        "group_size": group,
        "llm_bytes": llm,
        "crq_substep_bytes": crq_sub,
        "pre_matching_bytes": pre,
        "weight_bytes_per_step": llm + group * crq_sub + pre,
        "llm_kv_bytes_per_position": kv_per_position(text_cfg),
        "crq_kv_bytes_per_position": kv_per_position(crq_cfg),
    }


def kv_bytes_per_step(info: dict, batch: int, context: float) -> float:
    """KV read by one step at LLM context `context`: LLM once; each of the K CRQ sub-steps reads K*context positions."""
    k = info["group_size"]
    llm = batch * context * info["llm_kv_bytes_per_position"]
    crq = batch * k * (k * context) * info["crq_kv_bytes_per_position"]
    return llm + crq


def chat_token_ids(config) -> dict:
    text_cfg = config.text_config
    audio_cfg = config.audio_config
    audio_token = getattr(config, "audio_token_index", None)
    if audio_token is None:
        audio_token = config.audio_token_id
    specials = {
        int(x)
        for x in (
            audio_token,
            text_cfg.audio_bos_index,
            text_cfg.audio_eos_index,
            text_cfg.sil_index,
            text_cfg.bos_token_id,
            text_cfg.pad_token_id,
            151643,
            151644,
            151645,
        )
        if x is not None
    }
    eos = text_cfg.eos_token_id
    specials |= set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    # Plain "text" ids for the chat-template part of the prompt: below every special id.
    text_high = min([s for s in specials if s > 16] + [int(text_cfg.vocab_size)])
    return {
        "audio_token": int(audio_token),
        "audio_bos": int(text_cfg.audio_bos_index),
        "audio_eos": int(text_cfg.audio_eos_index),
        "speech_pad": int(audio_cfg.pad_token_id),
        "group_size": int(audio_cfg.group_size),
        "num_mel_bins": int(audio_cfg.num_mel_bins),
        "text_high": int(text_high),
        "vocab_size": int(text_cfg.vocab_size),
        # An in-vocabulary pad id for finished rows (none finish with EOS disabled, but keep it valid).
        "pad": int(next(x for x in (text_cfg.pad_token_id, text_cfg.bos_token_id, 0) if x is not None)),
    }


def make_chat_inputs(model: torch.nn.Module, batch: int, seconds: float, device: str, seed: int = 0) -> dict:
    """Processor-shaped tensors for a `seconds`-long spoken question (no tokenizer needed).

    input_ids (batch, L): ~30 chat-template ids + <|audio_bos|> + ceil(25*seconds/5) <|AUDIO|> + <|audio_eos|> + 5 ids;
    speech_ids (batch, S) all <|audio_pad|>, S = 25*seconds rounded up to a multiple of 5; input_features
    (batch, 128, 100*seconds) random log-mel-like values with a full feature_attention_mask; feature_exist_mask all
    true.
    """
    ids = chat_token_ids(model.config)
    group = ids["group_size"]
    g = torch.Generator().manual_seed(seed)
    speech_len = max(1, int(seconds * TOKENS_PER_SECOND))
    padded = math.ceil(speech_len / group) * group
    placeholders = math.ceil(speech_len / group)
    mel_frames = max(1, int(round(seconds * 100)))
    prefix = torch.randint(20, ids["text_high"], (batch, 30), generator=g)
    suffix = torch.randint(20, ids["text_high"], (batch, 5), generator=g)
    audio = torch.cat(
        [
            torch.full((batch, 1), ids["audio_bos"]),
            torch.full((batch, placeholders), ids["audio_token"]),
            torch.full((batch, 1), ids["audio_eos"]),
        ],
        dim=1,
    )
    input_ids = torch.cat([prefix, audio, suffix], dim=1)
    speech_attention_mask = torch.zeros(batch, padded, dtype=torch.long)
    speech_attention_mask[:, :speech_len] = 1
    inputs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "speech_ids": torch.full((batch, padded), ids["speech_pad"], dtype=torch.long),
        "speech_attention_mask": speech_attention_mask,
        "input_features": torch.randn(batch, ids["num_mel_bins"], mel_frames, generator=g) * 0.5 - 0.5,
        "feature_attention_mask": torch.ones(batch, mel_frames, dtype=torch.long),
        "feature_exist_mask": torch.ones(batch, dtype=torch.bool),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def compile_argument(mode: str, args: argparse.Namespace):
    """The `compile_config` of the chat's compiled rows (None: generate_speech's defaults)."""
    if mode == "eager":
        return None
    if args.compile_config:
        return json.loads(args.compile_config)
    if is_cuda(args.device):
        return None
    # CPU smoke runs: trace with dynamo (proves the step is capturable) without slow C++ codegen.
    return {"backend": "eager", "fullgraph": True}


def plan_overrides(args: argparse.Namespace) -> dict:
    return json.loads(args.plan_overrides) if args.plan_overrides else {}


# One SpeechGenerator per model, backend, cache length and plan overrides: the runs of a row share its caches and
# recorded graphs, as a serving process would (closed by `drop_generators`).
_GENERATORS: dict = {}


def speech_generator(model, backend: str, max_length: int, overrides: dict, config=None):
    key = (id(model), backend, max_length, tuple(sorted(overrides.items())), config)
    if key not in _GENERATORS:
        _GENERATORS[key] = model.speech_generator(
            max_batch_size=64, max_length=max_length, backend=backend, plan_overrides=overrides, kernel_config=config
        )
    return _GENERATORS[key]


def drop_generators(model) -> None:
    """Close the generators of `model` (their caches and CUDA graphs) and its default one."""
    for key in [key for key in _GENERATORS if key[0] == id(model)]:
        _GENERATORS.pop(key).close()
    if hasattr(model, "clear_speech_caches"):
        model.clear_speech_caches()


def generation_kwargs(model, mode: str, args: argparse.Namespace, max_new_tokens: int, **extra) -> dict:
    """`generate_speech` keywords of a row. `extra`: more keywords; `cache_max_length` (the generator's max_length),
    `plan_overrides` (the generator's) and `eager_prefill` (the compiled row's kernels and CUDA graphs with an eager prefill: backend "cuda_graphs")
    pick the `speech_generator`."""
    ids = chat_token_ids(model.config)
    backend = "eager" if mode == "eager" else args.chat_backend
    if extra.pop("eager_prefill", False) and mode != "eager":
        backend = "cuda_graphs"
    kwargs = {
        "max_new_tokens": max_new_tokens,
        # performance.md setting: text greedy, speech sampled T=0.8 / top-p 0.9 / repetition penalty 1.2
        "do_sample": True,
        "text_greedy": True,
        "temperature": 0.8,
        "top_p": 0.9,
        "repetition_penalty": 1.2,
        # No stop id: every run does exactly max_new_tokens steps.
        "eos_token_id": [],
        "pad_token_id": ids["pad"],
        "backend": backend,
        "cache_implementation": "static",
        "return_audio": False,
    }
    compile_config = compile_argument(mode, args)
    if compile_config is not None and backend == "compiled":
        kwargs["compile_config"] = compile_config
    max_length = extra.pop("cache_max_length", None)
    overrides = extra.pop("plan_overrides", None) or plan_overrides(args)  # a --compare variant's, else the run's
    config = extra.pop("kernel_config", None)  # a --compare variant's DecodeKernelConfig, else --kernel-config's
    if config is None and args.kernel_config:
        config = kernel_config(model, args.kernel_config)
    if max_length is not None:
        kwargs["speech_generator"] = speech_generator(model, backend, max_length, overrides, config)
    kwargs.update(extra)
    return kwargs


def kernel_config(model, overrides: dict):
    """`DecodeKernelConfig.for_device(model's device)` with `overrides` (field name -> value, e.g. `{"split_num_warps":
    8}` of `--kernel-config` or a `--compare` variant's "kernel_config"), for
    `model.speech_generator(kernel_config=...)`. A different config is a different step configuration: it compiles and
    records graphs of its own."""
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    device = next(model.parameters()).device
    return DecodeKernelConfig.for_device(device).replace(**overrides)


def cache_length(prompt_len: int, args: argparse.Namespace) -> int:
    """One LLM cache length for every call of a batch size (timing runs, TTFA, repeated calls): the same
    `generate_speech` workspace and compiled graph serve them all, so only the first call compiles / captures.
    `--cache-steps N` sizes it for N new tokens, as a call with `max_new_tokens=N` whose reply ends sooner."""
    longest = prompt_len + max(args.steps, args.ttfa_steps, args.repeat_steps, args.cache_steps)
    return -(-longest // 128) * 128


def generated_steps(output, prompt_len: int) -> int | None:
    sequences = getattr(output, "sequences", None)
    if sequences is None and isinstance(output, (tuple, list)) and output:
        sequences = output[0]
    if isinstance(sequences, torch.Tensor):
        return int(sequences.shape[-1]) - prompt_len
    return None


def generate(model, inputs: dict, kwargs: dict, notes: list[str]):
    with torch.no_grad():
        return call_with_supported_kwargs(model.generate_speech, {**inputs, **kwargs}, notes)


def measure_step_time(
    model, inputs: dict, mode: str, args: argparse.Namespace, device: str, short: int, long: int, **extra
) -> dict:
    """ms per LLM step as the slope between runs of `short` and `long` steps (after a warm-up of each).

    Both runs use the same cache size (`cache_max_length`), hence the same workspace and compiled graph.
    """
    notes: list[str] = []
    prompt_len = inputs["input_ids"].shape[1]
    extra = {"cache_max_length": cache_length(prompt_len, args), **extra}
    runs = {}
    reset_peak(device)
    first = {}
    def run(n: int):
        return timed(lambda: generate(model, inputs, generation_kwargs(model, mode, args, n, **extra), notes), device)

    for n in (short, long):  # warm-up: compilation / CUDA-graph capture happens here
        seconds, out = run(n)
        first[n] = seconds
        steps = generated_steps(out, prompt_len)
        if steps is not None and steps != n:
            notes.append(f"{n}-step run stopped after {steps} steps (EOS not disabled?)")
        runs[n] = {"steps": steps if steps is not None else n, "times": []}
    for _ in range(args.repeats):
        for n in (short, long):
            runs[n]["times"].append(run(n)[0])
    t_short = statistics.median(runs[short]["times"])
    t_long = statistics.median(runs[long]["times"])
    d_steps = runs[long]["steps"] - runs[short]["steps"]
    if d_steps <= 0:
        raise RuntimeError(f"runs of {short} and {long} new tokens did the same number of steps")
    step_s = (t_long - t_short) / d_steps
    if step_s <= 0:
        # Timing noise exceeded the steps' cost (a loaded host, few or cheap steps): never report a slope <= 0; the
        # long run's time per step (its prefill included) bounds the step from above.
        step_s = t_long / runs[long]["steps"]
        notes.append("slope not positive (timing noise exceeds the step cost; raise --steps): the long run's time per "
                     "step, prefill included, an upper bound")
    spread = [
        (max(runs[n]["times"]) - min(runs[n]["times"])) / d_steps * 1e3 for n in (short, long)
    ]
    return {
        "ms_per_step": step_s * 1e3,
        "spread_ms": max(spread),  # run-to-run spread of the slope's inputs, in ms/step
        "fixed_s": t_short - runs[short]["steps"] * step_s,  # prefill + per-call overhead
        "first_call_s": first[short],
        "compile_s": max(0.0, first[short] - t_short) + max(0.0, first[long] - t_long),
        "steps": [runs[short]["steps"], runs[long]["steps"]],
        "peak_gb": peak_gb(device),
        "notes": notes,
    }


def step_counts(mode: str, args: argparse.Namespace) -> tuple[int, int]:
    """`(short, long)` max_new_tokens of the two timing runs whose slope is the step time (eager: at most
    `--eager-steps`)."""
    long = args.steps if mode != "eager" else min(args.steps, args.eager_steps)
    return max(1, long // 4), long


def chat_step_row(model, bandwidth: dict, mode: str, batch: int, args: argparse.Namespace, results: Results) -> dict:
    device = args.device
    info = results.data["chat_model"]  # filled by the (lazy) build of `model`
    inputs = make_chat_inputs(model, batch, args.input_seconds, device)
    short, long = step_counts(mode, args)
    m = measure_step_time(model, inputs, mode, args, device, short, long)
    row = {"mode": mode, "batch": batch, **m, "prompt_len": int(inputs["input_ids"].shape[1])}
    step_s = m["ms_per_step"] / 1e3
    row["rtf"] = step_s / STEP_SECONDS
    row["x_realtime_aggregate"] = batch * STEP_SECONDS / step_s if step_s > 0 else None
    row["achieved_gb_per_s"] = info["weight_bytes_per_step"] / step_s / 1e9 if step_s > 0 else None
    copy_bw = bandwidth.get("copy_gb_per_s")
    if copy_bw:
        context = row["prompt_len"] + (short + long) / 2
        floor_bytes = info["weight_bytes_per_step"] + kv_bytes_per_step(info, batch, context)
        row["floor_ms"] = floor_bytes / (copy_bw * 1e9) * 1e3
        row["x_floor"] = m["ms_per_step"] / row["floor_ms"]
    return row


def compare_row(model, mode: str, batch: int, args: argparse.Namespace) -> dict:
    """ms per LLM step of each `--compare` variant (generate_speech keyword arguments over the run's own), measured
    side by side: every round measures each variant once, in turn, in one process (the ratio between variants is
    what such a run reports; a lone step time drifts between runs). A variant's `"kernel_config"` (field overrides of
    `DecodeKernelConfig`, over `--kernel-config`'s) is passed as `model.speech_generator(kernel_config=...)`: part of
    the step configuration, so each config compiles and records its own step graphs."""
    inputs = make_chat_inputs(model, batch, args.input_seconds, args.device)
    short, long = step_counts(mode, args)
    variants = [{"kwargs": dict(spec), "ms_per_step": [], "notes": []} for spec in args.compare]
    for round_index in range(args.compare_rounds):
        for variant in variants:
            kwargs = variant_kwargs(model, variant["kwargs"], args)
            m = measure_step_time(model, inputs, mode, args, args.device, short, long, **kwargs)
            variant["ms_per_step"].append(m["ms_per_step"])
            variant["notes"] = sorted(set(variant["notes"]) | set(m["notes"]))
            log(f"  round {round_index + 1}: {variant_label(variant)} {m['ms_per_step']:.3f} ms/step")
    for variant in variants:
        variant["median_ms"] = statistics.median(variant["ms_per_step"])
    return {"mode": mode, "batch": batch, "rounds": args.compare_rounds, "variants": variants}


def variant_kwargs(model, spec: dict, args: argparse.Namespace) -> dict:
    """A `--compare` variant's generate_speech keyword arguments: its `"kernel_config"` overrides (over
    `--kernel-config`'s) as a `DecodeKernelConfig` object, which `generation_kwargs` hands to the variant's own
    `SpeechGenerator` (so it records step graphs of its own)."""
    kwargs = {name: value for name, value in spec.items() if name != "kernel_config"}
    if "kernel_config" in spec or args.kernel_config:
        kwargs["kernel_config"] = kernel_config(model, {**(args.kernel_config or {}), **spec.get("kernel_config", {})})
    return kwargs


def variant_label(variant: dict) -> str:
    """A `--compare` variant as its JSON: the generate_speech kwargs (with its "kernel_config" overrides)."""
    return json.dumps(variant["kwargs"])


def crq_share_row(model, mode: str, batch: int, args: argparse.Namespace, full_ms: float | None) -> dict:
    """Step time with `disable_speech=True` (LLM only) against the normal step: the CRQ's share of a step."""
    device = args.device
    inputs = make_chat_inputs(model, batch, args.input_seconds, device)
    short, long = step_counts(mode, args)
    m = measure_step_time(model, inputs, mode, args, device, short, long, disable_speech=True)
    row = {"mode": mode, "batch": batch, "llm_only_ms_per_step": m["ms_per_step"], "notes": m["notes"]}
    if full_ms:
        row["full_ms_per_step"] = full_ms
        row["crq_share"] = (full_ms - m["ms_per_step"]) / full_ms
    return row


def ttfa_row(model, decoder, mode: str, args: argparse.Namespace, eager_prefill: bool = False) -> dict:
    """Time to the first non-empty audio chunk of `generate_speech_stream` (batch 1, full decoder, hop 15), with
    the prompt forward compiled with the compiled loop (the default) or, `eager_prefill`, not."""
    device = args.device
    inputs = make_chat_inputs(model, 1, args.input_seconds, device)
    notes: list[str] = []
    prompt_len = inputs["input_ids"].shape[1]
    kwargs = generation_kwargs(
        model, mode, args, args.ttfa_steps, cache_max_length=cache_length(prompt_len, args), eager_prefill=eager_prefill
    )
    kwargs.pop("return_audio")
    kwargs.update({"speech_decoder": decoder, "speaker": speaker_embedding(device)[0], "token_hop_len": args.hop})
    # Seeded: every call (and both rows of --eager-prefill) samples the same speech tokens, so a row never fails
    # or differs because one draw happened to end the speech early.
    kwargs["seed"] = 0
    if args.stream_options:
        kwargs["stream_options"] = json.loads(args.stream_options)

    def first_audio() -> dict:
        synchronize(device)
        start = time.perf_counter()
        events, result, event_ms = 0, None, []
        with torch.no_grad():
            stream = call_with_supported_kwargs(model.generate_speech_stream, {**inputs, **kwargs}, notes)
            try:
                for event in stream:
                    events += 1
                    event_ms.append(round((time.perf_counter() - start) * 1e3, 1))  # the first: after the prefill
                    audio = getattr(event, "audio", None)
                    if audio is not None and audio.numel() > 0:
                        synchronize(device)
                        result = {"seconds": time.perf_counter() - start, "events": events, "samples": audio.numel(),
                                  "event_ms": event_ms}
                        break
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
        if result is None:
            raise RuntimeError(f"no audio in {events} stream events ({args.ttfa_steps} steps)")
        return result

    reset_peak(device)
    cold = first_audio()  # compiles / captures
    warm = [first_audio() for _ in range(max(1, args.repeats))]
    best = statistics.median(w["seconds"] for w in warm)
    return {
        "mode": mode,
        "input_seconds": args.input_seconds,
        "ttfa_ms": best * 1e3,
        "first_call_ttfa_ms": cold["seconds"] * 1e3,
        "events_before_audio": warm[0]["events"],
        "first_chunk_samples": warm[0]["samples"],
        # When each stream event arrived (ms after the call): the first follows the prefill, each later one an LLM
        # step (plus, for the last, the decoder's first chunk).
        "event_ms": warm[0]["event_ms"],
        "peak_gb": peak_gb(device),
        "notes": notes,
    }


def repeat_calls_row(model, mode: str, args: argparse.Namespace) -> dict:
    """`--repeat-calls` consecutive short generate_speech calls: memory before/after (a leak shows here) and time."""
    device = args.device
    inputs = make_chat_inputs(model, 1, args.input_seconds, device)
    notes: list[str] = []
    prompt_len = inputs["input_ids"].shape[1]
    kwargs = generation_kwargs(model, mode, args, args.repeat_steps, cache_max_length=cache_length(prompt_len, args))
    generate(model, inputs, kwargs, notes)  # warm
    cleanup(device)
    before = allocated_gb(device)
    reset_peak(device)
    times = []
    for _ in range(args.repeat_calls):
        seconds, _ = timed(lambda: generate(model, inputs, kwargs, notes), device)
        times.append(seconds)
    cleanup(device)
    after = allocated_gb(device)
    return {
        "mode": mode,
        "calls": args.repeat_calls,
        "steps_per_call": args.repeat_steps,
        "median_call_ms": statistics.median(times) * 1e3,
        "max_call_ms": max(times) * 1e3,
        "allocated_before_gb": before,
        "allocated_after_gb": after,
        "peak_gb": peak_gb(device),
        "notes": notes,
    }


# ----------------------------------------------------------------------------------------------------------------------
# CosyVoice3 decoder
# ----------------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------------------------


def fmt(value, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10 ** (-digits):
            return f"{value:.2g}{suffix}"
        return f"{value:,.{digits}f}{suffix}"
    return f"{value}{suffix}"


def human(value: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (params) / '1.23 MB' (bytes)."""
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".strip()


def row_status(row: dict) -> str | None:
    return row.get("status")


def notes_of(row: dict) -> str:
    parts = list(row.get("notes") or [])
    if row.get("status"):
        parts.insert(0, row["status"])
    return "; ".join(parts).replace("|", "/")


def notes_suffix(row: dict) -> str:
    """" (notes)" for a report sentence, or "" when the row has none."""
    notes = notes_of(row)
    return f" ({notes})" if notes else ""


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_chat(data: dict) -> str:
    rows = []
    for r in data["chat"]:
        if row_status(r):
            rows.append([r["mode"], str(r["batch"])] + ["–"] * 10 + [notes_of(r)])
            continue
        rows.append(
            [
                r["mode"],
                str(r["batch"]),
                fmt(r["ms_per_step"], 2) + f" ±{fmt(r.get('spread_ms'), 2)}",
                fmt(r["rtf"], 4),
                fmt(r["x_realtime_aggregate"], 0) + "×",
                fmt(r.get("floor_ms"), 2),
                fmt(r.get("x_floor"), 2) + "×",
                fmt(r.get("achieved_gb_per_s"), 0),
                fmt(OFFICIAL_CHAT_MS["default SDPA"] / r["ms_per_step"], 0) + "×"
                if r["batch"] == 1
                else "–",
                fmt(r.get("compile_s"), 1),
                fmt(r.get("fixed_s"), 3),
                fmt(r.get("peak_gb"), 1),
                notes_of(r),
            ]
        )
    header = [
        "mode",
        "batch",
        "ms / LLM step",
        "RTF",
        "aggregate × real time",
        "floor ms",
        "× floor",
        "weights GB/s",
        "× faster than official (390 ms)",
        "compile s",
        "prefill+overhead s",
        "peak GB (chat)",
        "notes",
    ]
    out = [table(header, rows)]
    # eager vs compiled, measured in this run
    by_key = {(r["mode"], r["batch"]): r for r in data["chat"] if not row_status(r)}
    ratios = [
        f"batch {b}: compiled is {by_key[('eager', b)]['ms_per_step'] / by_key[('compiled', b)]['ms_per_step']:.1f}× "
        f"faster than eager"
        for b in sorted({k[1] for k in by_key})
        if ("eager", b) in by_key and ("compiled", b) in by_key
    ]
    if ratios:
        out.append("\n" + "; ".join(ratios) + ".")
    return "\n".join(out)


def render_compare(data: dict) -> str:
    """One table per `--compare` measurement: each variant's median step and its rounds, relative to the first."""
    out = []
    for r in data.get("compare", []):
        title = f"Side by side ({r['mode']}, batch {r['batch']}, {r.get('rounds', '?')} interleaved rounds)"
        if row_status(r):
            out.append(f"{title}: {r['status']}")
            continue
        first = r["variants"][0]["median_ms"]
        rows = [
            [
                f"`{variant_label(v)}`",
                fmt(v["median_ms"], 3),
                fmt(v["median_ms"] / first, 3) + "×",
                ", ".join(fmt(ms, 3) for ms in v["ms_per_step"]),
                "; ".join(v.get("notes", [])),
            ]
            for v in r["variants"]
        ]
        header = ["generate_speech kwargs", "ms / LLM step (median)", "vs first", "rounds (ms)", "notes"]
        out.append(f"{title}:\n\n{table(header, rows)}")
    return "\n\n".join(out)


def render_extras(data: dict) -> str:
    lines = []
    bw = data.get("bandwidth") or {}
    if bw.get("copy_gb_per_s"):
        lines.append(
            f"- Device copy bandwidth (read + write): **{bw['copy_gb_per_s']:.0f} GB/s** "
            f"({bw['buffer_mb']} MiB buffers)."
        )
    elif bw.get("status"):
        lines.append(f"- Copy bandwidth: {bw['status']}")
    cm = data.get("chat_model") or {}
    if cm.get("weight_bytes_per_step"):
        lines.append(
            f"- Chat model: {human(cm['parameters'])} parameters ({cm['dtype']}, attention "
            f"{cm.get('attn_implementation')}), built in {cm['build_s']} s; bytes read per step: LLM "
            f"{human(cm['llm_bytes'], 'B')} + {cm['group_size']} × CRQ {human(cm['crq_substep_bytes'], 'B')} + "
            f"pre_matching {human(cm['pre_matching_bytes'], 'B')} = **{human(cm['weight_bytes_per_step'], 'B')}** "
            "(the floor also counts the KV cache read at the mean context)."
        )
    elif cm.get("status"):
        lines.append(f"- Chat model: {cm['status']}")
    if cm.get("non_finite_buffers"):
        lines.append(f"- WARNING non-finite buffers: {cm['non_finite_buffers']}")
    for r in data.get("crq_share", []):
        if row_status(r):
            lines.append(f"- CRQ share ({r['mode']}, batch {r['batch']}): {r['status']}")
        else:
            share = r.get("crq_share")
            lines.append(
                f"- CRQ share ({r['mode']}, batch {r['batch']}): LLM-only step (`disable_speech=True`) "
                f"{r['llm_only_ms_per_step']:.2f} ms vs full {fmt(r.get('full_ms_per_step'), 2)} ms → CRQ "
                f"{'–' if share is None else f'{share * 100:.0f} %'} of the step."
                + notes_suffix(r)
            )
    stream_options = data.get("meta", {}).get("stream_options", "streaming_decoder() defaults")
    for r in data.get("ttfa", []):
        if r.get("prefill"):  # rows since the prefill compiles with the loop by default
            mode = f"{r['mode']}, {r['prefill']} prefill"
        else:  # older JSON (--from-json): the prefill was eager unless compile_prefill was set
            mode = r["mode"] + (", compile_prefill=True" if r.get("compile_prefill") else "")
        if row_status(r):
            lines.append(f"- Time to first audio ({mode}): {r['status']}")
        else:
            lines.append(
                f"- Time to first audio chunk ({mode}, {r['input_seconds']:g} s question, full decoder, hop 15, "
                f"stream options {stream_options}): "
                f"**{r['ttfa_ms']:.0f} ms** warm (first call {r['first_call_ttfa_ms']:.0f} ms), after "
                f"{r['events_before_audio']} stream events"
                + (f" (arrived at {', '.join(map(str, r['event_ms']))} ms)" if r.get("event_ms") else "")
                + f"; peak {fmt(r.get('peak_gb'), 1)} GB."
                + notes_suffix(r)
            )
    for r in data.get("repeat_calls", []):
        if row_status(r):
            lines.append(f"- Repeated calls ({r.get('mode')}): {r['status']}")
        else:
            lines.append(
                f"- {r['calls']} consecutive `generate_speech` calls ({r['mode']}, {r['steps_per_call']} steps each): "
                f"median {r['median_call_ms']:.0f} ms, max {r['max_call_ms']:.0f} ms; allocated memory "
                f"{fmt(r.get('allocated_before_gb'), 3)} GB before → {fmt(r.get('allocated_after_gb'), 3)} GB after; "
                f"peak {fmt(r.get('peak_gb'), 1)} GB." + notes_suffix(r)
            )
    return "\n".join(lines)


def render_decoder(data: dict) -> str:
    rows = []
    for r in data["decoder"]:
        if row_status(r):
            rows.append([r["mode"], r["test"]] + ["–"] * 7 + [notes_of(r)])
            continue
        official = OFFICIAL_DECODER.get(r["test"], {})
        rows.append(
            [
                r["mode"],
                r["test"] + (f" (hop {r['hop']})" if r.get("hop") else ""),
                fmt(r["wall_s"], 3),
                fmt(r["rtf"], 4),
                fmt(r.get("first_chunk_ms"), 1),
                fmt(r.get("max_chunk_ms"), 1),
                f"{fmt(r.get('first_chunk_ms'), 1)} → {fmt(r.get('last_chunk_ms'), 1)}" if r.get("chunks") else "–",
                fmt(r.get("peak_gb"), 2),
                (f"{official['wall_s']} s / RTF {official['rtf']} → {fmt(r.get('x_vs_official'), 1)}×")
                if official
                else "–",
                notes_of(r),
            ]
        )
    header = [
        "mode",
        "test",
        "wall s",
        "RTF",
        "first chunk ms",
        "max chunk ms",
        "first → last chunk ms",
        "peak GB (decoder)",
        "official (performance.md) → ours ×",
        "notes",
    ]
    out = [table(header, rows)]
    dm = data.get("decoder_model") or {}
    if dm.get("parameters"):
        out.append(
            f"\nDecoder: {human(dm['parameters'])} parameters ({dm['dtype']}, {dm['source']}), built in "
            f"{dm['build_s']} s. Streaming pushes 5 tokens at a time (one LLM step); a chunk's time is the push that "
            "returned it, i.e. its latency after its tokens arrived."
        )
    elif dm.get("status"):
        out.append(f"\nDecoder: {dm['status']}")
    return "\n".join(out)


def render_markdown(data: dict) -> str:
    meta = data["meta"]
    # Name only the parts that ran (a decoder-only run says nothing about generate_speech's settings).
    compiled = []
    if data["chat"] or data.get("chat_model"):
        compiled.append(f"`generate_speech({meta.get('chat_compile')})`")
    if data.get("decoder") or data.get("decoder_model"):
        compiled.append(f"decoder `{meta.get('decoder_compile')}`")
    parts = [
        f"## {meta['date']} — {meta.get('gpu')}",
        "",
        f"`{meta['command']}`",
        "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, CUDA {meta.get('cuda', '–')}, python "
        f"{meta['python']}, funaudiochat_hf {meta.get('funaudiochat_hf')} (git {meta.get('git') or '?'}); "
        + (f"compiled = {', '.join(compiled)}; " if compiled else "")
        + f"float32 matmul precision {meta.get('float32_matmul_precision')}"
        + (" — **tiny random configs, numbers are not meaningful**" if meta.get("tiny") else ""),
        "",
    ]
    if data.get("compare"):
        parts += ["### Chat loop variants side by side, random weights", "", render_compare(data), ""]
    if data["chat"]:
        parts += ["### Chat loop (LLM + CRQ), random weights", "", render_chat(data), ""]
    if data["chat"] or data.get("chat_model") or data.get("bandwidth"):
        parts += [render_extras(data), ""]
    if data["decoder"] or data.get("decoder_model"):
        precision = meta.get("decoder_precision", "float32")
        streaming = meta.get("stream_options", "streaming_decoder() defaults")
        parts += [
            f"### CosyVoice3 decoder ({precision} estimator; streaming: {streaming}), random weights",
            "",
            render_decoder(data),
            "",
        ]
        for row in data.get("decoder_precision", []):
            if "mel_snr_db" in row:
                parts += [
                    f"Precision check ({row['precision']} vs float32, eager, 10 s of random tokens): mel SNR "
                    f"{row['mel_snr_db']:.1f} dB (max abs diff {row['mel_max_abs_diff']:.3g}, mel std "
                    f"{row['mel_std']:.3g}), waveform SNR {row['wav_snr_db']:.1f} dB"
                    + (
                        f" (F0 {row['f0_snr_db']:.1f} dB; with float32's excitation "
                        f"{row['wav_same_excitation_snr_db']:.1f} dB)"
                        if "f0_snr_db" in row
                        else ""
                    )
                    + f"{notes_suffix(row)}.",
                    "",
                ]
    skipped = [entry for entry in data.get("log", []) if entry["status"].startswith("skipped")]
    if skipped:
        parts += ["Skipped (time budget): " + ", ".join(e["label"] for e in skipped) + ".", ""]
    parts.append(
        "Context (performance.md, official code, H200, batch 1): 390 ms/step default SDPA, 189–205 ms with cuDNN SDPA "
        "off, 23.3 GB peak; floor ≈ 4.7 ms/step. Targets: ≤ 7 ms/step at batch 1, first audio ≤ 150 ms, batch 16 ≥ "
        "300× real time; decoder offline RTF ≤ 0.01, streaming RTF ≤ 0.02 with first chunk ≤ 30 ms."
    )
    return "\n".join(parts) + "\n"


def write_markdown(path: str | Path, markdown: str) -> None:
    """Write the rendered tables to `path` (`--markdown`), replacing what was there."""
    Path(path).write_text(markdown)
    log(f"wrote the markdown tables to {path}")


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny random configs from tests/fixtures (smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=128, help="LLM steps of the long timing run (short run: steps // 4)")
    p.add_argument("--eager-steps", type=int, default=32, help="cap on --steps in eager mode (slow per step)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions of each run, median (3; 1 with --tiny)")
    p.add_argument("--batch-sizes", default=None, help="1,4,16 (1,2 with --tiny)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--parts", default="chat,decoder")
    p.add_argument("--input-seconds", type=float, default=None, help="spoken question length (10; 2 with --tiny)")
    p.add_argument("--chat-dtype", default="auto", help="auto = bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--compile-config", default=None,
        help='generate_speech(compile_config=...) of the compiled rows as JSON, e.g. \'{"mode": "max-autotune"}\'',
    )
    p.add_argument(
        "--chat-backend", default="compiled", choices=["compiled", "cuda_graphs", "auto"],
        help="generate_speech(backend=...) of the chat's non-eager rows (their mode is still labelled 'compiled')",
    )
    p.add_argument(
        "--plan-overrides", default=None,
        help='SpeechGenerator(plan_overrides=...) as JSON, e.g. \'{"fold_crq_matching": false}\' (debugging)',
    )
    p.add_argument(
        "--compile-vocoder", action="store_true",
        help="compiled decoder mode also runs decoder.compile_vocoder() (HiFT's upsampling stack, dynamic shapes)",
    )
    p.add_argument(
        "--eager-prefill", action="store_true",
        help="also measure the time to first audio with backend='cuda_graphs' (no compiled prefill), side by side",
    )
    p.add_argument(
        "--kernel-config", default=None, metavar="JSON",
        help="DecodeKernelConfig field overrides for every chat call, e.g. '{\"attention_pipeline_stages\": 3}'\n"
             "(model.speech_generator(kernel_config=DecodeKernelConfig.for_device(device).replace(**JSON)))",
    )
    p.add_argument(
        "--plain-launches", action="store_true",
        help="the Triton decode kernels without programmatic dependent launch: --kernel-config's\n"
             "{\"programmatic_launch\": false}",
    )
    p.add_argument("--decoder-compile-config", default=None, help="JSON kwargs for the decoder's compile helper")
    p.add_argument(
        "--decoder-precision", default="auto", choices=["auto", "float32", "tf32", "bfloat16", "float16"],
        help="DiT estimator precision: auto (the decoder's default: bfloat16 on CUDA, float32 elsewhere); float32;\n"
        "tf32 (float32 + torch.backends.cuda.matmul.allow_tf32 = True); bfloat16 / float16\n"
        "(use_low_precision_estimator()). A precision check row compares it with float32",
    )
    p.add_argument("--decoder-tests", default="offline,stream", help="which decoder measurements to run")
    p.add_argument("--decoder-modes", default=None, help="decoder modes (default: --modes)")
    p.add_argument(
        "--stream-options", default=None,
        help='JSON kwargs for streaming_decoder(), e.g. \'{"flow_left_context_tokens": 100}\''
    )
    p.add_argument("--hop", type=int, default=15, help="streaming decoder token hop")
    p.add_argument("--decoder-seconds", default=None, help="decoder reply lengths (10,30; 1,2 with --tiny)")
    p.add_argument("--no-crq-share", dest="crq_share", action="store_false",
                   help="skip the compiled CRQ-share row (one more compile of the step, ~1 min on an H200)")
    p.add_argument("--ttfa-steps", type=int, default=None, help="max_new_tokens of the TTFA stream (40; 12 tiny)")
    p.add_argument("--repeat-calls", type=int, default=None, help="consecutive short calls (100; 3 with --tiny)")
    p.add_argument("--repeat-steps", type=int, default=8, help="max_new_tokens of each repeated call")
    p.add_argument(
        "--cache-steps", type=int, default=0,
        help="size the static caches for this many new tokens (a long max_new_tokens, the reply ending sooner);\n"
             "default: the longest measured run",
    )
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds; remaining measurements are skipped")
    p.add_argument("--bandwidth-mb", type=int, default=None, help="copy buffer size (default 2048 cuda, 64 cpu)")
    p.add_argument(
        "--compare", nargs="+", default=None, metavar="JSON",
        help="measure only chat variants, side by side: each a JSON object of generate_speech keyword arguments\n"
             "(e.g. '{\"plan_overrides\": {\"overlap_text_head\": false}}' '{}'), every round measuring each in turn, per batch size. A\n"
             "variant's \"kernel_config\" holds DecodeKernelConfig field overrides (e.g. '{\"kernel_config\":\n"
             "{\"attention_split_warps\": [[1, 4]]}}'): a config object passed down, which records the variant's\n"
             "own step graphs",
    )
    p.add_argument("--compare-rounds", type=int, default=3, help="rounds of --compare (medians reported)")
    p.add_argument(
        "--markdown", default=None, metavar="PATH",
        help="also write the markdown tables to PATH (replaced if it exists); default: print them only",
    )
    p.add_argument(
        "--from-json", default=None, metavar="FILE",
        help="render the tables of a results JSON (printed, and to --markdown PATH), then exit",
    )
    args = p.parse_args(argv)
    if args.markdown is not None and not Path(args.markdown).resolve().parent.is_dir():
        p.error(f"--markdown {args.markdown}: its folder does not exist")
    try:
        args.kernel_config = parse_kernel_config(args.kernel_config, args.plain_launches)
    except ValueError as error:
        p.error(f"--kernel-config: {error}")
    if args.compare is not None:
        try:
            args.compare = [json.loads(text) for text in args.compare]
        except json.JSONDecodeError as error:
            p.error(f"--compare takes JSON objects of generate_speech keyword arguments: {error}")
        if not all(isinstance(kwargs, dict) for kwargs in args.compare) or args.compare_rounds < 1:
            p.error("--compare takes JSON objects (e.g. '{\"plan_overrides\": {\"overlap_text_head\": false}}') and --compare-rounds >= 1")
        try:
            for kwargs in args.compare:
                parse_kernel_config(kwargs.get("kernel_config"))
        except ValueError as error:
            p.error(f"--compare: a variant's \"kernel_config\": {error}")
    # --tiny runs on a CPU in well under a minute: shorter audio and fewer repetitions (numbers are meaningless there).
    defaults = {
        "repeats": (3, 1),
        "input_seconds": (10.0, 2.0),
        "decoder_seconds": ("10,30", "1,2"),
        "ttfa_steps": (40, 12),
        "repeat_calls": (100, 3),
        "batch_sizes": ("1,4,16", "1,2"),
    }
    for name, (full, tiny) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.bandwidth_mb is None:
        args.bandwidth_mb = 2048 if is_cuda(args.device) else 64
    if args.decoder_precision == "auto":  # what CosyVoice3Config(estimator_precision="auto") gives on the device
        args.decoder_precision = "bfloat16" if is_cuda(args.device) else "float32"
    return args


def parse_kernel_config(value, plain_launches: bool = False) -> dict | None:
    """`DecodeKernelConfig` field overrides from JSON text or a parsed object (None: none), checked against the
    config's fields and values (`DecodeKernelConfig.replace`); `plain_launches` adds `programmatic_launch=False`.
    Raises ValueError naming what is wrong."""
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"takes a JSON object of DecodeKernelConfig fields, got {value!r}")
    overrides = dict(value or {}, **({"programmatic_launch": False} if plain_launches else {}))
    try:
        hash(DecodeKernelConfig().replace(**overrides))
    except TypeError as error:
        raise ValueError(f"{overrides!r}: {error}") from None
    return overrides or None


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def plan(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(kind, label, params) in priority order, so a run cut short by `--time-budget` still has the key numbers.

    Each new decoder shape (another offline length, the streaming window) costs a compile of ~90 s at full size, so
    the numbers that are furthest from their targets come first: the batch-1 step, the time to first audio and the
    streaming decoder (its graphs are the ones the time-to-first-audio stream captures), then the offline decoder.
    """
    modes = csv(args.modes)
    batches = [int(b) for b in csv(args.batch_sizes)]
    parts = csv(args.parts)
    compiled = [m for m in ("compiled", "eager") if m in modes]  # compiled first
    best = compiled[0] if compiled else "eager"
    first_batch = 1 if 1 in batches else batches[0]
    items: list[tuple[str, str, dict]] = []
    if "chat" in parts and args.compare:  # the variants side by side instead of the chat rows
        return [("compare", f"compare batch {b}", {"mode": best, "batch": b}) for b in batches]
    if "chat" in parts:
        for mode in compiled:
            items.append(("chat", f"chat {mode} batch {first_batch}", {"mode": mode, "batch": first_batch}))
        if "eager" in modes:
            items.append(("crq", f"CRQ share eager batch {first_batch}", {"mode": "eager", "batch": first_batch}))
    if "decoder" in parts:
        seconds = [float(s) for s in csv(args.decoder_seconds)]
        decoder_modes = csv(args.decoder_modes) if args.decoder_modes else modes
        tests = [test for test in ("stream", "offline") if test in csv(args.decoder_tests)]
        for mode in [m for m in ("compiled", "eager") if m in decoder_modes]:
            if mode == "compiled":
                items.append(("decoder_compile", "decoder compile", {"mode": mode}))
            if "chat" in parts and not any(kind == "ttfa" for kind, _, _ in items):  # the decoder as first set up
                items.append(("ttfa", f"time to first audio ({best})", {"mode": best}))
                if args.eager_prefill and best == "compiled":  # side by side: the same graphs apart from the prefill
                    label = f"time to first audio ({best}, eager prefill)"
                    items.append(("ttfa", label, {"mode": best, "eager_prefill": True}))
            for s in seconds:
                for test in tests:
                    label = f"decoder {mode} {test} {s:g} s"
                    items.append((f"decoder_{test}", label, {"mode": mode, "seconds": s}))
    if "chat" in parts:
        rest = sorted([b for b in batches if b != first_batch], reverse=True)  # batch 16 before batch 4
        for b in rest:
            for mode in compiled:
                items.append(("chat", f"chat {mode} batch {b}", {"mode": mode, "batch": b}))
        items.append(("repeat", f"{args.repeat_calls} consecutive calls ({best})", {"mode": best}))
        if "compiled" in modes and not args.tiny and args.crq_share:  # another compile: too slow for CPU smoke runs
            items.append(("crq", f"CRQ share compiled batch {first_batch}", {"mode": "compiled", "batch": first_batch}))
    return items


def raise_recompile_limits() -> None:
    """Several batch sizes / cache sizes / disable_speech each make a graph: never fall back to eager silently."""
    with contextlib.suppress(Exception):
        from torch import _dynamo

        config = _dynamo.config
        for name, value in (("cache_size_limit", 64), ("recompile_limit", 64), ("accumulated_cache_size_limit", 512)):
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), value))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_json:
        markdown = render_markdown(json.loads(Path(args.from_json).read_text()))
        log("\n" + markdown)
        if args.markdown:
            write_markdown(args.markdown, markdown)
        return 0
    if is_cuda(args.device) and not torch.cuda.is_available():
        log("CUDA is not available; use --device cpu")
        return 2
    budget = Budget(args.time_budget)
    results = Results(args, argv)
    meta = results.data["meta"]
    log(f"benchmark: {meta['gpu']} | torch {meta['torch']} | transformers {meta['transformers']} | {meta['command']}")
    torch.manual_seed(0)
    raise_recompile_limits()

    device = args.device
    bandwidth = run_measurement(
        results, budget, "copy bandwidth", lambda: measure_copy_bandwidth(device, args.bandwidth_mb), device
    )
    results.data["bandwidth"] = bandwidth
    if bandwidth.get("copy_gb_per_s"):
        log(f"copy bandwidth: {bandwidth['copy_gb_per_s']:.0f} GB/s")

    state: dict[str, Any] = {}

    def chat_model():
        if "chat" not in state:
            value = run_measurement(results, budget, "build chat model", lambda: build_chat_model(args), device)
            if isinstance(value, tuple):
                state["chat"], results.data["chat_model"] = value
                log(f"chat model: {json.dumps(results.data['chat_model'], default=str)}")
            else:
                state["chat"], results.data["chat_model"] = None, value
        if state["chat"] is None:
            raise RuntimeError(f"chat model unavailable ({results.data['chat_model'].get('status')})")
        return state["chat"]

    def decoder_model():
        if "decoder" not in state:
            value = run_measurement(results, budget, "build decoder", lambda: build_decoder(args), device)
            if isinstance(value, tuple):
                state["decoder"], results.data["decoder_model"] = value
                log(f"decoder: {json.dumps(results.data['decoder_model'], default=str)}")
                if args.decoder_precision != "float32":
                    # Against float32 first (same model, eager), then switch for every decoder measurement.
                    label = f"decoder precision check ({args.decoder_precision})"
                    row = run_measurement(
                        results, budget, label, lambda: decoder_precision_row(state["decoder"], args), device
                    )
                    results.add("decoder_precision", row)
                    if "mel_snr_db" in row:
                        log(f"  -> mel SNR {row['mel_snr_db']:.1f} dB, wav SNR {row['wav_snr_db']:.1f} dB vs float32")
                apply_decoder_precision(state["decoder"], args.decoder_precision)
            else:
                state["decoder"], results.data["decoder_model"] = None, value
        if state["decoder"] is None:
            raise RuntimeError(f"decoder unavailable ({results.data['decoder_model'].get('status')})")
        return state["decoder"]

    full_step_ms: dict[tuple[str, int], float] = {}
    try:
        run_plan(args, results, budget, bandwidth, chat_model, decoder_model, state, full_step_ms)
    except BudgetExceeded as error:  # the hard stop fired between two measurements: keep what was measured
        log(f"[stop] {one_line(error)}")
    budget.cancel_alarm()
    markdown = render_markdown(results.data)
    log("\n" + markdown)
    results.save()
    if args.markdown:
        write_markdown(args.markdown, markdown)
    return 0


def resident_gb(model) -> float:
    """Parameter + buffer bytes of a model on the device, in GB (0 for None)."""
    if model is None:
        return 0.0
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9


def exclude_other_model(row: dict, other) -> dict:
    """Peak memory of a measurement without the other model's weights (both models stay resident in one run)."""
    other_gb = resident_gb(other)
    if row.get("peak_gb") is not None and other_gb:
        row["peak_gb"] -= other_gb
        row["peak_excludes_gb"] = other_gb
    return row


def usable_mode(preferred: str, full_step_ms: dict) -> str:
    """The compiled mode for TTFA / repeated calls, unless every compiled chat measurement failed (then eager)."""
    measured = {mode for mode, _ in full_step_ms}
    if preferred in measured or not measured:
        return preferred
    return "eager" if "eager" in measured else preferred


def run_plan(args, results, budget, bandwidth, chat_model, decoder_model, state, full_step_ms) -> None:
    def measure(label: str, fn: Callable[[], Any]):
        return run_measurement(results, budget, label, fn, args.device)

    for kind, label, p in plan(args):
        mode = p.get("mode")
        if kind == "chat":
            row = measure(label, lambda: chat_step_row(chat_model(), bandwidth, mode, p["batch"], args, results))
            row = exclude_other_model({"mode": mode, "batch": p["batch"], **row}, state.get("decoder"))
            if "ms_per_step" in row:
                full_step_ms[(mode, p["batch"])] = row["ms_per_step"]
                log(f"  -> {row['ms_per_step']:.2f} ms/step, RTF {row['rtf']:.4f}, peak {fmt(row.get('peak_gb'))} GB")
            results.add("chat", row)
        elif kind == "compare":
            row = measure(label, lambda: compare_row(chat_model(), mode, p["batch"], args))
            results.add("compare", {"mode": mode, "batch": p["batch"], **row})
        elif kind == "crq":
            full = full_step_ms.get((mode, p["batch"]))
            row = measure(label, lambda: crq_share_row(chat_model(), mode, p["batch"], args, full))
            results.add("crq_share", {"mode": mode, "batch": p["batch"], **row})
        elif kind == "ttfa":
            mode = usable_mode(mode, full_step_ms)
            eager_prefill = p.get("eager_prefill", False) and mode == "compiled"
            label = f"time to first audio ({mode}{', eager prefill' if eager_prefill else ''})"
            row = measure(label, lambda: ttfa_row(chat_model(), decoder_model(), mode, args, eager_prefill))
            prefill = "compiled" if mode == "compiled" and not eager_prefill else "eager"
            row = {"mode": mode, "input_seconds": args.input_seconds, "prefill": prefill, **row}
            results.add("ttfa", row)  # both models count
        elif kind == "repeat":
            mode = usable_mode(mode, full_step_ms)
            label = f"{args.repeat_calls} consecutive calls ({mode})"
            row = measure(label, lambda: repeat_calls_row(chat_model(), mode, args))
            results.add("repeat_calls", exclude_other_model({"mode": mode, **row}, state.get("decoder")))
        elif kind == "decoder_compile":
            value = measure(label, lambda: compile_decoder(decoder_model(), args))
            if isinstance(value, dict):  # failed or skipped: no compiled decoder rows
                state["decoder_compile_failed"] = value["status"]
            else:
                log(f"  -> decoder compiled with {value}()")
        elif kind in ("decoder_offline", "decoder_stream"):
            name = f"{'offline' if kind == 'decoder_offline' else 'stream'} {p['seconds']:g} s"
            if mode == "compiled" and state.get("decoder_compile_failed"):
                row = {"status": state["decoder_compile_failed"]}
            else:
                fn = decoder_offline_row if kind == "decoder_offline" else decoder_stream_row
                row = measure(label, lambda: fn(decoder_model(), mode, p["seconds"], args))
            results.add("decoder", exclude_other_model({"mode": mode, "test": name, **row}, state.get("chat")))
        log(f"  (elapsed {budget.elapsed():.0f} s of {args.time_budget:.0f} s)")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without interpreter teardown: after a measurement interrupted by the time limit (e.g. inside a CUDA-graph
    # capture or with compile workers alive) teardown can hang, and the results are already written.
    os._exit(code)
