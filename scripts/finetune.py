#!/usr/bin/env python
"""Fine-tune Fun-Audio-Chat on JSON-lines conversations with the transformers `Trainer`.

Smoke run on CPU (tiny random model + a synthetic dataset written next to the outputs, a couple of minutes):

    python scripts/finetune.py --model tests/fixtures/funaudiochat_tiny --output-dir runs/tiny \\
        --max-steps 40 --learning-rate 2e-3 --save-steps 10
    python scripts/finetune.py ... --resume            # continue from the last checkpoint in --output-dir

Real model on one GPU:

    python scripts/finetune.py --model FunAudioLLM/Fun-Audio-Chat-8B --dataset train.jsonl --output-dir runs/sft \\
        --bf16 --gradient-checkpointing --lora --learning-rate 1e-4 --epochs 1

Several GPUs: the same script under `accelerate launch` (FSDP: `--config_file examples/accelerate_fsdp.yaml`) or
`torchrun`, see docs/finetuning.md. `--batch-size` is per process; `--global-batch-size` fixes the optimizer batch
whatever the number of processes (the gradient accumulation is derived from it), so runs on 1 and on N GPUs see the
same samples in the same optimizer steps.

The final model (LoRA merged back) and its processor are saved in `<output-dir>/final`, ready for
`FunAudioChatForConditionalGeneration.from_pretrained(...).generate_speech(...)`; `<output-dir>/train_metrics.json`
holds the run's throughput and, on GPUs, each process's peak memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from funaudiochat_hf import FunAudioChatForConditionalGeneration, FunAudioChatProcessor
from funaudiochat_hf.cli import _looks_local, one_line_error
from funaudiochat_hf.training_funaudiochat import (
    FunAudioChatTrainer,
    JsonlSpeechDataset,
    freeze_audio_encoder,
    lora_config,
    make_synthetic_dataset,
    merge_lora,
)


logger = logging.getLogger("finetune")

# transformers >= 5.20 renamed `gradient_checkpointing` to `activation_checkpointing` (the old name still works, with a
# deprecation warning); use whichever this version has.
_CHECKPOINTING_ARG = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Model folder or Hub id, e.g. tests/fixtures/funaudiochat_tiny.")
    parser.add_argument("--output-dir", required=True, help="Checkpoints, logs and the final model go here.")
    parser.add_argument("--dataset", help="JSON-lines training file (default: synthetic data in <output-dir>/data).")
    parser.add_argument("--eval-dataset", help="Optional JSON-lines evaluation file.")
    parser.add_argument("--synthetic-samples", type=int, default=16, help="Size of the synthetic dataset.")
    parser.add_argument("--max-steps", type=int, default=-1, help="Optimizer steps (overrides --epochs when > 0).")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=2, help="Per-device (per-process) batch size.")
    parser.add_argument("--grad-accum", type=int, default=None, help="Gradient accumulation steps (default 1).")
    parser.add_argument(
        "--global-batch-size", type=int, default=None,
        help="Samples per optimizer step over all processes; sets the gradient accumulation to "
        "global / (batch size x processes), which must divide evenly.",
    )  # fmt: skip
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="Reference full SFT: 1e-5; LoRA: ~1e-4.")
    parser.add_argument("--lr-scheduler", default="cosine")
    parser.add_argument("--warmup", type=float, default=0.02, help="Warmup: fraction of the steps (< 1) or steps.")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument(
        "--save-steps", type=int, default=500,
        help="Checkpoint every this many steps and at the last step; 0: no checkpoints at all.",
    )  # fmt: skip
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--eval-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resume", nargs="?", const="latest", default=None,
        help="Resume from a checkpoint folder, or (no value) from the last checkpoint in --output-dir.",
    )
    parser.add_argument("--lora", action="store_true", help="Train LoRA adapters on the LLM and CRQ projections.")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--lora-no-crq", action="store_true", help="LoRA on the LLM only.")
    parser.add_argument("--freeze-audio-encoder", action="store_true", help="Do not train the continuous encoder.")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU).")
    parser.add_argument("--attn-implementation", default=None, help="e.g. sdpa, flash_attention_2.")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config (see examples/deepspeed_zero*.json).")
    parser.add_argument(
        "--fsdp-config", default=None,
        help="FSDP through TrainingArguments: a JSON file of `fsdp_config` keys (docs/finetuning.md). Under "
        "`accelerate launch --config_file examples/accelerate_fsdp.yaml` leave it out: the launcher configures FSDP.",
    )  # fmt: skip
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers.")
    parser.add_argument("--report-to", default="none", help='"none", "tensorboard", "wandb", ...')
    parser.add_argument("--use-cpu", action="store_true", help="Train on CPU even if a GPU is present.")
    parser.add_argument(
        "--skip-final-save", action="store_true",
        help="Do not save the final model (measurement runs: add --save-steps 0 for no checkpoint either).",
    )  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="Show the full traceback of an error.")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def _read_fsdp_config(path: str) -> dict:
    config_path = Path(path).expanduser()
    if not config_path.is_file():
        raise ValueError(f"--fsdp-config: file '{path}' not found.")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"--fsdp-config: '{path}' is not valid JSON ({error.msg}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"--fsdp-config: '{path}' must hold a JSON object of fsdp_config keys.")
    return config


def fsdp_activation_checkpointing(args: argparse.Namespace) -> bool:
    """Whether FSDP's own activation checkpointing is on (`accelerate launch` config or `--fsdp-config`)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"
    if args.fsdp_config:
        config = _read_fsdp_config(args.fsdp_config)
        return bool(config.get("activation_checkpointing", config.get("fsdp_activation_checkpointing", False)))
    return False


