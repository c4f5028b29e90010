"""The CosyVoice3 decoder's device defaults (`estimator_precision`, `apply_device_defaults`) and how far a 16-bit DiT
estimator moves the output from float32 (`scripts/decoder_precision_snr.py`)."""

import contextlib
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from funaudiochat_hf import CosyVoice3Config, CosyVoice3Token2Wav

from conftest import COSYVOICE3_GOLDEN, COSYVOICE3_TINY, load_module


SNR_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "decoder_precision_snr.py"
LOGGER = "funaudiochat_hf.modeling_cosyvoice3_performance"  # where `apply_device_defaults` logs


@pytest.fixture(scope="module")
def snr_script():
    return load_module(SNR_SCRIPT, "decoder_precision_snr")


@pytest.fixture(scope="module")
def flow_full():
    return load_file(COSYVOICE3_GOLDEN / "flow_full.safetensors")


@contextlib.contextmanager
def reported_on_cuda():
    """Decoders report a CUDA device (what `apply_device_defaults` decides by) inside the block; nothing moves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CosyVoice3Token2Wav, "device", property(lambda self: torch.device("cuda")))
        yield


def _state(model):
    estimator = model.flow.decoder.estimator
    return (
        {parameter.dtype for parameter in estimator.parameters()},
        model.config.estimator_autocast_dtype,
        model.qkv_projections_fused,
        estimator.input_embed.conv_pos_embed.conv1_tap_major is not None,
    )


def test_bfloat16_estimator_snr_against_float32_on_the_fixtures(snr_script, flow_full):
    """bfloat16 against float32 on the golden tokens (measured on CPU: mel 49.4 dB, F0 48.4 dB, the waveform with
    float32's excitation 35.9 dB). The plain waveform SNR is reported but not held to a floor here: the tiny
    random HiFT's large F0 weights turn a 48 dB F0 into unrelated harmonic phases (~0 dB); on full-size weights it
    follows the mel (`scripts/decoder_precision_snr.py` without arguments)."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    row = snr_script.precision_snr(model, "bfloat16", "cpu", flow_full["speech_token"], flow_full["embedding"])
    assert row["precision"] == "bfloat16" and row["tokens"] == 90 and not row["notes"]
    assert 40.0 <= row["mel_snr_db"] < 100  # low precision was really used, and the mel stays close
    assert row["f0_snr_db"] >= 40.0
    assert row["wav_same_excitation_snr_db"] >= 28.0
    assert row["mel_max_abs_diff"] < 0.1 * row["mel_std"]
    assert _state(model)[:2] == ({torch.float32}, None)  # the check leaves the float32 weights as they were


def test_snr_script_prints_a_json_line_per_precision(snr_script, capsys):
    assert snr_script.main(["--tiny", "--device", "cpu", "--precisions", "float16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = json.loads(lines[0])
    assert row["precision"] == "float16" and row["mel_snr_db"] > 50 and row["decoder"].endswith("cosyvoice3_tiny")
    assert lines[1].startswith("| precision |") and lines[3].startswith("| float16 | 90 |")
    with pytest.raises(SystemExit):
        snr_script.main(["--tiny", "--device", "cpu", "--precisions", "int8"])


def test_cpu_default_leaves_the_float32_decoder_alone(flow_full):
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    assert model.config.estimator_precision == "auto"
    mel = model.tokens_to_mel(flow_full["speech_token"], flow_full["embedding"])
    torch.testing.assert_close(mel, flow_full["mel"], atol=1e-4, rtol=1e-4)
    assert _state(model) == ({torch.float32}, None, False, False)
    assert model.resolved_estimator_precision() == "float32"
    assert model.resolved_estimator_precision(torch.device("cuda")) == "bfloat16"


def test_cuda_default_is_a_bfloat16_estimator_with_fused_weight_copies(caplog, flow_full):
    """On its first call on CUDA the decoder casts its estimator to bfloat16 (one log line) and keeps the fused
    q/k/v and tap-major position-conv copies; later calls leave it alone."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    with caplog.at_level(logging.INFO, logger=LOGGER), reported_on_cuda():
        model.apply_device_defaults()
        model.apply_device_defaults()
    messages = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert len(messages) == 1 and "bfloat16" in messages[0] and "'auto'" in messages[0]
    assert _state(model) == ({torch.bfloat16}, "bfloat16", True, True)
    attention = model.flow.decoder.estimator.transformer_blocks[0].attn
    assert attention.qkv_weight.dtype == torch.bfloat16
    tap_major = model.flow.decoder.estimator.input_embed.conv_pos_embed.conv1_tap_major
    assert tap_major.dtype == torch.bfloat16

    # The same numbers as the explicit opt-in of before (bf16 weights; the fused GEMM rounds like the three).
    reference = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    reference.use_low_precision_estimator("bfloat16")
    reference.fuse_qkv_projections()
    args = (flow_full["speech_token"], flow_full["embedding"])
    torch.testing.assert_close(model.tokens_to_mel(*args), reference.tokens_to_mel(*args), atol=0, rtol=0)
    assert _state(model)[:2] == ({torch.bfloat16}, "bfloat16")  # "auto" on the CPU keeps what it runs in


def test_auto_keeps_float32_on_a_gpu_without_bfloat16_tensor_cores(caplog, monkeypatch):
    """On a GPU older than compute capability 8.0 (a T4, a V100) a bfloat16 estimator would be emulated, slower, and
    the decoder's Triton kernels do not run there: "auto" keeps float32 and says so once; "bfloat16" still casts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    assert model.resolved_estimator_precision(torch.device("cuda")) == "float32"
    with caplog.at_level(logging.INFO, logger=LOGGER), reported_on_cuda():
        model.apply_device_defaults()
        model.apply_device_defaults()
    messages = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert len(messages) == 1 and "7.5" in messages[0] and "float32" in messages[0]
    assert _state(model)[:2] == ({torch.float32}, None)

    explicit = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    explicit.config.estimator_precision = "bfloat16"
    with reported_on_cuda():
        explicit.apply_device_defaults()
    assert _state(explicit)[:2] == ({torch.bfloat16}, "bfloat16")


def test_cuda_float32_is_one_option_away(caplog, tmp_path):
    """`estimator_precision="float32"` (config or `from_pretrained` keyword) keeps the float32 weights on CUDA; the
    fused q/k/v copy is still taken, the tap-major copy (read by the 16-bit kernel only) is not."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY)
    model.save_pretrained(tmp_path)
    reloaded = CosyVoice3Token2Wav.from_pretrained(tmp_path, estimator_precision="float32")
    assert reloaded.config.estimator_precision == "float32"
    with caplog.at_level(logging.INFO, logger=LOGGER), reported_on_cuda():
        reloaded.apply_device_defaults()
    assert not [record for record in caplog.records if record.name == LOGGER]
    assert _state(reloaded) == ({torch.float32}, None, True, False)


def test_explicit_precision_applies_on_every_device_and_use_low_precision_estimator_is_explicit(flow_full):
    """An explicit 16-bit precision applies on the CPU too; `use_low_precision_estimator` records its choice, so
    the first CUDA call keeps it (float16 here) instead of the default bfloat16; bad values are named."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    model.use_low_precision_estimator("float16")
    assert model.config.estimator_precision == "float16"
    with reported_on_cuda():
        model.apply_device_defaults()
    assert _state(model) == ({torch.float16}, "float16", True, True)

    explicit = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    explicit.config.estimator_precision = "bfloat16"
    opted_in = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    opted_in.use_low_precision_estimator("bfloat16")
    args = (flow_full["speech_token"], flow_full["embedding"])
    torch.testing.assert_close(explicit.tokens_to_mel(*args), opted_in.tokens_to_mel(*args), atol=0, rtol=0)
    assert _state(explicit) == ({torch.bfloat16}, "bfloat16", False, False)  # the CUDA-only copies stay off

    with pytest.raises(ValueError, match="estimator_precision must be one of"):
        CosyVoice3Config(estimator_precision="bf16")
    bad = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    bad.config.estimator_precision = "int8"
    with pytest.raises(ValueError, match="estimator_precision must be one of"):
        bad.tokens_to_mel(*args)


def test_explicit_float32_casts_16_bit_weights_back():
    """A decoder whose config says float32 but whose estimator runs in bfloat16 (autocast set in the config, or
    16-bit weights saved) runs float32 on its first call."""
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    model.use_low_precision_estimator("bfloat16")
    model.config.estimator_precision = "float32"
    with reported_on_cuda():
        model.apply_device_defaults()
    assert _state(model) == ({torch.float32}, None, True, False)


# -- GPU --------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_default_decoder_runs_bfloat16_and_stays_close_to_float32(flow_full):
    """The tiny decoder moved to CUDA with no options: bfloat16 estimator with its weight copies, offline and
    streamed (CUDA graphs), within the CPU-measured SNR floor of float32 on the same GPU."""
    tokens, speaker = flow_full["speech_token"].cuda(), flow_full["embedding"].cuda()
    reference = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval()
    reference.config.estimator_precision = "float32"
    reference_mel = reference.cuda().tokens_to_mel(tokens, speaker)
    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).eval().cuda()
    mel = model.tokens_to_mel(tokens, speaker)
    assert _state(model) == ({torch.bfloat16}, "bfloat16", True, True)
    snr = 10 * torch.log10(reference_mel.double().pow(2).sum() / (mel.double() - reference_mel.double()).pow(2).sum())
    assert 40.0 <= float(snr) < 100
    stream = model.streaming_decoder(speaker_embedding=speaker, token_hop_len=15)
    assert stream.cuda_graphs
    audio = torch.cat([stream.push(tokens[0, i : i + 5]) for i in range(0, tokens.shape[1], 5)] + [stream.finalize()])
    assert audio.shape == (tokens.shape[1] * 960,) and torch.isfinite(audio).all()
