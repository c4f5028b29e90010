"""Speech in, speech out with the `speech-to-speech` pipeline.

    python examples/speech_to_speech.py                       # tiny offline model, synthetic question (noise out)
    python examples/speech_to_speech.py question.wav --model FunAudioLLM/Fun-Audio-Chat-8B \
        --decoder path/to/Fun-CosyVoice3-0.5B-2512
"""

import argparse

import soundfile
from transformers import pipeline

import funaudiochat_hf  # noqa: F401  (registers the task)
from funaudiochat_hf.tiny_model import build_tiny_model, synthetic_question


parser = argparse.ArgumentParser()
parser.add_argument("question", nargs="?", help="audio file (default: a synthetic 2-s clip)")
parser.add_argument("--model", help="chat model (default: the tiny offline model, whose output is noise)")
parser.add_argument("--decoder", help="CosyVoice3 folder for the official two-repo layout")
parser.add_argument("-o", "--output", default="reply.wav")
args = parser.parse_args()

s2s = pipeline("speech-to-speech", model=args.model or str(build_tiny_model()), decoder=args.decoder)
question = args.question or {"array": synthetic_question(2.0), "sampling_rate": 16000}

# one reply
reply = s2s(question, max_new_tokens=64)
print("reply:", reply["text"])
soundfile.write(args.output, reply["audio"], reply["sampling_rate"])

# streamed: audio chunks arrive while the reply is generated
for event in s2s.stream(question, max_new_tokens=64):
    print(f"+{event['audio'].size} samples {event['text']!r}")

# a second turn: earlier assistant turns are text, user turns audio
chat = [
    {"role": "user", "content": [{"type": "audio", "audio": question}]},
    {"role": "assistant", "content": reply["text"]},
    {"role": "user", "content": [{"type": "audio", "audio": question}]},
]
print("second reply:", s2s(chat, max_new_tokens=64)["text"])
