"""Device defaults and speed options of `CosyVoice3Token2Wav`: estimator precision, fused q/k/v projections,
`torch.compile` of the estimator and the vocoder."""

import threading
from typing import Optional

import torch
from transformers.utils import logging

from .configuration_cosyvoice3 import ESTIMATOR_PRECISIONS
from .triton_support import MIN_CAPABILITY


logger = logging.get_logger(__name__)

# Serialises `apply_device_defaults` (two threads' first calls must not both cast the weights); held only then.
_DEVICE_DEFAULTS_LOCK = threading.Lock()


class CosyVoice3PerformanceMixin:
    """Speed settings of `CosyVoice3Token2Wav` (its `flow`, `hift`, `config`, `device` and the
    `_device_defaults_applied` slot it initialises)."""

    def compile_estimator(
        self, whole_solver: bool = False, fuse_qkv_projections: bool = True, **compile_kwargs
    ) -> None:
        """`torch.compile` the DiT estimator in place (the 10-step Euler loop calls it with fixed shapes).

        whole_solver=True compiles the whole Euler loop (`flow.decoder.solve`: 10 steps x CFG batch) as one graph
        instead, which with `mode="reduce-overhead"` replays as one CUDA graph per input length. `compile_kwargs`
        go to `torch.compile`; `dynamic` defaults to True (streaming chunk lengths vary). On CUDA in float32, inputs
        on either side of ~10 s of tokens (`MAX_UNFOLD_ELEMENTS`) are two graphs (a 16-bit estimator runs its
        position convs as a Triton kernel at every length). Offline calls of a few seconds are bound by kernel
        launches: `mode="reduce-overhead"` replays each input length as a CUDA graph (recorded on its first call),
        which measured about twice as fast for a 10 s call (docs/performance.md). `fuse_qkv_projections` (default
        True): first run each DiT block's q/k/v projections as one GEMM ([`fuse_qkv_projections`]). The position
        embedding's conv weights are stored tap-major for its Triton kernel (`store_tap_major_weights`).
        """
        if fuse_qkv_projections:
            self.fuse_qkv_projections()
        self.flow.decoder.estimator.input_embed.conv_pos_embed.store_tap_major_weights()
        compile_kwargs.setdefault("dynamic", True)
        self._flow_compile_kwargs = dict(compile_kwargs)
        logger.warning("compile_estimator: the decoder's next call compiles its DiT estimator (a minute or more).")
        if whole_solver:
            decoder = self.flow.decoder
            decoder.solve = torch.compile(decoder.solve, **compile_kwargs)
        else:
            self.flow.decoder.estimator.compile(**compile_kwargs)

    def compile_vocoder(self, channels_last_convolutions: Optional[bool] = None, **compile_kwargs) -> None:
        """`torch.compile` HiFT's upsampling stack (`hift.filter_body`: its convs and Snake residual blocks) in place.

        The STFT / iSTFT around it stay eager (complex tensors). Inductor fuses the element-wise ops between the
        convs: the 72 Snake activations (each one Triton kernel eagerly on CUDA, `snake_cosyvoice3`, which traces as
        its torch expression for Inductor), the convs' bias adds and the residual sums; streaming decoders replay the
        compiled stack inside their CUDA graph. `compile_kwargs` go to `torch.compile`; `dynamic` defaults to True
        (the vocoder windows of a stream and offline lengths vary). A streamed chunk's vocoder stage measured faster
        so, with no offline gain; the first call compiles for about a minute longer (docs/performance.md).

        `channels_last_convolutions` (None = True when the model is on a CUDA device) first calls
        `hift.use_channels_last_convolutions()`: the filter's convs and the element-wise ops between them run
        channels-last, so that cuDNN's NHWC kernels need no layout conversions (convs with channel counts that are
        not multiples of 8, such as the 18-channel source_downs and conv_post, keep the default layout). A streamed
        chunk measured slightly faster so (docs/performance.md).
        """
        if channels_last_convolutions is None:
            channels_last_convolutions = self.device.type == "cuda"
        if channels_last_convolutions:
            self.hift.use_channels_last_convolutions()
        compile_kwargs.setdefault("dynamic", True)
        logger.warning("compile_vocoder: the decoder's next call compiles its vocoder (about a minute).")
        self.hift.filter_body = torch.compile(self.hift.filter_body, **compile_kwargs)

    def use_low_precision_estimator(self, dtype: str = "bfloat16") -> None:
        """Run the DiT estimator in `dtype` ("bfloat16" or "float16"), storing its weights in that dtype.

        Sets `config.estimator_precision` and `config.estimator_autocast_dtype` and casts the estimator's parameters
        (not its buffers: the rotary table stays float32) once, in place. Under autocast every Linear / Conv casts
        its float32 weights to `dtype` on each call (7 casts per DiT block, 10 Euler steps per flow call); weights
        already in `dtype` give the same values without those casts, so the output is unchanged (tested bit-exact
        against autocast over float32 weights) and the estimator's weight memory halves. In place: reload the model
        to get the float32 weights back (`estimator_precision="float32"` then keeps them).
        """
        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {dtype!r}")
        self.config.estimator_precision = dtype
        self._cast_estimator(dtype)

    @torch.no_grad()
    def _cast_estimator(self, precision: str) -> None:
        """Store the estimator's parameters in `precision` and run it so (autocast for a 16-bit one); the derived
        weight copies (fused q/k/v, tap-major position convs) follow."""
        dtype = getattr(torch, precision)
        self.config.estimator_autocast_dtype = None if precision == "float32" else precision
        for parameter in self.flow.decoder.estimator.parameters():
            parameter.data = parameter.data.to(dtype)
        if self.qkv_projections_fused:
            self.fuse_qkv_projections()
        position_embedding = self.flow.decoder.estimator.input_embed.conv_pos_embed
        if position_embedding.conv1_tap_major is not None or (self.device.type == "cuda" and precision != "float32"):
            position_embedding.store_tap_major_weights()

    def resolved_estimator_precision(self, device: Optional[torch.device] = None) -> str:
        """What `config.estimator_precision` means on `device` (default: the model's): an explicit precision is
        itself; "auto" is bfloat16 on CUDA (or the 16-bit dtype the estimator already runs in) and, elsewhere or on a
        GPU without bfloat16 tensor cores (`older_gpu`), the precision it runs in now (float32 for a freshly loaded
        model), which `apply_device_defaults` leaves alone."""
        precision = self.config.estimator_precision
        if precision not in ESTIMATOR_PRECISIONS:
            raise ValueError(f"config.estimator_precision must be one of {ESTIMATOR_PRECISIONS}, got {precision!r}")
        if precision != "auto":
            return precision
        current = self.config.estimator_autocast_dtype
        device = device or self.device
        if device.type == "cuda" and not older_gpu(device):
            return current or "bfloat16"
        return current or "float32"

    def apply_device_defaults(self) -> None:
        """Bring the decoder to its default settings for the device it is on, once per device type.

        `forward`, `tokens_to_mel` and `streaming_decoder` call it, so a model moved with `.to()` / `.cuda()`,
        loaded with `device_map` or built under `with torch.device("cuda")` gets them on its first call there (a
        `.to()` override would miss the last two, which never call it). It applies `config.estimator_precision`
        ("auto": bfloat16 on CUDA; one log line when it casts), and on CUDA keeps the weight copies that the
        uncompiled estimator is faster with: the fused q/k/v projections (`fuse_qkv_projections`: one GEMM instead
        of three per block and Euler step) and, for a 16-bit estimator, the tap-major position-conv weights that its
        Triton kernel reads (`store_tap_major_weights`: no transposing copy per call). The copies are taken now:
        after changing the estimator's weights in place, fuse / store them again. After the first call this is one
        attribute check.
        """
        device_type = self.device.type
        if self._device_defaults_applied == device_type:
            return
        with _DEVICE_DEFAULTS_LOCK:
            if self._device_defaults_applied == device_type:
                return
            precision = self.resolved_estimator_precision()
            weights = {parameter.dtype for parameter in self.flow.decoder.estimator.parameters()}
            running = self.config.estimator_autocast_dtype or "float32"
            # "auto" off CUDA, or on a GPU without bfloat16 tensor cores, leaves the estimator as it is (also
            # autocast set over float32 weights).
            older = device_type == "cuda" and older_gpu(self.device)
            leave = self.config.estimator_precision == "auto" and (device_type != "cuda" or older)
            if leave and older:
                major, minor = torch.cuda.get_device_capability(self.device)
                logger.info(
                    f"CosyVoice3 decoder on a GPU of compute capability {major}.{minor}: DiT estimator kept in "
                    f"{running} (estimator_precision='auto' picks bfloat16 on GPUs with bfloat16 tensor cores, "
                    f"{'.'.join(map(str, MIN_CAPABILITY))} and newer)"
                )
            if not leave and (running != precision or weights != {getattr(torch, precision)}):
                logger.info(
                    f"CosyVoice3 decoder on {device_type}: DiT estimator in {precision} "
                    f"(estimator_precision={self.config.estimator_precision!r}; 'float32' keeps the reference's)"
                )
                self._cast_estimator(precision)
            if device_type == "cuda":
                if not self.qkv_projections_fused:
                    self.fuse_qkv_projections()
                position_embedding = self.flow.decoder.estimator.input_embed.conv_pos_embed
                if self.config.estimator_autocast_dtype is not None and position_embedding.conv1_tap_major is None:
                    position_embedding.store_tap_major_weights()
            self._device_defaults_applied = device_type

    def fuse_qkv_projections(self) -> None:
        """Run each DiT block's q/k/v projections as one GEMM: 22 x 10 fewer GEMMs per flow call at full size, which
        matter where the flow is bound by kernel latency (streaming chunks, short offline calls). Equal up to float
        rounding. The fused weights are non-persistent copies (checkpoints are unchanged), taken now: call it again,
        or `unfuse_qkv_projections()`, after changing the estimator's weights (`use_low_precision_estimator` does).
        `compile_estimator()` calls it by default."""
        for block in self.flow.decoder.estimator.transformer_blocks:
            block.attn.fuse_qkv_projections()

    def unfuse_qkv_projections(self) -> None:
        for block in self.flow.decoder.estimator.transformer_blocks:
            block.attn.unfuse_qkv_projections()

    @property
    def qkv_projections_fused(self) -> bool:
        blocks = self.flow.decoder.estimator.transformer_blocks
        return len(blocks) > 0 and blocks[0].attn.qkv_weight is not None

    @property
    def flow_is_compiled(self) -> bool:
        """Whether `compile_estimator` was called (streaming decoders then give the flow one fixed shape)."""
        return getattr(self, "_flow_compile_kwargs", None) is not None

    @property
    def flow_compiles_cuda_graphs(self) -> bool:
        """Whether the compiled flow records its own CUDA graphs (`mode="reduce-overhead"` / `"max-autotune"`)."""
        mode = (getattr(self, "_flow_compile_kwargs", None) or {}).get("mode")
        return mode in ("reduce-overhead", "max-autotune")


__all__ = ["CosyVoice3PerformanceMixin"]


def older_gpu(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU without bfloat16 tensor cores (compute capability below `MIN_CAPABILITY`: a T4,
    a V100), where a bfloat16 estimator would be slower, not faster. False on a host without CUDA."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) < MIN_CAPABILITY
