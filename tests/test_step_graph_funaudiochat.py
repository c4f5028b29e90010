"""Tests of `step_graph_funaudiochat`: `generate_speech`'s decode step recorded and replayed as one CUDA graph."""

import contextlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from transformers import AutoModel

from funaudiochat_hf import step_graph_funaudiochat
from funaudiochat_hf.step_graph_funaudiochat import CapturedStep, StepGraphs, tensor_addresses

from conftest import FUNAUDIOCHAT_TINY


GOLDEN_KWARGS = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.0, eos_token_id=322, pad_token_id=320)


@dataclass
class _Copies:
    weight: torch.Tensor
    bias: torch.Tensor | None
    rows: int


def test_tensor_addresses_cover_modules_dataclasses_and_containers():
    module = nn.Linear(3, 2)
    copies = _Copies(torch.zeros(4), None, 7)
    extra = torch.ones(2, 2, dtype=torch.float16)
    addresses = tensor_addresses(module, [copies, {"x": extra}], None, module)
    expected = [(t.data_ptr(), t.dtype, tuple(t.shape)) for t in (module.weight, module.bias, copies.weight, extra)]
    assert list(addresses) == expected  # in order, the module once, ints and None skipped

    with torch.no_grad():
        module.weight.mul_(2)  # in place: a recording still reads the right tensor
    assert tensor_addresses(module, [copies, {"x": extra}]) == addresses
    module.weight = nn.Parameter(module.weight.detach().clone())  # replaced: recordings are stale
    assert tensor_addresses(module, [copies, {"x": extra}]) != addresses
    assert tensor_addresses(extra.view(4)) != tensor_addresses(extra)  # a shape is part of what a recording reads


class _FakeGraph:
    """Stands in for `torch.cuda.CUDAGraph` on a CPU: flags the work run between `capture_begin` and `capture_end` as
    recorded, keeps the capture streams and the most captures ever in progress at once; counts replays."""

    active = False
    streams = []
    in_progress = 0
    most_at_once = 0

    def __init__(self):
        self.replays = 0

    def capture_begin(self, *pool, capture_error_mode="global"):
        assert capture_error_mode == "thread_local" and len(pool) <= 1
        self.pool = pool[0] if pool else None
        _FakeGraph.streams.append(_FakeStream.current)
        _FakeGraph.active = True
        _FakeGraph.in_progress += 1
        _FakeGraph.most_at_once = max(_FakeGraph.most_at_once, _FakeGraph.in_progress)

    def capture_end(self):
        _FakeGraph.in_progress -= 1
        _FakeGraph.active = False

    def replay(self):
        self.replays += 1


class _FakeStream:
    current = None  # the stream of the innermost `torch.cuda.stream(...)` block

    def __init__(self, device=None):
        self.device = device

    def wait_stream(self, other):
        pass


@contextlib.contextmanager
def _fake_stream_context(stream):
    outer, _FakeStream.current = _FakeStream.current, stream
    try:
        yield
    finally:
        _FakeStream.current = outer


def _fake_cuda_graphs(monkeypatch) -> None:
    """`torch.cuda`'s graphs and streams stood in for on a CPU (and no side stream made yet). A capture must neither
    synchronise the device nor empty the caching allocators (as `torch.cuda.graph` does)."""
    from funaudiochat_hf import cuda_graph_capture

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"a capture called torch.cuda.{name}")

        return call

    cuda = step_graph_funaudiochat.torch.cuda
    monkeypatch.setattr(cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(cuda, "graph", forbidden("graph"))
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(cuda, name, forbidden(name))
    monkeypatch.setattr(cuda, "Stream", _FakeStream)
    monkeypatch.setattr(cuda, "stream", _fake_stream_context)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: _FakeStream(device))
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "graph_pool_handle", object)
    monkeypatch.setattr(cuda_graph_capture, "_CAPTURE", cuda_graph_capture._CaptureStreams())
    monkeypatch.setattr(_FakeGraph, "streams", [])
    monkeypatch.setattr(_FakeGraph, "most_at_once", 0)


