#!/usr/bin/env python
"""Multi-GPU fine-tuning check: scripts/finetune.py under `accelerate launch` with examples/accelerate_fsdp.yaml
(FSDP2, full shard, activation checkpointing, frozen audio encoder; LoRA: examples/accelerate_fsdp_lora.yaml), run for
real, with a JSON + markdown summary.

    python scripts/multi_gpu_check.py --out "$OUT"                       # every part, on up to 2 GPUs
    python scripts/multi_gpu_check.py --out "$OUT" --parts reduced       # the reduced-depth parts only
    python scripts/multi_gpu_check.py --out "$OUT" --dry-run             # print the launches, run nothing

Everything uses random weights (offline): the processor is the tiny test model's (its tokenizers), the configs are
Fun-Audio-Chat-8B's architecture with the tiny tokenizers' special-token ids. The parts:

* `reduced` (full widths and vocabularies, 2 LLM / 2 CRQ / 2 audio-encoder layers, fits one GPU):
  - equivalence: 1 GPU x batch 2b against N GPUs x batch b (same seed, same equal-length data, float32 so the
    comparison sees the distribution and not bf16 rounding): per-step losses and the final weights' updates;
  - resume: the N-GPU run again from its middle checkpoint, against the uninterrupted run;
  - LoRA: N GPUs, bf16, the adapter merged into a saved model on the main process;
  - generate: both saved models loaded on one GPU with `from_pretrained`, then `generate_speech`.
* `fullsize` (Fun-Audio-Chat-8B's size): peak memory per GPU and steady-state samples/s, full fine-tuning (needs
  >= 2 GPUs: 8B parameters with fp32 Adam states do not fit one) and LoRA, bf16, as the yaml ships.
* `deepspeed`: the reduced model under examples/deepspeed_zero3.json on N GPUs, when `deepspeed` imports.

With one GPU the same command runs what applies (the 1-GPU side of every comparison, resume, generate, LoRA).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "fixtures" / "funaudiochat_tiny"
FSDP_YAML = REPO / "examples" / "accelerate_fsdp.yaml"
FSDP_LORA_YAML = REPO / "examples" / "accelerate_fsdp_lora.yaml"
ZERO3_JSON = REPO / "examples" / "deepspeed_zero3.json"
PARTS = ("reduced", "fullsize", "deepspeed")
# `accelerate launch` of this interpreter's accelerate (no reliance on PATH).
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
# float32 equivalence, 1 GPU against N: cuDNN convolutions (TF32 by default) and the summation order differ.
LOSS_RTOL = 1e-3
UPDATE_RTOL = 2e-2  # |w_N - w_1| / |w_1 - w_0| over the trained weights
# Resume on the same GPUs: only non-deterministic CUDA kernels (atomics in embedding backward) differ.
RESUME_LOSS_RTOL = 1e-4
# Full-size samples: a 16-s spoken question, a 16-s spoken reply (400 speech tokens at 25 Hz) of 48 words.
FULLSIZE_SAMPLE = {"seconds": 16.0, "speech_tokens": 400, "words": 48}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="Summary (summary.json, summary.md) and logs go here.")
    parser.add_argument(
        "--work-dir", default=str(REPO / "outputs" / "multi_gpu_work"),
        help="Models and runs (git-ignored default, kept between calls so parts can run in separate commands).",
    )  # fmt: skip
    parser.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated subset of {', '.join(PARTS)}.")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs for the multi-GPU side (at most those present).")
    parser.add_argument("--per-gpu-batch", type=int, default=4, help="b: N GPUs x b against 1 GPU x N*b.")
    parser.add_argument("--steps", type=int, default=8, help="Optimizer steps of the reduced-depth runs (even).")
    parser.add_argument("--fullsize-steps", type=int, default=6, help="Steps of each full-size run (2 are warm-up).")
    parser.add_argument("--fullsize-batch", type=int, default=4, help="Per-GPU batch of the full-size runs.")
    parser.add_argument("--timeout", type=int, default=540, help="Seconds allowed to each launch.")
    parser.add_argument("--dry-run", action="store_true", help="Print the launches instead of running them.")
    args = parser.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown --parts {unknown}; choose from {', '.join(PARTS)}.")
    if args.steps < 2 or args.steps % 2:
        parser.error("--steps must be even and >= 2 (the resume starts from the middle checkpoint).")
    if args.fullsize_steps < 4:
        parser.error("--fullsize-steps must be >= 4 (2 warm-up steps, then at least 2 timed ones).")
    if args.gpus < 1 or args.per_gpu_batch < 1 or args.fullsize_batch < 1:
        parser.error("--gpus, --per-gpu-batch and --fullsize-batch must be >= 1.")
    args.parts = parts
    return args


# ----------------------------------------------------------------------------------------------------------------
# Models and data
# ----------------------------------------------------------------------------------------------------------------


def _copy_token_ids(target: dict, source: dict) -> None:
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _copy_token_ids(target[key], value)
        elif str(key).endswith(("token_id", "_index")):
            target[key] = value


def full_size_config(llm_layers: int | None = None, crq_layers: int | None = None, encoder_layers: int | None = None):
    """Fun-Audio-Chat-8B's architecture (`FunAudioChatConfig()`) with the tiny test tokenizers' special-token ids, so
    the tiny processor can feed it; optionally fewer layers in the LLM, the CRQ and the audio encoder."""
    from funaudiochat_hf import FunAudioChatConfig

    config = FunAudioChatConfig().to_dict()
    _copy_token_ids(config, FunAudioChatConfig.from_pretrained(TINY).to_dict())
    for section, layers in ((config["text_config"], llm_layers),
                            (config["audio_config"]["crq_transformer_config"], crq_layers)):  # fmt: skip
        if layers is not None:
            section["num_hidden_layers"] = layers
            section["layer_types"] = section["layer_types"][:layers]
            section["max_window_layers"] = min(section.get("max_window_layers", layers), layers)
    if encoder_layers is not None:
        config["audio_config"]["encoder_layers"] = encoder_layers
    return FunAudioChatConfig.from_dict(config)


def build_model_folder(folder: Path, config, device: str = "cuda:0") -> dict:
    """Random bf16 weights built on `device` (`_from_config`) and saved with the tiny processor; `finetune.py` loads
    them in float32."""
    import torch

    from funaudiochat_hf import FunAudioChatForConditionalGeneration, FunAudioChatProcessor

    if (folder / ".complete").is_file():
        return json.loads((folder / ".complete").read_text())
    start = time.perf_counter()
    with torch.device(device):
        model = FunAudioChatForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    FunAudioChatProcessor.from_pretrained(TINY).save_pretrained(folder)
    info = {"parameters": sum(p.numel() for p in model.parameters()), "build_s": round(time.perf_counter() - start)}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    (folder / ".complete").write_text(json.dumps(info))
    return info


def write_dataset(folder: Path, num_samples: int, seconds: float, speech_tokens: int, words: int) -> Path:
    """Equal-length conversations: no batch pads anything, so batch b on N GPUs and batch N*b on one see the same
    tensors (a clip padded in a batch gets one more Whisper frame than alone)."""
    from funaudiochat_hf import FunAudioChatProcessor
    from funaudiochat_hf.training_funaudiochat import make_synthetic_dataset

    processor = FunAudioChatProcessor.from_pretrained(TINY)
    return make_synthetic_dataset(
        folder, processor, num_samples=num_samples, seed=0, min_seconds=seconds, max_seconds=seconds,
        min_words=words, max_words=words, min_speech_tokens=speech_tokens, max_speech_tokens=speech_tokens,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------------------------


class Runner:
    """Runs (or, dry, prints) the launches; keeps each one's command, log file and outcome for the summary."""

    def __init__(self, out: Path, timeout: int, dry_run: bool):
        self.logs = out / "logs"
        self.timeout = timeout
        self.dry_run = dry_run
        self.launches: list[dict] = []

    def finetune(self, name: str, processes: int, finetune_args: list[str], mixed_precision: str | None = None,
                 deepspeed: bool = False) -> dict:  # fmt: skip
        if deepspeed:
            launcher = [*ACCELERATE_LAUNCH, "--num_processes", str(processes), "--num_machines", "1",
                        "--mixed_precision", mixed_precision or "bf16", "--dynamo_backend", "no"]  # fmt: skip
            # DeepSpeed's "auto" precision follows TrainingArguments.bf16, so the script gets --bf16 as well.
            finetune_args = [*finetune_args, "--deepspeed", str(ZERO3_JSON), "--gradient-checkpointing", "--bf16"]
        else:
            # LoRA: the config without FSDP's activation checkpointing, and transformers' checkpointing instead.
            lora = "--lora" in finetune_args
            if lora:
                finetune_args = [*finetune_args, "--gradient-checkpointing"]
            config = FSDP_LORA_YAML if lora else FSDP_YAML
            launcher = [*ACCELERATE_LAUNCH, "--config_file", str(config), "--num_processes", str(processes)]
            if mixed_precision is not None:
                launcher += ["--mixed_precision", mixed_precision]
        launcher += ["--main_process_port", str(29500 + len(self.launches))]
        return self.run(name, [*launcher, str(REPO / "scripts" / "finetune.py"), *finetune_args])

    def run(self, name: str, command: list[str]) -> dict:
        record = {"name": name, "command": " ".join(command)}
        self.launches.append(record)
        print(f"[multi_gpu_check] {name}: {record['command']}", flush=True)
        if self.dry_run:
            record["ok"] = None
            return record
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        start = time.perf_counter()
        with log.open("w") as handle:
            try:
                code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
                                      timeout=self.timeout).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                code = "timeout"
        record.update(ok=code == 0, returncode=code, seconds=round(time.perf_counter() - start), log=str(log))
        if code != 0:
            record["log_tail"] = log.read_text(errors="replace")[-3000:]
            print(f"[multi_gpu_check] {name} FAILED ({code}); log tail:\n{record['log_tail']}", flush=True)
        return record


