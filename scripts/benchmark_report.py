"""The markdown tables of `scripts/benchmark.py`'s results (its JSON, also one written on another machine): the chat
rows, `--compare` variants, the one-line extras (bandwidth, model sizes, CRQ share, time to first audio, repeated
calls) and the decoder rows."""

from __future__ import annotations

from pathlib import Path

from benchmark_chat import variant_label
from benchmark_common import OFFICIAL_CHAT_MS, OFFICIAL_DECODER, log


def fmt(value, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10 ** (-digits):
            return f"{value:.2g}{suffix}"
        return f"{value:,.{digits}f}{suffix}"
    return f"{value}{suffix}"


def human(value: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (params) / '1.23 MB' (bytes)."""
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".strip()


def row_status(row: dict) -> str | None:
    return row.get("status")


def notes_of(row: dict) -> str:
    parts = list(row.get("notes") or [])
    if row.get("status"):
        parts.insert(0, row["status"])
    return "; ".join(parts).replace("|", "/")


def notes_suffix(row: dict) -> str:
    """" (notes)" for a report sentence, or "" when the row has none."""
    notes = notes_of(row)
    return f" ({notes})" if notes else ""


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_chat(data: dict) -> str:
    rows = []
    for r in data["chat"]:
        if row_status(r):
            rows.append([r["mode"], str(r["batch"])] + ["–"] * 10 + [notes_of(r)])
            continue
        rows.append(
            [
                r["mode"],
                str(r["batch"]),
                fmt(r["ms_per_step"], 2) + f" ±{fmt(r.get('spread_ms'), 2)}",
                fmt(r["rtf"], 4),
                fmt(r["x_realtime_aggregate"], 0) + "×",
                fmt(r.get("floor_ms"), 2),
                fmt(r.get("x_floor"), 2) + "×",
                fmt(r.get("achieved_gb_per_s"), 0),
                fmt(OFFICIAL_CHAT_MS["default SDPA"] / r["ms_per_step"], 0) + "×"
                if r["batch"] == 1
                else "–",
                fmt(r.get("compile_s"), 1),
                fmt(r.get("fixed_s"), 3),
                fmt(r.get("peak_gb"), 1),
                notes_of(r),
            ]
        )
    header = [
        "mode",
        "batch",
        "ms / LLM step",
        "RTF",
        "aggregate × real time",
        "floor ms",
        "× floor",
        "weights GB/s",
        "× faster than official (390 ms)",
        "compile s",
        "prefill+overhead s",
        "peak GB (chat)",
        "notes",
    ]
    out = [table(header, rows)]
    # eager vs compiled, measured in this run
    by_key = {(r["mode"], r["batch"]): r for r in data["chat"] if not row_status(r)}
    ratios = [
        f"batch {b}: compiled is {by_key[('eager', b)]['ms_per_step'] / by_key[('compiled', b)]['ms_per_step']:.1f}× "
        f"faster than eager"
        for b in sorted({k[1] for k in by_key})
        if ("eager", b) in by_key and ("compiled", b) in by_key
    ]
    if ratios:
        out.append("\n" + "; ".join(ratios) + ".")
    return "\n".join(out)


def render_compare(data: dict) -> str:
    """One table per `--compare` measurement: each variant's median step and its rounds, relative to the first."""
    out = []
    for r in data.get("compare", []):
        title = f"Side by side ({r['mode']}, batch {r['batch']}, {r.get('rounds', '?')} interleaved rounds)"
        if row_status(r):
            out.append(f"{title}: {r['status']}")
            continue
        first = r["variants"][0]["median_ms"]
        rows = [
            [
                f"`{variant_label(v)}`",
                fmt(v["median_ms"], 3),
                fmt(v["median_ms"] / first, 3) + "×",
                ", ".join(fmt(ms, 3) for ms in v["ms_per_step"]),
                "; ".join(v.get("notes", [])),
            ]
            for v in r["variants"]
        ]
        header = ["generate_speech kwargs", "ms / LLM step (median)", "vs first", "rounds (ms)", "notes"]
        out.append(f"{title}:\n\n{table(header, rows)}")
    return "\n\n".join(out)


def render_extras(data: dict) -> str:
    lines = []
    bw = data.get("bandwidth") or {}
    if bw.get("copy_gb_per_s"):
        lines.append(
            f"- Device copy bandwidth (read + write): **{bw['copy_gb_per_s']:.0f} GB/s** "
            f"({bw['buffer_mb']} MiB buffers)."
        )
    elif bw.get("status"):
        lines.append(f"- Copy bandwidth: {bw['status']}")
    cm = data.get("chat_model") or {}
    if cm.get("weight_bytes_per_step"):
        lines.append(
            f"- Chat model: {human(cm['parameters'])} parameters ({cm['dtype']}, attention "
            f"{cm.get('attn_implementation')}), built in {cm['build_s']} s; bytes read per step: LLM "
            f"{human(cm['llm_bytes'], 'B')} + {cm['group_size']} × CRQ {human(cm['crq_substep_bytes'], 'B')} + "
            f"pre_matching {human(cm['pre_matching_bytes'], 'B')} = **{human(cm['weight_bytes_per_step'], 'B')}** "
            "(the floor also counts the KV cache read at the mean context)."
        )
    elif cm.get("status"):
        lines.append(f"- Chat model: {cm['status']}")
    if cm.get("non_finite_buffers"):
        lines.append(f"- WARNING non-finite buffers: {cm['non_finite_buffers']}")
    for r in data.get("crq_share", []):
        if row_status(r):
            lines.append(f"- CRQ share ({r['mode']}, batch {r['batch']}): {r['status']}")
        else:
            share = r.get("crq_share")
            lines.append(
                f"- CRQ share ({r['mode']}, batch {r['batch']}): LLM-only step (`disable_speech=True`) "
                f"{r['llm_only_ms_per_step']:.2f} ms vs full {fmt(r.get('full_ms_per_step'), 2)} ms → CRQ "
                f"{'–' if share is None else f'{share * 100:.0f} %'} of the step."
                + notes_suffix(r)
            )
    stream_options = data.get("meta", {}).get("stream_options", "streaming_decoder() defaults")
    for r in data.get("ttfa", []):
        if r.get("prefill"):  # rows since the prefill compiles with the loop by default
            mode = f"{r['mode']}, {r['prefill']} prefill"
        else:  # older JSON (--from-json): the prefill was eager unless compile_prefill was set
            mode = r["mode"] + (", compile_prefill=True" if r.get("compile_prefill") else "")
        if row_status(r):
            lines.append(f"- Time to first audio ({mode}): {r['status']}")
        else:
            lines.append(
                f"- Time to first audio chunk ({mode}, {r['input_seconds']:g} s question, full decoder, hop 15, "
                f"stream options {stream_options}): "
                f"**{r['ttfa_ms']:.0f} ms** warm (first call {r['first_call_ttfa_ms']:.0f} ms), after "
                f"{r['events_before_audio']} stream events"
                + (f" (arrived at {', '.join(map(str, r['event_ms']))} ms)" if r.get("event_ms") else "")
                + f"; peak {fmt(r.get('peak_gb'), 1)} GB."
                + notes_suffix(r)
            )
    for r in data.get("repeat_calls", []):
        if row_status(r):
            lines.append(f"- Repeated calls ({r.get('mode')}): {r['status']}")
        else:
            lines.append(
                f"- {r['calls']} consecutive `generate_speech` calls ({r['mode']}, {r['steps_per_call']} steps each): "
                f"median {r['median_call_ms']:.0f} ms, max {r['max_call_ms']:.0f} ms; allocated memory "
                f"{fmt(r.get('allocated_before_gb'), 3)} GB before → {fmt(r.get('allocated_after_gb'), 3)} GB after; "
                f"peak {fmt(r.get('peak_gb'), 1)} GB." + notes_suffix(r)
            )
    return "\n".join(lines)


def render_decoder(data: dict) -> str:
    rows = []
    for r in data["decoder"]:
        if row_status(r):
            rows.append([r["mode"], r["test"]] + ["–"] * 7 + [notes_of(r)])
            continue
        official = OFFICIAL_DECODER.get(r["test"], {})
        rows.append(
            [
                r["mode"],
                r["test"] + (f" (hop {r['hop']})" if r.get("hop") else ""),
                fmt(r["wall_s"], 3),
                fmt(r["rtf"], 4),
                fmt(r.get("first_chunk_ms"), 1),
                fmt(r.get("max_chunk_ms"), 1),
                f"{fmt(r.get('first_chunk_ms'), 1)} → {fmt(r.get('last_chunk_ms'), 1)}" if r.get("chunks") else "–",
                fmt(r.get("peak_gb"), 2),
                (f"{official['wall_s']} s / RTF {official['rtf']} → {fmt(r.get('x_vs_official'), 1)}×")
                if official
                else "–",
                notes_of(r),
            ]
        )
    header = [
        "mode",
        "test",
        "wall s",
        "RTF",
        "first chunk ms",
        "max chunk ms",
        "first → last chunk ms",
        "peak GB (decoder)",
        "official (performance.md) → ours ×",
        "notes",
    ]
    out = [table(header, rows)]
    dm = data.get("decoder_model") or {}
    if dm.get("parameters"):
        out.append(
            f"\nDecoder: {human(dm['parameters'])} parameters ({dm['dtype']}, {dm['source']}), built in "
            f"{dm['build_s']} s. Streaming pushes 5 tokens at a time (one LLM step); a chunk's time is the push that "
            "returned it, i.e. its latency after its tokens arrived."
        )
    elif dm.get("status"):
        out.append(f"\nDecoder: {dm['status']}")
    return "\n".join(out)


def render_markdown(data: dict) -> str:
    meta = data["meta"]
    # Name only the parts that ran (a decoder-only run says nothing about generate_speech's settings).
    compiled = []
    if data["chat"] or data.get("chat_model"):
        compiled.append(f"`generate_speech({meta.get('chat_compile')})`")
    if data.get("decoder") or data.get("decoder_model"):
        compiled.append(f"decoder `{meta.get('decoder_compile')}`")
    parts = [
        f"## {meta['date']} — {meta.get('gpu')}",
        "",
        f"`{meta['command']}`",
        "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, CUDA {meta.get('cuda', '–')}, python "
        f"{meta['python']}, funaudiochat_hf {meta.get('funaudiochat_hf')} (git {meta.get('git') or '?'}); "
        + (f"compiled = {', '.join(compiled)}; " if compiled else "")
        + f"float32 matmul precision {meta.get('float32_matmul_precision')}"
        + (" — **tiny random configs, numbers are not meaningful**" if meta.get("tiny") else ""),
        "",
    ]
    if data.get("compare"):
        parts += ["### Chat loop variants side by side, random weights", "", render_compare(data), ""]
    if data["chat"]:
        parts += ["### Chat loop (LLM + CRQ), random weights", "", render_chat(data), ""]
    if data["chat"] or data.get("chat_model") or data.get("bandwidth"):
        parts += [render_extras(data), ""]
    if data["decoder"] or data.get("decoder_model"):
        precision = meta.get("decoder_precision", "float32")
        streaming = meta.get("stream_options", "streaming_decoder() defaults")
        layout = "; HiFT's filter channels-last" if meta.get("vocoder_layout") == "channels-last" else ""
        parts += [
            f"### CosyVoice3 decoder ({precision} estimator{layout}; streaming: {streaming}), random weights",
            "",
            render_decoder(data),
            "",
        ]
        for row in data.get("decoder_precision", []):
            if "mel_snr_db" in row:
                parts += [
                    f"Precision check ({row['precision']} vs float32, eager, 10 s of random tokens): mel SNR "
                    f"{row['mel_snr_db']:.1f} dB (max abs diff {row['mel_max_abs_diff']:.3g}, mel std "
                    f"{row['mel_std']:.3g}), waveform SNR {row['wav_snr_db']:.1f} dB"
                    + (
                        f" (F0 {row['f0_snr_db']:.1f} dB; with float32's excitation "
                        f"{row['wav_same_excitation_snr_db']:.1f} dB)"
                        if "f0_snr_db" in row
                        else ""
                    )
                    + f"{notes_suffix(row)}.",
                    "",
                ]
    skipped = [entry for entry in data.get("log", []) if entry["status"].startswith("skipped")]
    if skipped:
        parts += ["Skipped (time budget): " + ", ".join(e["label"] for e in skipped) + ".", ""]
    parts.append(
        "Context (performance.md, official code, H200, batch 1): 390 ms/step default SDPA, 189–205 ms with cuDNN SDPA "
        "off, 23.3 GB peak; floor ≈ 4.7 ms/step. Targets: ≤ 7 ms/step at batch 1, first audio ≤ 150 ms, batch 16 ≥ "
        "300× real time; decoder offline RTF ≤ 0.01, streaming RTF ≤ 0.02 with first chunk ≤ 30 ms."
    )
    return "\n".join(parts) + "\n"


def write_markdown(path: str | Path, markdown: str) -> None:
    """Write the rendered tables to `path` (`--markdown`), replacing what was there."""
    Path(path).write_text(markdown)
    log(f"wrote the markdown tables to {path}")
