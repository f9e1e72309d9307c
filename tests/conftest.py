"""Shared fixtures: synthetic models built once per test session."""

import dataclasses
from pathlib import Path

import pytest

from ds4py import synth


# ds4's benchmark corpus: ../shared beside the checkout (and beside CI's clone); never copied in.
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "promessi_sposi.txt"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The `tiny` preset, exactly as `ds4py make-model --preset tiny` writes it."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth.build_model(str(path), "tiny", "none", seed=0)
    return path


def micro_spec():
    """Tiny dims with a 512-entry vocabulary: a ~1 MB file for fuzzing and corruption tests."""
    return dataclasses.replace(synth.preset_spec("tiny"), n_vocab=512)


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "micro.gguf"
    synth.build_model(str(path), "tiny", "none", seed=1, spec=micro_spec())
    return path
