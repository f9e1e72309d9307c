"""The options table: parsing, environment binding, precedence, conflicts, README sync, typer glue."""

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ds4py import options as o
from ds4py.errors import Ds4Error

GiB, MiB = 1 << 30, 1 << 20


def test_every_option_has_one_env_and_one_flag():
    flags = [x.flag for x in o.OPTIONS]
    envs = [x.env for x in o.OPTIONS]
    assert len(set(flags)) == len(flags) and len(set(envs)) == len(envs)
    assert all(e.startswith("DS4_CUDA_") == x.from_ds4 or e.startswith("DS4PY_") for e, x in zip(envs, o.OPTIONS))
    ds4_names = {"--gpu-resident": "DS4_CUDA_COPY_MODEL_CHUNKED", "--no-direct-io": "DS4_CUDA_NO_DIRECT_IO",
                 "--keep-model-pages": "DS4_CUDA_KEEP_MODEL_PAGES", "--no-model-copy": "DS4_CUDA_NO_MODEL_COPY",
                 "--direct-model": "DS4_CUDA_DIRECT_MODEL", "--copy-chunk-mb": "DS4_CUDA_MODEL_COPY_CHUNK_MB"}
    table = {x.flag: x.env for x in o.OPTIONS}
    assert all(table[f] == e for f, e in ds4_names.items())
    assert set(f.name for f in o.WeightOptions.__dataclass_fields__.values()) >= {x.dest for x in o.OPTIONS}


@pytest.mark.parametrize("text,value", [("80G", 80 * GiB), ("80GB", 80 * GiB), ("80GiB", 80 * GiB), ("80", 80 * GiB),
                                        ("512m", 512 * MiB), ("1.5T", int(1.5 * (1 << 40))), ("4096K", 4 * MiB),
                                        (" 2 g ", 2 * GiB), ("0", 0)])
def test_sizes(text, value):
    assert o.parse_size(text, "--x") == value


@pytest.mark.parametrize("text", ["", "-1G", "G", "80X", "eighty", "1.2.3G", "80 GiBs"])
def test_bad_sizes(text):
    with pytest.raises(Ds4Error, match="--x"):
        o.parse_size(text, "--x")


def test_defaults_with_empty_environment():
    w = o.from_env({})
    assert (w.weights, w.copy_chunk_mb, w.n_ctx, w.gpu_vram, w.ram_budget, w.expert_cache) == (
        "auto", 64, 32768, None, None, None)
    assert set(w.sources.values()) == {"default"}
    r = w.to_request()
    assert r.weights == "auto" and r.gpu_vram is None


def test_precedence_flag_over_env_over_default():
    env = {"DS4PY_CTX": "8192", "DS4_CUDA_MODEL_COPY_CHUNK_MB": "128", "DS4PY_GPU_VRAM": "40G"}
    w = o.from_env(env, n_ctx="16k")
    assert w.n_ctx == 16384 and w.sources["n_ctx"] == "flag"
    assert w.copy_chunk_mb == 128 and w.sources["copy_chunk_mb"] == "env"
    assert w.gpu_vram == 40 * GiB and w.sources["gpu_vram"] == "env"
    assert w.ram_budget is None and w.sources["ram_budget"] == "default"
    # an explicit False from a caller beats the environment too
    w = o.from_env({"DS4_CUDA_KEEP_MODEL_PAGES": "1"}, keep_model_pages=False)
    assert w.keep_model_pages is False and w.sources["keep_model_pages"] == "flag"


@pytest.mark.parametrize("raw,value", [("1", True), ("yes", True), ("ON", True), ("true", True), ("0", False),
                                       ("off", False), ("no", False), ("  ", False)])
def test_boolean_environment(raw, value):
    assert o.from_env({"DS4_CUDA_NO_DIRECT_IO": raw}).no_direct_io is value


def test_bad_environment_values_name_the_variable():
    with pytest.raises(Ds4Error, match="DS4_CUDA_NO_DIRECT_IO"):
        o.from_env({"DS4_CUDA_NO_DIRECT_IO": "maybe"})
    with pytest.raises(Ds4Error, match="--ctx"):
        o.from_env({"DS4PY_CTX": "lots"})


def test_value_forms():
    w = o.from_env({}, weights="pagecache", expert_cache="512", gpu_vram="auto", ram_budget="100G", n_ctx="64K")
    assert w.weights == "page-cache" and w.expert_cache == ("slots", 512) and w.gpu_vram is None
    assert w.ram_budget == 100 * GiB and w.n_ctx == 65536
    w = o.from_env({}, weights="direct", expert_cache="8G")
    assert w.weights == "stream" and w.expert_cache == ("bytes", 8 * GiB)
    r = w.to_request()
    assert r.expert_cache_bytes == 8 * GiB and r.expert_cache_slots is None
    assert o.from_env({}, gpu_resident=True).to_request().weights == "device"
    with pytest.raises(Ds4Error, match="--ctx"):
        o.from_env({}, n_ctx=str(o.MAX_CTX + 1))
    assert o.from_env({"DS4PY_PREFILL_CHUNK": "1k"}).prefill_chunk == 1024
    assert o.from_env({}).prefill_chunk == o.DEFAULT_PREFILL_CHUNK
    with pytest.raises(Ds4Error, match="--prefill-chunk"):
        o.from_env({}, prefill_chunk=str(o.MAX_PREFILL_CHUNK + 1))
    assert o.from_env({}).attention == "auto"
    assert o.from_env({"DS4PY_ATTENTION": "F32"}).attention == "f32"
    assert o.from_env({"DS4PY_ATTENTION": "f32"}, attention="f64").attention == "f64"
    with pytest.raises(Ds4Error, match="--attention: 'f16' is not one of auto, f64, f32"):
        o.from_env({}, attention="f16")


