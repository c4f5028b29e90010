"""Reading the official CosyVoice3 files (`cosyvoice3.yaml`, `flow.pt`, `hift.pt`, `spk2info.pt`).

Only used when converting / loading with `CosyVoice3Token2Wav.from_original`; inference never imports it.
The yaml is read without hyperpyyaml: its `!new:` / `!name:` / `!apply:` tags are dropped and `!ref <name>`
expressions are resolved against the top-level values (only arithmetic such as `<chunk_size> * 2`), within bounds on
size, nesting and expansion, so a small hostile file gets a clear error instead of a hang.
"""

import ast
import operator
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml

from .configuration_cosyvoice3 import CosyVoice3Config


SPEAKER_FILES = ("spk2info.pt", "new_spk2info.pt")

# yaml `hift:` keys passed as-is to CosyVoice3HiFTGenerator (the f0 predictor's kwargs become a dict).
HIFT_KEYS = (
    "in_channels", "base_channels", "nb_harmonics", "sampling_rate", "nsf_alpha", "nsf_sigma", "nsf_voiced_threshold",
    "upsample_rates", "upsample_kernel_sizes", "istft_params", "resblock_kernel_sizes", "resblock_dilation_sizes",
    "source_resblock_kernel_sizes", "source_resblock_dilation_sizes", "lrelu_slope", "audio_limit",
    "conv_pre_look_right", "f0_predictor",
)


class _Ref(str):
    """An unresolved `!ref` expression."""


class _TagTolerantLoader(yaml.SafeLoader):
    """SafeLoader that ignores hyperpyyaml object tags and keeps `!ref` expressions for later resolution."""


def _construct_tagged(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_TagTolerantLoader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))
_TagTolerantLoader.add_multi_constructor("!", _construct_tagged)

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Div: operator.truediv, ast.USub: operator.neg}

# Bounds on what a cosyvoice3.yaml may cost to read. The official file is ~10 KB with a few hundred values nested a
# few levels deep; yaml aliases (`&a` / `*a`) can make a 1 KB file describe an exponentially large tree, and `!ref`
# expressions can build huge numbers or strings, so the reader counts what it builds and refuses past these.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000  # values produced by resolution (an alias counts once per place it is used)
MAX_YAML_DEPTH = 32  # nesting of mappings / sequences (a self-referencing alias is infinitely deep)
MAX_REF_MAGNITUDE = 1 << 62  # numbers a `!ref` expression may produce
MAX_REF_STRING = 4096  # characters a `!ref` expression may produce


def _number(value: Any, expression: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`!ref {expression}`: arithmetic needs numbers, got {value!r}")
    return value


def _evaluate(node: ast.AST, expression: str) -> Any:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, expression)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, expression), _evaluate(node.right, expression)
        if isinstance(node.op, ast.Add) and isinstance(left, str) and isinstance(right, str):
            result = left + right
        else:
            try:
                result = _OPERATORS[type(node.op)](_number(left, expression), _number(right, expression))
            except ZeroDivisionError:
                raise ValueError(f"`!ref {expression}` divides by zero") from None
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        result = _OPERATORS[type(node.op)](_number(_evaluate(node.operand, expression), expression))
    else:
        raise ValueError(f"unsupported expression `!ref {expression}`")
    too_big = len(result) > MAX_REF_STRING if isinstance(result, str) else not abs(result) <= MAX_REF_MAGNITUDE
    if too_big:
        raise ValueError(f"`!ref {expression}` gives a value out of range")
    return result


