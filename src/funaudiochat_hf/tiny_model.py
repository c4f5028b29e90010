"""A tiny random-weight Fun-Audio-Chat (+ CosyVoice3 decoder) that runs anywhere, offline, in seconds.

It has the real architecture and the real processor files (a tiny tokenizer), so every code path of the package runs
(prompting, joint text + speech decoding, token2wav, pipeline, CLI, demo), but its weights are random: **its text is
gibberish and its audio is noise**. It is the offline default of the CLI and the demo and the model of the tests.
Use the real model with `--model FunAudioLLM/Fun-Audio-Chat-8B --decoder <CosyVoice3 folder>`.

```python
from funaudiochat_hf.tiny_model import build_tiny_model

path = build_tiny_model()  # ~/.cache/funaudiochat_hf/tiny-<version>, built once (a few seconds), then reused
```
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers.utils import logging

from .configuration_cosyvoice3 import CosyVoice3Config
from .configuration_funaudiochat import FunAudioChatConfig


logger = logging.get_logger(__name__)

# Bump whenever the recipe below changes: the cache folder name includes it, so stale builds are never reused.
TINY_MODEL_VERSION = "v2"
ASSETS_DIR = Path(__file__).parent / "tiny_assets"
_COMPLETE_MARKER = ".complete"
# How many weight seeds the deterministic search may try before giving up (the first one usually works).
_MAX_SEED_TRIES = 64
_SEARCH_MAX_NEW_TOKENS = 40
_MIN_SPEECH_TOKENS = 20
# The tiny decoder's level: its reply to the synthetic question peaks here (a normal level for speech, with headroom).
REPLY_PEAK_DBFS = -6.0
# Spreads of the vocoder's random outputs: log-magnitudes (natural log; wider ones make a spikier, quieter-sounding
# noise at the same peak) and phases (radians, before the model's own sin).
_LOG_MAGNITUDE_STD = 0.5
_PHASE_STD = float(np.pi)

NOISE_WARNING = (
    "This is a tiny RANDOM-WEIGHT model: its text is gibberish and its audio is noise. It only shows that everything "
    "runs. For real replies use --model FunAudioLLM/Fun-Audio-Chat-8B --decoder <Fun-CosyVoice3-0.5B-2512 folder> "
    "(see the README)."
)

_MODEL_CARD = f"""---
license: apache-2.0
tags: [funaudiochat, speech-to-speech, random-weights, testing]
---
# Tiny random Fun-Audio-Chat (version {TINY_MODEL_VERSION})

Built by `funaudiochat_hf.tiny_model.build_tiny_model()`. {NOISE_WARNING}
"""


def tiny_model_cache_dir() -> Path:
    """Where built tiny models are cached: `$FUNAUDIOCHAT_HF_CACHE`, else `$HF_HOME/funaudiochat_hf`, else
    `$XDG_CACHE_HOME/funaudiochat_hf` (default `~/.cache/funaudiochat_hf`)."""
    if os.environ.get("FUNAUDIOCHAT_HF_CACHE"):
        return Path(os.environ["FUNAUDIOCHAT_HF_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "funaudiochat_hf"
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(cache_home).expanduser() / "funaudiochat_hf"


def tiny_token2wav_config(speech_vocab_size: int) -> CosyVoice3Config:
    """The tiny CosyVoice3 decoder: the architecture of Fun-CosyVoice3-0.5B-2512 with small widths (as the parity
    fixture `tests/fixtures/cosyvoice3_tiny`), one speech-token row per chat-model speech token, two voices."""
    return CosyVoice3Config(
        vocab_size=speech_vocab_size,
        pre_lookahead_channels=64,
        dit_dim=64,
        dit_depth=2,
        dit_heads=2,
        dit_dim_head=32,
        dit_conv_pos_groups=16,
        noise_frames=3000,  # 60 s of mel: plenty for replies bounded by max_new_tokens
        hift_config={"base_channels": 32, "f0_predictor": {"num_class": 1, "in_channels": 80, "cond_channels": 32}},
        speaker_names=["中文女", "中文男"],
    )


def tiny_model_config() -> FunAudioChatConfig:
    """The tiny chat config (hidden 64, 2 layers; tiny tokenizer vocabulary) with the tiny decoder attached."""
    chat = json.loads((ASSETS_DIR / "chat_config.json").read_text())
    for key in ("transformers_version", "architectures", "torch_dtype"):
        chat.pop(key, None)
    speech_vocab_size = chat["audio_config"]["bos_token_id"]  # ids [0, bos) are speech tokens
    return FunAudioChatConfig(**chat, token2wav_config=tiny_token2wav_config(speech_vocab_size).to_dict())


def synthetic_question(seconds: float = 2.0, sampling_rate: int = 16000) -> np.ndarray:
    """A deterministic voice-like clip `(samples,)` float32 (a gliding harmonic tone with syllable-rate envelope).

    Handy as an example input where no recording exists (the demo's example, smoke tests)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}.")
    t = np.arange(int(seconds * sampling_rate)) / sampling_rate
    pitch = 140.0 + 30.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / sampling_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 3.0 * t)) * np.minimum(1.0, 10 * t) * np.minimum(1.0, 10 * (t[-1] - t))
    return (0.25 * voice * envelope / 2.6).astype(np.float32)


