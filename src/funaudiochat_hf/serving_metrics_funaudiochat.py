"""The speech engine's metrics: the counters and histograms a `SpeechEngine` updates under its lock (`EngineMetrics`),
and their Prometheus text from the engine's `snapshot()` (`prometheus_text`, the server's `/metrics`)."""

from __future__ import annotations


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1


class EngineMetrics:
    """Counters of a `SpeechEngine` (read by the server's `/metrics`); updated under the engine's lock."""

    def __init__(self):
        self.requests = {"stop": 0, "length": 0, "cancelled": 0, "error": 0, "rejected": 0}
        self.steps = 0
        self.rebases = 0
        self.step_rows = Histogram((1, 2, 4, 8, 16, 32, 64, 128))
        self.time_to_first_audio = Histogram((0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0))
        self.audio_seconds = 0.0


def prometheus_text(snapshot: dict) -> str:
    """The engine's metrics in Prometheus' text format."""
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)

    def histogram(name, help_, data):
        buckets, counts, total, count = data
        samples = [f'{name}_bucket{{le="{bound:g}"}} {n}' for bound, n in zip(buckets, counts)]
        samples += [f'{name}_bucket{{le="+Inf"}} {count}', f"{name}_sum {total:.6f}", f"{name}_count {count}"]
        metric(name, "histogram", help_, samples)

    requests = [f'funaudiochat_requests_total{{outcome="{k}"}} {v}' for k, v in snapshot["requests"].items()]
    metric("funaudiochat_requests_total", "counter", "Requests by outcome (stop, length, cancelled, error, rejected).",
           requests)  # fmt: skip
    metric("funaudiochat_requests_running", "gauge", "Requests in a decode slot.", [
        f"funaudiochat_requests_running {snapshot['running']}"])  # fmt: skip
    metric("funaudiochat_requests_queued", "gauge", "Requests waiting for a slot.", [
        f"funaudiochat_requests_queued {snapshot['queued']}"])  # fmt: skip
    metric("funaudiochat_slots", "gauge", "Rows of the static decode batch.", [
        f"funaudiochat_slots {snapshot['slots']}"])  # fmt: skip
    metric("funaudiochat_decode_steps_total", "counter", "Decode steps run.", [
        f"funaudiochat_decode_steps_total {snapshot['steps']}"])  # fmt: skip
    metric("funaudiochat_cache_rebases_total", "counter", "Cache column shifts made to admit a request.", [
        f"funaudiochat_cache_rebases_total {snapshot['rebases']}"])  # fmt: skip
    histogram("funaudiochat_decode_step_rows", "Requests decoded per decode step.", snapshot["step_rows"])
    histogram("funaudiochat_time_to_first_audio_seconds", "Submission to first audio chunk.",
              snapshot["time_to_first_audio"])  # fmt: skip
    metric("funaudiochat_generated_audio_seconds_total", "counter", "Seconds of audio generated.", [
        f"funaudiochat_generated_audio_seconds_total {snapshot['audio_seconds']:.3f}"])  # fmt: skip
    return "\n".join(lines) + "\n"
