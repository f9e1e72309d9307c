"""`ds4py run` and `ds4py tokenize` end to end on the tiny model, as a user runs them (subprocess),
plus `generate` with a fake engine (stop rules, Ctrl-C, prefix reuse)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ds4py import synth
from ds4py.generate import Session, generate

N_GEN = 6


def ds4py(*args, stdin=None, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "ds4py", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def greedy_runs(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    runs = []
    for i in range(2):
        r = ds4py("run", "-m", str(tiny_model), "-p", "Ciao, come stai?", "-n", str(N_GEN), "--temp", "0",
                  "--ctx", "512", "--dump-logits", str(d / f"logits{i}.bin"))
        runs.append((r, d / f"logits{i}.bin"))
    return runs


def test_run_greedy_is_deterministic(greedy_runs):
    (a, _), (b, _) = greedy_runs
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    stats = [line for line in a.stderr.splitlines() if line.startswith("ds4py: prefill:")]
    assert len(stats) == 1 and "generation:" in stats[0] and stats[0].endswith("t/s")


def test_dump_logits_match_engine(greedy_runs, tiny_model):
    from ds4py.chat import render_prompt
    from ds4py.forward_cpu import CpuEngine
    from ds4py.io.spec import open_model
    from ds4py.tokenizer import Tokenizer

    (_, path), (_, path2) = greedy_runs
    m = open_model(tiny_model)
    dumped = np.fromfile(path, dtype="<f4")
    assert dumped.shape == (m.spec.n_vocab,)
    np.testing.assert_array_equal(dumped, np.fromfile(path2, dtype="<f4"))
    tok = Tokenizer.from_gguf(m.file)
    ids = render_prompt(tok, "Ciao, come stai?")
    logits = CpuEngine(m, n_ctx=512).prefill(ids)
    np.testing.assert_array_equal(dumped, logits)
    m.close()


def test_run_seeded_sampling_is_deterministic(tiny_model):
    args = ("run", "-m", str(tiny_model), "-p", "Tell me a story", "-n", str(N_GEN), "--temp", "1.5",
            "--min-p", "0", "--seed", "1234", "--nothink", "--ctx", "512")
    a, b = ds4py(*args), ds4py(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_run_bad_model_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, just some bytes" * 4)
    for path in (bad, tmp_path / "missing.gguf"):
        r = ds4py("run", "-m", str(path), "-p", "hi", "-n", "1")
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and str(path) in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def test_run_interactive_chat(tiny_model):
    r = ds4py("run", "-m", str(tiny_model), "-n", "3", "--temp", "0", "--ctx", "512",
              stdin="hello\n/nothink\nand again\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert "thinking off" in r.stderr
    assert sum(line.startswith("ds4py: prefill:") for line in r.stderr.splitlines()) == 2


def test_run_chat_ctrl_c_stops_the_reply_and_returns_to_the_prompt(tiny_model):
    """SIGINT while a long reply streams: the reply ends, the stats line follows, the chat goes on."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "ds4py", "run", "-m", str(tiny_model), "-n", "100000",
                             "--ctx", "200000", "--temp", "1", "--min-p", "0", "--seed", "3"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("tell me everything\n")
        proc.stdin.flush()
        proc.stdout.read(8)                  # generation is streaming now
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("/quit\n")
        proc.stdin.flush()
        proc.stdin.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "[interrupted]" in err and "ds4py: prefill:" in err and "Traceback" not in err


