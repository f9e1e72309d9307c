"""The CPU engine against the float64 reference, prefill against decode, routing rules, state.

One decode run of the tiny model (module fixture) feeds every comparison: the positions cover the
raw window only (1), the first ratio-4 rows (3), a saturated window (> n_swa), the indexer really
selecting (>= 4·idx_topk + 3) and the first ratio-128 rows (127), all read from the spec.

Two reference runs shadow the engine token by token:
* tie-aligned: the reference gets the engine's side of each rounding decision (TieHints) and takes
  it only where its own float64 value sits within 1e-5 of a rounding boundary. These are the tight
  checks: same top-5 and max |Δlogit| <= 1e-3 × std.
* independent: no hints. Rounding ties then flip at random (ds4-model.md §12.5: at position 0 the
  attention output is a scaled copy of an FP8 row, so Q8 ties are everywhere) and the flips are
  amplified through the layers, so only the §12.5 criterion is checked: correlation > 0.99.
"""

import numpy as np
import pytest

import ds4py.forward_cpu as FC
from ds4py import reference as R
from ds4py.io.gguf import GGML_Q8_0
from ds4py.io.spec import open_model
from ds4py.kernels import cpu_ops as ops

TOL = 1e-3


@pytest.fixture(scope="module")
def model(tiny_model):
    m = open_model(tiny_model)
    yield m
    m.close()


def coverage_positions(spec):
    """name -> position, from the spec (§12.4)."""
    return {
        "raw window only": 1,
        "first ratio-4 rows": 3,
        "saturated window": spec.n_swa + 1,
        "indexer selecting": 4 * spec.idx_topk + 3,
        "first ratio-128 rows": 127,
        "after ratio-128 rows": 130,
    }


class EngineRecorder:
    """Wraps the engine's kernel entry points to record the inputs of its activation quantizers."""

    def __init__(self, monkeypatch):
        self.q8_0, self.q8_k = [], []
        mm, cpu = FC.mm, FC.cpu
        recorder = self

        def recording_mm(w, x, order_rows=None):
            if w[1] == GGML_Q8_0:
                recorder.q8_0.append(x[0].copy())
            return mm(w, x, order_rows)

        class RecordingCpu:
            def __getattr__(self, name):
                return getattr(cpu, name)

            def moe_batch(self, *args):
                out, mids = cpu.moe_batch(*args, with_mids=True)
                # the reference quantizes x, then each slot's down input, in slot order
                recorder.q8_k.extend([np.array(args[5][0])] + [m.copy() for m in mids[0]])
                return out

        monkeypatch.setattr(FC, "mm", recording_mm)
        monkeypatch.setattr(FC, "cpu", RecordingCpu())

    def clear(self):
        self.q8_0.clear()
        self.q8_k.clear()


def stored_rows(engine, pos):
    """The cache rows the engine wrote at pos, keyed as TieHints wants them."""
    rows = {}
    for il, cache in enumerate(engine.layers):
        rows[("raw", il)] = cache.raw[pos % cache.raw.shape[0]].copy()
        for kind, lane in (("comp", cache.attn), ("index", cache.index)):
            if lane is not None and (pos + 1) % lane.ratio == 0:
                rows[(kind, il)] = lane.rows[lane.n_rows - 1].copy()
    return rows


@pytest.fixture(scope="module")
def shadow_run(model):
    """Decode a token sequence in the engine and in both references, keeping logits at the
    coverage positions plus what proves the coverage (rows, indexer activity)."""
    spec = model.spec
    positions = coverage_positions(spec)
    check = set(positions.values())
    n_tokens = max(check) + 1
    tokens = np.random.default_rng(7).integers(0, spec.n_vocab, n_tokens).tolist()
    # Compile the engine's njit kernels with their real argument types before anything is patched:
    # router_topk must not be compiled against the patched module global topk_desc below.
    FC.CpuEngine(model, n_ctx=256).decode(tokens[0])
    mp = pytest.MonkeyPatch()
    rec = EngineRecorder(mp)
    engine = FC.CpuEngine(model, n_ctx=256)
    aligned, independent = R.Reference(model), R.Reference(model)
    out = {"engine": {}, "aligned": {}, "independent": {}, "ties_taken": 0, "coverage": {}, "tokens": tokens}
    selecting = []
    orig_topk = FC.ops.topk_desc
    try:
        mp.setattr(FC.ops, "topk_desc", lambda v, k: (selecting.append((len(v), k)), orig_topk(v, k))[1])
        for pos, token in enumerate(tokens):
            rec.clear()
            selecting.clear()
            logits = engine.decode(token)
            want = pos in check
            with R.TieHints(rec.q8_0, rec.q8_k, stored_rows(engine, pos)) as hints:
                ref_logits = aligned.decode(token, want_logits=want)
            out["ties_taken"] += hints.taken
            ind_logits = independent.decode(token, want_logits=want)
            if want:
                out["engine"][pos], out["aligned"][pos], out["independent"][pos] = logits, ref_logits, ind_logits
                out["coverage"][pos] = {
                    "ratio4_rows": max((c.attn.n_rows for c in engine.layers if c.index is not None), default=0),
                    "ratio128_rows": max((c.attn.n_rows for c in engine.layers if c.attn is not None and c.index is None), default=0),
                    "indexer_selected": bool(selecting),
                }
    finally:
        mp.undo()
    return out


