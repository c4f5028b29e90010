"""The models of `scripts/bench_serving.py` (and `profile_ttfa.py --serving-prompt`): the full-size chat model and
CosyVoice3 decoder with random weights, and a processor that speaks the full-size model's token ids."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import benchmark  # scripts/benchmark.py: its options
import benchmark_chat  # the full-size chat model builder
import benchmark_decoder  # the full-size decoder builder
import torch


class FullSizeProcessor:
    """The tiny processor (`funaudiochat_hf/tiny_assets`) speaking the full-size model's token ids.

    The tiny tokenizer's added tokens are the real Qwen3 ones in the same order at ids 320.. instead of 151643..: its
    `input_ids` from the first added id up are shifted by one offset (the full config's `<|AUDIO|>` id minus the tiny
    one, checked against the other special ids), and the user audio's `speech_ids` (all `<|audio_pad|>`) take the full
    audio config's pad id. Plain BPE ids (below the added ones) are valid full-size ids as they are. Everything else
    (chat template, features, `decode_reply`, the tokenizer) is the tiny processor's: reply ids beyond the tiny
    vocabulary decode to nothing, which only empties the transcripts.
    """

    def __init__(self, processor, config):
        self.processor = processor
        tokenizer = processor.tokenizer
        added = sorted(tokenizer.added_tokens_decoder)
        if added != list(range(added[0], added[0] + len(added))):
            raise ValueError("The tiny tokenizer's added tokens are not one contiguous id range.")
        self.first_added_id = added[0]
        self.offset = int(config.audio_token_index) - tokenizer.convert_tokens_to_ids(processor.audio_token)
        text = config.text_config
        expected = {
            processor.audio_bos_token: text.audio_bos_index,
            processor.audio_eos_token: text.audio_eos_index,
            "<|sil|>": text.sil_index,
            "<|endoftext|>": text.bos_token_id,
        }
        for token, full_id in expected.items():
            tiny_id = tokenizer.convert_tokens_to_ids(token)
            if tiny_id + self.offset != int(full_id):
                raise ValueError(f"{token}: tiny id {tiny_id} + offset {self.offset} != the full config's {full_id}.")
        if added[-1] + self.offset >= int(text.vocab_size):
            raise ValueError(f"The shifted added ids exceed the full vocabulary ({text.vocab_size}).")
        self.tiny_speech_pad = int(processor.speech_tokenizer.pad_token_id)
        self.full_speech_pad = int(config.audio_config.pad_token_id)
        bins = int(processor.feature_extractor.feature_size)
        if bins != int(config.audio_config.num_mel_bins):
            raise ValueError(f"The tiny feature extractor has {bins} mel bins, the full model {config.audio_config}.")

    def __call__(self, *args, **kwargs):
        outputs = self.processor(*args, **kwargs)
        ids = outputs["input_ids"]
        if not isinstance(ids, torch.Tensor):
            raise ValueError("FullSizeProcessor needs return_tensors='pt'.")
        outputs["input_ids"] = torch.where(ids >= self.first_added_id, ids + self.offset, ids)
        speech = outputs.get("speech_ids")
        if speech is not None:
            if not bool((speech == self.tiny_speech_pad).all()):
                raise ValueError("FullSizeProcessor maps user audio (all <|audio_pad|> speech ids) only.")
            outputs["speech_ids"] = torch.full_like(speech, self.full_speech_pad)
        return outputs

    def __getattr__(self, name):
        return getattr(self.processor, name)


def build_models(args, log: Callable[[str], None]) -> tuple[object, object, object, dict]:
    """(chat model, speech decoder, processor, info) for a run of `args` (bench_serving's options: `tiny`, `device`,
    `feature_window_seconds`); `log` says what was built."""
    if args.tiny:
        from funaudiochat_hf.cli import _load_pipeline

        pipe = _load_pipeline(argparse.Namespace(model=None, decoder=None, speakers=None, device=args.device,
                                                 dtype="auto", trust_remote_code=False))  # fmt: skip
        model, decoder, processor = pipe.model, pipe.decoder, with_window(pipe.processor, args.feature_window_seconds)
        info = {"source": "funaudiochat_hf.tiny_model (as the CLI loads it)"}
    else:
        from funaudiochat_hf import FunAudioChatProcessor
        from funaudiochat_hf.tiny_model import ASSETS_DIR

        bench_args = benchmark.parse_args(["--device", args.device])
        model, info = benchmark_chat.build_chat_model(bench_args)
        log(f"chat model built: {info['parameters'] / 1e9:.2f} B parameters, {info['dtype']}")
        decoder, decoder_info = benchmark_decoder.build_decoder(bench_args)
        # The defaults a loaded decoder gets on its first call on the device (CUDA: bf16 estimator, fused q/k/v).
        decoder.apply_device_defaults()
        # One stored voice (a random-weight decoder has none), as an official decoder's default speaker.
        decoder.config.speaker_names = ["bench"]
        decoder.speaker_embeddings = benchmark_decoder.speaker_embedding(args.device)
        tiny = with_window(FunAudioChatProcessor.from_pretrained(str(ASSETS_DIR)), args.feature_window_seconds)
        processor = FullSizeProcessor(tiny, model.config)
        info = {"source": "full-size configs, random weights (scripts/benchmark.py)", "chat": info,
                "decoder": decoder_info}  # fmt: skip
    estimator = decoder.flow.decoder.estimator
    info["decoder_estimator_dtype"] = str(next(estimator.parameters()).dtype).replace("torch.", "")
    info["decoder_qkv_fused"] = bool(decoder.qkv_projections_fused)
    extractor = processor.feature_extractor
    info["feature_window_seconds"] = extractor.n_samples / extractor.sampling_rate
    return model, decoder, processor, info


def with_window(processor, seconds: int | None):
    """`processor` with the same log-mel extractor but another window (`chunk_length`, what every clip's features
    are padded to); None: as it is."""
    from transformers import WhisperFeatureExtractor

    if seconds is None:
        return processor
    extractor = processor.feature_extractor
    processor.feature_extractor = WhisperFeatureExtractor(
        feature_size=extractor.feature_size, sampling_rate=extractor.sampling_rate, hop_length=extractor.hop_length,
        chunk_length=seconds, n_fft=extractor.n_fft, padding_value=extractor.padding_value, dither=extractor.dither,
        return_attention_mask=extractor.return_attention_mask,
    )  # fmt: skip
    return processor


__all__ = ["FullSizeProcessor", "build_models", "with_window"]
