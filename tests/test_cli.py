"""funaudiochat-s2s: speech in, speech out on the tiny offline model; one-line errors."""

import os
import subprocess
import sys

import numpy as np
import pytest

from funaudiochat_hf.cli import _generating_note, main
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


def _short_clip(folder) -> str:
    """A 30 ms recording (48 kHz): shorter than the 40 ms speech frame the model hears."""
    path = folder / "short.wav"
    soundfile.write(path, np.full(1440, 0.1, dtype=np.float32), 48000)
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/no/such/question.wav"], "input file not found"),
        (["DIRECTORY"], "input is a directory, not an audio file"),
        (["NOT_AUDIO"], "input is not an audio file"),
        (["SHORT"], "input is too short"),
        (["QUESTION", "--model", "/no/such/folder"], "--model folder not found: /no/such/folder"),
        (["QUESTION", "--model", "./missing-model"], "--model folder not found: ./missing-model"),
        (["QUESTION", "--decoder", "/no/such/decoder"], "--decoder folder not found: /no/such/decoder"),
        (["QUESTION", "--model", "NOT_AUDIO"], "is a file: pass the model's folder or a Hub id"),
        (["QUESTION", "--speakers", "/no/such/spk2info.pt"], "--speakers file not found"),
        ([], "no input"),
        (["QUESTION", "--voice", "nobody"], "unknown voice 'nobody'"),
        (["QUESTION", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["QUESTION", "--temperature", "-1"], "--temperature must be positive"),
        (["QUESTION", "--system-prompt", "x" * 300_000], "--system-prompt has 300000 characters"),
    ],
)
def test_errors_are_one_line_with_nonzero_exit(cache_dir, question, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache_dir))
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("not a recording")
    paths = {"QUESTION": str(question), "DIRECTORY": str(tmp_path), "NOT_AUDIO": str(not_audio),
             "SHORT": _short_clip(tmp_path)}  # fmt: skip
    assert main([paths.get(a, a) for a in argv]) == 1
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and message in err_lines[0], err_lines


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
        (["--temperature", "nan"], "--temperature must be positive and finite, got nan"),
        (["--temperature", "inf"], "--temperature must be positive and finite, got inf"),
        (["--seed", str(2**64)], f"--seed must fit in 64 bits (-2**63 to 2**64 - 1), got {2**64}"),
        (["--seed", str(-(2**63) - 1)], "--seed must fit in 64 bits"),
        (["--greedy", "--temperature", "0.7"], "--greedy takes no sampling options: drop --temperature or --greedy"),
        (["--top-p", "0.5", "--greedy"], "--greedy takes no sampling options: drop --top-p or --greedy"),
        (["--greedy", "--temperature", "1", "--top-p", "1"], "drop --temperature and --top-p or --greedy"),
        (["--device", "gpu"], "--device gpu is not a device name: use auto, cpu, cuda or cuda:N"),
        (["--device", "cuda:x"], "--device cuda:x is not a device name"),
        (["--device", "meta"], "--device meta: not available on this machine"),
    ],
)
def test_sampling_and_device_options_are_checked_before_any_model_loads(cache_dir, question, monkeypatch, capsys,
                                                                        argv, message):  # fmt: skip
    """generate_speech refused a bad --top-p or --seed, and the pipeline a bad --device, only after the model (16 GB)
    had loaded; --greedy silently overrode an explicit --temperature / --top-p."""
    from funaudiochat_hf import cli

    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache_dir))
    monkeypatch.setattr(cli, "_load_pipeline", lambda args: pytest.fail("the models were loaded"))
    assert main([str(question), *argv]) == 1
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and message in err_lines[0], err_lines


def test_sampling_options_at_their_limits_are_passed_on():
    from funaudiochat_hf import cli

    def kwargs(*argv):
        return cli._generate_kwargs(cli._parser().parse_args(["q.wav", *argv]))

    assert kwargs("--top-p", "1", "--temperature", "1e-3") == {"top_p": 1.0, "temperature": 1e-3}
    assert kwargs("--seed", "-1") == {"seed": -1}  # torch takes any 64-bit seed, as generate_speech does
    assert kwargs("--seed", str(2**64 - 1), "--greedy") == {"seed": 2**64 - 1, "do_sample": False}


def test_a_cuda_device_this_machine_lacks_is_refused_by_name(monkeypatch):
    """`--device cuda:7` on a one-GPU host reached the pipeline, after loading; checked against the device count."""
    import torch

    from funaudiochat_hf import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli._device("cuda") == "cuda" and cli._device("cuda:0") == "cuda:0" and cli._device("auto") == "cuda"
    with pytest.raises(ValueError, match=r"--device cuda:7: this machine has 1 CUDA device \(cuda:0 to cuda:0\)"):
        cli._device("cuda:7")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"has 2 CUDA devices \(cuda:0 to cuda:1\)"):
        cli._device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda:0: CUDA is not available on this machine"):
        cli._device("cuda:0")
    assert cli._device("auto") == "cpu" and cli._device("cpu") == "cpu"