def agreement(a, b):
    return np.abs(a - b).max() / b.std(), np.corrcoef(a, b)[0, 1]


def test_engine_matches_tie_aligned_reference(shadow_run, model):
    positions = coverage_positions(model.spec)
    lines = []
    for name, pos in positions.items():
        e, r = shadow_run["engine"][pos], shadow_run["aligned"][pos]
        rel, corr = agreement(e, r)
        lines.append(f"pos {pos} ({name}): max|d|/std {rel:.2e}, corr {corr:.8f}")
        assert rel <= TOL, "\n".join(lines)
        assert list(np.argsort(-e)[:5]) == list(np.argsort(-r)[:5]), "\n".join(lines)
    print("\n".join(lines) + f"\nties taken from the engine: {shadow_run['ties_taken']}")


def test_coverage_is_real(shadow_run, model):
    s, cov = model.spec, shadow_run["coverage"]
    p = coverage_positions(s)
    assert cov[p["raw window only"]]["ratio4_rows"] == 0
    assert cov[p["first ratio-4 rows"]]["ratio4_rows"] == 1
    assert cov[p["first ratio-4 rows"]]["ratio128_rows"] == 0
    assert p["saturated window"] > s.n_swa
    assert cov[p["indexer selecting"]]["indexer_selected"]
    assert cov[p["indexer selecting"]]["ratio4_rows"] == s.idx_topk + 1
    assert cov[p["first ratio-128 rows"]]["ratio128_rows"] == 1


def test_engine_correlates_with_independent_reference(shadow_run):
    """Without tie alignment only the §12.5 criterion holds: high correlation, same argmax mostly."""
    lines = []
    for pos, e in shadow_run["engine"].items():
        r = shadow_run["independent"][pos]
        rel, corr = agreement(e, r)
        same5 = list(np.argsort(-e)[:5]) == list(np.argsort(-r)[:5])
        lines.append(f"pos {pos} independent: max|d|/std {rel:.2e}, corr {corr:.6f}, top-5 same {same5}, "
                     f"argmax same {np.argmax(e) == np.argmax(r)}")
        assert corr > 0.99, "\n".join(lines)
    print("\n".join(lines))


def test_prefill_then_decode_equals_decodes(shadow_run, model):
    """Prefill N tokens (in several layer-major chunks) then decode one == N+1 decodes."""
    tokens = shadow_run["tokens"]
    n = max(shadow_run["engine"])                      # decode logits exist at n (and n-3 = 127)
    engine = FC.CpuEngine(model, n_ctx=256, prefill_chunk=48)
    last_prompt = engine.prefill(tokens[:128])         # logits at position 127
    for t in tokens[128:n]:
        engine.decode(t)
    final = engine.decode(tokens[n])
    for got, pos in ((last_prompt, 127), (final, n)):
        want = shadow_run["engine"][pos]
        rel, _ = agreement(got, want)
        assert rel <= TOL and list(np.argsort(-got)[:5]) == list(np.argsort(-want)[:5]), (pos, rel)


def test_snapshot_restore(model):
    engine = FC.CpuEngine(model, n_ctx=64)
    engine.prefill(list(range(100, 110)))              # 2 ratio-4 rows emitted, a compressor mid-window
    snap = engine.snapshot()
    a = engine.decode(10)
    for t in range(20, 30):                            # emits more rows, slides the state
        engine.decode(t)
    engine.restore(snap)
    assert engine.n_past == 10
    np.testing.assert_array_equal(engine.decode(10), a)
    engine.reset()
    assert engine.n_past == 0


def test_context_limit(model):
    from ds4py.errors import Ds4Error
    engine = FC.CpuEngine(model, n_ctx=4)
    engine.prefill([1, 2, 3, 4])
    with pytest.raises(Ds4Error, match="context full"):
        engine.decode(5)


# ---- routing (§6.11) ------------------------------------------------------------------------------

def test_hash_layers_route_by_token_id(model):
    s = model.spec
    engine = FC.CpuEngine(model, n_ctx=16)
    for token in (17, 4242, s.n_vocab - 1):
        engine.decode(token)
        for il in range(s.n_hash):
            table = model.file.rows(f"blk.{il}.ffn_gate_tid2eid.weight")
            np.testing.assert_array_equal(engine.last_routing[il][0], table[token])


def test_expert_weights_normalised_and_scaled(model):
    s = model.spec
    engine = FC.CpuEngine(model, n_ctx=16)
    engine.decode(99)
    assert s.expert_weights_scale == 1.5
    for il in range(s.n_layer):
        ids, weights = engine.last_routing[il]
        assert len(set(ids.tolist())) == s.n_used
        assert abs(weights.sum() - s.expert_weights_scale) < 1e-5