def prune_checkpoints(folder: Path, keep: tuple[int, ...] = ()) -> list[str]:
    """Delete `folder`'s `checkpoint-N` folders but those of steps `keep`; returns the names deleted. A reduced-depth
    checkpoint (full vocabularies, fp32 weights and Adam states) takes ~22 GB: a run's last one, never resumed from,
    filled a one-H100 machine's 64 GB disk before the LoRA run could save its model."""
    deleted = []
    for checkpoint in sorted(folder.glob("checkpoint-*")):
        step = checkpoint.name.removeprefix("checkpoint-")
        if checkpoint.is_dir() and not (step.isdigit() and int(step) in keep):
            shutil.rmtree(checkpoint)
            deleted.append(checkpoint.name)
    return deleted


def _losses(output_dir: Path) -> list[dict]:
    history = json.loads((output_dir / "log_history.json").read_text())
    return [{key: entry[key] for key in ("step", "loss", "text_loss", "speech_loss", "grad_norm")}
            for entry in history if "loss" in entry]  # fmt: skip


def _max_rel(rows_a: list[dict], rows_b: list[dict], key: str = "loss") -> float:
    return max(abs(a[key] - b[key]) / max(abs(b[key]), 1e-12) for a, b in zip(rows_a, rows_b))


def compare_weights(initial: Path, reference: Path, other: Path) -> dict:
    """How far `other`'s final weights are from `reference`'s, relative to how far training moved `reference`."""
    from safetensors.torch import load_file

    def load_weights(folder: Path) -> dict:  # one file or several shards
        return {name: value for path in sorted(folder.glob("*.safetensors")) for name, value in load_file(path).items()}

    w0, w1, w2 = (load_weights(folder) for folder in (initial, reference, other))
    diff_sq = update_sq = 0.0
    max_abs = 0.0
    for name, weight in w1.items():
        if name not in w0:
            continue
        weight = weight.double()
        update_sq += float((weight - w0[name].double()).square().sum())
        difference = w2[name].double() - weight
        diff_sq += float(difference.square().sum())
        max_abs = max(max_abs, float(difference.abs().max()))
    del w0, w1, w2
    return {"update_norm": update_sq**0.5, "diff_norm": diff_sq**0.5,
            "relative": (diff_sq / max(update_sq, 1e-30)) ** 0.5, "max_abs_diff": max_abs}  # fmt: skip


