"""Compiled-kernel cache and on-disk artifact cache (CPU: compile for sm_100a/sm_90a, no GPU)."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import warnings

import pytest

from cute_kernels import catalog, jit
from cute_kernels.artifact_cache import ArtifactCache, function_prefix

CFG = dict(hidden=7168, dtype="bfloat16")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def kdef():
    return catalog.kernels()["row_rms"]


@pytest.fixture
def fresh_cache():
    jit.CACHE.clear()
    yield jit.CACHE
    jit.CACHE.clear()


# ----------------------------------------------------------------- cache key ----------
def test_key_names_every_field(kdef):
    k = jit.CacheKey.make(kdef, "sm_100a", CFG)
    assert k.kernel == "row_rms" and k.arch == "sm_100a" and k.dsl_version == "4.8.1"
    assert json.loads(k.config) == kdef.canonical_config(CFG) and len(k.source_hash) == 16
    digests = {
        k.digest(),
        jit.CacheKey.make(kdef, "sm_90a", CFG).digest(),
        jit.CacheKey.make(kdef, "sm_100a", dict(CFG, hidden=28672)).digest(),
        jit.CacheKey.make(kdef, "sm_100a", CFG, options="--gpu-arch=sm_100a --keep-cubin").digest(),
    }
    assert len(digests) == 4
    # arch spellings normalise to one key
    assert jit.CacheKey.make(kdef, "sm100", CFG) == k


def test_spelled_out_defaults_name_the_same_artifact():
    """A launch that passes build()'s defaults explicitly (the MoE decode kernel's stages=None,
    row_passes=False) hits the AOT entry built from a config that leaves them out."""
    k = catalog.kernels()["moe_expert_swap_ab_sm90"]
    aot = {"E": 256, "N": 4096, "K": 7168, "tok_n": 16, "silu_quant": True}
    assert jit.CacheKey.make(k, "sm_90a", dict(aot, stages=None, row_passes=False)) == \
        jit.CacheKey.make(k, "sm_90a", aot)
    assert jit.CacheKey.make(k, "sm_90a", dict(aot, stages=3)) != jit.CacheKey.make(k, "sm_90a", aot)
    assert jit.CacheKey.make(k, "sm_90a", dict(aot, row_passes=0)) != jit.CacheKey.make(k, "sm_90a", aot)


def test_source_change_changes_key(tmp_path, kdef):
    src = tmp_path / "k.py"
    src.write_text("a = 1\n")
    d = jit.KernelDef("tmp_k", kdef.build, (str(src),), kdef.archs)
    h1 = d.source_hash()
    src.write_text("a = 2\n")
    assert d.source_hash() != h1


# -------------------------------------------------------------- in-process ------------
def test_hits_misses_and_compile_seconds(fresh_cache, tmp_path):
    store = ArtifactCache(str(tmp_path))
    f1 = jit.get_kernel("row_rms", "sm_100a", artifact_cache=store, **CFG)
    f2 = jit.get_kernel("row_rms", "sm_100a", artifact_cache=store, **CFG)
    assert f1 is f2
    s = fresh_cache.stats
    assert (s.misses, s.hits, s.compiles, s.disk_writes) == (1, 1, 1, 1)
    assert s.compile_seconds > 0


def test_concurrent_first_calls_compile_once(fresh_cache, kdef):
    out, errs = [], []

    def worker():
        try:
            out.append(jit.get_kernel("row_rms", "sm_90a", use_disk=False, **CFG))
        except Exception as e:  # pragma: no cover - surfaced below
            errs.append(e)

    ts = [threading.Thread(target=worker) for _ in range(6)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errs and len(out) == 6 and all(f is out[0] for f in out)
    assert fresh_cache.stats.compiles == 1 and fresh_cache.stats.hits == 5
    # the GPU tests' hang watchdog discounts this: every thread's miss (compile or its wait) counted
    assert fresh_cache.busy_seconds() >= fresh_cache.stats.compile_seconds > 0
    busy = fresh_cache.busy_seconds()
    jit.get_kernel("row_rms", "sm_90a", use_disk=False, **CFG)  # a hit adds nothing
    assert fresh_cache.busy_seconds() == busy


def test_unknown_kernel_and_arch():
    with pytest.raises(KeyError, match="unknown kernel"):
        jit.get_kernel("nope", "sm_90a")
    with pytest.raises(ValueError, match="not supported"):
        jit.get_kernel("row_rms", "sm_80", **CFG)


# --------------------------------------------------------------- artifact cache -------
def test_round_trip_loads_without_compiling(fresh_cache, tmp_path, kdef):
    store = ArtifactCache(str(tmp_path))
    for arch in ("sm_90a", "sm_100a"):
        jit.get_kernel("row_rms", arch, artifact_cache=store, **CFG)
    assert fresh_cache.stats.compiles == 2
    fresh_cache.clear()
    for arch in ("sm_90a", "sm_100a"):
        fn = jit.get_kernel("row_rms", arch, artifact_cache=store, **CFG)
        assert fn is not None
    assert fresh_cache.stats.compiles == 0 and fresh_cache.stats.disk_loads == 2
    man = json.load(open(os.path.join(store.entry_dir(jit.CacheKey.make(kdef, "sm_90a", CFG)), "manifest.json")))
    assert man["key"]["arch"] == "sm_90a" and man["key"]["dsl_version"] == "4.8.1"
    assert set(man["files"]) == {"kernel.o", "kernel.h"}
    assert all(len(v["sha256"]) == 64 for v in man["files"].values())


def _corrupt_truncate(d):
    p = os.path.join(d, "kernel.o")
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])


def _corrupt_flip(d):
    p = os.path.join(d, "kernel.o")
    data = bytearray(open(p, "rb").read())
    data[len(data) // 3] ^= 0x40
    open(p, "wb").write(bytes(data))


def _edit_manifest(field, value):
    def f(d):
        p = os.path.join(d, "manifest.json")
        m = json.load(open(p))
        m["key"][field] = value
        json.dump(m, open(p, "w"))
    return f


def _garbage_manifest(d):
    open(os.path.join(d, "manifest.json"), "w").write("{not json")


def _no_object(d):
    os.remove(os.path.join(d, "kernel.o"))


@pytest.mark.parametrize(
    "corrupt, why",
    [
        (_corrupt_truncate, "truncated"),
        (_corrupt_flip, "sha256 mismatch"),
        (_edit_manifest("arch", "sm_100a"), "manifest arch"),
        (_edit_manifest("dsl_version", "4.7.0"), "manifest dsl_version"),
        (_garbage_manifest, "unreadable"),
        (_no_object, "kernel.o missing"),
    ],
)
def test_bad_entry_is_reported_once_never_loaded_and_rebuilt(fresh_cache, tmp_path, kdef, corrupt, why):
    store = ArtifactCache(str(tmp_path))
    key = jit.CacheKey.make(kdef, "sm_90a", CFG)
    jit.get_kernel("row_rms", "sm_90a", artifact_cache=store, **CFG)
    d = store.entry_dir(key)
    corrupt(d)
    ok, reason, _ = store.check_entry(d, key)
    assert not ok and why in reason
    fresh_cache.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        jit.get_kernel("row_rms", "sm_90a", artifact_cache=store, **CFG)
    msgs = [str(x.message) for x in w if "artifact cache entry" in str(x.message)]
    assert len(msgs) == 1 and why in msgs[0]
    assert fresh_cache.stats.disk_loads == 0 and fresh_cache.stats.compiles == 1  # rebuilt, not loaded
    assert store.check_entry(d, key)[0]  # the rebuilt entry is valid again
    assert not [n for n in os.listdir(os.path.dirname(d)) if n.startswith(".")]  # no temp/trash left


def _writer(root, q):
    import cute_kernels.jit as j
    from cute_kernels.artifact_cache import ArtifactCache as AC

    from cute_kernels.catalog import kernels

    kd = kernels()["row_rms"]
    c = j.compile_now(kd, "sm_100a", CFG)
    q.put(AC(root).put(j.CacheKey.make(kd, "sm_100a", CFG), c.fn))


def test_concurrent_writers_leave_one_valid_entry(tmp_path, kdef):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_writer, args=(str(tmp_path), q)) for _ in range(3)]
    [p.start() for p in ps]
    [p.join(120) for p in ps]
    assert all(p.exitcode == 0 for p in ps)
    wrote = [q.get(timeout=5) for _ in ps]
    assert sum(wrote) >= 1
    store = ArtifactCache(str(tmp_path))
    res = store.verify()
    assert len(res) == 1 and res[0][1], res
    key = jit.CacheKey.make(kdef, "sm_100a", CFG)
    assert store.check_entry(store.entry_dir(key), key)[0]
    assert not [n for n in os.listdir(os.path.dirname(store.entry_dir(key))) if n.startswith(".")]


def test_env_var_sets_default_root(monkeypatch, tmp_path):
    from cute_kernels import artifact_cache as ac

    monkeypatch.setenv(ac.ENV_VAR, str(tmp_path / "x"))
    assert ac.default_cache().root == str(tmp_path / "x")


def test_function_prefix_is_a_c_identifier(kdef):
    p = function_prefix(jit.CacheKey.make(kdef, "sm_90a", CFG))
    assert p.isidentifier() and p.startswith("ck_row_rms_")


# ------------------------------------------------------------------------ CLI ---------
def _cli(*args, cache):
    return subprocess.run([sys.executable, "-m", "cute_kernels", *args, "--cache", cache],
                          capture_output=True, text=True, cwd=REPO, timeout=600)


def test_cli_build_warm_rebuild_list_verify_clear(tmp_path):
    cache = str(tmp_path / "c")
    cold = _cli("build", "--arch", "sm_100a", "--arch", "sm_90a", cache=cache)
    assert cold.returncode == 0, cold.stderr
    n = sum(len(list(jit.iter_aot(catalog.kernels(), arch=a))) for a in ("sm_100a", "sm_90a"))
    assert cold.stdout.count("compiled") == n
    warm = _cli("build", "--arch", "sm_100a", "--arch", "sm_90a", cache=cache)
    assert warm.returncode == 0 and warm.stdout.count("| cached") == n
    assert "compiled" not in warm.stdout  # a warm entry is verified and loaded, never recompiled
    assert _cli("list", cache=cache).stdout.count("| ok") == n
    assert _cli("verify", cache=cache).returncode == 0
    obj = next(os.path.join(r, "kernel.o") for r, _, fs in os.walk(cache) if "kernel.o" in fs)
    open(obj, "ab").write(b"x")
    bad = _cli("verify", cache=cache)
    assert bad.returncode == 1 and "BAD" in bad.stdout
    assert _cli("clear", cache=cache).returncode == 0 and not os.path.exists(cache)


def test_cli_build_wo_a_shape_adds_its_routes(tmp_path):
    """``--wo-a-shape G,R,Dg`` adds every config wo_a() routes to for a model's own shape up to
    ``--max-tokens`` (here: the wgmma decode kernel's two token tiles), filtered by
    ``--kernel``; a malformed shape is refused before anything compiles."""
    from cute_kernels.wo_a import aot_routes

    cache = str(tmp_path / "c")
    base = len([1 for k, _ in jit.iter_aot(catalog.kernels(), ["wo_a_decode_swap_ab"], "sm_90a")])
    extra = [c for n, c in aot_routes("sm_90a", [(8, 512, 1536)], 40) if n == "wo_a_decode_swap_ab"]
    assert len(extra) == 2  # tok_n 8 / 16; the T = 17..40 engine routes are filtered out by --kernel
    r = _cli("build", "--arch", "sm_90a", "--kernel", "wo_a_decode_swap_ab", "--wo-a-shape", "8,512,1536",
             "--max-tokens", "40", cache=cache)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("| compiled") == base + 2 and r.stdout.count('"Dg": 1536') == 2
    for bad, why in (("8,512", "three integers"), ("8,500,1536", "multiples of 64")):
        r = _cli("build", "--arch", "sm_90a", "--wo-a-shape", bad, cache=cache)
        assert r.returncode != 0 and why in r.stderr and "compiled" not in r.stdout


def test_cli_build_tensor_entries_as_tvm_ffi_objects(tmp_path):
    """``build --tensor-entries``: each tensor entry's AOT configs become TVM-FFI objects in the
    cache (kernel.o, no C header; the key's options name TVM-FFI) that load as tvm_ffi
    functions; without the flag none is built; ``--with-runtime`` links them like the plain
    entries; a flipped byte fails ``verify``."""
    pytest.importorskip("tvm_ffi")
    cache = str(tmp_path / "c")
    plain = _cli("build", "--arch", "sm_90a", "--kernel", "row_rms", "--kernel", "row_rms_tensors", cache=cache)
    assert plain.returncode == 0 and plain.stdout.count("| compiled") == 2 and "row_rms_tensors" not in plain.stdout
    r = _cli("build", "--arch", "sm_90a", "--kernel", "row_rms", "--kernel", "row_rms_tensors", "--tensor-entries",
             "--with-runtime", cache=cache)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("| compiled") == 2 and r.stdout.count("| cached") == 2 and "4 linked kernel.so" in r.stdout
    store = ArtifactCache(cache)
    kdef = catalog.kernels()["row_rms_tensors"]
    for cfg in kdef.aot_configs:
        key = jit.CacheKey.make(kdef, "sm_90a", cfg)
        assert jit.TVM_FFI_OPTION in key.options.split()
        entry = store.entry_dir(key)
        assert sorted(os.listdir(entry)) == ["kernel.o", "kernel.so", "manifest.json"]  # no C header
        _, fn = store.load(key)
        assert type(fn).__module__.startswith("tvm_ffi")
    assert _cli("verify", cache=cache).returncode == 0
    open(os.path.join(entry, "kernel.o"), "ab").write(b"x")
    with pytest.warns(RuntimeWarning, match="invalid"):
        assert not store.has_valid(key)
    assert _cli("verify", cache=cache).returncode == 1


def test_exported_entry_loads_without_the_dsl_compiler(tmp_path):
    """An artifact-cache entry called through cute_kernels.exported in a fresh process that never
    imports `cutlass`: kernel.o links against libcute_dsl_runtime.so and its symbols resolve; the
    launcher's argument list is read from kernel.h; with no GPU the first CUDA call reports a
    CUDA error (on a GPU: the kernel runs, tests/test_row_rms.py)."""
    cache = str(tmp_path / "c")
    built = _cli("build", "--arch", "sm_90a", "--kernel", "row_rms", cache=cache)
    assert built.returncode == 0, built.stderr
    entry = next(r for r, _, fs in os.walk(cache) if "kernel.o" in fs)
    code = f"""
import sys
from cute_kernels.exported import ExportedKernel
k = ExportedKernel({entry!r})
k.open()
assert "cutlass" not in sys.modules, "the loader imported the DSL"
print(k.arg_names)
try:
    k.load()
    print("loaded")
except RuntimeError as e:
    print("cuda:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "['x_ptr', 'rstd_ptr', 'num_tokens', 'eps', 'stream']" in r.stdout
    assert os.path.exists(os.path.join(entry, "kernel.so"))
    import torch

    assert ("loaded" in r.stdout) == torch.cuda.is_available()


@pytest.mark.gpu
def test_exported_entry_runs_on_gpu_without_the_dsl(tmp_path):
    """The same entry launched through ctypes on the GPU equals row_rms()'s output."""
    import torch

    from cute_kernels.exported import ExportedKernel
    from cute_kernels.row_rms import row_rms

    cache = str(tmp_path / "c")
    assert _cli("build", "--arch", "sm_90a", "--kernel", "row_rms", cache=cache).returncode == 0
    entry = next(r for r, _, fs in os.walk(cache) if "kernel.o" in fs)
    k = ExportedKernel(entry)
    k.load()
    import json
    C = json.loads(json.load(open(os.path.join(entry, "manifest.json")))["key"]["config"])["hidden"]
    x = torch.randn(5, C, device="cuda").bfloat16()
    out = torch.full((5,), float("nan"), device="cuda")
    assert k(x.data_ptr(), out.data_ptr(), 5, 1e-6, torch.cuda.current_stream().cuda_stream) == 0
    torch.cuda.synchronize()
    assert torch.equal(out, row_rms(x, 1e-6))


# ------------------------------------------------------- runtime-only mode -----------
#: a process without the CuTe DSL: its packages (compiler and runtime library) cannot be found
_NO_DSL = """
import importlib.abc, sys
class _NoDsl(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cutlass", "nvidia_cutlass_dsl"):
            raise ModuleNotFoundError(f"no module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, _NoDsl())
"""


def _without_dsl(code: str, cache: str):
    env = dict(os.environ, CUTE_KERNELS_CACHE_DIR=cache)
    env.pop("CUTE_DSL_RUNTIME_LIB", None)
    return subprocess.run([sys.executable, "-c", _NO_DSL + code], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=env)


def test_runtime_only_mode_serves_the_cache_without_the_dsl(tmp_path):
    """A process that cannot import the DSL (compiler or runtime package): every kernel module
    of the catalogue and the custom ops import (stand-ins, none left in sys.modules, and another
    importer of ``cutlass`` still gets ImportError); get_kernel returns the entry that
    ``build --with-runtime`` wrote -- its launcher linked, the runtime library the cache's own
    copy; a config or an arch the cache lacks raises MissingArtifact naming the build command,
    which then builds exactly that entry (``bundle`` links it); the entry points still validate
    before any launch."""
    cache = str(tmp_path / "c")
    built = _cli("build", "--arch", "sm_90a", "--kernel", "row_rms", "--with-runtime", cache=cache)
    assert built.returncode == 0, built.stderr
    assert "2 linked kernel.so" in built.stdout
    code = """
import sys, torch
from cute_kernels import catalog, jit, runtime_only
from cute_kernels.exported import ExportedKernel
from cute_kernels.row_rms import row_rms
import cute_kernels.ops, moe.ops, comm.ops
assert runtime_only.active()
print("kernels", len(catalog.kernels()))
print("left", sorted(m for m in sys.modules if m.split(".")[0] == "cutlass"))
try:
    import cutlass
    print("third-party: imported")
except ImportError:
    print("third-party: ImportError")
k = jit.get_kernel("row_rms", "sm_90a", hidden=7168, dtype="bfloat16")
assert isinstance(k, ExportedKernel), k
print("args", k.arg_names, "lib", k._runtime_library)
for arch, hidden in (("sm_90a", 512), ("sm_100a", 7168)):
    try:
        jit.get_kernel("row_rms", arch, hidden=hidden, dtype="bfloat16")
    except runtime_only.MissingArtifact as e:
        print("missing:", e)
try:
    row_rms(torch.zeros(3, 100, dtype=torch.bfloat16))
except ValueError as e:
    print("validated:", e)
"""
    r = _without_dsl(code, cache)
    assert r.returncode == 0, r.stderr
    assert f"kernels {len(catalog.kernels())}" in r.stdout
    assert "left []" in r.stdout and "third-party: ImportError" in r.stdout
    assert "'x_ptr', 'rstd_ptr', 'num_tokens', 'eps', 'stream'" in r.stdout
    assert os.path.join(cache, jit.dsl_version(), "lib", "libcute_dsl_runtime.so") in r.stdout
    missing = [line for line in r.stdout.splitlines() if line.startswith("missing:")]
    assert len(missing) == 2 and all("python -m cute_kernels build --arch" in m for m in missing)
    assert "holds row_rms for: sm_90a" in missing[1] and "--arch sm_100a" in missing[1]
    assert "validated: row_rms: x.shape[1]=100" in r.stdout
    # the command the error names builds the missing entry; the next process finds it
    cmd = missing[0].split("Build it where the DSL is installed: ")[1]
    args = cmd.split(" --cache ")[0].split("cute_kernels ")[1]
    import shlex

    assert _cli(*shlex.split(args), cache=cache).returncode == 0
    bundled = _cli("bundle", cache=cache)  # links the new entry (no compiles)
    assert bundled.returncode == 0 and "3 entries linked" in bundled.stdout, bundled.stdout + bundled.stderr
    again = _without_dsl("import cute_kernels.row_rms\nfrom cute_kernels import jit\n"
                         "print(type(jit.get_kernel('row_rms', 'sm_90a', hidden=512)).__name__)", cache)
    assert again.returncode == 0 and "ExportedKernel" in again.stdout, again.stderr


def test_runtime_only_mode_serves_tensor_entries_through_tvm_ffi(tmp_path):
    """Runtime-only mode with apache-tvm-ffi: ``use_tvm_ffi()`` is accepted; the tensor entries
    that ``build --tensor-entries --with-runtime`` wrote load as tvm_ffi functions from their
    linked kernel.so (no DSL in the process), whose C checks refuse a CPU tensor with a
    ValueError before any launch; the pointer launchers stay ctypes; a missing tensor entry
    raises MissingArtifact naming the build command."""
    pytest.importorskip("tvm_ffi")
    cache = str(tmp_path / "c")
    built = _cli("build", "--arch", "sm_90a", "--kernel", "row_rms", "--kernel", "row_rms_tensors",
                 "--tensor-entries", "--with-runtime", cache=cache)
    assert built.returncode == 0 and "4 linked kernel.so" in built.stdout, built.stdout + built.stderr
    code = """
import sys, torch
from cute_kernels import jit, runtime_only
from cute_kernels.exported import ExportedKernel
import cute_kernels.row_rms
assert runtime_only.active()
jit.use_tvm_ffi()
fn = jit.get_tensor_kernel("row_rms_tensors", "sm_90a", hidden=7168, dtype="bfloat16")
print("entry", type(fn).__module__)
assert isinstance(jit.get_kernel("row_rms", "sm_90a", hidden=7168, dtype="bfloat16"), ExportedKernel)
try:
    fn(torch.zeros(2, 7168, dtype=torch.bfloat16), torch.zeros(2), 1e-6)
except ValueError as e:
    print("refused:", e)
try:
    jit.get_tensor_kernel("row_rms_tensors", "sm_90a", hidden=512, dtype="bfloat16")
except runtime_only.MissingArtifact as e:
    print("missing:", e)
print("left", sorted(m for m in sys.modules if m.split(".")[0] == "cutlass"))
"""
    r = _without_dsl(code, cache)
    assert r.returncode == 0, r.stderr
    assert "entry tvm_ffi" in r.stdout and "left []" in r.stdout
    assert "refused:" in r.stdout and "mX" in r.stdout, r.stdout
    assert "missing:" in r.stdout and "--kernel row_rms_tensors" in r.stdout and '"hidden": 512' in r.stdout


def test_runtime_only_mode_refuses_a_tampered_or_empty_cache(tmp_path):
    """A flipped byte in an entry's linked kernel.so makes the entry invalid (MissingArtifact,
    not a load); an empty cache names the build command."""
    cache = str(tmp_path / "c")
    assert _cli("build", "--arch", "sm_90a", "--kernel", "row_rms", "--with-runtime", cache=cache).returncode == 0
    so = next(os.path.join(r, "kernel.so") for r, _, fs in os.walk(cache) if "kernel.so" in fs and "7168" in
              open(os.path.join(r, "manifest.json")).read())
    with open(so, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    code = """
import cute_kernels.row_rms
from cute_kernels import jit, runtime_only
try:
    jit.get_kernel("row_rms", "sm_90a", hidden=7168)
except runtime_only.MissingArtifact as e:
    print("missing:", e)
"""
    r = _without_dsl(code, cache)
    assert r.returncode == 0 and "missing:" in r.stdout, r.stderr
    assert "kernel.so does not match the manifest" in r.stderr  # the warning names the cause
    r = _without_dsl(code, str(tmp_path / "empty"))
    assert r.returncode == 0 and "holds no kernels" in r.stdout and "python -m cute_kernels build" in r.stdout


@pytest.mark.gpu
def test_runtime_only_entry_points_match_the_dsl_path_on_gpu(tmp_path):
    """On a GPU, in a process without the DSL: row_rms() and masked_softmax() through the
    cache's ctypes launchers equal the same calls through the DSL in this process, bit for
    bit (the same machine code); with apache-tvm-ffi, so do row_rms()'s calls through its
    tensor entry (the first validated, the next two through the entry)."""
    import torch

    from cute_kernels.masked_softmax import masked_softmax
    from cute_kernels.row_rms import row_rms

    cache = str(tmp_path / "c")
    for kernel, cfg in (("row_rms", '{"hidden": 7168}'), ("masked_softmax", None)):
        extra = ("--config", cfg) if cfg else ()
        assert _cli("build", "--arch", "sm_90a", "--kernel", kernel, *extra, "--with-runtime",
                    cache=cache).returncode == 0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 7168, generator=g).bfloat16()
    s = torch.randn(3, 128, 592, generator=g).bfloat16()  # its AOT config: 128 heads x 592 keys, mask 608
    m = torch.rand(3, 608, generator=g) > 0.3
    torch.save({"x": x, "s": s, "m": m}, str(tmp_path / "in.pt"))
    code = f"""
import torch
from cute_kernels.row_rms import row_rms
from cute_kernels.masked_softmax import masked_softmax
d = torch.load({str(tmp_path / "in.pt")!r})
out = {{"rms": row_rms(d["x"].cuda(), 1e-6).cpu(), "sm": masked_softmax(d["s"].cuda(), d["m"].cuda()).cpu()}}
torch.save(out, {str(tmp_path / "out.pt")!r})
"""
    r = _without_dsl(code, cache)
    assert r.returncode == 0, r.stderr
    got = torch.load(str(tmp_path / "out.pt"))
    assert torch.equal(got["rms"], row_rms(x.cuda(), 1e-6).cpu())
    assert torch.equal(got["sm"], masked_softmax(s.cuda(), m.cuda()).cpu())
    try:  # the tensor entry through apache-tvm-ffi, still without the DSL: the same bits
        import tvm_ffi  # noqa: F401
    except ImportError:
        return
    assert _cli("build", "--arch", "sm_90a", "--kernel", "row_rms_tensors", "--tensor-entries", "--with-runtime",
                cache=cache).returncode == 0
    code = f"""
import torch
from cute_kernels import jit
from cute_kernels.row_rms import _TENSOR_FNS, row_rms
jit.use_tvm_ffi()
x = torch.load({str(tmp_path / "in.pt")!r})["x"].cuda()
outs = [row_rms(x, 1e-6, out=torch.full((x.shape[0],), float("nan"), device="cuda")) for _ in range(3)]
assert _TENSOR_FNS and type(next(iter(_TENSOR_FNS.values()))).__module__.startswith("tvm_ffi")
torch.save([o.cpu() for o in outs], {str(tmp_path / "out.pt")!r})
"""
    r = _without_dsl(code, cache)
    assert r.returncode == 0, r.stderr
    for got in torch.load(str(tmp_path / "out.pt")):
        assert torch.equal(got, row_rms(x.cuda(), 1e-6).cpu())


# ------------------------------------------------------------ direct launch -----------
def test_c_address_points_at_each_arguments_value():
    """What the compiled function reads for each kind of argument the entry points pass: the
    pointer value, the scalar's bits, the stream handle."""
    import ctypes
    import struct

    import cutlass

    t = __import__("torch").zeros(64)
    p = jit.gmem_ptr(cutlass.Float32, t, 4)
    assert ctypes.c_uint64.from_address(jit.c_address(p)).value == t.data_ptr()
    assert ctypes.c_int32.from_address(jit.c_address(jit.i32(-7))).value == -7
    assert ctypes.string_at(jit.c_address(jit.f32(0.1)), 4) == struct.pack("<f", 0.1)
    assert ctypes.c_uint64.from_address(jit.c_address(jit.cu_stream(0x1234))).value == 0x1234
    assert jit.c_address(p) == jit.c_address(p)  # memoised: stable while the object lives


class _FakeExecutor:
    def __init__(self):
        self.calls = []

    def run_compiled_program(self, addrs):
        import ctypes

        self.calls.append([ctypes.c_int32.from_address(a).value for a in addrs])


class _FakeCompiled:
    """The DSL's compiled-function interface as DirectLaunch uses it; ``lie`` makes its
    execution args disagree with the arguments' values."""

    def __init__(self, lie=False):
        self.lie, self.dsl_calls, self._default_executor = lie, 0, _FakeExecutor()

    def __call__(self, *args):
        self.dsl_calls += 1

    def generate_execution_args(self, *args):
        import ctypes

        vals = [ctypes.c_int32(int(a) + (1 if self.lie else 0)) for a in args]
        self._keep = vals
        return [ctypes.c_void_p(ctypes.addressof(v)) for v in vals], []


def test_direct_launch_takes_the_executor_only_after_checking():
    """The first call per argument-type tuple goes through the DSL; when the DSL's addresses
    hold the same bytes as DirectLaunch's, later calls go straight to the executor with the
    values of *their* arguments; a disagreement keeps every call on the DSL's path, and so
    does DIRECT_LAUNCH = False."""
    from cutlass import Int32

    fn = _FakeCompiled()
    d = jit.DirectLaunch(fn)
    d(Int32(3), Int32(4))
    assert fn.dsl_calls == 1 and fn._default_executor.calls == []
    d(Int32(5), Int32(6))
    assert fn.dsl_calls == 1 and fn._default_executor.calls == [[5, 6]]

    liar = _FakeCompiled(lie=True)
    d = jit.DirectLaunch(liar)
    for v in range(3):
        d(Int32(v))
    assert liar.dsl_calls == 3 and liar._default_executor.calls == []

    fn = _FakeCompiled()
    d = jit.DirectLaunch(fn)
    try:
        jit.DIRECT_LAUNCH = False
        for v in range(3):
            d(Int32(v))
    finally:
        jit.DIRECT_LAUNCH = True
    assert fn.dsl_calls == 3 and fn._default_executor.calls == []


def test_direct_launch_keeps_scalar_values_alive_when_the_memo_clears(monkeypatch):
    """A memo that fills up mid-argument-list drops the owners of earlier scalars' C values;
    the launch must still read every argument's own value (a dangling address would pass
    freed memory -- a garbage size or pointer -- to the kernel)."""
    import ctypes

    from cutlass import Int32

    fn = _FakeCompiled()
    d = jit.DirectLaunch(fn)
    d(Int32(1), Int32(2), Int32(3))  # checked through the DSL

    def run(addrs):  # reuse freed small blocks before reading, as a busy process would
        junk = [ctypes.c_void_p(ctypes.addressof(ctypes.c_int32(-1))) for _ in range(4096)]
        fn._default_executor.calls.append([ctypes.c_int32.from_address(a).value for a in addrs])
        del junk

    monkeypatch.setattr(fn._default_executor, "run_compiled_program", run)
    monkeypatch.setattr(jit, "_ADDR_MAX", 1)  # every new entry clears the memo
    d(Int32(101), Int32(202), Int32(303))
    assert fn._default_executor.calls == [[101, 202, 303]]


def test_get_kernel_wraps_and_forwards_attributes(kdef, fresh_cache, tmp_path):
    """get_kernel's object is a DirectLaunch; the compiled function's own attributes (what the
    SASS tests and the artifact export read) come through it."""
    f = jit.get_kernel("row_rms", "sm_90a", artifact_cache=ArtifactCache(str(tmp_path)), **CFG)
    assert isinstance(f, jit.DirectLaunch)
    assert hasattr(f, "export_to_c") and f.export_to_c == f.fn.export_to_c


# ------------------------------------------------------------ TVM-FFI launches ---------
_TVM_FFI_SCRIPT = """
import sys
import cutlass, pytest, torch
import cute_kernels.row_rms  # registers the kernel
from cute_kernels.artifact_cache import ArtifactCache
from cute_kernels import jit

t = torch.zeros(8)
jit.use_tvm_ffi(True)
fn = jit.get_kernel("row_rms", "sm_90a", hidden=4096, dtype="bfloat16")
assert not isinstance(fn, jit.DirectLaunch) and "TVMFFI" in type(fn).__name__  # compiled in this process
assert type(ArtifactCache(sys.argv[1]).load(  # and exported: the entry loads as a TVM-FFI function
    jit.CacheKey.make(jit.registry()["row_rms"], "sm_90a", dict(hidden=4096, dtype="bfloat16"),
                      f"--gpu-arch=sm_90a {jit.TVM_FFI_OPTION}"))[1]).__module__.startswith("tvm_ffi")
assert jit.gmem_ptr(cutlass.Float32, t, 4) == t.data_ptr()
assert jit.i32(5) == 5 and jit.f32(0.5) == 0.5 and jit.cu_stream(0x1234) == 0x1234
with pytest.raises(TypeError, match="argument #0"):
    fn("x", 0, 1, 1e-6, 0)
if not torch.cuda.is_available():  # the arguments were accepted: the CUDA runtime refuses
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        fn(t.data_ptr(), t.data_ptr(), 1, 1e-6, 0)
jit.use_tvm_ffi(False)
assert isinstance(jit.get_kernel("row_rms", "sm_90a", hidden=4096, dtype="bfloat16"), jit.DirectLaunch)
assert not isinstance(jit.gmem_ptr(cutlass.Float32, t, 4), int)
print("ok")
"""


def test_tvm_ffi_launch_mode_converts_plain_arguments(tmp_path):
    """``jit.use_tvm_ffi()``: kernels compile with the DSL's TVM-FFI calling convention and take
    raw addresses, Python numbers and the stream handle (the argument helpers switch with it);
    a wrong argument type is a TypeError naming the argument before any launch; switching back
    gives DirectLaunch again. Run in a fresh process: without a GPU the DSL builds the
    function's host side only when the target arch is set at start-up (CUTE_DSL_ARCH); the
    call then reaches the CUDA runtime and fails there, which shows the arguments were
    accepted."""
    pytest.importorskip("tvm_ffi")
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["CUTE_DSL_ARCH"] = "sm_90a"
    env["CUTE_KERNELS_CACHE_DIR"] = str(tmp_path)
    res = subprocess.run([sys.executable, "-c", _TVM_FFI_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), (None, False)])
def test_tvm_ffi_mode_from_the_environment(value, on):
    """``CUTE_KERNELS_TVM_FFI=1`` turns the TVM-FFI launches on at import (a serving process
    changes no code); ``0`` or unset leaves the direct launch."""
    pytest.importorskip("tvm_ffi")
    env = {k: v for k, v in os.environ.items() if k != jit.TVM_FFI_ENV}
    if value is not None:
        env[jit.TVM_FFI_ENV] = value
    res = subprocess.run([sys.executable, "-c", "from cute_kernels import jit; print(jit.TVM_FFI)"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == str(on), res.stderr[-2000:]


def test_tvm_ffi_mode_needs_its_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tvm_ffi", None)  # an import of it now fails
    with pytest.raises(ImportError, match="apache-tvm-ffi"):
        jit.use_tvm_ffi(True)
    assert not jit.TVM_FFI
