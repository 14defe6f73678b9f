"""Evaluation: streamed perplexity, long-range recall, logit fidelity, speed; results and plots.

Owns the measurements behind ``kvtier eval`` / ``kvtier bench`` / ``kvtier report`` (the caches
compared, the streamed runs, the result schema, plots). A user of the package, not part of it:
may import any kvtier module (the adapter :mod:`kvtier.hf` for caches and ``enable``), transformers
and the optional ``datasets`` / matplotlib, lazily where a command does not need them; nothing in
kvtier imports ``eval`` except ``cli`` and ``doctor``.
"""