def test_bias_selects_but_does_not_weigh():
    logits = np.array([2.0, 1.0, 0.5, -1.0, -3.0, 0.0], dtype=np.float32)
    probs = np.sqrt(np.log1p(np.exp(logits.astype(np.float64))))
    no_bias = ops.router_topk(logits, np.zeros(0, np.float32), 2)
    assert list(no_bias) == [0, 1]
    bias = np.array([0, 0, 0, 0, 10.0, 5.0], dtype=np.float32)       # lifts experts 4 and 5
    ids = ops.router_topk(logits, bias, 2)
    assert list(ids) == [4, 5]
    w = ops.router_weights(logits, ids, 1.5, True)
    expected = probs[[4, 5]] / probs[[4, 5]].sum() * 1.5                 # unbiased probabilities
    np.testing.assert_allclose(w, expected, rtol=1e-6)


def test_router_ties_go_to_lower_index_and_sum_floor():
    logits = np.full(8, -40.0, dtype=np.float32)                        # softplus ≈ e^-40: tiny probs
    ids = ops.router_topk(logits, np.zeros(0, np.float32), 3)
    assert list(ids) == [0, 1, 2]
    w = ops.router_weights(logits, ids, 1.5, True)
    p = np.float32(np.sqrt(np.float32(np.exp(-40.0))))
    np.testing.assert_allclose(w, p / 2.0 ** -14 * 1.5, rtol=1e-6)    # sum below the 2^-14 floor


def test_engine_routing_matches_reference(model, monkeypatch):
    """Same experts and weights as the (tie-aligned) reference, hash and biased layers alike."""
    rec = EngineRecorder(monkeypatch)
    engine, ref = FC.CpuEngine(model, n_ctx=16), R.Reference(model)
    for pos, token in enumerate((3, 77, 12345)):
        rec.clear()
        engine.decode(token)
        with R.TieHints(rec.q8_0, rec.q8_k, stored_rows(engine, pos)):
            ref.decode(token, want_logits=False)
        for il in range(model.spec.n_layer):
            np.testing.assert_array_equal(engine.last_routing[il][0], ref.last_routing[il][0])
            np.testing.assert_allclose(engine.last_routing[il][1], ref.last_routing[il][1], rtol=1e-5)


# ---- the non-matmul kernels against the reference's numpy versions --------------------------------

def test_f16_round_matches_numpy():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-9, 5, 4000),
                        np.array([0.0, -0.0, 65504, 65519, 65520, -70000, 6.1e-5, 5.9e-8, 3e-8, 1e-9], np.float32)])
    y = x.copy()
    ops.f16_round_inplace(y)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))


def test_fp8_fp4_hadamard_match_reference():
    rng = np.random.default_rng(1)
    for scale in (1e-3, 1.0, 300.0):
        x = (rng.standard_normal(256) * scale).astype(np.float32)
        x[:8] = np.float32(scale) * np.array([1, 0.5, 0.25, 1.125, 1.0625, 0.03125, -0.09375, 0], np.float32)
        y = x.copy()
        ops.fp8_e4m3_sim_inplace(y, 256)
        np.testing.assert_array_equal(y, R.fp8_e4m3_sim(x.astype(np.float64)).astype(np.float32))
        z = x[:64].copy()
        ops.hadamard_inplace(z)
        np.testing.assert_allclose(z, R.hadamard(x[:64].astype(np.float64)), rtol=1e-5, atol=1e-6 * scale)
        v = np.round(x[:64] * 4 / scale).astype(np.float32) / 4     # many exact FP4 ties
        w = v.copy()
        ops.fp4_e2m1_sim_inplace(w)
        np.testing.assert_array_equal(w, R.fp4_e2m1_sim(v.astype(np.float64)).astype(np.float32))


def test_fp4_ties_go_to_even_grid_index():
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] + [0.0] * 24, dtype=np.float32)
    ops.fp4_e2m1_sim_inplace(v)       # amax 6 -> scale 1
    assert list(v[:8]) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_warm_up_leaves_no_trace(model, monkeypatch):
    """CpuEngine.warm_up (the bench calls it before its clocks) runs the indexer's scoring too
    (it compiles only once a lane holds more than idx_topk rows) and puts the state back: the
    logits after it are bitwise those of an engine that never warmed up, from an empty state and
    from a state with a prefix already in it."""
    tokens = np.random.default_rng(11).integers(0, model.spec.n_vocab, 12).tolist()
    cold, warm = FC.CpuEngine(model, n_ctx=64), FC.CpuEngine(model, n_ctx=64)
    scored = []
    scores = FC.ops.indexer_scores
    monkeypatch.setattr(FC.ops, "indexer_scores", lambda *a: (scored.append(1), scores(*a))[1])
    warm.warm_up()
    monkeypatch.setattr(FC.ops, "indexer_scores", scores)
    assert scored and warm.n_past == 0
    np.testing.assert_array_equal(warm.prefill(tokens[:7]), cold.prefill(tokens[:7]))
    warm.warm_up()
    assert warm.n_past == 7
    np.testing.assert_array_equal(warm.decode(tokens[7]), cold.decode(tokens[7]))
    np.testing.assert_array_equal(warm.prefill(tokens[8:]), cold.prefill(tokens[8:]))
