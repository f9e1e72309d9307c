"""DS4 chat prompt rendering (ds4.c `encode_chat_prompt`, `ds4_chat_append_message`).

Special tokens are inserted by id; every text part is BPE'd on its own, so nothing merges across
a boundary. A one-shot prompt is

    [BOS] (+ think-max prefix) + BPE(system) + [<｜User｜>] + BPE(prompt) + [<｜Assistant｜>]
    + [<think>] when thinking, else [</think>]

There is no separator between the system text and <｜User｜>, and an empty system adds nothing.
"""

import re

from .tokenizer import BOS_TEXT, SPECIAL_TEXTS, Tokenizer

DEFAULT_SYSTEM = "You are a helpful assistant"

# Think-max: this text goes right after BOS (ds4's DS4_REASONING_EFFORT_MAX_PREFIX, the same text
# as DeepSeek's V4 encoder). ds4 only honours it when the context is >= 393216 tokens; below that
# the caller should fall back to think=True (see `effective_think`).
THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
THINK_MAX_MIN_CONTEXT = 393216

# think: True -> <think> (ds4 "high"), False -> </think> (--nothink), "max" -> prefix + <think>.
Think = bool | str


def effective_think(think: Think, ctx_size: int) -> Think:
    """ds4 downgrades think-max to normal thinking when the context is too small for it."""
    if think == "max" and ctx_size < THINK_MAX_MIN_CONTEXT:
        return True
    return think


def _check_think(think: Think) -> None:
    if think not in (True, False, "max"):
        raise ValueError(f"think must be True, False or 'max', not {think!r}")


def chat_begin(tok: Tokenizer, think: Think = True) -> list[int]:
    """BOS, plus the think-max prefix when asked for."""
    _check_think(think)
    ids = [tok.bos_id]
    if think == "max":
        ids += tok.encode(THINK_MAX_PREFIX)
    return ids


def assistant_prefix(tok: Tokenizer, think: Think = True) -> list[int]:
    """What opens the turn the model is about to generate."""
    _check_think(think)
    return [tok.assistant_id, tok.think_id if think else tok.end_think_id]


def message_ids(tok: Tokenizer, role: str, content: str) -> list[int]:
    """One history message, by ds4's rules:
    system/developer: the text as is; assistant: <｜Assistant｜> + </think> (unless the content
    opens with <think> or </think>) + text; user: <｜User｜> + text; tool/function: <｜User｜> +
    "Tool: " + text. Any other role is treated as user."""
    if role in ("system", "developer"):
        return tok.encode(content)
    if role == "assistant":
        ids = [tok.assistant_id]
        if not content.startswith(("<think>", "</think>")):
            ids.append(tok.end_think_id)
        return ids + tok.encode(content)
    ids = [tok.user_id]
    if role in ("tool", "function"):
        ids += tok.encode("Tool: ")  # BPE'd apart from the content, as ds4 does
    return ids + tok.encode(content)


def is_rendered(prompt: str) -> bool:
    """A prompt that starts with the literal BOS text is taken as already rendered."""
    return prompt.startswith(BOS_TEXT)


_SPECIAL_PATTERN = re.compile("|".join(re.escape(text) for text in SPECIAL_TEXTS))


def tokenize_rendered(tok: Tokenizer, text: str) -> list[int]:
    """Map the 7 special-token strings in `text` to their ids and BPE the spans between them
    (ds4 `tokenize_rendered_chat_vocab`). The easy way to feed an exact token sequence."""
    ids: list[int] = []
    span_start = 0
    for match in _SPECIAL_PATTERN.finditer(text):
        ids += tok.encode(text[span_start:match.start()])
        ids.append(tok.special_ids[match.group()])
        span_start = match.end()
    ids += tok.encode(text[span_start:])
    return ids


def render_prompt(tok: Tokenizer, prompt: str, system: str = DEFAULT_SYSTEM, think: Think = True) -> list[int]:
    """One user turn, ready for generation. A pre-rendered prompt (see `is_rendered`) is
    tokenized as it stands, and `system` and `think` are then ignored."""
    if is_rendered(prompt):
        return tokenize_rendered(tok, prompt)
    ids = chat_begin(tok, think)
    if system:
        ids += tok.encode(system)
    ids.append(tok.user_id)
    ids += tok.encode(prompt)
    return ids + assistant_prefix(tok, think)


def render_chat(tok: Tokenizer, messages, think: Think = True) -> list[int]:
    """A whole history -> ids ending with the assistant prefix, ready for generation.
    `messages` holds {"role": ..., "content": ...} dicts or (role, content) pairs; put the system
    prompt in as the first message if you want one."""
    ids = chat_begin(tok, think)
    for message in messages:
        role, content = (message["role"], message["content"]) if isinstance(message, dict) else message
        ids += message_ids(tok, role, content)
    return ids + assistant_prefix(tok, think)


class Conversation:
    """The token transcript of an interactive chat, kept equal to what the model has seen so the
    KV cache can be reused from turn to turn.

        conv = Conversation(tok)
        prompt = conv.add_user("Hi")   # whole transcript, ending with <｜Assistant｜><think>
        ... generate from prompt, collecting ids ...
        conv.add_reply(generated_ids)  # include the EOS if the model ended its turn with one
    """

    def __init__(self, tok: Tokenizer, system: str = DEFAULT_SYSTEM, think: Think = True):
        self.tok = tok
        self.think = think  # may be changed between turns (/think, /nothink)
        self.tokens = chat_begin(tok, think)
        if system:
            self.tokens += message_ids(tok, "system", system)

    def add_user(self, text: str) -> list[int]:
        """Append a user turn and the assistant prefix; return the full transcript."""
        self.tokens += message_ids(self.tok, "user", text)
        self.tokens += assistant_prefix(self.tok, self.think)
        return list(self.tokens)

    def add_reply(self, ids) -> None:
        """Append what the model generated for the current turn."""
        self.tokens += [int(i) for i in ids]
