"""Batched decoding of several CosyVoice3 streaming decoders (`streaming_batch_cosyvoice3.decode_ready`) against each
decoder's own sequential `push` / `finalize`: mels at 1e-5 (rows are independent; only float rounding differs) and
audio as the other streaming tests compare it (HiFT amplifies the mel's rounding, see test_modeling_cosyvoice3)."""

import pytest
import torch

from funaudiochat_hf import CosyVoice3Token2Wav
from funaudiochat_hf.streaming_batch_cosyvoice3 import GRAPH_BATCH_SIZES, decode_ready
from funaudiochat_hf.tiny_model import tiny_token2wav_config

from conftest import COSYVOICE3_TINY
from test_modeling_cosyvoice3 import _close, _close_wav


@pytest.fixture(scope="module")
def model():
    return CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)


def _voice(seed: int, model) -> torch.Tensor:
    return torch.randn(1, model.config.spk_embed_dim, generator=torch.Generator().manual_seed(seed))


def _recording(decoder) -> list:
    """Record the mel of every flow call the decoder takes (`_take_mel`'s real frames)."""
    mels = []
    take = decoder._take_mel

    def recorded(mel, *args, **kwargs):
        mels.append(mel.clone())
        return take(mel, *args, **kwargs)

    decoder._take_mel = recorded
    return mels


def _tokens(model, count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (count,), generator=torch.Generator().manual_seed(seed))


def _streams(model, options: dict):
    """Three replies with their own voice, hop and phase (before the batched part): one not started (its first, short
    chunk comes in the batch), one in its steady state (left context full), one a chunk from its end."""
    plans = [
        dict(voice=0, first_token_hop_len=5, prefix=0, tokens=_tokens(model, 40, 1)),
        dict(voice=1, first_token_hop_len=None, prefix=75, tokens=_tokens(model, 130, 2)),
        dict(voice=2, first_token_hop_len=5, prefix=25, tokens=_tokens(model, 44, 3)),
    ]
    decoders = []
    for plan in plans:
        pair = []
        for _ in range(2):  # sequential, batched
            decoder = model.streaming_decoder(
                speaker_embedding=_voice(plan["voice"], model), token_hop_len=15,
                first_token_hop_len=plan["first_token_hop_len"], flow_left_context_tokens=30, **options,
            )  # fmt: skip
            decoder.push(plan["tokens"][: plan["prefix"]])
            pair.append(decoder)
        decoders.append((pair, plan))
    return decoders


@pytest.mark.parametrize(
    "options, batch_sizes",
    [({}, "auto"), ({"flow_window_bucket_tokens": (24,)}, "auto"), ({"flow_window_bucket_tokens": (24,)}, (1, 2, 4))],
    ids=["exact-shapes", "padded-windows", "batch-padded-to-4"],
)
def test_batched_decoding_equals_each_decoders_own_push(model, options, batch_sizes, monkeypatch):
    streams = _streams(model, options)
    sequential = [pair[0] for pair, _ in streams]
    batched = [pair[1] for pair, _ in streams]
    seq_mels = [_recording(decoder) for decoder in sequential]
    bat_mels = [_recording(decoder) for decoder in batched]
    flow_calls = []  # (rows, frames) of each flow call
    flow = model.flow.decoder.solve
    monkeypatch.setattr(
        model.flow.decoder, "solve", lambda x, *args: flow_calls.append(tuple(x.shape[::2])) or flow(x, *args)
    )
    seq_audio = [[] for _ in streams]
    bat_audio = [[] for _ in streams]
    # Rounds of added tokens: 3 ready rows; then 2, and 1 (the steady decoder gets two chunks at once); then 1.
    positions = [plan["prefix"] for _, plan in streams]
    for step in ((10, 20, 15), (25, 30, 4), (5, 5, 0)):
        for index, ((pair, plan), count) in enumerate(zip(streams, step)):
            tokens = plan["tokens"][positions[index] : positions[index] + count]
            positions[index] += count
            seq_audio[index].append(pair[0].push(tokens))
            pair[1].add_tokens(tokens)
        for index, audio in enumerate(decode_ready(batched, batch_sizes=batch_sizes)):
            bat_audio[index].append(audio)
    assert positions == [len(plan["tokens"]) for _, plan in streams]
    for index in range(len(streams)):
        seq_audio[index].append(sequential[index].finalize())
        bat_audio[index].append(batched[index].finalize())
    # The batched rounds (3, 2, 1, 1 rows) between the sequential ones (1 row). With padded windows the first round's
    # rows are decoded by window size: the new reply's first chunk (a 24-token window) apart from the two full ones,
    # which it would otherwise be padded to.
    rows = sorted({count for count, _ in flow_calls})
    if options:
        full = model.config.token_mel_ratio * batched[1].max_flow_window
        assert rows == [1, 2] and (2, full) in flow_calls, flow_calls
    else:
        assert rows == [1, 2, 3], flow_calls
    for index in range(len(streams)):
        assert len(seq_mels[index]) == len(bat_mels[index]) >= 2
        for seq_mel, bat_mel in zip(seq_mels[index], bat_mels[index]):
            _close(bat_mel, seq_mel, atol=1e-5)
        seq = torch.cat(seq_audio[index])
        bat = torch.cat(bat_audio[index])
        _close_wav(bat, seq)
        # chunk by chunk too: each call returned the same stretch of audio
        assert [piece.shape for piece in bat_audio[index]] == [piece.shape for piece in seq_audio[index]]
        assert (sequential[index].token_offset, sequential[index].emitted_frames) == (
            batched[index].token_offset, batched[index].emitted_frames
        )  # fmt: skip


