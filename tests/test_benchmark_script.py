"""Smoke test of scripts/benchmark.py on CPU with tiny random configs (the real numbers come from a GPU run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "benchmark.py"


def _run(args: list[str], out_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out_dir), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench_out")
    proc = _run(["--tiny", "--device", "cpu", "--steps", "4", "--markdown", str(out_dir / "tables.md")], out_dir)
    return proc, out_dir


def test_tiny_run_prints_tables(tiny_run):
    proc, _ = tiny_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| mode | batch | ms / LLM step |" in out
    assert "| mode | test | wall s |" in out
    # every planned measurement shows up as a row (--tiny defaults: batch sizes 1,2; decoder replies of 1 s and 2 s):
    # 2 batch sizes x 2 modes, 2 modes x (2 offline + 2 streaming)
    rows = [line for line in out.splitlines() if line.startswith("| eager | ") or line.startswith("| compiled | ")]
    assert len(rows) == 4 + 8, "\n".join(rows)


def test_tiny_run_measures(tiny_run):
    """The eager batch-1 chat step and the eager offline decoder produce real numbers, not 'failed' rows."""
    proc, out_dir = tiny_run
    data = json.loads((out_dir / "benchmark.json").read_text())
    assert data["meta"]["tiny"] is True and data["meta"]["device"] == "cpu"
    assert data["bandwidth"]["copy_gb_per_s"] > 0
    chat = {(r["mode"], r["batch"]): r for r in data["chat"]}
    assert set(chat) == {(m, b) for m in ("eager", "compiled") for b in (1, 2)}
    eager1 = chat[("eager", 1)]
    assert "status" not in eager1, eager1
    assert eager1["ms_per_step"] > 0 and eager1["steps"] == [1, 4]
    assert eager1["rtf"] == pytest.approx(eager1["ms_per_step"] / 200.0)
    assert eager1["floor_ms"] > 0 and eager1["x_floor"] == pytest.approx(eager1["ms_per_step"] / eager1["floor_ms"])
    assert not [n for n in eager1["notes"] if "stopped after" in n], eager1["notes"]  # EOS really disabled
    decoder = {(r["mode"], r["test"]): r for r in data["decoder"]}
    offline = decoder[("eager", "offline 2 s")]
    assert "status" not in offline, offline
    assert offline["rtf"] == pytest.approx(offline["wall_s"] / 2.0)
    stream = decoder[("eager", "stream 2 s")]
    assert "status" not in stream, stream
    assert stream["chunks"] >= 2 and stream["max_chunk_ms"] >= stream["first_chunk_ms"] > 0
    # the rest of the reply's wall time: the pushes (of 5 of the 50 tokens) that return no audio, and the flush
    idle = f"{10 - stream['chunks']} pushes without audio: "
    assert any(note.startswith(idle) and "finalize" in note for note in stream["notes"]), stream["notes"]
    assert (out_dir / "benchmark.md").read_text().startswith("## ")


def test_markdown_goes_to_the_given_file(tiny_run):
    """`--markdown PATH` gets the printed tables (the same as $OUT/benchmark.md)."""
    proc, out_dir = tiny_run
    tables = (out_dir / "tables.md").read_text()
    assert tables == (out_dir / "benchmark.md").read_text() and tables.strip() in proc.stdout


def test_from_json_renders_the_tables(tiny_run, tmp_path, capsys):
    """--from-json renders a JSON written on the GPU machine: printed, and written to --markdown PATH."""
    _, out_dir = tiny_run
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import benchmark
    finally:
        sys.path.pop(0)
    target = tmp_path / "tables.md"
    assert benchmark.main(["--from-json", str(out_dir / "benchmark.json"), "--markdown", str(target)]) == 0
    text = target.read_text()
    assert text.startswith("## ") and "### Chat loop" in text and "### CosyVoice3 decoder" in text
    assert text.strip() in capsys.readouterr().out
    assert benchmark.main(["--from-json", str(out_dir / "benchmark.json")]) == 0  # no --markdown: printed only
    assert "### Chat loop" in capsys.readouterr().out and target.read_text() == text
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--markdown", str(tmp_path / "no_such_folder" / "tables.md")])


def test_failures_are_recorded_not_fatal(tmp_path):
    """A measurement that raises becomes a 'failed: ...' row and the run still prints its tables."""
    proc = _run(
        ["--tiny", "--device", "cpu", "--steps", "4", "--parts", "decoder", "--modes", "eager",
         "--decoder-seconds", "-1"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "benchmark.json").read_text())
    assert data["decoder"] and all(r["status"].startswith("failed:") for r in data["decoder"])
    assert "failed:" in proc.stdout


def test_decoder_precision_and_stream_options(tmp_path):
    """--decoder-precision adds a float32-vs-precision check row; --stream-options reach streaming_decoder();
    --decoder-tests / --decoder-modes select the decoder rows."""
    proc = _run(
        ["--tiny", "--device", "cpu", "--parts", "decoder", "--modes", "compiled", "--decoder-modes",
         "eager", "--decoder-tests", "stream", "--decoder-precision", "bfloat16", "--stream-options",
         '{"flow_left_context_tokens": 10, "flow_window_bucket_tokens": 8}'],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "benchmark.json").read_text())
    (check,) = data["decoder_precision"]
    assert check["precision"] == "bfloat16" and 10 < check["mel_snr_db"] < 200 and check["mel_max_abs_diff"] > 0
    assert [(r["mode"], r["test"]) for r in data["decoder"]] == [("eager", "stream 1 s"), ("eager", "stream 2 s")]
    assert all("flow windows padded to 8/16/24/28 tokens" in r["notes"] for r in data["decoder"])
    assert "Precision check (bfloat16 vs float32" in proc.stdout
    assert data["decoder_model"]["hift_channels_last"] is False
    # A decoder-only run names the decoder's compile settings, not generate_speech's.
    header = (tmp_path / "benchmark.md").read_text()
    assert "compiled = decoder `" in header and "generate_speech(backend=" not in header
    assert "channels-last" not in header


def test_channels_last_vocoder_runs_every_decoder_row_with_that_layout(tmp_path):
    """--channels-last-vocoder: HiFT's filter channels-last before the decoder rows, named in the decoder's header."""
    proc = _run(
        ["--tiny", "--device", "cpu", "--parts", "decoder", "--modes", "eager", "--decoder-tests", "offline,stream",
         "--decoder-seconds", "1", "--channels-last-vocoder"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "benchmark.json").read_text())
    assert data["decoder_model"]["hift_channels_last"] is True
    assert data["meta"]["vocoder_layout"] == "channels-last"
    rows = {(r["mode"], r["test"]): r for r in data["decoder"]}
    assert set(rows) == {("eager", "offline 1 s"), ("eager", "stream 1 s")}
    assert all(r["rtf"] > 0 and not r.get("status") for r in rows.values())
    assert "HiFT's filter channels-last" in (tmp_path / "benchmark.md").read_text()


def test_time_budget_skips_remaining_work(tmp_path):
    proc = _run(["--tiny", "--device", "cpu", "--steps", "4", "--time-budget", "0.001"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "benchmark.json").read_text())
    assert data["chat"] and all(r["status"].startswith("skipped") for r in data["chat"])
    assert "Skipped (time budget)" in proc.stdout


def test_hard_stop_interrupts_a_measurement():
    """The SIGALRM hard stop turns an overrunning measurement into a 'failed' row and skips the rest."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import benchmark
        import benchmark_results
    finally:
        sys.path.pop(0)
    import time

    args = benchmark.parse_args(["--tiny", "--device", "cpu"])
    results = benchmark_results.Results(args, [])
    budget = benchmark_results.Budget(0.2, hard_margin=0.5)  # alarm after 1 s
    try:
        value = benchmark_results.run_measurement(results, budget, "sleeper", lambda: time.sleep(5), "cpu")
        after = benchmark_results.run_measurement(results, budget, "next", lambda: 1, "cpu")
    finally:
        budget.cancel_alarm()
    assert value["status"].startswith("failed: BudgetExceeded")
    assert after["status"].startswith("skipped")


