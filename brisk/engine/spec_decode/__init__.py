"""Speculative decoding: a cheap proposer drafts tokens, the target verifies them in one forward."""
