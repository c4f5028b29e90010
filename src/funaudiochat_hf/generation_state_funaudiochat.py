"""`SpeechGenerator`: the owner of everything `generate_speech` keeps between calls.

A generator holds, for one model: the decode workspaces (static KV caches and per-row state, `DecodeWorkspace`), the
weight copies the fast backends read (`DecodeWeights`: fused CRQ projections, padded / folded heads, own-weight kernel
views), the CUDA graphs recorded on its workspaces, its compiled step functions and the text head's side stream.
`memory_bytes()` reports what its tensors take; `close()` (or leaving a `with` block) frees them. Nothing of this
lives in module-level state, and nothing is set on the model or its config during a call (the speech decoder takes
its device's defaults once, at its first call there: `CosyVoice3Token2Wav.apply_device_defaults`).

`model.generate_speech(...)` uses the model's default generator (made at the first call, grown when a call needs a
larger batch or cache, closed by `model.clear_speech_caches()`), or the one passed as `speech_generator=`.

Threads: a generator runs one call at a time. A call that finds the model's default generator busy in another thread
decodes with a temporary generator of its own (closed after the call: no reuse of caches or CUDA graphs); a call
given an explicit `speech_generator` waits until it is free. A stream holds its generator until it is exhausted or
closed, so a call (or `close()`) in the thread that holds it would wait forever: it raises instead (the default
generator's call takes a temporary one).
"""

import threading
from collections import OrderedDict
from collections.abc import Mapping

import torch
from transformers.utils import logging

from .decoder_stack_funaudiochat import EAGER_HALVES, DecoderLayerHalves
from .fused_crq_funaudiochat import (
    folded_crq_matching,
    fused_crq_projections,
    padded_output_linear,
    with_decode_kernels,
)
from .generation_plan_funaudiochat import (
    BACKENDS,
    DecodePlan,
    DeviceFacts,
    ModelFacts,
    plan_decode,
    prefill_compile_options,
    step_compile_options,
)
from .generation_step_funaudiochat import CompiledParts, decode_step, prefill_crq_steps, recompile_limit
from .triton_config_funaudiochat import DecodeKernelConfig
from .generation_workspace_funaudiochat import DecodeWorkspace, StepConfig, storage_bytes
from .step_graph_funaudiochat import CapturedStep
from .triton_linear_funaudiochat import own_weight_kernels
from .triton_prompt_funaudiochat import PROMPT_KERNEL_HALVES
from .triton_text_head_funaudiochat import OverlappedTextHead


logger = logging.get_logger(__name__)

# Static caches are sized to a multiple of this many LLM positions, so calls with slightly different prompt lengths
# reuse the same workspace and the same graphs.
CACHE_LENGTH_MULTIPLE = 128
# Static workspaces a generator keeps for reuse (least recently used dropped first).
MAX_CACHED_WORKSPACES = 2


