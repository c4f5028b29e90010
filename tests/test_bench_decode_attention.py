"""Tests of scripts/bench_decode_attention.py: its arguments, and that the calls it times are the decode step's
attention at the case's positions (Triton's interpreter on CPU; the timings need a GPU)."""

import argparse
import json
import sys
from pathlib import Path

import pytest

from conftest import run_in_triton_interpreter


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
try:
    import bench_decode_attention as bench
finally:
    sys.path.pop(0)


def test_cases_and_configs_are_checked_before_any_gpu_work():
    assert bench.parse_case("CRQ:16:1900") == bench.Case("CRQ", 16, 1900)
    for bad in ("CRQ:16", "MLP:1:10", "LLM:0:10", "LLM:x:10"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_case(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="JSON object"):
        bench.parse_config("[1, 2]")
    with pytest.raises(argparse.ArgumentTypeError, match="no field attention_stages"):
        bench.parse_config('{"attention_stages": 2}')
    args = bench.parse_args(["--configs", "{}", '{"attention_split_stages": [[16, 2]]}'])
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    base, stages = bench.kernel_configs(DecodeKernelConfig(), args.configs)
    assert base == DecodeKernelConfig() and stages.attention_split_stages == ((16, 2),)
    assert bench.cache_gigabytes(bench.Case("CRQ", 16, 1900)) == pytest.approx(0.1245, abs=1e-4)


_SCRIPT = """
import json, sys, torch
sys.path.insert(0, %r)
import bench_decode_attention as bench
from transformers.models.qwen3.modeling_qwen3 import rotate_half
from funaudiochat_hf.triton_attention_funaudiochat import AttentionLaunch
from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

torch.manual_seed(0)
case = bench.Case("CRQ", 2, 70)  # 70 positions: the new one (69) in the second 64-position block
layers = bench.Layers(case, max_positions=192, device="cpu", layers=2, dtype=torch.float32)
before = [keys.clone() for keys in layers.keys]
launch = AttentionLaunch.of(DecodeKernelConfig(), case.rows)
first = layers.attend(launch)
second = layers.attend(launch)  # the lengths are set back: the same positions again

def normed(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

errors, p = [], layers.position
for i in range(layers.count):
    q = normed(layers.query[i].view(2, 16, 128), layers.q_norm)
    k = normed(layers.key[i].view(2, 8, 128), layers.k_norm)
    cos, sin = layers.cos[:, None], layers.sin[:, None]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    keys, values = before[i].clone(), layers.values[i]
    keys[:, :, p] = k
    seen_keys, seen_values = keys[:, :, : p + 1].repeat_interleave(2, 1), values[:, :, : p + 1].repeat_interleave(2, 1)
    scores = torch.einsum("bhd,bhnd->bhn", q, seen_keys) * 128 ** -0.5
    expected = torch.einsum("bhn,bhnd->bhd", scores.softmax(-1), seen_values)
    errors.append(max((first[i][:, 0] - expected).abs().max().item(), (second[i] - first[i]).abs().max().item(),
                      (layers.keys[i][:, :, p] - k).abs().max().item()))
print(json.dumps({"errors": errors, "lengths": layers.lengths.tolist(), "position": p}))
""" % str(SCRIPTS)


def test_each_call_attends_to_the_cases_positions_with_the_steps_inputs():
    """Each layer's call norms and rotates its query and new key, writes the key at the case's last position and
    attends to exactly the case's positions (float32, to 1e-4), and a repeated call measures the same positions."""
    result = json.loads(run_in_triton_interpreter(_SCRIPT))
    assert result["position"] == 69 and result["lengths"] == [70, 70]
    assert max(result["errors"]) < 1e-4, result
