"""scripts/build_hub_repo.py: the one-folder repo, loaded with remote code where funaudiochat_hf is not importable."""

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from funaudiochat_hf.tiny_model import TINY_MODEL_VERSION, build_tiny_model
from conftest import load_module


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "build_hub_repo.py"


def _load_script():
    return load_module(SCRIPT, "build_hub_repo")


@pytest.fixture(scope="module")
def builder():
    return _load_script()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    # shared by every test module of the session (same base temp dir)
    return build_tiny_model(tmp_path_factory.getbasetemp() / "cache" / f"tiny-{TINY_MODEL_VERSION}")


@pytest.fixture(scope="module")
def hub_dir(builder, tiny_model_dir, tmp_path_factory):
    return builder.build_hub_repo(str(tiny_model_dir), tmp_path_factory.mktemp("hub") / "repo")


def test_folder_layout(builder, hub_dir):
    config = json.loads((hub_dir / "config.json").read_text())
    assert config["auto_map"] == builder.AUTO_MAP
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM", "AutoProcessor"}
    pipelines = config["custom_pipelines"]["speech-to-speech"]
    assert pipelines["impl"] == "pipeline_speech_to_speech.SpeechToSpeechPipeline"
    assert pipelines["pt"] == ["AutoModel"]  # transformers resolves these with getattr(transformers, name)
    processor_config = json.loads((hub_dir / "processor_config.json").read_text())
    assert processor_config["auto_map"]["AutoProcessor"] == "processing_funaudiochat.FunAudioChatProcessor"
    for name in ("model.safetensors", "tokenizer.json", "speech_tokenizer/tokenizer.json", "preprocessor_config.json",
                 "chat_template.jinja", "README.md"):
        assert (hub_dir / name).is_file(), name
    code = {p.name for p in hub_dir.glob("*.py")}
    assert {"configuration_funaudiochat.py", "modeling_funaudiochat.py", "processing_funaudiochat.py",
            "pipeline_speech_to_speech.py", "audio_io.py", "modeling_cosyvoice3.py"} <= code
    assert not code & {"__init__.py", "cli.py", "tiny_model.py"}
    card = (hub_dir / "README.md").read_text()
    assert card.startswith("---\nlicense: other") and "## License" in card and "trust_remote_code=True" in card and "## Limits" in card


def test_code_files_follow_relative_imports(builder):
    package = ROOT / "src" / "funaudiochat_hf"
    names = {p.name for p in builder.code_files(package)}
    for path in builder.code_files(package):
        for imported in builder.relative_imports(path):
            assert f"{imported}.py" in names, (path.name, imported)
    # Every generation_* file the model's mixin needs goes along (the generation package is split by job).
    generation = {p.name for p in package.glob("generation_*_funaudiochat.py")} | {"generation_funaudiochat.py"}
    assert generation <= names


def test_relative_import_forms(builder, tmp_path):
    """`from .x import y` (also multi-line, also inside a function) and `from . import x` are followed; any other
    relative form fails loudly, naming the file and line, instead of silently leaving a file out."""
    source = tmp_path / "flat_funaudiochat.py"
    source.write_text(
        "from .a_x import (\n    b,\n)\nfrom . import c_x, d_x as d\nimport torch\n\n\ndef f():\n"
        "    from .e_x import g\n"
    )
    assert sorted(builder.relative_imports(source)) == ["a_x", "c_x", "d_x", "e_x"]
    for statement in ("from ..outside import x", "from .pkg.sub import x"):
        source.write_text(f"import os\n{statement}\n")
        with pytest.raises(ValueError, match=r"flat_funaudiochat.py:2: .*not a flat relative import"):
            builder.relative_imports(source)


def test_refuses_to_overwrite_and_needs_a_decoder(builder, tiny_model_dir, hub_dir, tmp_path):
    with pytest.raises(FileExistsError, match="--overwrite"):
        builder.build_hub_repo(str(tiny_model_dir), hub_dir)
    # The official layout's chat folder without --decoder: refused before the output folder is emptied (--overwrite)
    # or the model loads.
    from conftest import FUNAUDIOCHAT_TINY

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="has no speech decoder inside: set --decoder"):
        builder.build_hub_repo(str(FUNAUDIOCHAT_TINY), kept, overwrite=True)
    assert (kept / "notes.txt").read_text() == "mine"


