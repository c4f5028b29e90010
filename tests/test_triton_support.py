"""Where the package's Triton kernels run (`triton_support`): Triton installed and a GPU of compute capability 8.0 or
newer. On an older GPU (a T4, a V100) every decoder dispatcher takes its PyTorch path instead of failing to compile a
bfloat16 kernel. CPU-only: CUDA tensors are fake (`FakeTensorMode`) and the GPU's capability is patched."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from funaudiochat_hf import (
    adaln_cosyvoice3,
    attention_cosyvoice3,
    istft_cosyvoice3,
    position_conv_cosyvoice3,
    snake_cosyvoice3,
    source_merge_cosyvoice3,
    triton_support,
)


@pytest.fixture
def gpu(monkeypatch):
    """Pretend Triton is installed and CUDA present; returns a setter of the GPU's compute capability."""
    monkeypatch.setattr(triton_support, "triton", object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def set_capability(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return set_capability


def _dispatcher_inputs():
    """For each decoder dispatcher, a call of its check on fake CUDA inputs the kernel takes."""
    with FakeTensorMode(), torch.no_grad():
        bf16 = {"device": "cuda", "dtype": torch.bfloat16}
        hidden, modulation = torch.empty(2, 7, 48, **bf16), torch.empty(2, 1, 48, **bf16)
        query = torch.empty(2, 136, 4 * 64, **bf16)
        cos = torch.empty(136, 64, device="cuda")
        snake_hidden, alpha = torch.empty(1, 8, 30, device="cuda"), torch.empty(8, device="cuda")
        samples = torch.empty(1, 480, device="cuda")
        conv_hidden = torch.empty(2, 30, 16, **bf16)
    conv = nn.Conv1d(16, 16, 5, groups=4).requires_grad_(False)
    return {
        "adaln": lambda: adaln_cosyvoice3._kernel_applies(hidden, hidden, modulation, modulation, modulation),
        "dit_attention": lambda: attention_cosyvoice3._kernel_applies(query, query, query, cos, 4, None),
        "snake": lambda: snake_cosyvoice3._kernel_applies(snake_hidden, alpha),
        "istft": lambda: istft_cosyvoice3.float32_kernel_applies(samples, samples),
        "source_merge": lambda: source_merge_cosyvoice3._kernel_applies(samples),
        "position_conv": lambda: position_conv_cosyvoice3._kernel_applies(conv_hidden, conv, None),
    }


@pytest.mark.parametrize("name", sorted(_dispatcher_inputs()))
def test_decoder_kernels_run_from_compute_capability_8_and_fall_back_below(gpu, name):
    check = _dispatcher_inputs()[name]
    gpu((9, 0))
    assert check()
    gpu((8, 0))
    assert check()
    gpu((7, 5))  # a T4: no bfloat16 tensor cores, not a GPU Triton supports
    assert not check()


def test_kernels_run_on_needs_triton_and_a_cuda_tensor(gpu, monkeypatch):
    gpu((9, 0))
    with FakeTensorMode():
        cuda = torch.empty(2, device="cuda")
    assert triton_support.kernels_run_on(cuda)
    assert not triton_support.kernels_run_on(torch.empty(2))
    monkeypatch.setattr(triton_support, "triton", None)
    assert not triton_support.kernels_run_on(cuda)


def test_triton_available_needs_triton_and_a_recent_gpu(gpu, monkeypatch):
    gpu((7, 0))  # a V100: no bfloat16 tl.dot
    assert not triton_support.triton_available("cuda") and not triton_support.triton_available("cpu")
    gpu((9, 0))
    assert triton_support.triton_available("cuda:0") and not triton_support.triton_available("cpu")
    monkeypatch.setattr(triton_support, "triton", None)
    assert not triton_support.triton_available("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not triton_support.capable_gpu("cuda")