def world_size() -> int:
    """Processes of this run, as `torchrun` / `accelerate launch` announce them before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_args(args: argparse.Namespace) -> None:
    """Refuse contradictory or impossible settings before anything is loaded."""
    if not args.learning_rate > 0:
        raise ValueError(f"--learning-rate must be > 0, got {args.learning_rate}.")
    for name in ("batch_size", "global_batch_size", "grad_accum", "logging_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
    if args.save_steps < 0:
        raise ValueError(f"--save-steps must be >= 0 (0: no checkpoints), got {args.save_steps}.")
    if args.eval_dataset and args.save_steps == 0 and not args.eval_steps:
        raise ValueError("--eval-dataset with --save-steps 0 needs --eval-steps (it defaults to --save-steps).")
    if args.global_batch_size is not None:
        if args.grad_accum is not None:
            raise ValueError("Give --global-batch-size or --grad-accum, not both (the first sets the second).")
        per_step = args.batch_size * world_size()
        if args.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} is not a multiple of --batch-size {args.batch_size} "
                f"x {world_size()} processes."
            )
        args.grad_accum = args.global_batch_size // per_step
    elif args.grad_accum is None:
        args.grad_accum = 1
    if args.fsdp_config:
        _read_fsdp_config(args.fsdp_config)  # a missing or malformed file fails here, not after loading the model
    if args.deepspeed and (args.fsdp_config or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"):
        raise ValueError("--deepspeed and FSDP exclude each other: pick one.")
    if args.lora and fsdp_activation_checkpointing(args):
        # FSDP's checkpointing wraps each layer in a CheckpointWrapper; peft then looks for the LoRA weights of those
        # layers under the wrapper's module names, which the gathered state dict does not use, and saves adapters
        # (final and in every checkpoint) without them.
        raise ValueError(
            "--lora with FSDP's activation checkpointing would save adapters without the LoRA weights of the "
            "checkpointed layers: use examples/accelerate_fsdp_lora.yaml (FSDP activation checkpointing off) and "
            "--gradient-checkpointing."
        )
    if args.gradient_checkpointing and fsdp_activation_checkpointing(args):
        raise ValueError(
            "--gradient-checkpointing and FSDP's activation checkpointing (fsdp_activation_checkpointing in the "
            "accelerate config / --fsdp-config) exclude each other: under FSDP drop --gradient-checkpointing."
        )


def check_paths(args: argparse.Namespace) -> None:
    """The model folder and the data files exist: checked before the model loads (not in `parse_args`, which
    `scripts/multi_gpu_check.py` runs on folders it has yet to write)."""
    if _looks_local(args.model) and not Path(args.model).expanduser().is_dir():
        raise ValueError(f"--model folder not found: {args.model}")
    for option, path in (("--dataset", args.dataset), ("--eval-dataset", args.eval_dataset)):
        if path is not None and not Path(path).expanduser().is_file():
            raise ValueError(f"{option} file not found: {path}")


def build_training_arguments(args: argparse.Namespace) -> TrainingArguments:
    kwargs = dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup if args.warmup < 1 else int(args.warmup),
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        logging_steps=args.logging_steps,
        # Trainer also checkpoints the last step under "steps"; "no" writes no checkpoint at all.
        save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=max(args.save_steps, 1),
        save_total_limit=args.save_total_limit,
        seed=args.seed,
        bf16=args.bf16,
        remove_unused_columns=False,  # the collator needs the raw conversations
        dataloader_num_workers=args.num_workers,
        dataloader_pin_memory=torch.cuda.is_available() and not args.use_cpu,
        report_to=[] if args.report_to == "none" else [args.report_to],
        use_cpu=args.use_cpu,
        deepspeed=args.deepspeed,
        fsdp=bool(args.fsdp_config),
        fsdp_config=_read_fsdp_config(args.fsdp_config) if args.fsdp_config else None,
        disable_tqdm=True,
    )
    if args.eval_dataset:
        kwargs.update(eval_strategy="steps", eval_steps=args.eval_steps or args.save_steps)
    if args.gradient_checkpointing:
        kwargs[_CHECKPOINTING_ARG] = True
    return TrainingArguments(**kwargs)


def resolve_checkpoint(resume: str | None, output_dir: str) -> str | None:
    if resume is None:
        return None
    if resume == "latest":
        checkpoint = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if checkpoint is None:
            raise ValueError(f"--resume: no checkpoint-* folder in '{output_dir}'.")
        return checkpoint
    if not Path(resume).is_dir():
        raise ValueError(f"--resume: checkpoint folder '{resume}' not found.")
    return resume


def main(argv: list[str] | None = None) -> Path | None:
    """Run the fine-tuning; returns the folder of the saved final model (None with --skip-final-save)."""
    args = parse_args(argv)
    check_paths(args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    checkpoint = resolve_checkpoint(args.resume, args.output_dir)
    training_args = build_training_arguments(args)
    set_seed(args.seed)

    processor = FunAudioChatProcessor.from_pretrained(args.model)
    model_kwargs = {"dtype": torch.float32}
    if args.attn_implementation:
        model_kwargs["attn_implementation"] = args.attn_implementation
    model = FunAudioChatForConditionalGeneration.from_pretrained(args.model, **model_kwargs)

    dataset_path = args.dataset
    if dataset_path is None:
        data_dir = Path(args.output_dir) / "data"
        # The main process writes it while the others wait, then they read it.
        with training_args.main_process_first(local=False, desc="synthetic dataset"):
            if training_args.process_index == 0:
                make_synthetic_dataset(data_dir, processor, num_samples=args.synthetic_samples, seed=args.seed)
        dataset_path = data_dir / "train.jsonl"
        logger.info("Using the synthetic dataset %s", dataset_path)
    train_dataset = JsonlSpeechDataset(dataset_path)
    eval_dataset = JsonlSpeechDataset(args.eval_dataset) if args.eval_dataset else None

    if args.freeze_audio_encoder:
        logger.info("Froze %d audio-encoder parameters", freeze_audio_encoder(model))
    if args.lora:
        from peft import get_peft_model

        config = lora_config(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             crq=not args.lora_no_crq)
        model = get_peft_model(model, config)
        model.print_trainable_parameters()

    timer = StepTimer()
    trainer = FunAudioChatTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processor=processor,
        callbacks=[timer],
    )
    requested_fsdp = bool(args.fsdp_config) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if requested_fsdp and not trainer.is_fsdp_enabled:
        # accelerate runs FSDP on accelerators only (on CPU processes it falls back to DDP).
        logger.warning("FSDP was requested but accelerate did not enable it on %s: running DDP.", training_args.device)
    global_batch = args.batch_size * training_args.world_size * args.grad_accum
    logger.info(
        "%d process(es) x batch %d x %d accumulation step(s) = %d samples per optimizer step",
        training_args.world_size, args.batch_size, args.grad_accum, global_batch,
    )  # fmt: skip
    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = {**train_output.metrics, **timer.metrics(global_batch), **peak_memory(trainer)}

    final_dir = Path(args.output_dir) / "final"
    if args.skip_final_save:
        final_dir = None
    elif args.lora:
        adapter_dir = Path(args.output_dir) / "adapter"
        trainer.save_model(str(adapter_dir))  # collective under FSDP / DeepSpeed: gathers the adapter weights
        if trainer.is_world_process_zero():
            if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
                # The trained model is sharded over the processes: merge the gathered adapter into a fresh base.
                merged = merge_saved_adapter(args.model, adapter_dir, model_kwargs)
            else:
                merged = merge_lora(trainer.accelerator.unwrap_model(trainer.model))
            merged.save_pretrained(final_dir)
            processor.save_pretrained(final_dir)
        trainer.accelerator.wait_for_everyone()
    else:
        trainer.save_model(str(final_dir))  # gathers FSDP / DeepSpeed shards; also saves the processor
    if trainer.is_world_process_zero():
        output_dir = Path(args.output_dir)
        history = output_dir / "log_history.json"
        history.write_text(json.dumps(trainer.state.log_history, indent=1), encoding="utf-8")
        (output_dir / "train_metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
        logger.info("Final model: %s; log history: %s; metrics: %s", final_dir, history, metrics)
    # Every process waits for the writer, then destroys its process group: a gloo group left to interpreter exit
    # can abort the process ("terminate called without an active exception") after a successful run.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return final_dir


class StepTimer(TrainerCallback):
    """Wall time at the end of every optimizer step, for the steady-state throughput (the first steps pay for
    allocation and autotuning, so `train_samples_per_second` of `Trainer`, which averages over the whole run,
    understates it)."""

    WARMUP_STEPS = 2

    def __init__(self):
        self.step_ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # once per optimizer step, outside the step's own work
        self.step_ends.append(time.perf_counter())

    def metrics(self, global_batch: int) -> dict:
        timed = self.step_ends[self.WARMUP_STEPS :]
        if len(timed) < 2:
            return {}
        seconds = (timed[-1] - timed[0]) / (len(timed) - 1)
        return {
            "steady_step_seconds": seconds,
            "steady_samples_per_second": global_batch / seconds,
            "steady_steps_timed": len(timed) - 1,
            "global_batch_size": global_batch,
        }


def peak_memory(trainer: FunAudioChatTrainer) -> dict:
    """Each process's peak CUDA memory (allocated by tensors / reserved by the caching allocator), in GiB."""
    if trainer.args.device.type != "cuda":
        return {}
    device = trainer.args.device
    local = torch.tensor(
        [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)], device=device
    ) / 2**30
    gathered = trainer.accelerator.gather(local[None]).tolist()  # one row per process
    return {
        "peak_allocated_gib_per_process": [round(row[0], 2) for row in gathered],
        "peak_reserved_gib_per_process": [round(row[1], 2) for row in gathered],
    }


