"""Small helpers with no home of their own (pure Python: kv/ may import them)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many b-sized parts hold a."""
    return -(-a // b)