def _fake_workspace():
    ws = type("Workspace", (), {})()
    ws.step_graphs, ws.device = StepGraphs(), torch.device("cuda")
    return ws


def test_captured_step_runs_then_records_once_then_replays(monkeypatch):
    _fake_cuda_graphs(monkeypatch)
    calls = []
    step = CapturedStep(lambda model, ws, cfg: calls.append(("recorded" if _FakeGraph.active else "ran", cfg)), "key")
    ws = _fake_workspace()
    ws.step_graphs.check(((1, torch.float32, (2,)),))

    step(None, ws, "cfg")  # compiles / builds its kernels: run for real, nothing recorded
    assert calls == [("ran", "cfg")] and len(ws.step_graphs) == 0
    step(None, ws, "cfg")  # recorded (which runs nothing), then replayed
    assert calls[1:] == [("recorded", "cfg")] and ws.step_graphs.graphs["key"].replays == 1
    for _ in range(3):
        step(None, ws, "cfg")
    assert len(calls) == 2 and ws.step_graphs.graphs["key"].replays == 4

    other = CapturedStep(lambda model, ws, cfg: calls.append(("other", cfg)), "other key")
    other(None, ws, "cfg")  # another configuration keeps its own graph
    assert calls[-1] == ("other", "cfg") and list(ws.step_graphs.graphs) == ["key"]

    ws.step_graphs.check(((1, torch.float32, (2,)),))  # same tensors: the graphs stay
    assert len(ws.step_graphs) == 1
    ws.step_graphs.check(((2, torch.float32, (2,)),))  # a tensor moved: dropped, warmed up again
    assert len(ws.step_graphs) == 0
    step(None, ws, "cfg")
    assert calls[-1] == ("ran", "cfg")
    step(None, ws, "cfg")
    # Every capture on the device's one side stream: a new stream per capture got cuBLAS workspaces of its own
    # (34.6 MB on an H100), kept for the life of the process.
    streams = _FakeGraph.streams
    assert len(streams) == 2 and isinstance(streams[0], _FakeStream) and streams[0] is streams[1]


def test_graphs_recorded_with_a_shared_pool_share_the_workspaces_one(monkeypatch):
    """Graphs that never replay together (the audio encoder's, one per chunk count) share one memory pool of the
    workspace, so they hold the largest one's intermediates, not the sum; others get a pool of their own; when the
    graphs are dropped (a tensor moved) so is the pool."""
    _fake_cuda_graphs(monkeypatch)
    ws = _fake_workspace()
    ws.step_graphs.check(((1, torch.float32, (2,)),))
    steps = [CapturedStep(lambda model, ws, cfg: None, ("audio", n), shared_pool=True) for n in (1, 2)]
    steps.append(CapturedStep(lambda model, ws, cfg: None, "step"))
    for step in steps * 2:  # run, then record
        step(None, ws, None)
    graphs = ws.step_graphs.graphs
    assert graphs[("audio", 1)].pool is graphs[("audio", 2)].pool is not None and graphs["step"].pool is None
    first_pool = graphs[("audio", 1)].pool
    ws.step_graphs.check(((2, torch.float32, (2,)),))
    for step in steps[:1] * 2:
        step(None, ws, None)
    assert graphs[("audio", 1)].pool is not first_pool


