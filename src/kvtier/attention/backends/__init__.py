"""Attention backends: one small interface (:class:`~.base.Backend`), one file per backend.

Owns the code that turns query rows and one segment of a layer (an exact segment: sinks or hot
tokens; or a packed tier) into a :class:`~kvtier.attention.partials.Partial`, and the one
:class:`~.base.Selection` type every backend reads. Which backend runs which segment is decided
once per forward step by :class:`kvtier.attention.plan.AttentionPlan`, never here: a backend reads
no threshold, no query length and no availability probe of another backend.

* :mod:`.torch` - plain torch ops (bit-plane partials for few rows, chunk-wise decoding + GEMMs or
  flash attention for many rows); every device, every codec; the reference the others match.
* :mod:`.cpu` - the C++ kernels: per packed tier (:mod:`kvtier.kernels.cpu`) and one fused call
  for a whole layer (:mod:`kvtier.kernels.fused_cpu`).
* :mod:`.triton` - the Triton kernels (:mod:`kvtier.kernels.dispatch`), CUDA or Triton's CPU
  interpreter; imported only when the plan picks it, so CPU use never imports Triton.

May import: torch, ``kvtier.attention.partials`` / ``.sparse``, ``kvtier.codecs``,
``kvtier.kernels``, ``kvtier.quant``, ``kvtier.indexing``. Never ``kvtier.attention.plan``,
``.tiered`` or ``kvtier.hf``.
"""

from .base import Backend, Selection

__all__ = ["Backend", "Selection"]
