"""Offline flow calls of `CosyVoice3Token2Wav.forward` replayed as CUDA graphs, padded to a few bucket lengths.

Short offline calls are bound by kernel launches; a recorded graph replays the whole flow (token embedding,
look-ahead conv, Euler solver) in one launch. The model owns the recordings (`offline_flow_graphs`).
"""

import functools
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.nn.functional as F

from .configuration_cosyvoice3 import CosyVoice3Config
from .cuda_graph_cosyvoice3 import CUDAGraphRunner
from .modeling_cosyvoice3_flow import build_attention_mask
from .streaming_cosyvoice3 import flow_window_to_mel


if TYPE_CHECKING:
    from .modeling_cosyvoice3_flow import CosyVoice3Flow


# Offline flow calls replayed as CUDA graphs pad their tokens up to the first of these lengths that fits, so that a
# few graphs serve every reply length (the padding is hidden from attention by a key mask, as for a padded batch).
# Longer calls (over ~30 s) are bound by compute rather than by kernel launches and run as ordinary calls.
OFFLINE_GRAPH_BUCKET_TOKENS = (64, 128, 192, 256, 384, 512, 768)
# Recorded offline flow graphs kept per model (bucket x batch size), least recently used dropped.
OFFLINE_MAX_GRAPHS = 4


def flow_graph_settings(config: CosyVoice3Config, flow: "CosyVoice3Flow") -> tuple:
    """What a CUDA graph of the flow depends on besides its input shapes: the estimator's precision, the TF32
    switches, and where the weights and their derived copies (fused q/k/v, tap-major position convs) live (a `.to()`,
    a precision cast or a re-fuse re-allocates them; a graph holds the old addresses)."""
    estimator = flow.decoder.estimator
    blocks = estimator.transformer_blocks
    fused = blocks[0].attn.qkv_weight if len(blocks) else None
    tap_major = estimator.input_embed.conv_pos_embed.conv1_tap_major
    weights = [next(module.parameters()) for module in (flow.input_embedding, flow.pre_lookahead_layer, estimator)]
    return (
        config.estimator_autocast_dtype,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        tuple((weight.data_ptr(), weight.dtype) for weight in weights),
        None if fused is None else fused.data_ptr(),
        None if tap_major is None else tap_major.data_ptr(),
    )


class CosyVoice3OfflineGraphsMixin:
    """The offline CUDA-graph path of `CosyVoice3Token2Wav` (its `flow`, `config`, `device` and the
    `_offline_flow_graphs` slot it initialises)."""

    def _resolve_cuda_graphs(self, cuda_graphs: Union[bool, str]) -> bool:
        on_cuda = self.device.type == "cuda"
        if cuda_graphs == "auto":
            return on_cuda and not self.flow_compiles_cuda_graphs
        if cuda_graphs not in (True, False):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {self.device}")
        return cuda_graphs

    @staticmethod
    def offline_graph_bucket(num_tokens: int) -> Optional[int]:
        """The padded length of an offline flow call of `num_tokens` tokens replayed as a CUDA graph (None: too long,
        an ordinary call)."""
        return next((bucket for bucket in OFFLINE_GRAPH_BUCKET_TOKENS if bucket >= num_tokens), None)

    @property
    def offline_flow_graphs(self) -> CUDAGraphRunner:
        """The CUDA graphs of offline flow calls (`forward(cuda_graphs=...)`), created on first use and owned by this
        model: one recording per bucket length and batch size, at most `OFFLINE_MAX_GRAPHS` (each holds its
        activations' memory), least recently used dropped; `clear_offline_flow_graphs()` frees them all."""
        if self._offline_flow_graphs is None:
            self._offline_flow_graphs = CUDAGraphRunner(
                functools.partial(flow_window_to_mel, self.flow),
                functools.partial(flow_graph_settings, self.config, self.flow),
                max_graphs=OFFLINE_MAX_GRAPHS,
            )
        return self._offline_flow_graphs

    def clear_offline_flow_graphs(self) -> None:
        self._offline_flow_graphs = None

    def _bucketed_flow(
        self,
        tokens: torch.Tensor,
        speaker_embedding: torch.Tensor,
        lengths: list[int],
        bucket: int,
        runner: Optional[CUDAGraphRunner] = None,
    ) -> torch.Tensor:
        """Final flow call of rows of `tokens` (batch, used) (valid ids; row i has `lengths[i]` real tokens),
        right-padded to `bucket` tokens with a key mask: mel (batch, mel_bins, token_mel_ratio * used) float32.
        Replayed by `runner` (a `CUDAGraphRunner` of `flow_window_to_mel`), or called directly (None)."""
        flow, ratio = self.flow, self.config.token_mel_ratio
        batch, used = tokens.shape
        token_lengths = torch.tensor(lengths, device=self.device)
        frames = ratio * bucket
        dtype = flow.input_embedding.weight.dtype  # of the token embeddings, hence of mu
        inputs = (
            F.pad(tokens, (0, bucket - used)),
            token_lengths,
            flow.decoder.start_noise(batch, frames).to(dtype),
            flow.speaker_condition(speaker_embedding),
            build_attention_mask(token_lengths * ratio, frames, None, self.device, batch),
            *flow.decoder.cached_time_conditioning(batch, self.device, dtype),
        )
        mel = flow_window_to_mel(flow, *inputs) if runner is None else runner(*inputs)
        return mel[:, :, : ratio * used]


__all__ = ["OFFLINE_GRAPH_BUCKET_TOKENS", "OFFLINE_MAX_GRAPHS", "CosyVoice3OfflineGraphsMixin", "flow_graph_settings"]
