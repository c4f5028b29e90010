"""FunAudioChatForConditionalGeneration: parity with the reference outputs (fixtures b, c, d), loading quirks,
text-only `generate`, and training details (gradient checkpointing)."""

import copy
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForSeq2SeqLM

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf.compat import OUTPUT_CACHE_FIELD, cache_kwargs
from funaudiochat_hf.configuration_funaudiochat import FunAudioChatConfig
from funaudiochat_hf.modeling_funaudiochat import (
    FunAudioChatAudioEncoder,
    FunAudioChatForConditionalGeneration,
    sinusoid_position_table,
)

from conftest import FUNAUDIOCHAT_GOLDEN, FUNAUDIOCHAT_TINY


ATOL = RTOL = 1e-4
OLD_TRANSFORMERS_PYTHON = "/tmp/venv517/bin/python"  # transformers 5.17 (the GPU machine's version), if present


def assert_close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def prompt_inputs(inputs):
    """The stored processor outputs of fixture (a) (conftest `inputs`): one 2.45 s clip in the S2S chat prompt."""
    return inputs


@pytest.fixture(scope="module")
def train_golden():
    return load_file(FUNAUDIOCHAT_GOLDEN / "d_train.safetensors")


def train_batch(golden):
    return {k[len("batch."):]: v.clone() for k, v in golden.items() if k.startswith("batch.")}


# --------------------------------------------------------------------------------------------------------------------
# Loading


def test_loads_official_layout_without_missing_or_unexpected_keys():
    model, info = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32, output_loading_info=True)
    assert isinstance(model, FunAudioChatForConditionalGeneration)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # The speech head is the speech embedding (the checkpoint stores only the latter).
    assert model.audio_invert_tower.lm_head.weight is model.audio_tower.embed_tokens.weight
    assert model.audio_invert_tower.crq_transformer.embed_tokens is None
    # The non-persistent sinusoid table is rebuilt after loading.
    assert torch.equal(model.continuous_audio_tower.positional_embedding, sinusoid_position_table(1500, 32))
    assert model.config.audio_config._attn_implementation == "sdpa"
    # The official example scripts' auto class works too.
    assert isinstance(AutoModelForSeq2SeqLM.from_pretrained(FUNAUDIOCHAT_TINY), FunAudioChatForConditionalGeneration)


def test_checkpoint_with_leftover_crq_embeddings_and_explicit_speech_head_loads(tmp_path):
    for path in FUNAUDIOCHAT_TINY.iterdir():
        if path.is_file() and path.name != "model.safetensors":
            (tmp_path / path.name).symlink_to(path)
    state = load_file(FUNAUDIOCHAT_TINY / "model.safetensors")
    state["audio_invert_tower.crq_transformer.embed_tokens.weight"] = torch.randn(384, 32)
    state["audio_invert_tower.lm_head.weight"] = state["audio_tower.embed_tokens.weight"].clone()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})

    model, info = AutoModel.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.audio_invert_tower.lm_head.weight is model.audio_tower.embed_tokens.weight
    assert torch.equal(model.audio_tower.embed_tokens.weight, state["audio_tower.embed_tokens.weight"])


def test_save_reload_round_trip_reproduces_logits(model, prompt_inputs, tmp_path):
    model.save_pretrained(tmp_path)
    saved_keys = load_file(tmp_path / "model.safetensors").keys()
    assert "audio_invert_tower.lm_head.weight" not in saved_keys  # tied duplicate, as in the official checkpoint
    assert saved_keys == load_file(FUNAUDIOCHAT_TINY / "model.safetensors").keys()
    reloaded = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, actual = model(**prompt_inputs), reloaded(**prompt_inputs)
    assert torch.equal(actual.logits, expected.logits)
    assert torch.equal(actual.speech_logits, expected.speech_logits)


