"""The decode-step projections of a Qwen3 stack through Triton kernels, with the layer's norms and activation folded in.

The plan part `crq_linear` runs the CRQ's layers on them, `llm_linear` the LLM's, over its own unfused weights (4
kernels per layer: its q, k and v weights are read by one kernel, `part_weights`, with no concatenated copy); both are
on by default in the fast backends on CUDA when Triton is installed. Each projection with what surrounds it in the
layer is one kernel:

- `qkv = linear(RMSNorm(x))`, `h = x + linear(attention)`, `a = SiLU(gate(RMSNorm(h))) * up(RMSNorm(h))`,
  `y = h + linear(a)`;
- one row (`MAX_ROWS`, a batch-1 decode step): the GEMV kernel of `triton_linear_gemv_funaudiochat`, whose programs
  read their weights once per row (slower than cuBLAS from two rows, where cuBLAS shares each weight read);
- 2 to `ROWS_KERNEL_MAX_ROWS` rows, given `split_k_counters` (`generate_speech` passes its workspace's): the several-row
  kernel of `triton_linear_rows_funaudiochat`, which reads each weight tile once for all rows on tensor cores. There
  the residual projections also return their outputs' sums of squares, which the next input norm adds up
  (`with_squares` / `norm_squares`).

Rounding follows the eager layer: the norm output, each GEMM output and the activation are rounded to the model
dtype where transformers rounds them; only the float32 summation order differs from cuBLAS (results equal the eager
layer up to one rounding of the model dtype; in float32 to ~1e-6). One exception: the one-row kernel folds the norm
of narrow inputs into its products and does not round the normed input (within one more rounding).

The launchers are opaque PyTorch operators (`torch.library.custom_op`) that `torch.compile` keeps in its graph and CUDA
graphs replay. Their tiles, warps and launch kind come from a [`DecodeKernelConfig`], resolved before the operator
(`decode_linear(kernel_config=...)`) and handed to it as its `launch` ints ([`LinearLaunch`]); on GPUs that have them
(sm_90+) the kernels are programmatic dependent launches, whose programs fetch their first weight tiles while the
previous kernel finishes.
"""

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .triton_support import triton
from .triton_config_funaudiochat import MIN_ROWS_BLOCK_N, DecodeKernelConfig
from .triton_linear_gemv_funaudiochat import launch_gemv, part_tile
from .triton_linear_rows_funaudiochat import (
    ROWS_KERNEL_MAX_ROWS,
    SQUARES_GROUP,
    launch_rows,
    row_squares,
    squares_groups,
)


# Input rows (batch x positions) up to which the GEMV kernel replaces cuBLAS: it reads the weights once per row, where
# cuBLAS shares each weight read between the rows (measured faster at one row, slower at two).
MAX_ROWS = 1


class LinearLaunch(NamedTuple):
    """The [`DecodeKernelConfig`] values one projection's launch reads, resolved for its shape: what the operators
    take as `launch` (`to_ints`; empty: resolved from `DecodeKernelConfig.for_device` of x's device)."""

    programmatic: bool
    fold_norm: bool  # the GEMV kernel folds the input norm into its products
    max_shared_memory: int  # bytes a several-row program may use; 0: unchecked
    norm_chunk_elements: int
    gemv_tile: tuple[int, int, int]
    rows_tile: tuple[int, int, int, int, int, bool]

    @classmethod
    def of(cls, config: DecodeKernelConfig, out_features: int, in_features: int, gated: bool) -> "LinearLaunch":
        return cls(
            config.programmatic_launch,
            in_features <= config.gemv_folded_norm_max_features,
            config.max_shared_memory or 0,
            config.rows_norm_chunk_elements,
            config.gemv_kernel_tile(out_features, in_features, gated),
            config.rows_kernel_tile(out_features, in_features, gated),
        )

    def to_ints(self) -> list[int]:
        head = [int(self.programmatic), int(self.fold_norm), self.max_shared_memory, self.norm_chunk_elements]
        return [*head, *self.gemv_tile, *(int(value) for value in self.rows_tile)]

    @classmethod
    def from_ints(cls, launch: list[int]) -> "LinearLaunch":
        programmatic, fold_norm, shared, chunk = launch[:4]
        rows_tile = (*launch[7:12], bool(launch[12]))
        return cls(bool(programmatic), bool(fold_norm), shared, chunk, tuple(launch[4:7]), rows_tile)


