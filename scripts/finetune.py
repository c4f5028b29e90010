#!/usr/bin/env python
"""Fine-tune Fun-Audio-Chat on JSON-lines conversations with the transformers `Trainer`.

Smoke run on CPU (tiny random model + a synthetic dataset written next to the outputs, a couple of minutes):

    python scripts/finetune.py --model tests/fixtures/funaudiochat_tiny --output-dir runs/tiny \\
        --max-steps 40 --learning-rate 2e-3 --save-steps 10
    python scripts/finetune.py ... --resume            # continue from the last checkpoint in --output-dir

Real model (one GPU; multi-GPU: `accelerate launch` + `--fsdp-config` / `--deepspeed`, see docs/finetuning.md):

    python scripts/finetune.py --model FunAudioLLM/Fun-Audio-Chat-8B --dataset train.jsonl --output-dir runs/sft \\
        --bf16 --gradient-checkpointing --lora --learning-rate 1e-4 --epochs 1

The final model (LoRA merged back) and its processor are saved in `<output-dir>/final`, ready for
`FunAudioChatForConditionalGeneration.from_pretrained(...).generate_speech(...)`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from transformers import TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from funaudiochat_hf import FunAudioChatForConditionalGeneration, FunAudioChatProcessor
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
    parser.add_argument("--batch-size", type=int, default=2, help="Per-device batch size.")
    parser.add_argument("--grad-accum", type=int, default=1, help="Gradient accumulation steps.")
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="Reference full SFT: 1e-5; LoRA: ~1e-4.")
    parser.add_argument("--lr-scheduler", default="cosine")
    parser.add_argument("--warmup", type=float, default=0.02, help="Warmup: fraction of the steps (< 1) or steps.")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--save-steps", type=int, default=500, help="Checkpoint every this many steps.")
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
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config (see examples/deepspeed_zero2.json).")
    parser.add_argument("--fsdp", default=None, help='FSDP options, e.g. "full_shard auto_wrap".')
    parser.add_argument("--fsdp-config", default=None, help="FSDP JSON config (see docs/finetuning.md).")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers.")
    parser.add_argument("--report-to", default="none", help='"none", "tensorboard", "wandb", ...')
    parser.add_argument("--use-cpu", action="store_true", help="Train on CPU even if a GPU is present.")
    return parser.parse_args(argv)


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
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        seed=args.seed,
        bf16=args.bf16,
        remove_unused_columns=False,  # the collator needs the raw conversations
        dataloader_num_workers=args.num_workers,
        dataloader_pin_memory=torch.cuda.is_available() and not args.use_cpu,
        report_to=[] if args.report_to == "none" else [args.report_to],
        use_cpu=args.use_cpu,
        deepspeed=args.deepspeed,
        fsdp=args.fsdp or "",
        fsdp_config=args.fsdp_config,
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


def main(argv: list[str] | None = None) -> Path:
    """Run the fine-tuning; returns the folder of the saved final model."""
    args = parse_args(argv)
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

    trainer = FunAudioChatTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processor=processor,
    )
    trainer.train(resume_from_checkpoint=checkpoint)

    final_dir = Path(args.output_dir) / "final"
    if args.lora:
        adapter_dir = Path(args.output_dir) / "adapter"
        trainer.save_model(str(adapter_dir))
        if trainer.is_fsdp_enabled:
            # The weights are sharded over the processes: merge offline (docs/finetuning.md, "LoRA").
            logger.warning("FSDP: saved the LoRA adapter to %s; merge it offline with `merge_lora`.", adapter_dir)
            final_dir = adapter_dir
        elif trainer.is_world_process_zero():
            merged = merge_lora(trainer.accelerator.unwrap_model(trainer.model))
            merged.save_pretrained(final_dir)
            processor.save_pretrained(final_dir)
    else:
        trainer.save_model(str(final_dir))  # gathers FSDP / DeepSpeed shards; also saves the processor
    if trainer.is_world_process_zero():
        history = Path(args.output_dir) / "log_history.json"
        history.write_text(json.dumps(trainer.state.log_history, indent=1), encoding="utf-8")
        logger.info("Saved the final model to %s (log history: %s)", final_dir, history)
    return final_dir


if __name__ == "__main__":
    main()
