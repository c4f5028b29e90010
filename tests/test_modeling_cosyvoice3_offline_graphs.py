"""Offline CosyVoice3 decoding through CUDA graphs (`forward(cuda_graphs=...)`): flow calls right-padded to a few
bucket lengths. The padded computation itself is checked on CPU; the replay needs a GPU (tests marked `gpu`)."""

import pytest
import torch
from safetensors.torch import load_file

from funaudiochat_hf import CosyVoice3Token2Wav
from funaudiochat_hf.modeling_cosyvoice3 import OFFLINE_GRAPH_BUCKET_TOKENS, OFFLINE_MAX_GRAPHS

from conftest import COSYVOICE3_GOLDEN, COSYVOICE3_TINY


@pytest.fixture(scope="module")
def flow_full():
    return load_file(COSYVOICE3_GOLDEN / "flow_full.safetensors")


def test_buckets():
    bucket = CosyVoice3Token2Wav.offline_graph_bucket
    assert [bucket(n) for n in (1, 64, 65, 250, 750, 768)] == [64, 64, 128, 256, 768, 768]
    assert bucket(769) is None  # an ordinary call
    assert list(OFFLINE_GRAPH_BUCKET_TOKENS) == sorted(OFFLINE_GRAPH_BUCKET_TOKENS)


def test_bucketed_flow_equals_the_unpadded_flow(flow_full):
    """What the offline graph replays, run directly on CPU: rows padded to a bucket with a key mask give the mel of
    each row decoded alone, unpadded (the golden mel within the usual 1e-4)."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    tokens, speaker = flow_full["speech_token"], flow_full["embedding"]
    spk = model.get_speaker_embedding(speaker_embedding=speaker)
    with torch.no_grad():
        mel = model._bucketed_flow(tokens, spk, [90], bucket=128)
        torch.testing.assert_close(mel, flow_full["mel"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mel, model.tokens_to_mel(tokens, speaker), atol=1e-5, rtol=1e-5)
        rows = torch.stack([tokens[0], torch.cat([tokens[0, :61], torch.zeros(29, dtype=torch.long)])])
        batch = model._bucketed_flow(rows, spk.expand(2, -1), [90, 61], bucket=128)
        short = model.tokens_to_mel(tokens[:, :61], speaker)
    assert batch.shape == (2, 80, 180)
    torch.testing.assert_close(batch[0], mel[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[1, :, :122], short[0], atol=1e-5, rtol=1e-5)


def test_offline_graphs_are_off_on_cpu_and_cannot_be_forced(flow_full):
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        model(flow_full["speech_token"], cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or 'auto'"):
        model(flow_full["speech_token"], cuda_graphs="yes")
    model(flow_full["speech_token"][:, :10])
    assert model._offline_flow_graphs is None  # nothing recorded, nothing created


@pytest.mark.gpu
def test_cuda_offline_graphs_match_the_same_padded_call_and_stay_bounded(flow_full):
    """On CUDA offline calls replay one graph per bucket and batch size, with the numbers of the same padded call
    made directly; lengths in one bucket share a graph; the model keeps at most OFFLINE_MAX_GRAPHS and frees them on
    request."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval().cuda()
    tokens = flow_full["speech_token"].cuda()
    spk = model.get_speaker_embedding(speaker_embedding=flow_full["embedding"])
    with torch.no_grad():
        graphed = model(tokens).waveform
        graphs = model.offline_flow_graphs
        assert len(graphs) == 1
        direct = model._bucketed_flow(tokens, spk, [90], bucket=128)
        replayed = model._bucketed_flow(tokens, spk, [90], bucket=128, runner=graphs)
        torch.testing.assert_close(replayed, direct, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model.mel_to_wav(replayed), graphed, atol=1e-4, rtol=1e-4)  # the flow + HiFT
        model(tokens[:, :70])  # the same bucket (128): no new recording
        assert len(graphs) == 1
        for length in (30, 150, 200, 300, 450):  # four more buckets: the oldest are dropped
            out = model(tokens[:, : min(length, 90)].repeat(1, -(-length // 90))[:, :length])
            assert out.waveform.shape == (1, length * 960) and torch.isfinite(out.waveform).all()
        assert len(graphs) == OFFLINE_MAX_GRAPHS
        eager = model(tokens, cuda_graphs=False).waveform
        assert eager.shape == graphed.shape
    model.clear_offline_flow_graphs()
    assert model._offline_flow_graphs is None