class _Resolver:
    """Resolves `!ref` expressions against the top-level scalars, counting the values it builds (see the bounds)."""

    def __init__(self, top: dict, path: Union[str, Path]):
        self.top = top
        self.path = path
        self.num_values = 0
        self.resolving: list[str] = []  # names being resolved, to catch `a: !ref <b>`, `b: !ref <a>`
        self.resolved: dict[str, Any] = {}

    def _error(self, reason: str) -> ValueError:
        return ValueError(f"{self.path}: {reason}; is it a CosyVoice3 yaml?")

    def name(self, name: str) -> Any:
        if name in self.resolved:
            return self.resolved[name]
        if name in self.resolving:
            raise self._error(f"circular `!ref` ({' -> '.join(self.resolving + [name])})")
        if name not in self.top:
            raise self._error(f"`!ref <{name}>` names no top-level value")
        if len(self.resolving) >= MAX_YAML_DEPTH:
            raise self._error(f"`!ref` chains longer than {MAX_YAML_DEPTH} ({' -> '.join(self.resolving[:3])} -> ...)")
        self.resolving.append(name)
        try:
            value = self(self.top[name], depth=0)
        finally:
            self.resolving.pop()
        self.resolved[name] = value
        return value

    def __call__(self, value: Any, depth: int = 0) -> Any:
        self.num_values += 1
        if self.num_values > MAX_YAML_VALUES:
            raise self._error(f"it expands to more than {MAX_YAML_VALUES} values (nested yaml aliases?)")
        if depth > MAX_YAML_DEPTH:
            raise self._error(f"it nests deeper than {MAX_YAML_DEPTH} levels (a self-referencing alias?)")
        if isinstance(value, _Ref):
            expression = re.sub(r"<([\w.]+)>", lambda m: repr(self.name(m.group(1))), value)
            try:
                return _evaluate(ast.parse(expression, mode="eval"), value)
            except ValueError as error:
                raise self._error(str(error)) from None
            except (SyntaxError, RecursionError, MemoryError) as error:
                raise self._error(f"cannot resolve `!ref {value}`") from error
        if isinstance(value, dict):
            return {key: self(item, depth + 1) for key, item in value.items()}
        if isinstance(value, list):
            return [self(item, depth + 1) for item in value]
        return value


def read_cosyvoice3_yaml(path: Union[str, Path]) -> dict:
    """The `flow` and `hift` sections of cosyvoice3.yaml as plain dicts (references resolved).

    Raises `ValueError` for a file that is not a CosyVoice3 yaml or costs more than the bounds above to read.
    """
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{path} is {size} bytes, more than a CosyVoice3 yaml ({MAX_YAML_BYTES} bytes at most)")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_TagTolerantLoader)
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not a readable yaml file: {error}") from None
    if not isinstance(raw, dict) or "flow" not in raw or "hift" not in raw:
        raise ValueError(f"{path} has no `flow:` / `hift:` sections; is it a CosyVoice3 yaml?")
    top = {key: value for key, value in raw.items() if not isinstance(value, (dict, list))}
    resolve = _Resolver(top, path)
    return {"top": resolve(top), "flow": resolve(raw["flow"]), "hift": resolve(raw["hift"])}


def config_from_yaml(path: Union[str, Path], speaker_names: Optional[list[str]] = None) -> CosyVoice3Config:
    sections = read_cosyvoice3_yaml(path)
    flow, hift, top = sections["flow"], sections["hift"], sections["top"]
    try:
        pre = flow["pre_lookahead_layer"]
        decoder = flow["decoder"]
        cfm = decoder.get("cfm_params", {})
        cfm = cfm.get("content", cfm)
        dit = decoder["estimator"]
    except KeyError as error:
        raise ValueError(f"{path}: missing flow entry {error}") from error
    if cfm.get("solver", "euler") != "euler":
        raise ValueError(f"{path}: only the 'euler' solver is supported, got {cfm['solver']!r}")
    hift_config = {key: hift[key] for key in HIFT_KEYS if key in hift}
    return CosyVoice3Config(
        vocab_size=flow["vocab_size"],
        token_embedding_dim=flow["input_size"],
        mel_bins=flow["output_size"],
        spk_embed_dim=flow["spk_embed_dim"],
        token_mel_ratio=flow["token_mel_ratio"],
        pre_lookahead_len=flow["pre_lookahead_len"],
        pre_lookahead_channels=pre["channels"],
        dit_dim=dit["dim"],
        dit_depth=dit["depth"],
        dit_heads=dit["heads"],
        dit_dim_head=dit["dim_head"],
        dit_ff_mult=dit["ff_mult"],
        static_chunk_size=dit.get("static_chunk_size", 50),
        inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
        t_scheduler=cfm.get("t_scheduler", "cosine"),
        hift_config=hift_config,
        sampling_rate=top.get("sample_rate", hift.get("sampling_rate", 24000)),
        speaker_names=speaker_names,
    )


