import os
import warnings

import pytest

from cute_kernels import arch


@pytest.mark.parametrize("s, want", [("sm_90a", "sm_90a"), ("sm90", "sm_90a"), ("90", "sm_90a"),
                                      ("sm_100", "sm_100a"), ("SM_100A", "sm_100a"), ("sm_103a", "sm_103a")])
def test_normalize(s, want):
    assert arch.normalize_arch(s) == want


@pytest.mark.parametrize("s, exc", [("sm_80", ValueError), ("hopper", ValueError), (90, TypeError)])
def test_normalize_rejects(s, exc):
    with pytest.raises(exc):
        arch.normalize_arch(s)


def test_dispatch_paths():
    both = ("sm100", "sm90", "reference")
    assert arch.dispatch("k", both, arch="sm_100a") == "sm100"
    assert arch.dispatch("k", both, arch="sm_103a") == "sm100"
    assert arch.dispatch("k", both, arch="sm_90a") == "sm90"
    assert arch.dispatch("k", ("sm100", "portable"), arch="sm_90a") == "portable"


def test_dispatch_unknown_device_warns_once():
    arch._warned.discard("dispatch:kx")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with arch.override_arch(None):
            for _ in range(3):
                if arch.current_arch() is None:
                    assert arch.dispatch("kx", ("sm100", "reference")) == "reference"
    if arch.current_arch() is None:
        assert len([x for x in w if "kx" in str(x.message)]) == 1


def test_override_is_scoped():
    before = arch.current_arch()
    with arch.override_arch("sm_100a"):
        assert arch.current_arch() == "sm_100a"
        with arch.override_arch("sm_90a"):
            assert arch.current_arch() == "sm_90a"
        assert arch.current_arch() == "sm_100a"
    assert arch.current_arch() == before


def test_no_reference_path_raises():
    with pytest.raises(RuntimeError, match="no kernel"):
        arch.dispatch("ky", ("sm100",), arch="sm_90a")


def test_cuda_profile_keeps_cupti_initialised(monkeypatch):
    """Every profiler session of the benches goes through cute_kernels.profiling, which keeps
    CUPTI initialised between sessions (graphs in the process) unless the environment says
    otherwise."""
    from cute_kernels import profiling

    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.setenv("DISABLE_CUPTI_LAZY_REINIT", "0")  # the user's choice stands
    prof = profiling.cuda_profile(cpu=True)
    assert os.environ["TEARDOWN_CUPTI"] == "0" and os.environ["DISABLE_CUPTI_LAZY_REINIT"] == "0"
    assert prof is not None  # not entered: nothing is profiled on this machine
