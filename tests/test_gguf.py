"""The GGUF layer, the spec derivation, the builder and every bad-input case."""

import dataclasses
import os
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4py import synth
from ds4py.errors import ModelFileError
from ds4py.io import gguf
from ds4py.io.gguf import GGML_IQ2_XXS, GGML_Q2_K, GGML_Q8_0, PlannedTensor, tensor_nbytes
from ds4py.io.spec import (DS4_FLASH_VALUES, METADATA_KEYS, expected_tensors, open_model,
                           read_spec, tensor_role)

from conftest import micro_spec


def test_io_package_does_not_shadow_stdlib():
    import io

    import ds4py.io
    assert hasattr(io, "BytesIO") and io.__name__ == "io"
    assert ds4py.io.__name__ == "ds4py.io" and not hasattr(ds4py.io, "BytesIO")


# ---- layout and spec ---------------------------------------------------------------------------------

def test_tiny_spec_roundtrip_and_layout(tiny_model):
    m = open_model(tiny_model)
    spec = m.spec
    for key, value in synth.TINY_VALUES.items():
        assert getattr(spec, key) == pytest.approx(value), key
    assert spec.compress_ratios == (0, 0, 4, 128, 4, 128)
    g = m.file
    # Every expected tensor is there with the derived shape, and nothing else.
    names = {e.name for e in expected_tensors(spec)} - {f"blk.{il}.exp_probs_b.bias" for il in range(spec.n_hash)}
    assert set(g.tensors) == names
    # Zero-copy views with the engine's row layout.
    q_a = g.rows("blk.0.attn_q_a.weight")
    assert q_a.shape == (spec.q_lora, spec.n_embd // 32 * 34) and q_a.dtype == np.uint8
    assert not q_a.flags.owndata and q_a.base is not None
    exps = g.rows("blk.3.ffn_down_exps.weight")
    assert exps.shape == (spec.n_exp, spec.n_embd, spec.n_ff // 256 * 84)
    embd = g.rows("token_embd.weight")
    assert embd.shape == (spec.n_vocab, spec.n_embd) and embd.dtype == np.float16
    assert 0.8 < float(np.std(embd[:1000].astype(np.float32))) < 1.2
    tid = g.rows("blk.0.ffn_gate_tid2eid.weight")
    assert tid.shape == (spec.n_vocab, spec.n_used)
    assert all(len(set(row)) == spec.n_used for row in tid[:200])
    assert m.validation.ok and m.validation.aliased_tensors == 0
    m.close()


def test_builder_metadata_types_are_ds4s(tiny_model):
    with gguf.GGUFFile(tiny_model) as g:
        expect = {"u32": gguf.UINT32, "u64": gguf.UINT64, "f32": gguf.FLOAT32, "bool": gguf.BOOL}
        for _, key, rule in METADATA_KEYS:
            assert g.value_types[f"deepseek4.{key}"] == expect[rule], key
        assert g.array_types["deepseek4.attention.compress_ratios"] == gguf.UINT32
        assert g.array_types["deepseek4.swiglu_clamp_exp"] == gguf.FLOAT32
        assert g.metadata["general.alignment"] == 32
        assert len(g.metadata["tokenizer.ggml.tokens"]) == 129280
        assert g.metadata["tokenizer.ggml.tokens"][128803] == "<｜User｜>"


def test_flash_plan_matches_ds4():
    spec = synth.preset_spec("flash")
    assert spec.is_ds4_flash()
    planned, blobs = synth.plan_tensors(spec, "none")
    assert len(planned) == 1328
    described = sum(tensor_nbytes(t.ggml_type, t.ne) for t in planned)
    padded = sum(gguf.align_up(tensor_nbytes(t.ggml_type, t.ne), 32) for t in planned)
    assert padded == 86_714_777_664            # ds4-model.md §3: 80.76 GiB, 32-byte padded
    routed = sum(tensor_nbytes(t.ggml_type, t.ne) for t in planned if tensor_role(t.name) == "routed experts")
    assert round(routed / 2**30, 2) == 72.56
    per_layer = {}
    for t in planned:
        if t.name.startswith("blk."):
            il = int(t.name.split(".")[1])
            per_layer[il] = per_layer.get(il, 0) + 1
    assert per_layer[0] == per_layer[1] == 24 and per_layer[2] == 34
    assert per_layer[3] == 28 and per_layer[4] == 34
    types = {t.name.split(".", 2)[-1]: t.ggml_type for t in planned if t.name.startswith("blk.5.")}
    assert types["ffn_gate_exps.weight"] == GGML_IQ2_XXS and types["ffn_down_exps.weight"] == GGML_Q2_K
    assert types["attn_q_b.weight"] == GGML_Q8_0
    largest = {t.name: tensor_nbytes(t.ggml_type, t.ne) for t in planned}
    assert largest["token_embd.weight"] == 1_059_061_760
    assert largest["blk.7.ffn_down_exps.weight"] == 704_643_072
    assert largest["blk.7.ffn_up_exps.weight"] == 553_648_128
    assert largest["output.weight"] == 562_626_560
    assert len(synth.plan_tensors(spec, "per-role")[1]) == 44
    assert sum(synth.plan_tensors(spec, "experts")[1].values()) < 10.0 * 2**30


def test_aliasing_accounting(tmp_path):
    path = tmp_path / "alias.gguf"
    spec = micro_spec()
    info = synth.build_model(str(path), "tiny", "per-role", seed=2, spec=spec)
    m = open_model(path)
    g = m.file
    assert info["blobs"] < info["tensors"]
    # Layers share the same bytes per role; the engine still sees every tensor.
    a = g.tensors["blk.2.attn_q_a.weight"]
    b = g.tensors["blk.4.attn_q_a.weight"]
    assert a.offset == b.offset and a.nbytes == b.nbytes
    assert g.tensors["blk.2.ffn_gate_exps.weight"].offset != g.tensors["blk.2.ffn_up_exps.weight"].offset
    described = sum(t.nbytes for t in g.tensors.values())
    assert m.validation.unique_bytes < described <= g.file_size * 10
    assert m.validation.aliased_tensors > 0
    m.close()


def test_gguf_py_reads_what_we_write(micro_model):
    from gguf import GGUFReader
    reader = GGUFReader(str(micro_model))
    ours = gguf.GGUFFile(micro_model)
    assert len(reader.tensors) == len(ours.tensors)
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert int(t.tensor_type) == mine.ggml_type
        assert tuple(int(x) for x in t.shape) == mine.ne
        assert t.data_offset == mine.offset and t.n_bytes == mine.nbytes
    field = reader.fields["deepseek4.block_count"]
    assert int(field.parts[field.data[0]][0]) == 6
    ours.close()


# ---- bad input ---------------------------------------------------------------------------------------

def _rewrite(src, dst, mutate_meta=None, mutate_tensors=None):
    """Rebuild a GGUF from an existing one with its metadata / tensor infos edited."""
    with gguf.GGUFFile(src) as g:
        meta = [(k, g.value_types[k], g.metadata[k], g.array_types.get(k)) for k in g.metadata]
        infos = [dict(name=t.name, ggml_type=t.ggml_type, ne=t.ne, offset=t.offset, nbytes=t.nbytes)
                 for t in g.tensors.values()]
        data = {t.name: bytes(g.bytes_view(t.name)) for t in g.tensors.values()}
    if mutate_meta:
        meta = mutate_meta(meta)
    if mutate_tensors:
        infos = mutate_tensors(infos)
    planned = [PlannedTensor(i["name"], i["ggml_type"], i["ne"], i["name"]) for i in infos]
    sizes = {i["name"]: tensor_nbytes(i["ggml_type"], i["ne"]) for i in infos}

    def write_blob(blob, f):
        raw = data.get(blob, b"")
        f.write(raw[:sizes[blob]].ljust(sizes[blob], b"\0"))
    gguf.write_gguf(str(dst), meta, planned, sizes, write_blob)
    return dst


def _expect_error(path, fragment):
    with pytest.raises(ModelFileError) as e:
        open_model(path).close()
    assert fragment in str(e.value), str(e.value)
    assert str(path) in str(e.value)
    return str(e.value)


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"this is not a model at all, just text" * 10)
    _expect_error(p, "not a GGUF file")


def test_gguf_v2(tmp_path, micro_model):
    raw = bytearray(micro_model.read_bytes())
    raw[4:8] = struct.pack("<I", 2)
    p = tmp_path / "v2.gguf"
    p.write_bytes(raw)
    _expect_error(p, "version 2")


@pytest.mark.parametrize("where", ["header", "kv", "tensor_infos", "data"])
def test_truncated(tmp_path, micro_model, where):
    with gguf.GGUFFile(micro_model) as g:
        cut = {"header": 12, "kv": 1000, "tensor_infos": g.data_offset - 200,
               "data": g.file_size - 1000}[where]
    p = tmp_path / f"cut-{where}.gguf"
    p.write_bytes(micro_model.read_bytes()[:cut])
    _expect_error(p, "trunc")


def test_missing_metadata_key(tmp_path, micro_model):
    p = _rewrite(micro_model, tmp_path / "m.gguf",
                 mutate_meta=lambda meta: [m for m in meta if m[0] != "deepseek4.expert_count"])
    _expect_error(p, "deepseek4.expert_count is missing")


def test_wrong_key_type(tmp_path, micro_model):
    def to_u64(meta):
        return [(k, gguf.UINT64 if k == "deepseek4.block_count" else t, v, a) for k, t, v, a in meta]
    p = _rewrite(micro_model, tmp_path / "t.gguf", mutate_meta=to_u64)
    _expect_error(p, "deepseek4.block_count has GGUF type u64")


def test_missing_tensor(tmp_path, micro_model):
    p = _rewrite(micro_model, tmp_path / "mt.gguf",
                 mutate_tensors=lambda infos: [i for i in infos if i["name"] != "blk.3.attn_kv.weight"])
    _expect_error(p, "missing tensor blk.3.attn_kv.weight")


def test_wrong_shape(tmp_path, micro_model):
    def reshape(infos):
        for i in infos:
            if i["name"] == "blk.1.attn_q_a.weight":
                i["ne"] = (i["ne"][0], i["ne"][1] * 2)
        return infos
    p = _rewrite(micro_model, tmp_path / "s.gguf", mutate_tensors=reshape)
    _expect_error(p, "blk.1.attn_q_a.weight has shape")


def test_wrong_type(tmp_path, micro_model):
    def retype(infos):
        for i in infos:
            if i["name"] == "blk.0.attn_q_a.weight":
                i["ggml_type"] = gguf.GGML_F16
        return infos
    p = _rewrite(micro_model, tmp_path / "ty.gguf", mutate_tensors=retype)
    _expect_error(p, "blk.0.attn_q_a.weight is F16, expected Q8_0")


def test_offset_past_end(tmp_path, micro_model):
    raw = bytearray(micro_model.read_bytes())
    with gguf.GGUFFile(micro_model) as g:
        name = "output.weight"
        info = g.tensors[name]
        needle = struct.pack("<Q", len(name)) + name.encode()
        at = raw.index(needle) + len(needle)
        n_dims = struct.unpack_from("<I", raw, at)[0]
        off_at = at + 4 + 8 * n_dims + 4
        struct.pack_into("<Q", raw, off_at, g.file_size)   # relative offset beyond the end
    p = tmp_path / "off.gguf"
    p.write_bytes(raw)
    _expect_error(p, "truncated")


def test_directory_and_unreadable(tmp_path):
    _expect_error(tmp_path, "is a directory")
    _expect_error(tmp_path / "nope.gguf", "cannot open")
    sock_path = tmp_path / "sock.gguf"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    try:
        _expect_error(sock_path, "cannot open")
    finally:
        s.close()


def test_cli_errors_are_one_line(tmp_path, micro_model):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(micro_model.read_bytes()[:5000])
    for target in (bad, tmp_path, tmp_path / "missing.gguf"):
        r = subprocess.run([sys.executable, "-m", "ds4py", "inspect", str(target)], capture_output=True, text=True)
        assert r.returncode == 2
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {target}:"), r.stderr
        assert "Traceback" not in r.stderr + r.stdout


def test_cli_inspect_json(micro_model):
    import json
    r = subprocess.run([sys.executable, "-m", "ds4py", "inspect", "--json", str(micro_model)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["architecture"]["n_layer"] == 6 and report["loadable_by_ds4py"]
    assert report["ds4_compatible"] is False and report["tensor_count"] == 178


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_truncate_and_mutate(tmp_path, micro_model, data):
    """Any truncation or byte mutation gives a clean ModelFileError or a clean load."""
    raw = bytearray(micro_model.read_bytes())
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    else:
        header_end = 2_000_000 if len(raw) > 2_000_000 else len(raw)
        for _ in range(data.draw(st.integers(1, 8))):
            at = data.draw(st.integers(0, min(header_end, len(raw)) - 1))
            raw[at] = data.draw(st.integers(0, 255))
    p = tmp_path / "fuzz.gguf"
    p.write_bytes(raw)
    try:
        open_model(p).close()
    except ModelFileError as e:
        assert str(p) in str(e)


def test_flash_metadata_reads_back_as_ds4s_model(tmp_path):
    """The f32 keys (epsilons) read back as float32 values; they must still count as ds4's."""
    from ds4py.io.spec import read_spec
    path = tmp_path / "flash-meta.gguf"
    spec = synth.preset_spec("flash")
    gguf.write_gguf(str(path), synth.metadata_for(spec, "flash"), [], {}, lambda blob, f: None)
    with gguf.GGUFFile(path) as g:
        back = read_spec(g)
    assert back.rms_eps != 1e-6 and back.is_ds4_flash(), back.ds4_differences()
    assert dataclasses.replace(back, n_layer=42).ds4_differences() == ["n_layer"]
