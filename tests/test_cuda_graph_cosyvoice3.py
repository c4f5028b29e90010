"""CUDA-graph replay of the streaming CosyVoice3 decoder (`cuda_graph_cosyvoice3.CUDAGraphRunner`).

The replay itself needs a GPU (tests marked `gpu`); on CPU the argument checks and the "auto" choices are tested.
"""

import pytest
import torch

from funaudiochat_hf import CosyVoice3Token2Wav
from funaudiochat_hf.cuda_graph_cosyvoice3 import (
    CUDAGraphRunner,
    _Recording,
    _static_copy,
    broadcast_dims,
    input_signature,
)
from funaudiochat_hf.streaming_batch_cosyvoice3 import GRAPH_BATCH_SIZES, decode_ready
from funaudiochat_hf.streaming_cosyvoice3 import _graph_runners

from conftest import COSYVOICE3_TINY


def _stream(model, tokens, **kwargs):
    decoder = model.streaming_decoder(speaker="中文女", token_hop_len=15, flow_left_context_tokens=30, **kwargs)
    pieces = [decoder.push(tokens[i : i + 5]) for i in range(0, len(tokens), 5)]
    return torch.cat(pieces + [decoder.finalize()]), decoder


def test_runner_rejects_non_cuda_tensors_and_bad_sizes():
    runner = CUDAGraphRunner(lambda x: x * 2)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        runner(torch.ones(3))
    with pytest.raises(ValueError, match="max_graphs"):
        CUDAGraphRunner(lambda x: x, max_graphs=0)


def test_recording_copies_an_input_only_when_it_is_another_tensor_or_was_modified():
    """What `CUDAGraphRunner` does before each replay (its static buffers here on CPU; the replay itself is tested on
    the GPU below): the same tensor, unmodified, is not copied again; a modified one (in place, through a view or an
    index) or another tensor is; inference-mode tensors, which have no version counter, always are."""
    static = torch.zeros(4)
    recording = _Recording(graph=None, inputs=[static], output=None)
    value = torch.ones(4)
    recording.load_inputs((value,))
    assert torch.equal(static, value)
    static.fill_(7.0)  # stands for a copy that would have been needed
    recording.load_inputs((value,))
    assert torch.equal(static, torch.full((4,), 7.0))  # not copied again
    value[1:].add_(1.0)  # modified through a view: copied
    recording.load_inputs((value,))
    assert torch.equal(static, torch.tensor([1.0, 2.0, 2.0, 2.0]))
    recording.load_inputs((torch.full((4,), 3.0),))  # another tensor: copied
    assert torch.equal(static, torch.full((4,), 3.0))
    with torch.inference_mode():
        frozen = torch.full((4,), 5.0)
        recording.load_inputs((frozen,))
        static.fill_(0.0)
        recording.load_inputs((frozen,))
    assert torch.equal(static, frozen)


def test_recording_keeps_one_slice_of_a_broadcast_input():
    """An input expanded along a dimension (the flow's time conditioning: one row for every batch row) is kept as one
    slice in the recording, expanded as the graph reads it; later values write that slice."""
    row = torch.arange(6.0).reshape(1, 6)
    value = row.expand(32, 6)
    assert broadcast_dims(value) == (0,) and broadcast_dims(row) == () and broadcast_dims(torch.zeros(32, 6)) == ()
    static = _static_copy(value)
    assert static.shape == (32, 6) and static.stride() == (0, 1) and static.untyped_storage().nbytes() == 6 * 4
    recording = _Recording(graph=None, inputs=[static], output=None)
    recording.load_inputs(((row + 1).expand(32, 6),))
    assert torch.equal(recording.inputs[0], (row + 1).expand(32, 6))
    dense = torch.randn(2, 3)
    assert torch.equal(_static_copy(dense), dense) and _static_copy(dense).data_ptr() != dense.data_ptr()


def test_signature_tells_broadcast_from_dense_inputs():
    """A dense input of a broadcast one's shape is another recording (its rows differ: one slice cannot hold it)."""
    broadcast, dense = torch.ones(1, 4).expand(8, 4), torch.ones(8, 4)
    assert input_signature((broadcast,)) != input_signature((dense,))
    assert input_signature((broadcast,)) == input_signature((torch.zeros(1, 4).expand(8, 4),))


