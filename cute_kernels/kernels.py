"""Imports every kernel module so that each registers itself with :mod:`cute_kernels.jit`.

Add a line here for each new kernel; the AOT build (``python -m cute_kernels build``) and
the machine-code tests iterate over the registry.
"""

from . import row_rms, masked_softmax  # noqa: F401
from moe import quant  # noqa: F401,E402
from moe import router  # noqa: F401,E402
from . import wo_a, wo_a_decode, wo_a_decode_sm90, wo_a_decode_fp8, draft_head_fp8  # noqa: F401,E402
from moe import finalize  # noqa: F401,E402
from comm import push_allreduce  # noqa: F401,E402
from . import mhc_stats, mhc_pre_mix, mhc_post_mix  # noqa: F401,E402
from . import indexer_scores, indexer_scores_fp8, indexer_scores_sm90, indexer_scores_sm90_group, indexer_scores_sm100, indexer_topk  # noqa: F401,E402,E501
from moe import experts_sm100, experts_sm90, experts_sm90_decode  # noqa: F401,E402
