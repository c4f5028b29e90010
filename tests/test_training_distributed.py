"""Fine-tuning on several processes, on CPU: the accelerate FSDP configs as the launcher hands them to FSDP (which
layers become FSDP units, where the tied speech head lives), the DeepSpeed configs, scripts/finetune.py's multi-process
arguments, scripts/multi_gpu_check.py's plan, and two processes on the gloo backend against one: DDP, and accelerate's
own FSDP2 code (tests/fsdp_on_cpu.py: accelerate enables FSDP on accelerators only) with loss curves, weights,
save / resume, LoRA and bf16. NCCL, CUDA memory and speed are left to scripts/multi_gpu_check.py on GPUs."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from safetensors.torch import load_file

from funaudiochat_hf import FunAudioChatForConditionalGeneration, FunAudioChatProcessor
from funaudiochat_hf.training_funaudiochat import freeze_audio_encoder, lora_config, make_synthetic_dataset

from conftest import FUNAUDIOCHAT_TINY, load_module


REPO = Path(__file__).resolve().parents[1]
FSDP_YAML = REPO / "examples" / "accelerate_fsdp.yaml"
FSDP_LORA_YAML = REPO / "examples" / "accelerate_fsdp_lora.yaml"
# The speech head and the speech embedding are one tensor (`_tied_weights_keys`): it must stay in one FSDP unit.
TIED_SPEECH_HEAD = ("audio_tower.embed_tokens.weight", "audio_invert_tower.lm_head.weight")


def _load_script(name: str):
    return load_module(REPO / "scripts" / f"{name}.py", name)


@pytest.fixture(scope="module")
def finetune():
    return _load_script("finetune")


@pytest.fixture(scope="module")
def tiny_model():
    return FunAudioChatForConditionalGeneration.from_pretrained(FUNAUDIOCHAT_TINY)


# ------------------------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------------------------


def _launcher_env(config_file: Path, num_processes: int = 2, *options: str) -> dict:
    """The FSDP / accelerate environment `accelerate launch --config_file ... [options]` gives each process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", str(config_file), "--num_processes", str(num_processes), *options, "scripts/finetune.py"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    env = prepare_multi_gpu_env(args)
    return {key: value for key, value in env.items() if key.startswith(("FSDP_", "ACCELERATE_"))}


def test_fsdp_yaml_is_an_fsdp2_bf16_config_with_activation_checkpointing():
    raw = yaml.safe_load(FSDP_YAML.read_text())
    fsdp = raw["fsdp_config"]
    assert raw["distributed_type"] == "FSDP" and raw["mixed_precision"] == "bf16" and not raw["use_cpu"]
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_reshard_after_forward"] is True  # full shard
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # the final save must load with from_pretrained
    # keys FSDP2 declares obsolete (accelerate warns and drops them)
    assert not {"fsdp_sync_module_states", "fsdp_use_orig_params", "fsdp_backward_prefetch"} & set(fsdp)

    from accelerate.utils import FullyShardedDataParallelPlugin

    env = _launcher_env(FSDP_YAML)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.activation_checkpointing and plugin.cpu_ram_efficient_loading
    assert plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["Qwen3DecoderLayer", "Qwen2_5OmniAudioEncoderLayer"]
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)


