"""The fixed-address state of one decoding run: `StepConfig` (its Python constants) and `DecodeWorkspace` (its KV
caches, per-row state and scratch buffers)."""

import copy
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache

from .generation_audio_graph_funaudiochat import MAX_RECORDED_AUDIO_CHUNKS, AudioChunkBuffers
from .generation_plan_funaudiochat import DecodePlan
from .sampling_funaudiochat import SamplingParameters, SamplingSettings, SamplingSwitches
from .step_graph_funaudiochat import StepGraphs, tensor_addresses
from .triton_linear_funaudiochat import split_k_counters_for


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors` (None entries and non-tensors skipped)."""
    seen, total = set(), 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


@dataclass(frozen=True)
class PromptBuffers:
    """A bucket-padded prompt's fixed inputs: `input_ids` `(batch, length)`, `inputs_embeds` `(batch, length,
    hidden)`, `padding` `(batch,)` (left padding per row, the bucket's included)."""

    input_ids: torch.Tensor
    inputs_embeds: torch.Tensor
    padding: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.inputs_embeds, self.padding]


@dataclass(frozen=True)
class StepConfig:
    """Python constants of one decoding run (hashable: `torch.compile` and the step CUDA graphs are keyed by them).

    Only the sampling *switches* are here; their values live in the workspace as tensors, so a new temperature /
    top-p / top-k / penalty reuses the compiled step.
    """

    text: SamplingSwitches
    speech: SamplingSwitches
    disable_speech: bool
    group_size: int
    speech_bos_id: int
    speech_eos_id: int
    audio_bos_index: int
    audio_eos_index: int
    pad_token_id: int
    output_logits: bool
    plan: DecodePlan  # which parts run (`generation_plan_funaudiochat`)
    # The registered attention-interface name of the decode steps' one-query attention (`plan.attention`), passed
    # down to `decoder_stack_forward`; None: the model's own.
    attention_implementation: str | None = None
    kernel_config: Hashable | None = None  # the Triton kernels' per-GPU tuning (`DecodeKernelConfig`), or None


class DecodeWorkspace:
    """KV caches and per-row decoding state of one run, as fixed-address buffers.

    The decode step only mutates these tensors in place, so a compiled step sees the same addresses every call (a
    requirement of CUDA graphs). A `SpeechGenerator` owns its workspaces and reuses one for later runs with the same
    batch size and cache length (never two runs at once: the generator's lock). The weight copies the step reads
    (`fused_crq`, `speech_head`, `folded`, `llm_kernels`) and the text head's stream are set by the generator, which
    owns them too.
    """

    def __init__(
        self, model, batch_size: int, max_length: int, static: bool, output_logits: bool, per_row_sampling: bool = False
    ):
        text_config = model.config.text_config
        audio_config = model.config.audio_config
        embedding_weight = model.language_model.get_input_embeddings().weight
        self.device, self.dtype = embedding_weight.device, embedding_weight.dtype
        self.batch_size, self.max_length, self.static = batch_size, max_length, static
        k = audio_config.group_size
        vocab = model.language_model.get_output_embeddings().weight.shape[0]
        codebook = audio_config.codebook_size
        hidden = text_config.hidden_size
        b, dev = batch_size, self.device

        crq_config = model.audio_invert_tower.crq_transformer.config if model.audio_invert_tower is not None else None
        # The several-row kernel's and the attention's arrival counters (`crq_linear` / `llm_linear`): per workspace,
        # as a run's own; one tensor for both stacks, which never run at the same time.
        self.split_k_counters = split_k_counters_for([c for c in (text_config, crq_config) if c is not None], dev, b)
        if static:
            self.llm_cache = StaticCache(config=text_config, max_cache_len=max_length)
            self.crq_cache = StaticCache(config=crq_config, max_cache_len=k * max_length) if crq_config else None
        else:
            self.llm_cache = DynamicCache(config=text_config)
            self.crq_cache = DynamicCache(config=crq_config) if crq_config else None

        long = dict(dtype=torch.long, device=dev)
        self.llm_mask = torch.ones(b, max_length, dtype=torch.bool, device=dev)
        self.crq_mask = torch.ones(b, k * max_length, dtype=torch.bool, device=dev)
        self.step = torch.zeros((), **long)
        self.llm_position = torch.zeros(b, **long)
        self.crq_position = torch.zeros(b, **long)
        self.next_embeds = torch.zeros(b, 1, hidden, dtype=self.dtype, device=dev)
        self.next_ids = torch.zeros(b, **long)
        self.prev_speech_token = torch.zeros(b, **long)  # the last speech token sampled (the CRQ's next input)
        self.speaking = torch.zeros(b, dtype=torch.bool, device=dev)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.finish_step = torch.zeros(b, **long)
        self.groups = torch.zeros(b, **long)  # speech groups appended per row
        self.last_group = torch.zeros(b, k, **long)
        self.speech_seen = torch.zeros(b, codebook, dtype=torch.bool, device=dev)
        self.text_seen = torch.zeros(b, vocab, dtype=torch.bool, device=dev)
        self.eos_ids = torch.zeros(1, **long)
        self.text_out = torch.zeros(b, max_length, **long)
        # K extra columns at the end receive the (discarded) groups of rows that are not speaking.
        self.speech_out = torch.zeros(b, k * max_length + k, **long)
        # Scratch of the current step: text logits, the K speech-head inputs, the group being sampled.
        self.text_logits_step = torch.zeros(b, vocab, dtype=torch.float32, device=dev)
        # `overlap_text_head`: the LLM's last hidden state, read by the text head on its own stream.
        self.text_head_input = torch.zeros(b, hidden, dtype=self.dtype, device=dev)
        self.sub_inputs = torch.zeros(b, k, hidden, dtype=self.dtype, device=dev)
        # `fold_crq_matching`: the K sub-position inputs already in the CRQ's width.
        crq_hidden = crq_config.hidden_size if crq_config else 1
        self.folded_sub_inputs = torch.zeros(b, k, crq_hidden, dtype=self.dtype, device=dev)
        # The next CRQ sub-step's input, where the speech sampler's kernel writes it (`sample_tokens_into`).
        self.next_crq_input = torch.zeros(b, 1, crq_hidden, dtype=self.dtype, device=dev)
        self.sub_step = torch.zeros((), **long)
        self.group = torch.zeros(b, k, **long)
        self.group_logits = torch.zeros(b, k, codebook, dtype=torch.float32, device=dev)
        self.group_seen = torch.zeros(b, codebook, dtype=torch.bool, device=dev)
        self.text_noise = torch.ones(b, vocab, dtype=torch.float32, device=dev)
        self.speech_noise = torch.ones(b, k, codebook, dtype=torch.float32, device=dev)
        # Sampling values of the run (0-d tensors, filled by `reset`): read by the graph, not baked into it.
        # `per_row_sampling`: `(batch, 1)` tensors, one value per row (a continuous batch of different requests).
        rows = b if per_row_sampling else None
        self.text_sampling = SamplingParameters(dev, rows=rows)
        self.speech_sampling = SamplingParameters(dev, rows=rows)
        # The plan's weight copies and text head stream (see the class docstring), or None.
        self.fused_crq = None  # `fuse_crq_projections`: `FusedCRQProjections` (its kernel view with `crq_linear`)
        self.speech_head = None  # `pad_speech_head`: the speech head's `PaddedLinear`
        self.folded = None  # `fold_crq_matching`: `FoldedCRQMatching`
        self.llm_kernels = None  # `llm_linear`: the LLM's `OwnWeightKernels`
        self.text_head = None  # `overlap_text_head`: an `OverlappedTextHead`
        # `plan.step_graph`: the CUDA graphs of the decode step and CRQ sub-step recorded on this workspace.
        self.step_graphs = StepGraphs()
        # `plan.prefill_graph`: the bucket-padded prompt's fixed inputs, by padded length (`prompt_buffers_for`).
        self.prompt_buffers: dict[int, PromptBuffers] = {}
        # `plan.prefill_graph`: the recorded audio encoder's fixed inputs and output, for the most chunks recorded
        # (`audio_chunk_buffers_for`: each chunk count's recording reads and writes its first rows).
        self.audio_chunk_buffers: AudioChunkBuffers | None = None
        # Tables the decode step reads that depend on no run's state (`decode_table`).
        self.decode_tables: dict[Hashable, object] = {}
        # Per-step raw logits, only with `output_logits=True` (debugging / parity tests).
        self.text_logits = self.speech_logits = None
        if output_logits:
            self.text_logits = torch.zeros(b, max_length, vocab, dtype=torch.float32, device=dev)
            self.speech_logits = torch.zeros(b, max_length, k, codebook, dtype=torch.float32, device=dev)
        for tensor in self._buffers():
            torch._dynamo.mark_static_address(tensor)

    # Tensors of the whole run, not of a row: the step counters, the stop ids, the kernels' arrival counters (sized
    # for the workspace's rows, so that they serve any fewer).
    _RUN_TENSORS = ("step", "sub_step", "eos_ids", "split_k_counters")

    def first_rows(self, rows: int) -> "DecodeWorkspace":
        """A workspace over the first `rows` rows of this one (after its prefill allocated the caches): every per-row
        buffer and cache tensor is a view of this one's (the same storage, so a step of the view reads and writes
        these rows here), the run's tensors are shared, and it has graphs of its own. A step of fewer rows costs
        less: a continuous batch whose busy rows are the first ones steps only those
        (`serving_batch_funaudiochat`). The weight copies and text head are attached by the generator."""
        if not 1 <= rows <= self.batch_size:
            raise ValueError(f"`rows` must be between 1 and the workspace's {self.batch_size}, got {rows}.")
        if not self.static:
            raise ValueError("Only a static workspace has fixed rows to view.")
        view = copy.copy(self)
        view.batch_size = rows
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor) and name not in self._RUN_TENSORS:
                if value.shape[0] != self.batch_size:
                    raise RuntimeError(f"DecodeWorkspace.{name} is neither per row nor listed in `_RUN_TENSORS`.")
                setattr(view, name, value[:rows])
        view.llm_cache = _first_cache_rows(self.llm_cache, rows)
        view.crq_cache = _first_cache_rows(self.crq_cache, rows)
        view.text_sampling = self.text_sampling.first_rows(rows)
        view.speech_sampling = self.speech_sampling.first_rows(rows)
        view.fused_crq = view.speech_head = view.folded = view.llm_kernels = view.text_head = None
        view.step_graphs = StepGraphs()
        view.prompt_buffers = {}
        view.audio_chunk_buffers = None
        return view

    def _buffers(self) -> list[torch.Tensor]:
        tensors = [value for value in vars(self).values() if isinstance(value, torch.Tensor)]
        return tensors + self.text_sampling.tensors() + self.speech_sampling.tensors()

    def _cache_tensors(self) -> list[torch.Tensor]:
        return [
            tensor
            for cache in (self.llm_cache, self.crq_cache) if cache is not None
            for layer in getattr(cache, "layers", ())
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)) if tensor is not None
        ]  # fmt: skip

    def graph_inputs(self) -> list:
        """Everything of the workspace a recorded step reads or writes besides the model's own weights: its buffers,
        its caches' tensors and the run's weight copies (for `StepGraphs.check`)."""
        return [*self._buffers(), *self._cache_tensors(), self.fused_crq, self.folded, self.speech_head]

    def check_graphs(self, model) -> None:
        """Keep the recorded graphs only if `model`'s weights and everything in `graph_inputs` are where they were
        recorded ([`StepGraphs.check`])."""
        self.step_graphs.check(tensor_addresses(model, self.graph_inputs()))

    def memory_bytes(self) -> int:
        """Bytes held by the workspace's buffers and caches (each storage counted once)."""
        fixed_inputs = list(self.prompt_buffers.values())
        if self.audio_chunk_buffers is not None:
            fixed_inputs.append(self.audio_chunk_buffers)
        prompts = [tensor for buffers in fixed_inputs for tensor in buffers.tensors()]
        tables = [t for table in self.decode_tables.values() for t in (table if isinstance(table, tuple) else (table,))]
        return storage_bytes([*self._buffers(), *self._cache_tensors(), *prompts, *tables])

    def decode_table(self, key: Hashable, build):
        """The decode step's table `key` (a tensor or a tuple of them that depends on no run's state: the rotary
        tables of every cache position, the cache's column indices), `build()` on first use and kept with the
        workspace. Built by a step's first, unrecorded call, never replaced: not among `graph_inputs`."""
        table = self.decode_tables.get(key)
        if table is None:
            table = self.decode_tables[key] = build()
        return table

    def prompt_buffers_for(self, length: int, hidden_size: int) -> "PromptBuffers":
        """The fixed input buffers of a bucket-padded prompt of `length` columns (created on first use, kept with
        the workspace: the recorded prompt graph of that length reads them). Not among `graph_inputs`: a new length
        adds buffers without moving any tensor an earlier graph reads."""
        buffers = self.prompt_buffers.get(length)
        if buffers is None:
            b, dev = self.batch_size, self.device
            buffers = PromptBuffers(
                input_ids=torch.zeros(b, length, dtype=torch.long, device=dev),
                inputs_embeds=torch.zeros(b, length, hidden_size, dtype=self.dtype, device=dev),
                padding=torch.zeros(b, dtype=torch.long, device=dev),
            )
            self.prompt_buffers[length] = buffers
        return buffers

    def audio_chunk_buffers_for(self, num_chunks: int, encoder) -> AudioChunkBuffers:
        """The recorded audio `encoder`'s fixed buffers for `num_chunks` chunks: the first rows of the workspace's
        buffers for `MAX_RECORDED_AUDIO_CHUNKS` (made on first use, kept with the workspace, like
        `prompt_buffers_for`'s)."""
        if self.audio_chunk_buffers is None:
            self.audio_chunk_buffers = AudioChunkBuffers.for_encoder(encoder, MAX_RECORDED_AUDIO_CHUNKS)
        return self.audio_chunk_buffers.first(num_chunks)

    def reset(
        self,
        eos_ids: torch.Tensor,
        speech_pad_id: int,
        text_settings: SamplingSettings | None = None,
        speech_settings: SamplingSettings | None = None,
    ) -> None:
        if text_settings is not None:
            self.text_sampling.fill_(text_settings)
        if speech_settings is not None:
            self.speech_sampling.fill_(speech_settings)
        for cache in (self.llm_cache, self.crq_cache):
            if cache is not None and self.static:
                cache.reset()
        self.step.zero_()
        if self.split_k_counters is not None:
            self.split_k_counters.zero_()  # after a run stopped mid-step (an error, a KeyboardInterrupt)
        self.done.zero_()
        self.speaking.zero_()
        self.groups.zero_()
        self.speech_seen.zero_()
        self.text_seen.zero_()
        self.finish_step.fill_(self.max_length)
        self.speech_out.fill_(speech_pad_id)
        if self.eos_ids.shape != eos_ids.shape:
            # A different number of stop ids is a different graph anyway; re-allocate and re-mark.
            self.eos_ids = eos_ids.clone()
            torch._dynamo.mark_static_address(self.eos_ids)
        else:
            self.eos_ids.copy_(eos_ids)



def _first_cache_rows(cache: StaticCache | None, rows: int) -> StaticCache | None:
    """A static cache over the first `rows` rows of `cache`: its layers' keys and values are views, and each layer's
    `cumulative_length` is the same tensor (updated in place), so both see every write and the same column."""
    if cache is None:
        return None
    view = copy.copy(cache)
    view.layers = []
    for layer in cache.layers:
        if not layer.is_initialized:
            raise RuntimeError("A static cache's rows can be viewed once its tensors exist (after the prefill).")
        layer_view = copy.copy(layer)
        layer_view.keys, layer_view.values = layer.keys[:rows], layer.values[:rows]
        layer_view.batch_size = rows
        view.layers.append(layer_view)
    return view


__all__ = ["DecodeWorkspace", "PromptBuffers", "StepConfig", "storage_bytes"]