def test_push_to_hub_dry_run_lists_files_without_network(builder, hub_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = builder.push_to_hub(hub_dir, "someone/fun-audio-chat-s2s", dry_run=True)
    out = capsys.readouterr().out
    assert "would upload" in out and "someone/fun-audio-chat-s2s" in out
    assert "config.json" in files and "pipeline_speech_to_speech.py" in files and "model.safetensors" in files


def test_cli_errors_are_one_line(builder, tmp_path, capsys):
    code = builder.main(["--chat", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1 and err == [f"error: chat model folder not found: {tmp_path / 'missing'}"]


_REMOTE_SCRIPT = r"""
import json, sys
sys.path[:0] = json.loads(sys.argv[2])  # site-packages only: no .pth files, so no editable funaudiochat_hf
try:
    import funaudiochat_hf
except ImportError:
    pass
else:
    raise SystemExit("funaudiochat_hf is importable: the test would not prove anything")
import numpy as np
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoProcessor, pipeline

repo = sys.argv[1]
config = AutoConfig.from_pretrained(repo, trust_remote_code=True)
assert type(config).__name__ == "FunAudioChatConfig", type(config)
assert type(AutoProcessor.from_pretrained(repo, trust_remote_code=True)).__name__ == "FunAudioChatProcessor"
model = AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True)
assert type(model).__name__ == "FunAudioChatForConditionalGeneration"
s2s = pipeline(model=repo, trust_remote_code=True, device="cpu")  # task inferred from custom_pipelines
assert s2s.task == "speech-to-speech", s2s.task
t = np.arange(16000) / 16000
reply = s2s(0.3 * np.sin(2 * np.pi * 180 * t).astype(np.float32), max_new_tokens=6, do_sample=False)
print(json.dumps({"pipeline": type(s2s).__name__, "module": type(s2s).__module__, "text": reply["text"],
                  "samples": int(reply["audio"].size), "dtype": str(reply["audio"].dtype),
                  "sampling_rate": reply["sampling_rate"], "speakers": s2s.speakers}))
"""


def test_remote_code_load_without_the_package(hub_dir, tmp_path):
    copy = tmp_path / "copied-repo"
    shutil.copytree(hub_dir, copy)
    site_dirs = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if os.path.isdir(p)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _REMOTE_SCRIPT, str(copy), json.dumps(site_dirs)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["pipeline"] == "SpeechToSpeechPipeline"
    assert report["module"].startswith("transformers_modules.")  # the repo's copy, not the package
    assert report["sampling_rate"] == 24000 and report["dtype"] == "float32" and report["samples"] > 0
    assert report["speakers"] == ["中文女", "中文男"]


def test_build_from_the_official_two_repo_layout(builder, tmp_path):
    """--chat (no decoder) + --decoder (official CosyVoice3 folder) + --speakers -> one folder with both."""
    from transformers import AutoModel

    from conftest import COSYVOICE3_TINY, FUNAUDIOCHAT_TINY

    out = builder.build_hub_repo(
        str(FUNAUDIOCHAT_TINY), tmp_path / "repo", decoder=str(COSYVOICE3_TINY),
        speakers=str(COSYVOICE3_TINY / "spk2info.pt"),
    )
    config = json.loads((out / "config.json").read_text())
    assert config["token2wav_config"]["model_type"] == "cosyvoice3"
    model = AutoModel.from_pretrained(out)
    assert model.token2wav is not None and model.token2wav.config.speaker_names
    assert model.token2wav.config.speaker_names == config["token2wav_config"]["speaker_names"]


def test_installed_package_serves_the_folder_without_remote_code(hub_dir):
    """With the package installed, `pipeline("speech-to-speech", model=folder)` needs no `trust_remote_code`
    (transformers refuses any pipeline listed in `custom_pipelines` without it) and runs none of the folder's code; the
    task is still inferred from the folder, and `trust_remote_code=True` (the model card's call) keeps working."""
    import sys

    import numpy as np
    from transformers import AutoConfig, pipeline

    import funaudiochat_hf

    before = {name for name in sys.modules if name.startswith("transformers_modules")}
    s2s = pipeline("speech-to-speech", model=str(hub_dir), device="cpu")
    assert isinstance(s2s, funaudiochat_hf.SpeechToSpeechPipeline)
    assert isinstance(s2s.model, funaudiochat_hf.FunAudioChatForConditionalGeneration)
    assert isinstance(s2s.processor, funaudiochat_hf.FunAudioChatProcessor)
    reply = s2s(np.zeros(8000, dtype=np.float32), max_new_tokens=6, do_sample=False)
    assert reply["sampling_rate"] == 24000 and reply["audio"].size > 0
    for kwargs in ({}, {"trust_remote_code": True}):  # the task inferred from `custom_pipelines`
        inferred = pipeline(model=str(hub_dir), device="cpu", **kwargs)
        assert inferred.task == "speech-to-speech" and isinstance(inferred, funaudiochat_hf.SpeechToSpeechPipeline)
    assert {name for name in sys.modules if name.startswith("transformers_modules")} == before
    # The entries are kept as the folder wrote them (a model saved from it lists them again).
    config = AutoConfig.from_pretrained(hub_dir)
    assert json.loads(config.to_json_string())["custom_pipelines"] == json.loads(
        (hub_dir / "config.json").read_text()
    )["custom_pipelines"]