def test_sharded_bf16_checkpoint_loads(model, prompt_inputs, tmp_path):
    bf16 = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    reloaded, info = AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out = reloaded.eval()(**prompt_inputs)
        reference = model(**prompt_inputs)
    assert out.logits.dtype == torch.bfloat16
    # bf16 rounding only: the text logits stay close to the float32 ones.
    assert_close(out.logits.float(), reference.logits, atol=0.3, rtol=0.05)


def test_device_map_auto_and_no_split_modules_name_real_classes(model):
    no_split = set(model._no_split_modules)
    module_classes = {type(m).__name__ for m in model.modules()}
    assert no_split <= module_classes
    loaded = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, device_map="auto")
    assert loaded.audio_invert_tower.lm_head.weight is loaded.audio_tower.embed_tokens.weight
    assert torch.equal(loaded.continuous_audio_tower.positional_embedding.cpu(), sinusoid_position_table(1500, 32))


def test_loads_from_a_home_relative_path(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "fac").symlink_to(FUNAUDIOCHAT_TINY)
    monkeypatch.setenv("HOME", str(home))
    model = FunAudioChatForConditionalGeneration.from_pretrained("~/models/fac", dtype=torch.float32)
    assert model.config.audio_token_index == 346


def test_text_lm_head_is_not_tied_and_input_grads_can_be_enabled(model):
    language_model = model.language_model
    assert language_model.lm_head.weight is not language_model.model.embed_tokens.weight
    assert model.audio_invert_tower.crq_transformer.embed_tokens is None
    model.enable_input_require_grads()  # PEFT + gradient checkpointing calls this on every sub-model
    model.disable_input_require_grads()


# --------------------------------------------------------------------------------------------------------------------
# Parity with the reference (float32)


def test_audio_features_match_reference(model, prompt_inputs):
    golden = load_file(FUNAUDIOCHAT_GOLDEN / "b_audio_features.safetensors")
    with torch.no_grad():
        out = model.get_audio_features(
            prompt_inputs["input_features"],
            prompt_inputs["feature_attention_mask"],
            prompt_inputs["speech_ids"].shape[-1],
        )
    assert torch.equal(out.audio_output_lengths, golden["audio_output_lengths"])
    assert_close(out.last_hidden_state, golden["audio_features"])


def test_default_feature_padding_gives_the_reference_outputs(model, prompt_inputs):
    """The processor's default features (padded to the longest clip) give the logits and tokens of the reference's
    (padded to the extractor's whole window): the encoder reads only valid frames."""
    from transformers import AutoProcessor

    from funaudiochat_hf import AUDIO_TEMPLATE, SPOKEN_S2M_PROMPT

    processor = AutoProcessor.from_pretrained(FUNAUDIOCHAT_TINY)
    clip = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")["waveform_16k"].numpy()
    messages = [{"role": "system", "content": SPOKEN_S2M_PROMPT}, {"role": "user", "content": AUDIO_TEMPLATE}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    compact = processor(text=text, audio=[clip])
    full = processor(text=text, audio=[clip], feature_padding="max_length")
    assert compact["input_features"].shape[-1] < full["input_features"].shape[-1] == 3000
    assert torch.equal(compact["input_ids"], prompt_inputs["input_ids"])
    with torch.no_grad():
        compact_out, full_out = model(**compact), model(**full)
    assert_close(compact_out.logits, full_out.logits, atol=1e-5, rtol=1e-5)
    assert_close(compact_out.speech_logits, full_out.speech_logits, atol=1e-5, rtol=1e-5)
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=320)
    assert torch.equal(model.generate(**compact, **kwargs), model.generate(**full, **kwargs))


def test_eager_attention_gives_the_sdpa_result(prompt_inputs):
    """The reference's own eager path scrambles heads; ours must not."""
    golden = load_file(FUNAUDIOCHAT_GOLDEN / "b_audio_features.safetensors")
    eager = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32, attn_implementation="eager").eval()
    assert eager.config.audio_config._attn_implementation == "eager"
    with torch.no_grad():
        features = eager.get_audio_features(
            prompt_inputs["input_features"], prompt_inputs["feature_attention_mask"], 65
        ).last_hidden_state
    assert_close(features, golden["audio_features"])