def generate_check(folder: Path, device: str = "cuda:0") -> dict:
    """`from_pretrained` on one device, then `generate_speech` on a synthetic spoken question."""
    import torch

    from funaudiochat_hf import FunAudioChatForConditionalGeneration, FunAudioChatProcessor
    from funaudiochat_hf.processing_funaudiochat import AUDIO_TEMPLATE, DEFAULT_S2M_PROMPT
    from funaudiochat_hf.tiny_model import synthetic_question

    model = FunAudioChatForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    processor = FunAudioChatProcessor.from_pretrained(folder)
    messages = [{"role": "system", "content": DEFAULT_S2M_PROMPT}, {"role": "user", "content": AUDIO_TEMPLATE}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=prompt, audio=[synthetic_question(2.0)], return_tensors="pt").to(device)
    inputs["input_features"] = inputs["input_features"].to(model.dtype)
    output = model.generate_speech(**inputs, max_new_tokens=16, do_sample=False, return_audio=False)
    result = {"sequence_shape": list(output.sequences.shape), "speech_ids_shape": list(output.speech_ids.shape),
              "prompt_length": int(inputs["input_ids"].shape[1]),
              "speech_head_tied": model.audio_invert_tower.lm_head.weight is model.audio_tower.embed_tokens.weight}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# ----------------------------------------------------------------------------------------------------------------