def _fsdp_units(model, env: dict) -> list[str]:
    """Names of the modules accelerate's FSDP2 preparation shards as units of their own (besides the root)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    return [name for name, module in model.named_modules() if name and policy(module)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp_units_are_the_transformer_layers_and_the_tied_head_stays_in_the_root(tiny_model, lora):
    from peft import get_peft_model

    model = FunAudioChatForConditionalGeneration.from_pretrained(FUNAUDIOCHAT_TINY)
    freeze_audio_encoder(model)
    if lora:
        model = get_peft_model(model, lora_config(r=2))
    prefix = "base_model.model." if lora else ""
    config = tiny_model.config
    expected = (
        [f"{prefix}continuous_audio_tower.layers.{i}" for i in range(config.audio_config.encoder_layers)]
        + [
            f"{prefix}audio_invert_tower.crq_transformer.layers.{i}"
            for i in range(config.audio_config.crq_transformer_config.num_hidden_layers)
        ]
        + [f"{prefix}language_model.model.layers.{i}" for i in range(config.text_config.num_hidden_layers)]
    )
    config_file = FSDP_LORA_YAML if lora else FSDP_YAML
    units = _fsdp_units(model, _launcher_env(config_file))
    assert units == expected
    for unit in units:
        names = {f"{unit}.{name}" for name, _ in model.get_submodule(unit).named_parameters()}
        assert not names & {prefix + name for name in TIED_SPEECH_HEAD}, unit
    # Why the config names the classes: accelerate's default (the model's `_no_split_modules`) would shard the
    # discrete encoder and the CRQ decoder as two units, each holding one end of the tied speech head.
    env = {key: value for key, value in _launcher_env(config_file).items() if key != "FSDP_TRANSFORMER_CLS_TO_WRAP"}
    default_units = _fsdp_units(model, env)
    assert f"{prefix}audio_tower" in default_units and f"{prefix}audio_invert_tower" in default_units


def test_deepspeed_configs_take_batch_and_precision_from_the_trainer():
    for stage in (2, 3):
        config = json.loads((REPO / "examples" / f"deepspeed_zero{stage}.json").read_text())
        assert config["zero_optimization"]["stage"] == stage
        for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
            assert config[key] == "auto", key
        assert config["bf16"]["enabled"] == "auto"
    zero3 = json.loads((REPO / "examples" / "deepspeed_zero3.json").read_text())["zero_optimization"]
    assert zero3["stage3_gather_16bit_weights_on_model_save"] is True  # else the final save holds empty tensors


# ------------------------------------------------------------------------------------------------------------------
# scripts/finetune.py arguments
# ------------------------------------------------------------------------------------------------------------------


def _argv(*extra) -> list[str]:
    return ["--model", str(FUNAUDIOCHAT_TINY), "--output-dir", "unused", *extra]


def test_global_batch_size_sets_the_accumulation_per_world_size(finetune, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert finetune.parse_args(_argv("--batch-size", "2", "--global-batch-size", "16")).grad_accum == 4
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert finetune.parse_args(_argv("--batch-size", "2", "--global-batch-size", "16")).grad_accum == 8
    assert finetune.parse_args(_argv("--batch-size", "2")).grad_accum == 1
    assert finetune.parse_args(_argv("--grad-accum", "3")).grad_accum == 3
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="not a multiple of --batch-size 2 x 4 processes"):
        finetune.parse_args(_argv("--batch-size", "2", "--global-batch-size", "12"))
    with pytest.raises(ValueError, match="not both"):
        finetune.parse_args(_argv("--global-batch-size", "16", "--grad-accum", "2"))
    with pytest.raises(ValueError, match="--batch-size must be >= 1"):
        finetune.parse_args(_argv("--batch-size", "0"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/no/such/model", "--output-dir", "unused"], "--model folder not found: /no/such/model"),
        (_argv("--dataset", "/no/such/train.jsonl"), "--dataset file not found: /no/such/train.jsonl"),
        (_argv("--eval-dataset", "/no/such/eval.jsonl"), "--eval-dataset file not found"),
        (_argv("--learning-rate", "-1"), "--learning-rate must be > 0"),
    ],
)
def test_missing_files_and_bad_rates_are_refused_before_loading(finetune, monkeypatch, argv, message):
    monkeypatch.setattr(finetune.FunAudioChatProcessor, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=message):
        finetune.main(argv)


def test_a_setup_error_is_one_line_without_a_traceback(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "finetune.py"
    argv = [sys.executable, str(script), *_argv("--dataset", str(tmp_path / "missing.jsonl"))]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"error: --dataset file not found: {tmp_path / 'missing.jsonl'}"]
    debug = subprocess.run(argv + ["--debug"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_gradient_checkpointing_conflicts_with_fsdp_activation_checkpointing(finetune, monkeypatch, tmp_path):
    with monkeypatch.context() as patch:
        for key, value in _launcher_env(FSDP_YAML).items():
            patch.setenv(key, value)
        with pytest.raises(ValueError, match="drop --gradient-checkpointing"):
            finetune.parse_args(_argv("--gradient-checkpointing"))
        assert not finetune.parse_args(_argv()).gradient_checkpointing
        with pytest.raises(ValueError, match="exclude each other: pick one"):
            finetune.parse_args(_argv("--deepspeed", "examples/deepspeed_zero3.json"))
        with pytest.raises(ValueError, match="use examples/accelerate_fsdp_lora.yaml"):
            finetune.parse_args(_argv("--lora"))
    with monkeypatch.context() as patch:
        for key, value in _launcher_env(FSDP_LORA_YAML).items():
            patch.setenv(key, value)
        args = finetune.parse_args(_argv("--lora", "--gradient-checkpointing"))
        assert args.lora and args.gradient_checkpointing
    fsdp_json = tmp_path / "fsdp.json"
    fsdp_json.write_text(json.dumps({"version": 2, "activation_checkpointing": True}))
    with pytest.raises(ValueError, match="drop --gradient-checkpointing"):
        finetune.parse_args(_argv("--fsdp-config", str(fsdp_json), "--gradient-checkpointing"))
    fsdp_json.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        finetune.parse_args(_argv("--fsdp-config", str(fsdp_json)))
    with pytest.raises(ValueError, match="not found"):
        finetune.parse_args(_argv("--fsdp-config", str(tmp_path / "missing.json")))


def test_fsdp_config_file_turns_fsdp_on_in_the_training_arguments(finetune, tmp_path):
    fsdp_json = tmp_path / "fsdp.json"
    layers = ["Qwen3DecoderLayer", "Qwen2_5OmniAudioEncoderLayer"]
    fsdp_json.write_text(json.dumps({"version": 2, "transformer_layer_cls_to_wrap": layers}))
    args = finetune.build_training_arguments(
        finetune.parse_args(_argv("--fsdp-config", str(fsdp_json), "--use-cpu", "--output-dir", str(tmp_path)))
    )
    assert args.fsdp and args.fsdp_config["version"] == 2
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == layers
    plain = finetune.build_training_arguments(finetune.parse_args(_argv("--use-cpu", "--output-dir", str(tmp_path))))
    assert not plain.fsdp


# ------------------------------------------------------------------------------------------------------------------
# Two processes (DDP, and accelerate's FSDP2 path, on gloo) against one
# ------------------------------------------------------------------------------------------------------------------


STEPS = 4
FSDP_ON_CPU = REPO / "tests" / "fsdp_on_cpu.py"


@pytest.fixture(scope="module")
def equal_length_dataset(tmp_path_factory):
    """Every clip equally long and every reply equally many speech tokens: the batches of one and of two samples then
    pad nothing (Whisper features of a clip padded in a batch get one more frame than alone, a real difference)."""
    processor = FunAudioChatProcessor.from_pretrained(FUNAUDIOCHAT_TINY)
    return make_synthetic_dataset(
        tmp_path_factory.mktemp("equal"), processor, num_samples=8, seed=3, min_seconds=1.0, max_seconds=1.0,
        min_words=3, max_words=3, min_speech_tokens=20, max_speech_tokens=20,
    )  # fmt: skip


def _script_args(dataset: Path, output_dir: Path, *extra) -> list[str]:
    return [
        "--model", str(FUNAUDIOCHAT_TINY), "--dataset", str(dataset), "--output-dir", str(output_dir),
        "--max-steps", str(STEPS), "--save-steps", "2", "--learning-rate", "2e-3", "--use-cpu", "--num-workers", "0",
        "--freeze-audio-encoder", *extra,
    ]  # fmt: skip


def _torchrun(argv: list[str], fsdp: Path | None = None, mixed_precision: str = "no") -> None:
    """scripts/finetune.py on 2 CPU processes: DDP, or accelerate's FSDP2 path with the `fsdp` accelerate config
    (float32 by default: the 1-process references are float32)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        *([str(FSDP_ON_CPU)] if fsdp else []), str(REPO / "scripts" / "finetune.py"), *argv,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    if fsdp:
        env.update(_launcher_env(fsdp, 2, "--mixed_precision", mixed_precision))
    result = run_or_dump_stacks(command, env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def run_or_dump_stacks(command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`command` with faulthandler on in it and its children (the launcher's ranks), every one of them marked
    (`RUN_MARK`). If it has not ended after `timeout` s, each marked process gets SIGABRT in turn, the launcher first:
    each Python process prints where every one of its threads is, and the test fails with that and what they printed
    before (a run that once hung after training had finished gave no clue where it waited). In turn, because their
    dumps share one stderr and would interleave; the launcher first, because a rank that ends first lets it return.
    Found by their mark, not their process group: torchrun starts each rank in a session of its own, and a rank whose
    launcher has died is an orphan; one that outlived its launcher holds the output pipes, and waiting for them then
    never ended (a CI run hung for good). Whatever survives the dumps is killed."""
    mark = uuid.uuid4().hex
    process = subprocess.Popen(
        command, env={**env, "PYTHONFAULTHANDLER": "1", RUN_MARK: mark}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        others = sorted(pid for pid in _processes_of_run(mark) if pid != process.pid)
        for pid in (process.pid, *others):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
                time.sleep(DUMP_SECONDS)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # not even a dump: kill them all
            for pid in (process.pid, *_processes_of_run(mark)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stdout, stderr = process.communicate(timeout=30)
        pytest.fail(f"the run hung for {timeout} s; its output and each process's threads:\n{stdout[-3000:]}\n"
                    f"{stderr[-12000:]}")  # fmt: skip
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# What a process aborted by `run_or_dump_stacks` gets to print its threads before the next one is aborted.
DUMP_SECONDS = 0.5
# The environment variable that marks every process of one `run_or_dump_stacks` run (its value: the run's id).
RUN_MARK = "FUNAUDIOCHAT_TEST_RUN"


def _processes_of_run(mark: str) -> list[int]:
    """The ids of the live processes whose environment holds `RUN_MARK` = `mark`."""
    needle = f"{RUN_MARK}={mark}".encode()
    return _processes_where("environ", lambda environ: needle in environ.split(b"\0"))


def _processes_where(proc_file: str, matches) -> list[int]:
    """The ids of the live processes whose `/proc/<id>/<proc_file>` (bytes) `matches` (Linux)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/{proc_file}", "rb") as content:
                if matches(content.read()):
                    found.append(int(entry))
    return found


def _losses(output_dir: Path) -> list[list[float]]:
    history = json.loads((output_dir / "log_history.json").read_text())
    keys = ("step", "loss", "text_loss", "speech_loss", "grad_norm")
    return [[entry[key] for key in keys] for entry in history if "loss" in entry]


def _assert_same_training(run: Path, reference: Path, loss_rtol: float, weight_atol: float) -> None:
    losses, expected = _losses(run), _losses(reference)
    assert [row[0] for row in losses] == [row[0] for row in expected] == list(range(1, STEPS + 1))
    for row, expected_row in zip(losses, expected):
        assert row == pytest.approx(expected_row, rel=loss_rtol), row[0]
    weights = load_file(run / "final" / "model.safetensors")
    expected_weights = load_file(reference / "final" / "model.safetensors")
    assert weights.keys() == expected_weights.keys()
    for name, weight in expected_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=0, atol=weight_atol, msg=name)


@pytest.fixture(scope="module")
def one_process_run(equal_length_dataset, finetune, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("one_process")
    finetune.main(_script_args(equal_length_dataset, output_dir, "--batch-size", "2"))
    return output_dir


@pytest.fixture(scope="module")
def ddp_run(equal_length_dataset, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("ddp")
    _torchrun(_script_args(equal_length_dataset, output_dir, "--batch-size", "1"))
    return output_dir


@pytest.fixture(scope="module")
def fsdp_run(equal_length_dataset, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("fsdp")
    _torchrun(_script_args(equal_length_dataset, output_dir, "--batch-size", "1"), fsdp=FSDP_YAML)
    return output_dir


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["ddp", "fsdp"])
def test_two_processes_match_one_process_with_twice_the_batch(launch, one_process_run, request):
    """2 processes x batch 1 = 1 process x batch 2: same samples per step (the seeded sampler's permutation, the
    processes take alternate batches of it), the gradients averaged over the processes as over the batch. float32;
    only the summation order of the loss and the gradients differs."""
    run = request.getfixturevalue(f"{launch}_run")
    checkpoint = run / "checkpoint-2"
    assert {path.name for path in checkpoint.glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert (checkpoint / "pytorch_model_fsdp.bin").is_file() == (launch == "fsdp")  # really sharded, or really not
    _assert_same_training(run, one_process_run, loss_rtol=1e-5, weight_atol=1e-5)
    losses = _losses(one_process_run)
    assert losses[-1][1] < losses[0][1]  # it trains
    metrics = json.loads((run / "train_metrics.json").read_text())
    assert metrics["global_batch_size"] == 2 and metrics["steady_samples_per_second"] > 0
    # The GPU driver's measure of the same: the difference relative to the update training made.
    compare_weights = _load_script("multi_gpu_check").compare_weights
    same = compare_weights(FUNAUDIOCHAT_TINY, one_process_run / "final", run / "final")
    assert same["update_norm"] > 0.1 and same["relative"] < 1e-5
    assert compare_weights(FUNAUDIOCHAT_TINY, run / "final", FUNAUDIOCHAT_TINY)["relative"] == pytest.approx(1)


@pytest.mark.slow
def test_fsdp_resume_continues_the_run_and_the_saved_model_generates(fsdp_run, equal_length_dataset, tmp_path):
    """Save on 2 FSDP processes, resume on 2: the same losses and weights; the full-state-dict save loads with
    `from_pretrained` and `generate_speech` runs on it."""
    _torchrun(_script_args(equal_length_dataset, tmp_path, "--batch-size", "1",
                           "--resume", str(fsdp_run / "checkpoint-2")), fsdp=FSDP_YAML)  # fmt: skip
    _assert_same_training(tmp_path, fsdp_run, loss_rtol=1e-6, weight_atol=1e-6)
    result = _load_script("multi_gpu_check").generate_check(fsdp_run / "final", "cpu")
    assert result["speech_head_tied"] and result["sequence_shape"][1] > result["prompt_length"]


@pytest.mark.slow
def test_fsdp_in_bf16_as_shipped_trains_like_float32(fsdp_run, equal_length_dataset, tmp_path):
    """The shipped config's bf16: FSDP2 computes with bf16 copies of the float32 master weights (no dtype clash in
    the audio encoder, the CRQ or the losses), and saves float32 weights."""
    _torchrun(_script_args(equal_length_dataset, tmp_path, "--batch-size", "1", "--save-steps", "0"),
              fsdp=FSDP_YAML, mixed_precision="bf16")  # fmt: skip
    losses, float32 = _losses(tmp_path), _losses(fsdp_run)
    assert [row[1:4] for row in losses] != [row[1:4] for row in float32]  # bf16 really ran
    for row, reference in zip(losses, float32):
        assert row[1:4] == pytest.approx(reference[1:4], rel=2e-2), row[0]  # loss, text_loss, speech_loss
    weights = load_file(tmp_path / "final" / "model.safetensors")
    assert {weight.dtype for weight in weights.values()} == {torch.float32}


@pytest.mark.slow
def test_fsdp_lora_saves_the_merged_model_of_a_single_process_run(equal_length_dataset, finetune, tmp_path):
    """LoRA on 2 FSDP processes: the gathered adapter, merged on the main process into a fresh base model, gives the
    model a single process trains with twice the batch."""
    lora = ("--lora", "--lora-r", "4", "--save-steps", "0", "--gradient-checkpointing")
    _torchrun(_script_args(equal_length_dataset, tmp_path / "fsdp", "--batch-size", "1", *lora), fsdp=FSDP_LORA_YAML)
    finetune.main(_script_args(equal_length_dataset, tmp_path / "one", "--batch-size", "2", *lora))
    adapters = [load_file(tmp_path / run / "adapter" / "adapter_model.safetensors") for run in ("fsdp", "one")]
    assert adapters[0].keys() == adapters[1].keys()  # every LoRA weight gathered, the layers' too
    _assert_same_training(tmp_path / "fsdp", tmp_path / "one", loss_rtol=1e-5, weight_atol=1e-5)
    base = load_file(FUNAUDIOCHAT_TINY / "model.safetensors")
    merged = load_file(tmp_path / "fsdp" / "final" / "model.safetensors")
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[name], base[name])  # the adapters are in


# ------------------------------------------------------------------------------------------------------------------
# scripts/multi_gpu_check.py (the GPU driver): what it would launch, checked on CPU
# ------------------------------------------------------------------------------------------------------------------


def _planned_launches(tmp_path: Path, gpus: int) -> dict[str, list[str]]:
    check = _load_script("multi_gpu_check")
    summary = check.main(["--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--dry-run",
                          "--gpus", str(gpus), "--parts", "reduced,fullsize"])  # fmt: skip
    assert (tmp_path / "out" / "summary.md").is_file()
    return {launch["name"]: launch["command"].split() for launch in summary["launches"]}


def _finetune_args(finetune, command: list[str]):
    """The launch's processes, and its finetune.py arguments as the script parses them under that launch."""
    processes = int(command[command.index("--num_processes") + 1])
    config_file = Path(command[command.index("--config_file") + 1])
    script_args = command[command.index(str(REPO / "scripts" / "finetune.py")) + 1 :]
    assert config_file == (FSDP_LORA_YAML if "--lora" in script_args else FSDP_YAML)
    with mock.patch.dict(os.environ, {**_launcher_env(config_file, processes), "WORLD_SIZE": str(processes)}):
        return processes, finetune.parse_args(script_args)


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_multi_gpu_check_compares_equal_global_batches_and_resumes_the_multi_gpu_run(tmp_path, finetune):
    launches = _planned_launches(tmp_path, gpus=2)
    assert list(launches) == ["reduced_1gpu", "reduced_2gpu", "reduced_2gpu_resume", "reduced_2gpu_lora",
                              "fullsize_lora_2gpu", "fullsize_full_2gpu"]  # fmt: skip
    parsed = {name: _finetune_args(finetune, command) for name, command in launches.items()}
    (one_gpus, one), (two_gpus, two) = parsed["reduced_1gpu"], parsed["reduced_2gpu"]
    assert (one_gpus, one.batch_size, one.grad_accum) == (1, 8, 1)
    assert (two_gpus, two.batch_size, two.grad_accum) == (2, 4, 1)
    for key in ("model", "dataset", "max_steps", "seed", "learning_rate", "warmup", "freeze_audio_encoder"):
        assert getattr(one, key) == getattr(two, key), key
    for name in ("reduced_1gpu", "reduced_2gpu", "reduced_2gpu_resume"):
        assert _option(launches[name], "--mixed_precision") == "no"  # float32 comparison
    resumed = parsed["reduced_2gpu_resume"][1]
    assert resumed.resume == str(Path(two.output_dir) / "checkpoint-4") and two.save_steps == 4
    assert one.save_steps == 0  # the 1-GPU run is not resumed: no fp32 optimizer checkpoint
    assert parsed["reduced_2gpu_lora"][1].lora and not parsed["reduced_2gpu_lora"][1].skip_final_save
    full, lora = parsed["fullsize_full_2gpu"][1], parsed["fullsize_lora_2gpu"][1]
    assert not full.lora and lora.lora and full.skip_final_save and lora.skip_final_save
    assert full.save_steps == lora.save_steps == resumed.save_steps == 0  # no 9.4B-parameter fp32 checkpoints
    assert "--mixed_precision" not in launches["fullsize_full_2gpu"]  # bf16 as the yaml ships
    for _, args in parsed.values():  # LoRA: transformers' checkpointing; full fine-tuning: FSDP's
        assert args.freeze_audio_encoder and args.gradient_checkpointing == args.lora


def test_multi_gpu_check_on_one_gpu_runs_what_applies(tmp_path, finetune):
    launches = _planned_launches(tmp_path, gpus=1)
    assert list(launches) == ["reduced_1gpu", "reduced_1gpu_resume", "reduced_1gpu_lora", "fullsize_lora_1gpu"]
    one = _finetune_args(finetune, launches["reduced_1gpu"])[1]
    resumed = _finetune_args(finetune, launches["reduced_1gpu_resume"])[1]
    assert resumed.resume == str(Path(one.output_dir) / "checkpoint-4") and one.save_steps == 4


def test_multi_gpu_check_keeps_only_the_checkpoint_it_resumes_from(tmp_path):
    """A reduced-depth checkpoint takes ~22 GB: the run's last one (never resumed from) filled a 64 GB disk."""
    prune_checkpoints = _load_script("multi_gpu_check").prune_checkpoints
    run = tmp_path / "run"
    for name in ("checkpoint-4", "checkpoint-8", "final"):
        (run / name).mkdir(parents=True)
    (run / "checkpoint-notes.txt").write_text("not a checkpoint folder")
    assert prune_checkpoints(run, keep=(4,)) == ["checkpoint-8"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "checkpoint-notes.txt", "final"]
    assert prune_checkpoints(run) == ["checkpoint-4"] and (run / "final").is_dir()


def test_multi_gpu_check_full_size_config_is_the_8b_architecture_with_the_tiny_tokenizer_ids():
    from funaudiochat_hf import FunAudioChatConfig

    check = _load_script("multi_gpu_check")
    full, reduced, eight_b = check.full_size_config(), check.full_size_config(2, 2, 2), FunAudioChatConfig()
    tiny_ids = FunAudioChatConfig.from_pretrained(FUNAUDIOCHAT_TINY)
    assert full.text_config.hidden_size == eight_b.text_config.hidden_size == reduced.text_config.hidden_size
    assert full.text_config.num_hidden_layers == eight_b.text_config.num_hidden_layers
    assert full.text_config.vocab_size == eight_b.text_config.vocab_size
    assert full.audio_config.codebook_size == eight_b.audio_config.codebook_size
    assert (reduced.text_config.num_hidden_layers, reduced.audio_config.encoder_layers) == (2, 2)
    assert len(reduced.audio_config.crq_transformer_config.layer_types) == 2
    for config in (full, reduced):
        assert config.audio_token_index == tiny_ids.audio_token_index
        assert config.text_config.eos_token_id == tiny_ids.text_config.eos_token_id
        assert config.audio_config.bos_token_id == tiny_ids.audio_config.bos_token_id
    with torch.device("meta"):
        model = FunAudioChatForConditionalGeneration._from_config(reduced)
    assert 1.5e9 < sum(p.numel() for p in model.parameters()) < 2.5e9  # full widths and vocabularies, 2 layers each


def test_multi_gpu_check_model_folder_loads_and_generates(tmp_path):
    """The driver's model building and its `from_pretrained` + `generate_speech` check, on CPU with the tiny config."""
    from funaudiochat_hf import FunAudioChatConfig

    check = _load_script("multi_gpu_check")
    info = check.build_model_folder(tmp_path / "model", FunAudioChatConfig.from_pretrained(FUNAUDIOCHAT_TINY), "cpu")
    assert info["parameters"] > 0 and (tmp_path / "model" / "tokenizer.json").is_file()
    assert check.build_model_folder(tmp_path / "model", None, "cpu") == info  # built once
    result = check.generate_check(tmp_path / "model", "cpu")
    assert result["speech_head_tied"] and result["sequence_shape"][1] > result["prompt_length"]


def test_adapter_merged_after_a_sharded_run_equals_the_in_memory_merge(finetune, equal_length_dataset, tmp_path):
    """Under FSDP / DeepSpeed the main process merges the saved adapter into a freshly loaded base model: the same
    weights as merging the trained in-memory model (what a single process does)."""
    final = finetune.main(_script_args(equal_length_dataset, tmp_path, "--lora", "--lora-r", "4", "--max-steps", "2",
                                       "--batch-size", "2", "--save-steps", "10"))  # fmt: skip
    merged = finetune.merge_saved_adapter(str(FUNAUDIOCHAT_TINY), tmp_path / "adapter", {"dtype": torch.float32})
    expected = load_file(final / "model.safetensors")
    state = merged.state_dict()
    base = FunAudioChatForConditionalGeneration.from_pretrained(FUNAUDIOCHAT_TINY).state_dict()
    changed = [name for name in expected if not torch.equal(expected[name], base[name])]
    assert any("language_model.model.layers" in name for name in changed)  # the adapters were merged
    for name, weight in expected.items():
        torch.testing.assert_close(state[name], weight, rtol=0, atol=1e-6, msg=name)
    assert merged.audio_invert_tower.lm_head.weight is merged.audio_tower.embed_tokens.weight


def test_skip_final_save_and_no_checkpoints_write_only_logs_and_metrics(finetune, equal_length_dataset, tmp_path):
    argv = _script_args(equal_length_dataset, tmp_path, "--batch-size", "1", "--max-steps", "5", "--save-steps", "0",
                        "--skip-final-save")  # fmt: skip
    assert finetune.main(argv) is None
    assert not (tmp_path / "final").exists() and not list(tmp_path.glob("checkpoint-*"))
    metrics = json.loads((tmp_path / "train_metrics.json").read_text())
    assert metrics["steady_steps_timed"] == 2 and metrics["global_batch_size"] == 1  # steps 3-5 after 2 warm-up
    assert metrics["steady_samples_per_second"] == pytest.approx(1 / metrics["steady_step_seconds"])


def test_every_process_waits_for_the_writer_then_destroys_its_process_group(finetune, equal_length_dataset,
                                                                            tmp_path, monkeypatch):
    """A gloo process group left to interpreter exit can abort a process that finished its run ("terminate called
    without an active exception", SIGABRT, a failed torchrun): the script waits for the writing process, then ends
    training (which destroys the group), last."""
    import accelerate

    calls = []
    monkeypatch.setattr(accelerate.Accelerator, "wait_for_everyone", lambda self: calls.append("wait"))
    monkeypatch.setattr(accelerate.Accelerator, "end_training", lambda self: calls.append("end"))
    argv = _script_args(equal_length_dataset, tmp_path, "--batch-size", "1", "--max-steps", "1", "--save-steps", "0",
                        "--skip-final-save")  # fmt: skip
    finetune.main(argv)
    assert calls[-2:] == ["wait", "end"] and calls.count("end") == 1


def test_a_stuck_process_group_teardown_ends_the_finished_rank_successfully():
    """`destroy_process_group` once hung in a rank whose run had finished (CI, two gloo processes): the script's
    teardown waits for it at most its timeout, then exits with status 0 and says why; a teardown that ends is just
    waited for."""
    code = (
        "import sys, threading\n"
        f"sys.path.insert(0, {str(REPO / 'scripts')!r})\n"
        "import finetune, torch\n"
        "torch.distributed.destroy_process_group = lambda: print('destroyed', flush=True)\n"
        "finetune.end_process_group(timeout=5)\n"
        "torch.distributed.destroy_process_group = lambda: threading.Event().wait()\n"
        "finetune.end_process_group(timeout=0.5)\n"
        "print('not reached', flush=True)\n"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["destroyed"], result.stdout
    assert "teardown did not end within 0.5 s" in result.stderr, result.stderr[-3000:]
    assert time.monotonic() - started < 60


def test_only_the_writing_process_saves_the_processor(tmp_path, monkeypatch):
    """Under FSDP every process runs `Trainer._save` (to join the gathers); the processor must not be written by all
    of them at once into the same folder."""
    from transformers import TrainingArguments

    from funaudiochat_hf.training_funaudiochat import FunAudioChatTrainer, JsonlSpeechDataset

    processor = FunAudioChatProcessor.from_pretrained(FUNAUDIOCHAT_TINY)
    dataset = JsonlSpeechDataset(make_synthetic_dataset(tmp_path / "data", processor, num_samples=2))
    args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[], remove_unused_columns=False)
    trainer = FunAudioChatTrainer(model=FunAudioChatForConditionalGeneration.from_pretrained(FUNAUDIOCHAT_TINY),
                                  args=args, train_dataset=dataset, processor=processor)  # fmt: skip
    monkeypatch.setattr(TrainingArguments, "should_save", property(lambda self: False))  # a non-writing process
    trainer._save(str(tmp_path / "rank1"))
    assert not (tmp_path / "rank1").exists()
    monkeypatch.undo()
    trainer._save(str(tmp_path / "rank0"))
    assert (tmp_path / "rank0" / "processor_config.json").is_file() and (tmp_path / "rank0" / "config.json").is_file()


def test_a_hung_run_fails_with_where_each_process_waits():
    """A parent and its child both hang (as torchrun and a rank): the test fails within the timeout, with both
    processes' Python stacks, one after the other."""
    rank = "import time\\ndef rank_waits(): time.sleep(60)\\nrank_waits()"
    script = (  # the rank in a session of its own, as torchrun starts them
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', '{rank}'], start_new_session=True)\n"
        "def launcher_waits(): child.wait()\n"
        "launcher_waits()\n"
    )
    with pytest.raises(pytest.fail.Exception) as failure:
        run_or_dump_stacks([sys.executable, "-c", script], dict(os.environ), timeout=3)
    message = str(failure.value)
    assert "the run hung for 3 s" in message
    # whole lines, one process after the other (they shared stderr and once interleaved), the launcher first
    assert '"<string>", line 3 in launcher_waits' in message and '"<string>", line 2 in rank_waits' in message, message
    assert message.index("in launcher_waits") < message.index("in rank_waits"), message


def _alive_running(code: str) -> list[int]:
    """Live processes whose command line holds `code`."""
    return _processes_where("cmdline", lambda cmdline: code.encode() in cmdline)


def test_a_rank_that_outlives_its_launcher_is_dumped_and_ended():
    """The CI hang: the launcher ended, its rank (in a session of its own, now an orphan) hung and held the output
    pipes, and the wait for them never ended. The test now fails within the timeout with the rank's stack, and the
    rank is gone."""
    rank = "import time\\ndef orphan_rank_waits(): time.sleep(60)\\norphan_rank_waits()"
    script = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', '{rank}'], start_new_session=True)\n"
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_or_dump_stacks([sys.executable, "-c", script], dict(os.environ), timeout=3)
    assert time.monotonic() - started < 30
    message = str(failure.value)
    assert "the run hung for 3 s" in message and '"<string>", line 2 in orphan_rank_waits' in message, message
    deadline = time.monotonic() + 5
    while _alive_running("orphan_rank_waits") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive_running("orphan_rank_waits")
