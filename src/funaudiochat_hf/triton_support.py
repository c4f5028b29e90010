"""Where the package's Triton kernels run: the optional `triton` import and the device check of every dispatcher.

The kernels need Triton and an NVIDIA GPU of compute capability 8.0 or newer (`MIN_CAPABILITY`): their 16-bit
`tl.dot`s and bfloat16 conversions need the bfloat16 tensor cores of those GPUs, which are also the ones Triton
supports. On an older GPU (a T4, a V100) every dispatcher takes its PyTorch path, and the decode plan says so.
"""

import torch


try:
    import triton
except ImportError:  # CPU-only installs: every dispatcher takes its PyTorch path.
    triton = None


MIN_CAPABILITY = (8, 0)


def capable_gpu(device: torch.device | str) -> bool:
    """Whether `device` is a CUDA GPU of at least `MIN_CAPABILITY` (a host without CUDA: False)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def triton_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on `device`: Triton importable and a GPU of `MIN_CAPABILITY`."""
    return triton is not None and capable_gpu(device)


def kernels_run_on(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel may take `tensor`: Triton installed, a CUDA tensor, on a GPU of `MIN_CAPABILITY`.
    Device facts only (no values), so torch.compile folds it to a constant while tracing."""
    if triton is None or not tensor.is_cuda:
        return False
    return _capable_gpu_index(tensor.device.index)


@torch.compiler.assume_constant_result
def _capable_gpu_index(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY
