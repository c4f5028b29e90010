"""The serving engine's vocoder (`serving_vocoder_funaudiochat.ServingVocoder`): a request's decoder that fails fails
that request only, and the others' audio is what their decoders alone give (the failed batched call changed nothing:
each then decodes alone)."""

import torch

from funaudiochat_hf import CosyVoice3Token2Wav
from funaudiochat_hf.serving_vocoder_funaudiochat import ServingVocoder, VocodeItem

from conftest import COSYVOICE3_TINY
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