@pytest.mark.parametrize(
    "kind, message",
    [
        ("EMPTY", "is empty: it contains 0 samples"),
        ("LONG", "lasts 301.0 s (2408000 samples at 8000 Hz), longer than the 300 s limit"),
        ("LOW_RATE", "is sampled at 4000 Hz; supported rates are 8000-384000 Hz"),
    ],
)
def test_audio_that_decodes_but_is_refused_keeps_its_own_message(question, tmp_path, monkeypatch, capsys, kind,
                                                                 message):  # fmt: skip
    """Every refusal of the question used to read "input is not an audio file": that is said only of a file that
    does not decode; an empty, over-long or oddly sampled recording is named as such (with the file)."""
    from funaudiochat_hf import cli

    monkeypatch.setattr(cli, "_load_pipeline", lambda args: pytest.fail("the models were loaded"))
    path = tmp_path / f"{kind.lower()}.wav"
    if kind == "EMPTY":
        soundfile.write(path, np.zeros(0, np.float32), 16000)
    elif kind == "LONG":
        soundfile.write(path, np.zeros(301 * 8000, np.int16), 8000)
    else:
        soundfile.write(path, np.zeros(8000, np.int16), 8000)
        data = bytearray(path.read_bytes())
        data[24:28] = (4000).to_bytes(4, "little")  # the header's rate, as test_audio_io's header tests do
        path.write_bytes(bytes(data))
    assert main([str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and str(path) in err and "not an audio file" not in err, err


@pytest.mark.parametrize(
    "argv",
    [["QUESTION", "--voice", "nobody"], ["NOT_AUDIO"], ["SHORT"], ["QUESTION", "-o", "DIRECTORY"],
     ["QUESTION", "-o", "reply.xyz"], ["QUESTION", "-o", "reply"], ["QUESTION", "-o", "/proc/reply.wav"],
     ["QUESTION", "--model", "NO_DECODER"]],
)  # fmt: skip
def test_bad_voice_input_and_output_are_rejected_before_any_model_loads(cache_dir, question, tmp_path, monkeypatch,
                                                                        capsys, argv):  # fmt: skip
    from funaudiochat_hf import cli

    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache_dir))
    monkeypatch.setattr(cli, "_load_pipeline", lambda args: pytest.fail("the models were loaded"))
    not_audio = tmp_path / "notes.wav"
    not_audio.write_bytes(b"RIFF\x00\x00")
    from conftest import FUNAUDIOCHAT_TINY

    paths = {"QUESTION": str(question), "NOT_AUDIO": str(not_audio), "DIRECTORY": str(tmp_path),
             "NO_DECODER": str(FUNAUDIOCHAT_TINY), "SHORT": _short_clip(tmp_path)}  # fmt: skip
    assert main([paths.get(a, a) for a in argv]) == 1
    assert capsys.readouterr().err.startswith("error:")
    assert not (tmp_path / "reply").exists()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("suffix, container", [(".flac", "FLAC"), (".ogg", "OGG"), (".mp3", "MP3")])
def test_the_reply_is_written_in_the_container_its_name_says(cache_dir, question, tmp_path, monkeypatch, capsys,
                                                             suffix, container, stream):  # fmt: skip
    """16-bit PCM where the container holds it, else the container's own codec (Vorbis, MPEG layer III)."""
    if container not in soundfile.available_formats():
        pytest.skip(f"this libsndfile cannot write {container}")
    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache_dir))
    reply = tmp_path / "new" / f"reply{suffix}"
    argv = [str(question), "-o", str(reply), "--max-new-tokens", "8", "--greedy"] + (["--stream"] if stream else [])
    assert main(argv) == 0, capsys.readouterr().err
    info = soundfile.info(reply)
    assert info.format == container and info.samplerate == 24000 and info.frames > 0


