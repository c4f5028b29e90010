"""Fine-tuning: Trainer on the tiny model (loss, logging, gradient accumulation), gradient checkpointing, frozen audio
encoder, LoRA (+ merge), the JSON-lines dataset and scripts/finetune.py (checkpoint, resume, save, generate_speech)."""

import json
import re
import wave
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from funaudiochat_hf import FunAudioChatForConditionalGeneration, FunAudioChatProcessor
from funaudiochat_hf.data_collator_funaudiochat import FunAudioChatDataCollator
from funaudiochat_hf.processing_funaudiochat import AUDIO_TEMPLATE, DEFAULT_S2M_PROMPT
from funaudiochat_hf.training_funaudiochat import (
    FunAudioChatTrainer,
    JsonlSpeechDataset,
    freeze_audio_encoder,
    lora_config,
    lora_target_modules,
    make_synthetic_dataset,
    merge_lora,
)

from conftest import FUNAUDIOCHAT_TINY, load_module


REPO = Path(__file__).resolve().parents[1]
# transformers >= 5.20 renamed the TrainingArguments field (the old name still works, with a deprecation warning).
_CHECKPOINTING_ARG = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


@pytest.fixture(scope="module")
def processor():
    return FunAudioChatProcessor.from_pretrained(FUNAUDIOCHAT_TINY)


@pytest.fixture(scope="module")
def dataset_path(processor, tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("data"), processor, num_samples=8, seed=0)


def _model() -> FunAudioChatForConditionalGeneration:
    return FunAudioChatForConditionalGeneration.from_pretrained(FUNAUDIOCHAT_TINY)


def _args(output_dir, **kwargs) -> TrainingArguments:
    defaults = dict(
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
    )
    return TrainingArguments(str(output_dir), **{**defaults, **kwargs})


def _batch(processor, dataset, indices=(0, 1)):
    return FunAudioChatDataCollator(processor)([dataset[i] for i in indices])


def _train_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


# ------------------------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------------------------


def test_trainer_loss_goes_down_and_logs_text_and_speech_loss(processor, dataset_path, tmp_path):
    dataset = JsonlSpeechDataset(dataset_path)
    trainer = FunAudioChatTrainer(
        model=_model(),
        args=_args(tmp_path, max_steps=24, logging_steps=4, eval_strategy="no"),
        train_dataset=dataset,
        eval_dataset=dataset,
        processing_class=processor,  # moved to `processor=`: Trainer must not realign the model's special ids
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert len(logs) == 6
    for entry in logs:
        # the optimised loss is the model's loss = text + speech, each averaged over the same logging window
        assert entry["loss"] == pytest.approx(entry["text_loss"] + entry["speech_loss"], rel=1e-5)
    assert logs[-1]["loss"] < 0.6 * logs[0]["loss"]
    assert logs[-1]["text_loss"] < logs[0]["text_loss"] and logs[-1]["speech_loss"] < logs[0]["speech_loss"]

    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(metrics["eval_text_loss"] + metrics["eval_speech_loss"], rel=1e-5)
    # The trainer must not rewrite the model's special ids (the model reads text eos/pad for its transcript targets).
    assert trainer.model.config.text_config.eos_token_id == _model().config.text_config.eos_token_id


def test_logged_losses_are_exact_window_means(processor, dataset_path, tmp_path):
    """loss / text_loss / speech_loss logged for one step = mean of the model's per-micro-batch values; with gradient
    accumulation the plain `Trainer` averages (not sums) the micro-batch losses too."""
    dataset = JsonlSpeechDataset(dataset_path)
    two = torch.utils.data.Subset(dataset, [0, 1])
    model = _model()
    with torch.no_grad():
        outs = [model(**_batch(processor, dataset, (i,))) for i in (0, 1)]
    expected = {name: sum(float(getattr(o, name)) for o in outs) / 2 for name in ("loss", "text_loss", "speech_loss")}

    args = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1, learning_rate=0.0)
    ours = FunAudioChatTrainer(
        model=_model(), args=_args(tmp_path / "a", **args), train_dataset=two, processor=processor
    )
    ours.train()
    plain = Trainer(
        model=_model(),
        args=_args(tmp_path / "b", **args),
        train_dataset=two,
        data_collator=FunAudioChatDataCollator(processor),
    )
    plain.train()
    logged = _train_logs(ours)[0]
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value, rel=1e-4)
    assert _train_logs(plain)[0]["loss"] == pytest.approx(expected["loss"], rel=1e-4)
    assert _train_logs(plain)[0]["grad_norm"] == pytest.approx(logged["grad_norm"], rel=1e-4)