# Parts
# ----------------------------------------------------------------------------------------------------------------


def reduced_part(args, runner: Runner, work: Path, gpus: int, summary: dict) -> None:
    model_dir = work / "reduced_model"
    if not args.dry_run:
        summary["reduced_model"] = build_model_folder(model_dir, full_size_config(2, 2, 2))
    global_batch = gpus * args.per_gpu_batch
    data = work / "reduced_data" / "train.jsonl"
    if not args.dry_run:
        data = write_dataset(data.parent, global_batch * args.steps, seconds=4.0, speech_tokens=100, words=12)
    middle = args.steps // 2
    common = ["--model", str(model_dir), "--dataset", str(data), "--max-steps", str(args.steps),
              "--global-batch-size", str(global_batch), "--learning-rate", "1e-4", "--warmup", "0",
              "--freeze-audio-encoder", "--seed", "0"]  # fmt: skip
    runs = {"1gpu": work / "reduced_1gpu", f"{gpus}gpu": work / f"reduced_{gpus}gpu"}
    # Only the run that is resumed (the one on the most GPUs) writes checkpoints: fp32 Adam states are big.
    one_save = middle if gpus == 1 else 0
    one = runner.finetune("reduced_1gpu", 1, [*common, "--output-dir", str(runs["1gpu"]),
                          "--batch-size", str(global_batch), "--save-steps", str(one_save)], "no")  # fmt: skip
    result: dict = {"global_batch": global_batch, "steps": args.steps, "precision": "float32",
                    "tolerance": {"loss_rtol": LOSS_RTOL, "update_rtol": UPDATE_RTOL}}  # fmt: skip
    summary["equivalence"] = result
    if one["ok"]:
        result["losses_1gpu"] = _losses(runs["1gpu"])
    many = one
    if gpus > 1:
        many = runner.finetune(f"reduced_{gpus}gpu", gpus, [*common, "--output-dir", str(runs[f"{gpus}gpu"]),
                               "--batch-size", str(args.per_gpu_batch), "--save-steps", str(middle)], "no")  # fmt: skip
        if one["ok"] and many["ok"]:
            result[f"losses_{gpus}gpu"] = _losses(runs[f"{gpus}gpu"])
            result["loss_max_rel_diff"] = _max_rel(result[f"losses_{gpus}gpu"], result["losses_1gpu"])
            result["weights"] = compare_weights(model_dir, runs["1gpu"] / "final", runs[f"{gpus}gpu"] / "final")
            result["pass"] = result["loss_max_rel_diff"] <= LOSS_RTOL and result["weights"]["relative"] <= UPDATE_RTOL

    # Resume on the same number of GPUs from the middle checkpoint (the only one kept).
    source = runs[f"{gpus}gpu"]
    if not args.dry_run:
        prune_checkpoints(source, keep=(middle,))
    resumed_dir = work / f"reduced_{gpus}gpu_resumed"
    per_gpu = args.per_gpu_batch if gpus > 1 else global_batch
    resumed = runner.finetune(f"reduced_{gpus}gpu_resume", gpus, [*common, "--output-dir", str(resumed_dir),
                              "--batch-size", str(per_gpu), "--save-steps", "0",
                              "--resume", str(source / f"checkpoint-{middle}")], "no")  # fmt: skip
    resume: dict = {"gpus": gpus, "from_step": middle, "tolerance": {"loss_rtol": RESUME_LOSS_RTOL}}
    summary["resume"] = resume
    if many["ok"] and resumed["ok"]:
        full, again = _losses(source), _losses(resumed_dir)
        resume["steps_compared"] = [row["step"] for row in again if row["step"] > middle]
        resume["loss_max_rel_diff"] = _max_rel(again[middle:], full[middle:])
        resume["weights"] = compare_weights(model_dir, source / "final", resumed_dir / "final")
        resume["pass"] = resume["loss_max_rel_diff"] <= RESUME_LOSS_RTOL
    if not args.dry_run:  # the models compared are in final/: no checkpoint is read again
        prune_checkpoints(source)
        prune_checkpoints(resumed_dir)

    lora_dir = work / f"reduced_{gpus}gpu_lora"
    lora = runner.finetune(f"reduced_{gpus}gpu_lora", gpus, [
        "--model", str(model_dir), "--dataset", str(data), "--max-steps", "4", "--output-dir", str(lora_dir),
        "--batch-size", str(per_gpu), "--learning-rate", "1e-3", "--lora", "--freeze-audio-encoder",
        "--save-steps", "0"])  # fmt: skip
    summary["lora"] = {"gpus": gpus, "ok": lora["ok"]}
    if lora["ok"]:
        summary["lora"]["losses"] = _losses(lora_dir)
        summary["lora"]["adapter_saved"] = (lora_dir / "adapter" / "adapter_config.json").is_file()

    if args.dry_run:
        return
    generated = summary.setdefault("generate", {})
    for name, folder in ((f"full_ft_{gpus}gpu", source / "final"), (f"lora_{gpus}gpu", lora_dir / "final")):
        if not (folder / "config.json").is_file():
            generated[name] = {"ok": False, "error": f"{folder} was not saved"}
            continue
        try:
            generated[name] = {"ok": True, **generate_check(folder)}
        except Exception as error:  # noqa: BLE001 - the summary reports it and the other checks still run
            generated[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}


