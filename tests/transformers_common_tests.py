"""transformers' own common model tests (`ModelTesterMixin`, `GenerationTesterMixin`, `ConfigTester`) of the installed
transformers version, made importable for our tester.

They are not in the transformers wheel, so they are fetched once per version into a cache folder
(`$FUNAUDIOCHAT_HF_CACHE` or `~/.cache/funaudiochat_hf`, sub-folder `transformers-tests-<version>`), never copied into
this repository:

1. from GitHub, the files at the release tag: the three entry modules and, followed recursively, every module they
   import relatively;
2. else from the release's source distribution on PyPI (through `pip download`), which ships `tests/test_*common*.py`
   but not the modules they import from sub-folders (`generation/test_utils.py`, `exporters/test_export.py`,
   `utils/test_configuration_utils.py`). Those are written as placeholders defining the imported names (empty classes,
   `None`), and listed in `TransformersTests.placeholders` so the tester skips what depends on them, naming the reason.

The modules are imported as package `transformers_tests_<version>` (not `tests`, which our own folder would shadow).
Delete the cache folder to fetch again.
"""

import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import transformers


ENTRY_MODULES = ("test_modeling_common", "test_configuration_common", "generation.test_utils")
GITHUB_RAW = "https://raw.githubusercontent.com/huggingface/transformers/v{version}/tests/{path}"
FETCH_TIMEOUT_S = 120


@dataclass
class TransformersTests:
    """The imported common-test classes and where they came from."""

    version: str
    source: str  # "github" or "pypi-sdist"
    ModelTesterMixin: type
    GenerationTesterMixin: type
    ConfigTester: type
    placeholders: dict[str, list[str]] = field(default_factory=dict)  # module -> names it stands in for

    def missing(self, module: str) -> str | None:
        """The reason `module` (e.g. `"generation.test_utils"`) is only a placeholder, or None when it is real."""
        if module not in self.placeholders:
            return None
        return (
            f"transformers {self.version}: tests/{module.replace('.', '/')}.py is not in the PyPI source distribution "
            f"and GitHub could not be reached when the common tests were fetched ({cache_dir(self.version)})"
        )


def cache_dir(version: str) -> Path:
    root = Path(os.environ.get("FUNAUDIOCHAT_HF_CACHE", Path.home() / ".cache" / "funaudiochat_hf"))
    return root / f"transformers-tests-{version}"


def _package_name(version: str) -> str:
    return "transformers_tests_" + re.sub(r"\W", "_", version)


def _module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _relative_imports(source: str, module: str) -> list[tuple[str, list[str]]]:
    """`(imported module, names)` of every `from .x import a, b` in `source` (module `module`, dotted, package-relative),
    resolved to package-relative dotted names; imports reaching above the package are dropped."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.level == 0 or node.level - 1 > len(package):
            continue
        base = package[: len(package) - (node.level - 1)]
        target = ".".join(base + (node.module.split(".") if node.module else []))
        found.append((target, [alias.name for alias in node.names]))
    return found


def _download(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
        return response.read()


def _crawl(read, entry_modules) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Follow relative imports from `entry_modules`. `read(path)` returns a file's text or None when it is absent.
    Returns `({path: text}, {missing module: names imported from it})`."""
    files, missing, seen, queue = {}, {}, set(), list(entry_modules)
    while queue:
        module = queue.pop()
        if module in seen:
            continue
        seen.add(module)
        for path in (_module_path(module), module.replace(".", "/") + "/__init__.py"):
            text = read(path)
            if text is not None:
                files[path] = text
                queue.extend(target for target, _ in _relative_imports(text, _importer(path)) if target)
                break
        else:
            missing[module] = set()
    for path, text in files.items():  # the names each missing module would have to define
        for target, names in _relative_imports(text, _importer(path)):
            if target in missing:
                missing[target].update(names)
    return files, {module: sorted(names) for module, names in missing.items()}


