"""CosyVoice3 HiFT vocoder: parity with the reference `CausalHiFTGenerator` on the tiny random checkpoint
(fixtures/MANIFEST.md: tables, hift_full, token2wav_stream*), loading formats, batching, errors, torch.compile."""

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import COSYVOICE3_GOLDEN, COSYVOICE3_TINY
from funaudiochat_hf.modeling_cosyvoice3_hift import (
    CausalConv1d,
    CausalConv1dUpsample,
    CosyVoice3HiFTGenerator,
    conv1d_as_matmul,
)


# Longest source any golden needs (180 mel frames * 480); a prefix of the reference's 300 s table.
TABLE_SAMPLES = 86400
ATOL = RTOL = 1e-4


def hift_kwargs_from_yaml(path) -> dict:
    """The `hift:` section of cosyvoice3.yaml as plain kwargs (hyperpyyaml tags stripped, `<sample_rate>` resolved)."""
    text = path.read_text()
    sample_rate = int(re.search(r"^sample_rate: (\d+)", text, re.M).group(1))
    section = re.search(r"^hift: [^\n]*\n((?:[ \t]+[^\n]*\n)+)", text, re.M).group(1)
    section = section.replace("!ref <sample_rate>", str(sample_rate))
    section = re.sub(r"!new:\S+", "", section)
    return yaml.safe_load(section)


def original_state_dict() -> dict:
    return torch.load(COSYVOICE3_TINY / "hift.pt", weights_only=True)


def build_hift(state_dict=None) -> CosyVoice3HiFTGenerator:
    hift = CosyVoice3HiFTGenerator(**hift_kwargs_from_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml")).eval()
    hift.load_original_state_dict(original_state_dict() if state_dict is None else state_dict)
    hift.init_source_tables(max_samples=TABLE_SAMPLES)
    return hift


@pytest.fixture(scope="module")
def hift():
    return build_hift()


@pytest.fixture(scope="module")
def golden():
    return load_file(COSYVOICE3_GOLDEN / "hift_full.safetensors")


def assert_f0_close(actual, expected):
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-9)


def test_yaml_kwargs_are_the_tiny_sizes():
    kwargs = hift_kwargs_from_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml")
    assert kwargs["base_channels"] == 32 and kwargs["f0_predictor"]["cond_channels"] == 32
    assert kwargs["sampling_rate"] == 24000 and kwargs["upsample_rates"] == [8, 5, 3]


def test_source_tables_match_reference(hift):
    tables = load_file(COSYVOICE3_GOLDEN / "tables.safetensors")
    sine_gen = hift.m_source.l_sin_gen
    torch.testing.assert_close(sine_gen.rand_ini, tables["hift.m_source.l_sin_gen.rand_ini"], rtol=0, atol=0)
    torch.testing.assert_close(
        sine_gen.sine_waves, tables["hift.m_source.l_sin_gen.sine_waves[:, :L]"][:, :TABLE_SAMPLES], rtol=0, atol=0
    )
    torch.testing.assert_close(hift._stft_window(torch.device("cpu")), tables["hift.stft_window"], rtol=0, atol=0)


def test_full_size_source_tables_match_spec_check_values():
    # Spec 4.7 check values, drawn after the full-size F0 predictor (cond_channels 512).
    full_size = CosyVoice3HiFTGenerator()
    full_size.init_source_tables(max_samples=2)
    sine_gen = full_size.m_source.l_sin_gen
    expected_rand_ini = [0, 0.17098892, 0.16533190, 0.14378005, 0.76294738, 0.65893006, 0.02751905, 0.43482542,
                         0.05383557]
    assert sine_gen.rand_ini[0].tolist() == pytest.approx(expected_rand_ini, abs=1e-7)
    assert sine_gen.sine_waves[0, 0, :3].tolist() == pytest.approx([0.92282599, 0.47744751, 0.82705182], abs=1e-7)
    assert sine_gen.sine_waves.shape == (1, 2, 9)