def test_copy_chunk_is_clamped_like_ds4():
    w = o.from_env({}, copy_chunk_mb="8")
    assert w.copy_chunk_mb == 16 and "clamped" in w.notes[0]
    assert o.from_env({}, copy_chunk_mb="100000").copy_chunk_mb == 4096
    assert o.from_env({}, copy_chunk_mb="256").notes == []


@pytest.mark.parametrize("env,flags,names", [
    ({}, dict(weights="device", no_model_copy=True), ("--weights device", "--no-model-copy")),
    ({"DS4_CUDA_NO_MODEL_COPY": "1"}, dict(weights="device"), ("--weights device", "DS4_CUDA_NO_MODEL_COPY=1")),
    ({}, dict(weights="device", direct_model=True), ("--weights device", "--direct-model")),
    ({}, dict(gpu_resident=True, weights="stream"), ("--gpu-resident", "--weights stream")),
    ({"DS4_CUDA_COPY_MODEL_CHUNKED": "1"}, dict(no_model_copy=True),
     ("DS4_CUDA_COPY_MODEL_CHUNKED=1", "--no-model-copy")),
    ({}, dict(direct_model=True, weights="page-cache"), ("--weights page-cache", "--direct-model")),
    ({}, dict(weights="device", expert_cache="100"), ("--weights device", "--ssd-streaming-cache-experts 100")),
    ({}, dict(weights="stream", warm_weights=True), ("--weights stream", "--warm-weights")),
    ({"DS4PY_GPU_VRAM": "0"}, dict(weights="page-cache"), ("DS4PY_GPU_VRAM=0", "--weights page-cache")),
])
def test_conflicts_name_both_options(env, flags, names):
    with pytest.raises(Ds4Error) as e:
        o.from_env(env, **flags)
    msg = str(e.value)
    assert all(n in msg for n in names), msg
    assert "conflicts with" in msg and "\n" not in msg


def test_compatible_combinations():
    o.from_env({}, weights="stream", warm_weights=True, keep_model_pages=True)
    o.from_env({}, weights="page-cache", no_direct_io=True, keep_model_pages=True, expert_cache="64")
    o.from_env({}, no_model_copy=True, direct_model=True)
    o.from_env({}, weights="device", gpu_resident=True)


def test_readme_holds_the_rendered_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert o.markdown_table() in readme, "README out of date: paste `python -m ds4py.options` into it"


# ---- the typer glue -------------------------------------------------------------------------------

def _app():
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    seen = {}

    @app.command()
    @o.weight_options
    def cmd(name: str = typer.Option("x", "--name"), weights=None):
        seen["name"], seen["w"] = name, weights

    @app.command()
    def other():
        pass

    return app, seen


def test_decorator_adds_every_option_and_reports_sources(monkeypatch):
    for opt in o.OPTIONS:
        monkeypatch.delenv(opt.env, raising=False)
    monkeypatch.setenv("DS4PY_CTX", "2048")
    monkeypatch.setenv("DS4_CUDA_KEEP_MODEL_PAGES", "yes")
    app, seen = _app()
    runner = CliRunner()
    r = runner.invoke(app, ["cmd", "--name", "y", "--weights", "stream", "--no-direct-io", "--ctx", "4096"])
    assert r.exit_code == 0, r.output
    w = seen["w"]
    assert seen["name"] == "y"
    assert (w.weights, w.no_direct_io, w.n_ctx, w.keep_model_pages) == ("stream", True, 4096, True)
    assert w.sources["weights"] == "flag" and w.sources["n_ctx"] == "flag"
    assert w.sources["keep_model_pages"] == "env" and w.sources["gpu_vram"] == "default"


def test_decorator_help_lists_flags_and_env_names():
    app, _ = _app()
    r = CliRunner().invoke(app, ["cmd", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for opt in o.OPTIONS:
        assert opt.flag in r.output and opt.env in r.output, opt.flag


def test_decorator_bad_env_raises_ds4error_not_usage(monkeypatch):
    monkeypatch.setenv("DS4_CUDA_DIRECT_MODEL", "perhaps")
    app, _ = _app()
    r = CliRunner().invoke(app, ["cmd"])
    assert isinstance(r.exception, Ds4Error) and "DS4_CUDA_DIRECT_MODEL" in str(r.exception)


def test_decorator_needs_a_weights_parameter():
    with pytest.raises(TypeError):
        o.weight_options(lambda name="x": None)