class DecodeWeights:
    """The weight copies a plan's decode step reads, built from the model when first needed and rebuilt when the
    source weights changed (in place or re-allocated; the builders of `fused_crq_funaudiochat` compare them)."""

    def __init__(self):
        self.fused = None  # FusedCRQProjections
        self.padded_head = None  # PaddedLinear of the speech head
        self.folded = None  # FoldedCRQMatching
        self.llm_kernels = None  # OwnWeightKernels of the LLM (no tensors: one object, a compiled step guards on it)

    def attach(self, model, plan: DecodePlan, ws: DecodeWorkspace) -> None:
        """Refresh the copies `plan` needs and hand them to `ws` (outside any compiled code: reads `_version`)."""
        tower = model.audio_invert_tower
        ws.fused_crq = ws.speech_head = ws.folded = ws.llm_kernels = None
        if plan.fuse_crq_projections:
            self.fused = fused_crq_projections(tower.crq_transformer, self.fused)
            ws.fused_crq = with_decode_kernels(self.fused) if plan.crq_linear else self.fused
        if plan.pad_speech_head:
            self.padded_head = padded_output_linear(tower.lm_head, self.padded_head)
            ws.speech_head = self.padded_head
        if plan.fold_crq_matching:
            self.folded = folded_crq_matching(model, self.folded)
            ws.folded = self.folded
        if plan.llm_linear:
            if self.llm_kernels is None:
                self.llm_kernels = own_weight_kernels(model.language_model.model)
            ws.llm_kernels = self.llm_kernels

    def tensors(self) -> list[torch.Tensor]:
        tensors = []
        if self.fused is not None:
            for layer in self.fused.layers:
                tensors += [layer.qkv_weight, layer.qkv_bias, layer.gate_up_weight, layer.gate_up_bias]
        if self.padded_head is not None:
            tensors += [self.padded_head.weight, self.padded_head.bias]
        if self.folded is not None:
            folded = self.folded
            tensors += [folded.sub_inputs.weight, folded.sub_inputs.bias, folded.head.weight, folded.head.bias]
            tensors += [folded.speech_inputs, folded.feedback]
        return [tensor for tensor in tensors if tensor is not None]


