"""Source rules for CuTe DSL code that a compile and its machine-code checks cannot catch.

A helper that advances a pipeline state it was passed (``state.advance()``) inside a dynamic
branch or loop must return the state, and every caller must rebind it (``prod = helper(...,
prod, ...)``). The DSL carries a value changed inside a dynamic ``if`` / ``for`` out of it by
the enclosing function's variable names: the caller's object keeps the state from before the
call. The kernel still compiles, and then its main loop issues slices the prologue already
issued -- the two swap-AB WO-A kernels' shared prologue (``wo_a_decode_swap_ab.load_prologue``)
once made both re-load slice 0 and wait on a barrier phase that never came (a GPU hang).
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("cute_kernels", "moe", "comm", "spec_decode")


def _modules():
    for top in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path, encoding="utf-8") as fh:
                        yield os.path.relpath(path, ROOT), ast.parse(fh.read())


def _advanced_params(fn: ast.FunctionDef) -> set[str]:
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    return {n.func.value.id for n in ast.walk(fn)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "advance"
            and isinstance(n.func.value, ast.Name) and n.func.value.id in params}


def _returned_names(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Return) and n.value is not None:
            names |= {m.id for m in ast.walk(n.value) if isinstance(m, ast.Name)}
    return names


def _helpers():
    """(module, function, {param: position}) of every function or method advancing a parameter."""
    for rel, tree in _modules():
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and (adv := _advanced_params(fn)):
                pos = {a.arg: i for i, a in enumerate(fn.args.args)}
                yield rel, fn, {p: pos.get(p) for p in adv}


def _calls_of(rel: str, fn: ast.FunctionDef):
    """(module, call) of every call of helper ``fn`` of module ``rel``: by its name where it is
    defined or imported from there (``from .module import name``), as ``self.name`` in its own
    module (a method)."""
    home = os.path.splitext(os.path.basename(rel))[0]
    for mod, tree in _modules():
        imported = mod == rel or any(
            isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[-1] == home
            and any(a.name == fn.name for a in n.names) for n in ast.walk(tree))
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and (
                    (imported and isinstance(n.func, ast.Name) and n.func.id == fn.name)
                    or (mod == rel and isinstance(n.func, ast.Attribute) and n.func.attr == fn.name
                        and isinstance(n.func.value, ast.Name) and n.func.value.id == "self")):
                yield mod, tree, n


def test_helpers_return_the_states_they_advance():
    helpers = list(_helpers())
    assert helpers, "no helper advances a state any more: drop this rule or point it at the new place"
    for rel, fn, params in helpers:
        missing = set(params) - _returned_names(fn)
        assert not missing, f"{rel}: {fn.name} advances {sorted(missing)} but does not return it"


def test_callers_rebind_the_states_a_helper_advanced():
    calls = 0
    for rel, fn, params in _helpers():
        is_method = fn.args.args and fn.args.args[0].arg == "self"
        for mod, tree, call in _calls_of(rel, fn):
            calls += 1
            bound = set()
            for n in ast.walk(tree):
                if isinstance(n, ast.Assign) and n.value is call:
                    bound = {m.id for t in n.targets for m in ast.walk(t) if isinstance(m, ast.Name)}
            kw = {k.arg: k.value for k in call.keywords}
            for param, i in params.items():
                i = None if i is None else i - bool(is_method)
                arg = kw.get(param, call.args[i] if i is not None and i < len(call.args) else None)
                assert isinstance(arg, ast.Name) and arg.id in bound, (
                    f"{mod}:{call.lineno}: {fn.name}(...) advances its {param!r}: rebind it "
                    f"({getattr(arg, 'id', param)} = {fn.name}(...))")
    assert calls >= 2  # both swap-AB WO-A kernels
