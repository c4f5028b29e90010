"""scripts/bench_serving.py (with bench_serving_models.py): the full-size processor's id mapping, and a CPU smoke
run of the whole benchmark on the tiny model (real numbers come from a GPU)."""

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import load_module


pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"


@pytest.fixture(scope="module")
def script():
    return load_module(SCRIPT, "bench_serving")


@pytest.fixture(scope="module")
def models(script):  # loading bench_serving put scripts/ on sys.path
    import bench_serving_models

    return bench_serving_models


def test_full_size_processor_gives_the_full_configs_special_ids(models):
    from funaudiochat_hf import FunAudioChatConfig, FunAudioChatProcessor
    from funaudiochat_hf.processing_funaudiochat import AUDIO_TEMPLATE
    from funaudiochat_hf.tiny_model import ASSETS_DIR, synthetic_question

    config = FunAudioChatConfig()
    tiny = FunAudioChatProcessor.from_pretrained(str(ASSETS_DIR))
    processor = models.FullSizeProcessor(tiny, config)
    text = processor.apply_chat_template(
        [{"role": "user", "content": AUDIO_TEMPLATE}], tokenize=False, add_generation_prompt=True
    )
    clip = synthetic_question(1.0)
    plain = tiny(text=[text], audio=[clip], return_tensors="pt")
    mapped = processor(text=[text], audio=[clip], return_tensors="pt")

    ids, tiny_ids = mapped["input_ids"][0], plain["input_ids"][0]
    assert int((ids == config.audio_token_index).sum()) == int((tiny_ids == 346).sum()) == 5  # 25 frames / 5
    assert int((ids == config.text_config.audio_bos_index).sum()) == 1
    assert int((ids == config.text_config.audio_eos_index).sum()) == 1
    assert int((ids == 151644).sum()) == int((tiny_ids == 321).sum()) >= 2  # <|im_start|>
    assert torch.equal(ids[tiny_ids < 320], tiny_ids[tiny_ids < 320])  # plain BPE ids unchanged
    assert int(ids.max()) < config.text_config.vocab_size
    assert torch.all(mapped["speech_ids"] == config.audio_config.pad_token_id)
    assert torch.equal(mapped["input_features"], plain["input_features"])
    assert processor.feature_extractor is tiny.feature_extractor  # everything else delegates


def test_full_size_processor_refuses_a_config_whose_ids_do_not_line_up(models):
    from funaudiochat_hf import FunAudioChatConfig, FunAudioChatProcessor
    from funaudiochat_hf.tiny_model import ASSETS_DIR

    config = FunAudioChatConfig()
    config.text_config.audio_bos_index += 1
    with pytest.raises(ValueError, match="audio_bos"):
        models.FullSizeProcessor(FunAudioChatProcessor.from_pretrained(str(ASSETS_DIR)), config)


@pytest.fixture
def tiny_run(script, tmp_path_factory, tmp_path, monkeypatch):
    """Runs the script's main on the tiny model (CPU, 3 conversations of 8 steps); returns (exit code, report)."""
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(tmp_path_factory.getbasetemp() / "tiny_cache"))
    monkeypatch.delenv("OUT", raising=False)

    def run(*extra):
        path = tmp_path / "report.json"
        code = script.main(["--tiny", "--device", "cpu", "--conversations", "3", "--rate", "20", "--max-tokens", "8",
                            "--max-batch-size", "4", "--json", str(path), *extra])  # fmt: skip
        return code, json.loads(path.read_text())

    return run


def test_tiny_run_reports_every_phase_without_errors(tiny_run, capsys):
    code, report = tiny_run("--time-budget", "150")
    assert code == 0 and report["status"] == "ok" and report["skipped"] == [], report

    idle = report["idle"]
    for side in ("server", "direct"):
        assert len(idle[side]["ttfa_ms"]) == 3 and idle[side]["ttfa_ms_median"] > 0
        assert idle[side]["step_ms_median"] > 0
    assert idle["ttfa_ratio"] > 0 and idle["step_ratio"] > 0 and idle["processor_ms_median"] > 0
    assert idle["generate_speech_step_ms_median"] > 0
    # The chunk-derived step time of the direct stream is its per-event (per-step) time, up to timing noise.
    assert idle["direct"]["step_ms_median"] == pytest.approx(idle["direct"]["exact_step_ms_median"], rel=0.5)
    assert idle["server_repeats_identical"] and idle["direct_vs_server"]["match"]

    load = report["load"]
    assert load["errors"] == 0 and load["requests_lost"] == 0 and load["requests_sent"] == 5
    assert load["requests_by_outcome"]["length"] == 5  # no stop id: every reply runs --max-tokens steps
    assert load["ttfa_p50_ms"] > 0 and load["rtf_p95"] > 0 and load["aggregate_x_real_time"] > 0
    assert load["steady_window"] is None and report["targets"]["steady_aggregate_x_real_time"]["pass"] is None
    assert load["decode_steps"] >= 8 and 1 <= load["step_rows_mean"] <= 4
    assert list(load["ttfa_spans"]) == ["queue", "prefill", "decode", "vocoder_wait", "vocode", "in_engine"]
    assert all(0 <= span["p50_ms"] <= span["p95_ms"] for span in load["ttfa_spans"].values()), load["ttfa_spans"]
    assert load["ttfa_spans"]["prefill"]["p50_ms"] > 0 and load["ttfa_spans"]["vocode"]["p50_ms"] > 0
    assert report["correctness"]["correct_under_load"] is True
    # Under load a request's chunks are vocoded in batched calls with other requests': equal up to float rounding.
    assert all(check["audio_identical"] or check["audio_snr_db"] > 30 for check in report["correctness"]["requests"])
    assert report["memory"] == {"note": "n/a (not on CUDA)"}
    assert report["targets"]["errors"]["pass"] is True and report["targets"]["memory_delta_mb"]["pass"] is None
    out = capsys.readouterr().out
    assert "correct_under_load" in out and json.loads(out.strip().splitlines()[-1])["status"] == "ok"