def test_eval_forward_matches_reference(model, prompt_inputs):
    golden = load_file(FUNAUDIOCHAT_GOLDEN / "c_forward.safetensors")
    with torch.no_grad():
        out = model(**prompt_inputs)
    assert_close(out.logits, golden["text_logits"])
    assert_close(out.speech_logits, golden["speech_logits"])
    assert_close(out.last_hidden_state, golden["last_hidden_state"])
    assert out.loss is None and out.speech_loss is None


def test_training_forward_losses_logits_and_gradients_match_reference(train_golden):
    model = AutoModel.from_pretrained(FUNAUDIOCHAT_TINY, dtype=torch.float32).train()
    out = model(**train_batch(train_golden))
    assert_close(out.loss, train_golden["loss"])
    assert_close(out.text_loss, train_golden["text_loss"])
    assert_close(out.speech_loss, train_golden["speech_loss"])
    assert_close(out.logits, train_golden["text_logits"])
    assert_close(out.speech_logits, train_golden["speech_logits"])
    out.loss.backward()
    for name in ("language_model.model.layers.0.self_attn.q_proj.weight", "audio_tower.embed_tokens.weight"):
        assert_close(model.get_parameter(name).grad, train_golden[f"grad.{name}"])


def test_training_inputs_embeds_and_labels_match_reference(model, train_golden):
    batch = train_batch(train_golden)
    labels = batch.pop("labels")
    prompt_args = {k: v for k, v in batch.items() if k != "attention_mask"}
    with torch.no_grad():
        inputs_embeds = model.embed_prompt(**prompt_args)
        prompt = model._embed_prompt(**prompt_args)
    assert_close(inputs_embeds, train_golden["internal.lm_inputs_embeds"])
    assert torch.equal(model._text_labels(labels, prompt), train_golden["internal.lm_labels"])
    assert torch.equal(model._speech_labels(labels, prompt), train_golden["internal.speech_labels"])


def test_forward_with_precomputed_inputs_embeds_matches(model, prompt_inputs):
    embed_args = {k: v for k, v in prompt_inputs.items() if k != "attention_mask"}
    with torch.no_grad():
        full = model(**prompt_inputs)
        inputs_embeds = model.embed_prompt(**embed_args)
        precomputed = model(input_ids=prompt_inputs["input_ids"], inputs_embeds=inputs_embeds)
        embeds_only = model(inputs_embeds=inputs_embeds)
    assert_close(precomputed.logits, full.logits)
    assert_close(precomputed.speech_logits, full.speech_logits)
    assert_close(embeds_only.logits, full.logits)
    assert embeds_only.speech_logits is None  # the speech head needs the input ids
    with pytest.raises(ValueError, match="input_ids or inputs_embeds"):
        model()


def test_placeholder_count_mismatch_raises_naming_both_counts(model, prompt_inputs):
    input_ids = prompt_inputs["input_ids"]
    audio_positions = (input_ids[0] == model.config.audio_token_index).nonzero().squeeze(1)
    one_less = torch.cat([input_ids[:, : audio_positions[0]], input_ids[:, audio_positions[0] + 1 :]], dim=1)
    inputs = dict(prompt_inputs, input_ids=one_less)
    inputs.pop("attention_mask")
    message = rf"{len(audio_positions) - 1} <\|AUDIO\|> placeholders .* {len(audio_positions)} groups"
    with pytest.raises(ValueError, match=message):
        model.embed_prompt(**inputs)
    with pytest.raises(ValueError, match="no speech_ids"):
        model.embed_prompt(input_ids)


