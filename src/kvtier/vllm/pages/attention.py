"""Attention over packed vLLM pages as one object: :class:`PagedAttention` ``(fmt, backend)`` with
``plan`` / ``run`` / ``update`` (FlashInfer's plan once per step, run per layer).

:meth:`PagedAttention.plan` runs once per step (in the backend's metadata builder, over the step's
:class:`~.paged.StepPlan`) and makes every path choice of the step: which kernel attends each
request (the backend's kernel, a prefill kernel of :mod:`.prefill`, or the torch reference), which
prefill kernel, sparse decode or dense, and the index tensors of each. :meth:`~PagedAttention.run`
and :meth:`~PagedAttention.update` only read that plan. The thresholds (:data:`KERNEL_MAX_QUERY`,
:data:`KERNEL_MAX_CHUNK`, :data:`~.policy.SPARSE_MAX_QUERY`) and the kernels' availability are read
here and nowhere else on the vLLM side.

Backends, behind one small interface (:class:`PageKernel`: ``index``, ``attend``, ``update``, ``decode``):

- :class:`TorchPages`: plain torch (:func:`.paged.attend_request`, :func:`.paged.update_pages`:
  decode a request's pages, one SDPA call per request); every request of a step; the oracle the
  others are tested against.
- :class:`CppPages`: kvtier's C++ kernels (:mod:`kvtier.kernels.vllm_paged_cpu`: one attend and one
  update call per layer and step), pages of ``PagePolicy.kernel_codes``; decode rows and short chunks
  over packed blocks (the rest: :mod:`.prefill`'s kernels when given, else the torch reference).
- :class:`TritonPages`: kvtier's Triton kernel (:mod:`kvtier.kernels.triton_pages`), every request of
  a step in one launch, dense only, packing in torch. No engine path: the vLLM backend runs on the CPU
  platform only; tests run it under Triton's interpreter and ``benchmarks/gpu_check.py`` on a GPU.

Imports torch, :mod:`.paged`, :mod:`.policy`, :mod:`.prefill` (which imports vLLM only when a
:class:`~.prefill.VllmPrefill` is made) and (lazily) :mod:`kvtier.kernels`; never vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...codecs.pages import PageFormat
from .paged import RequestPlan, StepPlan, attend_request, update_pages
from .policy import SPARSE_MAX_QUERY
from .prefill import PrefillPlan, VllmPrefill

#: requests with more new tokens than this attend through SDPA (prefill chunks: compute-bound, BLAS
#: wins); the others (decode) through the fused kernel, which reads the packed pages once
KERNEL_MAX_QUERY = 16

#: new tokens up to which a chunk *over packed earlier blocks* also goes through the fused kernel,
#: which reads the pages in place (fp32, like the reference): 2.0-2.4x / 1.3-1.6x / 1.16-1.23x as
#: fast as decoding the pages for vLLM's fp32 kernel (:mod:`.prefill`) for 17 / 32 / 48 new tokens
#: over 2k packed tokens, 0.91-0.93x at 64 (2 threads, two runs of ``benchmarks/vllm_chunk_path.py``);
#: longer chunks, and chunks with no packed block (kvtier's bf16 prefill kernel), go to :mod:`.prefill`.
KERNEL_MAX_CHUNK = 48


def _long(x: list, n: int = 0, device: torch.device | None = None) -> torch.Tensor:
    t = torch.tensor(x, dtype=torch.long, device=device)
    return t.view(-1, n) if n else t


def _request_index(requests: list[RequestPlan], device: torch.device | None = None) -> dict:
    """The kernels' request index: ``reqs [R, 6]`` (``qs, qe``, side slot and rows, cached block read
    in part and its rows) and their packed blocks as ``pstart [R + 1]`` offsets into ``pids``."""
    rows, pstart, pids = [], [0], []
    for req in requests:
        pids.extend(req.packed)
        pstart.append(len(pids))
        side_slot = req.side_slot if req.side_rows else 0
        rows.append((req.qs, req.qe, side_slot, req.side_rows, max(req.head_block, 0), req.head_rows))
    return {"reqs": _long(rows, 6, device), "pstart": _long(pstart, 0, device), "pids": _long(pids, 0, device)}


class PageKernel:
    """What a backend of :class:`PagedAttention` does (one instance serves any number of engines).

    ``index`` builds, once per step, the index its ``attend`` and ``update`` read; ``attend`` writes
    the rows of the requests it was given into ``out``; ``update`` packs the blocks the step fills and
    writes the other new tokens into the side buffer; ``decode`` gives pages token-major."""

    name: str = ""

    def check(self, fmt: PageFormat) -> None:
        """Raise ``ValueError`` when this kernel cannot read ``fmt``'s pages."""

    def index(
        self, fmt: PageFormat, step: StepPlan, requests: list[RequestPlan], sparse_max_query: int, device
    ) -> dict:  # noqa: ANN001
        """The index of one step: ``requests`` are those this kernel attends (chosen by
        :meth:`PagedAttention.plan`), ``sparse_max_query`` the new tokens up to which a request decodes
        sparsely under ``PagePolicy.sparse_mass``, ``device`` that of the index tensors (``None``: CPU)."""
        raise NotImplementedError

    def attend(self, fmt: PageFormat, index: dict, pages, side, query, key, value, scale, out, counts) -> None:  # noqa: ANN001
        """Write the rows of the indexed requests into ``out`` (arguments as :meth:`PagedAttention.run`)."""
        raise NotImplementedError

    def update(self, fmt: PageFormat, step: StepPlan, index: dict, pages, side, key, value) -> None:  # noqa: ANN001
        update_pages(fmt, step, pages, side, key, value)

    def decode(self, fmt: PageFormat, pages: torch.Tensor, ids: list[int], dtype: torch.dtype):  # noqa: ANN201
        """Token-major ``k, v [len(ids) * T, H, D]`` in ``dtype`` of pages ``ids``."""
        H, D = fmt.heads, fmt.head_dim
        k, v = fmt.decode(pages[torch.tensor(ids)], dtype)  # [n, H, T, D]
        return k.transpose(1, 2).reshape(-1, H, D), v.transpose(1, 2).reshape(-1, H, D)


