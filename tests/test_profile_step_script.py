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


def _layers(t: float, count: int, projection: float, stream: int = 7) -> tuple[list, float]:
    """`count` decoder layers back to back from `t` (projections of `projection` µs, split 4, merge 1), then the end."""
    kernels = []
    for _ in range(count):
        for name, duration in [("_decode_rows_kernel", projection), ("_split_kernel", 4.0), ("_combine_kernel", 1.0),
                               ("_decode_rows_kernel", projection), ("_decode_rows_kernel", 2 * projection),
                               ("_decode_rows_kernel", projection)]:  # fmt: skip
            kernels.append(Kernel(name, t, duration, stream))
            t += duration
    return kernels, t


def test_layer_table_gives_each_stacks_layer_kernels():
    """Decoder layers are found as the projection / split / merge / projection x 3 runs of the main stream, grouped by
    stack call length (here two 3-layer calls and two 2-layer calls, other kernels between the calls): the median
    chain time of each of the layer's kernels per stack; other streams' kernels and stray kernels are left out."""
    kernels, t = [], 0.0
    for _ in range(2):
        layers, t = _layers(t, 3, projection=10.0)
        kernels += [*layers, Kernel("side_head", t - 20.0, 50.0, 9), Kernel("gather", t + 2.0, 1.0, 7)]
        for _ in range(2):
            layers, t = _layers(t + 5.0, 2, projection=3.0)
            kernels += [*layers, Kernel("_sample_kernel", t, 2.0, 7)]
            t += 2.0
    rows = [line for line in profile_step.layer_table(kernels).splitlines() if line.startswith("| ")][1:]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    # (stack layers, calls, q/k/v, split, merge, o_proj, gate/up, down_proj, layer): chain (duration).
    assert cells[0] == ["3", "2", "10.00 (10.00)", "4.00 (4.00)", "1.00 (1.00)", "10.00 (10.00)", "20.00 (20.00)",
                        "10.00 (10.00)", "55.0"]  # fmt: skip
    # A 2-layer call's first projection follows a gap of 2 µs (after the gather) or 5 (after the sampler): q/k/v chains
    # (3, 3, 3, 3, 5, 5, 8, 8), median 4; layers (20, 20, 20, 20, 22, 22, 25, 25), median 21.
    assert cells[1][:3] == ["2", "4", "4.00 (3.00)"] and cells[1][-1] == "21.0"
    assert profile_step.layer_table([Kernel("gemm", 0.0, 1.0, 7)]).startswith("No decoder layers")
