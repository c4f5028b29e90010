"""Shared fixtures: paths to the golden data copied from the reference implementations (see fixtures/MANIFEST.md)."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


FIXTURES = Path(__file__).parent / "fixtures"
FUNAUDIOCHAT_TINY = FIXTURES / "funaudiochat_tiny"
FUNAUDIOCHAT_GOLDEN = FIXTURES / "funaudiochat_golden"
COSYVOICE3_TINY = FIXTURES / "cosyvoice3_tiny"
COSYVOICE3_GOLDEN = FIXTURES / "cosyvoice3_golden"
SRC = Path(__file__).resolve().parents[1] / "src"


# Run first in every interpreter script. Triton 3.6's interpreter turns a runtime int into a one-element array, which
# numpy >= 2.4 no longer converts with int(): patch its `__index__` so that a loop bound taken from a kernel argument
# works (compiled kernels are unaffected).
_INTERPRETER_PATCH = """
import triton.runtime.interpreter as interpreter
_patch = interpreter._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patch_lang_tensor
"""


# The reference's log-mel features are float32 torch CPU arithmetic (an FFT, a matmul, a log): another CPU's kernels
# round them differently. On an AVX-512 Xeon (2026-12-03) they differ from the golden features by up to 1.8e-5 where
# other machines matched them exactly; the token ids and masks stay exact.
FEATURES_ATOL = 1e-4


def assert_close_to_golden_features(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Log-mel features `(batch, 128, frames)` against the reference's: same shape and dtype, within FEATURES_ATOL."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=FEATURES_ATOL, rtol=0)


def load_module(path: Path, name: str):
    """The Python file at `path` (a script, the demo app) imported as a module called `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class HostReads(TorchDispatchMode):
    """Records (`found`) the ops dispatched while `active()` is true whose result or work depends on a device value
    that the host must read, a sync on a GPU (and an error in a CUDA graph capture): `.item()`, nonzero, boolean
    indexing, masked_select, unique, repeat_interleave, equal, and `masked_fill` with a tensor fill value (CUDA reads it
    with `.item()`)."""

    OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave", "equal"}

    def __init__(self, active):
        super().__init__()
        self.active, self.found = active, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active():
            name = func.overloadpacket.__name__
            tensor_fill = name.startswith("masked_fill") and isinstance(args[2], torch.Tensor)
            indices = args[1] if name == "index" and len(args) > 1 else ()
            bool_index = any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices)
            if name in self.OPS or tensor_fill or bool_index:
                self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def run_in_triton_interpreter(script: str, timeout: int = 900) -> str:
    """Run a Python `script` under Triton's CPU interpreter and return its last stdout line; skips without Triton.

    A subprocess, because `TRITON_INTERPRET=1` must be set before the kernels are defined; the package sources and the
    tests folder are importable in it."""
    pytest.importorskip("triton")
    path = os.pathsep.join([str(SRC), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    source = _INTERPRETER_PATCH + textwrap.dedent(script)
    result = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def force_recorded_prompt_pass(monkeypatch) -> None:
    """Every plan with the CUDA backends' recorded prompt pass (`plan.prefill_graph`: prompts left-padded to a bucket,
    fixed buffers, prepared masks), run here without the recording."""
    import dataclasses

    from funaudiochat_hf.generation_state_funaudiochat import SpeechGenerator

    plan = SpeechGenerator.plan
    monkeypatch.setattr(SpeechGenerator, "plan", lambda *a, **k: dataclasses.replace(plan(*a, **k), prefill_graph=True))


def record_streaming_shapes(monkeypatch, decoder) -> set:
    """Spy on the streaming decoders' graphed calls of `decoder` as a batched round makes them: the set returned
    collects ("flow", tokens shape) of every flow call and ("hift", mel shape, source shape) of every non-final HiFT
    call (a reply's last HiFT call runs eagerly, without a graph). Rounds are padded to `GRAPH_BATCH_SIZES` as under
    CUDA graphs."""
    from funaudiochat_hf import streaming_batch_cosyvoice3, streaming_cosyvoice3

    sizes = streaming_batch_cosyvoice3.GRAPH_BATCH_SIZES
    monkeypatch.setattr(streaming_batch_cosyvoice3, "_batch_sizes", lambda batch_sizes, fixed_shapes: sizes)
    shapes = set()
    for module in (streaming_batch_cosyvoice3, streaming_cosyvoice3):
        flow = module.flow_window_to_mel
        monkeypatch.setattr(module, "flow_window_to_mel", lambda *args, flow=flow: shapes.add(
            ("flow", tuple(args[1].shape))) or flow(*args))  # fmt: skip
    hift = decoder.hift.decode

    def hift_spy(mel, source, finalize):
        if not finalize:
            shapes.add(("hift", tuple(mel.shape), tuple(source.shape)))
        return hift(mel, source, finalize=finalize)

    monkeypatch.setattr(decoder.hift, "decode", hift_spy)
    return shapes


def tiny_decoder_with_and_without(monkeypatch, module) -> dict:
    """The tiny CosyVoice3 decoder on CUDA with a bf16 estimator, with the Triton kernel of `module` where it applies
    (`module._kernel_applies`) and with the torch path everywhere (that test replaced by False): `{True: (mel,
    streamed audio), False: (...)}` for the golden tokens, offline `tokens_to_mel` and a stream of 15-token pushes
    (eager launches)."""
    from safetensors.torch import load_file

    from funaudiochat_hf import CosyVoice3Token2Wav

    model = CosyVoice3Token2Wav.from_original(COSYVOICE3_TINY).cuda().eval()
    model.use_low_precision_estimator("bfloat16")
    golden = load_file(COSYVOICE3_GOLDEN / "flow_full.safetensors")
    tokens, speaker = golden["speech_token"].cuda(), golden["embedding"].cuda()
    results = {}
    kernel_applies = module._kernel_applies
    for use_kernel in (True, False):
        monkeypatch.setattr(module, "_kernel_applies", kernel_applies if use_kernel else lambda *args: False)
        with torch.no_grad():
            mel = model.tokens_to_mel(tokens, speaker)
            stream = model.streaming_decoder(speaker_embedding=speaker, token_hop_len=15, cuda_graphs=False)
            pieces = [stream.push(tokens[0, i : i + 15]) for i in range(0, tokens.shape[1], 15)]
            results[use_kernel] = mel, torch.cat(pieces + [stream.finalize()])
    return results


def hopper_ptx(
    kernel, constexprs: dict, types: dict, num_warps: int = 4, divisible: tuple = (), options: dict | None = None
) -> str:
    """PTX of a Triton kernel compiled for an H100 / H200 (sm_90, no GPU needed) as a programmatic dependent launch.

    `constexprs`: the values of its `tl.constexpr` parameters (and of integers a launch specialises, such as a unit
    stride); `types`: the Triton type of its pointer (e.g. `"*bf16"`, taken as 16-byte aligned, as Triton specialises
    launches on torch's allocations) and float parameters; the other parameters are 32-bit integers, those named in
    `divisible` multiples of 16 (as Triton specialises them when they are); `options`: more compile options (they
    replace `num_warps` and the programmatic launch where they name them)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if signature[name][0] == "*" or (name in divisible and signature[name] == "i32")
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": num_warps, "launch_pdl": True, **(options or {})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def assert_waits_before_reading(ptx: str, pdl: bool) -> None:
    """A kernel's PTX as a programmatic dependent launch (`pdl`) waits for the previous kernel before its first global
    load and lets the next one launch; compiled without PDL, it has neither instruction."""
    lines = ptx.splitlines()
    control = [i for i, line in enumerate(lines) if "griddepcontrol" in line]
    if not pdl:
        assert not control
        return
    first_load = next(i for i, line in enumerate(lines) if "ld.global" in line)
    assert "griddepcontrol.wait" in lines[control[0]] and control[0] < first_load
    assert any("griddepcontrol.launch_dependents" in lines[i] for i in control)


# The README's test command runs in a venv with torch's CPU wheel, which brings no Triton: tests that need the package
# (its compiler, its interpreter, or host helpers such as `triton.cdiv`) are marked `triton` and skip there, before
# their body (or a parameter) reads a kernel that is only defined with Triton installed.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_triton = pytest.mark.skip(reason="needs the triton package")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if item.get_closest_marker("triton") is not None and not TRITON_INSTALLED:
            item.add_marker(skip_triton)


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    # The golden fixtures were made with one thread, and on the shared 2-core CI machine tiny ops are far faster on one
    # thread than with two threads fighting over it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo():
    # Compiled graphs of one test module must not count against the recompile limits of the next one, so the suite
    # passes in any order.
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# -- the tiny chat model and its golden processor outputs, shared by the chat-model test modules (one per module) ----


@pytest.fixture(scope="module")
def model():
    """The tiny random-weight Fun-Audio-Chat checkpoint (official layout), float32, eval mode."""
    from transformers import AutoModel

    import funaudiochat_hf  # noqa: F401  (registers the Auto classes)

    return AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def inputs():
    """The stored processor outputs of golden fixture (a): one 2.45 s clip in the S2S chat prompt."""
    from safetensors.torch import load_file

    data = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")
    data.pop("waveform_16k")
    return data


def assert_batch_rows_equal_single_runs(model, inputs, kwargs: dict, audio_token: int = 346, pad: int = 320) -> None:
    """`generate_speech(**kwargs)` on a left-padded batch (the golden prompt with its audio, and its last 40 text ids)
    gives each row the tokens and speech of that prompt run alone."""
    long_ids = inputs["input_ids"]
    ids = long_ids[0][long_ids[0] != audio_token]
    short_ids = ids[-40:][None]
    batch_ids = torch.full((2, long_ids.shape[1]), pad)
    batch_ids[0] = long_ids[0]
    batch_ids[1, -40:] = short_ids[0]
    mask = torch.ones_like(batch_ids)
    mask[1, :-40] = 0
    audio = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}

    batch = model.generate_speech(batch_ids, mask, **audio, **kwargs)
    singles = [model.generate_speech(long_ids, **audio, **kwargs), model.generate_speech(short_ids, **kwargs)]
    for row, (single, prompt_len) in enumerate(zip(singles, (long_ids.shape[1], 40))):
        new = single.sequences[0, prompt_len:]
        assert torch.equal(batch.sequences[row, long_ids.shape[1] : long_ids.shape[1] + len(new)], new)
        groups = single.speech_ids.shape[1]
        assert torch.equal(batch.speech_ids[row, :groups], single.speech_ids[0])
