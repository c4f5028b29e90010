"""Smoke test of scripts/profile_ttfa.py on CPU with the tiny random configs (real numbers come from a GPU)."""

from pathlib import Path

from conftest import load_module


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_ttfa.py"


def test_stages_of_the_first_audio_are_timed(tmp_path, capsys):
    module = load_module(SCRIPT, "profile_ttfa")
    report = module.main(["--tiny", "--device", "cpu", "--warm-calls", "1", "--top", "2", "--json", str(tmp_path / "t.json")])
    timed = report["timed_call"]
    assert len(report["warm_calls"]) == 1 and timed["ttfa_ms"] > 0 and timed["events_ms"][-1] <= timed["ttfa_ms"]
    stages = timed["stages"]
    assert set(stages) >= {"embed_prompt", "prefill"}  # the prompt pass is eager on a CPU
    (host, done), = stages["prefill"]
    assert 0 < host <= done and stages["embed_prompt"][0][1] <= done
    assert (tmp_path / "t.json").exists() and "profiled call" in capsys.readouterr().out
    from funaudiochat_hf import generation_loop_funaudiochat as loop

    assert not hasattr(loop.SpeechRun.prefill, "__wrapped__") and loop.SpeechRun.prefill.__name__ == "prefill"


def test_the_serving_benchmarks_prompt_can_be_profiled(capsys):
    """`--serving-prompt`: the processor's CPU tensors of bench_serving's spoken question (as the server hands them to
    the engine, whose prefill copies them to the device) instead of random device tensors."""
    module = load_module(SCRIPT, "profile_ttfa")
    report = module.main(["--tiny", "--device", "cpu", "--serving-prompt", "--input-seconds", "3", "--warm-calls", "1",
                          "--top", "2", "--syncs"])  # fmt: skip
    assert report["timed_call"]["ttfa_ms"] > 0 and "host syncs: counted on CUDA only" in capsys.readouterr().out
    from transformers import AutoConfig

    from funaudiochat_hf import FunAudioChatConfig  # noqa: F401  (registers the config class)

    model = type("Model", (), {"config": AutoConfig.for_model("funaudiochat"), "dtype": None})()
    inputs = module.serving_prompt_inputs(model, 3.0)
    assert inputs["input_ids"].device.type == "cpu" and inputs["input_features"].shape[-1] == 300
