"""Smoke test of scripts/bench_cold_start.py on CPU with the tiny random configs (real numbers come from a GPU)."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import load_module


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_cold_start.py"
TIMINGS = ("load_s", "script_start_to_loaded_s", "first_audio_s", "first_reply_rest_s",
           "first_reply_audio_s", "second_first_audio_s", "second_reply_s")


@pytest.fixture(scope="module")
def script():
    return load_module(SCRIPT, "bench_cold_start")


def test_one_process_measures_a_first_and_a_second_reply(script):
    """What one fresh process reports, measured in this one (tiny configs, CPU, 6 LLM steps per reply: the first audio
    comes before the end)."""
    args = script.parse_args(["--tiny", "--device", "cpu", "--max-new-tokens", "6"])
    row = script.measure_process(args, "empty")
    assert row["caches"] == "empty" and row["device"] == "cpu" and row["max_new_tokens"] == 6
    for name in TIMINGS:
        assert row[name] > 0, (name, row)
    assert row["import_s"] >= 0  # 0 here when another test imported it first; positive in a fresh process
    assert row["script_start_to_loaded_s"] >= row["load_s"]
    assert row["peak_gpu_gb"] is None and row["gpu"] is None  # no GPU here
    assert row["decoder_estimator_dtype"] == "float32"  # the CPU default
    json.dumps(row)  # one JSON line


def test_both_processes_share_one_cache_root_and_the_table_shows_them(script, tmp_path, monkeypatch, capsys):
    """The two processes run the script's child mode with every compile cache under the same root (empty for the
    first), one JSON line each, then the table."""
    calls = []

    def fake_run(command, env, capture_output, text, timeout):
        calls.append((command, env))
        caches = command[command.index("--child") + 1]
        row = {"caches": caches, "load_s": 1.0, "first_audio_s": 2.0, "first_reply_rest_s": 3.0,
               "second_first_audio_s": 0.1, "peak_gpu_gb": None, "decoder_estimator_dtype": "float32"}
        assert not any((tmp_path / "root").iterdir()) or caches == "warm"
        return subprocess.CompletedProcess(command, 0, stdout="log line\n" + json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(script.subprocess, "run", fake_run)
    assert script.main(["--tiny", "--device", "cpu", "--cache-dir", str(tmp_path / "root"),
                        "--json", str(tmp_path / "rows.json")]) == 0
    assert [command[command.index("--child") + 1] for command, _ in calls] == ["empty", "warm"]
    for command, env in calls:
        assert "--tiny" in command and command[command.index("--max-new-tokens") + 1] == "8"
        for variable, sub in script.CACHE_VARIABLES.items():
            assert env[variable] == str(tmp_path / "root" / sub)
    out = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["caches"] for line in out[:2]] == ["empty", "warm"]
    assert out[2].startswith("| caches |") and out[4].startswith("| empty | 1.0 | 2.00 | 3.00 | 100 |")
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [row["cache_root"] for row in rows] == [str(tmp_path / "root")] * 2


def test_a_failed_process_is_reported(script, monkeypatch, tmp_path):
    monkeypatch.setattr(
        script.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 1, "", "Traceback: boom")
    )
    with pytest.raises(RuntimeError, match=r"empty-cache process failed \(1\):\nTraceback: boom"):
        script.main(["--tiny", "--cache-dir", str(tmp_path)])