def test_token_ids_out_of_range_raise_clear_errors(model, prompt_inputs):
    inputs = dict(prompt_inputs)
    inputs.pop("attention_mask")
    vocab = model.get_input_embeddings().num_embeddings
    too_big = inputs["input_ids"].clone()
    too_big[0, 0] = vocab
    with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, {vocab}\)"):
        model.embed_prompt(**dict(inputs, input_ids=too_big))
    negative = inputs["speech_ids"].clone()
    negative[0, 0] = -1
    with pytest.raises(ValueError, match="speech_ids must lie in"):
        model(**dict(inputs, speech_ids=negative))
    with pytest.raises(ValueError, match=r"`input_ids` has ids outside the text vocabulary \[0, \d+\)"):
        model.generate_speech(too_big[:, :20], max_new_tokens=2)


def test_empty_clip_gives_zero_rows_and_does_not_change_the_other_clip(model):
    encoder = model.continuous_audio_tower
    torch.manual_seed(0)
    frames = 437  # 3 chunks: 200 + 200 + 37
    features = torch.randn(128, frames)
    with torch.no_grad():
        alone = encoder(features, torch.tensor([frames]), speech_maxlen=120).last_hidden_state
        with_empty = encoder(features, torch.tensor([0, frames, 0]), speech_maxlen=120).last_hidden_state
        all_empty = encoder(features[:, :0], torch.tensor([0, 0]), speech_maxlen=10).last_hidden_state
    _, output_len = FunAudioChatAudioEncoder.output_lengths(torch.tensor(frames))
    assert output_len == 109
    assert torch.equal(with_empty[0], torch.zeros_like(with_empty[0]))
    assert torch.equal(with_empty[2], torch.zeros_like(with_empty[2]))
    assert_close(with_empty[1], alone[0])
    assert alone[0, :109].abs().sum(-1).min() > 0 and torch.equal(alone[0, 109:], torch.zeros(11, 64))
    assert torch.equal(all_empty, torch.zeros(2, 10, 64))
    # Truncation to speech_maxlen keeps the first frames.
    with torch.no_grad():
        short = encoder(features, torch.tensor([frames]), speech_maxlen=50).last_hidden_state
    assert_close(short[0], alone[0, :50])


def test_encoder_output_lengths():
    after_conv, output = FunAudioChatAudioEncoder.output_lengths(torch.tensor([100, 3000, 300, 1, 0]))
    assert after_conv.tolist() == [50, 1500, 150, 1, 0]
    assert output.tolist() == [25, 750, 75, 0, 0]


def test_encode_groups_is_output_matching_of_group_mean(model):
    ids = torch.tensor([[1, 2, 3, 4, 5, 36, 36, 36, 36, 36]])
    tower = model.audio_tower
    expected = tower.output_matching(tower.embed_tokens(ids).reshape(1, 2, 5, -1).mean(2))
    assert_close(tower.encode_groups(ids), expected)
    with pytest.raises(ValueError, match="multiple of group_size"):
        tower.encode_groups(ids[:, :7])


def test_crq_positions_default_to_sub_position_index(model, prompt_inputs):
    with torch.no_grad():
        plain = model(**prompt_inputs)
        length = prompt_inputs["input_ids"].shape[1]
        explicit = model(**prompt_inputs, position_ids=torch.arange(length)[None])
    assert_close(explicit.speech_logits, plain.speech_logits)


def test_disable_speech_skips_the_speech_head(model, prompt_inputs, train_golden):
    with torch.no_grad():
        out = model(**prompt_inputs, disable_speech=True)
    assert out.speech_logits is None
    batch = train_batch(train_golden)
    with torch.no_grad():
        out = model(**batch, disable_speech=True)
    assert out.speech_loss is None
    assert_close(out.loss, train_golden["text_loss"])


def test_bad_feature_mask_raises(model, prompt_inputs):
    with pytest.raises(ValueError, match="feature_attention_mask"):
        model.get_audio_features(prompt_inputs["input_features"], prompt_inputs["feature_attention_mask"][:, :10], 65)


# --------------------------------------------------------------------------------------------------------------------
# Text-only generation through the standard `generate`


