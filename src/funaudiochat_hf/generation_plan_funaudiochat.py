"""Which parts of the decode loop run, as a pure function of the backend asked for and facts about device and model.

`plan_decode(backend, device_facts, model_facts, ...)` returns a frozen [`DecodePlan`]. It reads no globals and touches
no tensors, so it is unit-tested without a GPU by passing the facts; `DeviceFacts.of(model)` and
`ModelFacts.of(model, ...)` gather them from a real model.

Backends:

- "eager": the plain PyTorch loop (no torch.compile, no Triton kernels, no CUDA graphs): the reference, for debugging.
- "cuda_graphs": the package's Triton kernels and weight copies (fused CRQ projections, folded CRQ matching, padded
  speech head), the text head on a side stream, the decode step recorded as one CUDA graph; no torch.compile. CUDA.
- "compiled": the same parts with the step's three parts (LLM, CRQ sub-step, bookkeeping) and the prefill's layer
  halves compiled by `torch.compile`; also runs on a CPU (no CUDA graph there).
- "auto": a CPU (or other non-CUDA device) -> "eager"; CUDA -> `AUTO_CUDA_BACKEND`; a model dispatched over several
  devices -> "eager". Parts that cannot run (no Triton, compute capability < 8.0, weights the kernels cannot read)
  fall back one by one; `DecodePlan.fallbacks` says which and why (logged once per generator).
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields

from .fused_crq_funaudiochat import can_fold_crq_matching, can_fuse_crq_projections
from .triton_prompt_funaudiochat import prompt_kernels_supported
from .triton_support import triton_available
from .triton_linear_funaudiochat import MAX_ROWS, decode_kernels_supported, kernel_readable
from .triton_sampling_funaudiochat import sampler_kernel_supported
from .triton_text_head_funaudiochat import text_head_supported


BACKENDS = ("auto", "eager", "cuda_graphs", "compiled")
# With `DecodePlan.prefill_graph`, prompts are left-padded to a multiple of this many tokens: one recorded prompt
# graph per bucket; the padding costs a little GPU time (the prompt's forward is cheap next to its eager launches).
PROMPT_BUCKET = 64
# THE choice of "auto" on CUDA (the lead sets it from GPU measurements of "cuda_graphs" against "compiled").
AUTO_CUDA_BACKEND = "cuda_graphs"

# Parts an expert may turn off for debugging (`SpeechGenerator(plan_overrides={part: False})`).
OPTIONAL_PARTS = (
    "fuse_crq_projections",
    "fold_crq_matching",
    "crq_linear",
    "llm_linear",
    "speech_sampler",
    "overlap_text_head",
    "triton_attention",
    "prefill_graph",
    "bookkeeping_kernels",
    "prompt_kernels",
)

# torch.compile options of the compiled step parts (a `compile_config` updates them) and of the prefill's layer halves
# (dynamic shapes: one graph serves every prompt length).
STEP_COMPILE_DEFAULTS = {"fullgraph": True, "dynamic": False}
PREFILL_COMPILE_DEFAULTS = {"fullgraph": True, "dynamic": True}


@dataclass(frozen=True)
class DeviceFacts:
    """Where the model runs.

    Attributes:
        device_type: "cuda", "cpu", ...
        triton: the Triton kernels can run there (Triton importable, CUDA, compute capability >= 8.0).
        dispatched: the model is spread over several devices or offloaded (`device_map`).
    """

    device_type: str
    triton: bool
    dispatched: bool = False

    @classmethod
    def of(cls, model) -> "DeviceFacts":
        device = model.language_model.get_input_embeddings().weight.device
        mapped = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
        dispatched = len(mapped) > 1 or bool(mapped & {"cpu", "disk"})
        return cls(device.type, triton_available(device), dispatched)


@dataclass(frozen=True)
class ModelFacts:
    """What the model's weights allow, for one call's batch size.

    Attributes:
        speech: speech is decoded (a CRQ decoder exists and `disable_speech` is off).
        batch_size: rows of the call.
        crq_fusable: the CRQ's q/k/v and gate/up projections are plain loaded linears (`can_fuse_crq_projections`).
        crq_foldable: the linears around the CRQ stack can be multiplied out (`can_fold_crq_matching`).
        crq_kernels, llm_kernels: the stack's layers are readable by the Triton GEMV kernels.
        crq_head_kernels: the CRQ's matching layers, speech head and final norm are readable by them.
        sampler_kernel: the speech codebook fits the Triton sampler.
        text_head_kernel: the text head fits the Triton text head at this batch size.
        decode_attention: the stacks' attention implementations build `sdpa` / `eager` masks, which the package's
            one-query attention functions accept.
        prompt_kernels: the stacks' layers can run the prompt pass's element-wise kernels (`prompt_kernels_supported`).
    """

    speech: bool
    batch_size: int = 1
    crq_fusable: bool = True
    crq_foldable: bool = True
    crq_kernels: bool = True
    llm_kernels: bool = True
    crq_head_kernels: bool = True
    sampler_kernel: bool = True
    text_head_kernel: bool = True
    decode_attention: bool = True
    prompt_kernels: bool = True

    @classmethod
    def of(cls, model, batch_size: int, disable_speech: bool, text_head_max_rows: int = 16) -> "ModelFacts":
        tower = getattr(model, "audio_invert_tower", None)
        speech = tower is not None and not disable_speech
        llm = model.language_model
        configs = [llm.config] + ([tower.crq_transformer.config] if tower is not None else [])
        masks = all(config._attn_implementation in ("sdpa", "eager") for config in configs)
        stacks = [llm.model] + ([tower.crq_transformer] if speech else [])
        common = dict(
            speech=speech,
            batch_size=batch_size,
            llm_kernels=decode_kernels_supported(llm.model),
            # `text_head_max_rows`: the kernel config's rows up to which the overlapped head pays.
            text_head_kernel=batch_size <= text_head_max_rows and text_head_supported(llm.lm_head, batch_size),
            decode_attention=masks,
            prompt_kernels=all(prompt_kernels_supported(stack) for stack in stacks),
        )
        if not speech:
            return cls(**common, crq_fusable=False, crq_foldable=False, crq_kernels=False, crq_head_kernels=False,
                       sampler_kernel=False)  # fmt: skip
        crq = tower.crq_transformer
        head = (tower.input_matching, tower.output_matching, tower.lm_head)
        return cls(
            **common,
            crq_fusable=can_fuse_crq_projections(crq),
            crq_foldable=can_fold_crq_matching(model),
            crq_kernels=decode_kernels_supported(crq),
            crq_head_kernels=kernel_readable(head, (crq.norm,)),
            sampler_kernel=sampler_kernel_supported(model.config.audio_config.codebook_size),
        )


@dataclass(frozen=True)
class DecodePlan:
    """Which parts of the decode loop run (hashable: part of every compiled / CUDA-graph key).

    Attributes:
        backend: the backend that runs ("eager", "cuda_graphs" or "compiled"; "auto" resolved).
        static_cache: fixed-size `StaticCache`s (else `DynamicCache`s that grow with the reply).
        compile_step: the step's three parts compiled by torch.compile.
        compile_prefill: the prefill's decoder-layer halves compiled by torch.compile (dynamic shapes).
        step_graph: the decode step (and the prefill's last K - 1 CRQ sub-steps) recorded as one CUDA graph.
        prefill_graph: the prompt's forward (the LLM over the prompt, the CRQ's first pass) recorded as one CUDA
            graph per prompt length bucket: the prompt is left-padded to a multiple of `PROMPT_BUCKET` tokens
            (masked), so a few graphs serve every length and the prompt costs its GPU time, not its eager launches.
        attention: the one-query decode attention: "default" (the model's own), "gqa_matmul" (two GQA-aware matmuls,
            `attention_funaudiochat`) or "triton" (`triton_attention_funaudiochat`, with the q/k norms, rotary and
            cache write in its kernels).
        fuse_crq_projections: the CRQ layers run with fused q/k/v and gate/up copies.
        fold_crq_matching: the linear maps around the CRQ stack multiplied out (`FoldedCRQMatching`).
        crq_linear: the CRQ's decode steps through the Triton GEMV kernels (over the fused copies).
        llm_linear: the LLM's decode steps through them (over its own weights).
        crq_head_linear: the CRQ's matching layers and speech head through them too (one-row steps).
        speech_sampler: speech tokens drawn by the Triton sampler.
        pad_speech_head: the speech head, where cuBLAS runs it, through a copy padded to 8 rows.
        overlap_text_head: the text head as a Triton kernel on a side stream during the CRQ sub-steps.
        bookkeeping_kernels: the step's bookkeeping around its stacks as Triton kernels instead of ~50 small
            PyTorch ones: after the LLM stack its final norm, the text head's input and the speech head's conditioning
            (`triton_llm_tail_funaudiochat`); after the text token the stop and speech-end tests, outputs, histories
            and the next LLM input (`triton_finish_funaudiochat`). With the folded CRQ matching, where nothing fuses
            them (not in the compiled step, which Inductor fuses).
        prompt_kernels: the prompt pass's norms, q/k norms with the rotary embedding, residual adds and SiLU as four
            Triton kernels per layer instead of ~45 small PyTorch ones (`triton_prompt_funaudiochat`); not in the
            "compiled" backend, whose compiled layer halves Inductor fuses.
        fallbacks: why parts of the backend do not run here (empty when everything runs).
    """

    backend: str
    static_cache: bool
    compile_step: bool = False
    compile_prefill: bool = False
    step_graph: bool = False
    prefill_graph: bool = False
    attention: str = "default"
    fuse_crq_projections: bool = False
    fold_crq_matching: bool = False
    crq_linear: bool = False
    llm_linear: bool = False
    crq_head_linear: bool = False
    speech_sampler: bool = False
    pad_speech_head: bool = False
    overlap_text_head: bool = False
    bookkeeping_kernels: bool = False
    prompt_kernels: bool = False
    fallbacks: tuple[str, ...] = ()

    def parts(self) -> dict:
        """The plan as a plain dict (for logs and reports)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}.")


