"""Machine-code checks without a GPU: compile for an arch, disassemble, count instructions.

``sass_histogram("row_rms", "sm_100a", hidden=7168)`` compiles the registered kernel with
``--gpu-arch=sm_100a --keep-cubin`` on any machine (fake arguments), disassembles the cubin
with ``nvdisasm`` (wheel ``nvidia-cuda-nvdisasm``) and returns ``Counter`` of mnemonics with
their modifiers (``LDG.E.128``, ``UTCQMMA.2CTA``, ...). ``count(hist, "UTMALDG")`` sums every
mnemonic that starts with a prefix. Mnemonics to expect per path: ``shared/device/sass.md``.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

from .. import catalog, jit

# mnemonic with modifiers; modifiers may hold a lowercase 'x' (HGMMA.64x128x16.F32.BF16, LDTM.x32)
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


@functools.lru_cache(maxsize=1)
def find_nvdisasm() -> str:
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    for base in sys.path:
        for cand in glob.glob(os.path.join(base, "nvidia", "cu1*", "bin", "nvdisasm")):
            if os.access(cand, os.X_OK):
                return cand
    raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the 'test' extra)")


def compile_cubin(name: str, arch: str, **config) -> bytes:
    kdef = catalog.kernels()[name]
    with tempfile.TemporaryDirectory() as d:
        compiled = jit.compile_now(kdef, arch, config,
                                   options=f"{jit.default_options(arch)} --keep-cubin --dump-dir={d}")
        cubin = compiled.fn.artifacts.CUBIN
    if not cubin:
        raise RuntimeError(f"{name}: the compiler kept no cubin for {arch}")
    return cubin


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([find_nvdisasm(), "-c", f.name], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {res.stderr.strip()}")
    return res.stdout


def histogram(sass: str) -> Counter:
    return Counter(m.group(1) for m in _INSN.finditer(sass))


def opcodes(sass: str) -> list[str]:
    """The mnemonics in program order (a predicate like ``@P0`` dropped): for checks of where an
    instruction stands relative to others (a wait before the first load, stores after a barrier)."""
    return [m.group(1) for m in _INSN.finditer(sass)]


def global_loads_before(sass: str, first_use: str) -> tuple[int, bool]:
    """``(loads, all_before)``: the global loads (``LDG.*`` and ``cp.async``'s ``LDGSTS.*``) in
    program order, and whether every one stands before the first ``first_use`` instruction
    (``FFMA``: a row's first square; ``FMUL``: a weighted sum's first product) and, where the
    kernel stages them through ``cp.async``, before its first wait (``DEPBAR``) too. For short
    decode kernels: ptxas, keeping register pressure low, has issued later register loads only
    after earlier ones arrived -- one memory round trip more per group -- and the
    loads the arithmetic depends on through a wait cannot move past it (docs/decode_latency.md)."""
    ops = opcodes(sass)
    loads = [i for i, o in enumerate(ops) if o.startswith(("LDG.", "LDGSTS."))]
    use = next((i for i, o in enumerate(ops) if o == first_use or o.startswith(first_use + ".")), len(ops))
    wait = next((i for i, o in enumerate(ops) if o.startswith("DEPBAR")), len(ops))
    staged = any(ops[i].startswith("LDGSTS.") for i in loads)
    return len(loads), all(i < use and (i < wait or not staged) for i in loads) and (wait < use or not staged)


def sass_histogram(name: str, arch: str, **config) -> Counter:
    return histogram(disassemble(compile_cubin(name, arch, **config)))


def count(hist: Counter, prefix: str) -> int:
    """Instructions whose mnemonic is ``prefix`` or starts with ``prefix.``."""
    return sum(n for m, n in hist.items() if m == prefix or m.startswith(prefix + "."))


def local_memory_ops(hist: Counter) -> int:
    """Spill traffic: LDL/STL (local loads/stores)."""
    return count(hist, "LDL") + count(hist, "STL")


def register_counts(cubin: bytes) -> dict[str, int]:
    """Registers per thread of each kernel in a cubin, from the ``EIATTR_REGCOUNT`` (0x2f)
    records of its ``.nv.info`` section (what ``cuobjdump --dump-resource-usage`` reports)."""
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("register_counts: not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def cstr(base, off):
        return cubin[base + off:cubin.index(b"\0", base + off)].decode()

    names = {cstr(secs[shstrndx][4], s[0]): s for s in secs}
    symtab, strtab = names[".symtab"], names[".strtab"]
    info = names[".nv.info"]
    out, pos, end = {}, info[4], info[4] + info[5]
    while pos < end:
        fmt, attr = cubin[pos], cubin[pos + 1]
        if fmt == 0x04:  # EIFMT_SVAL: u16 size, then the payload
            size, = struct.unpack_from("<H", cubin, pos + 2)
            if attr == 0x2F:
                sym, regs = struct.unpack_from("<II", cubin, pos + 4)
                st_name, = struct.unpack_from("<I", cubin, symtab[4] + sym * symtab[9])
                out[cstr(strtab[4], st_name)] = regs
            pos += 4 + size
        else:  # EIFMT_NVAL / BVAL / HVAL: 4 bytes in all
            pos += 4
    return out
