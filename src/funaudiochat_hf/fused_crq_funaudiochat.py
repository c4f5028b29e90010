"""Weight copies derived for the decode step: fused q/k/v and gate/up projections of the CRQ speech head, a padded
speech head, and the linear maps around the CRQ stack multiplied out (used by the "cuda_graphs" and "compiled"
backends of `generate_speech`, where the weights allow).

At batch 1 a CRQ sub-step is latency-bound: each of its Qwen3 layers runs 7 small GEMMs (q, k, v, o, gate, up, down)
of a few microseconds each on a GPU, far above the time their weights take to read. Concatenating the q/k/v weights
into one `(q + 2 * kv, hidden)` matrix and the gate/up weights into one `(2 * intermediate, hidden)` matrix makes it
4 GEMMs per layer. `decoder_stack_forward(crq, fused_crq_projections(crq), ...)` (`decoder_stack_funaudiochat`)
runs them; everything else is transformers' own: it mirrors `Qwen3Model.forward` and `Qwen3DecoderLayer.forward`
line by line, calling the model's own norms, rotary embedding, mask builder, cache object, attention function
(`config._attn_implementation`), `o_proj` and `down_proj`, so positions, masks and the cache layout are exactly
those of `crq_transformer(...)`. Results equal it up to float rounding of the GEMMs (a concatenated GEMM may pick
another kernel / reduction order than three separate ones).

Cost: one extra copy of the CRQ's q/k/v and gate/up weights (about 0.6 GB in bfloat16 for the full-size 28-layer,
1024-wide CRQ).

`padded_output_linear` builds another derived copy: the speech head's weight with zero rows up to a multiple of 8
outputs, which cuBLAS multiplies faster at several rows (54 MB at full size).

`folded_crq_matching` multiplies out the linear maps around the CRQ stack ([`FoldedCRQMatching`]): a decode step reads
0.11 instead of 0.55 GB of them at full size, in 11 fewer GEMMs.

The builders keep nothing: the caller owns the copies (`generate_speech`'s `SpeechGenerator`) and passes the copy it
holds as `previous`, which is returned as it is while the source weights are unchanged and rebuilt once they changed
(in place or re-allocated: see [`FusedCRQProjections`]).
"""

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class FusedLayerProjections:
    """Concatenated input projections of one Qwen3 decoder layer.

    Attributes:
        qkv_weight: `(q_size + 2 * kv_size, hidden)`, rows of q_proj, then k_proj, then v_proj.
        qkv_bias: `(q_size + 2 * kv_size,)` or None (Qwen3 has biases only with `attention_bias=True`).
        gate_up_weight: `(2 * intermediate, hidden)`, rows of gate_proj then up_proj.
        gate_up_bias: `(2 * intermediate,)` or None.
        qkv_split: `(q_size, kv_size, kv_size)` output sizes of the fused q/k/v GEMM.
        intermediate_size: output size of gate_proj (= up_proj).
        decode_kernels: run a one-row CUDA decode step of the layer through the Triton kernels of
            `triton_linear_funaudiochat` (norms, activation and residual adds folded into the projections); set per
            run by `with_decode_kernels`, False in the cached copies.
    """

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    qkv_split: tuple[int, int, int]
    intermediate_size: int
    decode_kernels: bool = False


@dataclass
class FusedCRQProjections:
    """The fused projections of every layer of one CRQ Transformer, and the state of the weights they were built from.

    Attributes:
        layers: one [`FusedLayerProjections`] per decoder layer.
        source_state: `(data_ptr, _version)` of every source weight / bias at build time; any in-place update
            (`load_state_dict`, an optimizer step) bumps `_version`, any re-allocation (`.to()`, `.half()`) changes
            `data_ptr`, so a mismatch means the copies are stale.
        kernel_view: the `with_decode_kernels` view of these copies, built on first use (one object per set of
            copies, so a compiled step's guards on it keep holding).
    """

    layers: list[FusedLayerProjections]
    source_state: tuple[tuple[int, int], ...]
    kernel_view: "FusedCRQProjections | None" = field(default=None, repr=False, compare=False)


def _plain_linear(module: nn.Module, name: str, option: str = "fuse_crq_projections") -> nn.Linear:
    # Subclasses (quantized linears) and wrappers (LoRA) compute something else than `weight @ x`: fusing their raw
    # `weight` would silently drop that, so refuse them.
    if type(module) is not nn.Linear:
        raise ValueError(
            f"The plan part {option!r} needs plain `nn.Linear` CRQ projections, but `{name}` is a "
            f"{type(module).__name__} (merge adapters / dequantize first, or turn the part off)."
        )
    if module.weight.device.type == "meta":
        raise ValueError(f"The plan part {option!r}: the weight of `{name}` is not loaded (meta device).")
    return module


