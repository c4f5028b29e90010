"""Hop growth of the CosyVoice3 streaming decoder (`token_max_hop_len`, `stream_scale_factor`): the chunk boundaries
it gives, that each chunk is still computed as a fixed-hop chunk is, and that the cost per chunk stays bounded."""

import pytest
import torch

from funaudiochat_hf import CosyVoice3Token2Wav
from funaudiochat_hf.streaming_cosyvoice3 import _flow_window_sizes, hop_schedule

from conftest import COSYVOICE3_TINY
from test_modeling_cosyvoice3 import _close, _NewAllocations


@pytest.fixture(scope="module")
def model():
    return CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)


def _tokens(model, count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (count,), generator=torch.Generator().manual_seed(seed))


def _pushes(decoder, tokens: torch.Tensor, step: int = 5) -> tuple[list[torch.Tensor], list[int]]:
    """Push `step` tokens at a time, then finalize: (audio pieces, token_offset after each push that decoded)."""
    pieces, offsets = [], []
    for start in range(0, len(tokens), step):
        pieces.append(decoder.push(tokens[start : start + step]))
        if pieces[-1].numel():
            offsets.append(decoder.token_offset)
    return pieces + [decoder.finalize()], offsets


def test_hop_schedule():
    assert hop_schedule(5, 15, None, 2.0) == (5, 15)  # no growth
    assert hop_schedule(5, 15, 15, 2.0) == (5, 15)
    assert hop_schedule(5, 15, 100, 2.0) == (5, 15, 30, 60, 100)  # the reference's rule, capped at the maximum
    assert hop_schedule(15, 15, 40, 1.5) == (15, 15, 22, 33, 40)  # int() of each product, as the reference
    assert hop_schedule(25, 25, 100, 2) == (25, 25, 50, 100)


@pytest.mark.parametrize(
    "options, offsets",
    [
        ({}, list(range(15, 391, 15))),
        ({"first_token_hop_len": 5}, list(range(5, 396, 15))),
        ({"first_token_hop_len": 5, "token_max_hop_len": 15}, list(range(5, 396, 15))),
        ({"first_token_hop_len": 5, "token_max_hop_len": 100}, [5, 20, 50, 110, 210, 310]),
        ({"token_max_hop_len": 40, "stream_scale_factor": 1.5}, [15, 30, 52, 85, *range(125, 366, 40)]),
    ],
    ids=["default", "short-first", "max-equals-hop", "growth-to-100", "factor-1.5"],
)
def test_chunk_boundaries(model, options, offsets):
    """The chunk boundaries (token_offset after each chunk) of 400 tokens pushed 5 at a time: the hop of chunk k is
    `chunk_hop(k)`; a chunk is decoded once a token beyond its look-ahead has arrived, the rest by `finalize`."""
    decoder = model.streaming_decoder(speaker="中文女", token_hop_len=15, **options)
    pieces, decoded = _pushes(decoder, _tokens(model, 400))
    assert decoded == offsets
    hops = [decoder.chunk_hop(k) for k in range(len(offsets))]
    assert hops == [end - start for start, end in zip([0] + offsets, offsets)]
    assert torch.cat(pieces).shape == (400 * 960,)


def test_no_growth_is_todays_chunking_bit_for_bit(model):
    tokens = _tokens(model, 120, seed=1)
    today, _ = _pushes(model.streaming_decoder(speaker="中文女", first_token_hop_len=5), tokens)
    same, _ = _pushes(model.streaming_decoder(speaker="中文女", first_token_hop_len=5, token_max_hop_len=15), tokens)
    assert all(torch.equal(a, b) for a, b in zip(today, same)) and len(today) == len(same)


def test_grown_chunks_are_the_flow_calls_over_their_tokens_and_vocode_like_the_whole_mel(model):
    """While every flow window starts at token 0 (the reply shorter than the left context), a grown chunk's mel is
    the non-final flow call over the tokens up to its end plus look-ahead (the final chunk: the final call over all
    tokens), exactly; HiFT over the concatenated streamed mel, offline, gives the streamed audio."""
    tokens = _tokens(model, 120, seed=2)
    decoder = model.streaming_decoder(speaker="中文女", first_token_hop_len=5, token_max_hop_len=60)
    mels = []
    take = decoder._take_mel

    def recorded(mel, window_start, end, finalize):
        assert window_start == 0
        mels.append(mel[:, :, decoder.ratio * decoder.token_offset :].clone())
        return take(mel, window_start, end, finalize)

    decoder._take_mel = recorded
    pieces, offsets = _pushes(decoder, tokens)
    assert offsets == [5, 20, 50, 110]  # hops 5, 15, 30, 60, then the final 10 tokens
    speaker = model.get_speaker_embedding(speaker="中文女")
    ratio, lookahead = model.config.token_mel_ratio, model.config.pre_lookahead_len
    for start, end, mel in zip([0] + offsets, offsets, mels):
        expected = model.tokens_to_mel(tokens[None, : end + lookahead], speaker, finalize=False)
        assert torch.equal(mel, expected[:, :, ratio * start :])
    assert torch.equal(mels[-1], model.tokens_to_mel(tokens[None], speaker)[:, :, ratio * offsets[-1] :])
    streamed = torch.cat(pieces)
    _close(streamed, model.mel_to_wav(torch.cat(mels, dim=2))[0], atol=1e-5)


