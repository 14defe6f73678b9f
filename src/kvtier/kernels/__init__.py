"""Fused kernels for the packed tiers: a C++ CPU kernel (compiled on first use) and, on CUDA,
Triton kernels. Each has the torch functions of :mod:`kvtier.attention.partials` as reference."""