def read_speakers(path: Union[str, Path], speaker_names: Optional[list[str]] = None) -> tuple[list[str], torch.Tensor]:
    """spk2info file ({name: {"embedding": (1, 192), ...}}) -> (names, (n, 192) float32)."""
    info = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(info, dict) or not all(isinstance(v, dict) and "embedding" in v for v in info.values()):
        raise ValueError(f"{path} is not a spk2info file ({{name: {{'embedding': (1, 192)}}}})")
    names = list(info) if speaker_names is None else list(speaker_names)
    unknown = [name for name in names if name not in info]
    if unknown:
        raise ValueError(f"speakers {unknown} not in {path}; available: {list(info)}")
    if not names:
        return [], torch.zeros(0, 192)
    embeddings = torch.stack([info[name]["embedding"].reshape(-1).float() for name in names])
    return names, embeddings


def load_original_checkpoint(
    cls: type,
    model_dir: Union[str, Path],
    speakers_file: Optional[Union[str, Path]] = None,
    speaker_names: Optional[list[str]] = None,
):
    """`cls` (a `CosyVoice3Token2Wav`) built from an official folder; see `CosyVoice3Token2Wav.from_original`."""
    model_dir = Path(model_dir)
    for name in ("cosyvoice3.yaml", "flow.pt", "hift.pt"):
        if not (model_dir / name).is_file():
            raise FileNotFoundError(f"{model_dir} has no {name} (expected an official CosyVoice3 folder)")
    if speakers_file is None:
        found = [model_dir / name for name in SPEAKER_FILES if (model_dir / name).is_file()]
        speakers_file = found[0] if found else None
    if speakers_file is None and speaker_names:
        raise ValueError(
            f"speaker_names={speaker_names} were given but {model_dir} has no speakers file "
            f"({' / '.join(SPEAKER_FILES)}); pass `speakers_file=` (e.g. Fun-Audio-Chat's utils/new_spk2info.pt)."
        )
    names, embeddings = ([], None) if speakers_file is None else read_speakers(speakers_file, speaker_names)
    config = config_from_yaml(model_dir / "cosyvoice3.yaml", names)
    model = cls(config)
    flow_state = torch.load(model_dir / "flow.pt", map_location="cpu", weights_only=True)
    missing, unexpected = model.flow.load_state_dict(flow_state, strict=False)
    missing = [key for key in missing if not key.endswith("rotary_embed.inv_freq")]  # recomputed if absent
    if missing or unexpected:
        raise ValueError(f"flow.pt does not match the config: missing {missing}, unexpected {unexpected}")
    hift_state = torch.load(model_dir / "hift.pt", map_location="cpu", weights_only=True)
    model.hift.load_original_state_dict(hift_state)
    if names:  # no stored voices: the (0, spk_embed_dim) buffer stays as built
        if embeddings.shape[1] != config.spk_embed_dim:
            raise ValueError(f"speaker embeddings have {embeddings.shape[1]} dims, expected {config.spk_embed_dim}")
        with torch.no_grad():
            model.speaker_embeddings.copy_(embeddings)
    # The fixed noise tables were generated by the constructor (`_init_weights`); loading does not touch them.
    return model.eval()