def test_run_default_model_builds_once(tmp_path):
    r = ds4py("run", "-p", "hi", "-n", "2", "--temp", "0", "--ctx", "256",
              env_extra={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "embedded default" in r.stderr
    assert (tmp_path / "ds4py" / f"tiny-seed0-r{synth.RECIPE}.gguf").exists()


def test_tokenize(tiny_model):
    r = ds4py("tokenize", "-m", str(tiny_model), "hi there 12345 café\n\n  x", "--ids")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [6366, 1031, 223, 6895, 1883, 57664, 271, 223, 1527]   # ds4-model.md §9.4
    r = ds4py("tokenize", "-m", str(tiny_model), "Hello world")
    assert r.stdout.splitlines() == [" 19923 -> 'Hello'", "  2058 -> ' world'"]


# ---- generate with a fake engine ---------------------------------------------------------------

class ScriptedEngine:
    """Logits that make argmax follow a script; counts what it is asked to evaluate."""

    def __init__(self, script, n_ctx=100, n_vocab=10, interrupt_at=None, raise_at=None):
        self.script, self.n_ctx, self.n_vocab, self.interrupt_at = list(script), n_ctx, n_vocab, interrupt_at
        self.raise_at = raise_at or (lambda: KeyboardInterrupt())      # what decode raises at interrupt_at
        self.n_past, self.evaluated, self.resets = 0, [], 0

    def reset(self):
        self.n_past, self.resets = 0, self.resets + 1

    def _logits(self):
        out = np.zeros(self.n_vocab, np.float32)
        out[self.script[min(self.n_past, len(self.script) - 1)]] = 1.0
        return out

    def prefill(self, ids):
        self.evaluated.append(list(ids))
        self.n_past += len(ids)
        return self._logits()

    def decode(self, token):
        if self.interrupt_at is not None and self.n_past == self.interrupt_at:
            raise self.raise_at()
        self.evaluated.append([token])
        self.n_past += 1
        return self._logits()


class Greedy:
    def sample(self, logits):
        return int(np.argmax(logits))


def test_generate_stops_at_eos_and_reuses_prefix():
    eng = ScriptedEngine(script=[0, 0, 4, 5, 9, 9, 7, 7])   # prompt of 2 -> 4, 5, then EOS (9)
    s = Session(eng)
    streamed = []
    r = generate(s, [1, 2], Greedy(), 10, eos_id=9, on_token=streamed.append)
    assert r.tokens == [4, 5, 9] and streamed == r.tokens and r.stop == "eos" and r.n_prompt == 2
    r2 = generate(s, [1, 2, 4, 5, 9, 3], Greedy(), 1, eos_id=9)
    assert eng.evaluated[-1] == [9, 3] and r2.n_prompt == 2 and r2.stop == "length"


def test_generate_length_and_context_limits():
    r = generate(Session(ScriptedEngine(script=[1] * 50)), [2, 3], Greedy(), 4, eos_id=9)
    assert r.tokens == [1, 1, 1, 1] and r.stop == "length"
    r = generate(Session(ScriptedEngine(script=[1] * 50, n_ctx=4)), [2, 3], Greedy(), 10, eos_id=9)
    assert r.stop == "context" and len(r.tokens) == 3


def test_generate_ctrl_c_stops_cleanly_and_resets_a_half_updated_state():
    eng = ScriptedEngine(script=[1] * 50, interrupt_at=4)
    s = Session(eng)
    r = generate(s, [2, 3], Greedy(), 10, eos_id=9)
    assert r.stop == "interrupted" and r.tokens == [1, 1, 1]
    assert s.tokens == [] and eng.n_past == 0              # the interrupted decode left no state
    assert r.stats_line().startswith("ds4py: prefill: ")


def _numba_wrapped_interrupt():
    """What numba's dispatcher raises when Ctrl-C lands inside a compiled call (CI, session 19):
    SystemError caused by SystemError caused by the KeyboardInterrupt."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as ki:
            raise SystemError("<function _numba_unpickle> returned a result with an exception set") from ki
    except SystemError as inner:
        outer = SystemError("CPUDispatcher(<function hc_split_sinkhorn_rows>) returned a result with an exception set")
        outer.__cause__ = inner
        return outer


def test_generate_ctrl_c_inside_a_numba_call_stops_cleanly():
    eng = ScriptedEngine(script=[1] * 50, interrupt_at=4, raise_at=_numba_wrapped_interrupt)
    s = Session(eng)
    r = generate(s, [2, 3], Greedy(), 10, eos_id=9)
    assert r.stop == "interrupted" and r.tokens == [1, 1, 1]
    assert s.tokens == [] and eng.n_past == 0
    # a SystemError that is not an interrupt is a bug: it propagates
    eng = ScriptedEngine(script=[1] * 50, interrupt_at=4, raise_at=lambda: SystemError("something else"))
    with pytest.raises(SystemError, match="something else"):
        generate(Session(eng), [2, 3], Greedy(), 10, eos_id=9)


def test_compile_notice_says_once_and_times_only_real_compiles():
    """CompileNotice speaks at the first numba compile of a reply and adds up its seconds; a
    function already compiled costs nothing and says nothing."""
    from numba import njit
    from ds4py.cli import CompileNotice

    @njit
    def inner(x):
        return x * 2.0

    @njit
    def outer(x):                       # compiling it compiles inner inside: counted once
        return inner(x) + 1.0

    said = []
    notice = CompileNotice(said.append)
    with notice.install():
        assert outer(1.0) == 3.0
        assert outer(2.0) == 5.0
    assert len(said) == 1 and "compiling kernels" in said[0]
    assert 0.0 < notice.seconds < 60.0
    again = CompileNotice(said.append)
    with again.install():
        assert outer(3.0) == 7.0
    assert len(said) == 1 and again.seconds == 0.0


def test_compile_notice_hears_numba_cuda_compiles():
    """numba-cuda does not send "numba:compile" for a CUDA kernel; it holds its compiler lock,
    which it announces on its own event bus (re-entered while it compiles). CompileNotice must
    speak at the first hold and count the outermost holds' seconds (the GPU engine's compiles;
    a real one: test_kernels_cuda.py, on the GPU)."""
    import time
    from numba.cuda.core import event as cuda_event
    from ds4py.cli import CompileNotice

    said = []
    notice = CompileNotice(said.append)
    with notice.install():
        with cuda_event.trigger_event("numba-cuda:compiler_lock"):
            with cuda_event.trigger_event("numba-cuda:compiler_lock"):
                time.sleep(0.05)
    assert len(said) == 1 and "compiling kernels" in said[0]
    assert 0.05 <= notice.seconds < 5.0
    with cuda_event.trigger_event("numba-cuda:compiler_lock"):    # after install(): not heard
        pass
    assert len(said) == 1