def test_gradient_checkpointing_recomputes_and_matches(processor, dataset_path):
    dataset = JsonlSpeechDataset(dataset_path)
    batch = _batch(processor, dataset)

    def run(checkpointing: bool):
        model = _model().train()
        if checkpointing:
            # (renamed `activation_checkpointing_enable` in transformers 5.20)
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        calls = {"llm": 0, "crq": 0, "encoder": 0}
        # Attention of checkpointed layers: it runs again when the backward pass recomputes its layer (torch may stop
        # the recomputation early, before the layer's MLP, so the MLP is not a reliable probe).
        layers = {
            "llm": model.language_model.model.layers[0].self_attn,
            "crq": model.audio_invert_tower.crq_transformer.layers[0].self_attn,
            "encoder": model.continuous_audio_tower.layers[0].self_attn,
        }
        for name, layer in layers.items():
            layer.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        out = model(**batch)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.loss.detach(), grads, calls

    loss, grads, calls = run(False)
    ckpt_loss, ckpt_grads, ckpt_calls = run(True)
    assert calls == {"llm": 1, "crq": 1, "encoder": 1}
    assert ckpt_calls == {"llm": 2, "crq": 2, "encoder": 2}  # recomputed in the backward pass
    torch.testing.assert_close(ckpt_loss, loss, rtol=0, atol=1e-6)
    assert grads.keys() == ckpt_grads.keys()
    for name in grads:
        torch.testing.assert_close(ckpt_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_frozen_audio_encoder_gets_no_grads(processor, dataset_path):
    model = _model().train()
    frozen = freeze_audio_encoder(model)
    assert frozen == sum(p.numel() for p in model.continuous_audio_tower.parameters())
    model(**_batch(processor, JsonlSpeechDataset(dataset_path))).loss.backward()
    assert all(p.grad is None for p in model.continuous_audio_tower.parameters())
    # Everything fed by the encoder still learns, incl. the projection of its features.
    assert model.audio_tower.continual_output_matching.weight.grad.abs().sum() > 0
    assert model.language_model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="continuous_audio_tower"):
        freeze_audio_encoder(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------------------------
# LoRA
# ------------------------------------------------------------------------------------------------------------------


def test_lora_target_modules_cover_llm_and_crq_projections_only():
    model = _model()
    pattern = lora_target_modules()
    hit = sorted(name for name, _ in model.named_modules() if re.fullmatch(pattern, name))
    n_llm = model.config.text_config.num_hidden_layers
    n_crq = model.config.audio_config.crq_transformer_config.num_hidden_layers
    assert len(hit) == 7 * (n_llm + n_crq) + 3
    assert "audio_invert_tower.pre_matching" in hit and "audio_invert_tower.output_matching" in hit
    assert "language_model.model.layers.0.mlp.down_proj" in hit
    assert not any(name.startswith("continuous_audio_tower") or name.endswith("lm_head") for name in hit)
    assert all(name.startswith("language_model") for name in hit if re.fullmatch(lora_target_modules(crq=False), name))
    with pytest.raises(ValueError):
        lora_target_modules(llm=False, crq=False)


def test_lora_trains_only_adapters_and_merge_reproduces(processor, dataset_path, tmp_path):
    from peft import get_peft_model

    dataset = JsonlSpeechDataset(dataset_path)
    model = _model()
    base_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    peft_model = get_peft_model(model, lora_config(r=4, lora_alpha=8))
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)

    trainer = FunAudioChatTrainer(
        model=peft_model,
        args=_args(tmp_path / "run", max_steps=6, learning_rate=1e-2, **{_CHECKPOINTING_ARG: True}),
        train_dataset=dataset,
        processor=processor,
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert logs[-1]["loss"] < logs[0]["loss"] and "speech_loss" in logs[-1]

    state = {
        name.removeprefix("base_model.model.").replace(".base_layer", ""): tensor
        for name, tensor in peft_model.state_dict().items()
        if "lora_" not in name
    }
    assert state.keys() == base_state.keys()
    assert all(torch.equal(state[name], base_state[name]) for name in base_state), "a base weight changed"
    lora_b = [p for name, p in peft_model.named_parameters() if "lora_B" in name]
    assert all(p.abs().sum() > 0 for p in lora_b)  # every adapter (LLM and CRQ) was trained

    batch = _batch(processor, dataset, (2, 3))
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(**batch)
    merged = merge_lora(peft_model)
    assert type(merged) is FunAudioChatForConditionalGeneration
    with torch.no_grad():
        merged_out = merged(**batch)
    torch.testing.assert_close(merged_out.logits, adapted.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(merged_out.speech_logits, adapted.speech_logits, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert not torch.allclose(_model()(**batch).logits, adapted.logits, atol=1e-3)  # the adapters matter

    # The merged model saves and reloads to the same outputs (the tied speech head survives the merge).
    merged.save_pretrained(tmp_path / "merged")
    reloaded = FunAudioChatForConditionalGeneration.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        reloaded_out = reloaded(**batch)
    torch.testing.assert_close(reloaded_out.speech_logits, adapted.speech_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(reloaded_out.logits, adapted.logits, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------


def test_synthetic_dataset_is_deterministic_and_collates(processor, dataset_path, tmp_path):
    again = make_synthetic_dataset(tmp_path, processor, num_samples=8, seed=0)
    assert again.read_text() == dataset_path.read_text()
    assert (tmp_path / "audio" / "0003.wav").read_bytes() == (dataset_path.parent / "audio" / "0003.wav").read_bytes()
    assert make_synthetic_dataset(tmp_path / "other", processor, num_samples=8, seed=1).read_text() != again.read_text()

    dataset = JsonlSpeechDataset(again)
    assert len(dataset) == 8
    sample = dataset[0]
    assert Path(sample["messages"][0]["audio"]).is_file()  # relative path resolved against the jsonl folder
    with wave.open(sample["messages"][0]["audio"]) as handle:
        assert handle.getframerate() == 16000
    tokens = sample["messages"][1]["speech_tokens"]
    assert all(0 <= t < model_speech_vocab(processor) for t in tokens)
    batch = _batch(processor, dataset, (0, 1, 2))
    assert batch["feature_exist_mask"].tolist() == [True, False] * 3
    assert (batch["labels"] != -100).any()


def model_speech_vocab(processor) -> int:
    return sum(1 for token in processor.speech_tokenizer.get_vocab() if re.fullmatch(r"\[AU\d+\]", token))


def test_jsonl_dataset_reports_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": []}\n{"messages": [\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: invalid JSON"):
        JsonlSpeechDataset(path)
    path.write_text('{"text": "no messages"}\n')
    with pytest.raises(ValueError, match="'messages'"):
        JsonlSpeechDataset(path)
    with pytest.raises(ValueError, match="not found"):
        JsonlSpeechDataset(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------------------------------------------
# scripts/finetune.py
# ------------------------------------------------------------------------------------------------------------------


def _finetune_script():
    return load_module(REPO / "scripts" / "finetune.py", "finetune_script")


def _finetune(output_dir, *extra) -> Path:
    argv = [
        "--model", str(FUNAUDIOCHAT_TINY), "--output-dir", str(output_dir), "--synthetic-samples", "8",
        "--max-steps", "6", "--save-steps", "3", "--learning-rate", "2e-3", "--use-cpu", *extra,
    ]  # fmt: skip
    return _finetune_script().main(argv)


def test_finetune_destroys_the_process_group_after_a_successful_run_only(monkeypatch):
    """The command line destroys the process group once `main` returned: left to the interpreter's exit, gloo's worker
    threads could abort a rank that had finished and saved ("terminate called without an active exception", seen in
    the two-process FSDP test). A failed run leaves it (its rank must not wait in a collective for the others)."""
    script = _finetune_script()
    destroyed = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda *args: destroyed.append(True))
    monkeypatch.setattr(script, "main", lambda argv: None)
    script.run([])
    assert destroyed == [True]

    def failing(argv):
        raise ValueError("no such dataset")

    monkeypatch.setattr(script, "main", failing)
    with pytest.raises(SystemExit, match="error: no such dataset"):
        script.run([])
    assert destroyed == [True]


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("finetune_full")
    final = _finetune(output_dir)
    return output_dir, final


def test_finetune_resume_continues_the_same_run(uninterrupted_run, tmp_path):
    full_dir, full_final = uninterrupted_run
    assert (full_dir / "checkpoint-3").is_dir() and (full_dir / "checkpoint-6").is_dir()
    resumed_final = _finetune(tmp_path, "--resume", str(full_dir / "checkpoint-3"))

    full_log = json.loads((full_dir / "log_history.json").read_text())
    resumed_log = json.loads((tmp_path / "log_history.json").read_text())
    keys = ("step", "loss", "text_loss", "speech_loss")
    losses = [[entry.get(key) for key in keys] for entry in full_log if "loss" in entry]
    resumed = [[entry.get(key) for key in keys] for entry in resumed_log if "loss" in entry]
    assert [row[0] for row in resumed] == [1, 2, 3, 4, 5, 6]
    for row, resumed_row in zip(losses, resumed):
        assert resumed_row == pytest.approx(row, rel=1e-6), row[0]
    full_weights = load_file(full_final / "model.safetensors")
    resumed_weights = load_file(resumed_final / "model.safetensors")
    assert full_weights.keys() == resumed_weights.keys()
    for name in full_weights:
        torch.testing.assert_close(resumed_weights[name], full_weights[name], rtol=0, atol=1e-6, msg=name)


def test_finetune_resume_latest_needs_a_checkpoint(tmp_path):
    script = _finetune_script()
    with pytest.raises(ValueError, match="no checkpoint"):
        script.resolve_checkpoint("latest", str(tmp_path))
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-10").mkdir()
    assert script.resolve_checkpoint("latest", str(tmp_path)).endswith("checkpoint-10")


def test_finetuned_model_generates_speech(uninterrupted_run):
    full_dir, final = uninterrupted_run
    log = [entry for entry in json.loads((full_dir / "log_history.json").read_text()) if "loss" in entry]
    assert log[-1]["loss"] < log[0]["loss"]

    model = FunAudioChatForConditionalGeneration.from_pretrained(final).eval()
    processor = FunAudioChatProcessor.from_pretrained(final)
    base = _model()
    assert model.config.text_config.eos_token_id == base.config.text_config.eos_token_id
    assert not torch.equal(model.language_model.lm_head.weight, base.language_model.lm_head.weight)  # trained
    assert model.audio_invert_tower.lm_head.weight is model.audio_tower.embed_tokens.weight

    sample = JsonlSpeechDataset(full_dir / "data" / "train.jsonl")[0]
    messages = [{"role": "system", "content": DEFAULT_S2M_PROMPT}, {"role": "user", "content": AUDIO_TEMPLATE}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=prompt, audio=[sample["messages"][0]["audio"]], return_tensors="pt")
    output = model.generate_speech(**inputs, max_new_tokens=12, do_sample=False, return_audio=False)
    prompt_length = inputs["input_ids"].shape[1]
    assert output.sequences.shape[0] == 1 and output.sequences.shape[1] > prompt_length
    assert torch.equal(output.sequences[:, :prompt_length], inputs["input_ids"])
    codebook = model.config.audio_config.codebook_size
    assert output.speech_ids.shape[1] % model.config.audio_config.group_size == 0
    assert ((output.speech_ids >= 0) & (output.speech_ids < codebook)).all()


def test_finetune_script_lora_saves_a_merged_model(tmp_path):
    final = _finetune(
        tmp_path, "--lora", "--lora-r", "4", "--freeze-audio-encoder", "--gradient-checkpointing",
        "--max-steps", "3", "--save-steps", "3", "--learning-rate", "1e-2",
    )  # fmt: skip
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    model = FunAudioChatForConditionalGeneration.from_pretrained(final)
    base = _model()
    assert model.audio_invert_tower.lm_head.weight is model.audio_tower.embed_tokens.weight
    assert torch.equal(model.audio_tower.embed_tokens.weight, base.audio_tower.embed_tokens.weight)
    assert torch.equal(model.continuous_audio_tower.conv1.weight, base.continuous_audio_tower.conv1.weight)
    # the adapters are merged into the projections they target
    merged_projections = (
        "language_model.model.layers.0.self_attn.q_proj",
        "audio_invert_tower.crq_transformer.layers.1.mlp.up_proj",
    )
    for name in merged_projections:
        assert not torch.equal(model.get_submodule(name).weight, base.get_submodule(name).weight), name
