"""Tests of `scripts/profile_step.py`'s timeline analysis (the profiling itself needs a GPU): the per-step chain table
of two profiled calls, from synthetic timelines."""

import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import profile_step
finally:
    sys.path.pop(0)

Kernel = profile_step.Kernel


def _call(steps: int) -> list:
    """A synthetic profiled call: a prefill (two kernels), then per step a chain of three main-stream kernels, one of
    them a programmatic dependent launch that starts 1 µs before the previous kernel ends, and a long kernel on a
    second stream that runs beside the chain."""
    kernels = [Kernel("prefill_gemm", 0.0, 40.0, 7), Kernel("prefill_norm", 41.0, 4.0, 7)]
    t = 50.0
    for _ in range(steps):
        kernels.append(Kernel("gemv", t, 5.0, 7))  # ends at t + 5
        kernels.append(Kernel("side_head", t + 1.0, 30.0, 9))  # another stream: no chain time
        kernels.append(Kernel("attention", t + 4.0, 3.0, 7))  # PDL: starts before gemv ends, adds 2 µs
        kernels.append(Kernel("sampler", t + 7.5, 1.0, 7))  # a 0.5 µs gap, then 1 µs: adds 1.5 µs
        t += 40.0
    return kernels


def test_chain_table_gives_each_kernels_cost_per_decode_step():
    table = profile_step.chain_table(_call(2), _call(6), 2, 6)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    # The prefill's kernels cancel out; each step kernel is one call per step.
    assert "prefill_gemm" not in rows and "prefill_norm" not in rows
    assert rows["gemv"][1] == "1.0" and rows["attention"][1] == "1.0" and rows["side_head"][1] == "1.0"
    # Chain: gemv starts 40 - 8.5 µs after the previous step's sampler ends (its whole gap and duration count), the
    # attention adds its end past gemv's, the sampler its gap and duration; the side stream's kernel counts none.
    assert float(rows["gemv"][3]) == pytest.approx(36.5)
    assert float(rows["attention"][3]) == pytest.approx(2.0)
    assert float(rows["sampler"][3]) == pytest.approx(1.5)
    assert rows["side_head"][3] == "(other stream)" and float(rows["side_head"][2]) == pytest.approx(30.0)
    assert table.startswith("Per decode step (6 - 2 steps): 40.0 µs of main-stream chain")
    with pytest.raises(ValueError, match="more steps"):
        profile_step.chain_table(_call(2), _call(2), 2, 2)


def test_summarize_reads_written_timelines(tmp_path):
    """`--summarize` prints the table from two CSVs (as `write_timeline` writes them), without a GPU."""
    paths = []
    for steps in (2, 6):
        path = tmp_path / f"timeline_{steps}.csv"
        lines = ["name,start_us,duration_us,stream"]
        lines += [f"{k.name},{k.start:.3f},{k.duration:.3f},{k.stream}" for k in _call(steps)]
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    assert profile_step.read_timeline(paths[0]) == _call(2)
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "profile_step.py"), "--summarize", *paths, "2", "6"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "40.0 µs of main-stream chain" in proc.stdout and "| gemv | 1.0 |" in proc.stdout