def test_source_tables_with_explicit_generator(hift):
    generator = torch.Generator().manual_seed(0)
    torch.randn(1, 80, 15000, generator=generator)
    torch.empty(6561, 80).normal_(generator=generator)
    torch.empty(80, 192).uniform_(generator=generator)
    torch.empty(80).uniform_(generator=generator)
    other = CosyVoice3HiFTGenerator(**hift_kwargs_from_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml"))
    other.init_source_tables(generator=generator, max_samples=1000)
    assert torch.equal(other.m_source.l_sin_gen.sine_waves, hift.m_source.l_sin_gen.sine_waves[:, :1000])
    # A generator at another position gives other tables (the replay is what makes them match).
    other.init_source_tables(generator=torch.Generator().manual_seed(0), max_samples=1000)
    assert not torch.equal(other.m_source.l_sin_gen.sine_waves, hift.m_source.l_sin_gen.sine_waves[:, :1000])


@torch.no_grad()
def test_f0_source_and_wav_match_reference(hift, golden):
    mel = golden["mel"]
    f0 = hift.predict_f0(mel)
    assert_f0_close(f0, golden["f0"])
    torch.testing.assert_close(hift.f0_to_sample_rate(golden["f0"].float()), golden["f0_upsampled"], rtol=0, atol=0)
    source = hift.source_from_f0(golden["f0"].float())
    torch.testing.assert_close(source, golden["source"], atol=ATOL, rtol=RTOL)

    wav, source = hift(mel)
    assert wav.shape == (1, 480 * mel.shape[-1]) and wav.dtype == torch.float32
    torch.testing.assert_close(source, golden["source"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(wav, golden["wav"], atol=ATOL, rtol=RTOL)
    assert wav.abs().max() <= 0.99


@torch.no_grad()
def test_decode_with_given_source_matches_reference(hift, golden):
    wav, source = hift(golden["mel"], source=golden["source"])
    assert source is golden["source"]
    torch.testing.assert_close(wav, golden["wav_from_decode"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(hift.decode(golden["mel"], golden["source"]), golden["wav_from_decode"])


@pytest.mark.parametrize("fixture", ["token2wav_stream", "token2wav_stream_alt"])
@torch.no_grad()
def test_streaming_calls_match_reference(hift, fixture):
    stream = load_file(COSYVOICE3_GOLDEN / f"{fixture}.safetensors")
    chunks = json.loads((COSYVOICE3_GOLDEN / "manifest.json").read_text())["files"][f"{fixture}.safetensors"]["chunks"]
    assert any(not chunk["hift_finalize"] for chunk in chunks)
    for chunk in chunks:
        name, finalize = f"chunk{chunk['chunk']}", chunk["hift_finalize"]
        mel = stream[f"{name}.hift_input_mel"]
        assert_f0_close(hift.predict_f0(mel, finalize=finalize), stream[f"{name}.f0"])
        wav, source = hift(mel, finalize=finalize)
        torch.testing.assert_close(source, stream[f"{name}.source"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(wav, stream[f"{name}.hift_speech"], atol=ATOL, rtol=RTOL)
        expected_samples = 480 * (mel.shape[-1] if finalize else mel.shape[-1] - 8)
        assert wav.shape == (1, expected_samples)


def legacy_format(state_dict: dict) -> dict:
    """Same checkpoint with the pre-2.1 `weight_norm` names and the `generator.` prefix of the real hift.pt."""
    renamed = {}
    for key, value in state_dict.items():
        key = key.replace(".parametrizations.weight.original0", ".weight_g")
        key = key.replace(".parametrizations.weight.original1", ".weight_v")
        renamed[f"generator.{key}"] = value
    return renamed


@torch.no_grad()
def test_weight_norm_formats_load_identically(hift, golden):
    original = original_state_dict()
    legacy = legacy_format(original)
    assert any(key.endswith(".weight_g") for key in legacy)
    from_legacy = build_hift(legacy)
    # Our own (folded) state dict also loads through the same entry point.
    from_plain = build_hift(dict(hift.state_dict()))
    mel = golden["mel"][..., :30]
    expected, _ = hift(mel)
    for other in (from_legacy, from_plain):
        for key, value in hift.state_dict().items():
            assert torch.equal(other.state_dict()[key], value), key
        assert torch.equal(other(mel)[0], expected)


def test_state_dict_is_folded_except_f0_predictor(hift):
    keys = set(hift.state_dict())
    assert "conv_pre.weight" in keys and "resblocks.0.convs1.0.weight" in keys
    assert not any("parametrizations" in key for key in keys)
    assert all(key.startswith("f0_predictor.") for key in keys if key.endswith(("weight_g", "weight_v")))
    # The F0 predictor keeps g/v: the reference evaluates its weight norm in float64.
    assert "f0_predictor.condnet.0.weight_g" in keys and "f0_predictor.condnet.8.weight_v" in keys
    assert "m_source.l_sin_gen.sine_waves" not in keys  # fixed tables are not checkpoint data
    assert len(keys) == 328 - 82 + 5  # 82 weight-norm pairs -> 77 folded weights + 5 kept pairs


def test_loading_rejects_missing_and_unexpected_keys():
    hift = CosyVoice3HiFTGenerator(**hift_kwargs_from_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml"))
    state_dict = original_state_dict()
    del state_dict["conv_post.bias"]
    state_dict["conv_post.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"conv_post\.bias.*conv_post\.extra"):
        hift.load_original_state_dict(state_dict)
    state_dict = original_state_dict()
    del state_dict["ups.1.parametrizations.weight.original0"]
    with pytest.raises(ValueError, match=r"ups\.1.*magnitude"):
        hift.load_original_state_dict(state_dict)
    full_size = CosyVoice3HiFTGenerator()
    with pytest.raises(ValueError, match="shape mismatch"):
        full_size.load_original_state_dict(original_state_dict())


@torch.no_grad()
def test_batch_rows_are_independent(hift, golden):
    mel = golden["mel"][..., :40]
    other = golden["mel"][..., 100:140]
    batch = torch.cat([mel, other])
    for finalize in (True, False):
        wav, source = hift(batch, finalize=finalize)
        for row, single in enumerate((mel, other)):
            single_wav, single_source = hift(single, finalize=finalize)
            # Not bit-identical: the conv kernels block a batch of 2 differently (~5e-6); a leak would be O(0.1).
            torch.testing.assert_close(wav[row : row + 1], single_wav, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(source[row : row + 1], single_source, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(wav[0], wav[1])


@torch.no_grad()
def test_zero_padded_row_matches_single_row_except_last_samples(hift, golden):
    short = golden["mel"][..., :30]
    padded = torch.cat([torch.nn.functional.pad(short, (0, 12)), golden["mel"][..., 50:92]])
    single, _ = hift(short)
    batch, _ = hift(padded)
    trimmed = batch[:1, : single.shape[1]]
    # Documented: all but the last n_fft * hop_len samples, which see the STFT/iSTFT edge of the true signal end.
    torch.testing.assert_close(trimmed[:, :-64], single[:, :-64], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(trimmed, single, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_non_final_call_is_prefix_of_final_call(hift, golden):
    mel = golden["mel"]
    final, _ = hift(mel[..., :60])
    partial, _ = hift(mel[..., :40], finalize=False)
    torch.testing.assert_close(partial, final[:, : partial.shape[1]], atol=1e-6, rtol=1e-6)


def test_bad_inputs_raise_clear_errors(hift, golden):
    with pytest.raises(ValueError, match="mel must be"):
        hift(golden["mel"][0])
    with pytest.raises(ValueError, match="mel must be"):
        hift(torch.zeros(1, 79, 20))
    with pytest.raises(ValueError, match="needs at least 9"):
        hift(golden["mel"][..., :8], finalize=False)
    with pytest.raises(ValueError, match="source must be"):
        hift(golden["mel"][..., :10], source=golden["source"][..., :480])
    with pytest.raises(ValueError, match="noise table holds"):
        hift.source_from_f0(torch.zeros(1, TABLE_SAMPLES // 480 + 1))
    fresh = CosyVoice3HiFTGenerator(**hift_kwargs_from_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml"))
    with pytest.raises(ValueError, match="init_source_tables"):
        fresh(golden["mel"][..., :10])
    with pytest.raises(ValueError, match="upsample_kernel_sizes"):
        CosyVoice3HiFTGenerator(upsample_rates=[8, 5], upsample_kernel_sizes=[16, 11, 7])


def test_full_size_defaults_match_spec_parameter_count():
    with torch.device("meta"):
        full_size = CosyVoice3HiFTGenerator()
    # Spec 2.2: 20,779,887 numbers in hift.pt, 20,765,597 once all 14,290 weight-norm g numbers are folded; the F0
    # predictor keeps its 5 g vectors (5 * 512).
    assert sum(p.numel() for p in full_size.parameters()) == 20_765_597 + 5 * 512


@torch.no_grad()
def test_decode_compiles_fullgraph(golden):
    # A reduced config (one resblock kernel, one dilation) keeps compile time low; every code path is still there.
    kwargs = hift_kwargs_from_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml")
    kwargs.update(resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1]], source_resblock_dilation_sizes=[[1]] * 3)
    hift = CosyVoice3HiFTGenerator(**kwargs).eval()
    mel, source = golden["mel"][..., :20], golden["source"][..., : 20 * 480]
    compiled = torch.compile(hift.decode, fullgraph=True, backend="aot_eager")
    # The non-final path (look-ahead context, trimmed STFT and tail) is the superset; one compile keeps this test short.
    torch.testing.assert_close(compiled(mel, source, False), hift.decode(mel, source, False))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_conv1d_as_matmul_equals_the_convolution(dtype):
    """The F0 predictor's convs run as one GEMM (cuDNN has no fast float64 convolution)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 9, generator=generator, dtype=dtype)
    weight = torch.randn(7, 12, 3, generator=generator, dtype=dtype)
    bias = torch.randn(7, generator=generator, dtype=dtype)
    out = conv1d_as_matmul(hidden, weight, bias)
    assert out.shape == (2, 7, 7)
    torch.testing.assert_close(out, torch.nn.functional.conv1d(hidden, weight, bias))
    # a strided (transposed) input, as the previous conv's output arrives
    strided = hidden.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(conv1d_as_matmul(strided, weight, bias), out)


def _filter_inputs(hift, frames, seed=0):
    """Random (conv_pre output, source STFT) of `frames` mel frames for `filter_body`."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, hift.conv_pre.out_channels, frames, generator=generator)
    source_stft = torch.randn(1, hift.n_fft + 2, hift.stft_frames_per_mel_frame * frames + 1, generator=generator)
    return hidden, source_stft


def _captured_filter_inputs(hift, mel, source):
    """The (conv_pre output, source STFT) that `hift.decode(mel, source)` passes to `filter_body`."""
    captured = []
    hift.filter_body = lambda *args: captured.append(args) or type(hift).filter_body(hift, *args)
    try:
        hift.decode(mel, source)
    finally:
        del hift.filter_body
    return captured[0]


@torch.no_grad()
def test_channels_last_convolutions_match_the_default_layout(golden):
    hift = build_hift()
    mel, source = golden["mel"][..., :60], golden["source"][..., : 60 * 480]
    filter_inputs = _captured_filter_inputs(hift, mel, source)
    default_filter = hift.filter_body(*filter_inputs)
    default_decode = hift.decode(mel, source)
    default_stream, _ = hift(mel, finalize=False)
    state = {key: value.clone() for key, value in hift.state_dict().items()}

    hift.use_channels_last_convolutions()
    assert hift.channels_last_convolutions
    convs = hift.filter_convolutions()
    assert len(convs) == 79 and hift.conv_pre not in convs  # 3 ups + 3 source downs + 12 x 6 resblock convs + post
    # Tiny HiFT: channels 32 -> 16, 8, 4 per stage; the last stage (4 channels), the 18-channel source_downs and
    # conv_post keep the default layout: 2 ups + 2 x 6 source resblock convs + 2 x 18 resblock convs remain.
    eligible = hift.filter_convolutions(channels_last_only=True)
    assert len(eligible) == 50
    assert not any(conv in eligible for conv in [*hift.source_downs, hift.conv_post, hift.ups[2]])
    for conv in convs:
        if conv not in eligible:
            assert conv.weight.is_contiguous()
        elif conv.kernel_size[0] > 1:  # a k=1 weight is both layouts at once
            assert not conv.weight.is_contiguous()
            assert conv.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)
    assert hift.conv_pre.weight.is_contiguous()

    filtered = hift.filter_body(*filter_inputs)
    assert filtered.is_contiguous()  # conv_post (4 -> 18 channels) runs in the default layout
    # Float rounding only (oneDNN sums NHWC in another order): ~3e-6 of the output's scale (log-magnitudes ~6).
    assert (filtered - default_filter).abs().max() <= 1e-5 * default_filter.abs().max()
    torch.testing.assert_close(hift.decode(mel, source), default_decode, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hift(mel, finalize=False)[0], default_stream, atol=1e-5, rtol=1e-5)
    # Same state dict (keys, shapes, values); only the filter weights' strides differ.
    restrided = hift.state_dict()
    assert restrided.keys() == state.keys()
    assert all(torch.equal(restrided[key], value) for key, value in state.items())

    hift.use_channels_last_convolutions(False)
    assert not hift.channels_last_convolutions and all(conv.weight.is_contiguous() for conv in convs)
    torch.testing.assert_close(hift.filter_body(*filter_inputs), default_filter, atol=0, rtol=0)


@pytest.mark.parametrize("base_channels", [None, 64], ids=["tiny", "aligned"])
@torch.no_grad()
def test_channels_last_convolutions_keep_every_eligible_conv_output_channels_last(base_channels):
    """Checkable on the CPU: oneDNN picks its memory format by the same rule as cuDNN (channels-last if the input
    or the weight is), so every filter conv sees a (batch, channels, 1, frames) input and returns it channels-last
    (NHWC, H = 1), and the state dict still loads into the re-strided model without changing its layout.
    Exception: convs with an in- or out-channel count that is not a multiple of 8 (always the 18-channel
    source_downs and conv_post; in the tiny HiFT also its 4-channel last stage) return a contiguous output."""
    if base_channels is None:
        hift = build_hift()
    else:  # channels 32, 16, 8 per stage: only the 18-channel convs are left out, as in the released HiFT
        kwargs = hift_kwargs_from_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml")
        hift = CosyVoice3HiFTGenerator(**dict(kwargs, base_channels=base_channels)).eval()
    state = hift.state_dict()
    hift.use_channels_last_convolutions()
    hift.load_state_dict(state)
    outputs = []
    for conv in hift.filter_convolutions():
        conv.register_forward_hook(lambda module, args, output: outputs.append((module, args[0], output)))
    hift.filter_body(*_filter_inputs(hift, 12))
    assert len(outputs) == 79
    eligible = hift.filter_convolutions(channels_last_only=True)
    default_layout = {module for module, _, _ in outputs if module not in eligible}
    assert {*hift.source_downs, hift.conv_post} <= default_layout
    assert len(default_layout) == (4 if base_channels else 29)
    for module, hidden, output in outputs:
        assert hidden.dim() == 4 and output.dim() == 4 and output.shape[2] == 1
        if module in default_layout:
            assert output.is_contiguous() and module.weight.is_contiguous(), module
            continue
        assert output.is_contiguous(memory_format=torch.channels_last), module
        if module.kernel_size[0] > 1:
            assert module.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)


@torch.no_grad()
def test_channels_last_filter_compiles_without_layout_copies():
    """Inductor, dynamic shapes, layout optimisation off (as on CUDA, where Inductor turns it off for symbolic
    shapes), channels 32/16/8 per stage (only the 18-channel convs keep the default layout, as in the released
    HiFT), resblock convs with dilation 3: every 4-D buffer an eligible conv reads or writes is channels-last, the
    layout switches around the 18-channel convs are written by element-wise kernels that exist anyway (no extra
    copy kernel), the dilated convs run undilated over the (frames / 3, 3) view of their input and the upsampling
    convs at the input rate (polyphase) without a copy, and the weights are passed as they are (no copy kernel)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    kwargs = hift_kwargs_from_yaml(COSYVOICE3_TINY / "cosyvoice3.yaml")
    kwargs.update(resblock_kernel_sizes=[3], resblock_dilation_sizes=[[3]], source_resblock_dilation_sizes=[[1]] * 3)
    kwargs.update(base_channels=64)
    hift = CosyVoice3HiFTGenerator(**kwargs).eval()
    inputs = _filter_inputs(hift, 12)
    expected = hift.filter_body(*inputs)

    def compile_and_run():
        torch._dynamo.reset()
        try:
            with inductor_config.patch(layout_optimization=False):
                compiled = torch.compile(hift.filter_body, dynamic=True, fullgraph=True)
                out, codes = run_and_get_code(compiled, *inputs)
        finally:
            torch._dynamo.reset()
        code = "\n".join(codes)
        return out, code, len(re.findall(r"^\s+(?:cpp_fused_\w+|\w+\.run)\(", code, flags=re.M))  # kernel launches

    _, default_code, default_kernels = compile_and_run()
    hift.use_channels_last_convolutions()
    out, code, kernels = compile_and_run()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert out.is_contiguous()  # conv_post (8 -> 18 channels) keeps the default layout
    convs = re.findall(r"extern_kernels\.convolution\((.*)\)", code)
    assert len(convs) == len(hift.filter_convolutions()) == 19
    eligible = hift.filter_convolutions(channels_last_only=True)
    assert len(eligible) == 15 and not any(conv in eligible for conv in [*hift.source_downs, hift.conv_post])
    # No more element-wise kernels than with the default layout: the layout switches are fused.
    assert kernels <= default_kernels, (kernels, default_kernels)
    assert 0 < kernels and 0 < default_kernels
    # 4-D buffers: (batch, channels, 1, frames) with the channel stride 1 (the 18-channel convs run as 3-D calls).
    buffers = re.findall(r"empty_strided_\w+\(\(([^()]*)\), \(([^()]*)\)", code)
    four_d = [(size, stride) for size, stride in buffers if size.count(",") == 3]
    assert four_d and all(stride.split(", ")[1] == "1" for _, stride in four_d), four_d
    assert sum(bool(re.search(r"stride=\(\d+,\)", call)) for call in convs) == 4  # 3-D: source_downs, conv_post
    default_convs = re.findall(r"extern_kernels\.convolution\((.*)\)", default_code)
    assert sum("dilation=(3," in call for call in default_convs) == 3  # one resblock conv per stage
    assert not any("dilation=(1, 3)" in call or "dilation=(3," in call for call in convs)
    # Weights reach the conv as the parameters or views of them (arg*), never as freshly copied buffers.
    assert all(re.match(r"\w+, (reinterpret_tensor\()?arg\d+_1\b", call) for call in convs), convs[:3]


@pytest.mark.parametrize(("kernel", "rate"), [(16, 8), (11, 5), (7, 3), (4, 4), (3, 5)])
@torch.no_grad()
def test_channels_last_upsampling_runs_polyphase_at_the_input_rate(kernel, rate):
    """The channels-last path of `CausalConv1dUpsample` (one conv with `rate` x the output channels over the
    un-held input, its output memory read as the interleaved signal) equals hold + causal conv (float64: exact up to
    the order of the sums), for kernels longer and shorter than the rate; `load_state_dict` refreshes the polyphase
    copy; without one, or when a gradient is needed, the held signal is convolved as before."""
    upsample = CausalConv1dUpsample(16, 8, kernel, rate).double()
    hidden = torch.randn(2, 16, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = upsample(hidden)
    channels_last = hidden.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    weights = []
    conv2d = torch.nn.functional.conv2d
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "conv2d", lambda *args: weights.append(args[1].shape) or conv2d(*args))
        torch.testing.assert_close(upsample(channels_last).squeeze(2), expected)  # no copy stored: the held signal
        upsample.store_polyphase_weight()
        with torch.enable_grad():  # training: the path through `weight`
            assert upsample(channels_last).requires_grad
        assert weights == [(8, 16, 1, kernel)] * 2
        upsample(channels_last)
    assert weights[-1][0] == rate * 8
    taps = -(-(kernel - 1) // rate) + 1
    assert upsample.polyphase.shape == (rate * 8, 16, taps)
    got = upsample(channels_last)
    assert got.shape == (2, 8, 1, 13 * rate) and got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got.squeeze(2), expected, atol=1e-12, rtol=1e-12)
    other = CausalConv1dUpsample(16, 8, kernel, rate).double()
    upsample.load_state_dict(other.state_dict())  # new weights: a new polyphase copy
    torch.testing.assert_close(upsample(channels_last).squeeze(2), other(hidden), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(("dilation", "kernel", "frames"), [(3, 3, 20), (5, 3, 21), (2, 5, 9), (3, 7, 30), (5, 3, 5)])
@torch.no_grad()
def test_channels_last_dilated_convs_run_undilated_over_a_frame_grid(dilation, kernel, frames):
    """A dilated channels-last conv runs as a (kernel, 1) conv without dilation over the (frames / d, d) view of its
    input (right-padded to a whole row): the same values (float64), a channels-last output."""
    conv = CausalConv1d(8, 16, kernel, dilation=dilation).double()
    hidden = torch.randn(2, 8, frames, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = conv(hidden)
    conv.weight.data = conv.weight.data.transpose(1, 2).contiguous().transpose(1, 2)  # as the filter stores it
    calls = []
    original_conv2d = torch.nn.functional.conv2d
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "conv2d", lambda *args: calls.append(args) or original_conv2d(*args))
        got = conv(hidden.unsqueeze(2).contiguous(memory_format=torch.channels_last))
    assert len(calls) == 1 and calls[0][1].shape == (16, 8, kernel, 1) and len(calls[0]) == 3  # no dilation argument
    assert got.shape == (2, 16, 1, frames)
    torch.testing.assert_close(got.squeeze(2), expected, atol=1e-12, rtol=1e-12)


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_channels_last_filter_matches_the_default_layout_at_full_size():
    """Released channel counts (512 -> 256 / 128 / 64) on CUDA: the channels-last filter (polyphase upsampling,
    undilated grid convs, cuDNN NHWC kernels) against the default layout, both in float32 with TF32 convs."""
    hift = CosyVoice3HiFTGenerator().cuda().eval()
    inputs = [tensor.cuda() for tensor in _filter_inputs(hift, 23)]
    expected = hift.filter_body(*inputs)
    hift.use_channels_last_convolutions()
    got = hift.filter_body(*inputs)
    assert (got - expected).abs().max() <= 1e-3 * expected.abs().max()


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_graph_of_the_filter_runs_its_independent_parts_as_branches(channels_last):
    """Recorded into a CUDA graph (as a streamed chunk's vocoder is), the filter queues each stage's source term and
    its resblocks but the first on branch streams (so does the warm-up run before the recording); the replays give the
    eager filter's output for new inputs each time (full-size channels), and other calls use no branch."""
    from funaudiochat_hf.cuda_graph_capture import capture_branches
    from funaudiochat_hf.cuda_graph_cosyvoice3 import CUDAGraphRunner

    hift = CosyVoice3HiFTGenerator().cuda().eval()
    hift.use_channels_last_convolutions(channels_last)
    queued = []
    original = hift._source_term
    hift._source_term = lambda stage, stft: queued.append(torch.cuda.current_stream()) or original(stage, stft)
    runner = CUDAGraphRunner(hift.filter_body)
    main = torch.cuda.current_stream()
    for seed in range(3):
        inputs = [tensor.cuda() for tensor in _filter_inputs(hift, 40, seed)]
        queued.clear()
        expected = hift.filter_body(*inputs)
        assert queued == [main] * 3  # eager: no branches
        queued.clear()
        replayed = runner(*inputs)
        if seed == 0:  # the warm-up run before the recording, then the recording: both on one branch stream
            assert len(queued) == 6 and len(set(queued)) == 1 and queued[0] != main
        else:  # replayed
            assert queued == []
        torch.testing.assert_close(replayed, expected, atol=1e-5, rtol=1e-5)
    assert len(runner) == 1
    branch_streams = capture_branches(torch.zeros(1, device="cuda"), hift.num_kernels)
    assert branch_streams is None  # not recording now


def test_f0_predictor_keeps_its_float64_weights_between_inference_calls(golden):
    """The F0 predictor's float64 weights (cast + weight norm, ~22 kernels per call) are computed once while the
    parameters are unchanged and no gradient is needed; an in-place update or a gradient-enabled call recomputes
    them, and the f0 is the same either way."""
    hift = build_hift()
    mel = golden["mel"][..., :40]
    norms = []
    weight_norm = torch._weight_norm
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_weight_norm", lambda *args: norms.append(1) or weight_norm(*args))
        with torch.no_grad():
            first = hift.predict_f0(mel)
            assert len(norms) == 5
            torch.testing.assert_close(hift.predict_f0(mel), first, atol=0, rtol=0)
            assert len(norms) == 5  # cached
            conv = hift.f0_predictor.condnet[2]
            conv.weight_g.mul_(2)  # in place: seen
            changed = hift.predict_f0(mel)
            assert len(norms) == 6 and not torch.equal(changed, first)
            conv.weight_g.div_(2)
            torch.testing.assert_close(hift.predict_f0(mel), first)
        trained = hift.predict_f0(mel)  # gradients enabled: computed in the graph, never cached
        assert trained.requires_grad and len(norms) == 7 + 5
        trained.sum().backward()
        assert conv.weight_v.grad is not None
