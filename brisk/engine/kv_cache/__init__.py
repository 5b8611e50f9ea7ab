"""Paged KV-cache bookkeeping (pure Python, no torch): which block holds which tokens."""
