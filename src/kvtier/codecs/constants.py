"""The numeric constants of the block formats that the C++ kernels read, and the header they read them from.

Each constant has one definition in Python (named beside it below); C++ never restates it: the
kernels ``#include "codec_constants.h"``, a header that :func:`header` writes from these values when a
kernel is built (:func:`kvtier.kernels.build.source` puts its text in place of the include line, and
its hash is part of the built module's name). ``tests/test_kernel_sources.py`` fails on a literal
copy of any of these values in the C++ or Triton sources. Triton kernels take them as arguments.

May import: ``kvtier.quant`` and the codec modules of this package.
"""

from __future__ import annotations

import struct

from ..quant.groups import SCALE_EPS, SCALE_ROUND, ZERO_MAX
from .fp8 import FP8_MAX, FP8_SCALE_MIN

#: The header's name in ``#include "..."`` lines of ``kernels/csrc`` (no file of that name exists).
HEADER = "codec_constants.h"

#: C++ name -> (value, the Python name that owns it): what the kernels read.
KERNEL_CONSTANTS: dict[str, tuple[float, str]] = {
    "kScaleEps": (SCALE_EPS, "kvtier.quant.groups.SCALE_EPS"),
    "kZeroMax": (ZERO_MAX, "kvtier.quant.groups.ZERO_MAX"),
    "kScaleRound": (SCALE_ROUND, "kvtier.quant.groups.SCALE_ROUND"),
}

#: Every codec constant no kernel source may spell as a literal (those the kernels read, and the
#: format constants they do not read today).
CODEC_CONSTANTS: dict[str, float] = {
    **{owner: value for value, owner in KERNEL_CONSTANTS.values()},
    "kvtier.codecs.fp8.FP8_MAX": FP8_MAX,
    "kvtier.codecs.fp8.FP8_SCALE_MIN": FP8_SCALE_MIN,
}


def _float_literal(value: float) -> str:
    """``value`` as an exact C++ hex float literal of type float (refused if fp32 cannot hold it)."""
    if struct.unpack("f", struct.pack("f", value))[0] != value:
        raise ValueError(f"{value!r} is not exactly an fp32 value")
    return f"{float(value).hex()}f"


def header() -> str:
    """The text of ``codec_constants.h``: one ``constexpr float`` per :data:`KERNEL_CONSTANTS` entry."""
    lines = [
        "// codec_constants.h: written by kvtier.codecs.constants.header() when a kernel is built; not a file,",
        "// not to be copied. The codec constants the kernels read, each owned by the Python name beside it.",
        "#ifndef KVTIER_CODEC_CONSTANTS_H_",
        "#define KVTIER_CODEC_CONSTANTS_H_",
        "namespace kvtier_codec {",
    ]
    for name, (value, owner) in KERNEL_CONSTANTS.items():
        lines.append(f"constexpr float {name} = {_float_literal(value)};  // {owner} = {value!r}")
    lines += ["}  // namespace kvtier_codec", "#endif  // KVTIER_CODEC_CONSTANTS_H_", ""]
    return "\n".join(lines)