class TorchPages(PageKernel):
    """The plain-torch reference: each request's pages decoded, one SDPA call per request; packing with
    :meth:`PageFormat.encode <kvtier.codecs.pages.PageFormat.encode>`. Any page format, any device."""

    name = "torch"

    def index(self, fmt, step, requests, sparse_max_query, device):  # noqa: ANN001, ANN201
        sparse = fmt.policy.sparse_mass is not None
        return {"reqs": [(req, sparse and req.qe - req.qs <= sparse_max_query) for req in requests]}

    @torch.no_grad()
    def attend(self, fmt, index, pages, side, query, key, value, scale, out, counts) -> None:  # noqa: ANN001
        for req, sparse in index["reqs"]:
            out[req.qs : req.qe] = attend_request(fmt, req, pages, side, query, key, value, scale, sparse)


class CppPages(PageKernel):
    """kvtier's C++ kernels (:mod:`kvtier.kernels.vllm_paged_cpu`): one call per layer to attend, one to
    pack; pages of ``PagePolicy.kernel_codes`` (4-bit keys, 4- or 3-bit values), CPU tensors."""

    name = "cpp"

    def check(self, fmt: PageFormat) -> None:
        if not fmt.policy.kernel_codes:
            raise ValueError(
                f"the C++ page kernels read 4-bit keys with 4- or 3-bit values, not bits={fmt.policy.bits} / "
                f"value_bits={fmt.policy.vbits}: use the torch backend"
            )

    def index(self, fmt, step, requests, sparse_max_query, device):  # noqa: ANN001, ANN201
        idx = _request_index(requests)
        enc = [(b, max(slot, 0), start, first) for b, (slot, start, first) in zip(step.encode_blocks, step.encode_src)]
        writes = torch.stack((step.write_rows, step.write_tokens), 1) if step.write_rows is not None else _long([], 2)
        p = fmt.policy
        idx.update(
            enc=_long(enc, 4),
            writes=writes.contiguous(),
            level=1.0 if p.sparse_mass is None else p.sparse_mass,
            max_query=sparse_max_query,
        )
        return idx

    @torch.no_grad()
    def attend(self, fmt, index, pages, side, query, key, value, scale, out, counts) -> None:  # noqa: ANN001
        from ...kernels import vllm_paged_cpu

        if index["reqs"].shape[0]:
            vllm_paged_cpu.attend(
                query, key, value, side, pages, index["reqs"], index["pstart"], index["pids"], out, scale,
                fmt.layout(), index["level"], fmt.policy.local_window, index["max_query"], counts,
            )  # fmt: skip

    @torch.no_grad()
    def update(self, fmt, step, index, pages, side, key, value) -> None:  # noqa: ANN001
        from ...kernels import vllm_paged_cpu

        if index["enc"].shape[0] or index["writes"].shape[0]:
            vllm_paged_cpu.update(pages, side, key, value, index["enc"], index["writes"], fmt.layout())

    def decode(self, fmt: PageFormat, pages: torch.Tensor, ids: list[int], dtype: torch.dtype):  # noqa: ANN201
        """:meth:`PageKernel.decode` in C++ (``dtype``: the model dtype or fp32; the same values)."""
        from ...kernels import vllm_paged_cpu

        n, T, H, D = len(ids), fmt.tokens, fmt.heads, fmt.head_dim
        k, v = torch.empty(n * T, H, D, dtype=dtype), torch.empty(n * T, H, D, dtype=dtype)
        vllm_paged_cpu.decode(pages, torch.tensor(ids, dtype=torch.long), k, v, fmt.dtype, fmt.layout())
        return k, v


