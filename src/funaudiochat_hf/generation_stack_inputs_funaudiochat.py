"""The attention masks and rotary tables of a decode step's stack calls, prepared together at the step's start.

A decode step calls the LLM stack once and the CRQ stack K times, each over one new position. Each call built its own
attention mask (`create_causal_mask`: about ten small ops) and rotary tables (`compat.rotary_tables`: nine), and in
the CUDA-graphed step (the "cuda_graphs" backend, no Inductor to fuse them) every op is a kernel launch of its own:
over a hundred a step. Their values only depend on where each call writes: the LLM at its cache length, CRQ sub-step
i at the CRQ cache's length + i and position + i. `decode_stack_inputs` computes them in one pass per stack (the K
sub-steps' as one batch): the same values, as the mask over a static cache is its columns up to the written one and
the run's key mask, and the default rope's tables are elementwise in the positions, so they are gathered from tables of
every cache position that the workspace keeps (`DecodeWorkspace.decode_table`, with the column indices).
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .compat import rotary_tables
from .generation_workspace_funaudiochat import DecodeWorkspace, StepConfig


@dataclass
class DecodeStackInputs:
    """Prepared `(masks, (cos, sin))` of one decode step's stack calls: `llm` (None: not prepared) and `crq[i -
    first_sub_step]` of CRQ sub-step i. Masks are `{"full_attention": (batch, 1, 1, cache columns) bool}` (the form
    `decoder_stack_forward` takes prepared masks in), tables `(batch, 1, head_dim)` each."""

    llm: tuple[dict, tuple[torch.Tensor, torch.Tensor]] | None
    crq: list[tuple[dict, tuple[torch.Tensor, torch.Tensor]]]
    first_sub_step: int = 0

    def sub_step(self, index: int) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
        return self.crq[index - self.first_sub_step]


def _preparable(stack) -> bool:
    """A stack whose decode masks and tables this module computes: full attention only, the default rope."""
    return not getattr(stack, "has_sliding_layers", False) and getattr(stack.rotary_emb, "rope_type", None) == "default"


def prepares_stack_inputs(model, cfg: StepConfig) -> bool:
    """Whether a decode step prepares its stack inputs: static caches (the mask over their columns), the stacks run
    through `decoder_stack_forward` (a decode attention implementation: not the eager loop's own forwards), not the
    compiled step (Inductor fuses these ops itself), and both stacks `_preparable`."""
    plan = cfg.plan
    if not plan.static_cache or plan.compile_step or cfg.attention_implementation is None:
        return False
    stacks = [model.language_model.model]
    if not cfg.disable_speech:
        stacks.append(model.audio_invert_tower.crq_transformer)
    # One dtype for both stacks' hidden states: the tables are made in the LLM input's.
    one_dtype = len({stack.norm.weight.dtype for stack in stacks}) == 1
    return one_dtype and all(_preparable(stack) for stack in stacks)


def decode_masks(key_mask: torch.Tensor, lengths: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """`(n, batch, 1, 1, columns)` bool: for each cache length in `lengths` `(n,)` (the column a one-position call
    writes), what `create_causal_mask` gives that call over a static cache with the 2-D key mask `key_mask` `(batch,
    columns)`: the columns up to the written one that the row's key mask keeps. `columns`: the column indices
    (`arange`), if kept."""
    if columns is None:
        columns = torch.arange(key_mask.shape[1], device=key_mask.device)
    causal = columns[None, :] <= lengths[:, None]  # (n, columns)
    return (causal[:, None, :] & key_mask[None].bool())[:, :, None, None, :]


def _columns(ws: DecodeWorkspace, key_mask: torch.Tensor) -> torch.Tensor:
    """The column indices of a cache of `key_mask`'s width, kept by the workspace."""
    width = key_mask.shape[1]
    return ws.decode_table(("columns", width), lambda: torch.arange(width, device=key_mask.device))


def _position_tables(ws: DecodeWorkspace, name: str, rotary_emb, positions: torch.Tensor, count: int):
    """`rotary_tables(rotary_emb, ..., positions)` as two gathers from the tables of positions 0 to `count - 1`, which
    the workspace keeps (the default rope's tables are elementwise in the position: the same values)."""
    def build():
        every_position = torch.arange(count, device=ws.device)[None]
        return tuple(table[0] for table in rotary_tables(rotary_emb, ws.next_embeds, every_position))

    cos_table, sin_table = ws.decode_table(("rotary", name, count), build)
    return F.embedding(positions, cos_table), F.embedding(positions, sin_table)


def decode_stack_inputs(
    model, ws: DecodeWorkspace, cfg: StepConfig, first_sub_step: int = 0, llm: bool = True
) -> DecodeStackInputs:
    """The masks and tables of a decode step's LLM call (with `llm`) and of its CRQ sub-steps from `first_sub_step`
    to K - 1, from the workspace's positions and cache lengths before the step (see the module docstring)."""
    llm_inputs = None
    if llm:
        stack = model.language_model.model
        length = ws.llm_cache.layers[0].cumulative_length
        masks = decode_masks(ws.llm_mask, torch.as_tensor(length, device=ws.device).view(1), _columns(ws, ws.llm_mask))
        tables = _position_tables(ws, "llm", stack.rotary_emb, ws.llm_position[:, None], ws.llm_mask.shape[1])
        llm_inputs = ({"full_attention": masks[0]}, tables)
    crq_inputs = []
    if not cfg.disable_speech:
        stack = model.audio_invert_tower.crq_transformer
        offsets = ws.decode_table(
            ("offsets", first_sub_step), lambda: torch.arange(cfg.group_size - first_sub_step, device=ws.device)
        )
        length = ws.crq_cache.layers[0].cumulative_length
        masks = decode_masks(ws.crq_mask, offsets + length, _columns(ws, ws.crq_mask))
        positions = ws.crq_position[:, None] + offsets
        cos, sin = _position_tables(ws, "crq", stack.rotary_emb, positions, ws.crq_mask.shape[1])
        crq_inputs = [
            ({"full_attention": masks[i]}, (cos[:, i : i + 1], sin[:, i : i + 1])) for i in range(len(offsets))
        ]
    return DecodeStackInputs(llm_inputs, crq_inputs, first_sub_step)


__all__ = ["DecodeStackInputs", "decode_masks", "decode_stack_inputs", "prepares_stack_inputs"]
