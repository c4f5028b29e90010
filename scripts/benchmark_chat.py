"""The chat part of `scripts/benchmark.py`: the full-size (or tiny) `FunAudioChatForConditionalGeneration` with
random weights, processor-shaped inputs, the `generate_speech` keywords of a row, and the rows: ms per LLM step (the
slope between two run lengths), `--compare` variants side by side, the CRQ's share of a step, the time to the first
audio chunk and repeated short calls."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import TYPE_CHECKING

import torch

from benchmark_common import (
    FUNAUDIOCHAT_TINY,
    STEP_SECONDS,
    TOKENS_PER_SECOND,
    allocated_gb,
    call_with_supported_kwargs,
    check_buffers_finite,
    cleanup,
    is_cuda,
    log,
    peak_gb,
    reset_peak,
    synchronize,
    timed,
)
from benchmark_decoder import speaker_embedding


if TYPE_CHECKING:
    from benchmark_results import Results


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