def fullsize_part(args, runner: Runner, work: Path, gpus: int, summary: dict) -> None:
    model_dir = work / "full_model"
    if not args.dry_run:
        summary["full_model"] = build_model_folder(model_dir, full_size_config())
    data = work / "full_data" / "train.jsonl"
    if not args.dry_run:
        samples = gpus * args.fullsize_batch * args.fullsize_steps
        data = write_dataset(data.parent, samples, **FULLSIZE_SAMPLE)
    results = summary.setdefault(
        "fullsize", {"sample": FULLSIZE_SAMPLE, "gpus": gpus, "per_gpu_batch": args.fullsize_batch}
    )
    variants = {"lora": ["--lora", "--learning-rate", "1e-4"], "full": ["--learning-rate", "1e-5"]}
    for variant, extra in variants.items():
        if variant == "full" and gpus < 2:
            results[variant] = {"skipped": "8B parameters with fp32 master weights and Adam states need >= 2 GPUs"}
            continue
        output_dir = work / f"full_{variant}_{gpus}gpu"
        launch = runner.finetune(f"fullsize_{variant}_{gpus}gpu", gpus, [
            "--model", str(model_dir), "--dataset", str(data), "--output-dir", str(output_dir),
            "--max-steps", str(args.fullsize_steps), "--batch-size", str(args.fullsize_batch),
            "--freeze-audio-encoder", "--save-steps", "0", "--skip-final-save", *extra])  # fmt: skip
        results[variant] = {"command": launch["command"], "ok": launch["ok"]}
        if launch["ok"]:
            results[variant].update(json.loads((output_dir / "train_metrics.json").read_text()))


def deepspeed_part(args, runner: Runner, work: Path, gpus: int, summary: dict) -> None:
    try:
        import deepspeed  # noqa: F401

        version = deepspeed.__version__
    except Exception as error:  # noqa: BLE001 - DeepSpeed is optional; say why it did not run
        summary["deepspeed"] = {"skipped": f"deepspeed does not import ({type(error).__name__}: {error})"}
        return
    model_dir, data = work / "reduced_model", work / "reduced_data" / "train.jsonl"
    if not data.is_file() and not args.dry_run:
        summary["deepspeed"] = {"skipped": "needs the reduced part's model and data (run --parts reduced first)"}
        return
    output_dir = work / f"reduced_{gpus}gpu_zero3"
    launch = runner.finetune(f"reduced_{gpus}gpu_zero3", gpus, [
        "--model", str(model_dir), "--dataset", str(data), "--output-dir", str(output_dir), "--max-steps", "4",
        "--batch-size", str(args.per_gpu_batch), "--learning-rate", "1e-4", "--freeze-audio-encoder",
        "--save-steps", "0"], deepspeed=True)  # fmt: skip
    summary["deepspeed"] = {"version": version, "ok": launch["ok"]}
    if launch["ok"]:
        summary["deepspeed"]["losses"] = _losses(output_dir)
        summary["deepspeed"].update(json.loads((output_dir / "train_metrics.json").read_text()))


# ----------------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------------


def environment() -> dict:
    import accelerate
    import torch
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "gpus_present": torch.cuda.device_count()}  # fmt: skip
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import peft

        info["peft"] = peft.__version__
    except ImportError:
        info["peft"] = None
    return info


