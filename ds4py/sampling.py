"""ds4's token sampler (ds4.c `sample_top_p_min_p`, `sample_full_vocab`) and its RNG.

    temperature <= 0        greedy: the first index of the largest logit
    top_k == 0, top_p == 1  p_i = exp((l_i - l_max) / T) over the finite logits; drop p_i < min_p;
                            draw u * sum(p) and walk the survivors in vocabulary order
    top_p < 1               sort by logit (descending); keep tokens while p/sum >= (p_0/sum) * min_p
                            until the kept share reaches top_p; walk them in that order
    top_k > 0 (<= 1024)     the same, over the top_k logits only (ties: lower id first)

All arithmetic is float32 as in the C code. ds4's walk is `r -= p; if (r <= 0) pick`; here it
is the equivalent "first cumulative sum >= r" on a float32 running sum, which picks the same
token except when r lands within float32 rounding of a boundary. (ds4 itself is built with
fast-math, so its sums are re-associated and agree with any other build only to that level.)
"""

import time

import numpy as np

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.05
DEFAULT_TOP_K = 0
MAX_TOP_K = 1024

MASK64 = (1 << 64) - 1
XORSHIFT_ZERO_STATE = 0x9E3779B97F4A7C15  # a zero state would stay zero forever
XORSHIFT_MULTIPLIER = 0x2545F4914F6CDD1D


class XorShift64Star:
    """ds4's RNG: xorshift64* on a u64 state, Python ints masked to 64 bits."""

    def __init__(self, seed: int):
        self.state = seed & MASK64

    def next_u64(self) -> int:
        x = self.state or XORSHIFT_ZERO_STATE
        x ^= x >> 12
        x ^= (x << 25) & MASK64
        x ^= x >> 27
        self.state = x
        return (x * XORSHIFT_MULTIPLIER) & MASK64

    def next_f32(self) -> np.float32:
        """Uniform in [0, 1) from the top 24 bits of the output: exact in float32."""
        return np.float32(((self.next_u64() >> 40) & 0xFFFFFF) / 16777216.0)


def time_seed() -> int:
    """A seed for when none is given (ds4 mixes the time, pid and clock the same way)."""
    return (time.time_ns() ^ (time.perf_counter_ns() << 20)) & MASK64 or 1


def argmax_first(logits: np.ndarray) -> int:
    """ds4 `sample_argmax`: first index of the maximum; NaN never wins; 0 if nothing beats -inf."""
    values = np.where(np.isnan(logits), -np.inf, logits)
    return int(np.argmax(values))


def _relative_probs(logits: np.ndarray, max_logit: np.float32, temperature: np.float32) -> np.ndarray:
    """exp((l - l_max) / T) in float32: the largest logit gets exactly 1."""
    with np.errstate(over="ignore", under="ignore"):
        return np.exp((logits - max_logit) / temperature)


def _walk(probs: np.ndarray, u: np.float32) -> int | None:
    """Index where ds4's `r = u * sum; r -= p_i; stop when r <= 0` walk stops, or None when it
    runs off the end. `probs` are in walk order; the sum is the float32 running sum."""
    running = np.cumsum(probs, dtype=np.float32)
    r = np.float32(u * running[-1])
    index = int(np.searchsorted(running, r, side="left"))
    return index if index < len(probs) else None


def _filtered_count(probs: np.ndarray, total: np.float32, min_p: np.float32, top_p: np.float32) -> tuple[int, bool]:
    """How many of `probs` (sorted by logit, descending) ds4's filter keeps, and whether the
    filter stopped inside them (False: the answer may grow if more tokens follow).

    ds4 keeps tokens while share >= share_0 * min_p (the first always stays) and stops after the
    one whose running share reaches top_p. Shares only fall along the order, so the min-p
    survivors are a prefix."""
    shares = probs / total
    min_share = np.float32(shares[0] * min_p)
    below = np.flatnonzero(shares[1:] < min_share)
    kept = int(below[0]) + 1 if len(below) else len(probs)
    running = np.cumsum(probs[:kept], dtype=np.float32)
    reached = np.flatnonzero(running / total >= top_p)
    if len(reached):
        return int(reached[0]) + 1, True
    return kept, kept < len(probs)


