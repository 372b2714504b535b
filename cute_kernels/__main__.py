"""``python -m cute_kernels {build,list,verify,clear}`` -- the deployable artifact cache.

build   AOT-compile every registered kernel (every AOT config) for each ``--arch`` into the
        artifact cache; works without a GPU. Entries already valid are not rebuilt.
        WO-A's AOT configs are every config ``wo_a()`` routes to at T = 1 .. 16384 for its
        supported shapes; ``--wo-a-shape G,R,Dg`` (repeatable) adds a model's own shape at
        T = 1 .. ``--max-tokens``. On a GPU, ``--demo`` then runs each kernel once from the
        cache against PyTorch.
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


def _progress(i: int, n: int, label: str) -> None:
    width = 28
    done = int(width * i / max(n, 1))
    end = "\n" if i == n else ""
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:60]:<60}{end}")
    sys.stderr.flush()


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
    work = [(kdef, cfg, a) for a in archs for kdef, cfg in jit.iter_aot(reg, args.kernel or None, a) if a in kdef.archs]
    if args.wo_a_shape:
        work += _wo_a_work(reg, archs, args.wo_a_shape, args.max_tokens, args.kernel, work)
    rows, failed = [], 0
    t_all = time.perf_counter()
    for i, (kdef, cfg, a) in enumerate(work):
        _progress(i, len(work), f"{kdef.name} {a}")
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
    _progress(len(work), len(work), "done")
    print(_table(rows, ["kernel", "arch", "config", "seconds", "status"]))
    print(f"{len(work)} entries in {time.perf_counter() - t_all:.2f} s -> {store.root}")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cute_kernels", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="AOT-compile all kernels into the artifact cache")
    b.add_argument("--arch", action="append", help="sm_100a, sm_90a, sm_103a (repeatable; default sm_100a + sm_90a)")
    b.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    b.add_argument("--demo", action="store_true", help="on a GPU, run each built kernel once against PyTorch")
    b.add_argument("--wo-a-shape", action="append", metavar="G,R,Dg",
                   help="also every WO-A config wo_a() routes to for this shape (repeatable)")
    b.add_argument("--max-tokens", type=int, default=16384, help="T up to which --wo-a-shape is routed (16384)")
    for name, fn in (("build", cmd_build), ("list", cmd_list), ("verify", cmd_verify), ("clear", cmd_clear)):
        sp = b if name == "build" else sub.add_parser(name)
        sp.add_argument("--cache", default=None, help="artifact cache dir (default $CUTE_KERNELS_CACHE_DIR)")
        sp.set_defaults(fn=fn)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