def _source_linears(crq: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """`[(q_proj, k_proj, v_proj, gate_proj, up_proj)]` per decoder layer, validated."""
    layers = []
    for index, layer in enumerate(crq.layers[: crq.config.num_hidden_layers]):
        modules = [(f"self_attn.{name}", getattr(layer.self_attn, name)) for name in ("q_proj", "k_proj", "v_proj")]
        modules += [(f"mlp.{name}", getattr(layer.mlp, name)) for name in ("gate_proj", "up_proj")]
        layers.append(tuple(_plain_linear(module, f"layers.{index}.{name}") for name, module in modules))
    return layers


def can_fuse_crq_projections(crq: nn.Module) -> bool:
    """Whether `fused_crq_projections(crq)` would succeed: every q/k/v/gate/up projection is a loaded plain
    `nn.Linear` with consistent biases (False for LoRA wrappers, quantized layers, meta weights)."""
    try:
        linears = _source_linears(crq)
    except ValueError:
        return False
    for q, k, v, gate, up in linears:
        for group in ((q, k, v), (gate, up)):
            if len({linear.bias is None for linear in group}) > 1:
                return False
    return True


def _source_state(linears: list[tuple[nn.Linear, ...]]) -> tuple[tuple[int, int], ...]:
    tensors = [t for layer in linears for linear in layer for t in (linear.weight, linear.bias) if t is not None]
    return tuple((t.data_ptr(), t._version) for t in tensors)


def _concat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError(
            "The plan part 'fuse_crq_projections': some of the projections to fuse have a bias and some do not."
        )
    fused = torch.cat([t.detach() for t in tensors], dim=0)
    # Static address: a CUDA-graphed step reads the copy in place, like a parameter, instead of copying it per call.
    torch._dynamo.mark_static_address(fused)
    return fused


def _build(linears: list[tuple[nn.Linear, ...]], source_state) -> FusedCRQProjections:
    layers = []
    for q, k, v, gate, up in linears:
        layers.append(
            FusedLayerProjections(
                qkv_weight=_concat([q.weight, k.weight, v.weight]),
                qkv_bias=_concat([q.bias, k.bias, v.bias]),
                gate_up_weight=_concat([gate.weight, up.weight]),
                gate_up_bias=_concat([gate.bias, up.bias]),
                qkv_split=(q.out_features, k.out_features, v.out_features),
                intermediate_size=gate.out_features,
            )
        )
    return FusedCRQProjections(layers=layers, source_state=source_state)


@torch.no_grad()
def fused_crq_projections(crq: nn.Module, previous: FusedCRQProjections | None = None) -> FusedCRQProjections:
    """The fused q/k/v and gate/up weights of `crq` (a transformers `Qwen3Model`): `previous` (copies the caller
    holds) while the source weights are those it was built from, else new copies (see [`FusedCRQProjections`]).
    Call this outside `torch.compile`d code (it reads `Tensor._version`) and hand the result to
    `decoder_stack_forward`.

    Raises:
        ValueError: when a projection is not a plain loaded `nn.Linear` (LoRA wrapper, quantized layer, meta weight).
    """
    linears = _source_linears(crq)
    state = _source_state(linears)
    if previous is not None and previous.source_state == state:
        return previous
    return _build(linears, state)


def with_decode_kernels(fused: FusedCRQProjections) -> FusedCRQProjections:
    """The view of `fused` (same weight tensors) whose layers run decode steps through the Triton kernels of
    `triton_linear_funaudiochat`; built once per set of copies (a compiled step guards on the object)."""
    if fused.kernel_view is None:
        layers = [replace(layer, decode_kernels=True) for layer in fused.layers]
        fused.kernel_view = replace(fused, layers=layers, kernel_view=None)
    return fused.kernel_view


# cuBLAS multiplies a weight whose output count is not a multiple of 8 (16 bytes in 16-bit dtypes) with slower,
# unaligned kernels (measured slower for the 6,565-way speech head at several input rows).
OUTPUT_ALIGNMENT = 8


@dataclass
class PaddedLinear:
    """A copy of a linear layer with zero output rows appended up to a multiple of `OUTPUT_ALIGNMENT`; calling it gives
    the layer's outputs (a view of the padded product, without the padding).

    Attributes:
        weight: `(padded_out_features, in_features)`; bias: `(padded_out_features,)` or None.
        out_features: the layer's own output count.
        source_state: `(data_ptr, _version)` of the layer's weight and bias at build time (see `FusedCRQProjections`).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    source_state: tuple[tuple[int, int], ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., in_features)` -> `(..., out_features)`."""
        return F.linear(x, self.weight, self.bias)[..., : self.out_features]


def _padded(tensor: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """`tensor` with zero rows appended up to `rows`, as a static-address copy (`_concat`)."""
    if tensor is None:
        return None
    return _concat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


@torch.no_grad()
def padded_output_linear(linear: nn.Module, previous: PaddedLinear | None = None) -> PaddedLinear | None:
    """The [`PaddedLinear`] of `linear` (`previous` while its weights are those it was built from, as
    `fused_crq_projections`); None when padding does not apply: the output count is already a multiple of
    `OUTPUT_ALIGNMENT`, or `linear` is not a loaded plain `nn.Linear` (a LoRA wrapper or quantized layer computes
    something else than its raw weight). Call it outside `torch.compile`d code."""
    if type(linear) is not nn.Linear or linear.weight.device.type == "meta":
        return None
    rows = -(-linear.out_features // OUTPUT_ALIGNMENT) * OUTPUT_ALIGNMENT
    if rows == linear.out_features:
        return None
    state = _source_state([(linear,)])
    if previous is not None and previous.source_state == state:
        return previous
    return PaddedLinear(_padded(linear.weight, rows), _padded(linear.bias, rows), linear.out_features, state)


@dataclass
class FoldedCRQMatching:
    """The linear maps around the CRQ stack multiplied out, for decoding (`folded_crq_matching`).

    A decode step chains linear maps with nothing between them on both sides of the CRQ stack (H the LLM width, C the
    CRQ's, K sub-positions, V speech tokens, E the speech embedding `(V, H)`, P_k the k-th `(H, H)` block of
    `pre_matching`):

    - a sub-position's input `input_matching(pre_matching(z)_k + E[previous token])` is
      `(W_in P_k) z + (E W_in^T)[previous token]` (+ biases): one `(K * C, H)` GEMM per LLM position instead of a
      `(K * H, H)` one and K `(C, H)` ones, then a row gathered per sub-step;
    - the logits `lm_head(output_matching(h))` are `(W_head W_out) h`: a `(V, C)` GEMM per sub-step instead of a
      `(H, C)` and a `(V, H)` one;
    - the speech fed back to the LLM, the discrete encoder's `output_matching(mean_k E[g_k])`, is
      `mean_k (E W_feedback^T)[g_k]`: K gathered rows instead of an `(H, H)` GEMM.

    At full size that is 0.11 instead of 0.55 GB of weights read per LLM step (bfloat16), in 11 fewer GEMMs, for
    0.12 GB of copies. The products are taken in float64 and rounded once to the weights' dtype, so results equal
    the unfolded maps up to float rounding (in float32 to ~1e-6; in bfloat16 each map's rounding moves).

    Attributes:
        sub_inputs: `input_matching ∘ pre_matching`: H -> K * C (sub-position k of a position is output block k).
        speech_inputs: `(V, C)` `input_matching` of each speech embedding, without its bias (in `sub_inputs`).
        head: `lm_head ∘ output_matching`: C -> V, its weight padded as `padded_output_linear`'s.
        feedback: `(V, H)` the discrete encoder's `output_matching` of each speech embedding, bias included.
        source_state: `(data_ptr, _version)` of every source tensor at build time (see [`FusedCRQProjections`]).
    """

    sub_inputs: PaddedLinear
    speech_inputs: torch.Tensor
    head: PaddedLinear
    feedback: torch.Tensor
    source_state: tuple[tuple[int, int], ...]


# The sources of `FoldedCRQMatching`, in the order `_build_folded` takes them.
_FOLD_SOURCES = (
    "audio_invert_tower.pre_matching",
    "audio_invert_tower.input_matching",
    "audio_invert_tower.output_matching",
    "audio_invert_tower.lm_head",
    "audio_tower.output_matching",  # the discrete encoder's: the speech fed back to the LLM
)


def _fold_sources(model: nn.Module) -> tuple[tuple[nn.Linear, ...], nn.Embedding]:
    """The linears of `_FOLD_SOURCES` and the speech embedding, validated for folding."""
    if getattr(model, "audio_invert_tower", None) is None:
        raise ValueError("The plan part 'fold_crq_matching' needs the CRQ speech decoder (`audio_invert_tower`).")
    linears = tuple(_plain_linear(model.get_submodule(name), name, "fold_crq_matching") for name in _FOLD_SOURCES)
    embedding = model.audio_tower.embed_tokens
    if type(embedding) is not nn.Embedding or embedding.weight.device.type == "meta":
        raise ValueError(
            "The plan part 'fold_crq_matching' needs a loaded plain `nn.Embedding` as `audio_tower.embed_tokens`."
        )
    devices = {t.device for t in _fold_tensors(linears, embedding)}
    if len(devices) > 1:
        raise ValueError(
            f"The plan part 'fold_crq_matching' needs the CRQ's matching layers, speech head and speech embedding on "
            f"one device, found {sorted(map(str, devices))}."
        )
    return linears, embedding


def _fold_tensors(linears: tuple[nn.Linear, ...], embedding: nn.Embedding) -> list[torch.Tensor]:
    return [t for linear in linears for t in (linear.weight, linear.bias) if t is not None] + [embedding.weight]


def can_fold_crq_matching(model: nn.Module) -> bool:
    """Whether `folded_crq_matching(model)` would succeed: plain loaded linears and embedding on one device (False
    for LoRA wrappers, quantized layers, meta weights, a tower split over devices, no speech decoder)."""
    try:
        _fold_sources(model)
    except ValueError:
        return False
    return True


def _static_copy(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` rounded to `like`'s dtype, as a static-address copy (`_concat`)."""
    return _concat([tensor.to(like.dtype)])


def _folded_linear(weight: torch.Tensor, bias: torch.Tensor | None, like: torch.Tensor) -> PaddedLinear:
    """The float64 product `weight` `(out, in)` / `bias` as a [`PaddedLinear`] in `like`'s dtype."""
    rows = -(-weight.shape[0] // OUTPUT_ALIGNMENT) * OUTPUT_ALIGNMENT
    weight, bias = (None if t is None else t.to(like.dtype) for t in (weight, bias))
    return PaddedLinear(_padded(weight, rows), _padded(bias, rows), weight.shape[0], ())


def _float64(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return linear.weight.double(), None if linear.bias is None else linear.bias.double()


def _plus(*terms: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of the terms that are not None (broadcast), or None."""
    terms = [t for t in terms if t is not None]
    return sum(terms[1:], terms[0]) if terms else None


def _build_folded(
    group_size: int, linears: tuple[nn.Linear, ...], embedding: nn.Embedding, state
) -> FoldedCRQMatching:
    pre = linears[0]
    (in_w, in_b), (out_w, out_b), (head_w, head_b), (feedback_w, feedback_b) = map(_float64, linears[1:])
    speech = embedding.weight.double()  # (V, H)
    crq_hidden = in_w.shape[0]
    # Output block k of pre_matching is sub-position k (`split_positions`): K (C, H) products, one block of the
    # (K * H, H) weight in float64 at a time (a whole copy would be 0.7 GB at full size).
    sub_w = torch.cat([in_w @ block.double() for block in pre.weight.chunk(group_size)])  # (K * C, H)
    pre_b = None if pre.bias is None else pre.bias.double().view(group_size, -1)
    sub_b = _plus(None if pre_b is None else pre_b @ in_w.T, in_b)
    sub_b = None if sub_b is None else sub_b.expand(group_size, crq_hidden).flatten()
    like = linears[1].weight
    return FoldedCRQMatching(
        sub_inputs=_folded_linear(sub_w, sub_b, like),
        speech_inputs=_static_copy(speech @ in_w.T, like),
        head=_folded_linear(head_w @ out_w, _plus(None if out_b is None else head_w @ out_b, head_b), like),
        feedback=_static_copy(_plus(speech @ feedback_w.T, feedback_b), linears[4].weight),
        source_state=state,
    )


@torch.no_grad()
def folded_crq_matching(model: nn.Module, previous: FoldedCRQMatching | None = None) -> FoldedCRQMatching:
    """The [`FoldedCRQMatching`] of a `FunAudioChatForConditionalGeneration` (`previous` while the source weights are
    those it was built from, as `fused_crq_projections`). Call it outside `torch.compile`d code.

    Raises:
        ValueError: when a source is not a loaded plain `nn.Linear` / `nn.Embedding`, or they span several devices.
    """
    linears, embedding = _fold_sources(model)
    state = tuple((t.data_ptr(), t._version) for t in _fold_tensors(linears, embedding))
    if previous is not None and previous.source_state == state:
        return previous
    return _build_folded(model.audio_invert_tower.group_size, linears, embedding, state)
