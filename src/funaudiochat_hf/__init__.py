"""Fun-Audio-Chat speech-to-speech for transformers 5.

Importing the package registers the configs, models, processor and the `speech-to-speech` pipeline with the
transformers Auto classes, so `AutoModel.from_pretrained`, `AutoProcessor.from_pretrained` and
`pipeline("speech-to-speech", model=...)` work on official and converted checkpoints.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSeq2SeqLM,
    AutoProcessor,
)

from .configuration_cosyvoice3 import CosyVoice3Config
from .configuration_funaudiochat import FunAudioChatAudioEncoderConfig, FunAudioChatConfig
from .modeling_cosyvoice3 import CosyVoice3Token2Wav
from .modeling_funaudiochat import FunAudioChatForConditionalGeneration, FunAudioChatPreTrainedModel
from .processing_funaudiochat import FunAudioChatProcessor


__version__ = "0.1.0"


def _register() -> None:
    AutoConfig.register(FunAudioChatConfig.model_type, FunAudioChatConfig, exist_ok=True)
    AutoConfig.register(FunAudioChatAudioEncoderConfig.model_type, FunAudioChatAudioEncoderConfig, exist_ok=True)
    AutoConfig.register(CosyVoice3Config.model_type, CosyVoice3Config, exist_ok=True)
    AutoModel.register(FunAudioChatConfig, FunAudioChatForConditionalGeneration, exist_ok=True)
    # The official example scripts load the chat model through AutoModelForSeq2SeqLM (sic); keep them working.
    AutoModelForSeq2SeqLM.register(FunAudioChatConfig, FunAudioChatForConditionalGeneration, exist_ok=True)
    AutoModel.register(CosyVoice3Config, CosyVoice3Token2Wav, exist_ok=True)
    AutoProcessor.register(FunAudioChatConfig, FunAudioChatProcessor, exist_ok=True)


_register()

__all__ = [
    "CosyVoice3Config",
    "CosyVoice3Token2Wav",
    "FunAudioChatAudioEncoderConfig",
    "FunAudioChatConfig",
    "FunAudioChatForConditionalGeneration",
    "FunAudioChatPreTrainedModel",
    "FunAudioChatProcessor",
]