def test_profile_decoder_smoke(tmp_path):
    """scripts/profile_decoder.py (the GPU profiling helper for the streaming decoder) runs end to end on CPU."""
    trace = tmp_path / "chunk.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "profile_decoder.py"), "--tiny", "--device", "cpu", "--warm-chunks",
         "4", "--top", "3", "--trace", str(trace)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flow:" in proc.stdout and "vocode:" in proc.stdout and "aten ops" in proc.stdout
    assert "host returns after" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name", "").startswith("aten::") for event in events)


def test_profile_decoder_offline_smoke():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "profile_decoder.py"), "--tiny", "--device", "cpu", "--offline", "1",
         "--top", "3"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flow (tokens_to_mel):" in proc.stdout and "vocode (mel_to_wav):" in proc.stdout
    assert "one offline call (1 s):" in proc.stdout


def test_plan_puts_open_targets_before_the_offline_decoder():
    """Regression (GPU run of 2026-11-30 03:58): each decoder shape compiles for ~90 s at full size, and a time-budgeted
    run measured the offline rows but ran out before the time to first audio and the streaming decoder."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import benchmark
    finally:
        sys.path.remove(str(SCRIPT.parent))
    labels = [label for _, label, _ in benchmark.plan(benchmark.parse_args([]))]
    order = ["chat compiled batch 1", "decoder compile", "time to first audio (compiled)",
             "decoder compiled stream 10 s", "decoder compiled offline 10 s", "chat compiled batch 16"]
    assert [labels.index(label) for label in order] == sorted(labels.index(label) for label in order)
    assert labels.count("time to first audio (compiled)") == 1
    decoder_only = [label for _, label, _ in benchmark.plan(benchmark.parse_args(["--parts", "decoder"]))]
    assert not any(label.startswith(("time to first audio", "chat")) for label in decoder_only)


def test_compile_sweep_smoke():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "compile_sweep.py"), "--tiny", "--device", "cpu", "--steps", "4",
         '{"backend": "eager", "fullgraph": true}', '{"backend": "no-such-backend"}'],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 2, proc.stdout + proc.stderr[-3000:]
    assert "ms/step" in lines[0] and "failed" in lines[1]
    assert proc.returncode == 1  # a failed configuration is reported, the others still measured


def test_eager_prefill_adds_a_side_by_side_time_to_first_audio_row():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import benchmark
        import benchmark_chat
    finally:
        sys.path.remove(str(SCRIPT.parent))
    args = benchmark.parse_args(["--eager-prefill"])
    labels = [label for _, label, _ in benchmark.plan(args)]
    ttfa = [label for label in labels if label.startswith("time to first audio")]
    assert ttfa == ["time to first audio (compiled)", "time to first audio (compiled, eager prefill)"]
    assert labels.index(ttfa[1]) == labels.index(ttfa[0]) + 1
    # The side-by-side row runs the same kernels and CUDA graphs without the compiled prefill ("cuda_graphs"); every
    # other row keeps the compiled backend (the prefill compiled with the loop).
    from funaudiochat_hf import FunAudioChatConfig

    model = type("Model", (), {"config": FunAudioChatConfig()})()
    assert benchmark_chat.generation_kwargs(model, "compiled", args, 4)["backend"] == "compiled"
    assert benchmark_chat.generation_kwargs(model, "compiled", args, 4, eager_prefill=True)["backend"] == "cuda_graphs"
    assert benchmark_chat.generation_kwargs(model, "eager", args, 4)["backend"] == "eager"


def test_bench_ttfa_smoke():
    """scripts/bench_ttfa.py on tiny configs: one row per `--backends` value, in the order given, each with a time to
    first audio and the arrival of every stream event ("auto" on a CPU: the eager loop)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "bench_ttfa.py"), "--backends", "compiled,auto", "--",
         "--tiny", "--device", "cpu", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [row[1] for row in rows] == ["compiled", "auto"]
    for row in rows:
        ttfa, events = float(row[2]), [float(ms) for ms in row[3].split(", ")]
        assert len(events) >= 2 and 0 < events[0] <= ttfa + 1  # the first event (the prefill) precedes the audio


