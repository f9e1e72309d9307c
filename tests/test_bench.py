"""ds4py bench: frontiers, ds4-bench's CSV, snapshot/restore semantics, the CLI end to end."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import ITALIAN_SLICES

from ds4py import bench
from ds4py.errors import Ds4Error


def test_frontiers():
    assert bench.frontiers(2048, 16384, step_incr=2048) == [2048 * i for i in range(1, 9)]
    assert bench.frontiers(2048, 65536, step_mul=2) == [2048, 4096, 8192, 16384, 32768, 65536]
    assert bench.frontiers(100, 100) == [100]
    with pytest.raises(Ds4Error):
        bench.frontiers(200, 100)
    with pytest.raises(Ds4Error):
        bench.frontiers(1, 10, step_incr=2, step_mul=2)


def test_csv_header_is_ds4_benchs():
    assert bench.CSV_HEADER.split(",") == [
        "ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "gen_first_ms",
        "gen_steady_tokens", "gen_steady_tps", "kvcache_bytes"]


class CountingEngine:
    """A stand-in engine that records what the bench asks of it."""

    def __init__(self, n_vocab=50, eos=3):
        self.n_vocab, self.eos, self.calls, self.n_past = n_vocab, eos, [], 0

    def reset(self):
        self.n_past = 0

    def _logits(self):
        out = np.zeros(self.n_vocab, np.float32)
        out[self.eos] = 10.0                   # EOS is always the argmax: the probe must skip it
        out[7] = 5.0
        return out

    def prefill(self, tokens):
        self.calls.append(("prefill", self.n_past, len(tokens)))
        self.n_past += len(tokens)
        return self._logits()

    def decode(self, token):
        assert token != self.eos
        self.calls.append(("decode", self.n_past, token))
        self.n_past += 1
        return self._logits()

    def warm_up(self):
        self.calls.append(("warm_up", self.n_past))
        self.n_past = 99                       # whatever it leaves, the bench starts from reset

    def snapshot(self):
        return (self.n_past, np.zeros(10, np.float32))

    def restore(self, snap):
        self.n_past = snap[0]


def test_run_bench_prefills_incrementally_and_restores():
    engine = CountingEngine()
    rows = bench.run_bench(engine, list(range(100)), engine.eos, [16, 32, 64], gen_tokens=5)
    assert engine.calls[0] == ("warm_up", 0)                             # compiles before any timing
    prefills = [c for c in engine.calls if c[0] == "prefill"]
    assert prefills == [("prefill", 0, 16), ("prefill", 16, 16), ("prefill", 32, 32)]
    decodes = [c for c in engine.calls if c[0] == "decode"]
    assert len(decodes) == 15 and all(c[2] == 7 for c in decodes)      # EOS never chosen
    assert [r.ctx_tokens for r in rows] == [16, 32, 64]
    assert rows[0].kvcache_bytes == 40 and rows[-1].kvcache_bytes == 0  # no snapshot after the last
    assert rows[0].gen_steady_tokens == 4
    with pytest.raises(Ds4Error):
        bench.run_bench(CountingEngine(), list(range(10)), 3, [16], 2)


def test_bench_cli_on_tiny(tiny_model, tmp_path):
    csv = tmp_path / "b.csv"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("\n".join(ITALIAN_SLICES), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "ds4py", "bench", "-m", str(tiny_model), "--prompt-file", str(prompt),
                        "--ctx-start", "32", "--ctx-max", "96", "--step-incr", "32", "--gen-tokens", "4",
                        "--csv", str(csv)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = csv.read_text().splitlines()
    assert lines[0] == bench.CSV_HEADER
    rows = [line.split(",") for line in lines[1:]]
    assert [int(row[0]) for row in rows] == [32, 64, 96]
    assert all(float(row[2]) > 0 and float(row[4]) > 0 for row in rows)
    assert int(rows[0][8]) > 0 and int(rows[-1][8]) == 0
    assert "of roofline" in r.stdout + r.stderr


class RunEngine(CountingEngine):
    """A stand-in with the GPU engine's pipelined greedy loop."""

    def decode_greedy_run(self, token, n, forbid=-1):
        self.calls.append(("run", self.n_past, token, n, forbid))
        for _ in range(n):
            self.n_past += 1
            yield 7


def test_probe_uses_the_pipelined_greedy_loop():
    engine = RunEngine()
    engine.n_past = 16
    total, steps = bench.probe_decode(engine, engine._logits(), 5, engine.eos)
    assert engine.calls == [("run", 16, 7, 5, engine.eos)]     # the first pick skips EOS, one run of 5
    assert len(steps) == 5 and total == pytest.approx(sum(steps)) and engine.n_past == 21
