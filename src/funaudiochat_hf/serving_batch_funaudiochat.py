"""The speech engine's static batch: `ServingBatch`, the only class of the serving files that touches the decode
internals (workspace buffers, the step functions, the prefill).

A slot is a left-padded row: a request placed in one computes what it would alone (`generate_speech` at batch 1, same
seed); a GPU's kernels may round it differently (their summation order follows the row count and cache offset).

* Columns. The batch's static caches have `cache_length` LLM columns (K times that for the CRQ) written left to right
  by every step at one shared column `C` (the caches' `cumulative_length`). A request with an `L`-token prompt joins
  right-aligned: its prefill's cache entries go to columns `[C - L, C)`, its row of the attention masks is False before
  `C - L`, and its rotary positions (per row, carried in its state) start at 0, exactly as a left-padded row. Rotary
  positions are per row and the keys are stored rotated, so a row's columns may move without changing its attention:
  `rebase` shifts every column by one offset (one copy of the caches and masks, no recomputation) when the engine
  needs room on the left or the right; in an empty batch it moves only the column.
* Randomness. Each request draws its exponential noise from its own `torch.Generator` (seeded by the request, else
  from the global RNG), row by row before each step, in the order a single run draws it, whatever joins or leaves
  around it.
* Sampling values (temperature, top-p, repetition penalty) are per-row tensors read by the step. Which processors run
  at all (sampling or greedy) is fixed per engine: a top-p of 1 or a penalty of 1 in a row of a batch that runs those
  processors changes nothing, so every value rides along exactly.
* Leaving. A finished or cancelled row is marked done (the step then writes padding for it), its mask row is opened
  (every column readable, so the idle row never attends to nothing) and its rotary positions start over (an idle row
  is stepped along with the busy rows above it); its slot takes the next request.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .generation_config_funaudiochat import SpeechRequest as ResolvedRequest
from .generation_loop_funaudiochat import SpeechRun
from .serving_host_copy_funaudiochat import HostCopy, to_host
from .serving_requests_funaudiochat import SpeechRequest
from .triton_cache_copy_funaudiochat import CachePointers, copy_cache_columns
from .triton_support import kernels_run_on


# Values that switch every per-row sampling processor on in the batch's step (each row then reads its own values).
_BATCH_SWITCH_VALUES = {"temperature": 1.0, "top_p": 0.5, "repetition_penalty": 1.5}
# The request keywords that become per-row values.
REQUEST_SAMPLING_KEYS = ("temperature", "top_p", "repetition_penalty")
# Row counts of the batch's decode step (besides the whole batch): a step runs the smallest that holds every busy row.
_STEP_ROW_COUNTS = (1, 2, 4, 8, 16)


def step_row_counts(batch_size: int) -> tuple[int, ...]:
    """The row counts the decode step of a batch of `batch_size` slots comes in, ascending (the last: all of them).
    A request takes the lowest free slot, so the busy rows are mostly the first ones: one request alone is stepped as
    a batch of one (`generate_speech`'s step), not with the idle rows of the whole batch. Each count is one step
    graph, recorded when the engine starts."""
    return (*(rows for rows in _STEP_ROW_COUNTS if rows < batch_size), batch_size)


class ServingBatch:
    """The engine's only view of the decode internals.

    It owns one `SpeechGenerator` (`model.speech_generator(max_batch_size, cache_length, backend)`), held for the
    engine's lifetime: the generator owns the batch workspace (per-row sampling values), the batch-1 workspace the
    requests are prefilled in, the weight copies, compiled step functions and CUDA graphs. The batch's step is the
    generator's step function for the batch's `StepConfig`; a request's prefill is a `SpeechRun` of its own (batch 1,
    its own step configuration, exactly `generate_speech`'s). Besides that it reads and writes the workspace's per-row
    state (`_ROW_STATE`, `speech_out`, the masks, the two `StaticCache`s' tensors and `cumulative_length`) and its
    noise and sampling-value buffers.
    """

    # Per-row state a prefilled request brings into its slot (everything else of a row is scratch of one step).
    _ROW_STATE = (
        "llm_position", "crq_position", "next_embeds", "next_ids", "prev_speech_token", "speaking", "done",
        "finish_step", "groups", "last_group", "speech_seen", "text_seen",
    )  # fmt: skip

    def __init__(self, model, batch_size: int, cache_length: int, generation_options: dict, backend: str):
        self.model = model
        self.options = dict(generation_options)
        if self.options.pop("cache_implementation", "static") != "static":
            raise ValueError("The speech engine shares static caches between requests: drop `cache_implementation`.")
        for name in ("backend", "compile", "output_logits"):
            if name in self.options:
                raise ValueError(f"`{name}` is not a generation option of the engine (use `SpeechEngine(backend=...)`).")
        self.backend = backend
        self.batch_size, self.cache_length = batch_size, cache_length
        self.generator = model.speech_generator(max_batch_size=batch_size, max_length=cache_length, backend=backend)
        self.generator.acquire()  # the engine's own, for its lifetime (released by `close`)
        try:
            self._start_batch()
        except BaseException:
            self.close()
            raise
        self.steps_since_reset = 0
        # Requests are prefilled on the engine's prefill thread, on a CUDA stream of their own: their kernels overlap
        # the decode steps queued meanwhile instead of waiting behind them, and their host syncs wait for the prefill
        # alone. `_admitted`: the point of the batch's stream after the last `admit` read the prefill workspace,
        # which the next prefill must not overwrite before.
        device = self.ws.device
        self.prefill_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.prefill_stream is not None:  # the workspace and weights were written on this thread's stream
            self.prefill_stream.wait_stream(torch.cuda.current_stream(device))
        self._admitted: torch.cuda.Event | None = None
        # `admit` copies a prompt's cache columns with one launch per cache where the kernel runs; the address tables
        # of the caches it copies (the batch's, the prefill workspaces'), each kept while its cache lives.
        self._copy_kernel = kernels_run_on(self.ws.next_ids)
        self._cache_pointers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _start_batch(self) -> None:
        """The batch's run over a one-token dummy prompt per row: its step configuration and step function, and the
        prefill that allocates the batch's caches and attaches its weight copies; two warm-up steps then compile and
        record it. Every row is free afterwards."""
        dummy = torch.zeros(self.batch_size, 1, dtype=torch.long)
        # The batch's caches are static (rows join at a shared column); a request's own prefill uses the caches its
        # plan uses in `generate_speech` (e.g. dynamic ones on a CPU, where a static cache as long as the batch's
        # would make its prompt pass attend over, and build masks for, every column of it).
        batch_options = {**_BATCH_SWITCH_VALUES, "max_new_tokens": 1, "cache_implementation": "static"}
        batch_request = self._resolve(dummy, batch_options)
        self.batch_run = SpeechRun(
            self.model, self.generator, batch_request, dummy, None, {}, None, per_row_sampling=True
        )
        self.cfg, self.ws = self.batch_run.cfg, self.batch_run.ws
        self.k = self.cfg.group_size
        self.batch_run.prefill()
        # A run per row count of `step_row_counts`, over the first rows of the batch's workspace (views: the same
        # caches and state), each with its row count's plan (one row: `generate_speech`'s batch-1 step).
        self.row_runs: dict[int, SpeechRun] = {}
        for rows in step_row_counts(self.batch_size):
            run = self.batch_run
            if rows < self.batch_size:
                request = self._resolve(dummy[:rows], batch_options)
                run = SpeechRun(self.model, self.generator, request, dummy[:rows], None, {}, None,
                                per_row_sampling=True, rows_of=self.ws)  # fmt: skip
                if run.cfg.plan.step_graph:  # as a prefill checks its workspace's graphs
                    run.ws.check_graphs(self.model)
            self.row_runs[rows] = run
            # Twice: the first run compiles / warms the step up, the second records its CUDA graph
            # (`plan.step_graph`), so that no request waits for either and the graphs' memory is held from the start.
            run.step_fn(self.model, run.ws, run.cfg)
            run.step_fn(self.model, run.ws, run.cfg)
        for row in range(self.batch_size):
            self.free(row)
        self.ws.step.zero_()
        # The shared column, kept on the host from here on (`column`): read from the device once.
        self._column = int(self.ws.llm_cache.layers[0].cumulative_length)

    def close(self) -> None:
        """Free the generator's caches, weight copies and graphs (once)."""
        if self.generator is None:
            return
        generator, self.generator = self.generator, None
        generator.release()
        generator.close()

    # ------------------------------------------------------------------ requests
    def _resolve(self, input_ids: torch.Tensor, kwargs: dict) -> ResolvedRequest:
        return self.model.resolve_speech_request(input_ids, None, None, {**self.options, **kwargs})

    def resolve(self, request: SpeechRequest, max_new_tokens: int) -> ResolvedRequest:
        """A request's settings, checked as `generate_speech` checks them (same errors) without touching the model's
        tensors: safe to call from any thread."""
        kwargs = {"max_new_tokens": max_new_tokens}
        for name in REQUEST_SAMPLING_KEYS:
            value = getattr(request, name)
            if value is not None:
                kwargs[name] = value
        if request.seed is not None:
            kwargs["seed"] = request.seed
        resolved = self._resolve(request.inputs["input_ids"], kwargs)
        for stream in ("text", "speech"):
            own = getattr(resolved, stream).switches
            batch = getattr(self.cfg, stream)
            if own.do_sample != batch.do_sample or own.uses_top_k:
                mode = "samples" if batch.do_sample else "decodes greedily"
                raise ValueError(
                    f"This engine {mode} the {stream} tokens, with temperature / top_p / repetition_penalty values per "
                    "request; a request cannot switch sampling on or off or use top_k."
                )
        return resolved

    def prefill(self, request: SpeechRequest, resolved: ResolvedRequest) -> tuple[SpeechRun, dict]:
        """A request's batch-1 run on the engine's generator, its prompt prefilled alone in the prefill workspace, and
        its first step's outputs (as `read_results`); raises ValueError naming a problem of its inputs. All of it on
        `prefill_stream` (the run's copies of the request's tensors too), after the last `admit` read the workspace.
        The outputs' copy waits for everything the prefill queued: the workspace is complete when this returns
        (`admit` may read it on another stream)."""
        stream = contextlib.nullcontext() if self.prefill_stream is None else torch.cuda.stream(self.prefill_stream)
        with stream:
            if self._admitted is not None:
                self.prefill_stream.wait_event(self._admitted)
            inputs = dict(request.inputs)
            input_ids, attention_mask = inputs.pop("input_ids"), inputs.pop("attention_mask", None)
            run = SpeechRun(self.model, self.generator, resolved, input_ids, attention_mask, inputs, None)
            ws = run.prefill()
            # One copy; a prompt pass appends at most one speech group.
            token, done, groups, *speech = to_host(
                torch.cat([ws.next_ids[:1], ws.done[:1].long(), ws.groups[:1], ws.speech_out[0, : self.k]])
            ).tolist()
        return run, {"token": token, "done": bool(done), "speech": speech[: groups * self.k]}

    # ------------------------------------------------------------------ slots
    @property
    def column(self) -> int:
        """The batch's next cache column `C` (shared by every row): the caches' `cumulative_length`, mirrored on the
        host (`step` advances it, `rebase` moves it). The decode thread reads it between steps; a read of the device's
        value would wait for the step in flight (and, a pageable copy, stall the output thread's launches meanwhile)."""
        return self._column

    def admit(self, row: int, run: SpeechRun) -> None:
        """Move the prefilled request (its batch-1 workspace) into slot `row`, right-aligned at the current column."""
        ws, pre, k = self.ws, run.ws, self.k
        # The run's own columns: its prompt after any bucket padding of its recorded prompt pass.
        skip = run.bucket_padding or 0
        length = run.input_ids.shape[1] - skip
        end = self.column
        start = end - length
        for batch_cache, own_cache, scale in ((ws.llm_cache, pre.llm_cache, 1), (ws.crq_cache, pre.crq_cache, k)):
            if batch_cache is not None:
                self._copy_cache_columns(batch_cache, row, scale * start, own_cache, scale * skip, scale * length)
        ws.llm_mask[row] = True
        ws.llm_mask[row, :start] = False
        ws.crq_mask[row] = True
        ws.crq_mask[row, : k * start] = False
        for name in self._ROW_STATE:
            getattr(ws, name)[row] = getattr(pre, name)[0]
        width = min(ws.speech_out.shape[1], pre.speech_out.shape[1])
        ws.speech_out[row] = run.speech_pad_id
        ws.speech_out[row, :width] = pre.speech_out[0, :width]
        ws.text_sampling.fill_row_(row, run.request.text)
        ws.speech_sampling.fill_row_(row, run.request.speech)
        if self.prefill_stream is not None:  # the next prefill overwrites what was just read
            self._admitted = torch.cuda.Event()
            self._admitted.record()

    def _copy_cache_columns(self, batch_cache, row: int, start: int, own_cache, own_start: int, length: int) -> None:
        """Columns `[own_start, own_start + length)` of every layer of the prefill's cache (its row 0) to columns
        `[start, start + length)` of the batch's row `row`: one launch where both caches are static on a Triton GPU,
        else a copy per layer."""
        if self._copy_kernel:
            batch, own = self._pointers(batch_cache), self._pointers(own_cache)
            if batch is not None and own is not None and batch.layout() == own.layout():
                copy_cache_columns(batch, row, start, own, 0, own_start, length)
                return
        own, columns = slice(own_start, own_start + length), slice(start, start + length)
        for batch_layer, own_layer in zip(batch_cache.layers, own_cache.layers):
            batch_layer.keys[row, :, columns] = own_layer.keys[0, :, own]
            batch_layer.values[row, :, columns] = own_layer.values[0, :, own]

    def _pointers(self, cache) -> CachePointers | None:
        """The address table of `cache` (made on first use, again if its tensors changed), or None: not copyable by
        the kernel."""
        pointers = self._cache_pointers.get(cache)
        if pointers is None or not pointers.current(cache):
            pointers = CachePointers.of(cache)
            if pointers is not None:
                self._cache_pointers[cache] = pointers
        return pointers

    def free(self, row: int) -> None:
        """Mark slot `row` idle: the step writes padding for it; its masks read every column (never none); its rotary
        positions start over (`_restart_positions`)."""
        self.ws.done[row] = True
        self.ws.speaking[row] = False
        self.ws.llm_mask[row] = True
        self.ws.crq_mask[row] = True
        self._restart_positions([row])

    def _restart_positions(self, rows: list[int]) -> None:
        """Set the rotary positions of idle `rows` to 0. An idle row is stepped whenever a busy row above it is
        (`step_rows`), for as long as the engine runs, and every step advances its positions; the fast CUDA step looks
        its rotary tables up in tables of the cache's positions (`generation_stack_inputs_funaudiochat`), where a
        position past them was a device-side assert that stopped the engine. Restarted when a row leaves and every
        `max_length - 1` steps (`step`), an idle row's positions stay inside them."""
        self.ws.llm_position[rows] = 0
        self.ws.crq_position[rows] = 0

    def rebase(self, offset: int, free_rows: list[int]) -> None:
        """Shift every cache column and mask column left by `offset` (right if negative); the shared column moves
        with them. Free rows' masks stay open (their content is any finite stale state). With every row free
        nothing is copied: only the column moves."""
        if offset == 0:
            return
        ws, k = self.ws, self.k
        end = self.column
        copy = len(free_rows) < self.batch_size
        for cache, masks, scale in ((ws.llm_cache, ws.llm_mask, 1), (ws.crq_cache, ws.crq_mask, k)):
            if cache is None:
                continue
            shift, used = scale * offset, scale * end
            if copy:
                for layer in cache.layers:
                    _shift_columns(layer.keys, shift, used, dim=2)
                    _shift_columns(layer.values, shift, used, dim=2)
                # Columns opened on the left by a right shift precede every prompt; those vacated on the right by a
                # left shift are the next ones written, readable by every row.
                _shift_columns(masks, shift, used, dim=1, fill_left=False, fill_right=True)
            for layer in cache.layers:
                layer.cumulative_length.fill_(used - shift)
        self._column = end - offset
        for row in free_rows:
            ws.llm_mask[row] = True
            ws.crq_mask[row] = True

    # ------------------------------------------------------------------ steps
    def step_rows(self, busy_rows) -> int:
        """The rows a step runs while `busy_rows` are busy: the smallest row count of `step_row_counts` past the
        last busy row."""
        last = max(busy_rows)
        return next(rows for rows in self.row_runs if rows > last)

    def step(self, generators: dict[int, torch.Generator]) -> None:
        """One decode step of the first `step_rows` rows, which hold every busy one; `generators`: the busy rows' own
        generators (their noise is drawn row by row, text then speech, as a single run draws it). The other rows are
        free (done, masks open): they stay as they are until a step covers them again."""
        ws, cfg = self.ws, self.cfg
        for row, generator in generators.items():
            if cfg.text.do_sample:
                ws.text_noise[row].exponential_(generator=generator)
            if cfg.speech.do_sample and not cfg.disable_speech:
                ws.speech_noise[row].exponential_(generator=generator)
        # The step writes its text token at column `step` of `text_out`; the engine reads `next_ids` instead, so the
        # index only has to stay in range.
        if self.steps_since_reset >= ws.max_length - 1:
            ws.step.zero_()
            self._restart_positions([row for row in range(self.batch_size) if row not in generators])
            self.steps_since_reset = 0
        run = self.row_runs[self.step_rows(generators)]
        run.step_fn(self.model, run.ws, run.cfg)
        self.steps_since_reset += 1
        self._column += 1

    def start_read(self) -> HostCopy:
        """Start copying the last step's outputs to the host (`read_results` takes them): a snapshot queued right
        after the step, so a step queued after it does not change what is read."""
        ws = self.ws
        return HostCopy(torch.cat([ws.next_ids, ws.done.long(), ws.groups, ws.last_group.flatten()]))

    def read_results(self, copy: HostCopy) -> tuple[list[int], list[bool], list[int], list[list[int]]]:
        """The text token, done flag, speech-group count and last group of every row of the step whose outputs
        `copy` (`start_read`) holds, waiting for it."""
        snapshot = copy.result().tolist()
        b, k = self.batch_size, self.k
        groups = snapshot[3 * b :]
        return (
            snapshot[:b],
            [bool(v) for v in snapshot[b : 2 * b]],
            snapshot[2 * b : 3 * b],
            [groups[r * k : (r + 1) * k] for r in range(b)],
        )


def _shift_columns(tensor: torch.Tensor, shift: int, used: int, dim: int, fill_left=None, fill_right=None) -> None:
    """Move columns `[0, used)` of `tensor` along `dim` to `[-shift, used - shift)` in place (`shift` > 0: left).
    Columns opened on the left by a right shift get `fill_left`, those vacated on the right by a left shift
    `fill_right`, when given (else they keep stale values)."""
    if shift > 0:
        tensor.narrow(dim, 0, used - shift).copy_(tensor.narrow(dim, shift, used - shift).clone())
        if fill_right is not None:
            tensor.narrow(dim, used - shift, shift).fill_(fill_right)
    elif shift < 0:
        tensor.narrow(dim, -shift, used).copy_(tensor.narrow(dim, 0, used).clone())
        if fill_left is not None:
            tensor.narrow(dim, 0, -shift).fill_(fill_left)
