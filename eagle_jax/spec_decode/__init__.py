"""The speculative decoding loop: drafting, verification, statistics."""