def test_voices_of_a_folder_are_read_before_loading(cache_dir, question, monkeypatch, capsys):
    """A model folder's voices come from its config.json (no weights loaded): --list-voices and --voice use them."""
    from funaudiochat_hf import cli

    monkeypatch.setattr(cli, "_load_pipeline", lambda args: pytest.fail("the models were loaded"))
    model = str(cache_dir / f"tiny-{TINY_MODEL_VERSION}")
    assert main(["--list-voices", "--model", model]) == 0
    assert capsys.readouterr().out.split() == ["中文女", "中文男"]
    assert main([str(question), "--model", model, "--voice", "nobody"]) == 1
    assert "unknown voice 'nobody'; this decoder has: 中文女, 中文男" in capsys.readouterr().err
    # The official two-repo layout: the voices are the official decoder folder's speaker file's.
    from conftest import COSYVOICE3_TINY, FUNAUDIOCHAT_TINY

    assert main(["--list-voices", "--model", str(FUNAUDIOCHAT_TINY), "--decoder", str(COSYVOICE3_TINY)]) == 0
    assert capsys.readouterr().out.split() == ["中文女", "中文男"]


def test_reply_text_cannot_drive_the_terminal(cache_dir, question, monkeypatch, capsys):
    """Model text is printed with its control characters escaped: an escape sequence, a carriage return or a bidi
    override in the reply reaches the terminal as visible text, not as an action."""
    from funaudiochat_hf import cli

    text = "red\x1b[31m!\rover\u202eevil\tok\n中文"
    assert cli._printable(text) == "red\\x1b[31m!\\rover\\u202eevil\tok\n中文"

    class Pipe:
        speakers, device, sampling_rate = [], "cpu", 24000

        def __call__(self, inputs, **kwargs):
            return {"text": text, "audio": np.zeros(240, dtype=np.float32), "sampling_rate": 24000}

        def stream(self, inputs, **kwargs):
            yield {"text": text, "audio": np.zeros(240, dtype=np.float32), "sampling_rate": 24000, "finished": True}

    monkeypatch.setenv("FUNAUDIOCHAT_HF_CACHE", str(cache_dir))
    monkeypatch.setattr(cli, "_load_pipeline", lambda args: Pipe())
    for extra in ([], ["--stream"]):
        assert main([str(question), "-o", str(question.parent / "reply.wav"), *extra]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\r" not in out and "\u202e" not in out and "\\x1b[31m" in out


def test_help_shows_the_defaults_and_the_first_run(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("(default: 512; 48 with the tiny offline model)", "temperature (default: 0.8)",
                     "threshold (default: 0.9)", "(default: sampling)", "The first run waits longer"):  # fmt: skip
        assert expected in text, expected


def test_subprocess_error_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "funaudiochat_hf.cli", str(tmp_path / "missing.wav")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: input file not found: {tmp_path / 'missing.wav'}"


def test_a_first_download_is_announced(cache_dir, question, tmp_path, monkeypatch, capsys):
    """A Hub id whose config is not in the local cache is downloaded first: the wait is announced before it starts."""
    import transformers

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    # Its config.json is fetched first (a one-folder repo's: a decoder inside), then the weights would be.
    one_folder_config = str(cache_dir / f"tiny-{TINY_MODEL_VERSION}" / "config.json")
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda repo, name: one_folder_config)
    monkeypatch.setattr(transformers, "pipeline", offline)
    assert main([str(question), "--model", "someone/not-cached"]) == 1
    err = capsys.readouterr().err
    assert "note: downloading someone/not-cached from the Hub: the first run only" in err and "error: offline" in err


@pytest.mark.parametrize("fetched", ["NO_DECODER", "FAILS"])
def test_a_hub_model_without_a_decoder_is_refused_before_its_weights_download(question, tmp_path, monkeypatch,
                                                                              capsys, fetched):  # fmt: skip
    """The official layout's chat model named by Hub id without --decoder: its config.json (a few KB) says so before
    the weights (16 GB) are downloaded; a config that cannot be fetched is one error, not two waits."""
    from conftest import FUNAUDIOCHAT_TINY

    from funaudiochat_hf import cli

    def fetch(repo, name):
        if fetched == "FAILS":
            raise OSError("no network")
        return str(FUNAUDIOCHAT_TINY / name)

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.hf_hub_download", fetch)
    monkeypatch.setattr(cli, "_load_pipeline", lambda args: pytest.fail("the models were loaded"))
    assert main([str(question), "--model", "someone/official-layout"]) == 1
    err = capsys.readouterr().err
    expected = "has no speech decoder inside" if fetched == "NO_DECODER" else "could not be fetched from the Hub"
    assert expected in err


def test_the_note_before_a_gpu_reply_says_the_first_one_builds_kernels():
    """A new process's first reply on a GPU builds (or loads) the decode kernels and records CUDA graphs: seconds of
    silence after "generating the reply" unless the line says why; on a CPU there is nothing to say."""
    assert _generating_note("cpu") == "generating the reply on cpu ..."
    for device in ("cuda", "cuda:1"):
        note = _generating_note(device)
        assert note.startswith(f"generating the reply on {device} ...") and "kernels" in note and "first reply" in note
