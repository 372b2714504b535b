"""Where does eager host time go? Compiled vs artifact-loaded function, cProfile top entries."""
import cProfile, pstats, io, time, os, tempfile, torch
from cutlass import Float32, Int32
from cute_kernels import jit
from cute_kernels.artifact_cache import ArtifactCache
import cutlass

x = torch.randn(64, 7168, device="cuda").bfloat16(); out = torch.empty(64, device="cuda")
store = ArtifactCache(tempfile.mkdtemp())
fn_c = jit.get_kernel("row_rms", "sm_90a", artifact_cache=store, hidden=7168, dtype="bfloat16")
jit.CACHE.clear()
fn_l = jit.get_kernel("row_rms", "sm_90a", artifact_cache=store, hidden=7168, dtype="bfloat16")
assert jit.CACHE.stats.disk_loads == 1
px, po, st = jit.gmem_ptr(cutlass.BFloat16, x), jit.gmem_ptr(Float32, out, 4), jit.cu_stream()
T, e = Int32(64), Float32(1e-6)
for name, fn in [("compiled", fn_c), ("loaded", fn_l)]:
    for args_name, mk in [("prebuilt DSL scalars", lambda: (px, po, T, e, st)), ("python scalars", lambda: (px, po, 64, 1e-6, st))]:
        try:
            fn(*mk()); torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(1000): fn(*mk())
            torch.cuda.synchronize()
            print(f"{name:9s} {args_name:22s} {(time.perf_counter()-t0)*1e3:.1f} us/call")
        except Exception as ex:
            print(name, args_name, "ERR", str(ex)[:200])
pr = cProfile.Profile(); pr.enable()
for _ in range(300): fn_l(px, po, T, e, st)
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(25); print(s.getvalue()[:6000])
print(type(fn_c), type(fn_l))
