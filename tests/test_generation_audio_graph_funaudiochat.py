"""Tests of `generation_audio_graph_funaudiochat`: the prompt's audio encoder recorded per chunk count, and the
embedding around it free of host reads once the encoder's work is queued."""

import pytest
import torch

from funaudiochat_hf import generation_audio_graph_funaudiochat as audio_graph
from funaudiochat_hf.generation_audio_graph_funaudiochat import RecordedChunkEncoder
from funaudiochat_hf.generation_workspace_funaudiochat import DecodeWorkspace
from funaudiochat_hf.step_graph_funaudiochat import CapturedStep, StepGraphs

from conftest import HostReads


class _Workspace:
    """The part of a `DecodeWorkspace` the recorded encoder uses."""

    audio_chunk_buffers_for = DecodeWorkspace.audio_chunk_buffers_for

    def __init__(self):
        self.audio_chunk_buffers, self.step_graphs = None, StepGraphs()


def _features(model, lengths: list[int], seed: int = 0):
    """Right-padded log-mels of clips of `lengths` frames and their mask."""
    bins = model.config.audio_config.num_mel_bins
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(len(lengths), bins, max(lengths), generator=generator)
    mask = torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]
    return features * mask[:, None, :], mask.long()


def test_recorded_encoder_pads_chunks_to_full_length_and_gives_the_eager_features(model, monkeypatch):
    """The recorded encoder runs every chunk padded to `2 * n_window` frames (shapes that depend on the chunk count
    only): the features equal the eager encoder's (chunks padded to the longest one) for clips of one frame, of
    partial and full chunks, several clips at once; a call with shorter chunks after longer ones does not read the
    frames the longer ones left in the buffers (a conv at a chunk's end reads the next frame)."""
    calls = []
    monkeypatch.setattr(CapturedStep, "__call__", lambda self, *a: calls.append(self.key) or self.function(*a))
    encoder = model.continuous_audio_tower
    full = 2 * encoder.n_window
    ws = _Workspace()
    recorded = RecordedChunkEncoder(model, ws, None)
    for lengths in ([full + 45, 2 * full, 17], [full], [150], [1, 2, 3], [full + 1]):
        features, mask = _features(model, lengths, seed=len(calls))
        with torch.no_grad():
            eager = model.get_audio_features(features, mask).last_hidden_state
            graphed = model.get_audio_features(features, mask, chunk_encoder=recorded).last_hidden_state
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
        assert eager.abs().sum() > 0
    assert calls == [("audio_chunks", 5), ("audio_chunks", 1), ("audio_chunks", 1), ("audio_chunks", 3), ("audio_chunks", 2)]
    # One set of buffers for the most chunks recorded; each count's recording uses its first rows.
    buffers = ws.audio_chunk_buffers
    assert buffers.chunks.shape == (audio_graph.MAX_RECORDED_AUDIO_CHUNKS, encoder.conv1.in_channels, full)
    assert buffers.first(3).chunks.data_ptr() == buffers.chunks.data_ptr() and len(buffers.first(3).hidden) == 3

    # Above the recorded counts (long questions): the eager encoder, no buffers or recording kept.
    monkeypatch.setattr(audio_graph, "MAX_RECORDED_AUDIO_CHUNKS", 2)
    features, mask = _features(model, [2 * full + 7])
    with torch.no_grad():
        eager = model.get_audio_features(features, mask).last_hidden_state
        graphed = model.get_audio_features(features, mask, chunk_encoder=recorded).last_hidden_state
    torch.testing.assert_close(graphed, eager, atol=0, rtol=0)
    assert len(calls) == 5 and ws.audio_chunk_buffers is buffers


def test_the_prompt_embedding_reads_no_value_on_the_host_after_the_audio_encoder_starts(model, inputs):
    """On a GPU a read of a device value waits for all work queued before it: once the audio encoder's work is queued,
    a read would wait for the whole encoder (and, in a serving process, for the interpreter lock after it) instead of
    queueing the prompt pass behind it. The embedding counts, checks and slices on the host first. (It read the
    placeholder and group counts and the valid groups with a boolean index after the encoder.)"""
    started = []

    def chunk_encoder(chunks, chunk_lengths):
        started.append(True)
        return model.continuous_audio_tower.encode_chunks(chunks, chunk_lengths)

    prompt = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        expected = model.embed_prompt(inputs["input_ids"], **prompt)
        with HostReads(lambda: bool(started)) as mode:
            embeds = model.embed_prompt(inputs["input_ids"], **prompt, chunk_encoder=chunk_encoder)
    assert started, "the audio encoder did not run"
    assert mode.found == []
    torch.testing.assert_close(embeds, expected, atol=0, rtol=0)


@pytest.mark.gpu
def test_recorded_audio_encoder_replays_and_matches_eager_on_gpu(inputs):
    """At the defaults on CUDA the prompt's audio encoder is recorded on the workspace (second call) and replayed
    (third): the tokens equal the eager backend's, the features the eager encoder's (float32; GEMMs of other shapes)."""
    from transformers import AutoModel

    from conftest import FUNAUDIOCHAT_TINY

    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).cuda().eval()
    batch = {k: v.cuda() for k, v in inputs.items()}
    kwargs = dict(max_new_tokens=12, do_sample=False, repetition_penalty=1.0, eos_token_id=322, pad_token_id=320)
    with model.speech_generator() as generator:
        outputs = [generator.generate(**batch, **kwargs) for _ in range(3)]
        (ws,) = generator._workspaces.values()
        assert any(key[0] == "audio_chunks" for key in ws.step_graphs.graphs)
        buffers = ws.audio_chunk_buffers
        eager = model.get_audio_features(batch["input_features"], batch["feature_attention_mask"]).last_hidden_state
        graphed = model.get_audio_features(
            batch["input_features"], batch["feature_attention_mask"], chunk_encoder=RecordedChunkEncoder(model, ws, None)
        ).last_hidden_state
    torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
    reference = model.generate_speech(**batch, **kwargs, backend="eager")
    for out in outputs:
        assert torch.equal(out.sequences, outputs[0].sequences) and torch.equal(out.speech_ids, outputs[0].speech_ids)
    assert torch.equal(outputs[-1].sequences, reference.sequences)
    assert buffers.chunks.shape[-1] == 2 * model.continuous_audio_tower.n_window