def test_streaming_graphs_are_off_on_cpu_and_cannot_be_forced():
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    decoder = model.streaming_decoder(speaker="中文女")
    assert decoder.cuda_graphs is False and decoder.flow_window_sizes is None  # eager CPU: exact shapes
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        model.streaming_decoder(speaker="中文女", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        model.streaming_decoder(speaker="中文女", cuda_graphs="always")


def test_the_model_owns_its_streaming_graph_runners_until_cleared():
    """The runners (and the recordings and memory pools they hold) belong to the model: none until a stream needs
    them, then one set shared by every stream of the model, freed by `clear_streaming_graphs()`."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    assert model.streaming_graph_runners is None
    runners = _graph_runners(model)
    assert model.streaming_graph_runners is runners and _graph_runners(model) is runners
    assert set(runners) == {"flow", "hift"}
    model.clear_streaming_graphs()
    assert model.streaming_graph_runners is None
    assert _graph_runners(model) is not runners


def test_flow_graph_records_the_whole_window_from_token_ids_to_mel():
    """The flow graph starts at the token ids: its function embeds them and runs the look-ahead conv before the
    solver (eagerly those ~20 small launches made the GPU wait before each chunk's solver graph: measured slower),
    and its signature follows those layers' weights. Run here on CPU tensors (what the graph records), it gives
    `tokens_to_mel`'s mel, also for a right-padded, key-masked window."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    runner = _graph_runners(model)["flow"]
    flow, ratio = model.flow, model.config.token_mel_ratio
    tokens = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    speaker = model.get_speaker_embedding(speaker="中文女")
    with torch.no_grad():
        expected = model.tokens_to_mel(tokens, speaker)
        padded = torch.nn.functional.pad(tokens, (0, 4))
        frames = ratio * padded.shape[1]
        mask = (torch.arange(frames) < ratio * 20).view(1, 1, 1, frames)
        noise = flow.decoder.start_noise(1, frames)
        conditioning = flow.decoder.cached_time_conditioning(1, tokens.device, noise.dtype)
        mel = runner.function(padded, torch.tensor([20]), noise, flow.speaker_condition(speaker), mask, *conditioning)
    torch.testing.assert_close(mel[..., : ratio * 20], expected, atol=1e-5, rtol=1e-5)
    before = runner.settings()
    flow.input_embedding.weight.data = flow.input_embedding.weight.data.clone()  # re-allocated: record again
    assert runner.settings() != before


def test_steady_chunks_pass_the_flow_graph_the_same_constant_tensors():
    """Once the flow windows are full, every chunk hands the flow graph the very same token-count, key-mask, speaker
    and time-conditioning tensors (built once per window shape and per reply), so the runner copies only the token
    ids and the start noise before each replay: otherwise the GPU waits for the host's launches at the start of every
    chunk (bound by the host's work, measured slower). Run on CPU with a runner stand-in that
    records what it gets and computes it eagerly; the audio is the eager stream's."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    tokens = torch.randint(0, model.config.vocab_size, (120,), generator=torch.Generator().manual_seed(5))
    bucket = 30 + 15 + model.config.pre_lookahead_len
    expected, _ = _stream(model, tokens, flow_window_bucket_tokens=bucket)
    calls = []

    def flow_runner(*tensors):
        calls.append(tensors)
        return _graph_runners(model)["flow"].function(*tensors)

    decoder = model.streaming_decoder(speaker="中文女", token_hop_len=15, flow_left_context_tokens=30,
                                      flow_window_bucket_tokens=bucket)
    decoder._graphs = {"flow": flow_runner, "hift": lambda mel, source: model.hift.decode(mel, source, False)}
    decoder.cuda_graphs = True  # what the decoder does on CUDA: always a mask, graph-runner calls
    solver, fetched = model.flow.decoder, []
    cached = solver.cached_time_conditioning
    solver.cached_time_conditioning = lambda *args: fetched.append(args) or cached(*args)
    try:
        pieces = [decoder.push(tokens[i : i + 5]) for i in range(0, len(tokens), 5)]
    finally:
        del solver.cached_time_conditioning
    assert len(fetched) == 1  # once per reply: validating the model's cache costs the host ~0.2 ms per chunk
    torch.testing.assert_close(torch.cat(pieces + [decoder.finalize()]), expected, atol=1e-5, rtol=1e-5)
    assert all(call[4] is not None for call in calls)  # graph calls always take a mask (one signature)
    steady = [call for call in calls[:-1] if int(call[1]) == bucket]  # full windows, not the final call
    assert len(steady) >= 3
    for call in steady[1:]:  # (tokens, lengths, noise, speaker, mask, *conditioning): all but tokens and noise
        assert all(now is first for index, (now, first) in enumerate(zip(call, steady[0])) if index not in (0, 2))
        assert not torch.equal(call[2], steady[0][2])  # the start noise moves with the window


@pytest.mark.gpu
def test_runner_copies_an_input_again_only_when_it_is_another_tensor_or_was_modified():
    runner = CUDAGraphRunner(lambda x, y: x * 2 + y)
    x, y = torch.ones(4, device="cuda"), torch.zeros(4, device="cuda")
    torch.testing.assert_close(runner(x, y), torch.full((4,), 2.0, device="cuda"))
    recording = next(iter(runner._recordings.values()))
    recording.inputs[1].fill_(100.0)  # stands for a copy that would have been needed
    # the same y, unmodified: not copied again (the recorded buffer is used as it is)
    torch.testing.assert_close(runner(x, y), torch.full((4,), 102.0, device="cuda"))
    y.add_(1.0)  # modified in place (its version changes): copied again
    torch.testing.assert_close(runner(x, y), torch.full((4,), 3.0, device="cuda"))
    torch.testing.assert_close(runner(x, y.clone()), torch.full((4,), 3.0, device="cuda"))  # another tensor
    x[0] = 5.0  # an in-place write through indexing also counts
    torch.testing.assert_close(runner(x, y)[0], torch.tensor(11.0, device="cuda"))


@pytest.mark.gpu
def test_streaming_checks_device_tokens_when_a_chunk_needs_them():
    """Tokens pushed on the GPU are range-checked by the push that decodes them (pushes that decode nothing do not
    synchronise); a bad id raises there, the tokens pushed since the last chunk are discarded, and the stream goes on
    exactly as if they had never been pushed."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).cuda()
    tokens = torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(3)).cuda()
    expected, _ = _stream(model, tokens)
    decoder = model.streaming_decoder(speaker="中文女", token_hop_len=15, flow_left_context_tokens=30)
    vocab = model.config.vocab_size
    assert decoder.push(tokens[:5]).numel() == 0
    assert decoder.push(torch.tensor([3, vocab], device="cuda")).numel() == 0  # not checked yet
    decoder.push(tokens[5:15])
    with pytest.raises(ValueError, match=rf"outside .*\[{vocab}\] .*; the 22 tokens pushed since the last decoded"):
        decoder.push(tokens[15:20])  # 22 tokens > the first chunk's 15 + 3 look-ahead: decoded, hence checked
    pieces = [decoder.push(tokens[i : i + 5]) for i in range(0, len(tokens), 5)]  # all 22 were discarded
    torch.testing.assert_close(torch.cat(pieces + [decoder.finalize()]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_runner_records_per_signature_and_returns_fresh_tensors():
    calls = []

    def function(x, y):
        calls.append(x.shape)
        return torch.relu(x) @ y + 1

    scale = [1]
    runner = CUDAGraphRunner(function, settings=lambda: scale[0], max_graphs=2)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(8, 3, device="cuda")
    first = runner(x, y)
    torch.testing.assert_close(first, function(x, y))
    calls.clear()
    second = runner(x * 2, y)  # replay: the Python function does not run again
    assert calls == [] and len(runner) == 1
    torch.testing.assert_close(second, torch.relu(x * 2) @ y + 1)
    torch.testing.assert_close(first, torch.relu(x) @ y + 1)  # the earlier result was not overwritten
    runner(torch.randn(5, 8, device="cuda"), y)  # new shape: new graph
    scale[0] = 2  # new setting: new graph, the oldest is evicted (max_graphs=2)
    runner(x, y)
    assert len(runner) == 2


@pytest.mark.gpu
def test_runner_recordings_share_one_memory_pool():
    """A runner's recordings share one memory pool (replays are serialised and outputs cloned): recording a second,
    smaller shape reserves no memory for its intermediates beyond the first's, and both still replay correctly."""

    def function(x):  # ~4 intermediates of x's size, freed inside the graph
        return ((x * 2).sin() + (x * 3).cos()).exp().sum(-1)

    def graph_pool_bytes() -> int:  # memory of the private (graph) pools
        segments = torch.cuda.memory._snapshot()["segments"]
        return sum(seg["total_size"] for seg in segments if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))

    runner = CUDAGraphRunner(function)
    big, small = torch.randn(64, 1 << 18, device="cuda"), torch.randn(32, 1 << 18, device="cuda")
    before = graph_pool_bytes()
    runner(big)
    first = graph_pool_bytes() - before
    runner(small)
    second = graph_pool_bytes() - before - first
    assert first >= big.nbytes and second == 0, (first, second)
    torch.testing.assert_close(runner(big), function(big))
    torch.testing.assert_close(runner(small), function(small))


@pytest.mark.gpu
def test_a_replay_on_another_stream_waits_for_the_running_one():
    """Two engines' vocoder threads (or an engine and a direct streaming call) replay one decoder's graphs from their
    own CUDA streams. A replay queued on stream 2 while stream 1's is still running on the GPU must not overwrite the
    static input stream 1's graph is about to read (nor the pool memory both use)."""

    def slow_double(x):
        torch.cuda._sleep(20_000_000)  # spins ~10 ms on the GPU before reading x
        return x * 2

    runner = CUDAGraphRunner(slow_double)
    a, b = torch.ones(1024, device="cuda"), torch.full((1024,), 3.0, device="cuda")
    runner(a)  # recorded; `a` is the static input's last source: not copied again below
    torch.cuda.synchronize()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        from_first = runner(a)
    with torch.cuda.stream(second):
        from_second = runner(b)  # its input copy would run during the first replay's spin
    torch.cuda.synchronize()
    assert torch.equal(from_first, a * 2) and torch.equal(from_second, b * 2)


@pytest.mark.gpu
def test_cuda_graph_streaming_matches_eager_streaming():
    """Issue 3: on CUDA the streaming decoder replays the flow solver and the HiFT filter as CUDA graphs (default),
    with the audio of the eager calls on the same fixed window shape; later streams reuse the recordings."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    model.config.estimator_precision = "float32"  # float32 weights: autocast is switched on and off below
    model.cuda()
    tokens = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(3)).cuda()
    graphed, decoder = _stream(model, tokens)
    # "auto" sizes: a short first window (32 tokens) and the longest one (48)
    assert decoder.cuda_graphs and decoder.flow_window_sizes == (32, 30 + 15 + model.config.pre_lookahead_len)
    eager, _ = _stream(model, tokens, cuda_graphs=False, flow_window_bucket_tokens=decoder.flow_window_sizes)
    assert graphed.shape == eager.shape == (150 * 960,)
    torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
    runners = _graph_runners(model)
    assert len(runners["flow"]) == 2 and 1 <= len(runners["hift"]) <= 4
    recorded = len(runners["hift"])
    again, _ = _stream(model, tokens)
    assert torch.equal(again, graphed) and len(runners["flow"]) == 2 and len(runners["hift"]) == recorded
    model.config.estimator_autocast_dtype = "bfloat16"  # a precision switch is part of the signature
    try:
        low, _ = _stream(model, tokens)
    finally:
        model.config.estimator_autocast_dtype = None
    assert len(runners["flow"]) == 4 and torch.isfinite(low).all()


def _batched_streams(model, tokens, graph_runners=None, **kwargs):
    """Three streams of their own voices and phases, fed `_ROUNDS` (tokens per stream per round) and decoded together
    each round; `graph_runners`: runner stand-ins the decoders call as under CUDA graphs. Returns each stream's
    audio."""
    voices = [model.get_speaker_embedding(speaker=name) for name in ("中文女", "中文男")] + [torch.ones(1, 192)]
    decoders = []
    for voice in voices:
        decoder = model.streaming_decoder(speaker_embedding=voice.to(model.device), token_hop_len=15,
                                          flow_left_context_tokens=30, first_token_hop_len=5, **kwargs)  # fmt: skip
        if graph_runners is not None:  # what the decoder does on CUDA: graph-runner calls, always a mask
            decoder._graphs, decoder.cuda_graphs = graph_runners, True
        decoders.append(decoder)
    pieces, positions = [[] for _ in decoders], [0] * len(decoders)
    for counts in _ROUNDS:
        for index, count in enumerate(counts):
            decoders[index].add_tokens(tokens[index, positions[index] : positions[index] + count])
            positions[index] += count
        for index, audio in enumerate(decode_ready(decoders)):
            pieces[index].append(audio)
    return [torch.cat(piece + [decoder.finalize()]) for piece, decoder in zip(pieces, decoders)]


# Tokens per stream per round: 3, 2 and 1 ready rows in a round (batches of 4, 2 and 1 under graphs).
_ROUNDS = [(10, 10, 10), (10, 30, 10), (20, 40, 0), (15, 5, 5), (5, 0, 0)]


def test_batched_graph_calls_have_bucketed_batch_sizes():
    """Under CUDA graphs a batched call's batch is padded to one of `GRAPH_BATCH_SIZES` (3 ready rows -> 4), so the
    runners record at most (window sizes x batch sizes) graphs; the padding rows change no real row. Run on CPU with
    runner stand-ins that record the shapes they get and compute eagerly."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    tokens = torch.randint(0, model.config.vocab_size, (3, 80), generator=torch.Generator().manual_seed(4))
    sizes = (32, 30 + 15 + model.config.pre_lookahead_len)  # the "auto" sizes under graphs
    expected = _batched_streams(model, tokens, flow_window_bucket_tokens=sizes)
    shapes = {"flow": [], "hift": []}

    def flow(*tensors):
        shapes["flow"].append((tuple(tensors[0].shape), tensors[4] is not None))
        return _graph_runners(model)["flow"].function(*tensors)

    def hift(mel, source):
        shapes["hift"].append(tuple(mel.shape))
        return model.hift.decode(mel, source, finalize=False)

    graphed = _batched_streams(model, tokens, {"flow": flow, "hift": hift}, flow_window_bucket_tokens=sizes)
    batches = {shape[0] for shape, _ in shapes["flow"]} | {shape[0] for shape in shapes["hift"]}
    assert batches <= set(GRAPH_BATCH_SIZES) and 4 in batches, shapes
    assert {shape[1] for shape, _ in shapes["flow"]} <= set(sizes) and all(masked for _, masked in shapes["flow"])
    for actual, reference in zip(graphed, expected):
        torch.testing.assert_close(actual, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_graph_batched_streaming_matches_eager_batched_streaming():
    """Several streams decoded together replay one flow graph per (window size, batch size) and HiFT graphs per
    (window, batch size), with the audio of the same batched calls run eagerly; later streams record nothing new."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    model.config.estimator_precision = "float32"
    model.cuda()
    tokens = torch.randint(0, model.config.vocab_size, (3, 80), generator=torch.Generator().manual_seed(4)).cuda()
    sizes = (32, 30 + 15 + model.config.pre_lookahead_len)
    graphed = _batched_streams(model, tokens)
    eager = _batched_streams(model, tokens, cuda_graphs=False, flow_window_bucket_tokens=sizes)
    for actual, reference in zip(graphed, eager):
        assert actual.shape == reference.shape
        # Batched GEMMs round differently from one-row ones on the GPU: a few samples differ by ~1e-4
        torch.testing.assert_close(actual, reference, atol=1e-3, rtol=1e-3)
    runners = _graph_runners(model)
    flow_graphs, hift_graphs = len(runners["flow"]), len(runners["hift"])
    assert flow_graphs <= len(sizes) * 3  # batches of 1, 2 and 4 rows
    again = _batched_streams(model, tokens)
    assert len(runners["flow"]) == flow_graphs and len(runners["hift"]) == hift_graphs
    for actual, reference in zip(again, graphed):
        assert torch.equal(actual, reference)
