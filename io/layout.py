"""Where each tensor's bytes go: arena plans (file range -> arena offset) and expert geometry.

Pure arithmetic on the tensor table, shared by every GPU source and tested on the CPU.

An arena is one 1-D uint8 device allocation. Its plan lists the file intervals to copy, each the
union of tensor spans that overlap or lie within `merge_gap` bytes of each other (so aliased
tensors, which share one file range, are copied once, and a plain file's data region becomes one
interval). Every interval keeps its file offset modulo 4096 inside the arena, so whatever alignment
a tensor has in the file (GGUF: 32 bytes) it keeps in VRAM.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ds4py.io.spec import ROUTED_EXPERT_SUFFIXES, Model, is_routed_expert

ARENA_ALIGN = 4096
SLOT_ALIGN = 256                 # sub-slab alignment inside an expert-cache slot
MERGE_GAP = 64 << 10             # ds4 merges neighbouring tensors closer than 64 KiB


@dataclass(frozen=True)
class Interval:
    file_start: int
    file_end: int
    arena_start: int

    @property
    def nbytes(self) -> int:
        return self.file_end - self.file_start


@dataclass
class ArenaPlan:
    intervals: list[Interval]    # sorted by file_start, disjoint
    nbytes: int                  # arena allocation size

    def __post_init__(self):
        self._starts = [iv.file_start for iv in self.intervals]

    @property
    def copy_bytes(self) -> int:
        return sum(iv.nbytes for iv in self.intervals)

    def offset_of(self, file_offset: int, nbytes: int = 0) -> int:
        """Arena offset of a file byte range that the plan covers (KeyError otherwise)."""
        i = bisect.bisect_right(self._starts, file_offset) - 1
        if i < 0:
            raise KeyError(file_offset)
        iv = self.intervals[i]          # bisect guarantees iv.file_start <= file_offset
        if file_offset + nbytes > iv.file_end or file_offset >= iv.file_end:
            raise KeyError(file_offset)
        return iv.arena_start + file_offset - iv.file_start


def merge_spans(spans, merge_gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """Union of (start, end) spans, joining those closer than merge_gap."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if out and start <= out[-1][1] + merge_gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def plan_arena(spans, merge_gap: int = MERGE_GAP) -> ArenaPlan:
    intervals, cursor = [], 0
    for start, end in merge_spans(spans, merge_gap):
        arena_start = (cursor + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN + start % ARENA_ALIGN
        intervals.append(Interval(start, end, arena_start))
        cursor = arena_start + end - start
    return ArenaPlan(intervals, max(cursor, 1))


def dense_names(model: Model) -> list[str]:
    return [n for n in model.file.tensors if not is_routed_expert(n)]


def expert_names(model: Model) -> list[str]:
    return [n for n in model.file.tensors if is_routed_expert(n)]


def spans_of(model: Model, names) -> list[tuple[int, int]]:
    return [model.file.tensors[n].span for n in names]


# ---- the scales-last dense rows ------------------------------------------------------------------

@dataclass(frozen=True)
class Rewrite:
    """Rows at one arena offset that the source rewrites in the scales-last layout, once."""

    arena_offset: int
    n_rows: int
    K: int
    names: tuple[str, ...]           # every tensor whose bytes these are (aliases share one range)


def scales_last_rewrites(model: Model, plan: ArenaPlan, names) -> list[Rewrite]:
    """The dense tensors among `names` to keep scales-last in the arena (kernels/formats.py): those
    that formats.scales_last_ok accepts, grouped by arena range. A range that any other tensor of
    `names` overlaps without being exactly it (another type, a partial view) stays as it is."""
    from ds4py.kernels import formats

    infos = [model.file.tensors[n] for n in names]
    by_span: dict[tuple[int, int], list] = {}
    for info in infos:
        by_span.setdefault(info.span, []).append(info)
    spans = sorted(by_span)
    out = []
    end_before = 0                   # the furthest end of the spans before this one
    for i, span in enumerate(spans):
        group = by_span[span]
        first = group[0]
        overlaps = end_before > span[0] or (i + 1 < len(spans) and spans[i + 1][0] < span[1])
        end_before = max(end_before, span[1])
        if overlaps or len(first.ne) != 2 or any(g.ggml_type != first.ggml_type or g.ne != first.ne for g in group):
            continue
        off = plan.offset_of(span[0], first.nbytes)
        if formats.scales_last_ok(first.ggml_type, first.ne[0], off):
            out.append(Rewrite(off, first.ne[1], first.ne[0], tuple(g.name for g in group)))
    return out


# ---- routed experts ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertGeometry:
    """Where expert e of one layer lives in the file: matrix k at offset[k] + e * stride[k]."""

    layer: int
    offset: tuple[int, int, int]     # file offsets of ffn_gate_exps / ffn_up_exps / ffn_down_exps
    stride: tuple[int, int, int]     # bytes of one expert's matrix (= tensor nbytes / n_exp)

    def file_ranges(self, expert: int) -> list[tuple[int, int]]:
        """(file offset, nbytes) of expert's gate, up and down matrices."""
        return [(o + expert * s, s) for o, s in zip(self.offset, self.stride)]

    @property
    def expert_bytes(self) -> int:
        return sum(self.stride)


def expert_geometry(model: Model) -> list[ExpertGeometry]:
    """One ExpertGeometry per layer, from the tensor table."""
    out = []
    n_exp = model.spec.n_exp
    for il in range(model.spec.n_layer):
        infos = [model.file.tensors[f"blk.{il}.{sfx}"] for sfx in ROUTED_EXPERT_SUFFIXES]
        for info in infos:
            if info.ne[-1] != n_exp or info.nbytes % n_exp:
                raise ValueError(f"{info.name}: cannot split {info.nbytes} bytes into {n_exp} experts")
        out.append(ExpertGeometry(il, tuple(i.offset for i in infos), tuple(i.nbytes // n_exp for i in infos)))
    return out


@dataclass(frozen=True)
class SlotLayout:
    """An expert-cache slot: gate, up and down of one expert, each sub-slab SLOT_ALIGN-aligned."""

    sub_offset: tuple[int, int, int]  # offsets of gate/up/down inside a slot
    slot_bytes: int

    def offsets(self, slot: int) -> tuple[int, int, int]:
        base = slot * self.slot_bytes
        return tuple(base + o for o in self.sub_offset)


def slot_layout(geometry: list[ExpertGeometry]) -> SlotLayout:
    """Slots sized for the largest layer, so any (layer, expert) fits any slot."""
    sizes = [max(g.stride[k] for g in geometry) for k in range(3)]
    sub, pos = [], 0
    for size in sizes:
        sub.append(pos)
        pos += (size + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
    return SlotLayout(tuple(sub), pos)


def expert_slot_bytes(model: Model) -> int:
    return slot_layout(expert_geometry(model)).slot_bytes
