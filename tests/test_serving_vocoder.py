"""The serving engine's vocoder (`serving_vocoder_funaudiochat.ServingVocoder`): a request's decoder that fails fails
that request only, and the others' audio is what their decoders alone give (the failed batched call changed nothing:
each then decodes alone)."""

import pytest
import torch

from funaudiochat_hf import CosyVoice3Token2Wav, serving_vocoder_funaudiochat
from funaudiochat_hf.serving_vocoder_funaudiochat import ServingVocoder, VocodeItem

from conftest import COSYVOICE3_TINY, record_streaming_shapes
from test_modeling_cosyvoice3 import _close_wav


def test_a_failing_stream_fails_its_request_only(monkeypatch):
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    options = {"token_hop_len": 15, "first_token_hop_len": 5}
    vocoder = ServingVocoder(decoder, options, speech_bos_id=decoder.config.vocab_size)
    assert vocoder.cuda_stream is None  # a CPU decoder: no stream of its own
    tokens = torch.randint(0, decoder.config.vocab_size, (3, 30), generator=torch.Generator().manual_seed(0))
    voices = ["中文女", "中文男", None]

    def items(start, count, finished=False):
        return [VocodeItem(i, voices[i], tokens[i, start : start + count].tolist(), finished, True) for i in range(3)]

    first = vocoder.audio(items(0, 10))
    assert all(len(audio) > 0 for audio in first)  # every first chunk (5 tokens + 3 look-ahead) is ready

    def failing(*args, **kwargs):
        raise RuntimeError("vocoder failure")

    monkeypatch.setattr(vocoder._streams[1], "_hift_inputs", failing)
    second = vocoder.audio(items(10, 20, finished=True))
    assert isinstance(second[1], RuntimeError) and 1 not in vocoder._streams
    assert not vocoder._streams  # finished requests' decoders are dropped
    for i in (0, 2):
        alone = decoder.streaming_decoder(**({"speaker": voices[i]} if voices[i] else {}), **options)
        _close_wav(torch.from_numpy(first[i]), alone.push(tokens[i, :10]))  # batched: equal up to float rounding
        _close_wav(torch.from_numpy(second[i]), torch.cat([alone.push(tokens[i, 10:]), alone.finalize()]))


