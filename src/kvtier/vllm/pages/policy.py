"""Packed KV pages for vLLM's block pool: :class:`PagePolicy` (what an engine stores and how it
attends), its presets and backend names.

The page format itself (byte layout, encode, decode) is :class:`kvtier.codecs.pages.PageFormat`,
built from a :class:`PagePolicy`. Pure Python: imports nothing of kvtier, never vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

#: code widths a packed page may use (keys: ``bits``; values: ``value_bits``)
PAGE_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class PagePolicy:
    """How a vLLM engine stores and attends its paged KV through kvtier.

    Attributes
    ----------
    bits : code width of a full block; ``None`` keeps vLLM's own exact pages and kernels.
    block_size : tokens per vLLM block (a multiple of 32: vLLM's CPU kernels).
    sink_tokens : leading tokens of every block kept exact inside the page (a sequence's first
        block: its attention sinks); they cost ``4 * H * D`` bytes each in bf16.
    key_group : tokens per key quantization group (divides ``block_size``; ``None``: the block).
    value_group : channels per value group (divides the head dim; capped at it).
    side_slots : exact blocks of the side buffer (the partly filled last block of each running
        request), which is also the most requests an engine runs at once (``max_num_seqs``);
        ``None``: vLLM's ``max_num_seqs``. It grows on demand up to this many (each slot holds one
        block of every layer exact: 2.9 MB for SmolLM2-135M in bf16).
    sparse_mass : sparse decode (``SparsePolicy(select="tokens", method="mass")`` of the transformers
        cache): a request of at most :data:`SPARSE_MAX_QUERY` new tokens scores every packed token
        and reads the values of only the smallest set covering this share of each row's packed
        softmax mass (by factor-of-two weight buckets; kept weights renormalized), plus the last
        ``local_window`` tokens and the sinks. ``None``: dense. Up to 4 decimals (it names the backend).
    local_window : tokens before the new ones always attended when ``sparse_mass`` is set.
    value_bits : code width of the values of a full block (``None``: ``bits``). Values lose less
        than keys at a given width (they are averaged, keys go through a softmax), so a page may
        hold them narrower.
    value_rotation : the engine holds its values in a rotated basis: each new value row is
        multiplied by the randomized Hadamard matrix ``R`` (:func:`kvtier.quant.rotation.rotation`,
        QuaRot https://arxiv.org/abs/2404.00456) before it is stored, exact or packed, and each
        attention output by ``R.T`` after it is computed (``softmax(qK^T) (V R) R^T = softmax(qK^T) V``).
        The rotation spreads outlier channels over all channels, so a per-token value group loses
        less (3-bit values, simulated on SmolLM2: +1.41 % -> +0.96 % 4k perplexity).
    """

    bits: int | None = 4
    block_size: int = 128
    sink_tokens: int = 0
    key_group: int | None = None
    value_group: int = 64
    side_slots: int | None = 64
    sparse_mass: float | None = None
    local_window: int = 64
    value_bits: int | None = None
    value_rotation: bool = False

    def __post_init__(self) -> None:
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in PAGE_BITS):
            raise ValueError(f"PagePolicy.bits={self.bits!r} is not allowed: expected None or one of {PAGE_BITS}")
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 32 or b % 32 or b > 4096:
            raise ValueError(f"PagePolicy.block_size={b!r} is not allowed: expected a multiple of 32 in 32..4096")
        s = self.sink_tokens
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < b:
            raise ValueError(f"PagePolicy.sink_tokens={s!r} is not allowed: expected an int in 0..block_size-1")
        kg = self.key_group
        if kg is not None and (isinstance(kg, bool) or not isinstance(kg, int) or kg < 1 or b % kg):
            raise ValueError(f"PagePolicy.key_group={kg!r} is not allowed: expected None or a divisor of {b}")
        vg = self.value_group
        if isinstance(vg, bool) or not isinstance(vg, int) or vg < 1 or vg & (vg - 1):
            raise ValueError(f"PagePolicy.value_group={vg!r} is not allowed: expected a power of two")
        n = self.side_slots
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"PagePolicy.side_slots={n!r} is not allowed: expected None or an int >= 1")
        m = self.sparse_mass
        if m is not None and (
            isinstance(m, bool)
            or not isinstance(m, (int, float))
            or not 0 < m < 1
            or abs(round(m * 10_000) - m * 10_000) > 1e-6
        ):
            raise ValueError(
                f"PagePolicy.sparse_mass={m!r} is not allowed: "
                "expected None or a number in (0, 1) with at most 4 decimals"
            )
        if m is not None and self.bits is None:
            raise ValueError("PagePolicy.sparse_mass is not allowed with bits=None: exact pages attend densely")
        w = self.local_window
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= 1 << 20:
            raise ValueError(f"PagePolicy.local_window={w!r} is not allowed: expected an int in 0..2**20")
        vb = self.value_bits
        if vb is not None and (isinstance(vb, bool) or vb not in PAGE_BITS):
            raise ValueError(f"PagePolicy.value_bits={vb!r} is not allowed: expected None or one of {PAGE_BITS}")
        if not isinstance(self.value_rotation, bool):
            raise ValueError(f"PagePolicy.value_rotation={self.value_rotation!r} is not allowed: expected a bool")
        for name in ("value_bits", "value_rotation"):
            if getattr(self, name) not in (None, False) and self.bits is None:
                raise ValueError(f"PagePolicy.{name} is not allowed with bits=None: exact pages hold exact values")

    @property
    def packed(self) -> bool:
        return self.bits is not None

    @property
    def vbits(self) -> int | None:
        """Code width of the values of a full block."""
        return self.value_bits or self.bits

    @property
    def kernel_codes(self) -> bool:
        """Whether kvtier's C++ kernels (:mod:`kvtier.kernels.vllm_paged_cpu`) read and write these
        pages: 4-bit keys, 4- or 3-bit values; other widths go through the torch path."""
        return self.bits == 4 and self.vbits in (3, 4)


#: new tokens per request up to which ``PagePolicy.sparse_mass`` applies (decode steps; longer chunks
#: attend densely, as ``SparsePolicy.max_query_tokens`` in the transformers cache)
SPARSE_MAX_QUERY = 4

#: name -> (policy, one-line description)
PAGE_POLICIES: dict[str, tuple[PagePolicy, str]] = {
    "exact": (
        PagePolicy(bits=None, side_slots=None),
        "vLLM's own exact pages and CPU kernels, through kvtier's backend",
    ),
    "default": (
        PagePolicy(),
        "4-bit pages (keys per channel over the 128-token block, values per token): 3.66x the tokens of bf16; "
        "measured +0.022 / -0.005 nats on the next 64 tokens after 3k, +0.74 / +0.84 % 4k perplexity (2 books)",
    ),
    "sparse": (
        PagePolicy(sparse_mass=0.98),
        "default's pages; decode steps read the values of only the tokens covering 98 % of each row's packed "
        "softmax mass plus the last 64 (sparse decode)",
    ),
    "compact": (
        PagePolicy(value_bits=3, value_rotation=True),
        "4-bit keys, rotated 3-bit values: 4.13x the tokens of bf16 (default 3.66x); measured +0.034 / +0.001 nats, "
        "+1.05 / +1.06 % 4k perplexity (2 books)",
    ),
}


def get_page_policy(policy: str | PagePolicy) -> PagePolicy:
    """A :class:`PagePolicy` from a preset name (see :data:`PAGE_POLICIES`) or the policy itself."""
    if isinstance(policy, PagePolicy):
        return policy
    if not isinstance(policy, str) or policy not in PAGE_POLICIES:
        raise ValueError(f"unknown kvtier vLLM page policy {policy!r}: expected one of {sorted(PAGE_POLICIES)}")
    return PAGE_POLICIES[policy][0]


#: key of vLLM's ``additional_config`` naming the engine's kvtier backend
CONFIG_KEY = "kvtier_attention"
_PREFIX = "KVTierAttention_"
#: name of the per-engine backend selector in :mod:`kvtier.vllm.pages.backend` (``vllm serve``'s plugin)
SELECT = "KVTierSelect"


def policy_name(policy: PagePolicy) -> str:
    """The class name of ``policy``'s backend (every field in it, so any process can rebuild it)."""
    p = policy
    bits = 0 if p.bits is None else p.bits
    mass = round(p.sparse_mass * 10_000) if p.sparse_mass is not None else 0
    return (
        f"{_PREFIX}b{bits}_t{p.block_size}_s{p.sink_tokens}_k{p.key_group or 0}_v{p.value_group}_n{p.side_slots or 0}"
        f"_m{mass}_w{p.local_window}_c{p.value_bits or 0}_r{int(p.value_rotation)}"
    )


def parse_policy_name(name: str) -> PagePolicy:
    """Inverse of :func:`policy_name`."""
    if not isinstance(name, str) or not name.startswith(_PREFIX):
        raise ValueError(f"{name!r} is not a kvtier backend name (expected {_PREFIX}...)")
    fields = dict((part[0], int(part[1:])) for part in name[len(_PREFIX) :].split("_"))
    return PagePolicy(
        bits=fields["b"] or None,
        block_size=fields["t"],
        sink_tokens=fields["s"],
        key_group=fields["k"] or None,
        value_group=fields["v"],
        side_slots=fields["n"] or None,
        sparse_mass=fields["m"] / 10_000 if fields.get("m") else None,
        local_window=fields.get("w", 64),
        value_bits=fields.get("c", 0) or None,
        value_rotation=bool(fields.get("r", 0)),
    )
