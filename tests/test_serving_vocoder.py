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
        serving_vocoder_funaudiochat, "decode_ready", lambda streams, **kwargs: seen.append(
            torch.cuda.current_stream()) or batched(streams, **kwargs)
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

    def spy(streams, **kwargs):
        streams[0]._accept_pending()  # as decode_ready does first
        window = streams[0]._flow_window(finalize=False)[0].shape[0]
        calls.append((len(streams), window))
        return batched(streams, **kwargs)

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


@pytest.mark.gpu
def test_start_up_chunks_run_beside_a_steady_round_on_their_own_stream_and_graphs():
    """On CUDA with graphed decoders, a round of start-up chunks (`start(..., start_up=True)`) runs on a stream of
    its own, above the steady chunks' (both above the engine's steps), replaying graph runners of its own: it can be
    queued while a steady round is still on the GPU, decodes one chunk of each request (the rest wait for the next
    round), and every stream's audio equals what its decoder alone gives."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    decoder.config.estimator_precision = "float32"
    decoder.cuda()
    options = {"token_hop_len": 15, "first_token_hop_len": 5}
    vocoder = ServingVocoder(decoder, options, speech_bos_id=decoder.config.vocab_size)
    assert vocoder.concurrent_start_up
    assert vocoder.start_up_stream.priority < vocoder.cuda_stream.priority < torch.cuda.current_stream().priority
    tokens = torch.randint(0, decoder.config.vocab_size, (3, 90), generator=torch.Generator().manual_seed(2))
    voices = ["中文女", "中文男", None]
    audio = [[] for _ in voices]
    for start in range(0, 40, 10):  # requests 0 and 1 stream (their first chunk, then steady ones)
        items = [VocodeItem(i, voices[i], tokens[i, start : start + 10].tolist(), False, True) for i in range(2)]
        pending = vocoder.start(items, start_up=vocoder.in_start_up(0))
        for i, samples in enumerate(pending.result()):
            audio[i].append(torch.from_numpy(samples))
    steady = vocoder.start([VocodeItem(i, voices[i], tokens[i, 40:90].tolist(), True, True) for i in range(2)])
    # Request 2 joins while that round runs: its first 30 tokens complete two chunks, of which it decodes the first.
    first = vocoder.start([VocodeItem(2, voices[2], tokens[2, :30].tolist(), False, True)], start_up=True)
    audio[2].append(torch.from_numpy(first.result()[0]))
    assert vocoder._streams[2].chunks_decoded == 1 and vocoder._streams[2].chunk_ready()
    assert len(vocoder._start_up_graphs["flow"]) >= 1  # its own runners recorded the first chunks
    for i, samples in enumerate(steady.result()):
        audio[i].append(torch.from_numpy(samples))
    last = vocoder.start([VocodeItem(2, voices[2], tokens[2, 30:90].tolist(), True, True)]).result()
    audio[2].append(torch.from_numpy(last[0]))
    assert not vocoder._streams  # every request finished
    for i, voice in enumerate(voices):
        alone = decoder.streaming_decoder(**({"speaker": voice} if voice else {}), **options)
        expected = torch.cat([alone.push(tokens[i]).cpu(), alone.finalize().cpu()])
        _close_wav(torch.cat(audio[i]), expected)


def test_a_reply_that_ends_in_its_start_up_is_decoded_in_its_own_chunks():
    """A start-up round decodes one chunk per request (`max_rounds=1`); a reply that ends in that round with more
    chunks ready gets them decoded as chunks before its final one, as its decoder alone would (not merged into the
    final chunk, whose flow window would then differ)."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    options = {"token_hop_len": 15, "first_token_hop_len": 5}
    vocoder = ServingVocoder(decoder, options, speech_bos_id=decoder.config.vocab_size)
    tokens = torch.randint(0, decoder.config.vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    pending = vocoder._start([VocodeItem(0, None, tokens.tolist(), True, True)], None, 1)  # two chunks ready
    audio = torch.from_numpy(pending.result()[0])
    alone = decoder.streaming_decoder(**options)
    expected = torch.cat([alone.push(tokens), alone.finalize()])
    assert alone.chunks_decoded == 2 and not vocoder._streams
    assert audio.shape == expected.shape
    _close_wav(audio, expected)  # merged into the final chunk, the audio differed by up to 1.0


def test_a_replys_first_two_chunks_are_its_start_up():
    """`in_start_up`: a request is in its start-up (its rounds go first, and on CUDA beside steady rounds) until
    `START_UP_CHUNKS` (2) chunks of it are decoded; with only the first, a listener waited for the second behind the
    steady rounds (docs/serving.md)."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    options = {"token_hop_len": 15, "first_token_hop_len": 5}
    vocoder = ServingVocoder(decoder, options, speech_bos_id=decoder.config.vocab_size)
    assert serving_vocoder_funaudiochat.START_UP_CHUNKS == 2
    tokens = torch.randint(0, decoder.config.vocab_size, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    assert vocoder.in_start_up(7)  # no decoder yet
    starts = []
    for first, last in ((0, 9), (9, 24), (24, 40)):  # 5 + 3 + 1 tokens complete chunk 0, 15 more chunk 1
        assert len(vocoder.audio([VocodeItem(7, None, tokens[first:last], False, True)])[0]) > 0
        starts.append(vocoder.in_start_up(7))
    assert starts == [True, False, False]


def test_chunks_left_by_a_start_up_round_replay_the_runners_that_recorded_their_shapes(monkeypatch):
    """A reply that ends in a start-up round with chunks left ready decodes each of them by the runners whose warm-up
    recorded its shapes: the start-up lane's for a start-up chunk, the model's own (None) for a later one; a new
    recording on the way to the reply's end would cost hundreds of milliseconds and memory that a load keeps."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    options = {"token_hop_len": 15, "first_token_hop_len": 5}
    vocoder = ServingVocoder(decoder, options, speech_bos_id=decoder.config.vocab_size)
    lane = {"flow": "start-up flow", "hift": "start-up hift"}  # never replayed on CPU (the decoders are not graphed)
    calls = []  # (chunk index, the runners passed)
    batched = serving_vocoder_funaudiochat.decode_ready

    def spy(streams, graph_runners=None, max_rounds=None):
        calls.append((streams[0].chunks_decoded, graph_runners, max_rounds))
        return batched(streams, graph_runners=graph_runners, max_rounds=max_rounds)

    monkeypatch.setattr(serving_vocoder_funaudiochat, "decode_ready", spy)
    tokens = torch.randint(0, decoder.config.vocab_size, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    audio = vocoder._start([VocodeItem(0, None, tokens, True, True)], lane, 1).result()[0]  # chunks 0, 1, 2 ready
    assert calls == [(0, lane, 1), (1, lane, 1), (2, None, 1)], calls
    alone = decoder.streaming_decoder(**options)
    _close_wav(torch.from_numpy(audio), torch.cat([alone.push(torch.tensor(tokens)), alone.finalize()]))


@pytest.mark.parametrize("options", [{"token_hop_len": 15, "first_token_hop_len": 6}, {"token_hop_len": 4}])
def test_may_decode_says_whether_a_round_can_decode_audio(options):
    """`may_decode` (the engine holds its steps only for a round that can queue audio on the GPU) agrees with the
    decoders: False for ids that complete no chunk, True for ids that complete one and for a request's last item;
    `first_chunk_tokens` is the id count at which a new decoder's first chunk becomes ready (`chunk_ready`)."""
    decoder = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    vocoder = ServingVocoder(decoder, options, speech_bos_id=decoder.config.vocab_size)
    tokens = torch.randint(0, decoder.config.vocab_size, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    alone = decoder.streaming_decoder(**options)
    ready_at = next(count for count in range(1, 60) if (alone.add_tokens(torch.tensor(tokens[count - 1 : count])),
                                                         alone.chunk_ready())[1])  # fmt: skip
    assert vocoder.first_chunk_tokens == ready_at == options.get("first_token_hop_len", 4) + 3 + 1
    sent, decoded = 0, []

    def chunks():
        return vocoder._streams[1].chunks_decoded if 1 in vocoder._streams else 0

    for size in (2, 3, 4, 5, 5, 6, 9, 1, 8):
        item = VocodeItem(1, None, tokens[sent : sent + size], False, True)
        says, before = vocoder.may_decode([item]), chunks()
        vocoder.audio([item])
        assert says == (chunks() > before), (sent, size)
        decoded.append(says)
        sent += size
    assert True in decoded and False in decoded
    assert vocoder.may_decode([VocodeItem(1, None, [], True, True)])  # the last item: its rest is decoded
    assert not vocoder.may_decode([VocodeItem(1, None, tokens[:40], True, False)])  # cancelled: no audio wanted