def _importer(path: str) -> str:
    """Dotted name whose package is the one relative imports in file `path` resolve against (`a/__init__.py` -> its
    package is `a`, so `a.__init__`)."""
    return path[: -len(".py")].replace("/", ".")


def _fetch_github(version: str) -> dict[str, str]:
    def read(path):
        try:
            return _download(GITHUB_RAW.format(version=version, path=path)).decode()
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    files, missing = _crawl(read, ENTRY_MODULES)
    if missing:
        raise FileNotFoundError(f"not at the v{version} tag on GitHub: {sorted(missing)}")
    return files


def _fetch_sdist(version: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                   f"transformers=={version}", "--dest", tmp]
        result = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        archives = list(Path(tmp).glob("transformers-*.tar.gz"))
        if result.returncode != 0 or not archives:
            raise RuntimeError(f"pip download of the transformers {version} sdist failed: {result.stderr[-500:]}")
        sources = {}
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                parts = member.name.split("/")
                if member.isfile() and len(parts) >= 3 and parts[1] == "tests" and member.name.endswith(".py"):
                    sources["/".join(parts[2:])] = archive.extractfile(member).read().decode()
    files, missing = _crawl(sources.get, ENTRY_MODULES)
    entry_missing = [m for m in ("test_modeling_common", "test_configuration_common") if m in missing]
    if entry_missing:
        raise FileNotFoundError(f"the transformers {version} sdist lacks {entry_missing}")
    return files, missing


def _placeholder_source(module: str, names: list[str]) -> str:
    lines = [f'"""Placeholder: tests/{_module_path(module)} could not be fetched (see transformers_common_tests.py)."""']
    for name in names:
        lines.append(f"class {name}:\n    pass\n" if name[:1].isupper() else f"{name} = None")
    return "\n\n".join(lines) + "\n"


def _write_cache(target: Path, version: str, files: dict, placeholders: dict, source: str) -> None:
    """Write the package atomically (a half-written cache would be taken for a complete one)."""
    package = _package_name(version)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    root = staging / package
    for path, text in {**files, **{_module_path(m): _placeholder_source(m, n) for m, n in placeholders.items()}}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    (staging / "manifest.json").write_text(json.dumps({"source": source, "placeholders": placeholders}, indent=1))
    try:
        staging.rename(target)
    except OSError:  # another process was faster
        shutil.rmtree(staging, ignore_errors=True)


def load() -> TransformersTests:
    """Fetch (once) and import the common tests of the installed transformers.

    Raises:
        RuntimeError: when neither GitHub nor PyPI gives them (the tester module turns this into a skip).
    """
    version = transformers.__version__
    if "dev" in version:
        raise RuntimeError(f"transformers {version} is a development version: no released tests to fetch")
    target = cache_dir(version)
    if not (target / "manifest.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        errors = []
        try:
            _write_cache(target, version, _fetch_github(version), {}, "github")
        except Exception as error:  # noqa: BLE001  (any failure: fall back to the sdist)
            errors.append(f"GitHub: {error}")
            try:
                files, placeholders = _fetch_sdist(version)
                _write_cache(target, version, files, placeholders, "pypi-sdist")
            except Exception as error:  # noqa: BLE001
                errors.append(f"PyPI: {error}")
                raise RuntimeError(f"could not fetch transformers {version}'s common tests ({'; '.join(errors)})")
    manifest = json.loads((target / "manifest.json").read_text())
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    package = _package_name(version)
    modeling = importlib.import_module(f"{package}.test_modeling_common")
    configuration = importlib.import_module(f"{package}.test_configuration_common")
    generation = importlib.import_module(f"{package}.generation.test_utils")
    return TransformersTests(
        version=version,
        source=manifest["source"],
        ModelTesterMixin=modeling.ModelTesterMixin,
        GenerationTesterMixin=generation.GenerationTesterMixin,
        ConfigTester=configuration.ConfigTester,
        placeholders=manifest["placeholders"],
    )
