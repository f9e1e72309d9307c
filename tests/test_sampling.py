"""ds4's sampler: the RNG bit for bit, the filters, and agreement with a literal (slow) transcription
of ds4's loops written here from the spec."""

import math
import time

import numpy as np
import pytest

from ds4py.sampling import (
    DEFAULT_MIN_P,
    Sampler,
    XorShift64Star,
    argmax_first,
    sample_logits,
)

f32 = np.float32
U64 = 2**64


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------

class SpecRng:
    """xorshift64* exactly as the doc words it, with plain Python ints and % 2**64."""

    def __init__(self, seed):
        self.x = seed % U64

    def next(self):
        x = self.x if self.x != 0 else 0x9E3779B97F4A7C15
        x = x ^ (x >> 12)
        x = x ^ ((x << 25) % U64)
        x = x ^ (x >> 27)
        self.x = x
        return (x * 0x2545F4914F6CDD1D) % U64

    def f32(self):
        return f32(((self.next() >> 40) & 0xFFFFFF) / 2**24)


def test_first_output_for_seed_1_by_hand():
    # x = 1: x ^= x >> 12 leaves 1; x ^= x << 25 gives 2^25 + 1; x >> 27 is 0, so x = 2^25 + 1.
    # The output is (2^25 + 1) * M mod 2^64 = M + (M << 25) mod 2^64.
    M = 0x2545F4914F6CDD1D
    expected = (M + (M << 25)) % U64
    assert expected == 0x47E4CE4B896CDD1D
    rng = XorShift64Star(1)
    assert rng.next_u64() == expected
    assert rng.state == 2**25 + 1
    assert XorShift64Star(1).next_f32() == f32(0x47E4CE / 2**24)


@pytest.mark.parametrize("seed", [0, 1, 42, 2**63 + 12345, U64 - 1, 0x9E3779B97F4A7C15])
def test_rng_sequence_matches_spec(seed):
    ours, spec = XorShift64Star(seed), SpecRng(seed)
    for _ in range(2000):
        assert ours.next_u64() == spec.next()
    ours, spec = XorShift64Star(seed), SpecRng(seed)
    for _ in range(2000):
        u = ours.next_f32()
        assert u == spec.f32() and 0.0 <= u < 1.0 and isinstance(u, np.float32)


def test_zero_seed_is_replaced():
    zero, golden = XorShift64Star(0), XorShift64Star(0x9E3779B97F4A7C15)
    assert [zero.next_u64() for _ in range(5)] == [golden.next_u64() for _ in range(5)]


# ---------------------------------------------------------------------------------------------
# Literal transcription of ds4's sampler (loops, float32 scalars) as the oracle
# ---------------------------------------------------------------------------------------------

def reference_sample(logits, temperature, top_k, top_p, min_p, rng):
    logits = np.asarray(logits, dtype=f32)
    n = len(logits)

    def argmax():
        best, best_v = 0, -math.inf
        for i in range(n):
            if logits[i] > best_v:
                best, best_v = i, logits[i]
        return best

    if temperature <= 0:
        return argmax()
    if top_p <= 0 or top_p > 1:
        top_p = 1.0
    min_p = max(min_p, 0.0)
    T, top_p, min_p = f32(temperature), f32(top_p), f32(min_p)
    finite = [i for i in range(n) if np.isfinite(logits[i])]
    if not finite:
        return argmax()

    if top_k <= 0:
        best = finite[0]
        for i in finite:
            if logits[i] > logits[best]:
                best = i
        with np.errstate(under="ignore", over="ignore"):
            p = np.exp((logits - logits[best]) / T)  # the one vectorised step: same formula
        if top_p >= 1:
            total = f32(0)
            for i in finite:
                if p[i] >= min_p:
                    total = f32(total + p[i])
            if total <= 0:
                return best
            r = f32(rng.f32() * total)
            for i in finite:
                if p[i] < min_p:
                    continue
                r = f32(r - p[i])
                if r <= 0:
                    return i
            return best
        total = f32(0)
        for i in finite:
            total = f32(total + p[i])
        order = sorted(finite, key=lambda i: (-logits[i], i))
        probs = [p[i] for i in order]
    else:
        k = min(top_k, 1024, n)
        order = sorted(finite, key=lambda i: (-logits[i], i))[:k]
        values = logits[order]
        with np.errstate(under="ignore", over="ignore"):
            probs = list(np.exp((values - values[0]) / T))
        total = f32(0)
        for q in probs:
            total = f32(total + q)

    min_prob = f32(f32(probs[0] / total) * min_p)
    kept_sum, kept = f32(0), 0
    for j, q in enumerate(probs):
        if j > 0 and f32(q / total) < min_prob:
            break
        kept_sum = f32(kept_sum + q)
        kept += 1
        if f32(kept_sum / total) >= top_p:
            break
    r = f32(rng.f32() * kept_sum)
    for j in range(kept):
        r = f32(r - probs[j])
        if r <= 0:
            return order[j]
    return order[kept - 1]


CONFIGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),  # ds4's defaults
    dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.05),
    dict(temperature=0.8, top_k=0, top_p=0.5, min_p=0.0),
    dict(temperature=2.0, top_k=0, top_p=0.95, min_p=0.0),
    dict(temperature=1.0, top_k=40, top_p=1.0, min_p=0.05),
    dict(temperature=0.6, top_k=20, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=5000, top_p=1.0, min_p=0.0),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_agrees_with_literal_ds4_loops(config):
    data = np.random.default_rng(7)
    for trial in range(4):
        logits = (data.standard_normal(400) * (1 + trial)).astype(f32)
        logits[data.integers(0, 400, 5)] += 6  # a few favourites, as a real model has
        if trial == 3:
            logits[[10, 20]] = logits.max()  # a tie at the top
            logits[[30, 40]] = [-np.inf, np.nan]
        ours, spec = XorShift64Star(1000 + trial), SpecRng(1000 + trial)
        for _ in range(50):
            expected = reference_sample(logits, rng=spec, **config)
            assert sample_logits(logits, rng=ours, **config) == expected
        assert ours.state == spec.x  # one draw per sample, like ds4


# ---------------------------------------------------------------------------------------------
# Behaviour
# ---------------------------------------------------------------------------------------------

def test_defaults_are_ds4s():
    sampler = Sampler()
    assert (sampler.temperature, sampler.top_p, sampler.min_p, sampler.top_k) == (1.0, 1.0, DEFAULT_MIN_P, 0)
    assert DEFAULT_MIN_P == 0.05
    assert isinstance(sampler.seed, int)
    assert Sampler().seed != Sampler().seed  # time-based when not given


def test_greedy_picks_the_first_maximum():
    logits = np.array([1.0, 3.0, -2.0, 3.0, np.nan], dtype=f32)
    for temperature in (0.0, -1.0):
        sampler = Sampler(temperature=temperature, seed=5)
        assert sampler.greedy and sampler.sample(logits) == 1
        assert sampler.rng.state == 5  # greedy draws nothing
    assert argmax_first(np.array([np.nan, -np.inf], dtype=f32)) == 0
    assert argmax_first(np.array([0.0, np.inf, np.inf], dtype=f32)) == 1


def test_min_p_excludes():
    # p relative to the max: 1, e^-1 = 0.37, e^-3.5 = 0.030, e^-10: the last two are < 0.05.
    logits = np.array([0.0, -1.0, -3.5, -10.0], dtype=f32)
    sampler = Sampler(min_p=0.05, seed=3)
    picks = np.array([sampler.sample(logits) for _ in range(3000)])
    assert set(picks) == {0, 1}
    assert abs((picks == 1).mean() - math.exp(-1) / (1 + math.exp(-1))) < 0.03
    sampler = Sampler(min_p=0.0, seed=3)
    assert set(sampler.sample(logits) for _ in range(3000)) == {0, 1, 2}
    assert Sampler(min_p=1.5, seed=3).sample(logits) == 0  # nothing survives: ds4 falls back to the max


def test_top_k_restricts_and_breaks_ties_by_id():
    logits = np.array([5.0, 5.0, 4.0, 4.0, 3.0, 4.0], dtype=f32)
    sampler = Sampler(top_k=3, min_p=0.0, seed=11)
    assert set(sampler.sample(logits) for _ in range(2000)) == {0, 1, 2}
    sampler = Sampler(top_k=1, min_p=0.0, seed=11)
    assert set(sampler.sample(logits) for _ in range(50)) == {0}


