"""Block codecs, the bottom of kvtier's layers: how a tier encodes whole blocks of keys and values.

Owns each block format's layout and constants: :mod:`.base` (the codec interface, the affine rule
``x = a * code + b`` and :data:`~.base.AFFINE_MODES`, the parameter range check), one module per
codec (:mod:`.kbit`, :mod:`.sign`, :mod:`.mixed`, :mod:`.fp8`, :mod:`.vq` (vector codes and their
shipped codebooks), and the vLLM page format
:mod:`.pages`: layout, encode, decode), :mod:`.registry` (what a policy
stores: :func:`~.registry.make_codecs`, the exact dtype, the value group) and :mod:`.constants` (the
constants C++ reads, written into the generated ``codec_constants.h`` when a kernel is built; no
kernel source restates them). Kernels (C++, Triton), tiers, the offload store, attention and the
vLLM adapter read these formats from here.

May import (lower layers only): torch, ``kvtier.quant``, ``kvtier.policy`` and the leaf modules
(``kvtier.errors``, ``kvtier.stats``); never ``kvtier.kernels``, ``kvtier.offload``, ``kvtier.cache``,
``kvtier.attention``, the adapters or transformers.
"""

from .base import AFFINE_MODES, AffineCodec, affine_ab, check_params
from .fp8 import FP8, FP8_MAX, FP8_SCALE_MIN, Fp8Codec, dequantize_fp8, quantize_fp8
from .kbit import KBitCodec
from .mixed import META_DTYPES, MixedCodec
from .registry import Codec, make_codecs, storage_dtype, value_group
from .sign import SignCodec
from .vq import VqCodec

__all__ = [
    "AFFINE_MODES",
    "FP8",
    "FP8_MAX",
    "FP8_SCALE_MIN",
    "META_DTYPES",
    "AffineCodec",
    "Codec",
    "Fp8Codec",
    "KBitCodec",
    "MixedCodec",
    "SignCodec",
    "VqCodec",
    "affine_ab",
    "check_params",
    "dequantize_fp8",
    "make_codecs",
    "quantize_fp8",
    "storage_dtype",
    "value_group",
]