@dataclass
class TritonPages(PageKernel):
    """kvtier's Triton kernel (:mod:`kvtier.kernels.triton_pages`): every request of a step, decode rows
    and prefill chunks, pages of any :data:`~.policy.PAGE_BITS` codes, in one launch (plus a merge);
    CUDA tensors (CPU ones under Triton's interpreter); dense only. Packs in torch. No engine path (the
    vLLM backend runs on the CPU platform). ``num_splits``: splits per (request, head, row tile)
    (``None``: picked from the device)."""

    num_splits: int | None = None
    name = "triton"

    def check(self, fmt: PageFormat) -> None:
        if fmt.policy.sparse_mass is not None:
            raise ValueError("the Triton page kernel attends densely: PagePolicy.sparse_mass has no Triton path")

    def index(self, fmt, step, requests, sparse_max_query, device):  # noqa: ANN001, ANN201
        idx = _request_index(requests, device)
        idx["max_query"] = max((r.qe - r.qs for r in requests), default=0)  # most new tokens of a request
        idx["max_units"] = max((len(r.packed) + 2 for r in requests), default=1)  # most pages of one + 2
        return idx

    @torch.no_grad()
    def attend(self, fmt, index, pages, side, query, key, value, scale, out, counts) -> None:  # noqa: ANN001
        from ...kernels import triton_pages

        triton_pages.attend(
            query, key, value, side, pages, index["reqs"], index["pstart"], index["pids"], out, scale, fmt.layout(),
            fmt.policy.bits, max_query=index["max_query"], max_units=index["max_units"], num_splits=self.num_splits,
        )  # fmt: skip


KERNELS: dict[str, type[PageKernel]] = {"torch": TorchPages, "cpp": CppPages, "triton": TritonPages}


def choose_kernel(fmt: PageFormat) -> PageKernel:
    """The engine's kernel for ``fmt``'s pages: the C++ kernels where they read these codes and are
    built, else the torch reference (the one place availability is read on the vLLM side)."""
    from ...kernels import vllm_paged_cpu

    return CppPages() if fmt.policy.kernel_codes and vllm_paged_cpu.available() else TorchPages()


@dataclass
class PagedPlan:
    """One step of :class:`PagedAttention`: every request's path and the index tensors of each path
    (made once per step by :meth:`PagedAttention.plan`, read by every layer)."""

    step: StepPlan
    #: the backend kernel's index (its requests, and what ``update`` packs and writes)
    index: dict
    #: requests the backend kernel attends
    kernel: list[RequestPlan] = field(default_factory=list)
    #: the torch reference's index for the requests the kernel leaves when no prefill kernels are given
    rest: dict | None = None
    #: requests the prefill kernels attend (:class:`~.prefill.PrefillPlan` says which kernel)
    prefill: list[PrefillPlan] = field(default_factory=list)


