"""torch's functional collectives under the names this torch has.

torch 2.13 renamed ``all_gather_tensor`` / ``reduce_scatter_tensor`` / ``all_gather_tensor_autograd``
to ``*_single*`` (same signatures); the old names still work but warn at every call site, once per
rank (64 lines in a 16-rank expert-TP run). Older torch (the GPU machine's 2.11) may have only the
old names, so each is looked up once here.
"""

from __future__ import annotations

from torch.distributed import _functional_collectives as funcol

all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
