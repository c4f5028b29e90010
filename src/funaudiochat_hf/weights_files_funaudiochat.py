"""Name the broken file when a checkpoint's safetensors cannot be read.

transformers passes safetensors' own error through ("Error while deserializing header: incomplete metadata, file not
fully covered"), which does not say which file of which checkpoint is broken. `from_pretrained` of the chat model and
of the CosyVoice3 decoder catch it and raise `unreadable_weights_error(...)` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError


def _local_candidates(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _cached_candidates(repo_id: str, subfolder: str, revision: str | None) -> list[Path]:
    """The safetensors files of a Hub repo that are already in the local cache (nothing is downloaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return []

    def cached(name: str) -> Path | None:
        filename = f"{subfolder}/{name}" if subfolder else name
        try:
            found = try_to_load_from_cache(repo_id, filename, revision=revision)
        except Exception:  # an invalid repo id, ...
            return None
        return Path(found) if isinstance(found, str) else None

    files = [path for path in [cached("model.safetensors")] if path is not None]
    index = cached("model.safetensors.index.json")
    if index is not None:
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            shards = []
        files += [path for path in map(cached, shards) if path is not None]
    return files


def unreadable_weights_error(
    source: str | os.PathLike, error: Exception, subfolder: str = "", revision: str | None = None
) -> OSError:
    """An `OSError` naming the first unreadable `.safetensors` file of `source` (a folder or a cached Hub repo).

    Every candidate file's header is opened (cheap: no tensor is read); if none fails on its own, the message names
    the checkpoint and the original error.
    """
    from safetensors import safe_open

    folder = Path(os.path.expanduser(os.fspath(source)))
    folder = folder / subfolder if subfolder else folder
    if folder.is_dir():
        candidates = _local_candidates(folder)
    else:
        candidates = _cached_candidates(os.fspath(source), subfolder, revision)
    for path in candidates:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as file_error:
            return OSError(
                f"Could not read the weights file {path}: {file_error}. The file is probably truncated or corrupt (an "
                "interrupted download or copy): delete it and download or save the checkpoint again."
            )
    return OSError(f"Could not read the safetensors weights of {os.fspath(source)}: {error}")


@contextlib.contextmanager
def naming_unreadable_weights(source: str | os.PathLike, load_kwargs: dict) -> Iterator[None]:
    """Around a `from_pretrained(source, **load_kwargs)`: safetensors' own error (which does not say which file is
    broken) becomes [`unreadable_weights_error`]."""
    try:
        yield
    except SafetensorError as error:
        subfolder, revision = load_kwargs.get("subfolder") or "", load_kwargs.get("revision")
        raise unreadable_weights_error(source, error, subfolder, revision) from error


__all__ = ["naming_unreadable_weights", "unreadable_weights_error"]