def resolve_backend(backend: str, device: DeviceFacts, cache_implementation: str | None) -> tuple[str, tuple[str, ...]]:
    """The backend that runs for `backend` ("auto" resolved), and why "auto" took another than its first choice.

    Raises:
        ValueError: an explicit backend that cannot run here (the reason and what to use instead).
    """
    _check_backend(backend)
    cuda = device.device_type == "cuda"
    if backend == "auto":
        if not cuda:
            return "eager", ()
        if device.dispatched:
            return "eager", ("the model is dispatched over several devices: no CUDA graphs or compiled capture",)
        if cache_implementation == "dynamic":
            return "eager", ("cache_implementation='dynamic': the fast backends need static caches",)
        return AUTO_CUDA_BACKEND, ()
    if backend == "eager":
        return backend, ()
    if device.dispatched:
        raise ValueError(
            f"backend={backend!r} cannot capture a model dispatched over several devices (device_map); use 'eager'."
        )
    if cache_implementation == "dynamic":
        raise ValueError(f"backend={backend!r} needs static caches; drop cache_implementation='dynamic'.")
    if backend == "cuda_graphs" and not cuda:
        raise ValueError(
            f"backend='cuda_graphs' records the decode step as a CUDA graph: it needs the model on a CUDA GPU, this "
            f"one is on {device.device_type}. Use 'eager' (or 'compiled')."
        )
    return backend, ()


