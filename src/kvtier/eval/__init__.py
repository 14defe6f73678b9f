"""Evaluation: streamed perplexity, long-range recall, logit fidelity, speed; results and plots."""
