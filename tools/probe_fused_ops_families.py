"""Op families of FusedOps and a baseline Ops with chosen families swapped for the fused ones (probes)."""
from spec_decode.step_model import Ops

FAMILIES = {"mhc": ("mhc_mappings", "pre_mix", "post_mix"), "indexer": ("indexer_topk",), "wo_a": ("wo_a",),
            "moe": ("moe",)}


def hybrid(fused, fams):
    class H(Ops):
        pass
    h = H()
    for f in fams:
        for name in FAMILIES[f]:
            setattr(h, name, getattr(fused, name))
    return h