def sample_logits(logits, temperature: float, top_k: int, top_p: float, min_p: float, rng: XorShift64Star) -> int:
    """One token id from one row of logits, as ds4 picks it."""
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if temperature <= 0:
        return argmax_first(logits)
    if top_p <= 0 or top_p > 1:
        top_p = 1.0
    min_p = max(min_p, 0.0)
    temperature = np.float32(temperature)
    if top_k <= 0:
        return _sample_full_vocab(logits, temperature, np.float32(top_p), np.float32(min_p), rng)
    return _sample_top_k(logits, min(top_k, MAX_TOP_K), temperature, np.float32(top_p), np.float32(min_p), rng)


def _sample_full_vocab(logits, temperature, top_p, min_p, rng) -> int:
    finite = np.isfinite(logits)
    all_finite = bool(finite.all())
    if not all_finite and not finite.any():
        return argmax_first(logits)
    ids = None if all_finite else np.flatnonzero(finite)
    values = logits if all_finite else logits[ids]
    best = int(np.argmax(values))  # first maximum among the finite logits
    best_id = best if all_finite else int(ids[best])
    probs = _relative_probs(values, values[best], temperature)

    if top_p >= 1:
        survivors = np.flatnonzero(probs >= min_p)  # p < min_p is dropped (the max has p = 1)
        if len(survivors) == 0:
            return best_id
        index = _walk(probs[survivors], rng.next_f32())
        if index is None:
            return best_id
        position = int(survivors[index])
        return position if all_finite else int(ids[position])

    total = np.cumsum(probs, dtype=np.float32)[-1]
    shares = probs / total
    eligible = shares >= np.float32(shares[best] * min_p)  # min-p can only drop these
    eligible[best] = True  # the top token always stays
    n_eligible = int(eligible.sum())
    # Sorting all 129k logits costs ~10 ms, and the filter only looks at the head of the order.
    # Lower a probability floor until the tokens above it clearly hold top_p of the mass, then
    # sort just those. {p >= floor} is a head of the logit order, because p grows with the
    # logit. Should float32 rounding leave the filter unfinished inside it, go on lowering.
    floor = np.float32(1.0)
    while True:
        floor = np.float32(floor / 8)
        in_head = eligible & (probs >= floor)
        n_head = int(in_head.sum())
        if n_head < n_eligible and probs[in_head].sum(dtype=np.float64) < 1.001 * float(top_p) * float(total):
            continue
        head = np.flatnonzero(in_head)
        # Descending logit; equal logits keep vocabulary order (ds4's qsort leaves this open).
        order = head[np.argsort(-values[head], kind="stable")]
        count, complete = _filtered_count(probs[order], total, min_p, top_p)
        if complete or n_head == n_eligible:
            break
    chosen = order[:count]
    index = _walk(probs[chosen], rng.next_f32())
    position = int(chosen[count - 1 if index is None else index])
    return position if all_finite else int(ids[position])


def _top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The k largest finite logits' ids, descending; on ties the lower id ranks first and wins
    the last places (ds4's insertion keeps the earlier of equal values)."""
    ids = np.flatnonzero(np.isfinite(logits))
    values = logits[ids]
    if len(ids) > k:
        kth = np.partition(values, len(values) - k)[len(values) - k]
        above = values > kth
        at_kth = np.flatnonzero(values == kth)[: k - int(above.sum())]
        keep = np.sort(np.concatenate([np.flatnonzero(above), at_kth]))
        ids, values = ids[keep], values[keep]
    return ids[np.argsort(-values, kind="stable")]


def _sample_top_k(logits, k, temperature, top_p, min_p, rng) -> int:
    ids = _top_k_ids(logits, k)
    if len(ids) == 0:
        return argmax_first(logits)
    values = logits[ids]
    probs = _relative_probs(values, values[0], temperature)
    total = np.cumsum(probs, dtype=np.float32)[-1]
    count, _ = _filtered_count(probs, total, min_p, top_p)
    index = _walk(probs[:count], rng.next_f32())
    return int(ids[count - 1 if index is None else index])


class Sampler:
    """ds4's sampler with its defaults. `seed=None` seeds from the clock."""

    def __init__(
        self,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        min_p: float = DEFAULT_MIN_P,
        top_k: int = DEFAULT_TOP_K,
        seed: int | None = None,
    ):
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.top_k = int(top_k)
        self.seed = time_seed() if seed is None else int(seed)
        self.rng = XorShift64Star(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def sample(self, logits: np.ndarray) -> int:
        return sample_logits(logits, self.temperature, self.top_k, self.top_p, self.min_p, self.rng)
