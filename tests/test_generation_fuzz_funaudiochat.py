"""A hypothesis fuzz test of `generate_speech`'s arguments on the tiny model (issue #50): every example ends in a
result or one clear `TypeError` / `ValueError`, and the model still gives its seeded result afterwards."""

import math

import pytest
import torch


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


AUDIO_TOKEN = 346
SEEDED = dict(max_new_tokens=3, do_sample=True, seed=11)

# Values of every kind for the arguments most often got wrong: right and wrong types, edges and out-of-range values.
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-5, 500), max_size=3),
)
ARGUMENTS = {
    "max_new_tokens": st.one_of(st.integers(-2, 6), ANY_VALUE),
    "temperature": st.one_of(st.floats(0, 3), ANY_VALUE),
    "top_p": st.one_of(st.floats(0, 1.2), ANY_VALUE),
    "top_k": st.one_of(st.integers(-1, 50), ANY_VALUE),
    "repetition_penalty": st.one_of(st.floats(0, 2), ANY_VALUE),
    "do_sample": ANY_VALUE,
    "eos_token_id": st.one_of(st.integers(-1, 400), ANY_VALUE),
    "pad_token_id": st.one_of(st.integers(-1, 400), ANY_VALUE),
    "seed": ANY_VALUE,
    "num_beams": st.one_of(st.integers(0, 3), ANY_VALUE),
    "text_greedy": ANY_VALUE,
    "disable_speech": ANY_VALUE,
    "speech_top_k": ANY_VALUE,
}


def _bounded(value) -> bool:
    """Keeps the examples cheap: no call may decode more than 6 steps."""
    return not (isinstance(value, int) and not isinstance(value, bool) and value > 6)


@pytest.fixture(scope="module")
def prompt(inputs):
    ids = inputs["input_ids"][0]
    return ids[ids != AUDIO_TOKEN][-12:][None]


@pytest.fixture(scope="module")
def seeded(model, prompt):
    return model.generate_speech(prompt, **SEEDED)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
@example(data=None)  # the hand-picked cases below, every run
def test_any_arguments_end_in_a_result_or_a_clear_error(model, prompt, seeded, data):
    if data is None:
        for kwargs in HAND_PICKED:
            _check_one(model, prompt, seeded, dict(kwargs))
        return
    names = data.draw(st.sets(st.sampled_from(sorted(ARGUMENTS)), max_size=4))
    _check_one(model, prompt, seeded, {name: data.draw(ARGUMENTS[name], label=name) for name in sorted(names)})


# Found by hand or by earlier runs: huge ints, infinities, a string seed, float ids-like values.
HAND_PICKED = [
    dict(top_k=2**70),
    dict(seed=2**70),
    dict(temperature=float("inf")),
    dict(repetition_penalty=float("-inf")),
    dict(eos_token_id=[2**70]),
    dict(pad_token_id=-1, eos_token_id=5),
    dict(max_new_tokens=10**9),
    dict(seed="7"),
]


def _check_one(model, prompt, seeded, kwargs: dict) -> None:
    if not _bounded(kwargs.get("max_new_tokens")):
        kwargs["max_new_tokens"] = 4
    kwargs.setdefault("max_new_tokens", 3)
    try:
        out = model.generate_speech(prompt, **kwargs)
    except (TypeError, ValueError) as error:
        message = str(error)
        assert message and "\n" not in message.strip() or "GenerationConfig" in message, message
    else:
        assert out.sequences.shape[0] == 1 and out.sequences.shape[1] > prompt.shape[1]
        assert out.sequences.dtype == torch.long and not math.isnan(float(out.sequences.float().sum()))
    again = model.generate_speech(prompt, **SEEDED)
    assert torch.equal(again.sequences, seeded.sequences) and torch.equal(again.speech_ids, seeded.speech_ids)
