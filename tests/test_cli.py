"""funaudiochat-s2s: speech in, speech out on the tiny offline model; one-line errors."""

import os
import subprocess
import sys

import pytest

from funaudiochat_hf.cli import main
from funaudiochat_hf.tiny_model import TINY_MODEL_VERSION, build_tiny_model, synthetic_question

soundfile = pytest.importorskip("soundfile")  # librosa's audio backend (absent on bare GPU hosts)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "cache"
    build_tiny_model(cache / f"tiny-{TINY_MODEL_VERSION}")  # shared with the other test modules of the session
    return cache


@pytest.fixture()
def question(tmp_path):
    path = tmp_path / "question.wav"
    soundfile.write(path, synthetic_question(1.5), 16000)
    return path


def test_module_entry_point_writes_a_24khz_reply(cache_dir, question, tmp_path):
    reply = tmp_path / "out" / "reply.wav"
    env = dict(os.environ, FUNAUDIOCHAT_HF_CACHE=str(cache_dir), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "funaudiochat_hf.cli", str(question), "-o", str(reply), "--max-new-tokens", "10",
         "--greedy", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = soundfile.info(reply)
    assert info.samplerate == 24000 and info.channels == 1 and info.frames > 0
    assert "noise" in result.stderr and "--model FunAudioLLM/Fun-Audio-Chat-8B" in result.stderr
    assert "loading chat model" in result.stderr and f"wrote {reply}" in result.stderr
    assert result.stdout.strip()  # the text reply


def test_streaming_writes_the_same_kind_of_file(cache_dir, question, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache_dir))
    reply = tmp_path / "stream.wav"
    code = main([str(question), "-o", str(reply), "--stream", "--max-new-tokens", "8", "--greedy", "--voice", "中文男"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    info = soundfile.info(reply)
    assert info.samplerate == 24000 and info.frames > 0
    assert "first audio after" in captured.err


def test_list_voices(cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache_dir))
    assert main(["--list-voices"]) == 0
    assert capsys.readouterr().out.split() == ["中文女", "中文男"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/no/such/question.wav"], "input file not found"),
        ([], "no input"),
        (["QUESTION", "--voice", "nobody"], "unknown voice 'nobody'"),
        (["QUESTION", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["QUESTION", "--temperature", "-1"], "--temperature must be positive"),
        (["QUESTION", "--system-prompt", "x" * 300_000], "--system-prompt has 300000 characters"),
    ],
)
def test_errors_are_one_line_with_nonzero_exit(cache_dir, question, monkeypatch, capsys, argv, message):
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache_dir))
    argv = [str(question) if a == "QUESTION" else a for a in argv]
    assert main(argv) == 1
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and message in err_lines[0]


def test_subprocess_error_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "funaudiochat_hf.cli", str(tmp_path / "missing.wav")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: input file not found: {tmp_path / 'missing.wav'}"