def plan_decode(
    backend: str,
    device: DeviceFacts,
    model: ModelFacts,
    cache_implementation: str | None = None,
    overrides: Mapping[str, bool] | None = None,
) -> DecodePlan:
    """The [`DecodePlan`] of one call.

    Args:
        backend: one of `BACKENDS`.
        device, model: the facts (`DeviceFacts.of`, `ModelFacts.of`).
        cache_implementation: "static", "dynamic" or None (the backend's: dynamic for "eager", whose cost then
            follows the reply's length instead of the cache's, static for the others).
        overrides: `{part: False}` turns parts of `OPTIONAL_PARTS` off (debugging); `True` only checks that the
            part can run.

    Raises:
        ValueError: an unknown backend / part, an explicit backend that cannot run here, a part forced on that
            cannot run.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(OPTIONAL_PARTS))
    if unknown:
        raise ValueError(f"Unknown plan overrides {unknown}; the parts are {OPTIONAL_PARTS}.")
    resolved, fallbacks = resolve_backend(backend, device, cache_implementation)
    if resolved == "eager":
        if any(overrides.values()):
            raise ValueError(f"The eager backend runs none of the optional parts; got overrides {overrides}.")
        return DecodePlan("eager", static_cache=cache_implementation == "static", fallbacks=fallbacks)

    notes = list(fallbacks)
    cuda = device.device_type == "cuda"
    kernels = cuda and device.triton
    if cuda and not device.triton:
        notes.append("Triton kernels off: needs the `triton` package and a GPU of compute capability 8.0 or newer")
    speech = model.speech
    available = {
        "fuse_crq_projections": speech and model.crq_fusable,
        "fold_crq_matching": speech and model.crq_foldable,
        "llm_linear": kernels and model.llm_kernels,
        "speech_sampler": speech and kernels and model.sampler_kernel,
        "overlap_text_head": speech and kernels and model.text_head_kernel,
        "triton_attention": kernels and model.decode_attention,
        "prompt_kernels": kernels and model.prompt_kernels,
    }
    if speech and not model.crq_fusable:
        notes.append("fused CRQ projections off: the CRQ's projections are not plain loaded nn.Linear layers")
    if speech and not model.crq_foldable:
        notes.append("folded CRQ matching off: the layers around the CRQ stack are not plain loaded linears")
    if kernels and not model.llm_kernels:
        notes.append("LLM Triton linears off: the LLM's layers are not readable by the kernels")
    if kernels and not model.prompt_kernels:
        notes.append("prompt kernels off: the stacks' norms or MLP activation are not Qwen3's RMSNorm / SiLU")
    if not model.decode_attention:
        notes.append("decode attention: the model's own (its attention implementation is not sdpa / eager)")
    wanted = {}
    for part, can in available.items():
        want = overrides.get(part, True)
        if want and part in overrides and not can:
            raise ValueError(f"The plan part {part!r} cannot run here (device {device}, model {model}).")
        wanted[part] = can and want
    fuse = wanted["fuse_crq_projections"]
    crq_linear = fuse and kernels and model.crq_kernels and overrides.get("crq_linear", True)
    if overrides.get("crq_linear") and not crq_linear:
        raise ValueError("The plan part 'crq_linear' needs the fused CRQ projections and the Triton kernels.")
    crq_head_linear = crq_linear and model.crq_head_kernels
    head_on_kernel = crq_head_linear and model.batch_size <= MAX_ROWS
    if wanted["triton_attention"]:
        attention = "triton"
    elif model.decode_attention:
        attention = "gqa_matmul"
    else:
        attention = "default"
    compiled = resolved == "compiled"
    # The compiled backend compiles the prompt's layers instead (dynamic shapes, no padding).
    prefill_graph = cuda and not compiled and overrides.get("prefill_graph", True)
    if overrides.get("prefill_graph") and not prefill_graph:
        raise ValueError("The plan part 'prefill_graph' needs the 'cuda_graphs' backend on a CUDA GPU.")
    prompt_kernels = wanted["prompt_kernels"] and not compiled
    if overrides.get("prompt_kernels") and not prompt_kernels:
        raise ValueError(
            "The plan part 'prompt_kernels' needs the Triton kernels and a backend other than 'compiled' (which "
            "compiles the prompt's layers)."
        )
    bookkeeping = kernels and wanted["fold_crq_matching"] and not compiled
    bookkeeping_kernels = bookkeeping and overrides.get("bookkeeping_kernels", True)
    if overrides.get("bookkeeping_kernels") and not bookkeeping:
        raise ValueError(
            "The plan part 'bookkeeping_kernels' needs the Triton kernels, the folded CRQ matching and a backend other "
            "than 'compiled'."
        )
    return DecodePlan(
        backend=resolved,
        static_cache=True,
        compile_step=compiled,
        compile_prefill=compiled,
        step_graph=cuda,
        prefill_graph=prefill_graph,
        attention=attention,
        fuse_crq_projections=fuse,
        fold_crq_matching=wanted["fold_crq_matching"],
        crq_linear=crq_linear,
        llm_linear=wanted["llm_linear"],
        crq_head_linear=crq_head_linear,
        speech_sampler=wanted["speech_sampler"],
        # The folded speech head is padded itself; the GEMV kernel needs no padding.
        pad_speech_head=speech and not head_on_kernel and not wanted["fold_crq_matching"],
        overlap_text_head=wanted["overlap_text_head"],
        bookkeeping_kernels=bookkeeping_kernels,
        prompt_kernels=prompt_kernels,
        fallbacks=tuple(notes),
    )


def step_compile_options(compile_options: dict | None, step_graph: bool) -> dict:
    """torch.compile options of the compiled step parts: `STEP_COMPILE_DEFAULTS` updated with the call's
    `compile_config`. The parts record no CUDA graphs of their own: on CUDA the whole step is one (`step_graph`), so
    the mode "reduce-overhead" (`CompileConfig`'s default) is dropped and, under the step graph, "max-autotune"
    becomes "max-autotune-no-cudagraphs"."""
    options = {**STEP_COMPILE_DEFAULTS, **(compile_options or {})}
    mode = options.pop("mode", None)
    if step_graph and mode == "max-autotune":
        options["mode"] = "max-autotune-no-cudagraphs"
    elif mode not in (None, "reduce-overhead"):
        options["mode"] = mode
    return options


def prefill_compile_options(compile_options: dict | None) -> dict:
    """torch.compile options of the prefill's layer halves: dynamic shapes, no CUDA graphs (every prompt length
    would record its own), the call's `compile_config` backend."""
    options = dict(PREFILL_COMPILE_DEFAULTS)
    if compile_options and "backend" in compile_options:
        options["backend"] = compile_options["backend"]
    return options


__all__ = [
    "AUTO_CUDA_BACKEND",
    "BACKENDS",
    "PROMPT_BUCKET",
    "DecodePlan",
    "DeviceFacts",
    "ModelFacts",
    "OPTIONAL_PARTS",
    "plan_decode",
    "prefill_compile_options",
    "resolve_backend",
    "step_compile_options",
]
