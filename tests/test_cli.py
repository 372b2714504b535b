"""The command-line tools: help text, progress output, clear errors (CPU)."""

import argparse
import io
import subprocess
import sys

import pytest
import torch


def _actions(p: argparse.ArgumentParser):
    """Every option of ``p`` and of its subcommands, with the parser it belongs to."""
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _actions(sub)
        elif not isinstance(a, argparse._HelpAction):
            yield p.prog, a


@pytest.mark.parametrize("module", ["cute_kernels.__main__", "spec_decode.__main__", "spec_decode.bench"])
def test_every_option_has_help_with_its_default(module):
    """A reader of ``--help`` learns each option's meaning and default."""
    import importlib

    p = importlib.import_module(module).parser()
    for prog, a in _actions(p):
        assert a.help, (prog, a.option_strings)
        assert "default" in a.help, (prog, a.option_strings, a.help)


def test_subcommands_have_help():
    from cute_kernels.__main__ import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"build", "bundle", "list", "verify", "clear"}
    assert all(c.help for c in sub._choices_actions)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_only_on_a_terminal():
    """A terminal gets one line redrawn in place; a log one line per step, none for the end."""
    from cute_kernels.progress import progress

    log = io.StringIO()
    for i in range(3):
        progress(i, 3, f"step {i}", log)
    progress(3, 3, "done", log)
    assert log.getvalue() == "[1/3] step 0\n[2/3] step 1\n[3/3] step 2\n"
    tty = _Tty()
    for i in range(3):
        progress(i, 3, f"step {i}", tty)
    progress(3, 3, "done", tty)
    out = tty.getvalue()
    assert out.count("\r") == 4 and out.count("\n") == 1 and out.endswith("\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_spec_decode_cuda_without_cuda_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "spec_decode", "run", "--device", "cuda"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "spec_decode", "run", "--backend", "fused"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--device cuda" in r.stderr


def test_device_script_gpu_shards_cover_every_gpu_test_file():
    """``tools/device.sh gpu-tests 1..4`` together run every test file that has GPU tests, each
    once (a file left out of the shards would never run in the split GPU suite)."""
    import glob
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = open(os.path.join(root, "tools", "device.sh")).read()
    shards = [s.split() for s in re.findall(r'^\s*\d\) files="([^"]+)"', script, re.MULTILINE)]
    listed = [f for s in shards for f in s]
    assert len(shards) == 4 and len(listed) == len(set(listed))
    gpu = {os.path.relpath(f, root) for f in glob.glob(os.path.join(root, "tests", "test_*.py"))
           if re.search(r"^(@pytest\.mark\.gpu|pytestmark = .*gpu)", open(f).read(), re.MULTILINE)}
    assert gpu <= set(listed), sorted(gpu - set(listed))
    assert all(os.path.exists(os.path.join(root, f)) for f in listed)


def test_bench_cases_option():
    """``spec_decode.bench --cases``: BATCHxINPUTxOUTPUT specs become the run's cases; a
    malformed or non-positive one is a usage error naming the option, before any GPU work."""
    from spec_decode.bench import parser, run_cases

    ap = parser()
    got = run_cases(ap, ap.parse_args(["--cases", "1x4096x1024, 64X1024x512"]))
    assert got == [("BS1 in 4096 / out 1024", 1, 4096, 1024), ("BS64 in 1024 / out 512", 64, 1024, 512)]
    assert [c[1:] for c in run_cases(ap, ap.parse_args([]))] == [(1, 4096, 1024), (64, 4096, 2048)]
    for bad in ("1x4096", "0x16x16", "axbxc"):
        err = io.StringIO()
        with pytest.raises(SystemExit), __import__("contextlib").redirect_stderr(err):
            run_cases(ap, ap.parse_args(["--cases", bad]))
        assert "--cases" in err.getvalue()


@pytest.mark.parametrize("stop", ["watchdog", "sigterm"])
def test_gpu_test_watchdog_names_a_hung_test(tmp_path, stop):
    """``tests/conftest.py``'s hang reports: a GPU test still running its limit past its
    compiles ends the run with status 3, and SIGTERM (a job's ``timeout``) during a GPU test
    with status 124, each after every thread's stack, the test's own frame among them. Run in a
    child pytest that loads the conftest as a plugin with the GPU flag set (no GPU needed: the
    test only sleeps) and a limit of 1 s, or none and a SIGTERM once the test has started."""
    import os
    import signal
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    limit = 1.0 if stop == "watchdog" else 0.0
    (tmp_path / "test_sleeps.py").write_text(
        "import pathlib, time, pytest\n\n@pytest.mark.gpu\ndef test_sleeps():\n"
        "    pathlib.Path('started').touch()\n    time.sleep(30)\n")
    (tmp_path / "as_if_gpu.py").write_text(
        "import pytest\n\n@pytest.hookimpl(tryfirst=True)\ndef pytest_collection_modifyitems(config, items):\n"
        f"    import conftest\n    conftest.HAS_CUDA, conftest.GPU_TEST_TIMEOUT_S = True, {limit}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.join(root, "tests"), root,
                                                        os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-p",
                          "as_if_gpu", "-W", "ignore::pytest.PytestUnknownMarkWarning",
                          str(tmp_path / "test_sleeps.py")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    if stop == "sigterm":
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    want = {"watchdog": (3, "still running"), "sigterm": (124, "stopped by SIGTERM")}[stop]
    assert p.returncode == want[0], (p.returncode, out[-2000:], err[-2000:])
    assert f"test_sleeps.py::test_sleeps: {want[1]}" in err and "in test_sleeps" in err