def test_top_k_is_capped_at_1024():
    logits = -np.arange(3000, dtype=f32) * 1e-4  # nearly flat, strictly decreasing
    sampler = Sampler(temperature=10.0, top_k=5000, min_p=0.0, seed=2)
    picks = [sampler.sample(logits) for _ in range(3000)]
    assert max(picks) < 1024 and max(picks) > 900


def test_top_p_restricts():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(f32)
    sampler = Sampler(top_p=0.7, min_p=0.0, seed=9)
    picks = np.array([sampler.sample(logits) for _ in range(3000)])
    assert set(picks) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert abs((picks == 0).mean() - 0.5 / 0.8) < 0.03
    for out_of_range in (0.0, 1.5):  # ds4 treats these as 1
        sampler = Sampler(top_p=out_of_range, min_p=0.0, seed=9)
        assert set(sampler.sample(logits) for _ in range(3000)) == {0, 1, 2, 3}


def test_non_finite_logits_are_skipped():
    logits = np.array([np.nan, 1.0, -np.inf, 0.5, np.inf], dtype=f32)
    for config in CONFIGS:
        picks = {sample_logits(logits, rng=XorShift64Star(4), **config) for _ in range(200)}
        assert picks <= {1, 3}
    only_bad = np.array([np.nan, -np.inf, np.inf], dtype=f32)
    assert Sampler(seed=1).sample(only_bad) == 2  # all non-finite: plain argmax


def test_seeded_sampler_is_deterministic():
    logits = np.random.default_rng(0).standard_normal(5000).astype(f32) * 2
    first = [Sampler(seed=123).sample(logits) for _ in range(1)]
    a, b, c = Sampler(seed=123), Sampler(seed=123), Sampler(seed=124)
    run_a = [a.sample(logits) for _ in range(200)]
    assert run_a == [b.sample(logits) for _ in range(200)]
    assert run_a != [c.sample(logits) for _ in range(200)]
    assert run_a[0] == first[0]


def chi_square(counts, expected_probs):
    expected = np.asarray(expected_probs) * np.sum(counts)
    return float(np.sum((counts - expected) ** 2 / expected))


@pytest.mark.parametrize(
    "config",
    [
        dict(temperature=1.0, min_p=0.0),
        dict(temperature=0.6, min_p=0.0),
        dict(temperature=1.0, min_p=0.0, top_k=4),
        dict(temperature=1.0, min_p=0.0, top_p=0.8),
    ],
)
def test_distribution_follows_softmax(config):
    logits = np.array([2.0, 1.5, 1.0, 0.2, 0.0, -0.5, -1.0, -2.0], dtype=f32)
    weights = np.exp((logits.astype(np.float64) - logits.max()) / config["temperature"])
    allowed = np.ones(len(logits), dtype=bool)
    if "top_k" in config:
        allowed[config["top_k"] :] = False
    if "top_p" in config:
        share = np.cumsum(weights) / weights.sum()
        allowed[int(np.searchsorted(share, config["top_p"])) + 1 :] = False
    expected = np.where(allowed, weights, 0)
    expected /= expected.sum()
    sampler = Sampler(seed=2024, **config)
    counts = np.bincount([sampler.sample(logits) for _ in range(8000)], minlength=len(logits))
    assert np.all(counts[~allowed] == 0)
    # df <= 7; the 0.1% critical value of chi-square with 7 degrees of freedom is 24.3.
    assert chi_square(counts[allowed], expected[allowed]) < 24.3


def test_full_vocabulary_is_fast():
    data = np.random.default_rng(1)
    logits = (data.standard_normal(129280) * 2).astype(f32)
    logits[data.integers(0, 129280, 20)] += 12  # peaked, like a language model
    for config, budget_ms in [(dict(), 5.0), (dict(top_p=0.9), 10.0), (dict(top_k=40), 10.0), (dict(temperature=0), 5.0)]:
        sampler = Sampler(seed=1, **config)
        start = time.perf_counter()
        for _ in range(50):
            sampler.sample(logits)
        per_token_ms = (time.perf_counter() - start) / 50 * 1e3
        assert per_token_ms < budget_ms, f"{config}: {per_token_ms:.2f} ms per token"
