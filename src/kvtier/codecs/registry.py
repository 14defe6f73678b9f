"""What a policy stores: the exact tokens' dtype, the value group, and the warm and cold tiers' codecs.

:data:`Codec` is the union of the block codecs; :func:`make_codecs` is the one place that maps a
:class:`~kvtier.policy.TierPolicy` to codecs (a new codec joins here). May import: torch,
``kvtier.policy`` and the codec modules of this package.
"""

from __future__ import annotations

import torch

from ..policy import TierPolicy
from .fp8 import Fp8Codec
from .kbit import KBitCodec
from .mixed import MixedCodec
from .sign import SignCodec
from .vq import VqCodec

Codec = KBitCodec | SignCodec | Fp8Codec | MixedCodec | VqCodec


_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def storage_dtype(policy: TierPolicy, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype sinks and hot tokens are stored in."""
    if policy.exact_dtype == "model":
        return model_dtype
    if policy.exact_dtype == "half":
        return torch.float16 if model_dtype == torch.float32 else model_dtype
    return _DTYPES[policy.exact_dtype]


def value_group(policy: TierPolicy, head_dim: int) -> int:
    """Channels per value group of a layer: the largest divisor of ``head_dim`` that is at most
    ``policy.value_group_size`` (64 gives 40 at head_dim 80, 48 at 96, 56 at 112, 64 at 128).

    The one place a layer's value group is computed: codecs, kernel operands, the planner and the
    byte counts all read it from here, so any head dim works with any group size."""
    cap = min(policy.value_group_size, head_dim)
    return next(g for g in range(cap, 0, -1) if head_dim % g == 0)


def _group_codec(bits: int | str, group: int, rotate: bool = False) -> Codec:
    """The codec of a ``warm_bits`` / ``cold_bits`` value: ``"fp8"`` or a k-bit width."""
    return Fp8Codec(group, rotate=rotate) if bits == "fp8" else KBitCodec(bits, group, rotate=rotate)


def make_codecs(policy: TierPolicy, head_dim: int) -> tuple[Codec, Codec | None]:
    """Warm and cold codecs of a policy (cold is None when evicted). An adaptive policy's warm tier
    is coded like its cold tier (rotation, ``cold_meta`` parameters, clipped grids) at ``warm_bits``:
    on SmolLM2 a rotated 3-bit warm window with fp8 parameters (3.27 bits per element) costs less
    perplexity per byte than the unrotated 4-bit one with fp16 scales (4.5 bits)."""
    g = value_group(policy, head_dim)
    if policy.adaptive is not None and isinstance(policy.warm_bits, int):
        warm = MixedCodec(policy.warm_bits, policy.warm_bits, g, rotate=policy.cold_rotation, meta=policy.cold_meta)
    else:
        warm = _group_codec(policy.warm_bits, g)
    if policy.cold in ("evict", "offload"):  # offload: resident sketches, see kvtier.offload.tier
        return warm, None
    if policy.cold == "sign":
        return warm, SignCodec(g, rotate=policy.cold_rotation)
    vb = policy.cold_bits if policy.cold_value_bits is None else policy.cold_value_bits
    if policy.cold_codes == "vq":
        cold = VqCodec(policy.cold_bits, vb, g)
        cold.check_dim(head_dim)
        return warm, cold
    if policy.cold_value_bits is not None or policy.cold_meta != "fp16":
        return warm, MixedCodec(policy.cold_bits, vb, g, rotate=policy.cold_rotation, meta=policy.cold_meta)
    return warm, _group_codec(policy.cold_bits, g, rotate=policy.cold_rotation)