def merge_saved_adapter(base_model: str, adapter_dir: Path, model_kwargs: dict):
    """A saved LoRA adapter merged into a freshly loaded base model (on the CPU of the calling process)."""
    from peft import PeftModel

    logger.info("Merging the LoRA adapter %s into %s", adapter_dir, base_model)
    base = FunAudioChatForConditionalGeneration.from_pretrained(base_model, **model_kwargs)
    return merge_lora(PeftModel.from_pretrained(base, str(adapter_dir)))


def run(argv: list[str] | None = None) -> None:
    """The command line: `main`, one line for a bad setting, file or data (`--debug`: the traceback), and on success
    the process group destroyed while the interpreter is still alive (`end_process_group`). Left to the interpreter's
    exit, gloo's worker threads could abort a finished rank ("terminate called without an active exception", SIGABRT)
    and fail the run. Not on failure: a rank that raised must not wait in a collective for the others."""
    try:
        main(argv)
    except (ValueError, OSError) as error:
        if "--debug" in (sys.argv if argv is None else argv):
            raise
        sys.exit(f"error: {one_line_error(error)}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        end_process_group()


# How long a rank whose run succeeded waits for its process group's teardown.
TEARDOWN_TIMEOUT_SECONDS = 60.0


def end_process_group(timeout: float = TEARDOWN_TIMEOUT_SECONDS) -> None:
    """`torch.distributed.destroy_process_group()`, waited for at most `timeout` s. It has been seen to hang in a rank
    whose run had finished, its files written, after the other rank had destroyed its group and exited (a CI run of
    two gloo processes; pytorch/pytorch#75097): the launcher then waited for that rank for good. Past the timeout the
    rank says so and exits at once, successfully: the interpreter's own exit would meet the same stuck teardown."""
    teardown = threading.Thread(target=torch.distributed.destroy_process_group, name="process-group-teardown",
                                daemon=True)  # fmt: skip
    teardown.start()
    teardown.join(timeout)
    if teardown.is_alive():
        logger.warning("The process group's teardown did not end within %g s; exiting without it (the run's files are "
                       "written).", timeout)  # fmt: skip
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    run()
