"""The README's Python examples: each imports only names it uses, and the offline one runs as written."""

import ast
import re
from pathlib import Path

import numpy as np
import torch

from funaudiochat_hf.tiny_model import TINY_MODEL_VERSION, build_tiny_model


README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_python_examples_import_only_what_they_use():
    blocks = python_blocks()
    assert len(blocks) >= 2
    for block in blocks:
        tree = ast.parse(block)
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                unused = [alias.name for alias in node.names if (alias.asname or alias.name) not in used]
                assert not unused, f"README imports {unused} from {node.module} without using them:\n{block}"


def test_offline_python_example_runs(tmp_path_factory, monkeypatch):
    """The offline block, as written: the tiny model (the session's build, through the cache folder it names), its
    one-folder decoder (no `speech_decoder=`), a bare 16 kHz array, the pipeline and its `stream`."""
    cache = tmp_path_factory.getbasetemp() / "cache"
    build_tiny_model(cache / f"tiny-{TINY_MODEL_VERSION}")  # shared with the other test modules of the session
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache))
    offline = [block for block in python_blocks() if "build_tiny_model()" in block]
    assert len(offline) == 1
    scope = {}
    exec(compile(offline[0], "README.md", "exec"), scope)  # noqa: S102  (the README's own example)
    assert scope["reply"]["sampling_rate"] == 24000 and scope["reply"]["audio"].size > 0
    assert isinstance(scope["event"]["audio"], np.ndarray)
    audio = scope["audio"]
    assert isinstance(audio, torch.Tensor) and audio.ndim == 1 and audio.numel() > 0
    assert scope["out"].sampling_rate == 24000