@pytest.mark.gpu
def test_cuda_decoders_run_on_the_vocoders_own_stream(monkeypatch):
    """On CUDA the decoders run on the vocoder's stream (overlapping the engine's decode steps on the default one, at
    a higher priority); the audio that reaches the host is complete (`.cpu()` waits for that stream) and equals each
    stream alone."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    decoder.config.estimator_precision = "float32"
    decoder.cuda()
    options = {"token_hop_len": 15, "first_token_hop_len": 5}
    vocoder = ServingVocoder(decoder, options, speech_bos_id=decoder.config.vocab_size)
    assert vocoder.cuda_stream is not None and vocoder.cuda_stream != torch.cuda.current_stream()
    # Its kernels go before the engine's decode steps (default priority) whenever both wait for the GPU.
    assert vocoder.cuda_stream.priority < torch.cuda.current_stream().priority
    seen = []
    batched = serving_vocoder_funaudiochat.decode_ready
    monkeypatch.setattr(
        serving_vocoder_funaudiochat, "decode_ready", lambda streams: seen.append(torch.cuda.current_stream()) or
        batched(streams)
    )  # fmt: skip
    tokens = torch.randint(0, decoder.config.vocab_size, (3, 60), generator=torch.Generator().manual_seed(1))
    voices = ["中文女", "中文男", None]
    audio = [[] for _ in voices]
    for start in range(0, 60, 5):
        finished = start + 5 == 60
        items = [VocodeItem(i, voices[i], tokens[i, start : start + 5].tolist(), finished, True) for i in range(3)]
        for i, samples in enumerate(vocoder.audio(items)):
            audio[i].append(torch.from_numpy(samples))
    assert seen and all(stream == vocoder.cuda_stream for stream in seen)
    for i, voice in enumerate(voices):
        alone = decoder.streaming_decoder(**({"speaker": voice} if voice else {}), **options)
        pieces = [alone.push(tokens[i, start : start + 5]).cpu() for start in range(0, 60, 5)]
        pieces[-1] = torch.cat([pieces[-1], alone.finalize().cpu()])
        assert [len(piece) for piece in audio[i]] == [len(piece) for piece in pieces]
        _close_wav(torch.cat(audio[i]), torch.cat(pieces))


def test_warm_up_batch_sizes_cover_every_round():
    sizes = ServingVocoder.warm_up_batch_sizes
    assert sizes(16) == (1, 2, 4, 8, 16)
    assert sizes(6) == (1, 2, 4, 8)  # a round of 5 or 6 streams is padded to 8
    assert sizes(1) == (1,)
    assert sizes(40) == (1, 2, 4, 8, 16)  # larger rounds are split into calls of 16


@pytest.mark.parametrize(
    "growth, longest",
    [
        ({}, 20 + 15 + 3),  # left context + hop + look-ahead
        # hops 5, 15, 30, 60: both windows are full after the second chunk, the hop grows for two more
        ({"token_max_hop_len": 60, "flow_left_context_tokens": 10, "hift_left_context_frames": 16}, 10 + 60 + 3),
    ],
    ids=["fixed-hop", "hop-growth"],
)
def test_warm_up_decodes_every_batch_size_until_the_windows_are_full(monkeypatch, growth, longest):
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    options = {"token_hop_len": 15, "first_token_hop_len": 5, "flow_left_context_tokens": 20, **growth}
    vocoder = ServingVocoder(decoder, options, speech_bos_id=decoder.config.vocab_size)
    calls = []  # (streams, flow window tokens of the call's chunk)
    batched = serving_vocoder_funaudiochat.decode_ready

    def spy(streams):
        streams[0]._accept_pending()  # as decode_ready does first
        window = streams[0]._flow_window(finalize=False)[0].shape[0]
        calls.append((len(streams), window))
        return batched(streams)

    monkeypatch.setattr(serving_vocoder_funaudiochat, "decode_ready", spy)
    chunks = vocoder.warm_up(3)
    assert list(chunks) == [1, 2, 4]
    for size in (1, 2, 4):
        windows = [window for streams, window in calls if streams == size]
        assert windows[0] == 5 + 3 and windows[-1] == longest  # from the first chunk to a full window
        if growth:
            assert windows[-2] < longest  # the windows were full before the hop stopped growing
        assert len(windows) == chunks[size]


def test_a_servers_warm_up_recordings_fit_the_graph_runners(monkeypatch):
    """The graph runners keep their `_MAX_*_GRAPHS` most recent recordings: every shape a server's warm-up records (16
    streams, the auto window sizes of a graphed decoder, the hop growing to 200) must fit, or the load evicts and
    records again on the way to a reply's audio."""
    from funaudiochat_hf import streaming_batch_cosyvoice3, streaming_cosyvoice3

    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    shapes = record_streaming_shapes(monkeypatch, decoder)
    window_sizes = streaming_cosyvoice3._flow_window_sizes  # as under CUDA graphs ("auto" takes the steady windows)
    monkeypatch.setattr(streaming_cosyvoice3, "_flow_window_sizes", lambda bucket, longest, compiled, graphed,
                        steady_windows=(): window_sizes(bucket, longest, compiled, True, steady_windows))  # fmt: skip
    options = {"token_hop_len": 15, "first_token_hop_len": 5, "token_max_hop_len": 200}
    ServingVocoder(decoder, options, speech_bos_id=0).warm_up(16)
    flow_shapes = {shape for shape in shapes if shape[0] == "flow"}
    hift_shapes = shapes - flow_shapes
    assert {shape[1][0] for shape in flow_shapes} == set(streaming_batch_cosyvoice3.GRAPH_BATCH_SIZES)
    assert 20 < len(flow_shapes) <= streaming_cosyvoice3._MAX_FLOW_GRAPHS
    assert 10 < len(hift_shapes) <= streaming_cosyvoice3._MAX_HIFT_GRAPHS