def _redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every chat-model parameter like the parity-fixture generator does (see tests/fixtures/MANIFEST.md):
    biases N(0, 0.02^2), norm weights 1 + N(0, 0.1^2), embeddings N(0, 0.5^2), matrices N(0, 1/fan_in). Large,
    fan-in-scaled weights give peaky logits, so greedy decoding makes clear (if meaningless) choices."""
    generator = torch.Generator().manual_seed(seed)
    # Parameters and persistent buffers (the unused `audio_bos_eos_token` table is one) in checkpoint order, tied
    # tensors once: the order of `named_parameters()` when that table was a parameter, so the weights stay the same.
    tensors, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_floating_point() and id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append((name, tensor))
    with torch.no_grad():
        for name, param in tensors:
            if name.startswith("token2wav."):
                continue
            if param.ndim == 1:
                if name.endswith("bias"):
                    values = torch.randn(param.shape, generator=generator) * 0.02
                else:
                    values = 1 + torch.randn(param.shape, generator=generator) * 0.1
            elif "embed_tokens" in name or "audio_bos_eos_token" in name:
                values = torch.randn(param.shape, generator=generator) * 0.5
            else:
                fan_in = param[0].numel()
                values = torch.randn(param.shape, generator=generator) / fan_in**0.5
            param.copy_(values.to(param.dtype))


def _speaks(model, processor) -> tuple[bool, int, torch.Tensor]:
    """Whether greedy decoding of the synthetic question emits enough speech and then the speech EOS; the count of
    speech tokens, and those tokens `(1, count)`."""
    inputs = processor(
        text=_prompt(processor), audio=[synthetic_question()], return_tensors="pt"
    )
    output = model.generate_speech(
        **inputs, max_new_tokens=_SEARCH_MAX_NEW_TOKENS, do_sample=False, return_audio=False
    )
    speech = output.speech_ids[0]
    audio_config = model.config.audio_config
    is_speech = speech < audio_config.bos_token_id
    n_speech = int(is_speech.sum())
    ended = bool((speech == audio_config.eos_token_id).any())
    return n_speech >= _MIN_SPEECH_TOKENS and ended, n_speech, speech[is_speech][None]


@torch.no_grad()
def _set_vocoder_level(token2wav, speech_tokens: torch.Tensor, seed: int) -> None:
    """Redraw HiFT's last convolution so that the random decoder makes audible noise at a normal level.

    Initialised like any transformers model (weights N(0, 0.02^2)), the random HiFT ends in outputs of ~1e-4: every
    log-magnitude ~0 and every phase ~0, an impulse per STFT frame that the Hann window cancels (-70 dBFS). Here
    `conv_post` is redrawn so that, on the tiny model's reply `speech_tokens` (1, tokens), its log-magnitude outputs
    spread by `_LOG_MAGNITUDE_STD` and its phase outputs by `_PHASE_STD` (each output channel's weights scaled to that
    spread), with a log-magnitude bias that puts the reply's peak at `REPLY_PEAK_DBFS`: the iSTFT is linear in the
    magnitude, so one probe at a low level fixes the bias."""
    hift = token2wav.hift
    conv = hift.conv_post
    bins = hift.n_fft // 2 + 1
    speaker = token2wav.get_speaker_embedding()
    captured = {}
    hook = conv.register_forward_hook(lambda module, args, output: captured.__setitem__("output", output))
    try:
        generator = torch.Generator().manual_seed(seed)
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator))
        conv.bias.zero_()
        token2wav(speech_tokens, speaker_embedding=speaker)
        spread = torch.full((2 * bins,), _PHASE_STD)
        spread[:bins] = _LOG_MAGNITUDE_STD
        conv.weight.mul_((spread / captured["output"].std(dim=(0, 2)))[:, None, None])
        probe_bias = -10.0  # far below the clamps (magnitude <= 1e2, samples <= audio_limit)
        conv.bias[:bins] = probe_bias
        peak = token2wav(speech_tokens, speaker_embedding=speaker).waveform.abs().max().item()
        conv.bias[:bins] = probe_bias + float(np.log(10 ** (REPLY_PEAK_DBFS / 20) / peak))
    finally:
        hook.remove()


def _prompt(processor) -> str:
    from .processing_funaudiochat import AUDIO_TEMPLATE, DEFAULT_S2M_PROMPT

    messages = [{"role": "system", "content": DEFAULT_S2M_PROMPT}, {"role": "user", "content": AUDIO_TEMPLATE}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _build(folder: Path, seed: int) -> None:
    # The build runs in the caller's process (CLI, demo, server): seeding the global RNG there would change the seeds
    # later unseeded requests draw from it, so the build draws from a forked copy that is restored afterwards.
    with torch.random.fork_rng(devices=[]):
        _build_seeded(folder, seed)


def _build_seeded(folder: Path, seed: int) -> None:
    from .modeling_funaudiochat import FunAudioChatForConditionalGeneration
    from .processing_funaudiochat import FunAudioChatProcessor

    processor = FunAudioChatProcessor.from_pretrained(ASSETS_DIR)
    torch.manual_seed(seed)  # the decoder keeps its own (seeded) initialisation
    model = FunAudioChatForConditionalGeneration(tiny_model_config()).eval()
    tried = []
    for attempt in range(_MAX_SEED_TRIES):
        weight_seed = seed * 1000 + attempt
        _redraw_weights(model, weight_seed)
        ok, n_speech, speech_tokens = _speaks(model, processor)
        tried.append((weight_seed, n_speech))
        if ok:
            break
    else:
        raise RuntimeError(f"No weight seed in {tried[0][0]}..{tried[-1][0]} makes the tiny model speak: {tried}")
    logger.info("tiny model: weight seed %d (%d speech tokens)", weight_seed, n_speech)
    _set_vocoder_level(model.token2wav, speech_tokens, weight_seed)
    model.config.tiny_weight_seed = weight_seed
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / "README.md").write_text(_MODEL_CARD, encoding="utf-8")


def build_tiny_model(path: str | os.PathLike | None = None, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny random-weight speech-to-speech model and return its folder.

    Args:
        path: target folder; default `tiny_model_cache_dir() / "tiny-<version>"` (`-seed<seed>` appended for
            seed != 0). An existing complete build there is reused unless `force`.
        seed: selects the weights deterministically (same seed, same files' tensors).
        force: rebuild even if a complete build exists.

    Returns:
        The folder, loadable with `AutoModel.from_pretrained` / `AutoProcessor.from_pretrained` and
        `pipeline("speech-to-speech", model=...)` after `import funaudiochat_hf`. Its audio is noise.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
    if path is None:
        name = f"tiny-{TINY_MODEL_VERSION}" + (f"-seed{seed}" if seed else "")
        path = tiny_model_cache_dir() / name
    folder = Path(path).expanduser()
    if (folder / _COMPLETE_MARKER).is_file() and not force:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    logger.warning(f"Building the tiny random-weight model in {folder}: once (up to a minute on a CPU), then cached.")
    # Build next to the target and move it into place, so concurrent or interrupted builds never leave half a model.
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    scratch.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as any other
    try:
        _build(scratch, seed)
        (scratch / _COMPLETE_MARKER).write_text(TINY_MODEL_VERSION)
        if folder.exists():
            shutil.rmtree(folder)
        try:
            os.replace(scratch, folder)
        except OSError:
            if not (folder / _COMPLETE_MARKER).is_file():  # lost a race against an identical build: keep theirs
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


__all__ = ["NOISE_WARNING", "TINY_MODEL_VERSION", "build_tiny_model", "synthetic_question", "tiny_model_cache_dir"]
