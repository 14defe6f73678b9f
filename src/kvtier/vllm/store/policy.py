"""What the vLLM prefix store keeps of each offloaded block: :class:`StorePolicy` and its presets.

A policy names the codec a block is stored with when vLLM offloads it (``bits``; ``None`` is
lossless), the codec it is stepped down to when host RAM runs short (``cold_bits``, after the
fixed randomized Hadamard rotation when ``cold_rotation``), and how many tokens at the start of a
sequence stay exact for good (``sink_tokens``, the attention sinks of StreamingLLM,
https://arxiv.org/abs/2309.17453). Leaf module: imports nothing of kvtier and nothing of vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bit widths the k-bit codec packs (``kvtier.quant.pack_bits``); ``None`` stores raw bytes.
ALLOWED_BITS = (2, 3, 4, 6, 8)


@dataclass(frozen=True)
class StorePolicy:
    """How offloaded prefix blocks are stored.

    Attributes
    ----------
    bits : codec of a freshly stored block: k-bit KIVI layout (keys per channel over the block's
        tokens, values per token over ``value_group`` channels), or ``None`` for the exact bytes.
    rotate : rotate K and V by the Hadamard matrix before ``bits``-bit quantization.
    cold_bits : codec a block steps down to, in host RAM, when the byte budget runs short
        (before it leaves RAM); ``None``: no step, blocks go straight to disk or are evicted.
    cold_rotation : rotate before ``cold_bits`` quantization (QuaRot, https://arxiv.org/abs/2404.00456).
    cold_key_group : tokens per key group of the ``cold_bits`` codec.
    sink_tokens : the first tokens of a sequence kept exact (and left out of the statistics of
        the rest of their block); ``0`` for none.
    value_group : channels per value group (capped at the head dim, which it must divide).
    key_group : tokens per key group: keys are quantized per channel over this many tokens
        (capped at vLLM's block size, which it must divide).
    """

    bits: int | None = 4
    rotate: bool = False
    cold_bits: int | None = 3
    cold_rotation: bool = True
    sink_tokens: int = 32
    value_group: int = 64
    key_group: int = 128
    cold_key_group: int = 64

    def __post_init__(self) -> None:
        for name in ("bits", "cold_bits"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value not in ALLOWED_BITS):
                raise ValueError(f"StorePolicy.{name}={value!r} is not allowed: expected None or one of {ALLOWED_BITS}")
        for name in ("rotate", "cold_rotation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StorePolicy.{name}={getattr(self, name)!r} is not allowed: expected True or False")
        if self.bits is None and self.rotate:
            raise ValueError("StorePolicy.rotate=True is not allowed with bits=None: exact blocks are not rotated")
        if self.cold_bits is not None and (self.bits is None or self.cold_bits >= self.bits):
            raise ValueError(
                f"StorePolicy.cold_bits={self.cold_bits} is not allowed with bits={self.bits}: "
                "a step down needs fewer bits than the stored codec"
            )
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or not 0 <= self.sink_tokens:
            raise ValueError(f"StorePolicy.sink_tokens={self.sink_tokens!r} is not allowed: expected an int >= 0")
        if self.sink_tokens > 1 << 20:
            raise ValueError(f"StorePolicy.sink_tokens={self.sink_tokens} is not allowed: expected at most 2**20")
        for name in ("value_group", "key_group", "cold_key_group"):
            g = getattr(self, name)
            if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1) or g > 1 << 16:
                raise ValueError(f"StorePolicy.{name}={g!r} is not allowed: expected a power of two in 1..65536")

    @property
    def levels(self) -> tuple[tuple[int | None, bool, int], ...]:
        """``(bits, rotate, key_group)`` of each RAM level a block passes through, warmest first."""
        first = (self.bits, self.rotate, self.key_group)
        return (
            (first,) if self.cold_bits is None else (first, (self.cold_bits, self.cold_rotation, self.cold_key_group))
        )


#: name -> (policy, one-line description); the README's table says the same.
POLICIES: dict[str, tuple[StorePolicy, str]] = {
    "exact": (StorePolicy(bits=None, cold_bits=None, sink_tokens=0), "lossless: the block's bytes as vLLM holds them"),
    "default": (
        StorePolicy(),
        "32 sink tokens exact, blocks 4-bit (KIVI layout); under RAM pressure the coldest step down to 3-bit "
        "after the Hadamard rotation, then to disk, then out",
    ),
    "chat": (StorePolicy(cold_bits=None), "32 sink tokens exact, blocks 4-bit, no 3-bit step (disk, then out)"),
    "compact": (
        StorePolicy(bits=3, rotate=True, key_group=64, cold_bits=None),
        "32 sink tokens exact, blocks 3-bit after the Hadamard rotation from the start",
    ),
    "code": (StorePolicy(bits=8, cold_bits=4, cold_rotation=False), "conservative: 8-bit, stepping down to 4-bit"),
}


def get_store_policy(policy: str | StorePolicy) -> StorePolicy:
    """A :class:`StorePolicy` from a preset name (see :data:`POLICIES`) or the policy itself."""
    if isinstance(policy, StorePolicy):
        return policy
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown kvtier vLLM store policy {policy!r}: expected one of {sorted(POLICIES)}")
    return POLICIES[policy][0]
