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

from .audio_io import load_audio
from .configuration_cosyvoice3 import CosyVoice3Config
from .configuration_funaudiochat import FunAudioChatAudioEncoderConfig, FunAudioChatConfig
from .data_collator_funaudiochat import FunAudioChatDataCollator
from .generation_funaudiochat import (
    FunAudioChatGenerationConfig,
    FunAudioChatSpeechOutput,
    SpeechGenerator,
    SpeechStreamEvent,
)
from .modeling_cosyvoice3 import CosyVoice3Token2Wav
from .modeling_funaudiochat import FunAudioChatForConditionalGeneration, FunAudioChatPreTrainedModel
from .pipeline_speech_to_speech import SpeechToSpeechPipeline, register_pipeline
from .processing_funaudiochat import (
    AUDIO_TEMPLATE,
    DEFAULT_S2M_PROMPT,
    DEFAULT_S2T_PROMPT,
    SPOKEN_S2M_PROMPT,
    FunAudioChatProcessor,
)
from .streaming_cosyvoice3 import CosyVoice3StreamingDecoder


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
    register_pipeline()


_register()

__all__ = [
    "AUDIO_TEMPLATE",
    "DEFAULT_S2M_PROMPT",
    "DEFAULT_S2T_PROMPT",
    "SPOKEN_S2M_PROMPT",
    "CosyVoice3Config",
    "CosyVoice3StreamingDecoder",
    "CosyVoice3Token2Wav",
    "FunAudioChatAudioEncoderConfig",
    "FunAudioChatConfig",
    "FunAudioChatDataCollator",
    "FunAudioChatForConditionalGeneration",
    "FunAudioChatPreTrainedModel",
    "FunAudioChatProcessor",
    "FunAudioChatGenerationConfig",
    "FunAudioChatSpeechOutput",
    "SpeechGenerator",
    "SpeechStreamEvent",
    "SpeechToSpeechPipeline",
    "load_audio",
]
