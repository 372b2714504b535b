"""sm_103a (B300): every kernel that declares it compiles for it, with no local memory -- the
arch is claimed in the kernels' definitions and in the AOT build, so CI compiles it."""

import pytest

from cute_kernels import catalog, jit
from cute_kernels.testing import sass

DECLARED = sorted(name for name, k in catalog.kernels().items() if "sm_103a" in k.archs)


def test_some_kernels_declare_sm103a():
    assert len(DECLARED) >= 10


@pytest.mark.parametrize("name", DECLARED)
def test_first_aot_config_compiles_for_sm103a(name):
    k = catalog.kernels()[name]
    items = list(jit.iter_aot({name: k}, arch="sm_103a"))
    if items:
        _, cfg = items[0]
    else:  # its configurations come from the op above it (wo_a's router picks the decode kernel's)
        from cute_kernels.wo_a import route

        assert name == "wo_a_decode", f"{name} declares sm_103a but has no configuration for it"
        routed, cfg = route(5, 8, 1024, 4096, "sm_103a", decode_kernel="mma")
        assert routed == name
    h = sass.sass_histogram(name, "sm_103a", **cfg)
    assert sum(h.values()) > 0 and sass.local_memory_ops(h) == 0