def greedy_reference(model, prompt_inputs, steps):
    """Manual greedy loop without cache: full prompt embeddings, then one appended token embedding per step."""
    embed_args = {k: v for k, v in prompt_inputs.items() if k != "attention_mask"}
    tokens = []
    with torch.no_grad():
        embeds = model.embed_prompt(**embed_args)
        for _ in range(steps):
            token = model.language_model(inputs_embeds=embeds).logits[:, -1].argmax(-1)
            tokens.append(int(token))
            embeds = torch.cat([embeds, model.get_input_embeddings()(token)[:, None]], dim=1)
    return tokens


def test_text_generate_matches_manual_greedy_loop(model, prompt_inputs):
    steps = 8
    sequences = model.generate(
        **prompt_inputs, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=320
    )
    prompt_len = prompt_inputs["input_ids"].shape[1]
    assert torch.equal(sequences[:, :prompt_len], prompt_inputs["input_ids"])
    assert sequences[0, prompt_len:].tolist() == greedy_reference(model, prompt_inputs, steps)


def test_generate_with_several_return_sequences_keeps_each_rows_clips(model):
    """Regression: with num_return_sequences / beams, transformers repeats every model input row by row; the audio
    inputs are per clip (a row may hold several), so each copy of a row must get that row's clips again, in order."""
    from transformers import AutoProcessor

    from funaudiochat_hf import AUDIO_TEMPLATE

    processor = AutoProcessor.from_pretrained(FUNAUDIOCHAT_TINY)
    clip = load_file(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")["waveform_16k"].numpy()
    clips = [clip[:20000].copy(), clip[8000:].copy(), clip[4000:16000].copy()]  # 2 clips in row 0, 1 in row 1
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": AUDIO_TEMPLATE + " and " + AUDIO_TEMPLATE}], add_generation_prompt=True
        ),
        processor.apply_chat_template([{"role": "user", "content": AUDIO_TEMPLATE}], add_generation_prompt=True),
    ]
    kwargs = dict(max_new_tokens=4, eos_token_id=None, pad_token_id=320, return_dict_in_generate=True)
    single_inputs = [processor(text=texts[0], audio=clips[:2]), processor(text=texts[1], audio=clips[2:])]
    # References without any expansion: each row alone, greedy, and its next-token logits from a plain forward.
    greedy = [model.generate(**inputs, **kwargs, do_sample=False).sequences[0, -4:] for inputs in single_inputs]
    with torch.no_grad():
        first_logits = [model(**inputs).logits[0, -1] for inputs in single_inputs]
    batch = processor(text=texts, audio=[clips[:2], clips[2:]], padding_side="left")
    assert batch["speech_ids"].shape[0] == 3  # clip-level inputs: 3 clips for 2 rows
    # top_k=1 sampling = greedy, 2 returned copies per row; beam search, 2 beams returned (all start from the prompt).
    for expand in ({"do_sample": True, "top_k": 1, "num_return_sequences": 2}, {"num_beams": 2, "num_return_sequences": 2}):
        out = model.generate(**batch, **kwargs, **expand, output_logits=True)
        assert out.sequences.shape[0] == 4
        for row in range(2):
            for copy in (2 * row, 2 * row + 1):
                torch.testing.assert_close(out.logits[0][copy], first_logits[row], atol=1e-4, rtol=1e-4)
                if "top_k" in expand:
                    assert torch.equal(out.sequences[copy, -4:], greedy[row]), (row, copy)


def test_generate_continues_from_a_returned_cache(model, prompt_inputs):
    """`generate(..., cache=<returned cache>)` (`past_key_values=` before transformers 5.24) gives the tokens of one
    uninterrupted call. The same audio inputs are passed again: the cached prefix holds them already."""
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=320)
    audio = {k: v for k, v in prompt_inputs.items() if k not in ("input_ids", "attention_mask")}
    whole = model.generate(**prompt_inputs, max_new_tokens=6, **kwargs)
    first = model.generate(**prompt_inputs, max_new_tokens=3, return_dict_in_generate=True, **kwargs)
    cache = getattr(first, OUTPUT_CACHE_FIELD)
    assert cache.get_seq_length() == first.sequences.shape[1] - 1
    mask = torch.ones_like(first.sequences)
    rest = model.generate(first.sequences, attention_mask=mask, **audio, **cache_kwargs(cache), max_new_tokens=3, **kwargs)
    assert torch.equal(rest, whole)


