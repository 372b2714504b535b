"""Provenance: code fetched from public repositories stays out of this tree (the library's
rules, /work/.library/search/README.md). Third-party source files carry their authors'
copyright / SPDX headers; this project's files do not. The last exception, CUTLASS's MoE
grouped GEMM example vendored under moe/gemm_sm100/, was replaced by moe/experts_sm100.py:
none may come back."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a licence header: a comment line opening with a copyright notice or an SPDX tag
FOREIGN_HEADER = re.compile(r"^\s*(#|//|/?\*)\s*(Copyright \(c\)|SPDX-License-Identifier)", re.MULTILINE)
KNOWN_FOREIGN: set[str] = set()


def _sources():
    for top in ("cute_kernels", "moe", "spec_decode", "comm", "tests", "tools", "bench"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".py", ".sh", ".cu", ".cuh", ".h")):
                    yield os.path.relpath(os.path.join(dirpath, f), ROOT)


def test_no_new_third_party_sources():
    foreign = set()
    for rel in _sources():
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as fh:
            if FOREIGN_HEADER.search(fh.read(4096)):
                foreign.add(rel)
    assert foreign <= KNOWN_FOREIGN, sorted(foreign - KNOWN_FOREIGN)
    assert KNOWN_FOREIGN <= foreign, f"replaced? drop from KNOWN_FOREIGN: {sorted(KNOWN_FOREIGN - foreign)}"
