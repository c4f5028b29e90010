"""The Gradio demo in a real (headless Chromium) browser: upload a question, press Send, get the reply.

Runs `demo/app.py` with the tiny offline model on 127.0.0.1 and drives it with Playwright's Python API and the
Debian `chromium` (never `playwright install`). Skips only when Chromium or playwright is missing.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from funaudiochat_hf.tiny_model import TINY_MODEL_VERSION, build_tiny_model, synthetic_question

soundfile = pytest.importorskip("soundfile")  # librosa's audio backend (absent on bare GPU hosts)


pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SERVER_START_TIMEOUT_S = 240
REPLY_TIMEOUT_MS = 240_000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_http(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"demo server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"demo server did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def sync_playwright():
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run installs it)")
    module = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    return module.sync_playwright


@pytest.fixture(scope="module", params=["streamed", "whole"])
def demo_url(request, sync_playwright, tmp_path_factory):
    """The app, once streaming the reply audio (needs ffmpeg) and once sending it whole (the no-ffmpeg fallback)."""
    if request.param == "streamed" and shutil.which("ffmpeg") is None:
        pytest.skip("Gradio streams audio through ffmpeg, which is not installed (the 'whole' variant still runs)")
    cache = tmp_path_factory.getbasetemp() / "cache"
    build_tiny_model(cache / f"tiny-{TINY_MODEL_VERSION}")  # shared with the other test modules of the session
    port = _free_port()
    log = tmp_path_factory.mktemp("demo") / "server.log"
    env = dict(
        os.environ,
        FUNAUDIOCHAT_HF_CACHE=str(cache),
        FUNAUDIOCHAT_DEVICE="cpu",
        GRADIO_SERVER_NAME="127.0.0.1",
        GRADIO_SERVER_PORT=str(port),
        GRADIO_ANALYTICS_ENABLED="False",
        HF_HUB_OFFLINE="1",
        FUNAUDIOCHAT_STREAM_AUDIO="1" if request.param == "streamed" else "0",
    )
    env.pop("FUNAUDIOCHAT_MODEL", None)
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "demo" / "app.py")], stdout=sink, stderr=subprocess.STDOUT, env=env,
            cwd=ROOT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_for_http(url, process, log, SERVER_START_TIMEOUT_S)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the server's own process group only
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


QUESTION_PLAYER = "#question audio, #question [data-testid^='waveform']"
# streamed: an <audio> on a blob playlist; whole: a waveform player; both offer the reply for download
REPLY_HAS_AUDIO = "() => !!document.querySelector('#reply-audio [data-testid=download-link][href]')"
IDLE = "() => document.querySelectorAll('.generating, .pending').length === 0"


@pytest.fixture()
def page(sync_playwright, demo_url):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 1000})
        try:
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.goto(demo_url)
            yield page
        finally:
            context.close()
            browser.close()


def test_upload_question_and_get_spoken_reply(page, tmp_path):
    question = tmp_path / "question.wav"
    soundfile.write(question, synthetic_question(1.5), 16000)
    screenshot = Path(os.environ.get("DEMO_SCREENSHOT", tmp_path / "demo.png"))
    page.get_by_text("Offline demo model").wait_for()  # the noise warning is shown for the tiny model
    page.locator("#question input[type=file]").set_input_files(str(question))
    page.locator(QUESTION_PLAYER).first.wait_for()
    page.locator("#submit").click()
    # the streamed reply: transcript text, an audio player, the turn in the conversation, then idle
    page.wait_for_function(
        "() => { const t = document.querySelector('#transcript textarea'); return t && t.value.length > 0; }",
        timeout=REPLY_TIMEOUT_MS,
    )
    page.wait_for_function(REPLY_HAS_AUDIO, timeout=REPLY_TIMEOUT_MS)
    page.wait_for_function(IDLE, timeout=REPLY_TIMEOUT_MS)
    assert page.locator("#conversation").get_by_text("(1.5 s)").count() == 1
    transcript = page.locator("#transcript textarea").input_value()
    assert transcript.strip()
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 10_000

    page.locator("#submit").click()  # a second turn joins the same conversation
    page.wait_for_function(
        "() => document.querySelectorAll('#conversation .message-row, #conversation [data-testid=user]').length >= 2"
        " || document.querySelector('#conversation').innerText.split('(1.5 s)').length === 3",
        timeout=REPLY_TIMEOUT_MS,
    )
    page.wait_for_function(IDLE, timeout=REPLY_TIMEOUT_MS)
    assert page.locator("#conversation").get_by_text("(1.5 s)").count() == 2

    page.locator("#reset").click()  # a new conversation clears the transcript and the history
    page.wait_for_function("() => document.querySelector('#transcript textarea').value === ''")
    assert page.locator("#conversation").get_by_text("(1.5 s)").count() == 0


def test_too_long_question_gets_a_friendly_message(page, tmp_path):
    question = tmp_path / "long.wav"
    soundfile.write(question, synthetic_question(31.0), 16000)
    page.locator("#question input[type=file]").set_input_files(str(question))
    page.locator(QUESTION_PLAYER).first.wait_for()
    page.locator("#submit").click()
    page.get_by_text("please keep questions under 30 s").first.wait_for()
