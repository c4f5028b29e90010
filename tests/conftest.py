"""Shared fixtures: paths to the golden data copied from the reference implementations (see fixtures/MANIFEST.md)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch


FIXTURES = Path(__file__).parent / "fixtures"
FUNAUDIOCHAT_TINY = FIXTURES / "funaudiochat_tiny"
FUNAUDIOCHAT_GOLDEN = FIXTURES / "funaudiochat_golden"
COSYVOICE3_TINY = FIXTURES / "cosyvoice3_tiny"
COSYVOICE3_GOLDEN = FIXTURES / "cosyvoice3_golden"
SRC = Path(__file__).resolve().parents[1] / "src"


def run_in_triton_interpreter(script: str, timeout: int = 900) -> str:
    """Run a Python `script` under Triton's CPU interpreter and return its last stdout line; skips without Triton.

    A subprocess, because `TRITON_INTERPRET=1` must be set before the kernels are defined; the package sources and the
    tests folder are importable in it."""
    pytest.importorskip("triton")
    path = os.pathsep.join([str(SRC), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def hopper_ptx(kernel, constexprs: dict, types: dict, num_warps: int = 4) -> str:
    """PTX of a Triton kernel compiled for an H100 / H200 (sm_90, no GPU needed) as a programmatic dependent launch.

    `constexprs`: the values of its `tl.constexpr` parameters; `types`: the Triton type of its pointer (e.g. `"*bf16"`,
    taken as 16-byte aligned, as Triton specialises launches on torch's allocations) and float parameters; the other
    parameters are 32-bit integers."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if signature[name][0] == "*"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": num_warps, "launch_pdl": True}
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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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