def test_a_short_budget_skips_the_idle_phase_and_compares_the_load_requests_with_each_other(tiny_run):
    code, report = tiny_run("--time-budget", "90")  # the idle phase asks for 100 s, the load for 60 s
    assert code == 0 and report["status"] == "ok" and report["skipped"] == ["idle"], report
    assert "idle" not in report and report["targets"]["idle_ttfa_ratio"]["pass"] is None
    assert report["load"]["errors"] == 0
    correctness = report["correctness"]
    assert correctness["against"] == "the first seed-0 request of the load" and len(correctness["requests"]) == 1
    assert correctness["correct_under_load"] is True


def test_a_closed_load_counts_the_seed_0_requests_among_its_streams(tiny_run):
    """--concurrency 3: loadgen runs 1 user (3 less the two seed-0 requests sent during the load), so no more than
    3 streams are ever in flight on the 4 slots, and the report says so. --skip-idle: the load alone, however long the
    budget."""
    code, report = tiny_run("--time-budget", "150", "--concurrency", "3", "--skip-idle")
    assert code == 0 and report["status"] == "ok" and report["skipped"] == ["idle"], report
    load = report["load"]
    assert load["concurrency"] == 1 and load["errors"] == 0 and load["requests_sent"] == 5
    assert load["requests_lost"] == 0 and 1 <= load["step_rows_mean"] <= 3
    start, end = load["steady_window"]  # the one user's first and last conversation: two replies in between
    assert end > start and load["steady_audio_seconds"] > 0
    assert load["steady_aggregate_x_real_time"] == pytest.approx(load["steady_audio_seconds"] / (end - start))
    assert report["targets"]["steady_aggregate_x_real_time"]["value"] == load["steady_aggregate_x_real_time"]
    assert report["correctness"]["correct_under_load"] is True


def test_compare_audio_tells_rounding_from_a_reply_that_went_its_own_way(script):
    import numpy as np

    rng = np.random.default_rng(0)
    reference = (rng.standard_normal(48000) * 3000).astype("<i2")
    rounded = reference.copy()
    rounded[::7] += 1  # rounding: one step of 16-bit audio here and there
    diverged = reference.copy()
    diverged[36000:] = (rng.standard_normal(12000) * 3000).astype("<i2")  # a token went the other way at 1.5 s

    def reply(pcm):
        return {"pcm": pcm.tobytes(), "transcript": ""}

    same = script.compare_audio(reply(reference), reply(reference))
    assert same["audio_identical"] and same["match"] and same["diverged_at_seconds"] is None
    close = script.compare_audio(reply(reference), reply(rounded))
    assert close["match"] and close["audio_snr_db"] > 60 and close["diverged_at_seconds"] is None
    apart = script.compare_audio(reply(reference), reply(diverged))
    assert not apart["match"] and 1.5 <= apart["diverged_at_seconds"] < 1.51
    # a reply one token (960 samples) longer or shorter: where its audio parts from the reference is still said
    longer = np.concatenate([diverged, np.zeros(960, dtype="<i2")])
    unequal = script.compare_audio(reply(reference), reply(longer))
    assert not unequal["match"] and unequal["audio_snr_db"] is None and 1.5 <= unequal["diverged_at_seconds"] < 1.51
    shorter = script.compare_audio(reply(reference), reply(rounded[:-960]))
    assert not shorter["match"] and shorter["diverged_at_seconds"] == (len(reference) - 960) / 24000


def test_ttfa_spans_split_each_requests_timeline_into_its_stages(script):
    """The spans of a load's time to first audio, from the engine's timelines (seconds after submission): one request
    per span's p50 and p95 here; requests without first audio are left out."""
    timelines = [
        {"admitted": 0.010, "prefilled": 0.085, "ready": 0.125, "vocoding": 0.140, "first_audio": 0.155},
        {"admitted": 0.200, "prefilled": 0.280, "ready": 0.330, "vocoding": 0.400, "first_audio": 0.420},
        {"admitted": 0.001},  # cancelled before its first audio
    ]
    handles = [types.SimpleNamespace(timeline=timeline) for timeline in timelines]
    spans = script.ttfa_spans(handles)
    expected = {"queue": (10, 200), "prefill": (75, 80), "decode": (40, 50), "vocoder_wait": (15, 70),
                "vocode": (15, 20), "in_engine": (155, 420)}  # fmt: skip
    assert list(spans) == list(expected)
    for name, (p50, p95) in expected.items():
        assert (spans[name]["p50_ms"], spans[name]["p95_ms"]) == pytest.approx((p50, p95)), name
