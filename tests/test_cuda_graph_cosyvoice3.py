"""CUDA-graph replay of the streaming CosyVoice3 decoder (`cuda_graph_cosyvoice3.CUDAGraphRunner`).

The replay itself needs a GPU (tests marked `gpu`); on CPU the argument checks and the "auto" choices are tested.
"""

import pytest
import torch

from funaudiochat_hf import CosyVoice3Token2Wav
from funaudiochat_hf.cuda_graph_cosyvoice3 import CUDAGraphRunner
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


def test_streaming_graphs_are_off_on_cpu_and_cannot_be_forced():
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    decoder = model.streaming_decoder(speaker="中文女")
    assert decoder.cuda_graphs is False and decoder.flow_bucket is None  # eager CPU: exact shapes
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        model.streaming_decoder(speaker="中文女", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        model.streaming_decoder(speaker="中文女", cuda_graphs="always")


def test_flow_graph_records_the_whole_window_from_token_ids_to_mel():
    """The flow graph starts at the token ids: its function embeds them and runs the look-ahead conv before the
    solver (eagerly those ~20 small launches made the GPU wait before each chunk's solver graph: 27.04 against
    27.68 ms per chunk on an H200, BENCHMARKS.md), and its signature follows those layers' weights. Run here on CPU
    tensors (what the graph records), it gives `tokens_to_mel`'s mel, also for a right-padded, key-masked window."""
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
def test_cuda_graph_streaming_matches_eager_streaming():
    """Issue 3: on CUDA the streaming decoder replays the flow solver and the HiFT filter as CUDA graphs (default),
    with the audio of the eager calls on the same fixed window shape; later streams reuse the recordings."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).cuda()
    tokens = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(3)).cuda()
    graphed, decoder = _stream(model, tokens)
    assert decoder.cuda_graphs and decoder.flow_bucket == 30 + 15 + model.config.pre_lookahead_len
    eager, _ = _stream(model, tokens, cuda_graphs=False, flow_window_bucket_tokens=decoder.flow_bucket)
    assert graphed.shape == eager.shape == (150 * 960,)
    torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
    runners = _graph_runners(model)
    assert len(runners["flow"]) == 1 and 1 <= len(runners["hift"]) <= 4
    recorded = len(runners["hift"])
    again, _ = _stream(model, tokens)
    assert torch.equal(again, graphed) and len(runners["flow"]) == 1 and len(runners["hift"]) == recorded
    model.config.estimator_autocast_dtype = "bfloat16"  # a precision switch is part of the signature
    try:
        low, _ = _stream(model, tokens)
    finally:
        model.config.estimator_autocast_dtype = None
    assert len(runners["flow"]) == 2 and torch.isfinite(low).all()
