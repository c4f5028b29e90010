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


def _rows(table: str) -> dict:
    """`{(stream, kernel): cells}` of a chain table's rows."""
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return {(cells[0], cells[1]): cells[2:] for cells in rows[1:]}


def test_chain_table_gives_each_kernels_cost_per_decode_step():
    table = profile_step.chain_table(_call(2), _call(6), 2, 6)
    rows = _rows(table)
    # The prefill's kernels cancel out; each step kernel is one call per step.
    assert not any(name.startswith("prefill") for _, name in rows)
    assert [rows[key][0] for key in (("7", "gemv"), ("7", "attention"), ("9", "side_head"))] == ["1.0"] * 3
    # Chain on its own stream: gemv its duration (the 31.5 µs since the previous step's sampler are its stream's idle
    # time), the attention its end past gemv's, the sampler its duration after a 0.5 µs gap; the side stream's kernel
    # its duration.
    assert float(rows[("7", "gemv")][3]) == pytest.approx(5.0)
    assert float(rows[("7", "attention")][3]) == pytest.approx(2.0)
    assert float(rows[("7", "sampler")][3]) == pytest.approx(1.0)
    assert float(rows[("9", "side_head")][3]) == pytest.approx(30.0)
    assert table.startswith(
        "Per decode step (6 - 2 steps), by stream: stream 9: 30.0 µs of kernels' chain, 10.0 µs idle; "
        "stream 7: 8.0 µs of kernels' chain, 32.0 µs idle"
    )
    with pytest.raises(ValueError, match="more steps"):
        profile_step.chain_table(_call(2), _call(2), 2, 2)


def test_a_stream_waiting_for_another_is_idle_not_a_kernels_cost():
    """A step whose LLM runs on one stream and whose CRQ then runs on another, beside a long head on the first: the
    first stream's kernel after the wait costs its duration, and each stream's chain is its own kernels' work."""

    def call(steps):
        kernels, t = [], 0.0
        for _ in range(steps):
            kernels += [Kernel("llm", t, 50.0, 7), Kernel("head", t + 50.0, 20.0, 7)]
            kernels += [Kernel("crq", t + 50.0 + 10.0 * k, 10.0, 9) for k in range(6)]
            kernels.append(Kernel("feedback", t + 110.0, 2.0, 7))  # waits for the CRQ
            t += 112.0
        return kernels

    table = profile_step.chain_table(call(1), call(3), 1, 3)
    rows = _rows(table)
    assert float(rows[("7", "feedback")][3]) == pytest.approx(2.0)
    assert float(rows[("9", "crq")][2]) == pytest.approx(10.0) and float(rows[("9", "crq")][3]) == pytest.approx(60.0)
    streams = table.splitlines()[0].split(", by stream: ")[1]
    assert streams == (
        "stream 7: 72.0 µs of kernels' chain, 40.0 µs idle; stream 9: 60.0 µs of kernels' chain, 52.0 µs idle"
    )


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
    assert "stream 7: 8.0 µs of kernels' chain" in proc.stdout and "| 7 | gemv | 1.0 |" in proc.stdout


def _layers(t: float, count: int, projection: float, stream: int = 7, merge: bool = True) -> tuple[list, float]:
    """`count` decoder layers back to back from `t` (projections of `projection` µs, split 4, merge 1 unless the split
    merges), then the end."""
    kernels = []
    for _ in range(count):
        attention = [("_split_kernel", 4.0)] + ([("_combine_kernel", 1.0)] if merge else [])
        projections = [("_decode_rows_kernel", p) for p in (projection, 2 * projection, projection)]
        for name, duration in [("_decode_rows_kernel", projection), *attention, *projections]:
            kernels.append(Kernel(name, t, duration, stream))
            t += duration
    return kernels, t


def _layer_rows(kernels: list) -> list[list[str]]:
    rows = [line for line in profile_step.layer_table(kernels).splitlines() if line.startswith("| ")][1:]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_layer_table_gives_each_stacks_layer_kernels():
    """Decoder layers are found as the projection / split / merge / projection x 3 runs of a stream, grouped by stack
    call length (here two 3-layer calls and two 2-layer calls, other kernels between the calls): the median chain time
    of each of the layer's kernels per stack; other streams' kernels and stray kernels are left out."""
    kernels, t = [], 0.0
    for _ in range(2):
        layers, t = _layers(t, 3, projection=10.0)
        kernels += [*layers, Kernel("side_head", t - 20.0, 50.0, 9), Kernel("gather", t + 2.0, 1.0, 7)]
        for _ in range(2):
            layers, t = _layers(t + 5.0, 2, projection=3.0)
            kernels += [*layers, Kernel("_sample_kernel", t, 2.0, 7)]
            t += 2.0
    cells = _layer_rows(kernels)
    # (stack layers, calls, q/k/v, split, merge, o_proj, gate/up, down_proj, layer): chain (duration).
    assert cells[0] == ["3", "2", "10.00 (10.00)", "4.00 (4.00)", "1.00 (1.00)", "10.00 (10.00)", "20.00 (20.00)",
                        "10.00 (10.00)", "55.0"]  # fmt: skip
    # A 2-layer call's first projection follows a gap (after the gather or the sampler): idle, not its chain.
    assert cells[1][:3] == ["2", "4", "3.00 (3.00)"] and cells[1][-1] == "20.0"
    assert profile_step.layer_table([Kernel("gemm", 0.0, 1.0, 7)]).startswith("No decoder layers")


def test_layer_table_finds_stacks_on_each_stream_with_the_merge_in_the_split():
    """The LLM's layers on one stream, then the CRQ's on another, their attention merged by the split kernel (no merge
    kernel): each stack's layers are found on its stream, the merge shown as "-"."""
    kernels, t = [], 0.0
    for _ in range(3):
        layers, t = _layers(t, 4, projection=10.0, stream=7, merge=False)
        kernels += layers
        for _ in range(2):
            layers, t = _layers(t, 3, projection=2.0, stream=9, merge=False)
            kernels += [*layers, Kernel("_sample_kernel", t, 1.0, 9)]
            t += 1.0
        kernels.append(Kernel("_text_head_kernel", t - 20.0, 15.0, 7))
    cells = _layer_rows(kernels)
    assert cells[0] == ["4", "3", "10.00 (10.00)", "4.00 (4.00)", "-", "10.00 (10.00)", "20.00 (20.00)",
                        "10.00 (10.00)", "54.0"]  # fmt: skip
    assert cells[1][:5] == ["3", "6", "2.00 (2.00)", "4.00 (4.00)", "-"] and cells[1][-1] == "14.0"
