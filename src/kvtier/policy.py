"""Tier policies: what each layer keeps exact, what it quantizes and how, and named presets.

A :class:`TierPolicy` is a small validated, frozen dataclass (change one with ``replace()``); values
past generous upper bounds (``MAX_*``) are refused. Tokens of a sequence live in:

* **sinks** - the first ``sink_tokens`` real tokens of each row, exact for good (attention sinks,
  StreamingLLM https://arxiv.org/abs/2309.17453);
* **hot** - the most recent ``hot_tokens`` (up to ``hot_tokens + block_tokens - 1``), exact;
* **warm** - the next ``warm_tokens``, ``warm_bits`` group quantization (keys per channel over a
  block of ``block_tokens`` tokens, values per token over ``value_group_size`` channels): k-bit
  integer codes, or ``"fp8"`` for e4m3 codes with the same scale layout;
* **cold** - everything older: ``cold="sign"`` 1-bit centered signs with a scale, ``"quant"``
  ``cold_bits`` group quantization (k-bit or ``"fp8"``), or ``"evict"`` (dropped, as in a sink + window cache).

Tokens move hot -> warm -> cold a block at a time and are quantized once per move.
A k-bit cold tier may give values their own width (``cold_value_bits``) and store its
parameters in fp8 (``cold_meta="fp8"``). With ``adaptive`` (an :class:`AdaptivePolicy`, the
``"adaptive"`` preset) the cache holds a byte budget instead: the cold widths of keys and values are
chosen per layer from measured errors, and the warm window grows and shrinks with the budget (see
:mod:`kvtier.cache.adaptive`).

``layer_overrides`` maps layer indices (negative ones count from the end) to another policy, a
preset name or a preset variant's name (:func:`get_policy`), e.g. ``{0: "exact", -1: "exact"}`` or
``{5: "default:vq3/3"}``; against a model's layer count every key must name one of its layers and
no two keys the same one (:meth:`TierPolicy.check_layers`). Layers under one adaptive policy share
one byte budget.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

WARM_BITS = (2, 3, 4, 6, 8, "fp8")
COLD_BITS = (2, 3, 4, 6, 8, "fp8")
COLD_MODES = ("sign", "quant", "evict", "offload")
COLD_META = ("fp16", "fp8")
COLD_CODES = ("affine", "vq")
ADAPTIVE_CODES = (*COLD_CODES, "affine+vq")  # the last: the allocation picks each layer's family
VQ_COLD_BITS = (2, 3, 4)  # key widths of a vq cold tier (kvtier.codecs.vq.VQ_BITS holds 1 too: values)
ADAPTIVE_WIDTHS = (1, 2, 3, 4)
OFFLOAD_BACKENDS = ("cpu", "disk")
STORE_BITS = (None, 8, 4)
SPARSE_METHODS = ("topk", "quantile", "mass", "bound")
SPARSE_SELECT = ("tokens", "blocks")
EXACT_DTYPES = ("model", "half", "float16", "bfloat16", "float32")

# Upper bounds: generous, but a value past them is a typo that would allocate absurdly (the hot
# buffer grows to hot_tokens + block_tokens per row and KV head) or overflow position arithmetic.
MAX_HOT_TOKENS = 1 << 20  # 1,048,576 exact recent tokens per row
MAX_WARM_TOKENS = 1 << 24  # None is the way to say "unbounded"
MAX_SINK_TOKENS = 1 << 16
MAX_BLOCK_TOKENS = 4096
MAX_GROUP = 1024  # channels per value group (a head_dim is far smaller)
MAX_WINDOW = 1 << 24  # local windows and query-chunk limits, in tokens
MAX_BLOCKS = 1 << 20  # block counts: min/max blocks, prefetch margin
MAX_NUMBER_CHARS = 12  # characters of one number in a variant's name (ASCII digits, one point)
MAX_SHOWN_CHARS = 100  # a longer string is shown cut in an error message


def _shown(value: object) -> str:
    """``repr(value)`` for an error message; a string past ``MAX_SHOWN_CHARS`` is cut (and says so)."""
    if isinstance(value, str) and len(value) > MAX_SHOWN_CHARS:
        return f"{value[:MAX_SHOWN_CHARS]!r}... ({len(value)} characters)"
    return repr(value)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={_shown(value)} is not allowed: expected {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(name: str, value: object, *, allow_none: bool, maximum: int, minimum: int = 0) -> None:
    ok = (value is None and allow_none) or (_is_int(value) and minimum <= value <= maximum)
    allowed = f"an int in [{minimum}, {maximum}]" + (" or None (unbounded)" if allow_none else "")
    _check(ok, name, value, allowed)


def _check_choice(name: str, value: object, choices: tuple) -> None:
    """``value`` one of ``choices``, of the same type (``4.0`` or ``True`` is not the bit width 4)."""
    ok = any(value is c or (type(value) is type(c) and value == c) for c in choices)
    _check(ok, name, value, f"one of {choices}")


@dataclass(frozen=True)
class SparsePolicy:
    """Dynamic sparse attention over the warm and cold tiers.

    Sinks, the hot tier and the last ``local_window`` tokens are always attended. Beyond them a
    per-query threshold keeps what matters, in one of two ways:

    * ``select="tokens"``: scores are computed exactly from the packed keys (cheap: 4-bit reads),
      then value work (reads and FLOPs) is skipped for tokens below a per-row threshold on those
      exact probabilities; the kept weights of the tier are renormalized (its log-sum-exp stays
      that of all its tokens). Keys are always read. CPU only (the fused C++ kernel, or torch
      ops); on CUDA the Triton kernels attend densely instead.
    * ``select="blocks"``: whole blocks are chosen *before* scoring from Quest's upper bound of
      ``q . k`` per block (https://arxiv.org/abs/2406.10774), read for free from the quantization
      metadata (per-channel min and max of each block); dropped blocks cost nothing.

    Attributes
    ----------
    local_window : tokens before the query always attended.
    select : ``"tokens"`` or ``"blocks"`` (see above).
    method : ``"mass"`` keeps the highest-weight tokens (blocks) until ``level`` of the softmax
        mass is covered. Tokens: the mass is the row's - the tier's tokens plus the exact sinks and
        hot tokens the row attends - so the tokens dropped from a tier carry at most ``1 - level``
        of the row's softmax weight; the cut is by factor-of-two buckets of the weight (O(n)).
        ``"quantile"`` keeps scores at or above the ``1 - level`` quantile of the row (the seed's
        ``torch.quantile(scores, 0.7)`` keeps 30%: ``level=0.3``); ``"topk"`` (blocks only) keeps
        ``ceil(level * blocks)``; ``"bound"`` (blocks only) drops blocks only while the sum of their
        *guaranteed* mass bounds (Quest bound vs the exact tokens' log-sum-exp) stays within
        ``1 - level`` - lossless up to that mass, but at head_dim 64 the bounds are loose and it
        rarely drops anything (see BENCHMARKS.md).
    level : the method's parameter, in (0, 1].
    min_blocks : blocks mode: never keep fewer blocks than this per row.
    max_query_tokens : selection applies to forward calls of at most this many new tokens per
        row (decode steps; ``None``: every call). Longer chunks - prompt prefill - attend densely:
        prefill is compute-bound and dense GEMMs beat per-row selection there (on the 2-core CPU,
        token selection made 64-token chunks 3.3x slower than dense; see BENCHMARKS.md).
    """

    local_window: int = 64
    select: str = "tokens"
    method: str = "mass"
    level: float = 0.99
    min_blocks: int = 1
    max_query_tokens: int | None = 4

    def __post_init__(self) -> None:
        _check_count("local_window", self.local_window, allow_none=False, maximum=MAX_WINDOW)
        _check_count("min_blocks", self.min_blocks, allow_none=False, maximum=MAX_BLOCKS)
        _check_count("max_query_tokens", self.max_query_tokens, allow_none=True, minimum=1, maximum=MAX_WINDOW)
        _check_choice("select", self.select, SPARSE_SELECT)
        allowed = SPARSE_METHODS if self.select == "blocks" else ("mass", "quantile")
        _check(self.method in allowed, "method", self.method, f"one of {allowed} for select={self.select!r}")
        _check(
            isinstance(self.level, (int, float)) and not isinstance(self.level, bool) and 0 < self.level <= 1,
            "level",
            self.level,
            "a number in (0, 1]",
        )


@dataclass(frozen=True)
class OffloadPolicy:
    """Cold tier ``"offload"``: exact blocks in a block store, chosen per query from 1-bit key sketches.

    When a block goes cold its keys leave a resident 1-bit sketch (signs after a Hadamard rotation,
    with a per-channel mean and scale) and its keys and values go to the store: host RAM or disk.
    Each query row scores the cold blocks from the sketches (a block's log-sum-exp of its tokens'
    sketch scores estimates its softmax mass), keeps the blocks its budget allows, and attention
    runs exactly over the fetched blocks, merged with sinks and hot (see :mod:`kvtier.offload`).

    Attributes
    ----------
    backend : ``"cpu"`` (host RAM, pinned when computing on CUDA) or ``"disk"`` (memory-mapped
        files with a crc32 per block).
    path : disk only: the directory for the files (``None``: the system temp directory; ``""`` is
        refused rather than read as the current directory). A private subdirectory is created
        there and removed when the cache is closed or garbage-collected, or, after a crash, by the
        next disk cache created in the same directory.
    store_bits : ``None`` stores blocks exactly (storage dtype); 8 or 4 stores k-bit codes.
    mass : keep a row's highest-scoring blocks until the resident tokens (exact mass) plus the kept
        blocks (estimated mass) cover this fraction of the row's estimated attention mass;
        ``None``: no mass cut (with ``max_blocks=None`` too: every block, exact attention).
        The default 0.9999 is deliberately conservative because 1-bit estimates have heavy
        tails: on SmolLM2 at 4k tokens (decode rows) it keeps 80% of a row's blocks (92% of a
        KV head's union) and misses 0.035% of the true attention mass on average (worst row
        5%); 0.999 keeps 63% (81%) but misses 0.31% on average and up to 38% in the worst row.
    max_blocks : the read budget: at most this many cold blocks per query row (``None``: no cap,
        the ``mass`` rule alone). Where attention is diffuse the mass rule keeps most blocks and
        decode time grows with the context; the budget bounds it (Quest-style) at the price of
        the mass beyond it, which the sketches estimate for free: ``offload_stats().est_skipped_*``
        reports it, and a :class:`~kvtier.errors.BudgetWarning` says when a call's rows leave
        more than 5 % of it unread on average. The offload presets set 128 (8,192 tokens of 64-token
        blocks), which never binds up to 8k tokens.
    min_blocks : at least this many (the best-scoring) cold blocks per query row.
    local_window : blocks overlapping the last ``local_window`` tokens before a query are always
        kept (the hot tier already is a local window of at least ``hot_tokens``).
    prefetch : predict each layer's blocks and fetch them in a worker thread ahead of its attention.
        ``None`` (auto): on when a fetch is a real transfer - the disk backend, or compute on a GPU -
        and off for the host-RAM backend with compute on the CPU, where the "transfer" is a copy
        within the same memory and a worker doing it slows the compute thread more than it saves
        (measured on SmolLM2: 329.8 ms/token on vs 309.0 off at 8k, see BENCHMARKS.md).
    margin : blocks per KV head added to a prediction beyond last step's selection (the next-best).
    coarse_tol : two-level selection (CPU kernel): blocks are walked by descending coarse bound
        (an upper bound of each block's sketch estimate from resident per-block data) and scored
        from their sketch until the bounds of the blocks left sum to at most this fraction of every
        row's estimated total; ``0`` scores every block.
    reuse_steps : a layer's block selection is recomputed every this many decode steps and reused
        in between (blocks offloaded since are added); ``1``: every step. ``None`` (auto, with a
        read budget): every ``ceil(n / max_blocks)`` steps for a layer of ``n`` cold blocks - every
        step while the budget cannot bind, and beyond it the selection's O(n) sketch scoring is
        amortized so that its cost per step stays about that of ``max_blocks`` blocks.
    max_query_tokens : sketch selection applies to forward calls of at most this many new tokens
        (decode steps, short speculative chunks; ``None``: every call). Longer calls - prompt
        prefill - attend every cold block exactly: a prefill chunk's thousands of query rows
        select nearly every block anyway (92 % of a KV head's union at one decode row on SmolLM2),
        and scoring sketches and masking rows per block cost more than the attention; dense,
        the chunk reads each block once through torch's flash op, and the tokens it writes are
        computed from exact attention.
    """

    backend: str = "cpu"
    path: str | None = None
    store_bits: int | None = None
    mass: float | None = 0.9999
    max_blocks: int | None = None
    min_blocks: int = 8
    local_window: int = 0
    prefetch: bool | None = None
    margin: int = 4
    coarse_tol: float = 0.0
    reuse_steps: int | None = 1
    max_query_tokens: int | None = 16

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, OFFLOAD_BACKENDS)
        _check(
            self.path is None or (isinstance(self.path, str) and self.path.strip() != ""),
            "path",
            self.path,
            "a directory path (a non-empty str) or None (the system temp directory)",
        )
        _check(self.path is None or self.backend == "disk", "path", self.path, "None unless backend='disk'")
        _check_choice("store_bits", self.store_bits, STORE_BITS)
        _check(
            self.mass is None
            or (isinstance(self.mass, (int, float)) and not isinstance(self.mass, bool) and 0 < self.mass <= 1),
            "mass",
            self.mass,
            "a number in (0, 1] or None",
        )
        _check_count("max_blocks", self.max_blocks, allow_none=True, minimum=1, maximum=MAX_BLOCKS)
        _check_count("min_blocks", self.min_blocks, allow_none=False, maximum=MAX_BLOCKS)
        _check_count("local_window", self.local_window, allow_none=False, maximum=MAX_WINDOW)
        _check_count("margin", self.margin, allow_none=False, maximum=MAX_BLOCKS)
        _check(
            isinstance(self.coarse_tol, (int, float))
            and not isinstance(self.coarse_tol, bool)
            and 0 <= self.coarse_tol < 1,
            "coarse_tol",
            self.coarse_tol,
            "a number in [0, 1)",
        )
        _check_count("reuse_steps", self.reuse_steps, allow_none=True, minimum=1, maximum=MAX_BLOCKS)
        _check_count("max_query_tokens", self.max_query_tokens, allow_none=True, minimum=1, maximum=MAX_WINDOW)
        _check(
            self.prefetch is None or isinstance(self.prefetch, bool), "prefetch", self.prefetch, "a bool or None (auto)"
        )

    @property
    def unlimited(self) -> bool:
        """True when every cold block is fetched (attention over the offloaded tier is exact)."""
        return self.mass is None and self.max_blocks is None

    def reuse_every(self, nblocks: int) -> int:
        """Decode steps a selection serves in a layer of ``nblocks`` cold blocks (``reuse_steps``, resolved)."""
        if self.reuse_steps is not None:
            return self.reuse_steps
        return 1 if self.max_blocks is None else max(1, -(-nblocks // self.max_blocks))


@dataclass(frozen=True)
class AdaptivePolicy:
    """A byte budget instead of fixed widths: ``TieredCache(config, policy="adaptive", bits=2.5)``.

    The cache keeps its stored bits per K/V element - every tensor it holds, metadata, sinks and
    the hot ring included - at most ``bits`` once the context is past a short warm-up. How (see
    :mod:`kvtier.cache.adaptive`):

    * the first ``warmup_tokens`` tokens stay in the warm tier while every block that enters it is
      also coded at each candidate width (keys and values apart) and the error of the attention
      output of the layer's latest queries over it measured (keys coded, then values coded);
    * then the cold widths of keys and values are chosen per layer by a rate-distortion rule:
      start every layer at the narrowest width and repeatedly widen the (layer, keys or values)
      with the largest measured error reduction per byte while the average cold rate stays within
      what ``bits`` leaves at ``fit_tokens`` tokens after the exact sinks and hot ring;
    * from then on the warm window (``warm_bits``, recent tokens, coded like the cold tier: rotated,
      ``meta`` parameters) is as long as the budget allows at the current length: it grows with
      the context, and its oldest blocks step down to their layer's cold widths;
    * the eviction rung (``keep < 1``, 0.5 in the ``"adaptive"`` preset): of the tokens stepping
      down only ``keep`` stay, per sequence and KV head the ones the latest queries attend to most
      (SnapKV-style), and the cold code budget is spread over those, so they get wider codes.

    ``fit_tokens`` sets the trade between the two: a short one (the default 2,048) holds the
    budget from there on with narrow cold codes and gives the slack of longer contexts to a long
    recent window, which on SmolLM2 costs less than wider cold codes under a short window
    (BENCHMARKS.md, "Adaptive precision under a byte budget").

    Attributes
    ----------
    bits : target average stored bits per K/V element (0.5 to 16).
    widths : candidate code widths for cold keys and values (from 1, 2, 3, 4).
    meta : storage of the cold tier's affine parameters, ``"fp8"`` (e4m3) or ``"fp16"``.
    warmup_tokens : tokens seen before the allocation (a multiple of nothing; at least 1).
    fit_tokens : the length at which the budget is met with no warm window; past it the warm
        window takes the slack (a shorter one: a shorter warm-up, narrower cold widths).
    keep : the eviction rung, below the narrowest width: the fraction of the tokens leaving the
        warm window that stay (coded at the layer's cold widths); the others, chosen per layer,
        sequence and KV head by the attention the latest queries give them, are dropped and their
        bytes buy wider cold codes. A fraction ``j/g`` with ``g <= 8`` (blocks step down ``g`` at
        a time and leave ``j`` blocks); 1 keeps every token.
    codes : the cold codes' family: ``"affine"`` (scalar, ``meta`` parameters;
        :class:`~kvtier.codecs.MixedCodec`) or ``"vq"`` (vector codes from the shipped codebooks,
        :class:`~kvtier.codecs.VqCodec`: measured and stored at each width instead; ``meta`` unused),
        or ``"affine+vq"``: both measured, and the allocation picks each layer's family with its
        widths (the family's parameter bytes priced in; one family per layer, keys and values at
        their own widths). Vq widths whose sub-vectors do not tile the model's head dim are left out
        of the candidates.
    """

    bits: float = 2.5
    widths: tuple[int, ...] = (1, 2, 3, 4)
    meta: str = "fp8"
    warmup_tokens: int = 512
    fit_tokens: int = 2048
    keep: float = 1.0
    codes: str = "affine"

    def __post_init__(self) -> None:
        _check_choice("codes", self.codes, ADAPTIVE_CODES)
        _check(
            isinstance(self.bits, (int, float)) and not isinstance(self.bits, bool) and 0.5 <= self.bits <= 16,
            "bits",
            self.bits,
            "a number in [0.5, 16]",
        )
        _check(
            isinstance(self.widths, tuple) and len(self.widths) > 0 and all(w in ADAPTIVE_WIDTHS for w in self.widths),
            "widths",
            self.widths,
            f"a non-empty tuple of widths from {ADAPTIVE_WIDTHS}",
        )
        object.__setattr__(self, "widths", tuple(sorted(set(self.widths))))
        _check_choice("meta", self.meta, COLD_META)
        _check_count("warmup_tokens", self.warmup_tokens, allow_none=False, minimum=1, maximum=MAX_WINDOW)
        _check_count("fit_tokens", self.fit_tokens, allow_none=False, minimum=1, maximum=MAX_WINDOW)
        _check(
            isinstance(self.keep, (int, float))
            and not isinstance(self.keep, bool)
            and 0 < self.keep <= 1
            and abs(float(Fraction(self.keep).limit_denominator(8)) - self.keep) < 1e-9,
            "keep",
            self.keep,
            "a fraction j/g in (0, 1] with g <= 8, e.g. 0.5",
        )

    @property
    def keep_blocks(self) -> tuple[int, int]:
        """``(j, g)``: ``g`` blocks leaving the warm window leave ``j`` cold blocks (``keep = j/g``)."""
        f = Fraction(self.keep).limit_denominator(8)
        return f.numerator, f.denominator


class LayerOverrides(Mapping):
    """An immutable ``{layer index: TierPolicy or preset name}``: what ``TierPolicy.layer_overrides``
    holds once validated (hashable, picklable, equal to the dict with the same items)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | None = None) -> None:
        self._items: dict[int, TierPolicy | str] = dict(items or {})

    def __getitem__(self, key: int) -> TierPolicy | str:
        return self._items[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self) -> tuple:
        return (LayerOverrides, (self._items,))


@dataclass(frozen=True)
class TierPolicy:
    """How one layer stores its keys and values (frozen: ``replace()`` makes a changed copy).

    Attributes
    ----------
    hot_tokens : exact recent tokens (at most 2**20); ``None`` keeps every token exact (no compression).
    warm_tokens : tokens in the warm tier after hot (at most 2**24); ``None`` = unbounded (no cold
        tier). A multiple of ``block_tokens``.
    warm_bits : code of the warm tier: a bit width, one of 2, 3, 4, 6, 8, or ``"fp8"`` (e4m3 codes with
        fp16 scales in the same layout; attention decodes fp8 tiers chunk by chunk, dense only, so
        ``sparse`` must be None with an fp8 tier).
    sink_tokens : first real tokens of each row kept exact for good (at most 2**16).
    cold : ``"sign"`` (1-bit), ``"quant"`` (``cold_bits``-bit), ``"evict"``, or ``"offload"``
        (exact blocks in a block store, a 1-bit key sketch resident: see ``offload``).
    cold_bits : bit width (or ``"fp8"``) when ``cold == "quant"`` (the keys' width when
        ``cold_value_bits`` is set).
    cold_value_bits : the values' width of a k-bit cold tier (1, 2, 3, 4, 6 or 8), or None
        (``cold_bits``).
    cold_meta : storage of a k-bit cold tier's parameters: ``"fp16"`` (scale and zero) or ``"fp8"``
        (e4m3 step and offset, half the bytes; :class:`~kvtier.codecs.MixedCodec`).
    cold_codes : ``"affine"`` (scalar codes, ``x = a * code + b``) or ``"vq"``: vector codes from a
        shipped codebook on rotated coordinates (:class:`~kvtier.codecs.VqCodec`; keys at
        ``cold_bits`` in 2..4, values at ``cold_value_bits`` in 1..4 or ``cold_bits``). A vq tier is
        read in place by its own kernel (dense only: ``sparse`` None), needs ``cold_rotation``,
        the default ``cold_meta`` and no ``adaptive`` (a budget picks its family itself:
        ``AdaptivePolicy(codes="vq")``); the head dim must be a multiple of the sub-vectors (4
        coordinates at 2 bits, 2 at 3-4, 8 for 1-bit values).
    adaptive : an :class:`AdaptivePolicy` (a byte budget; cold widths per layer chosen from
        measured errors, a budget-driven warm window) or None. Needs ``cold="quant"``. An integer
        ``warm_bits`` is then coded like the cold tier (``cold_rotation``, ``cold_meta``).
    cold_rotation : randomized Hadamard rotation of K and V before the cold code, the 1-bit sign
        or the ``cold_bits`` k-bit one (default: on; on SmolLM2 it cuts the perplexity cost of the
        seed's 1-bit cold tier from +8.5% to +3.9%).
    block_tokens : migration block; also the token group of per-channel key statistics (1 to 4096).
    value_group_size : channels per group of per-token value statistics, at most (1 to 1024): a layer
        uses the largest divisor of its head dim not above it (:func:`kvtier.codecs.value_group`;
        64 gives 40 channels at head_dim 80, 48 at 96, 56 at 112), so no head dim is refused.
    exact_dtype : storage of sinks and hot tokens: ``"model"`` (the model's dtype),
        ``"half"`` (fp16 when the model runs in fp32, else the model's dtype) or a dtype name.
        A storage narrower than the model's dtype (fp16 for an fp32 model: up to 65,504) never
        stores ``inf``: a call whose keys or values exceed it is refused with a one-line
        :class:`~kvtier.errors.StorageRangeError` naming the layer and the largest ``|x|``, and the
        cache is left unchanged (one max per appended chunk; the model's own ``inf``/``NaN`` is
        not checked). Refusing rather than silently keeping fp32 keeps the bytes the cache reports
        and caps (``max_bytes``) what the policy says; ``"bfloat16"`` (fp32's range in 2 bytes) or
        ``"model"`` holds such values. Quantized tiers refuse the same way a block whose fp16 / fp8
        parameters cannot hold its range (:func:`kvtier.codecs.check_params`).
    sparse : a :class:`SparsePolicy` for dynamic sparse attention over warm and cold, or None.
    layer_overrides : layer index -> policy, preset name or preset variant name (:func:`get_policy`);
        negative indices count from the end. Any mapping; held as an immutable :class:`LayerOverrides`.
    name : label used in reports.
    offload : an :class:`OffloadPolicy` when ``cold == "offload"`` (``None`` there means the
        defaults); must be ``None`` otherwise.
    """

    hot_tokens: int | None = 128
    warm_tokens: int | None = 1024
    warm_bits: int | str = 4
    sink_tokens: int = 32
    cold: str = "sign"
    cold_bits: int | str = 2
    cold_rotation: bool = True
    block_tokens: int = 64
    value_group_size: int = 64
    exact_dtype: str = "model"
    sparse: SparsePolicy | None = None
    layer_overrides: Mapping[int, TierPolicy | str] = field(default_factory=lambda: {0: "exact", -1: "exact"})
    name: str = "custom"
    offload: OffloadPolicy | None = None
    cold_value_bits: int | None = None
    cold_meta: str = "fp16"
    adaptive: AdaptivePolicy | None = None
    cold_codes: str = "affine"

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_codes()
        self._check_offload()
        self._check_cold_values()
        self._check_vq()
        self._check_adaptive_and_sparse()
        overrides = self._checked_overrides()
        object.__setattr__(self, "layer_overrides", overrides)  # frozen dataclass: set once, here

    def _check_sizes(self) -> None:
        """Token counts and the value group: integers in range, warm a whole number of blocks."""
        _check_count("hot_tokens", self.hot_tokens, allow_none=True, maximum=MAX_HOT_TOKENS)
        _check_count("warm_tokens", self.warm_tokens, allow_none=True, maximum=MAX_WARM_TOKENS)
        _check_count("sink_tokens", self.sink_tokens, allow_none=False, maximum=MAX_SINK_TOKENS)
        _check_count("block_tokens", self.block_tokens, allow_none=False, minimum=1, maximum=MAX_BLOCK_TOKENS)
        _check_count("value_group_size", self.value_group_size, allow_none=False, minimum=1, maximum=MAX_GROUP)
        if self.warm_tokens is not None:
            _check(
                self.warm_tokens % self.block_tokens == 0,
                "warm_tokens",
                self.warm_tokens,
                f"a multiple of block_tokens={self.block_tokens}",
            )

    def _check_codes(self) -> None:
        """The codes of each tier, the exact dtype, the name and the sparse policy's type."""
        _check_choice("warm_bits", self.warm_bits, WARM_BITS)
        _check_choice("cold", self.cold, COLD_MODES)
        _check_choice("cold_bits", self.cold_bits, COLD_BITS)
        _check(isinstance(self.cold_rotation, bool), "cold_rotation", self.cold_rotation, "a bool")
        _check_choice("exact_dtype", self.exact_dtype, EXACT_DTYPES)
        _check(isinstance(self.name, str) and self.name != "", "name", self.name, "a non-empty str")
        _check(
            self.sparse is None or isinstance(self.sparse, SparsePolicy),
            "sparse",
            self.sparse,
            "a SparsePolicy or None",
        )

    def _check_cold_values(self) -> None:
        """Mixed cold codes (values of their own width, parameter dtype) only over integer cold keys."""
        _check(
            self.cold_value_bits is None
            or (self.cold_value_bits in (1, 2, 3, 4, 6, 8) and _is_int(self.cold_value_bits)),
            "cold_value_bits",
            self.cold_value_bits,
            "None or one of (1, 2, 3, 4, 6, 8)",
        )
        _check_choice("cold_meta", self.cold_meta, COLD_META)
        mixed = self.cold_value_bits is not None or self.cold_meta != "fp16"
        _check(
            not mixed or (self.cold == "quant" and self.cold_bits != "fp8"),
            "cold_value_bits",
            self.cold_value_bits,
            "None with cold_meta='fp16' unless cold='quant' with integer cold_bits",
        )

    def _check_vq(self) -> None:
        """Vector cold codes: quantized cold keys of a vq width, rotated, dense, fixed parameters."""
        _check_choice("cold_codes", self.cold_codes, COLD_CODES)
        if self.cold_codes != "vq":
            return
        _check(self.cold == "quant", "cold_codes", self.cold_codes, "'affine' unless cold='quant'")
        _check_choice("cold_bits", self.cold_bits, VQ_COLD_BITS)
        _check(
            self.cold_value_bits is None or self.cold_value_bits in (1, 2, 3, 4),
            "cold_value_bits",
            self.cold_value_bits,
            "None or one of (1, 2, 3, 4) with cold_codes='vq'",
        )
        _check(self.cold_rotation, "cold_rotation", self.cold_rotation, "True with cold_codes='vq'")
        _check(self.cold_meta == "fp16", "cold_meta", self.cold_meta, "'fp16' with cold_codes='vq' (its own format)")
        _check(self.sparse is None, "sparse", self.sparse, "None with cold_codes='vq' (vq tiers are attended densely)")
        _check(self.adaptive is None, "adaptive", self.adaptive, "None with cold_codes='vq' (not yet)")

    def _check_adaptive_and_sparse(self) -> None:
        """An adaptive budget needs quantized cold tiers and a hot window; sparse selection reads affine codes."""
        _check(
            self.adaptive is None or isinstance(self.adaptive, AdaptivePolicy),
            "adaptive",
            self.adaptive,
            "an AdaptivePolicy or None",
        )
        _check(
            self.adaptive is None or (self.cold == "quant" and self.hot_tokens is not None),
            "adaptive",
            self.adaptive,
            "None unless cold='quant' with a hot window",
        )
        if self.adaptive is not None and self.adaptive.codes != "affine":
            _check(
                self.sparse is None,
                "sparse",
                self.sparse,
                f"None with AdaptivePolicy(codes={self.adaptive.codes!r}) (vq tiers are attended densely)",
            )
        if self.sparse is not None and self.hot_tokens is not None:
            fp8 = self.warm_bits == "fp8" or (self.cold == "quant" and self.cold_bits == "fp8")
            _check(not fp8, "sparse", self.sparse, "None with an fp8 tier (sparse selection reads affine codes only)")

    def _checked_overrides(self) -> LayerOverrides:
        """A snapshot of ``layer_overrides`` (later edits of the caller's dict do nothing), each checked."""
        _check(isinstance(self.layer_overrides, Mapping), "layer_overrides", self.layer_overrides, "a dict")
        overrides = LayerOverrides(self.layer_overrides)
        for idx, sub in overrides.items():
            _check(isinstance(idx, int) and not isinstance(idx, bool), "layer_overrides key", idx, "an int")
            if isinstance(sub, str):
                try:
                    named = sub in PRESETS or preset_variant(sub) is not None
                except ValueError as err:  # a variant's form whose fields do not hold
                    raise ValueError(f"layer_overrides[{idx}]: {err}") from None
                expected = f"a preset name in {sorted(PRESETS)} or a variant ({' | '.join(VARIANT_FORMS)})"
                _check(named, f"layer_overrides[{idx}]", sub, expected)
            else:
                _check(isinstance(sub, TierPolicy), f"layer_overrides[{idx}]", sub, "a TierPolicy or a policy name")
        return overrides

    def _check_offload(self) -> None:
        if self.cold != "offload":
            _check(self.offload is None, "offload", self.offload, "None unless cold='offload'")
            return
        if self.offload is None:
            object.__setattr__(self, "offload", OffloadPolicy())  # frozen dataclass: the default, set once
        _check(isinstance(self.offload, OffloadPolicy), "offload", self.offload, "an OffloadPolicy or None")
        _check(self.sparse is None, "sparse", self.sparse, "None with cold='offload' (offload selects blocks itself)")

    @property
    def is_exact(self) -> bool:
        """True when this policy never compresses or drops a token."""
        return self.hot_tokens is None

    def replace(self, **changes: object) -> TierPolicy:
        """A copy with fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_layers(self, num_layers: int) -> None:
        """Refuse ``layer_overrides`` that do not fit a model of ``num_layers`` layers.

        Raises
        ------
        ValueError : a key outside ``[-num_layers, num_layers)``, or two keys naming one layer
            (``3`` and ``-1`` of 4 layers) with different policies, which would leave one of them
            silently unused (the same policy twice, ``{0: "exact", -1: "exact"}`` of 1 layer, is fine).
        """
        named: dict[int, int] = {}
        for key, sub in self.layer_overrides.items():
            if not -num_layers <= key < num_layers:
                raise ValueError(f"layer_overrides key {key} is not allowed: the model has {num_layers} layers")
            first = named.setdefault(key % num_layers, key)
            if self.layer_overrides[first] != sub:
                raise ValueError(
                    f"layer_overrides keys {first} and {key} are not allowed together: both name layer "
                    f"{key % num_layers} of {num_layers} with different policies; give one"
                )

    def for_layer(self, index: int, num_layers: int) -> TierPolicy:
        """The policy that layer ``index`` of ``num_layers`` uses, overrides resolved.

        Raises
        ------
        ValueError : overrides that do not fit ``num_layers`` layers (:meth:`check_layers`).
        """
        self.check_layers(num_layers)
        chosen: TierPolicy | str = self
        for key, sub in self.layer_overrides.items():
            if key % num_layers == index:
                chosen = sub
        if isinstance(chosen, str):
            chosen = get_policy(chosen)
        return chosen.replace(layer_overrides={}) if chosen.layer_overrides else chosen


# --- presets ------------------------------------------------------------------------------

_Preset = tuple[str, Callable[[], TierPolicy]]


def _exact() -> TierPolicy:
    return TierPolicy(hot_tokens=None, warm_tokens=0, sink_tokens=0, layer_overrides={}, name="exact")


def _default() -> TierPolicy:
    # Measured (benchmarks/sweep_policies.py, SmolLM2, streamed, two books): 4-bit beyond a 64-token
    # hot window with 64-token key groups costs +0.22% perplexity at 0.300 of fp16 bytes at 8k (0.313
    # at 4k); 128-token groups cost +0.57%, 3-bit everywhere +1.8%. A 3-bit cold tier beyond a 1,024
    # token 4-bit warm window costs +1.24% (4k) unrotated, +0.27% (4k) / +0.29% (8k) after the
    # Hadamard rotation, at 0.271 / 0.246 of fp16 bytes (warm 2,560 unrotated: +0.24% at 4k but
    # +2.99% at 8k). Sparse decode attention (benchmarks/sparse_work.py, 8k, two books): dropping at
    # most 2% of a row's softmax mass beyond a 64-token local window skips ~43% of the attention work
    # for +0.2% perplexity against the same policy dense (4-bit everywhere).
    return TierPolicy(
        hot_tokens=64,
        warm_tokens=1024,
        warm_bits=4,
        sink_tokens=32,
        cold="quant",
        cold_bits=3,
        cold_rotation=True,
        block_tokens=64,
        value_group_size=64,
        exact_dtype="half",
        sparse=SparsePolicy(local_window=64, select="tokens", method="mass", level=0.98),
        layer_overrides={},
        name="default",
    )


def _max_compression() -> TierPolicy:
    return TierPolicy(
        hot_tokens=128,
        warm_tokens=1024,
        warm_bits=4,
        sink_tokens=32,
        cold="sign",
        cold_rotation=True,
        block_tokens=64,
        exact_dtype="half",
        layer_overrides={},
        name="max-compression",
    )


def _chat() -> TierPolicy:
    return _default().replace(
        hot_tokens=192,
        warm_tokens=None,  # 4-bit beyond the hot window (measured so; no cold tier)
        sparse=SparsePolicy(local_window=64, select="tokens", method="mass", level=0.97),
        name="chat",
    )


def _code() -> TierPolicy:
    return _default().replace(
        hot_tokens=256,
        warm_tokens=None,  # conservative: 6-bit beyond the hot window, no cold tier
        warm_bits=6,
        sparse=SparsePolicy(local_window=128, select="tokens", level=0.99),
        name="code",
    )


def _fp8() -> TierPolicy:
    # The format transformers' and vLLM's fp8 KV caches use (e4m3), with finer scales: one per
    # channel per 64-token block for keys, one per token per 64 channels for values. No cold tier,
    # no sparse attention (the decode kernels read affine codes only; fp8 tiers are decoded chunk by
    # chunk). Measured in BENCHMARKS.md ("fp8").
    return _default().replace(warm_tokens=None, warm_bits="fp8", cold="evict", sparse=None, name="fp8")


def _kivi2() -> TierPolicy:
    return TierPolicy(
        hot_tokens=128,
        warm_tokens=None,
        warm_bits=2,
        sink_tokens=0,
        block_tokens=32,
        value_group_size=32,
        layer_overrides={},
        name="kivi2",
    )


def _sink_window() -> TierPolicy:
    return TierPolicy(
        hot_tokens=1020,
        warm_tokens=0,
        sink_tokens=4,
        cold="evict",
        block_tokens=1,
        layer_overrides={},
        name="sink-window",
    )


#: The offload presets' read budget (cold blocks per query row): 8,192 tokens of 64-token blocks.
OFFLOAD_READ_BLOCKS = 128


def _offload(backend: str) -> TierPolicy:
    # No warm tier: a block leaving the hot window goes straight to the store, its 1-bit key sketch
    # stays. Resident per token and KV head: D/8 + 1 sketch bytes + 2 D + 6 per 64-token block +
    # packed validity, table and key addresses (~11.3 bytes at D = 64, vs 256 for fp16 K/V; 0.044 of
    # fp16), plus the fp16 hot window and sinks (0.0494 of fp16 in all at 32k tokens, measured).
    # Read budget: 128 blocks (8,192 tokens) per query row, and a selection reused for
    # ceil(n / 128) steps; neither acts up to 8,192 tokens of context, so quality there is the mass
    # rule's, fresh every step; beyond, reads and selection work per step stay about flat
    # (BENCHMARKS.md, "Offload at 8k-32k") and the skipped share is estimated and reported.
    return TierPolicy(
        hot_tokens=64,
        warm_tokens=0,
        sink_tokens=32,
        cold="offload",
        block_tokens=64,
        value_group_size=64,
        exact_dtype="half",
        offload=OffloadPolicy(backend=backend, max_blocks=OFFLOAD_READ_BLOCKS, reuse_steps=None),
        layer_overrides={},
        name=f"offload-{backend}",
    )


def _offload_cpu() -> TierPolicy:
    return _offload("cpu")


def _offload_disk() -> TierPolicy:
    return _offload("disk")


def _adaptive() -> TierPolicy:
    # A byte budget (2.5 bits per element by default; TieredCache(..., bits=) sets it): cold widths per
    # layer from measured errors, warm window from the budget (kvtier.cache.adaptive). Dense decode
    # attention (the budget already removes what sparse attention would skip). Measured at 2.5 bits,
    # 4k, dracula (benchmarks/adaptive_ppl.py): a 3-bit rotated fp8 warm window +6.4 % where the
    # 4-bit one with fp16 scales costs +8.8 % (same held bytes); fit_tokens 2,048 +8.8 % at 2.43 bits
    # where 4,096 costs +13.3 % at 2.47; an exact ring of 64 + 64 beats none (+10.0 %). Two books, 4k:
    # bits=2.0 / 2.5 / 3.0 hold 1.95 / 2.43 / 2.95 bits for +21.9 / +7.1 / +3.4 % without eviction.
    # The eviction rung (keep=0.5: half of the tokens leaving the warm window dropped by attention,
    # wider codes for the rest), 4k dracula: bits=2.5 +2.18 % (keep 1: +5.93 %, 0.75: +6.81 %,
    # 0.25: +3.27 %), bits=3.0 +1.98 % (keep 1: +3.37 %, 0.75: +2.30 %), bits=2.0 +6.49 % (keep 1:
    # +19.33 %, 0.25: +5.56 %). Two books: bits=2.5 +2.48 % at 4k, +1.57 % at 8k. With the waiting
    # blocks of an eviction group reserved (the budget then holds at fit_tokens): bits=2.5 +2.37 %,
    # bits=3.0 +1.77 % at 4k (two books); a keep share per layer did not beat 0.5 everywhere.
    return _default().replace(
        warm_tokens=None,
        warm_bits=3,
        cold_bits=2,
        cold_meta="fp8",
        sparse=None,
        adaptive=AdaptivePolicy(keep=0.5),
        name="adaptive",
    )


PRESETS: dict[str, _Preset] = {
    "default": (
        "hot 64 + 32 sinks exact (fp16), 1,024 warm tokens 4-bit, older ones 3-bit after a Hadamard rotation; "
        "sparse decode attention (<= 2% of the mass dropped)",
        _default,
    ),
    "adaptive": (
        "a byte budget (bits=2.5 per element, everything included): cold key and value widths per layer "
        "from measured errors, 3-bit rotated warm window as long as the budget allows, half of the older "
        "tokens evicted by attention",
        _adaptive,
    ),
    "max-compression": ("hot 128 exact, warm 1,024 at 4 bits, cold 1-bit signs, 32 sinks", _max_compression),
    "chat": (
        "hot 192 + 32 sinks exact, every older token 4-bit; sparse decode attention (<= 3% of the mass dropped) "
        "beyond 64 tokens",
        _chat,
    ),
    "code": ("6-bit warm, hot 256, sparse mass 0.99 beyond a 128-token local window: conservative", _code),
    "exact": ("no compression; matches DynamicCache token for token", _exact),
    "fp8": ("hot 64 + 32 sinks exact (fp16), every older token fp8 e4m3 (key scales per block, value per token)", _fp8),
    "kivi2": ("baseline: 2-bit warm over all non-hot tokens (KIVI layout), hot 128", _kivi2),
    "sink-window": ("baseline: 4 sinks + 1,020-token window, older tokens evicted", _sink_window),
    "offload-cpu": (
        "hot 64 + 32 sinks resident; older blocks exact in host RAM, fetched by 1-bit sketch",
        _offload_cpu,
    ),
    "offload-disk": ("offload-cpu with blocks in memory-mapped temp files (crc32-checked)", _offload_disk),
}


#: The forms of a preset variant's name (:func:`get_policy`), as the one-line errors show them.
VARIANT_FORMS = (
    "adaptive@<bits>[:keep=<f>][:fit_tokens=<n>][:warmup_tokens=<n>][:sinks=<n>][:codes=vq|affine+vq]",
    "<preset>:vq<key bits>[/<value bits>]",
    "<preset>:dense",
)


def get_policy(policy: str | TierPolicy) -> TierPolicy:
    """A preset by name, a preset variant by name, or the policy itself.

    A variant's name is the policy's name too (what ``kvtier eval --caches``, ``kvtier plan
    --policy`` and ``TieredCache(config, name)`` take alike):

    * ``adaptive@<bits>[:keep=<f>][:fit_tokens=<n>][:warmup_tokens=<n>][:sinks=<n>][:codes=<c>]`` -
      the ``adaptive`` preset at a budget of ``bits`` per element, :class:`AdaptivePolicy` fields
      (``sinks``: the policy's ``sink_tokens``), e.g. ``adaptive@2.5:codes=vq``;
    * ``<preset>:vq<k>[/<v>]`` - the preset with its cold tier in vector codes of ``k``-bit keys and
      ``v``-bit values (sparse decode attention off: vq tiers are read whole), e.g. ``default:vq3/3``;
      only presets with a fixed-width quantized cold tier (``default``, ``max-compression``) take it;
    * ``<preset>:dense`` - the preset with sparse decode attention off.

    Raises
    ------
    ValueError : an unknown name, or a variant whose fields do not parse or do not validate.
    """
    if isinstance(policy, TierPolicy):
        return policy
    if isinstance(policy, str):
        if policy in PRESETS:
            return PRESETS[policy][1]()
        variant = preset_variant(policy)
        if variant is not None:
            return variant
    raise ValueError(
        f"policy={_shown(policy)} is not allowed: expected one of {sorted(PRESETS)}, a variant "
        f"({' | '.join(VARIANT_FORMS)}) or a TierPolicy"
    )


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    """A number of a variant's name: ASCII digits (and one point for a float), at most
    ``MAX_NUMBER_CHARS`` of them. ``int()`` and ``float()`` alone would take other scripts' digits
    (``"³"``), signs, spaces, underscores, ``"inf"`` and thousands of digits.

    Raises
    ------
    ValueError : anything else (the caller words the message).
    """
    form = r"[0-9]+" if kind is int else r"[0-9]+\.?[0-9]*|\.[0-9]+"
    if len(text) > MAX_NUMBER_CHARS or re.fullmatch(form, text) is None:
        raise ValueError(text)
    return kind(text)


def _takes_vq(policy: TierPolicy) -> bool:
    """Whether a ``<preset>:vq...`` variant applies: a fixed-width quantized cold tier (signs or
    k-bit codes) that tokens reach."""
    quantized = policy.cold in ("sign", "quant") and policy.adaptive is None
    return quantized and policy.hot_tokens is not None and policy.warm_tokens is not None


def preset_variant(name: str) -> TierPolicy | None:
    """The preset variant ``name`` names (forms: :func:`get_policy`), or None when ``name`` has no
    variant's form.

    Raises
    ------
    ValueError : a variant's form whose fields do not parse or do not validate, or a vq variant of a
        preset without a quantized cold tier.
    """
    if name.startswith("adaptive@"):
        bits_s, sep, opts = name.removeprefix("adaptive@").partition(":")
        items = [item.partition("=") for item in opts.split(":")] if sep else []
        keys = [key for key, _, _ in items]
        twice = sorted({key for key in keys if key and keys.count(key) > 1})
        if twice:
            raise ValueError(f"{_shown(name)} is not allowed: {_shown(twice[0])} is given twice; name each option once")
        fields: dict[str, object] = {}
        policy_fields: dict[str, object] = {}
        try:
            bits = _number(bits_s, float)
            for key, _, value in items:
                if key == "sinks":  # the policy's exact sink tokens (the rest are AdaptivePolicy fields)
                    policy_fields["sink_tokens"] = _number(value, int)
                elif key in ("keep", "fit_tokens", "warmup_tokens"):
                    fields[key] = _number(value, float if key == "keep" else int)
                elif key == "codes":
                    fields[key] = value
                else:
                    raise ValueError(key)
        except ValueError:
            raise ValueError(
                f"{_shown(name)} is not allowed: expected {VARIANT_FORMS[0]} (numbers in ASCII digits), "
                "e.g. adaptive@2.5 or adaptive@2.5:keep=0.5"
            ) from None
        p = PRESETS["adaptive"][1]()
        assert p.adaptive is not None
        adaptive = dataclasses.replace(p.adaptive, bits=bits, **fields)  # type: ignore[arg-type]
        return p.replace(adaptive=adaptive, name=name, **policy_fields)
    base, _, path = name.partition(":")
    if base not in PRESETS:
        return None
    if path == "dense":
        return PRESETS[base][1]().replace(sparse=None, name=name)
    if path.startswith("vq") and base == "adaptive":  # the budget chooses the widths
        raise ValueError(
            f"{_shown(name)} is not allowed: the adaptive budget chooses its cold widths; name the family instead, "
            "e.g. adaptive@2.5:codes=vq"
        )
    if path.startswith("vq"):  # its cold tier in vector codes
        p = PRESETS[base][1]()
        if not _takes_vq(p):
            takes = [n for n, (_, make) in PRESETS.items() if _takes_vq(make())]
            raise ValueError(
                f"{_shown(name)} is not allowed: preset {base!r} has no quantized cold tier to code in vq; "
                f"vq variants take {' or '.join(takes)}, e.g. default:vq3/2"
            )
        kb, slash, vb = path.removeprefix("vq").partition("/")
        try:
            vq = {"cold_bits": _number(kb, int), "cold_value_bits": _number(vb, int) if slash else None}
        except ValueError:
            raise ValueError(
                f"{_shown(name)} is not allowed: expected {VARIANT_FORMS[1]} (bits in ASCII digits), e.g. default:vq3/2"
            ) from None
        return p.replace(cold="quant", cold_codes="vq", sparse=None, name=name, **vq)
    return None