def _output_features(weight, gated: bool, up_weight, part_weights) -> int:
    """The output columns of a projection: the gate's rows of a fused gate/up weight, or the sum over the parts."""
    out_features = weight.shape[0] // 2 if gated and up_weight is None else weight.shape[0]
    return out_features + sum(part.shape[0] for part in part_weights)


def launch_decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    up_weight: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    part_weights: list[torch.Tensor] | tuple = (),
    part_biases: list[torch.Tensor] | tuple = (),
    split_k_counters: torch.Tensor | None = None,
    norm_squares: torch.Tensor | None = None,
    with_squares: bool = False,
    config: DecodeKernelConfig | LinearLaunch | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`residual + act(linear(norm(x)))` for a few rows; the body of the `funaudiochat::decode_linear` operator.

    Args:
        x: `(rows, in_features)`, last dimension contiguous; a few rows (each row's programs read all the weights).
        weight: `(out_features, in_features)` contiguous. With `gated` and no `up_weight`, `(2 * out_features,
            in_features)`: the gate rows then the up rows (`FusedLayerProjections.gate_up_weight`).
        bias: None or `(weight.shape[0],)`.
        norm_weight: None, or the `(in_features,)` weight of a Qwen3 RMSNorm applied to x first (with `eps`).
        residual: None or `(rows, out_features)`, added to the output.
        gated: output `SiLU(x @ gate^T) * (x @ up^T)` (the Qwen3 MLP's activation) instead of the plain projection;
            `weight` / `bias` are the gate's.
        up_weight, up_bias: the up projection's `(out_features, in_features)` weight and bias when it is a tensor of
            its own (the LLM's layers), None when it is in `weight`.
        part_weights: up to two more `(out_i, in_features)` weights whose outputs follow `weight`'s in the output
            (a layer's own k and v projections after its q projection: one kernel instead of three). Not with `gated`.
        part_biases: their biases when `bias` is given (then one per part weight), else empty.
        split_k_counters: None, or int32 zeros (one per output column tile, `rows_kernel_tile`): with 2 to
            `ROWS_KERNEL_MAX_ROWS` rows the several-row kernel runs instead of the GEMV kernel (unless a part
            boundary is not a multiple of its narrowest tile, 16 columns); its programs count their arrivals there and
            leave it zero. Not to be shared by launches that may run at the same time (another stream).
        norm_squares: None, or x's sums of squares `(rows, squares_groups(in_features))` float32 (`row_squares`'
            layout: what the launch that wrote x returned `with_squares`), for the norm: the several-row kernel then
            adds these up instead of reading all of x in every program. Needs `norm_weight`.
        with_squares: also return the output's `row_squares` (the several-row kernel stores them in its epilogue).
        config: the kernels' [`DecodeKernelConfig`] (or the [`LinearLaunch`] resolved from it for this shape); None:
            that of x's device.
    Returns:
        `(rows, out_features)` in x's dtype (`out_features` summed over the parts); with `with_squares`, a tuple of
        it and its `(rows, squares_groups(out_features))` float32 sums of squares.
    """
    if len(part_weights) > 2 or (gated and part_weights):
        raise ValueError("`part_weights` takes at most two weights, and not with `gated`.")
    if len(part_biases) != (len(part_weights) if bias is not None else 0):
        raise ValueError("`part_biases` needs one bias per part weight exactly when `bias` is given.")
    # The kernel walks rows by their stride, with unit strides within a row, and reads weights as contiguous matrices.
    x, residual = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (x, residual))
    weight, up_weight = (t if t is None or t.is_contiguous() else t.contiguous() for t in (weight, up_weight))
    part_weights = [t if t.is_contiguous() else t.contiguous() for t in part_weights]
    rows, in_features = x.shape
    if any(part.shape[1] != in_features for part in part_weights):
        raise ValueError(f"Every part weight must take the {in_features} input features of `x`.")
    if norm_squares is not None:
        _check_norm_squares(norm_squares, norm_weight, rows, in_features)
    if gated and up_weight is None:  # views of the fused copy: its two halves are contiguous
        out_features = weight.shape[0] // 2
        weight, up_weight = weight[:out_features], weight[out_features:]
        if bias is not None:
            bias, up_bias = bias[:out_features], bias[out_features:]
    part_ends = list(itertools.accumulate(t.shape[0] for t in (weight, *part_weights)))
    out_features = part_ends[-1]
    if not isinstance(config, LinearLaunch):
        config = LinearLaunch.of(config or DecodeKernelConfig.for_device(x.device), out_features, in_features, gated)
    pdl = bool(config.programmatic)
    parts = [*itertools.zip_longest(part_weights, part_biases), (None, None), (None, None)][:2]
    part_pointers = [x if t is None else t for part in parts for t in part]  # weight_1, bias_1, weight_2, bias_2
    if split_k_counters is not None and 1 < rows <= ROWS_KERNEL_MAX_ROWS:
        squares = None
        if with_squares:
            squares = torch.empty(rows, squares_groups(out_features), dtype=torch.float32, device=x.device)
        out = launch_rows(
            x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated,
            split_k_counters, norm_squares, squares, config.rows_tile, config.max_shared_memory,
            config.norm_chunk_elements, pdl,
        )  # fmt: skip
        if out is not None:
            return (out, squares) if with_squares else out
    # The GEMV kernel: each program reads its row whole, and computes the norm from it.
    block_n, block_k, num_warps = config.gemv_tile
    tile = (part_tile(block_n, part_ends), block_k, num_warps)
    out = launch_gemv(
        x, weight, bias, up_weight, up_bias, part_ends, part_pointers, norm_weight, eps, residual, gated, tile,
        config.fold_norm, pdl,
    )  # fmt: skip
    return (out, row_squares(out)) if with_squares else out


def _check_norm_squares(norm_squares: torch.Tensor, norm_weight: torch.Tensor | None, rows: int, in_features: int):
    """`launch_decode_linear`'s `norm_squares` argument: for a normed input, of `row_squares`' layout."""
    if norm_weight is None:
        raise ValueError("`norm_squares` are the sums of squares of a normed input: give `norm_weight` too.")
    expected = (rows, squares_groups(in_features))
    if tuple(norm_squares.shape) != expected or norm_squares.dtype != torch.float32:
        raise ValueError(
            f"`norm_squares` must be float32 of shape {expected} (the sums of squares of x's {in_features} features "
            f"by {SQUARES_GROUP}), got {norm_squares.dtype} {tuple(norm_squares.shape)}."
        )
    if not norm_squares.is_contiguous():
        raise ValueError("`norm_squares` must be contiguous.")


def _fake_output(x, weight, gated, up_weight, part_weights) -> torch.Tensor:
    """The `(rows, out_features)` output of `launch_decode_linear` as a fake (meta) tensor."""
    return x.new_empty(x.shape[0], _output_features(weight, gated, up_weight, part_weights))


# The operators' bodies (`launch_decode_linear` looked up at each call); `launch`: `LinearLaunch.to_ints()`, or empty.
def _decode_linear(*args, launch=()) -> torch.Tensor:
    return launch_decode_linear(*args, config=LinearLaunch.from_ints(launch) if launch else None)


def _decode_linear_and_squares(*args, launch=()) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_decode_linear(*args, with_squares=True, config=LinearLaunch.from_ints(launch) if launch else None)


# The operators' arguments: `launch_decode_linear`'s but `with_squares`, which picks the operator, and `config`,
# resolved to ints for the projection's shape (`LinearLaunch`).
_OPERATOR_ARGUMENTS = (
    "(Tensor x, Tensor weight, Tensor? bias, Tensor? norm_weight, float eps, Tensor? residual, bool gated, "
    "Tensor? up_weight, Tensor? up_bias, Tensor[] part_weights, Tensor[] part_biases, Tensor? split_k_counters, "
    "Tensor? norm_squares=None, *, int[] launch=[])"
)
if triton is not None:
    # Opaque operators (not `triton_op`): torch.compile's own launches of traced Triton kernels cannot ask for a
    # programmatic dependent launch; with CUDA graphs (the compiled loop's default) the launcher's host code only
    # runs while recording. `split_k_counters` is written while the kernels run but left as it was found (zeros):
    # not a mutation.
    _decode_linear_op = torch.library.custom_op(
        "funaudiochat::decode_linear", _decode_linear, mutates_args=(), schema=f"{_OPERATOR_ARGUMENTS} -> Tensor"
    )
    _decode_linear_and_squares_op = torch.library.custom_op(
        "funaudiochat::decode_linear_and_squares", _decode_linear_and_squares, mutates_args=(),
        schema=f"{_OPERATOR_ARGUMENTS} -> (Tensor, Tensor)",
    )  # fmt: skip

    @_decode_linear_op.register_fake
    def _(x, weight, bias, norm_weight, eps, residual, gated, up_weight, up_bias, part_weights, *rest, launch=()):
        return _fake_output(x, weight, gated, up_weight, part_weights)

    @_decode_linear_and_squares_op.register_fake
    def _(x, weight, bias, norm_weight, eps, residual, gated, up_weight, up_bias, part_weights, *rest, launch=()):
        out = _fake_output(x, weight, gated, up_weight, part_weights)
        return out, x.new_empty(x.shape[0], squares_groups(out.shape[1]), dtype=torch.float32)


def kernel_readable(linears, norms=()) -> bool:
    """Whether the kernels can read these modules as they are: plain `nn.Linear`s (not LoRA-wrapped or quantized: the
    kernels read `weight` as it is) with contiguous weights (else they would be copied on every call), and RMSNorms
    with a weight and `variance_epsilon`."""
    if any(type(linear) is not nn.Linear or not linear.weight.is_contiguous() for linear in linears):
        return False
    return all(hasattr(norm, "variance_epsilon") and getattr(norm, "weight", None) is not None for norm in norms)


def decode_kernels_supported(stack: nn.Module) -> bool:
    """Whether the layers of a Qwen3 stack can run their decode projections through the kernels: a SiLU MLP, and
    projections and RMSNorms (also the q / k norms, see `triton_attention_inputs_funaudiochat`) the kernels can read
    ([`kernel_readable`])."""
    if getattr(stack.config, "hidden_act", None) != "silu":
        return False
    for layer in stack.layers[: stack.config.num_hidden_layers]:
        attention, mlp = layer.self_attn, layer.mlp
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        linears = (*linears, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm)
        if not kernel_readable(linears, norms):
            return False
    return True


@dataclass(frozen=True)
class OwnWeightLayer:
    """`decoder_stack_forward` projections of one layer that runs its decode steps through the kernels with its own
    q/k/v and gate/up weights (the LLM: fused copies of an 8B model's weights would cost ~9 GB)."""

    decode_kernels: bool = True
    qkv_weight: None = None  # None: the layer's own projections, no fused copy
    gate_up_weight: None = None


@dataclass(frozen=True)
class OwnWeightKernels:
    """Per-layer [`OwnWeightLayer`]s of a stack, the `projections` argument of `decoder_stack_forward`."""

    layers: tuple[OwnWeightLayer, ...]


def own_weight_kernels(stack: nn.Module) -> OwnWeightKernels:
    """The [`OwnWeightKernels`] of a Qwen3 stack (a new value, owned by the caller; equal for stacks of as many
    layers, so a compiled step that guards on it does not recompile for a new one)."""
    return OwnWeightKernels(layers=(OwnWeightLayer(),) * stack.config.num_hidden_layers)


def use_decode_kernels(hidden_states: torch.Tensor) -> bool:
    """Whether a `(batch, n, features)` layer input takes the kernels: a CUDA tensor of at most `MAX_ROWS` rows, Triton
    installed (shape and device only, so the choice is a constant of a compiled graph; the run checked the GPU with
    `triton_available`)."""
    rows = hidden_states.numel() // hidden_states.shape[-1]
    return triton is not None and hidden_states.is_cuda and rows <= MAX_ROWS


def split_k_counters_for(stack_configs, device: torch.device | str, batch_size: int = 1) -> torch.Tensor:
    """int32 zeros enough for the several-row kernel over the projections of the Qwen3 stacks of `stack_configs` (a
    config, or a sequence of them: one tensor serves each stack in turn), one per column tile of the widest
    projection (q/k/v together, gate/up), and for the decode attention's arrivals at `batch_size` rows (one per row
    and KV head, and one more: `triton_attention_funaudiochat.launch_decode_attention(counters=...)`), for
    `decoder_stack_forward(split_k_counters=...)`."""
    configs = stack_configs if isinstance(stack_configs, (list, tuple)) else [stack_configs]
    size = 0
    for config in configs:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
        widest = max(qkv, config.intermediate_size, config.hidden_size)
        size = max(size, -(-widest // MIN_ROWS_BLOCK_N), batch_size * config.num_key_value_heads + 1)
    return torch.zeros(size, dtype=torch.int32, device=device)


def use_rows_kernel(hidden_states: torch.Tensor) -> bool:
    """Whether a `(batch, n, features)` layer input can take the several-row kernel (given `split_k_counters`): a
    decode step (one position per row) on CUDA of 2 to `ROWS_KERNEL_MAX_ROWS` rows, Triton installed."""
    rows = hidden_states.numel() // hidden_states.shape[-1]
    one_position = hidden_states.ndim < 3 or hidden_states.shape[-2] == 1
    several = 1 < rows <= ROWS_KERNEL_MAX_ROWS
    return triton is not None and hidden_states.is_cuda and one_position and several


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: nn.Module | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    up: nn.Linear | None = None,
    parts: tuple[nn.Linear, ...] = (),
    split_k_counters: torch.Tensor | None = None,
    norm_squares: torch.Tensor | None = None,
    with_squares: bool = False,
    kernel_config: DecodeKernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`(..., in_features)` -> `(..., out_features)`: `residual + act(linear(norm(x)))` through the operator.

    `norm` is a Qwen3 RMSNorm module (its weight and `variance_epsilon` are used); `gated` as in
    [`launch_decode_linear`], with `up` the up projection when it is not part of `weight`; `parts`: up to two more
    linears of the same input whose outputs follow (`launch_decode_linear`'s `part_weights`); `split_k_counters`: for
    2 to `ROWS_KERNEL_MAX_ROWS` rows, the several-row kernel's counters (see `launch_decode_linear`). `with_squares`:
    also return the output rows' `(rows, groups)` sums of squares, which a next call whose `norm` reads this output
    takes as `norm_squares` (`funaudiochat::decode_linear_and_squares`). `kernel_config`: the kernels'
    [`DecodeKernelConfig`], resolved here for this projection's shape; None: that of x's device, resolved when the
    operator runs."""
    shape = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    flat_residual = None if residual is None else residual.reshape(rows.shape[0], -1)
    operators = torch.ops.funaudiochat
    operator = operators.decode_linear_and_squares if with_squares else operators.decode_linear
    launch = []
    if kernel_config is not None:
        up_weight = None if up is None else up.weight
        out_features = _output_features(weight, gated, up_weight, [part.weight for part in parts])
        # Python ints: a compiled graph specialises on these shapes anyway (the tiles are constants of it).
        launch = LinearLaunch.of(kernel_config, int(out_features), int(x.shape[-1]), gated).to_ints()
    result = operator(
        rows,
        weight,
        bias,
        None if norm is None else norm.weight,
        1e-6 if norm is None else float(norm.variance_epsilon),
        flat_residual,
        gated,
        None if up is None else up.weight,
        None if up is None else up.bias,
        [part.weight for part in parts],
        [] if bias is None else [part.bias for part in parts],
        split_k_counters,
        norm_squares,
        launch=launch,
    )
    out, squares = result if with_squares else (result, None)
    out = out.view(*shape, out.shape[-1])
    return (out, squares) if with_squares else out


__all__ = [
    "MAX_ROWS",
    "ROWS_KERNEL_MAX_ROWS",
    "SQUARES_GROUP",
    "LinearLaunch",
    "OwnWeightKernels",
    "decode_kernels_supported",
    "decode_linear",
    "kernel_readable",
    "launch_decode_linear",
    "own_weight_kernels",
    "row_squares",
    "split_k_counters_for",
    "squares_groups",
    "use_decode_kernels",
    "use_rows_kernel",
]