def test_step_time_is_never_negative(monkeypatch):
    """Regression: on a loaded host the short run can take longer than the long one; the slope between them was
    reported as a negative ms / step (CI saw -7.9). The long run's time per step is reported instead, with a note."""
    sys.path.insert(0, str(REPO / "scripts"))
    import benchmark
    import benchmark_chat

    def scripted_run(fn, device):  # `fn` generates n steps; its time comes from the script
        steps = fn()
        return seconds[steps].pop(), steps

    monkeypatch.setattr(benchmark_chat, "timed", scripted_run)
    monkeypatch.setattr(benchmark_chat, "generate", lambda model, inputs, kwargs, notes: kwargs["max_new_tokens"])
    monkeypatch.setattr(
        benchmark_chat, "generation_kwargs", lambda model, mode, args, n, **extra: {"max_new_tokens": n}
    )
    monkeypatch.setattr(benchmark_chat, "generated_steps", lambda out, prompt_len: out)
    args = benchmark.parse_args(["--tiny", "--device", "cpu", "--repeats", "2"])
    inputs = {"input_ids": torch.zeros(1, 5, dtype=torch.long)}

    seconds = {1: [0.30] * 3, 4: [0.25] * 3}  # warm-up and two repeats each: the short run slower
    row = benchmark_chat.measure_step_time(None, inputs, "eager", args, "cpu", 1, 4)
    assert row["ms_per_step"] == pytest.approx(250.0 / 4)
    assert any("slope not positive" in note for note in row["notes"])
    seconds = {1: [0.10] * 3, 4: [0.40] * 3}
    row = benchmark_chat.measure_step_time(None, inputs, "eager", args, "cpu", 1, 4)
    assert row["ms_per_step"] == pytest.approx(100.0) and not row["notes"]


