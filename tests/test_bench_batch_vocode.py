"""Smoke test of scripts/bench_batch_vocode.py on CPU with the tiny decoder (real numbers come from a GPU)."""

import json
from pathlib import Path

from conftest import load_module


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_batch_vocode.py"


def test_rows_of_batched_and_sequential_rounds(capsys):
    script = load_module(SCRIPT, "bench_batch_vocode")
    script.main(["--streams", "2", "--rounds", "2", "--warmup-tokens", "45", "--", "--tiny", "--device", "cpu"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["device"] == "cpu" and lines[1]["streams"] == 2
    for name in ("batched", "sequential"):
        assert lines[1][f"{name}_round_ms"] > 0 and lines[1][f"{name}_rtf"] > 0
    assert lines[1]["graphs"] == {}  # no CUDA graphs on a CPU
