"""Chunked (streaming) CosyVoice3 token2wav with a bounded cost per chunk."""

import functools
import math
import numbers
import threading
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.nn.functional as F

from .cuda_graph_cosyvoice3 import CUDAGraphRunner


if TYPE_CHECKING:
    from .modeling_cosyvoice3 import CosyVoice3Token2Wav


class CosyVoice3StreamingDecoder:
    """Decode one reply's speech tokens chunk by chunk: `push(tokens)` returns only the new audio, `finalize()` the
    rest.

    Chunking (Fun-Audio-Chat's `token2wav` loop / web demo): chunk k covers tokens [start, start + hop), start being
    where chunk k - 1 ended and hop `token_hop_len` (for the first chunk and hop growth, see below). Its mel comes
    from a flow call (full attention, `finalize=False`) over the tokens up to start + hop + `pre_lookahead_len`, the
    last `pre_lookahead_len` tokens serving only as look-ahead. HiFT then runs with `finalize=False`, holding back
    the last 8 mel frames (3 for the F0 look-ahead, 4 for conv_pre, 1 for the iSTFT tail), which the next chunk or
    `finalize()` emits. A chunk is decoded once a token *beyond* its look-ahead has arrived, so the last chunk is
    always decoded as the final one, exactly like the reference loop (which knows the total length); with tokens
    arriving in groups of 5 and hop 15 this adds no delay. `finalize()` decodes whatever is left in one final call
    (the reference's loop can call its final step twice and then repeats audio; this decoder does not).

    `first_token_hop_len` (default None = `token_hop_len`, the reference's chunking): a shorter first chunk, e.g. 6
    tokens (`generate_speech_stream`'s), so the first audio needs 6 + 3 (+ 1) tokens instead of 15 + 3 (+ 1): two
    LLM steps of 5 tokens less time to first audio. Later chunks keep `token_hop_len`. Only the chunk boundaries
    move; every chunk is still computed as described here (so the audio differs from the reference's stream where the
    boundaries differ, as it does between any two hop sizes).

    Hop growth (`token_max_hop_len`, `stream_scale_factor`: the CosyVoice2/3 streaming driver's names and rule):
    chunk 0 covers `first_token_hop_len` tokens, chunk 1 `token_hop_len`, and each later chunk
    `min(token_max_hop_len, int(previous hop * stream_scale_factor))`, so the hop of chunk k is a function of k alone
    (`chunk_hop(k)`; `hop_schedule` lists them up to the largest), e.g. 5, 15, 30, 60, 100, 100, ... for
    `token_max_hop_len=100` and the default factor 2. The default None (= `token_hop_len`) keeps the hop fixed. The
    first chunks, hence the time to first audio, are unchanged; the later, longer chunks come when the decoded audio is
    already far ahead of playback (speech tokens arrive several times faster than real time) and cost less flow work
    per second of audio: each steady chunk recomputes its left context, so a hop h costs (left context + h + 3) / h
    tokens of flow per token of audio (218 / 15 = 14.5 at a hop of 15, 303 / 100 = 3 at 100 with the default
    200-token context).

    Bounded cost (the reference re-runs the flow on all tokens so far and HiFT on the whole mel history for every
    chunk):
      * flow: the call for chunk k starts at token max(0, start - flow_left_context_tokens); the start noise is
        taken at the absolute frame positions (as an offline call over all tokens would), so while the reply is
        shorter than `flow_left_context_tokens + hop` tokens every chunk equals the reference's chunk exactly;
        later chunks see only `flow_left_context_tokens` tokens of left context (the reference's web demo similarly
        restarts its flow window every 200 tokens, with a discontinuity this decoder does not have).
      * HiFT: runs on the last `hift_left_context_frames` already-emitted frames plus the new ones. HiFT is causal
        apart from its fixed look-ahead, and the two things that depend on the whole history are carried as state:
        the harmonic phase (the running sum of f0, kept in float64) and the position in the fixed noise table. So
        HiFT's output equals the reference's whole-history run up to float rounding (tested), as long as
        `hift_left_context_frames` covers its receptive field: about 22 frames for the full-size HiFT (mostly its
        first stage's resblocks), so the default 32 gives the whole-history audio (tested).

    Cost per chunk: once the windows are full and the hop has stopped growing (`steady`), every chunk runs exactly
    the same work (a flow call over `flow_left_context_tokens + hop + pre_lookahead_len` tokens, the hop being the
    largest of the schedule, `max_flow_window`, and HiFT over `hift_left_context_frames` + 2 * hop + 8 frames) and
    allocates no more than that; no intermediate is proportional to the reply length or to the 300 s noise / source
    tables (tested). The flow call dominates and its compute is proportional to its window: with the default 200
    tokens of left context and a fixed hop of 15 a steady chunk costs about 12x the flow compute of the 18-token
    first chunk; `flow_left_context_tokens` trades that cost against how much past the flow sees, hop growth against
    how long the later chunks are.

    `flow_window_bucket_tokens`: right-pad every flow window to one of a few sizes, hiding the padding from attention
    with a key mask, so that kernel plans (cuDNN, cuFFT), compiled graphs and CUDA graphs are reused across chunks
    instead of meeting a new shape for each of the first flow_left_context_tokens / hop chunks; short windows pay for
    the padding. The mel is unchanged up to float rounding (~1e-6). An int pads to a multiple of it (capped at the
    longest window); a tuple of ints pads to the smallest of those sizes that holds the window (the longest window
    is always a size); None = exact shapes; "auto" (default): when the flow runs as CUDA graphs, sizes 32, 128, ...
    (x4) below the longest window plus the steady window of every hop after the first (left context + hop +
    look-ahead: with hop growth, a steady chunk of a shorter hop does not pay for the longest window) and the longest
    window: a graph replay costs about the same for any short window, so the first chunks (the time to first audio)
    get a short graph of their own while only a few graphs are recorded; when the estimator has been compiled
    (`compile_estimator`), one size (the longest window: every call then runs the same compiled graph); otherwise
    None (eager on CPU: the short first windows are cheaper unpadded).
    `flow_window_sizes` holds the resulting sizes (None: exact shapes).

    `cuda_graphs` ("auto" = on when the model is on a CUDA device, unless its flow was compiled with its own CUDA
    graphs, `mode="reduce-overhead"`): replay the flow (token embedding, look-ahead conv and Euler solver) and the
    non-final HiFT filter calls as CUDA graphs ([`CUDAGraphRunner`], recorded once per shape and precision setting
    per model, shared by later streams). A chunk is then a few graph launches instead of thousands of kernel
    launches, with the same arithmetic (same kernels) as the eager calls. The first chunk of each new shape pays for
    the recording.

    Many streams (a server): `add_tokens` to each, then `streaming_batch_cosyvoice3.decode_ready(decoders)` decodes
    the chunks ready across them in one flow call per round and padded window size, each stream's audio as its own
    `push` would give it (`push` is `add_tokens` + `decode_ready()`), whatever hop each stream is at.

    How the audio differs from offline decoding (`model(tokens)`): only through the flow, exactly as the reference
    streaming path does: each chunk's mel is computed without the tokens after its look-ahead (and, past
    `flow_left_context_tokens`, without the distant past), so the mel (and therefore the audio) differs from a
    single flow call over the whole reply; vocoding the concatenated streamed mel offline gives the streamed audio
    (tested). With `token_hop_len` >= the reply length the stream equals offline decoding.
    """

    def __init__(
        self,
        model: "CosyVoice3Token2Wav",
        speaker_embedding: torch.Tensor,
        token_hop_len: int = 15,
        pre_lookahead_len: int = 3,
        flow_left_context_tokens: int = 200,
        hift_left_context_frames: int = 32,
        flow_window_bucket_tokens: Union[int, tuple[int, ...], str, None] = "auto",
        cuda_graphs: Union[bool, str] = "auto",
        first_token_hop_len: Optional[int] = None,
        token_max_hop_len: Optional[int] = None,
        stream_scale_factor: float = 2.0,
    ):
        # Each integer option is checked by its own name first: a float, nan or bool passes a bare `< 1` and then
        # fails under another option's name (token_max_hop_len) or as a raw TypeError deep in a chunk.
        token_hop_len = checked_stream_size("token_hop_len", token_hop_len)
        first_token_hop_len = checked_stream_size("first_token_hop_len", first_token_hop_len)
        token_max_hop_len = checked_stream_size("token_max_hop_len", token_max_hop_len)
        pre_lookahead_len = checked_stream_size("pre_lookahead_len", pre_lookahead_len)
        flow_left_context_tokens = checked_stream_size("flow_left_context_tokens", flow_left_context_tokens)
        hift_left_context_frames = checked_stream_size("hift_left_context_frames", hift_left_context_frames)
        if first_token_hop_len is None:
            first_token_hop_len = token_hop_len
        # The hops of chunks 0, 1, 2, ... until the largest; every later chunk has the last one.
        self.hop_schedule = hop_schedule(first_token_hop_len, token_hop_len, token_max_hop_len, stream_scale_factor)
        if pre_lookahead_len != model.config.pre_lookahead_len:
            raise ValueError(
                f"pre_lookahead_len must equal the model's pre-lookahead ({model.config.pre_lookahead_len}); "
                f"got {pre_lookahead_len}"
            )
        on_cuda = model.device.type == "cuda"
        if cuda_graphs == "auto":
            cuda_graphs = on_cuda and not model.flow_compiles_cuda_graphs
        elif cuda_graphs not in (True, False):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
        elif cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {model.device}")
        # The longest flow window any call can see (push decodes as soon as a chunk plus look-ahead is available).
        self.max_flow_window = flow_left_context_tokens + max(self.hop_schedule) + pre_lookahead_len
        # The window of a chunk of each later hop once the left context is full.
        steady_windows = tuple(flow_left_context_tokens + hop + pre_lookahead_len for hop in self.hop_schedule[1:])
        self.flow_window_sizes = _flow_window_sizes(
            flow_window_bucket_tokens,
            self.max_flow_window,
            compiled=model.flow_is_compiled,
            graphed=cuda_graphs,
            steady_windows=steady_windows,
        )
        self.model = model
        self.speaker_embedding = speaker_embedding
        self._speaker_condition = None  # flow.speaker_condition of it, on first use
        self._conditioning = None  # flow.decoder.cached_time_conditioning, on first use
        self._window_inputs: dict = {}  # (token count, mask) of each flow window shape, see `_flow`
        self.lookahead = pre_lookahead_len
        self.flow_left_context = flow_left_context_tokens
        self.hift_left_context = hift_left_context_frames
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs = _graph_runners(model) if self.cuda_graphs else None
        self.ratio = model.config.token_mel_ratio
        self.samples_per_frame = model.hift.upsample_scale
        # Mel frames whose audio a non-final HiFT call holds back: F0 look-ahead + conv_pre look-ahead + the last frame.
        self.hift_holdback_frames = model.hift.f0_predictor.lookahead + model.hift.conv_pre_look_right + 1
        device = model.device
        # Tokens [token_start, token_start + len(tokens)); mel frames of tokens [0, token_offset) are done.
        self.tokens = torch.zeros(0, dtype=torch.long, device=device)
        # Pushed since the last chunk, on the model's device, with whether `push` range-checked them (see `push`).
        self._pending: list[tuple[torch.Tensor, bool]] = []
        self.token_start = 0
        self.token_offset = 0
        self.chunks_decoded = 0  # non-final chunks: the next chunk's index
        # Mel history frames [mel_start, mel_start + mel.shape[-1]); audio of frames [0, emitted_frames) returned.
        self.mel = torch.zeros(1, model.config.mel_bins, 0, device=device)
        self.mel_start = 0
        self.emitted_frames = 0
        # Exact f0 (float32) and the running phase sum (float64, per harmonic) of frames [f0_start, f0_end).
        num_harmonics = model.hift.num_harmonics
        self.f0 = torch.zeros(1, 0, device=device)
        self.phase_cycles = torch.zeros(1, 0, num_harmonics, dtype=torch.float64, device=device)
        self.f0_start = 0
        self.finished = False

    # -- public API -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def push(self, tokens: torch.Tensor) -> torch.Tensor:
        """Add speech tokens (n,) (or (1, n)) and return the audio (samples,) that became final (possibly empty):
        `add_tokens(tokens)` then `decode_ready()`.

        Ids outside the codebook raise a ValueError. Tokens on the CPU are checked here; tokens on an accelerator
        are checked when a chunk first needs them (by the push that decodes it, or `finalize`), so that pushes
        which decode nothing do not wait for the device. A failed check discards every token pushed since the last
        decoded chunk (the message says how many), and the stream can go on.
        """
        self.add_tokens(tokens)
        return self.decode_ready()

    @torch.no_grad()
    def add_tokens(self, tokens: torch.Tensor) -> None:
        """Add speech tokens (n,) (or (1, n)) without decoding (see `push` for the checks): a caller serving many
        streams adds to each, then decodes all their ready chunks together (`streaming_batch_cosyvoice3.decode_ready`).
        """
        if self.finished:
            raise ValueError("push() after finalize(); start a new streaming_decoder for the next reply")
        tokens = torch.as_tensor(tokens)
        if tokens.dim() > 2 or (tokens.dim() == 2 and tokens.shape[0] != 1):
            # rows of a batch would be concatenated into one stream: one decoder per reply
            raise ValueError(f"push() takes the tokens of one stream, shape (n,) or (1, n); got {tuple(tokens.shape)}")
        tokens = self.model._check_token_layout(tokens.reshape(1, -1)).reshape(-1)
        checked = _checked_when_pushed(tokens)
        if checked:
            self.model._check_token_range(tokens)
        if tokens.numel():
            self._pending.append((tokens.to(self.model.device, torch.long), checked))

    @torch.no_grad()
    def decode_ready(self) -> torch.Tensor:
        """Decode every chunk the added tokens complete and return their audio (samples,) (possibly empty)."""
        pieces = []
        while self.chunk_ready():
            self._accept_pending()
            pieces.append(self._decode_chunk(finalize=False))
        return self._concat(pieces)

    def chunk_ready(self) -> bool:
        """Whether the added tokens complete a chunk (a token beyond its look-ahead has arrived) before `finalize`."""
        return not self.finished and self.tokens_to_next_chunk() == 0

    def tokens_to_next_chunk(self) -> int:
        """How many more tokens complete the next chunk (0: `chunk_ready`): its hop and look-ahead, and one beyond."""
        return max(0, self.token_offset + self._next_hop() + self.lookahead + 1 - self._num_tokens())

    @torch.no_grad()
    def finalize(self) -> torch.Tensor:
        """Decode every remaining token and return the rest of the audio (samples,). Idempotent."""
        if self.finished:
            return self._concat([])
        self._accept_pending()
        self.finished = True
        if self._num_tokens() == 0:
            return self._concat([])
        return self._decode_chunk(finalize=True)

    # -- internals ------------------------------------------------------------------------------------------------

    def _concat(self, pieces: list) -> torch.Tensor:
        if not pieces:
            return torch.zeros(0, device=self.model.device)
        return torch.cat(pieces)

    def _num_tokens(self) -> int:
        """Tokens pushed so far (checked or not)."""
        return self.token_start + self.tokens.shape[0] + sum(piece.shape[0] for piece, _ in self._pending)

    def _accept_pending(self) -> None:
        """Range-check the tokens pushed since the last chunk that `push` did not check (one host synchronisation,
        none if it checked them all) and append all of them to `tokens`."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        pieces = [piece for piece, _ in pending]
        unchecked = [piece for piece, checked in pending if not checked]
        if unchecked:
            try:
                self.model._check_token_range(torch.cat(unchecked))
            except ValueError as error:
                count = sum(piece.shape[0] for piece in pieces)
                message = f"{error}; the {count} tokens pushed since the last decoded chunk were discarded"
                raise ValueError(message) from None
        self.tokens = torch.cat([self.tokens, *pieces])

    def chunk_hop(self, index: int) -> int:
        """Tokens chunk `index` (0, 1, ...) covers unless it is the final one: `first_token_hop_len`, then
        `token_hop_len`, then each hop `stream_scale_factor` times the one before, up to `token_max_hop_len`."""
        return self.hop_schedule[min(index, len(self.hop_schedule) - 1)]

    def _next_hop(self) -> int:
        """Tokens the next chunk covers (`chunk_hop` of its index)."""
        return self.chunk_hop(self.chunks_decoded)

    @property
    def steady(self) -> bool:
        """Whether every later non-final chunk runs the shapes of the next one: its hop is the largest and the flow
        and HiFT windows are full (their histories are trimmed on the left)."""
        grown = self.chunks_decoded >= len(self.hop_schedule) - 1
        return grown and self.token_start > 0 and self.mel_start > 0

    def _decode_chunk(self, finalize: bool) -> torch.Tensor:
        flow_window = self._flow_window(finalize)
        if flow_window is not None:
            window, window_start, end = flow_window
            mel = self._flow(window, finalize, noise_offset=self.ratio * window_start)
            self._take_mel(mel, window_start, end, finalize)
        return self._vocode(finalize)

    def _flow_window(self, finalize: bool) -> Optional[tuple[torch.Tensor, int, int]]:
        """(window tokens (n,), its first token, the chunk's last token + 1) of the next chunk's flow call, or None
        when there is nothing to decode; the window starts `flow_left_context_tokens` before the chunk."""
        end = self._num_tokens() if finalize else self.token_offset + self._next_hop() + self.lookahead
        if end <= self.token_offset + (0 if finalize else self.lookahead):
            return None
        window_start = max(0, self.token_offset - self.flow_left_context)
        return self.tokens[window_start - self.token_start : end - self.token_start], window_start, end

    def _take_mel(self, mel: torch.Tensor, window_start: int, end: int, finalize: bool) -> None:
        """Append the new frames of the flow window's mel (1, mel_bins, real frames) and move past the chunk (`end`
        from `_flow_window`: the look-ahead tokens follow the chunk unless it is the final one)."""
        self.mel = torch.cat([self.mel, mel[:, :, self.ratio * (self.token_offset - window_start) :]], dim=2)
        self.token_offset = end if finalize else end - self.lookahead
        if not finalize:
            self.chunks_decoded += 1
        # Keep only the tokens the next flow window can reach.
        keep_from = max(0, self.token_offset - self.flow_left_context)
        self.tokens = self.tokens[keep_from - self.token_start :]
        self.token_start = keep_from

    def _flow(self, window: torch.Tensor, finalize: bool, noise_offset: int) -> torch.Tensor:
        """Mel (1, mel_bins, ratio * tokens') of the token window (tokens,), as `tokens_to_mel` computes it.

        With `flow_window_sizes`, the window is right-padded to the smallest size that holds it and the padding is
        hidden from attention; the flow's convs look left only
        (apart from the pre-lookahead conv, which then sees zeros exactly where a final call pads), so the real
        frames are unchanged up to float rounding while every call has one of a few fixed shapes.
        """
        model = self.model
        if self.flow_window_sizes is None:
            return model.tokens_to_mel(
                window.unsqueeze(0), self.speaker_embedding, finalize=finalize, noise_offset=noise_offset
            )
        inputs, real_frames = self._flow_inputs(window, finalize, noise_offset, self.padded_window(window.shape[0]))
        conditioning = self._time_conditioning()
        if self._graphs is None:
            mel = flow_window_to_mel(model.flow, *inputs, *conditioning)
        else:  # the same, as one graph replay
            mel = self._graphs["flow"](*inputs, *conditioning)
        return mel[:, :, :real_frames]

    def padded_window(self, num_tokens: int) -> int:
        """The size a flow window of `num_tokens` tokens is padded to (`flow_window_sizes`; None: not padded)."""
        if self.flow_window_sizes is None:
            return num_tokens
        return next((size for size in self.flow_window_sizes if size >= num_tokens), num_tokens)

    def _flow_inputs(
        self, window: torch.Tensor, finalize: bool, noise_offset: int, padded: int, masked: bool = False
    ) -> tuple[tuple[torch.Tensor, ...], int]:
        """The inputs of `flow_window_to_mel` but the time conditioning, for the token window (tokens,) right-padded
        to `padded` tokens: ((tokens (1, padded), lengths (1,), noise (1, mel_bins, frames), speaker condition
        (1, mel_bins), key mask (1, 1, 1, frames) or None), real frames), frames = token_mel_ratio * padded. The mask
        is given whenever frames are hidden, under CUDA graphs (one signature) or when `masked` (batched rows)."""
        model = self.model
        num_tokens = window.shape[0]
        flow = model.flow
        tokens = F.pad(window, (0, padded - num_tokens)).unsqueeze(0)
        real_frames = self.ratio * (num_tokens if finalize else num_tokens - self.lookahead)
        frames = self.ratio * padded  # the look-ahead tokens' frames are computed too, then hidden
        masked = masked or real_frames < frames or self.cuda_graphs  # graph replays always take a mask
        # The token count and the key-padding mask (1, 1, 1, frames), True = may attend (the layout
        # `build_attention_mask` returns), or None. Kept per shape: once the windows are full, every chunk passes the
        # same tensors, which the graph runner does not copy again (no launches while the GPU waits for the flow).
        key = (num_tokens, real_frames, frames, masked)
        if key not in self._window_inputs:
            # torch.full, not torch.tensor([n]): a fill kernel instead of a host-to-device copy.
            lengths = torch.full((1,), num_tokens, device=tokens.device)
            mask = None
            if masked:
                mask = (torch.arange(frames, device=tokens.device) < real_frames).view(1, 1, 1, frames)
            self._window_inputs[key] = (lengths, mask)
        lengths, mask = self._window_inputs[key]
        if self._speaker_condition is None:  # the same for every chunk of the reply
            self._speaker_condition = flow.speaker_condition(
                model.get_speaker_embedding(speaker_embedding=self.speaker_embedding)
            )
        dtype = flow.input_embedding.weight.dtype  # of the token embeddings, hence of mu
        noise = flow.decoder.start_noise(1, frames, noise_offset).to(dtype)
        return (tokens, lengths, noise, self._speaker_condition, mask), real_frames

    def _time_conditioning(self) -> tuple[torch.Tensor, ...]:
        """`flow.decoder.cached_time_conditioning` for one row.

        The same for every chunk of every reply: computed once per model (again if the weights or precision change),
        and fetched once per reply: checking that model cache's ~50 weight versions is host work on every chunk,
        during which the GPU waits (the weights do not change within a reply, as for the speaker condition)."""
        if self._conditioning is None:
            flow = self.model.flow
            self._conditioning = flow.decoder.cached_time_conditioning(
                1, self.model.device, flow.input_embedding.weight.dtype
            )
        return self._conditioning

    def _vocode(self, finalize: bool) -> torch.Tensor:
        inputs = self._hift_inputs(finalize)
        if inputs is None:
            return self._concat([])
        decode_mel, source, window_start, audio_end = inputs
        if self._graphs is not None and not finalize:
            wav = self._graphs["hift"](decode_mel, source)
        else:
            wav = self.model.hift.decode(decode_mel, source, finalize=finalize)
        return self._take_audio(wav, window_start, audio_end)

    def _hift_inputs(self, finalize: bool) -> Optional[tuple[torch.Tensor, torch.Tensor, int, int]]:
        """(mel (1, mel_bins, frames), source (1, 1, frames * 480), first frame, frames final after the call) of the
        next HiFT filter call, or None when no audio becomes final; extends the f0 / phase state first."""
        hift = self.model.hift
        mel_end = self.mel_start + self.mel.shape[-1]
        audio_end = mel_end if finalize else mel_end - self.hift_holdback_frames  # frames final after this call
        if audio_end <= self.emitted_frames:
            return None
        window_start = max(self.mel_start, self.emitted_frames - self.hift_left_context)
        mel = self.mel[:, :, window_start - self.mel_start :]
        f0_lookahead = 0 if finalize else hift.f0_predictor.lookahead
        source_end = mel_end - f0_lookahead  # frames that get an excitation in this call

        # f0 of frames not seen before. The float64 predictor runs on them plus the `left_context` (8) frames each
        # one depends on, not on the whole window; the window has that many real frames before them, so they are
        # exact.
        f0_end = self.f0_start + self.f0.shape[1]
        if source_end > f0_end:
            first = max(0, f0_end - window_start - hift.f0_predictor.left_context)
            f0_new = hift.predict_f0(mel[:, :, first:], finalize=finalize)[:, f0_end - window_start - first :]
            self._extend_source_state(f0_new.to(torch.float32))
        source = self._source(window_start, source_end)
        return mel[:, :, : source_end - window_start], source, window_start, audio_end

    def _take_audio(self, wav: torch.Tensor, window_start: int, audio_end: int) -> torch.Tensor:
        """The new audio (samples,) of the HiFT call's output wav (1, samples) for `_hift_inputs`' window; drops the
        history the next window cannot reach."""
        wav = wav[0, (self.emitted_frames - window_start) * self.samples_per_frame :]
        self.emitted_frames = audio_end
        keep_from = max(0, self.emitted_frames - self.hift_left_context)
        self.mel = self.mel[:, :, keep_from - self.mel_start :]
        self.mel_start = keep_from
        self.f0 = self.f0[:, keep_from - self.f0_start :]
        self.phase_cycles = self.phase_cycles[:, keep_from - self.f0_start :]
        self.f0_start = keep_from
        return wav

    def _extend_source_state(self, f0_new: torch.Tensor) -> None:
        """Append f0 (1, n) float32 and the running sum of (f0 * h / sample_rate) mod 1 over frames, in float64.

        The reference takes a float32 cumsum from sample 0 (accumulated in double on CPU); continuing a float64
        running sum reproduces it exactly on CPU and stays precise for long replies.
        """
        hift = self.model.hift
        harmonics = torch.arange(1, hift.num_harmonics + 1, dtype=torch.float32, device=f0_new.device)
        cycles = ((f0_new.unsqueeze(-1) * harmonics / hift.sampling_rate) % 1).to(torch.float64)
        previous = self.phase_cycles[:, -1:] if self.phase_cycles.shape[1] else torch.zeros_like(cycles[:, :1])
        running = torch.cumsum(torch.cat([previous, cycles], dim=1), dim=1)[:, 1:]
        self.f0 = torch.cat([self.f0, f0_new], dim=1)
        self.phase_cycles = torch.cat([self.phase_cycles, running], dim=1)

    def _source(self, start: int, end: int) -> torch.Tensor:
        """Excitation (1, 1, (end - start) * 480) of frames [start, end), as `hift.source_from_f0` would compute it
        over the whole history (same float32 arithmetic), with the noise table read at absolute sample positions."""
        hift = self.model.hift
        scale = self.samples_per_frame
        first = start - self.f0_start
        f0 = self.f0[:, first : end - self.f0_start]
        phase = self.phase_cycles[:, first : end - self.f0_start].to(torch.float32) * 2 * math.pi
        sines = (torch.sin(phase * scale) * hift.sine_amp).repeat_interleave(scale, dim=1)
        table = hift.m_source.l_sin_gen.sine_waves
        table_len = table.shape[1]
        if table_len == 0:
            raise ValueError("HiFT source tables are not initialised: call model.hift.init_source_tables()")
        sample_start, num_samples = start * scale, (end - start) * scale
        if sample_start + num_samples <= table_len:
            noise = table[:, sample_start : sample_start + num_samples]
        else:  # past 300 s the reference would fail; wrap around the table instead
            index = torch.arange(sample_start, sample_start + num_samples, device=table.device) % table_len
            noise = table.index_select(1, index)
        return hift.merge_source(sines, hift.f0_to_sample_rate(f0), noise)


# A stream's integer sizes and the smallest value of each; the optional ones may also be None (their default).
STREAM_SIZE_MINIMA = {"token_hop_len": 1, "first_token_hop_len": 1, "token_max_hop_len": 1, "pre_lookahead_len": 0,
                      "flow_left_context_tokens": 0, "hift_left_context_frames": 8}  # fmt: skip
_OPTIONAL_STREAM_SIZES = ("first_token_hop_len", "token_max_hop_len")


def checked_stream_size(name: str, value) -> Optional[int]:
    """`value` of the stream size `name` (a `STREAM_SIZE_MINIMA` key) as an int >= its minimum (None stays None for
    an optional one), else a ValueError naming `name`. A bool is not taken for an int here; numpy integers are."""
    minimum, optional = STREAM_SIZE_MINIMA[name], name in _OPTIONAL_STREAM_SIZES
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        allowed = f"None or an int >= {minimum}" if optional else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def hop_schedule(
    first_token_hop_len: int, token_hop_len: int, token_max_hop_len: Optional[int], stream_scale_factor: float
) -> tuple[int, ...]:
    """The hops of chunks 0, 1, 2, ... up to the first that reaches `token_max_hop_len` (None = `token_hop_len`: no
    growth); every later chunk has the last one. The reference's growth: each hop after the second is
    `min(token_max_hop_len, int(previous * stream_scale_factor))`."""
    if token_max_hop_len is None:
        token_max_hop_len = token_hop_len
    if not _positive_int(token_max_hop_len) or token_max_hop_len < token_hop_len:
        raise ValueError(
            f"token_max_hop_len must be None or an int >= token_hop_len ({token_hop_len}), got {token_max_hop_len!r}"
        )
    if isinstance(stream_scale_factor, bool) or not isinstance(stream_scale_factor, (int, float)):
        raise ValueError(f"stream_scale_factor must be a number >= 1, got {stream_scale_factor!r}")
    if not math.isfinite(stream_scale_factor) or stream_scale_factor < 1:
        raise ValueError(f"stream_scale_factor must be a finite number >= 1, got {stream_scale_factor!r}")
    hops = [first_token_hop_len, token_hop_len]
    if token_max_hop_len > token_hop_len and int(token_hop_len * stream_scale_factor) <= token_hop_len:
        # A hop that grows grows more the next time: checking the first step rules out a schedule that stalls.
        raise ValueError(
            f"stream_scale_factor={stream_scale_factor} does not grow token_hop_len={token_hop_len} towards "
            f"token_max_hop_len={token_max_hop_len} (int({token_hop_len} * {stream_scale_factor}) = "
            f"{int(token_hop_len * stream_scale_factor)}); use a larger factor"
        )
    while hops[-1] < token_max_hop_len:
        hops.append(min(token_max_hop_len, int(hops[-1] * stream_scale_factor)))
    return tuple(hops)


def positive_int_sizes(value) -> bool:
    """Whether `value` is a non-empty tuple or list of ints >= 1 (window or batch sizes)."""
    return isinstance(value, (tuple, list)) and bool(value) and all(_positive_int(size) for size in value)


# "auto" flow window sizes under CUDA graphs: the first, then x4 up to the longest window.
_AUTO_FIRST_WINDOW, _AUTO_WINDOW_GROWTH = 32, 4


def _flow_window_sizes(
    bucket, longest: int, compiled: bool, graphed: bool, steady_windows: tuple[int, ...] = ()
) -> Optional[tuple[int, ...]]:
    """The padded flow window sizes of `flow_window_bucket_tokens` (see `CosyVoice3StreamingDecoder`), ascending,
    the last one `longest`; None = exact shapes. "auto" under CUDA graphs also takes `steady_windows` (the window of
    a chunk of each hop with full left context) as sizes."""
    if bucket == "auto":
        if compiled:
            return (longest,)
        if not graphed:
            return None
        sizes, size = set(steady_windows), _AUTO_FIRST_WINDOW
        while size < longest:
            sizes.add(size)
            size *= _AUTO_WINDOW_GROWTH
        return (*sorted(size for size in sizes if size < longest), longest)
    if bucket is None:
        return None
    if _positive_int(bucket):
        return (*range(bucket, longest, bucket), longest)
    if positive_int_sizes(bucket):
        return (*sorted({size for size in bucket if size < longest}), longest)
    raise ValueError(
        "flow_window_bucket_tokens must be None, 'auto', an int >= 1 or a tuple of ints >= 1, got "
        f"{bucket!r}"
    )


def _checked_when_pushed(tokens: torch.Tensor) -> bool:
    """Whether `push` range-checks these tokens at once: on the CPU that needs no device synchronisation."""
    return tokens.device.type == "cpu"


def flow_window_to_mel(
    flow: torch.nn.Module,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    noise: torch.Tensor,
    speaker_condition: torch.Tensor,
    mask: Optional[torch.Tensor],
    *conditioning: torch.Tensor,
) -> torch.Tensor:
    """Mel (1, mel_bins, token_mel_ratio * padded) of a right-padded token window, from the tokens to the Euler
    solver's output: the part of a streamed chunk that the decoder replays as one CUDA graph (the token embedding and
    look-ahead conv included, so that the GPU does not wait for their eager launches before the solver's graph).

    tokens (1, padded) with `lengths` (1,) real tokens (embeddings past them are zeroed, so the look-ahead conv of
    the last real tokens sees the real look-ahead tokens or, for a final call, zeros, exactly as an unpadded call);
    noise (1, mel_bins, token_mel_ratio * padded) start point, in the token embeddings' dtype; speaker_condition
    (1, mel_bins); mask (1, 1, 1, frames) key mask or None; conditioning: `flow.decoder.cached_time_conditioning`.
    """
    mu = flow.frame_condition(tokens, lengths, finalize=True)
    return flow.decoder.solve(noise, mu, speaker_condition, torch.zeros_like(mu), mask, *conditioning)


# Recordings a model's runners keep (least recently used beyond). Flow: at most one per window size ("auto": 3 at a
# fixed hop, 6 with the hop growing to 100, 7 to 200) and batch size (`streaming_batch_cosyvoice3.GRAPH_BATCH_SIZES`:
# 5); a server's warm-up records 15, 22 and 23 of them at these three. HiFT: its window grows over the first few
# chunks (and hops), then stays the same, per batch size: 25 to 30 there. A load must not evict what the warm-up
# recorded (a recording on the way to a reply's audio costs hundreds of milliseconds); one memory pool per runner, so
# more recordings cost only their static inputs and outputs.
_MAX_FLOW_GRAPHS, _MAX_HIFT_GRAPHS = 48, 64

# Serialises the first creation of a model's runners (streams of one model may start in several threads).
_GRAPH_RUNNERS_LOCK = threading.Lock()


def _graph_runners(model: "CosyVoice3Token2Wav") -> dict[str, CUDAGraphRunner]:
    """The model's {"flow", "hift"} graph runners (`new_graph_runners`), created on first use. The model owns them
    (`model.streaming_graph_runners`, shared by its streaming decoders: a reply's decoder replays the graphs an
    earlier reply recorded); they are freed with the model, or by `model.clear_streaming_graphs()`."""
    with _GRAPH_RUNNERS_LOCK:
        runners = model.streaming_graph_runners
        if runners is None:
            runners = new_graph_runners(model)
            model.streaming_graph_runners = runners
    return runners


def new_graph_runners(model: "CosyVoice3Token2Wav") -> dict[str, CUDAGraphRunner]:
    """New {"flow": token window to mel (`flow_window_to_mel`), "hift": non-final filter} graph runners of `model`'s
    streamed chunks, with a memory pool of their own: their replays may run at the same time as those of the
    model's own runners (on another CUDA stream), which `decode_ready(..., graph_runners=...)` then replays. The
    caller owns them (and the memory their recordings hold)."""
    config, flow, hift = model.config, model.flow, model.hift
    estimator = flow.decoder.estimator

    def settings(*modules: torch.nn.Module):
        # What the recorded kernels depend on besides the input shapes: precision settings, and where the weights
        # live (a `.to()` re-allocates them; a graph holds their old addresses), and HiFT's conv layout
        # (`use_channels_last_convolutions` re-allocates the filter's weights).
        weights = [next(module.parameters()) for module in modules]
        # The fused DiT q/k/v copies (`fuse_qkv_projections`) and the position convs' tap-major weights
        # (`store_tap_major_weights`) are new tensors each time they are built.
        blocks = estimator.transformer_blocks
        fused = blocks[0].attn.qkv_weight if len(blocks) else None
        tap_major = estimator.input_embed.conv_pos_embed.conv1_tap_major
        return (
            config.estimator_autocast_dtype,
            None if tap_major is None else tap_major.data_ptr(),
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            tuple((weight.data_ptr(), weight.dtype) for weight in weights),
            None if fused is None else fused.data_ptr(),
            getattr(modules[-1], "channels_last_convolutions", None),
        )

    return {
        "flow": CUDAGraphRunner(
            functools.partial(flow_window_to_mel, flow),
            functools.partial(settings, flow.input_embedding, flow.pre_lookahead_layer, estimator),
            max_graphs=_MAX_FLOW_GRAPHS,
        ),
        "hift": CUDAGraphRunner(
            functools.partial(hift.decode, finalize=False),
            functools.partial(settings, hift),
            max_graphs=_MAX_HIFT_GRAPHS,
        ),
    }


__all__ = ["CosyVoice3StreamingDecoder", "hop_schedule", "new_graph_runners"]
