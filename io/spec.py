"""ModelSpec: the DeepSeek-V4-Flash architecture read from a GGUF's `deepseek4.*` metadata.

ds4 hard-codes every dimension and only checks that each key equals its constant; ds4py reads the
same keys, under the same GGUF type rules, and derives every tensor shape from them (ds4-model.md
§0, §2.1, §3). With ds4's values the derived table is exactly ds4's 1,328 tensors, so one function
(`expected_tensors`) serves both the validator and the synthetic model builder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ds4py.errors import ModelFileError
from ds4py.io import gguf
from ds4py.io.gguf import (GGML_F16, GGML_F32, GGML_I32, GGML_IQ2_XXS, GGML_Q2_K, GGML_Q4_K,
                           GGML_Q8_0, ggml_type_name)

ARCH = "deepseek4"

# (spec field, key under "deepseek4.", value rule). Rules are ds4's: "u32" accepts only UINT32,
# "u64" UINT64 or UINT32, "f32" FLOAT32/FLOAT64/UINT32/INT32, "bool" only BOOL.
METADATA_KEYS: list[tuple[str, str, str]] = [
    ("n_layer", "block_count", "u32"),
    ("n_embd", "embedding_length", "u32"),
    ("n_vocab", "vocab_size", "u32"),
    ("n_head", "attention.head_count", "u32"),
    ("n_head_kv", "attention.head_count_kv", "u32"),
    ("head_dim", "attention.key_length", "u32"),
    ("value_dim", "attention.value_length", "u32"),
    ("n_rot", "rope.dimension_count", "u32"),
    ("q_lora", "attention.q_lora_rank", "u32"),
    ("o_lora", "attention.output_lora_rank", "u32"),
    ("n_group", "attention.output_group_count", "u32"),
    ("n_exp", "expert_count", "u32"),
    ("n_used", "expert_used_count", "u32"),
    ("n_ff", "expert_feed_forward_length", "u32"),
    ("n_shared", "expert_shared_count", "u32"),
    ("n_hash", "hash_layer_count", "u32"),
    ("n_swa", "attention.sliding_window", "u32"),
    ("n_ihead", "attention.indexer.head_count", "u32"),
    ("idx_dim", "attention.indexer.key_length", "u32"),
    ("idx_topk", "attention.indexer.top_k", "u32"),
    ("n_hc", "hyper_connection.count", "u32"),
    ("n_sinkhorn", "hyper_connection.sinkhorn_iterations", "u32"),
    ("rope_orig_ctx", "rope.scaling.original_context_length", "u64"),
    ("rope_freq_base", "rope.freq_base", "f32"),
    ("rope_scale_factor", "rope.scaling.factor", "f32"),
    ("yarn_beta_fast", "rope.scaling.yarn_beta_fast", "f32"),
    ("yarn_beta_slow", "rope.scaling.yarn_beta_slow", "f32"),
    ("compress_rope_freq_base", "attention.compress_rope_freq_base", "f32"),
    ("expert_weights_scale", "expert_weights_scale", "f32"),
    ("rms_eps", "attention.layer_norm_rms_epsilon", "f32"),
    ("hc_eps", "hyper_connection.epsilon", "f32"),
    ("expert_weights_norm", "expert_weights_norm", "bool"),
]
_ACCEPTED_TYPES = {
    "u32": (gguf.UINT32,),
    "u64": (gguf.UINT64, gguf.UINT32),
    "f32": (gguf.FLOAT32, gguf.FLOAT64, gguf.UINT32, gguf.INT32),
    "bool": (gguf.BOOL,),
}
RATIOS_KEY, CLAMP_KEY = "attention.compress_ratios", "swiglu_clamp_exp"

# ds4's compile-time model (ds4-model.md §1): a file is ds4-compatible only with exactly these.
DS4_FLASH_VALUES = dict(
    n_layer=43, n_embd=4096, n_vocab=129280, n_head=64, n_head_kv=1, head_dim=512, value_dim=512,
    n_rot=64, q_lora=1024, o_lora=1024, n_group=8, n_exp=256, n_used=6, n_ff=2048, n_shared=1,
    n_hash=3, n_swa=128, n_ihead=64, idx_dim=128, idx_topk=512, n_hc=4, n_sinkhorn=20,
    rope_orig_ctx=65536, rope_freq_base=10000.0, rope_scale_factor=16.0, yarn_beta_fast=32.0,
    yarn_beta_slow=1.0, compress_rope_freq_base=160000.0, expert_weights_scale=1.5, rms_eps=1e-6,
    hc_eps=1e-6, expert_weights_norm=True,
)


def ds4_compress_ratio(il: int) -> int:
    """ds4's per-layer compression: raw window only for layers 0-1, then 4 (even) and 128 (odd)."""
    return 0 if il < 2 else (4 if il % 2 == 0 else 128)


@dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    value_dim: int
    n_rot: int
    q_lora: int
    o_lora: int
    n_group: int
    n_exp: int
    n_used: int
    n_ff: int
    n_shared: int
    n_hash: int
    n_swa: int
    n_ihead: int
    idx_dim: int
    idx_topk: int
    n_hc: int
    n_sinkhorn: int
    rope_orig_ctx: int
    rope_freq_base: float
    rope_scale_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    compress_rope_freq_base: float
    expert_weights_scale: float
    rms_eps: float
    hc_eps: float
    expert_weights_norm: bool
    compress_ratios: tuple[int, ...] = field(default=())
    swiglu_clamp: tuple[float, ...] = field(default=())

    def ratio(self, il: int) -> int:
        return self.compress_ratios[il]

    @property
    def n_nope(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def hc_mix(self) -> int:
        """Rows of an HC mixer: n_hc pre + n_hc post + n_hc² comb."""
        return (2 + self.n_hc) * self.n_hc

    @property
    def indexer_selects_from(self) -> int:
        """The first position at which a ratio-4 lane holds more than idx_topk compressed rows,
        so the indexer chooses among them (before it, every row is attended); the engines'
        warm-ups run a chunk there so that the selection's kernels compile before any clock."""
        return 4 * (self.idx_topk + 1)

    @staticmethod
    def compressed_rows(n_ctx: int, ratio: int) -> int:
        """Rows a compressed cache of this ratio holds at a context of n_ctx tokens (one per
        `ratio` tokens, plus two of slack for a pending window); at ratio 4 also the length of
        the indexer's score row of a token."""
        return n_ctx // ratio + 2

    def kv_bytes_per_token(self) -> int:
        """Steady-state compressed-cache growth in f32 (ds4-model.md §8, general form)."""
        n_r4 = sum(1 for r in self.compress_ratios if r == 4)
        n_other = [r for r in self.compress_ratios if r not in (0, 4)]
        per_token = n_r4 * (self.head_dim + self.idx_dim) * 4 / 4
        per_token += sum(self.head_dim * 4 / r for r in n_other)
        return int(math.ceil(per_token))

    def kv_bytes(self, n_ctx: int) -> int:
        """KV state for a context of n_ctx tokens: raw window + compressed + indexer rows (f32)."""
        raw = self.n_layer * min(self.n_swa, n_ctx) * self.head_dim * 4
        comp = 0
        for r in self.compress_ratios:
            if r:
                comp += self.compressed_rows(n_ctx, r) * self.head_dim * 4
            if r == 4:
                comp += self.compressed_rows(n_ctx, 4) * self.idx_dim * 4
        return raw + comp

    def ds4_differences(self) -> list[str]:
        """The keys whose value differs from ds4's compiled-in model. Floats compare as ds4's
        required_f32 does: within max(1, |expected|)·1e-6 (1e-6 read back from an f32 key is
        9.99999997e-07)."""
        def same(key, want):
            got = getattr(self, key)
            if isinstance(want, float):
                return abs(got - want) <= max(1.0, abs(want)) * 1e-6
            return got == want
        return [k for k, v in DS4_FLASH_VALUES.items() if not same(k, v)]

    def is_ds4_flash(self) -> bool:
        return not self.ds4_differences() and \
            self.compress_ratios == tuple(ds4_compress_ratio(il) for il in range(43)) and \
            all(c == 10.0 for c in self.swiglu_clamp)


def read_spec(g: gguf.GGUFFile) -> ModelSpec:
    """Read and type-check the architecture keys. Raises ModelFileError naming the first bad key."""
    arch = g.metadata.get("general.architecture")
    if arch is not None and arch != ARCH:
        raise ModelFileError(f"{g.path}: architecture is {arch!r}, not {ARCH!r}; ds4py runs DeepSeek-V4-Flash GGUFs only")
    values: dict[str, object] = {}
    for attr, key, rule in METADATA_KEYS:
        full = f"{ARCH}.{key}"
        if full not in g.metadata:
            raise ModelFileError(f"{g.path}: metadata key {full} is missing; this is not a ds4-layout DeepSeek-V4 file")
        vtype = g.value_types[full]
        if vtype not in _ACCEPTED_TYPES[rule]:
            raise ModelFileError(
                f"{g.path}: metadata key {full} has GGUF type {gguf.VALUE_TYPE_NAMES.get(vtype, vtype)}, "
                f"ds4 requires {rule}; rebuild the file with the right key types")
        value = g.metadata[full]
        values[attr] = float(value) if rule == "f32" else (bool(value) if rule == "bool" else int(value))
    n_layer = values["n_layer"]
    values["compress_ratios"] = _read_array(g, RATIOS_KEY, (gguf.UINT32, gguf.INT32), n_layer, int)
    values["swiglu_clamp"] = _read_array(g, CLAMP_KEY, (gguf.FLOAT32, gguf.FLOAT64), n_layer, float)
    for key in ("expert_group_count", "expert_group_used_count"):
        full = f"{ARCH}.{key}"
        if g.value_types.get(full) == gguf.UINT32 and g.metadata[full] != 0:
            raise ModelFileError(f"{g.path}: {full} = {g.metadata[full]} but DeepSeek-V4-Flash uses no expert groups (0)")
    spec = ModelSpec(**values)
    _check_dims(g.path, spec)
    return spec


def _read_array(g, key, item_types, n_layer, cast):
    full = f"{ARCH}.{key}"
    if full not in g.metadata:
        raise ModelFileError(f"{g.path}: metadata key {full} is missing")
    if g.value_types[full] != gguf.ARRAY or g.array_types[full] not in item_types:
        raise ModelFileError(f"{g.path}: metadata key {full} must be an array of "
                             f"{'/'.join(gguf.VALUE_TYPE_NAMES[t] for t in item_types)}")
    values = g.metadata[full]
    if len(values) < n_layer:
        raise ModelFileError(f"{g.path}: {full} has {len(values)} entries, needs {n_layer} (one per layer)")
    return tuple(cast(v) for v in values[:n_layer])


def _check_dims(path: str, s: ModelSpec) -> None:
    """The constraints of ds4-model.md §12.6 that every shape derivation relies on."""
    rules = [
        (s.n_layer >= 1, "block_count must be at least 1"),
        (s.n_head_kv == 1, "attention.head_count_kv must be 1 (one shared KV head)"),
        (s.n_shared == 1, "expert_shared_count must be 1"),
        (s.head_dim == s.value_dim, "key_length must equal value_length"),
        (s.n_embd % 256 == 0 and s.n_ff % 256 == 0, "embedding_length and expert_feed_forward_length must be multiples of 256"),
        (s.q_lora % 32 == 0 and s.o_lora % 32 == 0, "q/output lora ranks must be multiples of 32"),
        (s.n_group >= 1 and s.n_head % s.n_group == 0, "output_group_count must divide head_count"),
        ((s.n_head * s.head_dim // max(s.n_group, 1)) % 32 == 0, "head_count*key_length/output_group_count must be a multiple of 32"),
        (s.n_rot % 2 == 0 and 0 < s.n_rot <= s.idx_dim <= s.head_dim, "rope.dimension_count must be even and <= indexer key_length <= key_length"),
        (s.n_nope % 64 == 0, "key_length - rope.dimension_count must be a multiple of 64 (FP8 blocks)"),
        (s.idx_dim % 32 == 0 and s.idx_dim & (s.idx_dim - 1) == 0, "indexer key_length must be a power of two and a multiple of 32"),
        (1 <= s.n_used <= s.n_exp, "expert_used_count must be between 1 and expert_count"),
        (0 <= s.n_hash <= s.n_layer, "hash_layer_count must be <= block_count"),
        (s.n_swa >= 1 and s.idx_topk >= 1, "sliding_window and indexer top_k must be positive"),
        (all(r in (0, 4) or r > 4 for r in s.compress_ratios), "compress_ratios entries must be 0, 4 or > 4"),
        (s.n_hc >= 1 and s.n_sinkhorn >= 1, "hyper_connection count and sinkhorn_iterations must be positive"),
    ]
    for ok, what in rules:
        if not ok:
            raise ModelFileError(f"{path}: inconsistent architecture: {what}")


# ---- the tensor table ---------------------------------------------------------------------------

EXPERT_TYPES = (GGML_IQ2_XXS, GGML_Q2_K, GGML_Q4_K)
ROUTED_EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


@dataclass(frozen=True)
class ExpectedTensor:
    name: str
    ne: tuple[int, ...]
    types: tuple[int, ...]       # allowed GGML types (one, except routed experts)
    required: bool = True


def expected_tensors(s: ModelSpec) -> list[ExpectedTensor]:
    """Every tensor of the model, in ds4's order, with shapes derived from the spec (§3)."""
    E = ExpectedTensor
    hc_in = s.n_hc * s.n_embd
    out = [
        E("token_embd.weight", (s.n_embd, s.n_vocab), (GGML_F16,)),
        E("output_hc_base.weight", (s.n_hc,), (GGML_F32,)),
        E("output_hc_fn.weight", (hc_in, s.n_hc), (GGML_F16,)),
        E("output_hc_scale.weight", (1,), (GGML_F32,)),
        E("output_norm.weight", (s.n_embd,), (GGML_F32,)),
        E("output.weight", (s.n_embd, s.n_vocab), (GGML_Q8_0,)),
    ]
    for il in range(s.n_layer):
        r = s.ratio(il)
        coff = 2 if r == 4 else 1
        p = f"blk.{il}."
        out += [
            E(p + "hc_attn_fn.weight", (hc_in, s.hc_mix), (GGML_F16,)),
            E(p + "hc_attn_scale.weight", (3,), (GGML_F32,)),
            E(p + "hc_attn_base.weight", (s.hc_mix,), (GGML_F32,)),
            E(p + "attn_norm.weight", (s.n_embd,), (GGML_F32,)),
            E(p + "attn_q_a.weight", (s.n_embd, s.q_lora), (GGML_Q8_0,)),
            E(p + "attn_q_a_norm.weight", (s.q_lora,), (GGML_F32,)),
            E(p + "attn_q_b.weight", (s.q_lora, s.n_head * s.head_dim), (GGML_Q8_0,)),
            E(p + "attn_kv.weight", (s.n_embd, s.head_dim), (GGML_Q8_0,)),
            E(p + "attn_kv_a_norm.weight", (s.head_dim,), (GGML_F32,)),
            E(p + "attn_sinks.weight", (s.n_head,), (GGML_F32,)),
            E(p + "attn_output_a.weight", (s.n_head * s.head_dim // s.n_group, s.n_group * s.o_lora), (GGML_Q8_0,)),
            E(p + "attn_output_b.weight", (s.n_group * s.o_lora, s.n_embd), (GGML_Q8_0,)),
        ]
        if r != 0:
            out += [
                E(p + "attn_compressor_ape.weight", (coff * s.head_dim, r), (GGML_F16,)),
                E(p + "attn_compressor_kv.weight", (s.n_embd, coff * s.head_dim), (GGML_F16,)),
                E(p + "attn_compressor_gate.weight", (s.n_embd, coff * s.head_dim), (GGML_F16,)),
                E(p + "attn_compressor_norm.weight", (s.head_dim,), (GGML_F32,)),
            ]
        if r == 4:
            out += [
                E(p + "indexer.attn_q_b.weight", (s.q_lora, s.n_ihead * s.idx_dim), (GGML_F16,)),
                E(p + "indexer.proj.weight", (s.n_embd, s.n_ihead), (GGML_F16,)),
                E(p + "indexer_compressor_ape.weight", (2 * s.idx_dim, 4), (GGML_F16,)),
                E(p + "indexer_compressor_kv.weight", (s.n_embd, 2 * s.idx_dim), (GGML_F16,)),
                E(p + "indexer_compressor_gate.weight", (s.n_embd, 2 * s.idx_dim), (GGML_F16,)),
                E(p + "indexer_compressor_norm.weight", (s.idx_dim,), (GGML_F32,)),
            ]
        out += [
            E(p + "hc_ffn_fn.weight", (hc_in, s.hc_mix), (GGML_F16,)),
            E(p + "hc_ffn_scale.weight", (3,), (GGML_F32,)),
            E(p + "hc_ffn_base.weight", (s.hc_mix,), (GGML_F32,)),
            E(p + "ffn_norm.weight", (s.n_embd,), (GGML_F32,)),
            E(p + "ffn_gate_inp.weight", (s.n_embd, s.n_exp), (GGML_F16,)),
            E(p + "exp_probs_b.bias", (s.n_exp,), (GGML_F32,), required=False),
            E(p + "ffn_gate_exps.weight", (s.n_embd, s.n_ff, s.n_exp), EXPERT_TYPES),
            E(p + "ffn_up_exps.weight", (s.n_embd, s.n_ff, s.n_exp), EXPERT_TYPES),
            E(p + "ffn_down_exps.weight", (s.n_ff, s.n_embd, s.n_exp), EXPERT_TYPES),
            E(p + "ffn_gate_shexp.weight", (s.n_embd, s.n_ff), (GGML_Q8_0,)),
            E(p + "ffn_up_shexp.weight", (s.n_embd, s.n_ff), (GGML_Q8_0,)),
            E(p + "ffn_down_shexp.weight", (s.n_ff, s.n_embd), (GGML_Q8_0,)),
        ]
        if il < s.n_hash:
            out.append(E(p + "ffn_gate_tid2eid.weight", (s.n_used, s.n_vocab), (GGML_I32,)))
    return out


ROLE_ORDER = ("routed experts", "attention", "shared expert", "hyper-connection", "router",
              "compressor", "indexer", "norms", "embedding", "output head")


def tensor_role(name: str) -> str:
    """Which part of the model a tensor belongs to (for summaries and residency decisions)."""
    base = name.split(".", 2)[2] if name.startswith("blk.") else name
    if base in ROUTED_EXPERT_SUFFIXES:
        return "routed experts"
    if base == "token_embd.weight":
        return "embedding"
    if base.startswith("output"):
        return "output head"
    if base.startswith("indexer"):
        return "indexer"
    if base.startswith("attn_compressor"):
        return "compressor"
    if base.startswith("hc_"):
        return "hyper-connection"
    if base.endswith("_shexp.weight"):
        return "shared expert"
    if base in ("ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_tid2eid.weight"):
        return "router"
    if base.endswith("norm.weight"):
        return "norms"
    return "attention"


def is_routed_expert(name: str) -> bool:
    return tensor_role(name) == "routed experts"


# ---- validation ---------------------------------------------------------------------------------

@dataclass
class Validation:
    problems: list[str]               # each makes the file unusable
    ds4_incompatible: list[str]       # reasons ds4 itself would refuse the file (ds4py may still run it)
    aliased_tensors: int              # tensors whose bytes are shared with another tensor
    unique_bytes: int                 # bytes covered by distinct tensor spans

    @property
    def ok(self) -> bool:
        return not self.problems


def validate(g: gguf.GGUFFile, s: ModelSpec) -> Validation:
    problems: list[str] = []
    incompatible: list[str] = []
    for name, ggml_type in g.unknown_types.items():
        problems.append(f"tensor {name} has unknown GGML type {ggml_type}")
    for exp in expected_tensors(s):
        info = g.tensors.get(exp.name)
        if info is None:
            if exp.required:
                problems.append(f"missing tensor {exp.name}")
            continue
        if info.ne != exp.ne:
            problems.append(f"tensor {exp.name} has shape {list(info.ne)}, expected {list(exp.ne)}")
        if info.ggml_type not in exp.types:
            problems.append(f"tensor {exp.name} is {info.type_name}, expected "
                            f"{' or '.join(ggml_type_name(t) for t in exp.types)}")
    problems += _check_expert_types(g, s)
    problems += _check_hash_table(g, s)
    if not s.is_ds4_flash():
        diffs = s.ds4_differences()
        if s.compress_ratios != tuple(ds4_compress_ratio(il) for il in range(43)):
            diffs.append("compress_ratios")
        if any(c != 10.0 for c in s.swiglu_clamp):
            diffs.append("swiglu_clamp_exp")
        incompatible.append("dimensions differ from ds4's compiled-in model (" + ", ".join(diffs[:6]) +
                            (", …" if len(diffs) > 6 else "") + ")")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        problems.append("tokenizer.ggml.tokens is missing")
    elif len(tokens) < s.n_vocab:
        incompatible.append(f"token table has {len(tokens)} entries, fewer than n_vocab={s.n_vocab} (ds4 indexes it with the logits argmax)")
    if "tokenizer.ggml.merges" not in g.metadata:
        problems.append("tokenizer.ggml.merges is missing")
    aliased, unique = alias_summary(g)
    return Validation(problems, incompatible + problems, aliased, unique)


def _check_expert_types(g, s) -> list[str]:
    """ds4 needs gate type == up type; ds4py runs IQ2_XXS/IQ2_XXS/Q2_K (q2) and Q4_K x3 (q4)."""
    problems = []
    for il in range(s.n_layer):
        types = [g.tensors[f"blk.{il}.{sfx}"].ggml_type for sfx in ROUTED_EXPERT_SUFFIXES
                 if f"blk.{il}.{sfx}" in g.tensors]
        if len(types) == 3 and tuple(types) not in ((GGML_IQ2_XXS, GGML_IQ2_XXS, GGML_Q2_K),
                                                    (GGML_Q4_K, GGML_Q4_K, GGML_Q4_K)):
            problems.append(f"layer {il} routed experts are {'/'.join(ggml_type_name(t) for t in types)}; "
                            f"supported: IQ2_XXS/IQ2_XXS/Q2_K or Q4_K/Q4_K/Q4_K")
    return problems


def _check_hash_table(g, s) -> list[str]:
    for il in range(s.n_hash):
        name = f"blk.{il}.ffn_gate_tid2eid.weight"
        info = g.tensors.get(name)
        if info is None or info.ggml_type != GGML_I32 or info.ne != (s.n_used, s.n_vocab):
            continue
        ids = g.rows(name)
        if ids.min() < 0 or ids.max() >= s.n_exp:
            return [f"{name} holds expert ids outside [0, {s.n_exp})"]
    return []


def alias_summary(g: gguf.GGUFFile) -> tuple[int, int]:
    """(tensors sharing bytes with another tensor, bytes covered by the union of all spans)."""
    spans = sorted(info.span for info in g.tensors.values())
    seen: dict[tuple[int, int], int] = {}
    for span in spans:
        seen[span] = seen.get(span, 0) + 1
    aliased = sum(n for n in seen.values() if n > 1)
    covered, end = 0, -1
    for start, stop in spans:
        if stop <= end:
            continue
        covered += stop - max(start, end)
        end = stop
    return aliased, covered


def bytes_by(g: gguf.GGUFFile, key) -> dict[str, int]:
    """Tensor bytes described (aliases counted every time), grouped by key(TensorInfo)."""
    out: dict[str, int] = {}
    for info in g.tensors.values():
        k = key(info)
        out[k] = out.get(k, 0) + info.nbytes
    return out


@dataclass
class Model:
    """An opened, validated model file: the tensor table plus its spec."""

    file: gguf.GGUFFile
    spec: ModelSpec
    validation: Validation

    @property
    def path(self) -> str:
        return self.file.path

    def close(self) -> None:
        self.file.close()


def open_model(path) -> Model:
    """Open a GGUF and validate it as a DS4 model. Raises ModelFileError with one clear line."""
    g = gguf.GGUFFile(path)
    try:
        spec = read_spec(g)
        v = validate(g, spec)
    except ModelFileError:
        g.close()
        raise
    if not v.ok:
        g.close()
        more = f" (and {len(v.problems) - 1} more problems)" if len(v.problems) > 1 else ""
        raise ModelFileError(f"{path}: {v.problems[0]}{more}; this file is not a loadable DS4 model "
                             f"(run `ds4py inspect` for the full list)")
    return Model(g, spec, v)


def to_numpy_f32(g: gguf.GGUFFile, name: str) -> np.ndarray:
    """A small F32/F16 tensor as float32 (norms, HC params, biases)."""
    return np.asarray(g.rows(name), dtype=np.float32)