def test_return_dict_false_gives_the_outputs_tuple(model, prompt_inputs):
    with torch.no_grad():
        out = model(**prompt_inputs)
        flat = model(**prompt_inputs, return_dict=False)
    assert isinstance(flat, tuple) and len(flat) == len(out.to_tuple())
    for got, expected in zip(flat, out.to_tuple()):
        if isinstance(expected, torch.Tensor):
            assert torch.equal(got, expected)
    with torch.no_grad():
        features = model.get_audio_features(prompt_inputs["input_features"], return_dict=False)
    assert isinstance(features, tuple) and features[0].shape[-1] == model.config.text_config.hidden_size


def test_get_audio_features_follows_the_transformers_convention(model, prompt_inputs):
    """Only `input_features` needed; `output_hidden_states` / `output_attentions` / `return_dict` as transformers' own
    audio models take them; the features do not depend on what else is returned."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    features = prompt_inputs["input_features"]
    layers = model.config.audio_config.encoder_layers
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        plain = model.get_audio_features(input_features=features)
        full = eager.get_audio_features(input_features=features, output_hidden_states=True, output_attentions=True)
    assert isinstance(plain, BaseModelOutputWithPooling)
    # Default mask: every frame valid; default length: the clip's output length.
    assert plain.last_hidden_state.shape == (1, int(plain.audio_output_lengths[0]), model.config.hidden_size)
    assert plain.hidden_states is None and plain.attentions is None
    assert_close(full.last_hidden_state, plain.last_hidden_state)
    assert len(full.hidden_states) == layers + 1 and len(full.attentions) == layers
    chunks, frames = full.hidden_states[0].shape[:2]
    heads = model.config.audio_config.encoder_attention_heads
    assert full.attentions[0].shape == (chunks, heads, frames, frames)
    # Softmax rows over the valid keys of each chunk.
    assert_close(full.attentions[-1].sum(-1), torch.ones(chunks, heads, frames))


def test_keep_in_fp32_modules_name_only_modules_the_model_has(model):
    from funaudiochat_hf.tiny_model import tiny_model_config

    assert model.token2wav is None and not model._keep_in_fp32_modules_strict
    with_decoder = FunAudioChatForConditionalGeneration(tiny_model_config())
    assert with_decoder._keep_in_fp32_modules_strict == {"token2wav"}
    assert any(name.startswith("token2wav.") for name in with_decoder.state_dict())


def test_every_trainable_parameter_gets_a_gradient_from_audio_inputs(model, train_golden):
    """The official checkpoint's unused `audio_bos_eos_token` table still loads (a buffer under the same key), but is
    no parameter that never gets a gradient."""
    key = "continuous_audio_tower.audio_bos_eos_token.weight"
    assert torch.equal(model.state_dict()[key], load_file(FUNAUDIOCHAT_TINY / "model.safetensors")[key])
    trained = copy.deepcopy(model).train()
    trained(**train_batch(train_golden)).loss.backward()
    no_gradient = [name for name, param in trained.named_parameters() if param.requires_grad and param.grad is None]
    assert not no_gradient


@pytest.mark.skipif(not os.path.exists(OLD_TRANSFORMERS_PYTHON), reason="no transformers 5.17 interpreter")
def test_config_forward_and_text_generate_on_transformers_5_17(model, prompt_inputs):
    script = f"""
import torch, funaudiochat_hf
from transformers import AutoModel
from safetensors.torch import load_file
model = AutoModel.from_pretrained({str(FUNAUDIOCHAT_TINY)!r}, dtype=torch.float32).eval()
stored = load_file({str(FUNAUDIOCHAT_GOLDEN / "a_processor_outputs.safetensors")!r})
inputs = {{k: v for k, v in stored.items() if k != "waveform_16k"}}
out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=320)
with torch.no_grad():
    logits = model(**inputs).logits
