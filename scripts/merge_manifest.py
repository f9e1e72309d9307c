"""Merge the shapes of recorded kernel manifests into the shipped kernels/manifest.json.

A run records what it built in ~/.cache/ds4py/kernel-manifest.json (kernels/precompile.py): on
the GPU machine, scripts/device-precompile.sh leaves the CUDA ones in $OUT (manifest_after_tiny
.json, manifest_after_flash.json); on a machine without a GPU, `XDG_CACHE_HOME=/tmp/x ds4py run
...` records the CPU engine's under a "cpu;" key. Each shape given replaces the shipped one; the
file keeps one kernel per line (reviewable diffs).

    python scripts/merge_manifest.py RECORDED.json [...]
"""
import json
import sys
from pathlib import Path

from ds4py.kernels.precompile import SHIPPED, VERSION


def write(shapes: dict, path: Path = SHIPPED) -> None:
    parts = []
    for key in sorted(shapes):
        lines = ",\n".join("  " + json.dumps(e, sort_keys=True) for e in shapes[key])
        parts.append(f"{json.dumps(key)}: [\n{lines}\n]")
    path.write_text(f'{{"version": {VERSION}, "shapes": {{\n' + ",\n".join(parts) + "\n}}\n")


def main(paths: list[str]) -> int:
    shipped = json.loads(SHIPPED.read_text())
    for p in paths:
        recorded = json.loads(Path(p).read_text())
        for key, kernels in recorded.get("shapes", {}).items():
            shipped["shapes"][key] = kernels
            print(f"{len(kernels):3d} kernels  {key[:100]}")
    write(shipped["shapes"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
