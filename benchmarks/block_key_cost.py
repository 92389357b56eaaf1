"""Cost of one prefix-cache block key (16-token blocks): the chained SHA-256 that
kv/block_pool.py uses, the keyed BLAKE2b alternative (per-process random key), and the
old chain of Python's hash() of tuples (not collision resistant), for reference.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/block_key_cost.py

Each line is the best of --repeat runs of --number calls (the minimum is the least
disturbed by other work on the machine).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import timeit
from array import array

from pagedserve.kv.block_pool import _LENGTHS, _NO_PARENT, block_key

_BLAKE_KEY = os.urandom(32)


def blake2b_key(parent: bytes | None, token_ids, extra_keys: tuple[str, ...] = (), digest_size: int = 32) -> bytes:
    """block_key's encoding, hashed with keyed BLAKE2b instead of SHA-256."""
    extra = json.dumps(extra_keys).encode() if extra_keys else b""
    data = b"".join((parent or _NO_PARENT[:digest_size], _LENGTHS.pack(len(token_ids), len(extra)),
                     array("q", token_ids).tobytes(), extra))
    return hashlib.blake2b(data, key=_BLAKE_KEY, digest_size=digest_size).digest()


def old_key(parent, token_ids):
    return (None if parent is None else hash(parent), tuple(token_ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--number", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    tokens = list(range(1000, 1000 + args.block_size))   # a slice of a sequence's token list
    sha_parent, b32, b16 = block_key(None, tokens), blake2b_key(None, tokens), blake2b_key(None, tokens, (), 16)
    old_parent = old_key(None, tokens)
    cases = {
        "hash() of tuples (old, collidable)": lambda: old_key(old_parent, tokens),
        "SHA-256 (block_key)": lambda: block_key(sha_parent, tokens),
        "BLAKE2b keyed, 32-byte digest": lambda: blake2b_key(b32, tokens),
        "BLAKE2b keyed, 16-byte digest": lambda: blake2b_key(b16, tokens, (), 16),
    }
    print(f"block of {args.block_size} tokens, best of {args.repeat} x {args.number} calls")
    for name, fn in cases.items():
        best = min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number
        print(f"  {name:36s} {best * 1e9:8.0f} ns per block")


if __name__ == "__main__":
    main()