def render_markdown(summary: dict) -> str:
    lines = ["# Multi-GPU fine-tuning check", "", f"Environment: `{json.dumps(summary['environment'])}`", ""]
    equivalence = summary.get("equivalence")
    if equivalence and "loss_max_rel_diff" in equivalence:
        gpus = summary["gpus"]
        lines += [f"## Equivalence: 1 GPU x {equivalence['global_batch']} vs {gpus} GPUs x "
                  f"{equivalence['global_batch'] // gpus} (float32, reduced depth)", "",
                  f"| step | loss, 1 GPU | loss, {gpus} GPUs |", "|---|---|---|"]  # fmt: skip
        for one, many in zip(equivalence["losses_1gpu"], equivalence[f"losses_{gpus}gpu"]):
            lines.append(f"| {one['step']} | {one['loss']:.6f} | {many['loss']:.6f} |")
        weights = equivalence["weights"]
        lines += ["", f"Max relative loss difference {equivalence['loss_max_rel_diff']:.2e} (tolerance {LOSS_RTOL}); "
                  f"final weights: |w_{gpus} - w_1| / |w_1 - w_0| = {weights['relative']:.2e} (tolerance "
                  f"{UPDATE_RTOL}), max abs difference {weights['max_abs_diff']:.2e}. Pass: {equivalence['pass']}.", ""]
    resume = summary.get("resume")
    if resume and "loss_max_rel_diff" in resume:
        lines += [f"## Resume on {resume['gpus']} GPU(s) from step {resume['from_step']}", "",
                  f"Steps {resume['steps_compared']}: max relative loss difference {resume['loss_max_rel_diff']:.2e} "
                  f"(tolerance {RESUME_LOSS_RTOL}); final weights relative difference "
                  f"{resume['weights']['relative']:.2e}. Pass: {resume['pass']}.", ""]  # fmt: skip
    for name, result in summary.get("generate", {}).items():
        lines.append(f"- generate_speech after `from_pretrained` ({name}): {result}")
    fullsize = summary.get("fullsize")
    if fullsize:
        lines += ["", f"## Full size (random weights), {fullsize['gpus']} GPU(s), per-GPU batch "
                  f"{fullsize['per_gpu_batch']}, samples {fullsize['sample']}", "",
                  "| run | peak allocated GiB per GPU | peak reserved GiB per GPU | samples/s (steady) |",
                  "|---|---|---|---|"]  # fmt: skip
        for variant in ("full", "lora"):
            row = fullsize.get(variant, {})
            if "skipped" in row or not row.get("ok"):
                status = row.get("skipped") or ("not run" if row.get("ok") is None else "failed")
                lines.append(f"| {variant} | {status} | | |")
                continue
            lines.append(f"| {variant} | {row.get('peak_allocated_gib_per_process')} | "
                         f"{row.get('peak_reserved_gib_per_process')} | "
                         f"{row.get('steady_samples_per_second', float('nan')):.2f} |")  # fmt: skip
    if "deepspeed" in summary:
        lines += ["", f"DeepSpeed ZeRO-3: {summary['deepspeed']}"]
    lines += ["", "## Launches", ""]
    for launch in summary["launches"]:
        lines.append(f"- {launch['name']} ({'ok' if launch.get('ok') else launch.get('returncode')}, "
                     f"{launch.get('seconds')} s): `{launch['command']}`")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir).expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    import torch

    present = torch.cuda.device_count()
    if present == 0 and not args.dry_run:
        raise SystemExit("No CUDA device: this check runs on GPUs (tests/test_training_distributed.py covers CPU).")
    gpus = min(args.gpus, present) if present else args.gpus
    summary: dict = {"environment": environment(), "gpus": gpus, "parts": args.parts}
    runner = Runner(out, args.timeout, args.dry_run)
    summary["launches"] = runner.launches
    parts = {"reduced": reduced_part, "fullsize": fullsize_part, "deepspeed": deepspeed_part}
    for part in args.parts:
        start = time.perf_counter()
        try:
            parts[part](args, runner, work, gpus, summary)
        except Exception as error:  # noqa: BLE001 - report the failed part, keep the others
            summary[f"{part}_error"] = f"{type(error).__name__}: {error}"
            print(f"[multi_gpu_check] part {part} failed: {summary[f'{part}_error']}", flush=True)
        summary[f"{part}_seconds"] = round(time.perf_counter() - start)
        # Written after every part: a run cut short still leaves what it measured.
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        (out / "summary.md").write_text(render_markdown(summary))
    print(render_markdown(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
