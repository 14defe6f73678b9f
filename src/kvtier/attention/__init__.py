"""Attention over the tiers: the function and mask function registered with transformers."""

from .interface import disable, enable, kvtier_attention, register
from .mask import KVMask, kvtier_mask

__all__ = ["KVMask", "disable", "enable", "kvtier_attention", "kvtier_mask", "register"]