def test_cache_steps_size_the_caches_for_a_longer_call():
    """`--cache-steps N`: every call of a batch size runs with the caches of a `max_new_tokens=N` call (rounded up to
    128 positions), as a reply that ends before its limit; by default the longest measured run sizes them."""
    sys.path.insert(0, str(REPO / "scripts"))
    import benchmark
    import benchmark_chat

    args = benchmark.parse_args(["--steps", "64", "--ttfa-steps", "40", "--repeat-steps", "8"])
    assert benchmark_chat.cache_length(100, args) == 256  # 100 + 64 -> 256
    args = benchmark.parse_args(["--steps", "64", "--cache-steps", "1024"])
    assert benchmark_chat.cache_length(100, args) == 1152  # 100 + 1024 -> 1152


def test_kernel_config_overrides_build_config_objects(tmp_path):
    """`--kernel-config JSON` and a `--compare` variant's "kernel_config" name `DecodeKernelConfig` fields: they become
    config objects passed to generate_speech (`DecodeKernelConfig.for_device(device).replace(...)`, the variant's
    over the run's), never module constants set at run time; an unknown field or malformed JSON is refused before
    anything runs."""
    sys.path.insert(0, str(REPO / "scripts"))
    import benchmark
    import benchmark_chat
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    args = benchmark.parse_args(["--kernel-config", '{"attention_pipeline_stages": 3}', "--plain-launches"])
    assert args.kernel_config == {"attention_pipeline_stages": 3, "programmatic_launch": False}
    model = torch.nn.Linear(1, 1)
    expected = DecodeKernelConfig().replace(attention_pipeline_stages=3, programmatic_launch=False)
    assert benchmark_chat.kernel_config(model, args.kernel_config) == expected
    args = benchmark.parse_args(
        ["--kernel-config", '{"attention_pipeline_stages": 3}', "--compare", "{}",
         '{"plan_overrides": {"overlap_text_head": false}, "kernel_config": {"attention_split_warps": [[1, 4]], "attention_pipeline_stages": 1}}']
    )  # fmt: skip
    first, second = (benchmark_chat.variant_kwargs(model, spec, args) for spec in args.compare)
    assert first == {"kernel_config": DecodeKernelConfig(attention_pipeline_stages=3)}
    assert second == {
        "plan_overrides": {"overlap_text_head": False},
        "kernel_config": DecodeKernelConfig(attention_split_warps=((1, 4),), attention_pipeline_stages=1),
    }
    assert benchmark_chat.variant_kwargs(model, {}, benchmark.parse_args([])) == {}  # no overrides: the run's default
    for argv in (["--kernel-config", '{"no_such_field": 1}'], ["--kernel-config", "{"],
                 ["--compare", '{"kernel_config": {"split_num_warps": 8}}']):  # fmt: skip
        with pytest.raises(SystemExit):
            benchmark.parse_args(argv)
    bad = _run(["--tiny", "--device", "cpu", "--kernel-config", '{"no_such_field": 1}'], tmp_path)
    assert bad.returncode == 2 and "no field no_such_field" in bad.stdout + bad.stderr


def test_compare_measures_variants_side_by_side(tmp_path):
    """`--compare`: only the chat variants, every round measuring each in turn, per batch size; their medians in the
    JSON and one markdown table per batch; a malformed variant is refused before anything runs."""
    proc = _run(
        ["--tiny", "--device", "cpu", "--steps", "4", "--modes", "eager", "--batch-sizes", "1",
         "--compare", '{"plan_overrides": {"overlap_text_head": false}}', '{"plan_overrides": {"speech_sampler": false}}',
         "--compare-rounds", "2"],
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "benchmark.json").read_text())
    assert data["chat"] == [] and data["decoder"] == []
    (row,) = data["compare"]
    assert row["batch"] == 1 and row["mode"] == "eager" and row["rounds"] == 2
    assert [v["kwargs"] for v in row["variants"]] == [
        {"plan_overrides": {"overlap_text_head": False}}, {"plan_overrides": {"speech_sampler": False}}
    ]
    for variant in row["variants"]:
        assert len(variant["ms_per_step"]) == 2 and variant["median_ms"] > 0
    assert '| `{"plan_overrides": {"speech_sampler": false}}` |' in proc.stdout and "2 interleaved rounds" in proc.stdout
    bad = _run(["--tiny", "--device", "cpu", "--compare", "text_head=torch"], tmp_path)
    assert bad.returncode == 2 and "--compare takes JSON objects" in bad.stderr