def test_grown_chunks_cost_is_bounded_and_does_not_grow(model):
    """Past the left context, every flow window fits `max_flow_window` (left context + the largest hop + look-ahead)
    and the carried state stays bounded; once `steady` (largest hop, full windows), every chunk allocates exactly the
    same bytes."""
    hop, max_hop, flow_context, hift_context = 10, 40, 30, 32
    decoder = model.streaming_decoder(speaker="中文女", token_hop_len=hop, first_token_hop_len=5,
                                      token_max_hop_len=max_hop, flow_left_context_tokens=flow_context,
                                      hift_left_context_frames=hift_context)  # fmt: skip
    lookahead = model.config.pre_lookahead_len
    assert decoder.hop_schedule == (5, 10, 20, 40) and decoder.max_flow_window == flow_context + max_hop + lookahead
    windows = []
    flow = decoder._flow
    decoder._flow = lambda window, *args, **kwargs: windows.append(window.shape[0]) or flow(window, *args, **kwargs)
    tokens = _tokens(model, 400, seed=3)
    steady_chunks = []
    for start in range(0, len(tokens), 5):
        steady = decoder.steady
        with _NewAllocations() as counter:
            audio = decoder.push(tokens[start : start + 5])
        if audio.numel():
            assert decoder.tokens.numel() <= flow_context + max_hop + lookahead + 5
            assert decoder.mel.shape[-1] <= hift_context + model.config.token_mel_ratio * max_hop + 8
            if steady:
                steady_chunks.append((counter.total, counter.largest))
    decoder.finalize()
    assert max(windows) == decoder.max_flow_window and windows[-2] == decoder.max_flow_window
    assert len(steady_chunks) >= 5 and all(chunk == steady_chunks[0] for chunk in steady_chunks), steady_chunks


def test_flow_window_sizes_hold_each_hops_steady_window():
    """"auto" under CUDA graphs: a steady chunk of each hop replays a window of its own size, not the longest one."""
    steady = (218, 233, 263, 303)  # left context 200 + hops 15, 30, 60, 100 + look-ahead 3
    assert _flow_window_sizes("auto", 303, compiled=False, graphed=True, steady_windows=steady) == (
        32, 128, 218, 233, 263, 303
    )  # fmt: skip
    assert _flow_window_sizes("auto", 218, compiled=False, graphed=True, steady_windows=(218,)) == (32, 128, 218)
    assert _flow_window_sizes("auto", 303, compiled=True, graphed=True, steady_windows=steady) == (303,)
    assert _flow_window_sizes(128, 303, compiled=False, graphed=True, steady_windows=steady) == (128, 256, 303)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"token_max_hop_len": 10}, "token_max_hop_len"),  # below token_hop_len (15)
        ({"token_max_hop_len": 0}, "token_max_hop_len"),
        ({"token_max_hop_len": 30.0}, "token_max_hop_len"),
        ({"token_max_hop_len": True}, "token_max_hop_len"),
        ({"stream_scale_factor": 0.5}, "stream_scale_factor"),
        ({"stream_scale_factor": float("nan")}, "stream_scale_factor"),
        ({"stream_scale_factor": "2"}, "stream_scale_factor"),
        ({"stream_scale_factor": True}, "stream_scale_factor"),
        ({"token_max_hop_len": 30, "stream_scale_factor": 1.0}, "stream_scale_factor"),
        ({"token_max_hop_len": 30, "stream_scale_factor": 1.05}, r"int\(15 \* 1.05\) = 15"),  # would never grow
    ],
)
def test_bad_growth_arguments_are_refused(model, options, match):
    with pytest.raises(ValueError, match=match):
        model.streaming_decoder(speaker="中文女", token_hop_len=15, **options)
    # a factor of 1 is fine without growth
    assert model.streaming_decoder(speaker="中文女", stream_scale_factor=1).hop_schedule == (15, 15)


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("token_hop_len", 2.5, "token_hop_len must be an int >= 1, got 2.5"),  # once named token_max_hop_len
        ("token_hop_len", float("nan"), "token_hop_len must be an int >= 1, got nan"),
        ("token_hop_len", True, "token_hop_len must be an int >= 1, got True"),
        ("token_hop_len", 0, "token_hop_len must be an int >= 1, got 0"),
        ("first_token_hop_len", 5.0, "first_token_hop_len must be None or an int >= 1, got 5.0"),
        ("first_token_hop_len", 0, "first_token_hop_len must be None or an int >= 1, got 0"),
        ("flow_left_context_tokens", 1.5, "flow_left_context_tokens must be an int >= 0, got 1.5"),  # a TypeError
        ("flow_left_context_tokens", -1, "flow_left_context_tokens must be an int >= 0, got -1"),
        ("hift_left_context_frames", 32.0, "hift_left_context_frames must be an int >= 8, got 32.0"),
        ("hift_left_context_frames", 7, "hift_left_context_frames must be an int >= 8, got 7"),
        ("pre_lookahead_len", 3.0, "pre_lookahead_len must be an int >= 0, got 3.0"),
    ],
)
def test_each_integer_option_is_refused_by_its_own_name(model, name, value, match):
    """`token_hop_len=2.5` (or nan) passed `< 1` and failed naming token_max_hop_len; `flow_left_context_tokens=1.5`
    passed and raised a raw TypeError in the first chunk."""
    with pytest.raises(ValueError, match=match):
        model.streaming_decoder(speaker="中文女", **{name: value})


def test_numpy_integers_are_ints(model):
    import numpy as np

    decoder = model.streaming_decoder(speaker="中文女", token_hop_len=np.int64(10), first_token_hop_len=np.int32(5),
                                      flow_left_context_tokens=np.int64(30))  # fmt: skip
    assert decoder.hop_schedule == (5, 10) and type(decoder.flow_left_context) is int