def test_decode_ready_without_ready_chunks_and_bad_arguments(model):
    decoder = model.streaming_decoder(speaker_embedding=_voice(0, model))
    decoder.add_tokens(_tokens(model, 10, 0))  # 15 + 3 + 1 needed for a chunk
    assert not decoder.chunk_ready()
    assert [audio.shape for audio in decode_ready([decoder])] == [(0,)]
    assert decode_ready([]) == []
    with pytest.raises(ValueError, match="batch_sizes"):
        decode_ready([decoder], batch_sizes=(0,))
    with pytest.raises(ValueError, match="twice"):
        decode_ready([decoder, decoder])
    with pytest.raises(ValueError, match="max_rounds"):
        decode_ready([decoder], max_rounds=0)
    with pytest.raises(ValueError, match="CosyVoice3StreamingDecoder"):
        decode_ready([decoder, object()])
    other = CosyVoice3Token2Wav._from_config(tiny_token2wav_config(40), dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="another model"):
        decode_ready([decoder, other.streaming_decoder(speaker_embedding=torch.ones(other.config.spk_embed_dim))])
    assert GRAPH_BATCH_SIZES[0] == 1


def test_max_rounds_leaves_the_later_chunks_ready(model):
    """`max_rounds=1` decodes one chunk of each decoder (a server vocodes a reply's first chunk alone, beside other
    work) and leaves the later ready chunks to the next call; the audio is the same as decoding them all at once."""
    tokens = [_tokens(model, 60, seed) for seed in (4, 5)]
    once, stepwise = [], []
    for decoders in (once, stepwise):
        for index, stream_tokens in enumerate(tokens):
            decoder = model.streaming_decoder(speaker_embedding=_voice(index, model), token_hop_len=15,
                                              first_token_hop_len=5)  # fmt: skip
            decoder.add_tokens(stream_tokens[: 5 + 15 + 3 + 1 + 10 * index])  # two chunks ready
            decoders.append(decoder)
    whole = decode_ready(once)
    first = decode_ready(stepwise, max_rounds=1)
    assert [decoder.chunks_decoded for decoder in stepwise] == [1, 1]
    assert all(decoder.chunk_ready() for decoder in stepwise)
    rest = decode_ready(stepwise)
    assert [decoder.chunks_decoded for decoder in stepwise] == [decoder.chunks_decoded for decoder in once] == [2, 2]
    for index in range(2):
        assert len(first[index]) > 0
        _close_wav(torch.cat([first[index], rest[index]]), whole[index])


def test_decode_ready_names_the_decoder_with_bad_deferred_tokens(model, monkeypatch):
    """Tokens not checked when added (on an accelerator) are checked by the decoding: the error names the decoder,
    which discards them as `push` would; the others are unchanged."""
    from funaudiochat_hf import streaming_cosyvoice3

    monkeypatch.setattr(streaming_cosyvoice3, "_checked_when_pushed", lambda tokens: False)
    good, bad = (model.streaming_decoder(speaker_embedding=_voice(seed, model)) for seed in (0, 1))
    good.add_tokens(_tokens(model, 20, 0))
    bad.add_tokens(torch.tensor([1] * 19 + [model.config.vocab_size]))
    with pytest.raises(ValueError, match=r"streaming decoder 1: .*outside.*20 tokens .* discarded"):
        decode_ready([good, bad])
    assert bad._num_tokens() == 0 and good._num_tokens() == 20
    assert decode_ready([good, bad])[0].numel() > 0


