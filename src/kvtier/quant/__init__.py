"""Pure quantization functions: bit packing, k-bit group codes, 1-bit signs, rotations.

Owns the tensor math every codec and kernel shares (:mod:`.bits`, :mod:`.groups`,
:mod:`.rotation`): pure functions of tensors, no state. May import: torch only; nothing else of
kvtier (a leaf package).
"""

from .bits import pack_bits, pack_words, packed_size, planes, unpack_bits, unpack_words
from .groups import dequantize_kbit, dequantize_sign, quantize_ab, quantize_kbit, quantize_sign
from .rotation import rotation

__all__ = [
    "pack_bits",
    "pack_words",
    "packed_size",
    "planes",
    "unpack_bits",
    "unpack_words",
    "quantize_kbit",
    "quantize_ab",
    "dequantize_kbit",
    "quantize_sign",
    "dequantize_sign",
    "rotation",
]
