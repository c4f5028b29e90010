#!/usr/bin/env python
"""Build a one-folder Hub repo: chat model + CosyVoice3 decoder + processor + code, loadable without this package.

    python scripts/build_hub_repo.py --chat FunAudioLLM/Fun-Audio-Chat-8B \\
        --decoder path/to/Fun-CosyVoice3-0.5B-2512 --speakers path/to/new_spk2info.pt --out fun-audio-chat-s2s
    python scripts/build_hub_repo.py ... --out fun-audio-chat-s2s --push-to-hub you/fun-audio-chat-s2s [--dry-run]

The folder holds:
* `config.json` with `auto_map` for AutoConfig, AutoModel, AutoModelForSeq2SeqLM (the official scripts' class) and
  AutoProcessor, plus `custom_pipelines` for the `speech-to-speech` task (its `pt` entry names only transformers
  classes, as `pipeline()` resolves them with `getattr(transformers, name)`);
* the weights (safetensors; the decoder's under `token2wav.*`, speaker embeddings included);
* the processor files (tokenizers, feature extractor, chat template) with their own `auto_map`;
* the flat code files of `funaudiochat_hf` the entry points need (they import each other relatively);
* a model card `README.md`.

Then, with nothing but transformers installed:
    pipeline(model="you/fun-audio-chat-s2s", trust_remote_code=True)("question.wav")
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import sys
from pathlib import Path


AUTO_MAP = {
    "AutoConfig": "configuration_funaudiochat.FunAudioChatConfig",
    "AutoModel": "modeling_funaudiochat.FunAudioChatForConditionalGeneration",
    "AutoModelForSeq2SeqLM": "modeling_funaudiochat.FunAudioChatForConditionalGeneration",
    "AutoProcessor": "processing_funaudiochat.FunAudioChatProcessor",
}
CUSTOM_PIPELINES = {
    "speech-to-speech": {
        "impl": "pipeline_speech_to_speech.SpeechToSpeechPipeline",
        "pt": ["AutoModel"],
        "type": "multimodal",
    }
}


def relative_imports(path: Path) -> list[str]:
    """The sibling modules a flat package file imports relatively: `from .name import ...` and `from . import name`
    (anywhere in the file, also inside functions).

    Raises:
        ValueError: a relative import of another form (`from ..x`, `from .x.y`): the Hub code is one flat folder.
    """
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        if node.level == 1 and node.module is None:
            names += [alias.name for alias in node.names]
        elif node.level == 1 and "." not in node.module:
            names.append(node.module)
        else:
            statement = f"from {'.' * node.level}{node.module or ''} import ..."
            raise ValueError(
                f"{path.name}:{node.lineno}: `{statement}` is not a flat relative import (`from .module import name`"
                " or `from . import module`); the Hub folder is flat, so the exporter cannot follow it."
            )
    return names


def code_files(package_dir: Path) -> list[Path]:
    """The package files the Hub entry points need: the auto_map / pipeline modules and everything they import
    relatively (transitively). `__init__.py`, the CLI and the tiny-model builder are not needed remotely."""
    entry = {ref.split(".")[0] for ref in AUTO_MAP.values()}
    entry |= {info["impl"].split(".")[0] for info in CUSTOM_PIPELINES.values()}
    todo, seen = sorted(entry), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = package_dir / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is imported by the Hub code but does not exist.")
        seen.add(name)
        todo.extend(relative_imports(path))
    return [package_dir / f"{name}.py" for name in sorted(seen)]


def _model_card(chat: str, decoder: str | None, speakers: list[str]) -> str:
    voices = ", ".join(speakers) if speakers else "the decoder's default"
    decoder_line = f"speech decoder from `{decoder}`" if decoder else "speech decoder included in the chat checkpoint"
    return f"""---
license: other
license_name: upstream-model-licenses
library_name: transformers
pipeline_tag: audio-to-audio
tags: [funaudiochat, speech-to-speech, cosyvoice3, custom_code]
---
# Fun-Audio-Chat speech-to-speech (one folder)

Fun-Audio-Chat (Qwen3 LLM + audio encoders + CRQ speech head) and its CosyVoice3 token2wav decoder in one repo:
spoken question in, spoken (24 kHz) and written reply out. Chat model from `{chat}`, {decoder_line}.
Built with `scripts/build_hub_repo.py` of funaudiochat_hf; the code files here are that package's.

## Usage

```python
from transformers import pipeline

s2s = pipeline(model="<this repo>", trust_remote_code=True)  # task "speech-to-speech" is inferred
reply = s2s("question.wav", max_new_tokens=512)  # also bytes, arrays, {{"array", "sampling_rate"}}, chats, lists
reply["text"], reply["audio"], reply["sampling_rate"]  # str, float32 numpy (samples,), 24000

for event in s2s.stream("question.wav"):  # audio chunks while the reply is generated
    ...
```

With the package installed (`pip install funaudiochat_hf`), no remote code is needed:
`import funaudiochat_hf; pipeline("speech-to-speech", model="<this repo>")`, or the CLI
`funaudiochat-s2s question.wav -o reply.wav --model <this repo>`.