def test_a_failed_call_leaves_every_decoder_as_it_was(model, monkeypatch):
    """A call that fails after some rows took their mel restores every decoder: decoding each alone afterwards gives
    exactly the audio of decoders that never saw the failed call."""
    decoders = [model.streaming_decoder(speaker_embedding=_voice(seed, model)) for seed in range(3)]
    clean = [model.streaming_decoder(speaker_embedding=_voice(seed, model)) for seed in range(3)]
    for seed, (decoder, twin) in enumerate(zip(decoders, clean)):
        tokens = _tokens(model, 40, seed)
        decoder.add_tokens(tokens)
        twin.add_tokens(tokens)
    hift_inputs = decoders[2]._hift_inputs

    def failing(*args, **kwargs):
        raise RuntimeError("vocoder failure")

    monkeypatch.setattr(decoders[2], "_hift_inputs", failing)
    with pytest.raises(RuntimeError, match="vocoder failure"):
        decode_ready(decoders)
    monkeypatch.setattr(decoders[2], "_hift_inputs", hift_inputs)
    for decoder, twin in zip(decoders, clean):
        assert decoder.token_offset == 0 and decoder.mel.shape[-1] == 0 and decoder._num_tokens() == 40
        audio = torch.cat([decoder.decode_ready(), decoder.finalize()])
        assert torch.equal(audio, torch.cat([twin.decode_ready(), twin.finalize()]))


def test_a_compiled_flow_gets_bucketed_batch_sizes(monkeypatch):
    """Compiled code is specialised to shapes like a CUDA graph: once the estimator is compiled, 3 ready rows run as a
    batch of 4 (and every window at the one padded size)."""
    model = CosyVoice3Token2Wav._from_config(tiny_token2wav_config(40), dtype=torch.float32).eval()
    model.flow.decoder.init_noise()
    model.hift.init_source_tables()
    model.compile_estimator(backend="eager")
    decoders = [model.streaming_decoder(speaker_embedding=_voice(seed, model)[0], token_hop_len=5) for seed in range(3)]
    batches = []
    solve = model.flow.decoder.solve
    monkeypatch.setattr(model.flow.decoder, "solve", lambda x, *args: batches.append(tuple(x.shape)) or solve(x, *args))
    for seed, decoder in enumerate(decoders):
        decoder.add_tokens(torch.randint(0, 40, (9,), generator=torch.Generator().manual_seed(seed)))
    audio = decode_ready(decoders)
    assert all(piece.numel() > 0 for piece in audio)
    frames = model.config.token_mel_ratio * decoders[0].max_flow_window
    assert batches == [(4, model.config.mel_bins, frames)], batches


@pytest.mark.parametrize("options", [{}, {"flow_window_bucket_tokens": (24, 48)}], ids=["exact-shapes", "padded"])
def test_streams_at_different_hops_decode_together_as_alone(model, options):
    """Hop growth: streams at different stages of their hop schedule (5, 15, 30, 60) share rounds; each row's flow
    window is padded to the round's largest and HiFT runs per window shape, so each stream's mel and audio are its
    own `push`'s."""
    growth = dict(token_hop_len=15, first_token_hop_len=5, token_max_hop_len=60, flow_left_context_tokens=30)
    growth.update(options)
    prefixes, tokens = (0, 25, 60), [_tokens(model, 200, seed) for seed in range(3)]
    pairs = []
    for seed, prefix in enumerate(prefixes):
        pair = [model.streaming_decoder(speaker_embedding=_voice(seed, model), **growth) for _ in range(2)]
        for decoder in pair:
            decoder.push(tokens[seed][:prefix])
        pairs.append(pair)
    sequential, batched = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
    seq_mels = [_recording(decoder) for decoder in sequential]
    bat_mels = [_recording(decoder) for decoder in batched]
    seq_audio, bat_audio = [[] for _ in pairs], [[] for _ in pairs]
    mixed_rounds = 0
    for start in range(0, 140, 10):
        for index, prefix in enumerate(prefixes):
            piece = tokens[index][prefix + start : prefix + start + 10]
            seq_audio[index].append(sequential[index].push(piece))
            batched[index].add_tokens(piece)
        hops = {decoder._next_hop() for decoder in batched if decoder.chunk_ready()}
        mixed_rounds += len(hops) > 1
        for index, audio in enumerate(decode_ready(batched)):
            bat_audio[index].append(audio)
    assert mixed_rounds >= 2
    for index in range(len(pairs)):
        seq_audio[index].append(sequential[index].finalize())
        bat_audio[index].append(batched[index].finalize())
        assert batched[index].chunks_decoded == sequential[index].chunks_decoded >= 4  # chunk 3 on: the largest hop
        assert len(seq_mels[index]) == len(bat_mels[index])
        for seq_mel, bat_mel in zip(seq_mels[index], bat_mels[index]):
            _close(bat_mel, seq_mel, atol=1e-5)
        assert [piece.shape for piece in bat_audio[index]] == [piece.shape for piece in seq_audio[index]]
        _close_wav(torch.cat(bat_audio[index]), torch.cat(seq_audio[index]))
