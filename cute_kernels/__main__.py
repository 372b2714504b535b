"""Build and manage the artifact cache of compiled kernels: ``python -m cute_kernels {build,bundle,list,verify,clear}``.

build   AOT-compile every kernel of :mod:`cute_kernels.catalog` (every AOT config) for each
        ``--arch`` into the artifact cache; works without a GPU. Entries already valid are
        kept. ``--kernel NAME --config JSON`` builds one config; ``--with-runtime`` makes the
        cache a deployment that runs without the DSL compiler (the runtime library copied in,
        every entry linked: :mod:`cute_kernels.runtime_only`); ``--tensor-entries`` adds the
        TVM-FFI tensor entries (:func:`cute_kernels.jit.get_tensor_kernel`). WO-A's AOT configs are every config its default route takes at T = 1 .. 16384
        for the supported shapes; ``--wo-a-shape G,R,Dg`` (repeatable) adds a model's own
        shape at T = 1 .. ``--max-tokens``. ``--demo`` then, on a GPU, runs kernels from the
        cache against PyTorch and a few steps of the decode runtime (:mod:`cute_kernels.demo`).
bundle  make the cache a deployment without the DSL compiler: the runtime library copied in,
        every entry linked (what ``build --with-runtime`` adds; no compiles). Every kernel a
        workload compiled while run with the DSL installed is already an entry.
list    one line per entry: kernel, arch, config, size, status.
verify  re-hash every entry; exit status 1 if any is invalid.
clear   delete the cache directory.

The cache directory: ``--cache DIR``, else ``$CUTE_KERNELS_CACHE_DIR``, else
``~/.cache/cute_kernels``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .progress import progress


def _table(rows: list[list[str]], header: list[str]) -> str:
    cols = list(zip(header, *rows)) if rows else [(h,) for h in header]
    widths = [max(len(str(c)) for c in col) for col in cols]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def cmd_build(args) -> int:
    from . import catalog, jit
    from .arch import normalize_arch
    from .artifact_cache import ArtifactCache

    archs = [normalize_arch(a) for a in (args.arch or ["sm_100a", "sm_90a"])]
    reg = catalog.kernels()
    store = ArtifactCache(args.cache)
    if args.config is not None:
        if not args.kernel or len(args.kernel) != 1:
            raise SystemExit("--config needs exactly one --kernel")
        try:
            cfg = json.loads(args.config)
        except ValueError as e:
            raise SystemExit(f"--config {args.config!r}: not JSON ({e})")
        if not isinstance(cfg, dict):
            raise SystemExit(f"--config {args.config!r}: expected a JSON object of the kernel's config")
        if args.kernel[0] not in reg:
            raise SystemExit(f"--kernel {args.kernel[0]!r}: unknown (known: {', '.join(sorted(reg))})")
        work = [(reg[args.kernel[0]], cfg, a) for a in archs if a in reg[args.kernel[0]].archs]
    else:
        work = [(kdef, cfg, a) for a in archs
                for kdef, cfg in jit.iter_aot(reg, args.kernel or None, a, tensor_entries=args.tensor_entries)
                if a in kdef.archs]
    if args.wo_a_shape:
        work += _wo_a_work(reg, archs, args.wo_a_shape, args.max_tokens, args.kernel, work)
    rows, failed = [], 0
    t_all = time.perf_counter()
    for i, (kdef, cfg, a) in enumerate(work):
        progress(i, len(work), f"{kdef.name} {a}")
        key = jit.CacheKey.make(kdef, a, cfg)
        t0 = time.perf_counter()
        if store.has_valid(key):
            status = "cached"
        else:
            try:
                compiled = jit.compile_now(kdef, a, cfg, options=key.options)
                store.put(key, compiled.fn)
                status = "compiled"
            except Exception as e:  # report and keep building the rest
                status = f"FAILED: {str(e).splitlines()[0][:80] if str(e) else type(e).__name__}"
                failed += 1
        rows.append([kdef.name, a, json.dumps(cfg, sort_keys=True), f"{time.perf_counter() - t0:.3f}", status])
    progress(len(work), len(work), "done")
    print(_table(rows, ["kernel", "arch", "config", "seconds", "status"]))
    print(f"{len(work)} entries in {time.perf_counter() - t_all:.2f} s -> {store.root}")
    if args.with_runtime:
        lib, linked = store.bundle_runtime(jit.dsl_version())
        print(f"runtime-only deployment: {lib} and {linked} linked kernel.so (load them without the DSL compiler: "
              f"cute_kernels.runtime_only)")
    if args.demo:
        from .demo import run_demo

        run_demo(store)
    return 1 if failed else 0


def _wo_a_work(reg, archs, shapes, max_tokens, kernels, work):
    """Build items for every config wo_a() routes to at T = 1 .. max_tokens of ``shapes``
    (each "G,R,Dg") not already in ``work``."""
    from . import jit
    from .wo_a import aot_routes
    from .wo_a_sm90 import WoASm90

    parsed = []
    for text in shapes:
        try:
            G, R, Dg = (int(v) for v in text.split(","))
        except ValueError:
            raise SystemExit(f"--wo-a-shape {text!r}: expected three integers G,R,Dg (e.g. 8,512,2048)")
        if R < 64 or Dg < 64 or not WoASm90.can_implement(G, R, Dg):  # the Blackwell engine's rule is the same
            raise SystemExit(f"--wo-a-shape {text!r}: WO-A needs G >= 1 and R, Dg positive multiples of 64")
        parsed.append((G, R, Dg))
    if max_tokens < 1:
        raise SystemExit(f"--max-tokens {max_tokens}: must be >= 1")
    have = {(k.name, json.dumps(c, sort_keys=True), a) for k, c, a in work}
    extra = []
    for a in archs:
        for name, cfg in aot_routes(a, parsed, max_tokens):
            kdef = reg[name]
            item = (name, json.dumps(cfg, sort_keys=True), a)
            if a in kdef.archs and item not in have and (not kernels or name in kernels):
                have.add(item)
                extra.append((kdef, cfg, a))
    return extra


def cmd_bundle(args) -> int:
    from . import jit
    from .artifact_cache import ArtifactCache

    store = ArtifactCache(args.cache)
    lib, linked = store.bundle_runtime(jit.dsl_version())
    print(f"{store.root}: runtime library {lib}, {linked} entries linked -- a deployment without the DSL compiler "
          f"(cute_kernels.runtime_only)")
    return 0


def cmd_list(args) -> int:
    from .artifact_cache import ArtifactCache

    store = ArtifactCache(args.cache)
    rows = []
    for path in store.entries():
        ok, why, man = store.check_entry(path)
        key = (man or {}).get("key", {})
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        rows.append([key.get("kernel", "?"), key.get("arch", "?"), key.get("config", "?"), f"{size / 1024:.1f} KiB",
                     "ok" if ok else why])
    print(_table(rows, ["kernel", "arch", "config", "size", "status"]))
    print(f"{len(rows)} entries in {store.root}")
    return 0


def cmd_verify(args) -> int:
    from .artifact_cache import ArtifactCache

    store = ArtifactCache(args.cache)
    res = store.verify()
    for path, ok, why in res:
        print(f"{'ok  ' if ok else 'BAD '} {os.path.relpath(path, store.root)}  {'' if ok else why}")
    bad = sum(not ok for _, ok, _ in res)
    print(f"{len(res)} entries, {bad} invalid")
    return 1 if bad else 0


def cmd_clear(args) -> int:
    from .artifact_cache import ArtifactCache

    store = ArtifactCache(args.cache)
    n = store.clear()
    print(f"removed {n} entries from {store.root}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line (every subcommand and option with its help and default)."""
    p = argparse.ArgumentParser(prog="python -m cute_kernels", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{build,bundle,list,verify,clear}")
    b = sub.add_parser("build", help="AOT-compile every kernel into the artifact cache (no GPU needed)",
                       description="AOT-compile every registered kernel's ahead-of-time configs into the "
                                   "artifact cache; entries already valid are kept.")
    b.add_argument("--arch", action="append", metavar="ARCH",
                   help="sm_100a, sm_103a or sm_90a; repeatable (default: sm_100a and sm_90a)")
    b.add_argument("--kernel", action="append", metavar="NAME",
                   help="only this kernel; repeatable (default: every kernel of cute_kernels.catalog)")
    b.add_argument("--demo", action="store_true",
                   help="afterwards, on a GPU: run kernels from the cache against PyTorch and a few decode steps "
                        "of the runtime (default: off)")
    b.add_argument("--wo-a-shape", action="append", metavar="G,R,Dg",
                   help="also every WO-A config the default route takes for this shape; repeatable (default: the "
                        "supported shapes only)")
    b.add_argument("--max-tokens", type=int, default=16384, metavar="T",
                   help="T up to which --wo-a-shape is routed (default: %(default)s)")
    b.add_argument("--config", default=None, metavar="JSON",
                   help="build this one config of the one --kernel instead of its AOT configs (what a runtime-only "
                        "deployment's MissingArtifact error names; default: the AOT configs)")
    b.add_argument("--tensor-entries", action="store_true",
                   help="also the tensor entries' AOT configs (TVM-FFI functions taking torch tensors, for "
                        "cute_kernels.jit.use_tvm_ffi; needs apache-tvm-ffi; default: off)")
    b.add_argument("--with-runtime", action="store_true",
                   help="also copy the DSL's runtime library into the cache and link every entry, for a deployment "
                        "without the DSL compiler (cute_kernels.runtime_only; default: off)")
    helps = {"bundle": "copy the DSL's runtime library into the cache and link every entry (no compiles): the "
                       "cache then runs without the DSL compiler",
             "list": "one line per cache entry: kernel, arch, config, size, status",
             "verify": "re-hash every cache entry; exit status 1 if any is invalid",
             "clear": "delete the cache directory"}
    for name, fn in (("build", cmd_build), ("bundle", cmd_bundle), ("list", cmd_list), ("verify", cmd_verify),
                     ("clear", cmd_clear)):
        sp = b if name == "build" else sub.add_parser(name, help=helps[name], description=helps[name])
        sp.add_argument("--cache", default=None, metavar="DIR",
                        help="artifact cache directory (default: $CUTE_KERNELS_CACHE_DIR, else ~/.cache/cute_kernels)")
        sp.set_defaults(fn=fn)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
