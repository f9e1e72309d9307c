"""Generation: prompt in, tokens out, for any engine with `prefill(ids)`, `decode(id)`, `reset()`,
`n_past` and `n_ctx` (the CPU engine, the GPU engine).

`Session` remembers which tokens the engine has evaluated, so a multi-turn chat only prefills what
is new (ds4's prefix reuse, ds4-model.md §7). `generate` samples until EOS, the token budget or a
full context, calls `on_token` with each token as it comes, and times prefill and generation.
Ctrl-C (KeyboardInterrupt) ends the current generation cleanly: the result says "interrupted", and
if the interrupt landed inside an engine call (whose state is then half-updated) the session drops
its cache so the next turn re-evaluates the transcript. Inside a numba-compiled call the interrupt
arrives wrapped (`is_interrupt`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenResult:
    tokens: list[int] = field(default_factory=list)     # generated ids (the EOS included when hit)
    stop: str = "length"                                 # eos | length | context | interrupted
    n_prompt: int = 0                                    # tokens prefilled for this turn
    prefill_s: float = 0.0
    gen_s: float = 0.0
    prompt_logits: np.ndarray | None = None              # logits of the last prompt token

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return len(self.tokens) / self.gen_s if self.gen_s > 0 else 0.0

    def stats_line(self) -> str:
        """ds4's closing line."""
        return f"ds4py: prefill: {self.prefill_tps:.2f} t/s, generation: {self.gen_tps:.2f} t/s"


def is_interrupt(exc: BaseException | None) -> bool:
    """Ctrl-C, also when it lands inside a numba-compiled call: numba's dispatcher then raises
    SystemError("... returned a result with an exception set") whose cause is the
    KeyboardInterrupt (CI, session 19: the signal hit a lazily unpickled constant)."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class Session:
    """An engine plus the token list its state holds."""

    def __init__(self, engine):
        self.engine = engine
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.engine.reset()
        self.tokens = []

    def sync(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Make the state hold exactly `ids`, evaluating only what is not cached already.
        Returns (logits of the last token, tokens evaluated)."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("an empty prompt has nothing to continue from")
        common = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            common += 1
        # the state cannot be rolled back, and the last token must be evaluated to get its logits
        if common < len(self.tokens) or common == len(ids):
            self.reset()
            common = 0
        new = ids[common:]
        with self._guard():
            logits = self.engine.prefill(new)
        self.tokens = ids
        return logits, len(new)

    def decode(self, token: int) -> np.ndarray:
        with self._guard():
            logits = self.engine.decode(int(token))
        self.tokens.append(int(token))
        return logits

    def room(self) -> int:
        """Tokens that still fit in the context."""
        return self.engine.n_ctx - self.engine.n_past

    def _guard(self):
        session = self

        class Guard:
            def __enter__(self):
                return self

            def __exit__(self, exc_type, exc, tb):
                if exc_type is not None:        # half-updated state (Ctrl-C, error): start over
                    session.engine.reset()
                    session.tokens = []
                return False
        return Guard()


def generate(session: Session, prompt_ids: list[int], sampler, n_predict: int, eos_id: int,
             on_token=None, clock=time.perf_counter) -> GenResult:
    """Evaluate the prompt (reusing the cached prefix) and sample up to n_predict tokens.

    The last sampled token is not evaluated (the next turn's prefill does it when it is part of
    the transcript). `on_token(id)` is called for each token as soon as it is sampled."""
    result = GenResult()
    try:
        t0 = clock()
        logits, result.n_prompt = session.sync(prompt_ids)
        t1 = clock()
        result.prefill_s = t1 - t0
        result.prompt_logits = logits
        while len(result.tokens) < n_predict:
            token = int(sampler.sample(logits))
            result.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token == eos_id:
                result.stop = "eos"
                break
            if len(result.tokens) >= n_predict:
                break
            if session.room() < 1:
                result.stop = "context"
                break
            logits = session.decode(token)
        result.gen_s = clock() - t1
    except (KeyboardInterrupt, SystemError) as e:
        if not is_interrupt(e):
            raise
        result.stop = "interrupted"
        if result.prefill_s:
            result.gen_s = clock() - t0 - result.prefill_s
    return result
