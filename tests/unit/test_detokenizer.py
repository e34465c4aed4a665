"""The incremental detokenizer with the real SmolLM2 tokenizer: UTF-8 safety and stop strings."""
import pytest
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer

KOREAN = "안녕하세요, 만나서 반갑습니다. 오늘 날씨가 정말 좋네요!"
EMOJI = "Party time 🎉🎊 with family 👨‍👩‍👧‍👦 and pizza 🍕"


@pytest.fixture(scope="module")
def tokenizer(smol_model_dir):
    return AutoTokenizer.from_pretrained(smol_model_dir)


def stream(tokenizer, text: str, stop=()):
    detok = IncrementalDetokenizer(tokenizer, tuple(stop))
    deltas = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        deltas.append(detok.add_token(token_id))
        if detok.stopped_by:
            break
    deltas.append(detok.flush())
    return [d for d in deltas if d], detok


@pytest.mark.parametrize("text", [KOREAN, EMOJI, "plain ascii text, nothing special"])
def test_deltas_rebuild_the_text_without_replacement_chars(tokenizer, text):
    deltas, detok = stream(tokenizer, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == text


def test_per_token_decoding_would_have_broken_korean(tokenizer):
    # The original decoded each token alone; this shows the input really splits characters.
    ids = tokenizer.encode(KOREAN, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_stop_string_is_never_streamed_even_partly(tokenizer):
    text = "The answer is 42. END OF ANSWER and more text after it"
    deltas, detok = stream(tokenizer, text, stop=["END OF ANSWER"])
    assert "".join(deltas) == "The answer is 42. "
    assert detok.stopped_by == "END OF ANSWER"
    for i in range(len(deltas)):
        streamed = "".join(deltas[: i + 1])
        assert not any(streamed.endswith("END OF ANSWER"[:k]) for k in range(2, 14))


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, detok = stream(tokenizer, "alpha beta gamma delta", stop=["delta", "beta"])
    assert "".join(deltas) == "alpha "
    assert detok.stopped_by == "beta"


def test_text_without_stop_is_released_in_full_at_flush(tokenizer):
    deltas, detok = stream(tokenizer, "no stop here", stop=["zzz-long-stop"])
    assert "".join(deltas) == "no stop here" and detok.stopped_by is None