class SpeechGenerator:
    """Owner of the decoding state of one model (see the module docstring).

    Args:
        model: a `FunAudioChatForConditionalGeneration`.
        max_batch_size: the largest batch it decodes.
        max_length: LLM positions (prompt + reply) its static caches hold; None: sized by each call (prompt +
            `max_new_tokens`, rounded up to `CACHE_LENGTH_MULTIPLE`). A call that needs more raises.
        backend: the default backend of its calls (`generation_plan_funaudiochat.BACKENDS`).
        kernel_config: the Triton kernels' tuning (`DecodeKernelConfig`), carried in every step configuration.
        plan_overrides: `{part: False}` turns parts of the fast backends off (debugging; see
            `generation_plan_funaudiochat.OPTIONAL_PARTS`).
        growable: grow `max_batch_size` / `max_length` when a call needs more instead of raising (the model's
            default generator).
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 1,
        max_length: int | None = None,
        backend: str = "auto",
        kernel_config=None,
        plan_overrides: Mapping[str, bool] | None = None,
        *,
        growable: bool = False,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}.")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"`max_batch_size` must be an int >= 1, got {max_batch_size!r}.")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
            raise ValueError(f"`max_length` must be None or an int >= 2, got {max_length!r}.")
        if kernel_config is not None and not isinstance(kernel_config, DecodeKernelConfig):
            raise TypeError(f"`kernel_config` must be a DecodeKernelConfig or None, got {type(kernel_config).__name__}.")
        self.model = model
        self.max_batch_size, self.max_length = max_batch_size, max_length
        self.backend, self.kernel_config = backend, kernel_config
        self.plan_overrides = dict(plan_overrides or {})
        self.growable = growable
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding `_lock` (None: free)
        self._workspaces: OrderedDict = OrderedDict()  # (batch, cache length, output_logits) -> DecodeWorkspace
        self._weights = DecodeWeights()
        self._compiled_parts: dict = {}  # compile options key -> CompiledParts
        self._prefill_halves: dict = {}  # compile options key -> compiled DecoderLayerHalves
        self._logged: set = set()
        self.closed = False

    # ------------------------------------------------------------------ lifetime
    def memory_bytes(self) -> int:
        """Bytes held by its tensors: workspaces (caches, buffers) and weight copies (CUDA graph pools not counted)."""
        tensors = [t for ws in self._workspaces.values() for t in [*ws._buffers(), *ws._cache_tensors()]]
        return storage_bytes(tensors + self._weights.tensors())

    def close(self) -> None:
        """Free everything it holds (a later call builds it again)."""
        self.acquire()
        try:
            self._release_all()
        finally:
            self.release()

    def _release_all(self) -> None:
        self._workspaces.clear()
        self._weights = DecodeWeights()
        self._compiled_parts.clear()
        self._prefill_halves.clear()

    def __enter__(self) -> "SpeechGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, *args, **kwargs):
        """`model.generate_speech(*args, **kwargs)` with this generator."""
        return self.model.generate_speech(*args, speech_generator=self, **kwargs)

    def stream(self, *args, **kwargs):
        """`model.generate_speech_stream(*args, **kwargs)` with this generator."""
        return self.model.generate_speech_stream(*args, speech_generator=self, **kwargs)

    def acquire(self, blocking: bool = True) -> bool:
        """Take the generator for one call (`release()` after it). Where this thread holds it already (an unfinished
        stream), `blocking=True` raises a RuntimeError instead of waiting forever and `blocking=False` returns
        False."""
        if self._owner == threading.get_ident():  # only this thread writes its own id here
            if not blocking:
                return False
            raise RuntimeError(
                "This SpeechGenerator is in use by an unfinished stream in this thread: exhaust or close() it first "
                "(waiting for it here would never end)."
            )
        if not self._lock.acquire(blocking=blocking):
            return False
        self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def temporary_copy(self) -> "SpeechGenerator":
        """A new generator with the same settings (for a call that finds this one busy)."""
        return SpeechGenerator(
            self.model, self.max_batch_size, self.max_length, self.backend, self.kernel_config, self.plan_overrides,
            growable=True,
        )  # fmt: skip

    # ------------------------------------------------------------------ per call (the caller holds the lock)
    def kernel_config_for(self, device: torch.device) -> DecodeKernelConfig:
        """The generator's `kernel_config`, or where it has none the tuning of `device`'s GPU."""
        return self.kernel_config if self.kernel_config is not None else DecodeKernelConfig.for_device(device)

    def plan(self, backend: str | None, batch_size: int, disable_speech: bool, cache_implementation) -> DecodePlan:
        """The decode plan of a call (logs the fallbacks once per generator)."""
        device = self.model.language_model.get_input_embeddings().weight.device
        max_rows = self.kernel_config_for(device).text_head_overlap_max_rows
        facts = ModelFacts.of(self.model, batch_size, disable_speech, max_rows)
        plan = plan_decode(
            backend or self.backend, DeviceFacts.of(self.model), facts, cache_implementation, self.plan_overrides
        )
        if plan.fallbacks and plan.fallbacks not in self._logged:
            self._logged.add(plan.fallbacks)
            logger.warning(f"generate_speech runs backend {plan.backend!r}; {'; '.join(plan.fallbacks)}.")
        return plan

    def holds(self, needed: int) -> bool:
        """Whether a call that needs `needed` LLM cache positions fits (or may grow) this generator."""
        return self.growable or self.max_length is None or needed <= self.max_length

    def cache_length(self, batch_size: int, needed: int, static: bool) -> int:
        """LLM cache positions of a call that needs `needed` (prompt + max_new_tokens); checks or grows the limits."""
        if batch_size > self.max_batch_size:
            if not self.growable:
                raise ValueError(
                    f"The batch has {batch_size} rows but this SpeechGenerator holds at most max_batch_size="
                    f"{self.max_batch_size}; make one with a larger max_batch_size."
                )
            self.max_batch_size = batch_size
        if self.max_length is not None and needed > self.max_length:
            if not self.holds(needed):
                raise ValueError(
                    f"The call needs {needed} LLM cache positions (prompt + max_new_tokens) but this SpeechGenerator "
                    f"holds max_length={self.max_length}; lower max_new_tokens or make one with a larger max_length."
                )
            self.max_length = None
        if self.max_length is not None and static:
            return self.max_length
        rounded = -(-needed // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE
        if static:  # a kept workspace at least as long serves (its graphs too)
            lengths = [length for (batch, length, *_) in self._workspaces if batch == batch_size and length >= needed]
            return min(lengths, default=rounded)
        return needed

    def workspace(
        self,
        batch_size: int,
        cache_length: int,
        cfg: StepConfig,
        per_row_sampling: bool = False,
        rows_of: DecodeWorkspace | None = None,
    ) -> DecodeWorkspace:
        """A workspace for the call, with the plan's weight copies and text head attached (static: kept for reuse).
        `per_row_sampling`: its sampling values are per row (`DecodeWorkspace`). `rows_of`: a view of the first
        `batch_size` rows of that (static, prefilled) workspace instead (`DecodeWorkspace.first_rows`), which owns
        the storage; the view is not kept here."""
        plan = cfg.plan
        if rows_of is not None:
            if cache_length != rows_of.max_length:
                raise ValueError(f"A view of a workspace's rows has its {rows_of.max_length} cache columns.")
            ws = rows_of.first_rows(batch_size)
        elif not plan.static_cache:
            ws = DecodeWorkspace(self.model, batch_size, cache_length, False, cfg.output_logits, per_row_sampling)
        else:
            key = (batch_size, cache_length, cfg.output_logits, per_row_sampling)
            ws = self._workspaces.pop(key, None)
            if ws is None:
                ws = DecodeWorkspace(self.model, batch_size, cache_length, True, cfg.output_logits, per_row_sampling)
            self._workspaces[key] = ws
            while len(self._workspaces) > MAX_CACHED_WORKSPACES:
                self._workspaces.popitem(last=False)
        self._weights.attach(self.model, plan, ws)
        if plan.overlap_text_head and ws.text_head is None:
            ws.text_head = OverlappedTextHead(ws.device)
        return ws

    def step_functions(self, cfg: StepConfig, compile_options: dict | None):
        """`(step, prefill_crq_steps, prefill_halves)` of a plan: the decode step, the function running the prefill's
        last K - 1 (decode-shaped) CRQ sub-steps, and the layer halves of the prefill forward (None: the models' own
        forwards)."""
        plan = cfg.plan
        step, prefill_crq, halves = decode_step, prefill_crq_steps, None
        if plan.compile_step:
            options = step_compile_options(compile_options, plan.step_graph)
            key = tuple(sorted((name, repr(value)) for name, value in options.items()))
            if key not in self._compiled_parts:
                logger.warning(
                    f"generate_speech: the first call compiles the decode step ({options}); this takes a while "
                    "(minutes at full size), later calls reuse it."
                )
                self._compiled_parts[key] = CompiledParts(options)
            parts = self._compiled_parts[key]
            step, prefill_crq = parts, parts.prefill_crq_steps
        if plan.compile_prefill:
            options = prefill_compile_options(compile_options)
            key = tuple(sorted((name, repr(value)) for name, value in options.items()))
            if key not in self._prefill_halves:
                logger.warning(
                    f"generate_speech: the first call compiles the prompt's layers ({options}); later calls reuse them."
                )
                self._prefill_halves[key] = DecoderLayerHalves(
                    *(_limited(torch.compile(half, **options)) for half in EAGER_HALVES)
                )
            halves = self._prefill_halves[key]
        elif plan.prompt_kernels:
            halves = PROMPT_KERNEL_HALVES
        if plan.step_graph:
            # Keyed by everything the recorded work depends on besides the tensors (`StepGraphs.check`).
            key = (cfg,)  # `cfg` carries the plan and the kernel config
            step = CapturedStep(step, ("step", *key))
            prefill_crq = CapturedStep(prefill_crq, ("prefill_crq", *key))
        return step, prefill_crq, halves


def _limited(function):
    """`function` called under `recompile_limit()` (a compiled layer half)."""

    def call(*args, **kwargs):
        with recompile_limit():
            return function(*args, **kwargs)

    return call


__all__ = ["CACHE_LENGTH_MULTIPLE", "DecodeWeights", "SpeechGenerator"]