class PagedAttention:
    """Attention over one engine's packed pages of format ``fmt``, through ``backend``.

    Parameters
    ----------
    fmt : the pages' :class:`~kvtier.codecs.pages.PageFormat` (``fmt.dtype``: the model dtype).
    backend : ``"torch"``, ``"cpp"``, ``"triton"``, ``"auto"`` (:func:`choose_kernel`) or a :class:`PageKernel`.
    prefill : :class:`~.prefill.VllmPrefill`: the requests the C++ kernel leaves (prefill chunks) go
        through vLLM's CPU attention or kvtier's bf16 prefill kernel; ``None``: the torch reference.
    kernel_max_query, kernel_max_chunk : the C++ kernel takes requests of at most
        ``kernel_max_query`` new tokens, and those over packed blocks of at most ``kernel_max_chunk``.
    bf16_prefill : with ``prefill``, kvtier's bf16 prefill kernels where they are built and read these
        pages (``False``: every prefill chunk through vLLM's kernel).
    """

    def __init__(
        self,
        fmt: PageFormat,
        backend: str | PageKernel = "auto",
        prefill: VllmPrefill | None = None,
        *,
        kernel_max_query: int = KERNEL_MAX_QUERY,
        kernel_max_chunk: int = KERNEL_MAX_CHUNK,
        bf16_prefill: bool = True,
    ) -> None:
        if isinstance(backend, str):
            if backend != "auto" and backend not in KERNELS:
                raise ValueError(
                    f"backend={backend!r} is not allowed: expected 'auto', {', '.join(map(repr, KERNELS))}"
                )
            backend = choose_kernel(fmt) if backend == "auto" else KERNELS[backend]()
        backend.check(fmt)
        if prefill is not None and backend.name != "cpp":
            raise ValueError("prefill kernels take the requests the C++ kernel leaves: backend must be 'cpp'")
        self.fmt, self.kernel, self.prefill = fmt, backend, prefill
        self.kernel_max_query, self.kernel_max_chunk = kernel_max_query, kernel_max_chunk
        #: kvtier's bf16 prefill kernel for chunks of exact keys and values, and for chunks over packed
        #: blocks reading the pages in place (decided once per engine; vLLM's kernel otherwise)
        self.prefill_bf16 = self.prefill_paged = False
        if prefill is not None and bf16_prefill:
            from ...kernels import prefill_cpu

            self.prefill_bf16 = fmt.dtype == torch.bfloat16 and fmt.head_dim in (64, 128) and prefill_cpu.available()
            self.prefill_paged = self.prefill_bf16 and prefill_cpu.paged_supported(fmt.layout())

    @classmethod
    def for_engine(cls, fmt: PageFormat, num_heads: int) -> PagedAttention:
        """An engine's: the C++ kernels with the prefill kernels of :mod:`.prefill` (vLLM's and kvtier's)
        where the C++ kernels read these pages and are built, else the torch reference."""
        kernel = choose_kernel(fmt)
        prefill = None
        if kernel.name == "cpp":
            prefill = VllmPrefill(num_heads, fmt.heads, fmt.head_dim, fmt.tokens, fmt.dtype)
        return cls(fmt, kernel, prefill)

    def _kernel_takes(self, req: RequestPlan) -> bool:
        if self.kernel.name != "cpp":  # the torch reference and Triton take every request
            return True
        n = req.qe - req.qs
        return n <= self.kernel_max_query or (bool(req.packed or req.head_rows) and n <= self.kernel_max_chunk)

    def _prefill_kernel(self, req: RequestPlan) -> str:
        if req.packed and not req.head_rows and self.prefill_paged:
            return "kvtier_paged"  # kvtier's bf16 kernel reading the packed pages in place
        if not (req.packed or req.head_rows) and self.prefill_bf16:
            return "kvtier"  # exact bf16 keys and values
        return "vllm"  # vLLM's kernel (over packed blocks decoded to fp32: not values of the model dtype)

    def plan(self, step: StepPlan, device: torch.device | str | None = None) -> PagedPlan:
        """The :class:`PagedPlan` of ``step`` (index tensors on ``device``, default the CPU): once per step."""
        taken = [req for req in step.requests if self._kernel_takes(req)]
        left = [req for req in step.requests if not self._kernel_takes(req)]
        dev = torch.device(device) if device is not None else None
        plan = PagedPlan(step, self.kernel.index(self.fmt, step, taken, SPARSE_MAX_QUERY, dev), taken)
        if self.prefill is not None:
            plan.prefill = [self.prefill.plan(req, self._prefill_kernel(req)) for req in left]
        elif left:
            plan.rest = TorchPages().index(self.fmt, step, left, SPARSE_MAX_QUERY, dev)
        return plan

    @torch.no_grad()
    def run(
        self,
        plan: PagedPlan,
        pages: torch.Tensor,
        side: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's attention of every request of the step, written into ``out`` and returned.

        Parameters
        ----------
        pages : uint8 ``[num_blocks, page_bytes]``, this layer's packed pages.
        side : ``[slots, T, 2, H, D]`` this layer's side buffer.
        query : ``[N, Hq, D]``; key, value : ``[N, H, D]`` (the step's new tokens, rows contiguous; read in place).
        out : ``[N, Hq, D]`` fp32 or the model dtype (vLLM's output rows); ``None``: a new fp32 tensor.
        counts : int64 ``[2]``, incremented by the tokens valued and scored under sparse decode (C++ only).
        """
        if out is None:
            out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
        self.kernel.attend(self.fmt, plan.index, pages, side, query, key, value, scale, out, counts)
        if plan.rest is not None:
            TorchPages().attend(self.fmt, plan.rest, pages, side, query, key, value, scale, out, counts)
        for p in plan.prefill:
            self.prefill.attend(self.fmt, p, pages, side, query, key, value, scale, out, self.kernel.decode)
        return out

    @torch.no_grad()
    def update(
        self, plan: PagedPlan, pages: torch.Tensor, side: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Pack the blocks the step fills into ``pages``, then write the other new tokens into ``side``
        (after :meth:`run`: a slot released this step may be reused by a block started now)."""
        self.kernel.update(self.fmt, plan.step, plan.index, pages, side, key, value)

    def decode_rows(self, pages: torch.Tensor, ids: list[int], dtype: torch.dtype):  # noqa: ANN201
        """Token-major ``k, v [len(ids) * T, H, D]`` in ``dtype`` of pages ``ids`` (the backend's decoder)."""
        return self.kernel.decode(self.fmt, pages, ids, dtype)
