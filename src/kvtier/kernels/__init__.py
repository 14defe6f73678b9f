"""Fused kernels for the packed tiers: C++ CPU kernels (sources in ``csrc/``, compiled on first
use by :mod:`kvtier.kernels.build`, with a warning and the torch path as fallback) and, on CUDA,
Triton kernels. Each has the torch functions of :mod:`kvtier.attention.partials` as reference;
the attention backends (:mod:`kvtier.attention.backends`) call them where the attention plan says.

Owns: kernel sources, their build and the Triton wrappers (``dispatch``). May import torch, ``kvtier.quant`` and
``kvtier.codecs`` (codec metadata); never attention, cache state, offload or transformers.
"""