def test_two_threads_never_capture_at_once(monkeypatch):
    """The speech engine's prefill and output threads may both record: their captures (on the device's one side
    stream) take turns, each recording its own work; the devices' side streams differ."""
    import threading
    import time

    _fake_cuda_graphs(monkeypatch)
    start = threading.Barrier(4, timeout=30)
    recorded = []

    def run(index):
        def function(model, ws, cfg):
            if _FakeGraph.active:
                time.sleep(0.02)  # long enough for another thread to try to capture meanwhile
                recorded.append(index)

        ws = _fake_workspace()
        ws.device = torch.device("cuda", index % 2)
        captured = CapturedStep(function, ("test", index))
        captured(None, ws, None)  # runs it
        start.wait()
        captured(None, ws, None)  # records and replays

    threads = [threading.Thread(target=run, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(recorded) == [0, 1, 2, 3] and _FakeGraph.most_at_once == 1
    streams = _FakeGraph.streams
    assert len({id(stream) for stream in streams}) == 2  # one per device
    assert {stream.device.index for stream in streams} == {0, 1}


def test_first_check_keeps_what_ran_warm(monkeypatch):
    """The first address check follows the first call's warm-up runs (the prompt pass runs before it): made with
    these very tensors, they stay warm, so the second call records; a later move warms up again."""
    _fake_cuda_graphs(monkeypatch)
    calls = []
    step = CapturedStep(lambda model, ws, cfg: calls.append("recorded" if _FakeGraph.active else "ran"), "prompt")
    ws = _fake_workspace()
    step(None, ws, "cfg")  # before any check: the first call's prompt pass
    ws.step_graphs.check(((1, torch.float32, (2,)),))
    step(None, ws, "cfg")
    assert calls == ["ran", "recorded"]
    ws.step_graphs.check(((2, torch.float32, (2,)),))  # moved after recording: dropped and warmed up again
    step(None, ws, "cfg")
    assert calls[-1] == "ran"


def test_addresses_are_checked_before_the_prompt_pass_replays(model, inputs, monkeypatch):
    """The audio encoder and the prompt pass are recorded too: from a workspace's second call on, its tensor addresses
    are checked before either, so that a replaced weight drops the recordings before one replays (the old tensor may be
    freed). On a CPU, with the plan of a GPU whose Triton kernels are off and the recorded parts run directly, the
    order of the audio encoder, the prompt pass, the checks and the CRQ's first sub-steps of each call."""
    from funaudiochat_hf import generation_plan_funaudiochat

    monkeypatch.setattr(generation_plan_funaudiochat.DeviceFacts, "of", classmethod(lambda cls, m: cls("cuda", False)))
    events = []
    monkeypatch.setattr(CapturedStep, "__call__", lambda self, *args: events.append(self.key[0]) or self.function(*args))
    check = StepGraphs.check
    monkeypatch.setattr(StepGraphs, "check", lambda self, addresses: events.append("check") or check(self, addresses))
    generator = model.speech_generator(backend="cuda_graphs")
    first = generator.generate(**inputs, **GOLDEN_KWARGS)
    first_call = events[: events.index("step")]
    assert first_call[:3] == ["audio_chunks", "prompt", "check"]  # no cache before the prompt pass: checked after
    events.clear()
    again = generator.generate(**inputs, **GOLDEN_KWARGS)
    assert events[:3] == ["check", "audio_chunks", "prompt"] and events.count("check") == 1
    assert torch.equal(again.sequences, first.sequences) and torch.equal(again.speech_ids, first.speech_ids)
    eager = model.generate_speech(**inputs, **GOLDEN_KWARGS, backend="eager")  # the padded prompt pass: same tokens
    assert torch.equal(first.sequences, eager.sequences) and torch.equal(first.speech_ids, eager.speech_ids)
    generator.close()


def test_step_graph_needs_cuda(model, inputs):
    """The CUDA-graph backend says it needs a GPU; the compiled backend on a CPU runs without a step graph."""
    with pytest.raises(ValueError, match="cuda_graphs.*CUDA"):
        model.generate_speech(**inputs, **GOLDEN_KWARGS, backend="cuda_graphs")
    with model.speech_generator(backend="compiled") as generator:
        assert not generator.plan(None, 1, False, None).step_graph
        out = generator.generate(**inputs, **GOLDEN_KWARGS, compile_config={"backend": "aot_eager"})
    assert out.sequences.shape[1] > inputs["input_ids"].shape[1]


def _workspace(generator):
    (workspace,) = generator._workspaces.values()
    return workspace


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_graphs", "compiled"])
def test_step_graph_matches_eager_and_records_again_when_a_weight_moves_on_gpu(inputs, backend):
    """On CUDA the fast backends record their decode step and CRQ sub-step as one CUDA graph each: the golden tokens
    and per-step logits of the eager loop every call; a replaced weight is read after the next call records
    again."""
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    kwargs = dict(GOLDEN_KWARGS, output_logits=True)

    def check(reference, compiled):
        assert torch.equal(compiled.sequences, reference.sequences)
        assert torch.equal(compiled.speech_ids, reference.speech_ids)
        torch.testing.assert_close(compiled.text_logits, reference.text_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(compiled.speech_logits, reference.speech_logits, atol=1e-4, rtol=1e-4)

    eager = model.generate_speech(**inputs, **kwargs, backend="eager")
    generator = model.speech_generator(backend=backend)
    for call in range(3):  # warm-up and recording in the first call, replays only in the next ones
        check(eager, generator.generate(**inputs, **kwargs))
        graphs = _workspace(generator).step_graphs
        # The step runs many times a call: warm, then recorded in the first call. The prefill's CRQ sub-steps (and,
        # under "cuda_graphs", the audio encoder and the bucket-padded prompt pass) run once a call: warm in the first,
        # recorded in the second.
        prefill_parts = {"prefill_crq", "prompt", "audio_chunks"} if backend == "cuda_graphs" else {"prefill_crq"}
        once = prefill_parts if call > 0 else set()
        assert set(key[0] for key in graphs.graphs) == {"step"} | once
    recorded = dict(graphs.graphs)
    check(eager, generator.generate(**inputs, **kwargs))
    assert graphs.graphs == recorded  # replayed, not recorded again

    down_proj = model.audio_invert_tower.crq_transformer.layers[0].mlp.down_proj
    down_proj.weight = nn.Parameter(down_proj.weight.detach() * 3)
    changed = model.generate_speech(**inputs, **kwargs, backend="eager")
    assert not torch.equal(changed.speech_logits, eager.speech_logits)
    for _ in range(2):
        check(changed, generator.generate(**inputs, **kwargs))
    assert all(graph is not recorded.get(key) for key, graph in _workspace(generator).step_graphs.graphs.items())
    generator.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_graphs", "compiled"])
def test_step_graph_batch_rows_equal_single_runs_on_gpu(inputs, backend):
    from conftest import assert_batch_rows_equal_single_runs

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    for _ in range(2):  # the second time from recorded graphs
        assert_batch_rows_equal_single_runs(model, inputs, dict(GOLDEN_KWARGS, backend=backend))


@pytest.mark.gpu
def test_two_threads_record_on_gpu():
    """The speech engine's prefill and output threads may record CUDA graphs at the same time: their captures take
    turns on the device's one side stream (two at once on one stream fail or mix their work; a stream per capture
    keeps cuBLAS workspaces for good). Both recordings then replay their own work."""
    import threading
    import time
    from types import SimpleNamespace

    start, errors = threading.Barrier(2, timeout=30), []
    tensors = [torch.ones(4, device="cuda") for _ in range(2)]

    def step(index):
        def function(model, ws, cfg):
            if ws.recording:
                time.sleep(0.05)  # the other thread tries to capture meanwhile
            tensors[index].mul_(index + 2)

        return function

    def run(index):
        try:
            ws = SimpleNamespace(step_graphs=StepGraphs(), device=tensors[index].device, recording=False)
            captured = CapturedStep(step(index), ("test", index))
            captured(None, ws, None)  # runs it
            ws.recording = True
            start.wait()
            captured(None, ws, None)  # records and replays
            ws.recording = False
            captured(None, ws, None)  # replays
        except Exception as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    assert not errors, errors
    assert tensors[0].tolist() == [2.0**3] * 4 and tensors[1].tolist() == [3.0**3] * 4