Voices: {voices} (pass `speaker=`). Generation keywords (`max_new_tokens`, `temperature`, `top_p`, `top_k`,
`repetition_penalty`, `do_sample`, `seed`, `system_prompt`) pass through to `generate_speech`.

## Limits

* Input: speech (resampled to 16 kHz) up to the feature extractor's `chunk_length` per clip (300 s for
  Fun-Audio-Chat-8B); replies are bounded by `max_new_tokens` (5 LLM steps per second of speech).
* The voice comes from a fixed speaker embedding (no voice cloning); timbre control is limited to the stored voices.
* Half-duplex only: one turn in, one turn out. Multi-turn history keeps earlier assistant turns as text.
* English and Chinese are the languages the model was trained for; quality elsewhere is untested.

## License

The weights keep the licenses of their upstream repos (`{chat}` and the CosyVoice3 decoder,
Fun-CosyVoice3-0.5B-2512 for the official one): read those model cards before use. The code files are the
funaudiochat_hf package's (Apache-2.0).
"""


def _update_json(path: Path, update: dict) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(update)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def _looks_local(source: str) -> bool:
    """A path rather than a Hub id (`owner/name`)."""
    return source.startswith(("/", ".", "~")) or Path(source).expanduser().exists() or source.count("/") > 1


def attach_decoder(model, decoder) -> None:
    """Make `decoder` the model's `token2wav`, recorded in its config so `from_pretrained` rebuilds it."""
    model.config.token2wav_config = decoder.config
    model.token2wav = decoder


def build_hub_repo(
    chat: str,
    out: str | Path,
    decoder: str | None = None,
    speakers: str | None = None,
    overwrite: bool = False,
    max_shard_size: str = "5GB",
) -> Path:
    """Write the one-folder repo to `out` and return it (see the module docstring)."""
    import torch
    from transformers import AutoProcessor

    import funaudiochat_hf
    from funaudiochat_hf import FunAudioChatForConditionalGeneration
    from funaudiochat_hf.cli import check_decoder_before_loading
    from funaudiochat_hf.pipeline_speech_to_speech import load_speech_decoder

    for name, source in (("chat model", chat), ("decoder", decoder)):
        if source is not None and _looks_local(source) and not Path(source).expanduser().is_dir():
            raise FileNotFoundError(f"{name} folder not found: {source}")
    # Before the output folder is touched (--overwrite empties it) and anything loads: a chat model of the official
    # layout needs its decoder named.
    check_decoder_before_loading(chat, decoder, "--chat", "--decoder")
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it).")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    print(f"loading chat model {chat} ...", file=sys.stderr)
    model = FunAudioChatForConditionalGeneration.from_pretrained(chat, dtype="auto")
    if decoder is not None:
        print(f"loading speech decoder {decoder} ...", file=sys.stderr)
        attach_decoder(model, load_speech_decoder(decoder, speakers_file=speakers, dtype=torch.float32))
    if getattr(model, "token2wav", None) is None:
        raise ValueError(f"{chat} has no speech decoder: pass --decoder (a CosyVoice3 folder or Hub id).")
    processor = AutoProcessor.from_pretrained(chat)

    print(f"writing {out} ...", file=sys.stderr)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    processor.save_pretrained(out)
    package_dir = Path(funaudiochat_hf.__file__).parent
    for path in code_files(package_dir):
        shutil.copy2(path, out / path.name)

    _update_json(out / "config.json", {"auto_map": AUTO_MAP, "custom_pipelines": CUSTOM_PIPELINES})
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if (out / name).is_file():
            _update_json(out / name, {"auto_map": {"AutoProcessor": AUTO_MAP["AutoProcessor"]}})
    speaker_names = list(getattr(model.token2wav.config, "speaker_names", []) or [])
    (out / "README.md").write_text(_model_card(chat, decoder, speaker_names), encoding="utf-8")
    return out


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False, dry_run: bool = False) -> list[str]:
    """Upload `folder` to the Hub model repo `repo_id` (created if needed). With `dry_run`, only list the files
    that would be uploaded (no network). Returns the relative paths."""
    folder = Path(folder)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    if dry_run:
        print(f"dry run: would upload {len(files)} files to https://huggingface.co/{repo_id}")
        for name in files:
            print(f"  {name}")
        return files
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model")
    print(f"uploaded {len(files)} files to https://huggingface.co/{repo_id}")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chat", required=True, help="chat model folder or Hub id, e.g. FunAudioLLM/Fun-Audio-Chat-8B")
    parser.add_argument("--decoder", help="CosyVoice3 folder or Hub id (official or converted), unless --chat has one")
    parser.add_argument("--speakers", help="speaker embeddings file (spk2info.pt) for an official decoder folder")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default: %(default)s)")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the folder to this Hub model repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo as private")
    parser.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list what would be uploaded")
    args = parser.parse_args(argv)
    if args.dry_run and not args.push_to_hub:
        parser.error("--dry-run only applies to --push-to-hub")
    try:
        out = build_hub_repo(
            args.chat, args.out, decoder=args.decoder, speakers=args.speakers, overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
        )
        print(f"wrote {out}")
        if args.push_to_hub:
            push_to_hub(out, args.push_to_hub, private=args.private, dry_run=args.dry_run)
    except (ValueError, OSError) as error:  # OSError covers FileExistsError / FileNotFoundError
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