print(model.config.audio_token_index, model.config.text_config.sil_index, model.config.sampling_rate,
      funaudiochat_hf.FunAudioChatConfig().audio_token_index)
print(float((logits - load_file({str(FUNAUDIOCHAT_GOLDEN / "c_forward.safetensors")!r})["text_logits"]).abs().max()))
print(out[0, inputs["input_ids"].shape[1]:].tolist())
"""
    result = subprocess.run([OLD_TRANSFORMERS_PYTHON, "-c", script], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    config_line, logits_error, tokens = result.stdout.strip().splitlines()[-3:]
    assert config_line.split() == ["346", "350", "24000", "151669"]  # the official config.json reads the same
    assert float(logits_error) < ATOL
    assert tokens == str(greedy_reference(model, prompt_inputs, 8))


# --------------------------------------------------------------------------------------------------------------------
# Training on a tiny random config


def tiny_config(**overrides):
    text = dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=64, pad_token_id=0, eos_token_id=0, bos_token_id=0,
                audio_bos_index=60, audio_eos_index=61, sil_index=62)
    crq = dict(model_type="qwen3", hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=8, vocab_size=8)
    audio = dict(d_model=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=8,
                 max_source_positions=100, n_window=10, output_dim=32, codebook_size=12, bos_token_id=8,
                 eos_token_id=9, pad_token_id=10, group_size=5, crq_transformer_config=crq)
    audio.update(overrides)
    return FunAudioChatConfig(audio_config=audio, text_config=text, audio_token_index=63)


def tiny_batch():
    """One user clip (waveform, 12 speech frames -> 3 groups) and one assistant clip (speech tokens, 2 groups)."""
    generator = torch.Generator().manual_seed(0)
    user = [1, 2, 60] + [63] * 3 + [61, 3]
    assistant = [60] + [63] * 2 + [61, 4]
    input_ids = torch.tensor([user + assistant])
    labels = torch.tensor([[-100] * len(user) + assistant])
    speech_ids = torch.tensor([[10] * 12 + [10] * 3, [8] * 5 + [1, 2, 3, 4, 5] + [10] * 5])
    speech_attention_mask = torch.tensor([[1] * 12 + [0] * 3, [1] * 10 + [0] * 5])
    return dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        labels=labels,
        speech_ids=speech_ids,
        speech_attention_mask=speech_attention_mask,
        input_features=torch.randn(1, 8, 60, generator=generator),
        feature_attention_mask=torch.tensor([[1] * 47 + [0] * 13]),
        feature_exist_mask=torch.tensor([True, False]),
        text_ids=torch.tensor([[0, 0], [5, 6]]),
        text_attention_mask=torch.tensor([False, True]),
    )


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(mode):
    torch.manual_seed(0)
    config = tiny_config(continuous_features_mode=mode)
    model = FunAudioChatForConditionalGeneration(config).train()
    assert model.audio_invert_tower.lm_head.weight is model.audio_tower.embed_tokens.weight
    batch = tiny_batch()

    out = model(**batch)
    out.loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    # transformers 5.24 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    assert model.language_model.model.layers[0].gradient_checkpointing
    assert model.continuous_audio_tower.layers[0].gradient_checkpointing
    assert model.audio_invert_tower.crq_transformer.layers[0].gradient_checkpointing
    checkpointed = model(**batch)
    checkpointed.loss.backward()

    assert torch.isfinite(out.loss) and out.text_loss > 0 and out.speech_loss > 0
    assert_close(checkpointed.loss, out.loss)
    for name in ("continuous_audio_tower.layers.0.fc1.weight", "continuous_audio_tower.conv1.weight",
                 "audio_invert_tower.crq_transformer.layers.1.mlp.down_proj.weight",
                 "language_model.model.layers.0.self_attn.q_proj.weight", "audio_tower.embed_tokens.weight"):
        assert plain_grads[name].abs().sum() > 0, name
        assert_close(model.get_parameter(name).grad, plain_grads[name])


def test_batched_prompts_scatter_each_clip_into_its_own_row():
    torch.manual_seed(0)
    model = FunAudioChatForConditionalGeneration(tiny_config()).eval()
    generator = torch.Generator().manual_seed(1)
    rows = [[1, 60, 63, 63, 61, 2], [3, 60, 63, 63, 61, 4]]  # one clip of 2 groups per row
    features = torch.randn(2, 8, 50, generator=generator)
    feature_mask = torch.tensor([[1] * 40 + [0] * 10, [1] * 37 + [0] * 13])
    speech_ids = torch.full((2, 10), 10)
    speech_mask = torch.tensor([[1] * 10, [1] * 9 + [0]])
    with torch.no_grad():
        batched = model.embed_prompt(torch.tensor(rows), speech_ids, speech_mask, features, feature_mask)
        for i, row in enumerate(rows):
            single = model.embed_prompt(
                torch.tensor([row]),
                speech_ids[i : i + 1],
                speech_mask[i : i + 1],
                features[i : i + 1],
                feature_mask[i : i + 1],
            )
            assert_close(batched[i : i + 1], single)
    assert not torch.equal(batched[0, 2:4], batched[1, 2:4])


def test_bundled_speech_decoder_round_trips_and_stays_float32(tmp_path):
    from funaudiochat_hf.tiny_model import tiny_token2wav_config

    config = FunAudioChatConfig.from_pretrained(FUNAUDIOCHAT_TINY)
    config.token2wav_config = tiny_token2wav_config(36)
    torch.manual_seed(0)
    model = FunAudioChatForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    reloaded, info = AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert {p.dtype for p in reloaded.token2wav.parameters()} == {torch.float32}
    assert reloaded.language_model.lm_head.weight.dtype == torch.bfloat16
    expected = model.token2wav.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in reloaded.token2wav.state_dict().items())
    assert AutoModel.from_pretrained(FUNAUDIOCHAT_TINY).token2wav is None  # the official layout has no decoder


def test_audio_encoder_runs_padded_chunks_in_one_attention_call_without_host_syncs(model, monkeypatch):
    """Issue 4 (prefill): transformers' audio attention splits the packed chunks with `cu_seqlens.tolist()` in every
    layer (a host sync each) and attends chunk by chunk; the encoder instead runs the chunks padded to one length
    with a key mask, one attention call per layer. Same features as the per-chunk path, for clips of several
    lengths (full and partial chunks)."""
    from funaudiochat_hf.modeling_funaudiochat import FunAudioChatAudioAttention

    encoder = next(m for m in model.modules() if isinstance(m, FunAudioChatAudioEncoder))
    assert all(isinstance(layer.self_attn, FunAudioChatAudioAttention) for layer in encoder.layers)
    lengths = torch.tensor([245, 400, 17])  # 2 chunks (200 + 45), 2 full chunks, 1 short chunk
    features = torch.randn(encoder.config.num_mel_bins, int(lengths.sum()), generator=torch.Generator().manual_seed(0))

    def run(pad_chunks: bool):
        tolist_calls = []
        original_tolist = torch.Tensor.tolist
        monkeypatch.setattr(encoder, "pad_chunks", pad_chunks)
        monkeypatch.setattr(torch.Tensor, "tolist", lambda self: tolist_calls.append(1) or original_tolist(self))
        with torch.no_grad():
            out = encoder(features, lengths, 200).last_hidden_state
        monkeypatch.undo()
        return out, len(tolist_calls)

    padded, padded_syncs = run(True)
    packed, packed_syncs = run(False)
    assert_close(padded, packed)
    assert padded_syncs <= 3  # chunk lengths, clip lengths, clip indices
    assert packed_syncs >= padded_syncs + len(encoder.layers)  # + at least one per layer (3 in transformers 5.24)
