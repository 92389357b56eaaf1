"""64-bit address arithmetic in the Triton kernels: a KV cache of more than 2**31 elements
(every real deployment) under the interpreter, without the memory: the caches are
allocated but never written outside the few blocks used, so only those pages take RAM.

Run in a child process: with 32-bit offsets the interpreter reads or writes far outside
the cache, which kills the process (a segfault) rather than failing an assertion."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = """
import json, torch
from benchmarks.gpu_check import DEVICE, large_cache_attention, large_copy_on_write
print(json.dumps(dict(copy=large_copy_on_write(DEVICE), attention=large_cache_attention(DEVICE))))
"""


def test_kernels_address_caches_past_2_31_elements():
    """Copy-on-write in a SmolLM2-shaped cache (60 segments: 30 layers' K and V) of more
    than 2**31 one-byte elements, whose last segment starts past offset 2**31 (segment x
    segment stride overflowed 32 bits: a wild write); KV write, decode (split and not) and prefill at K/V
    offsets past 2**31, equal to the same kernels on a small cache with the same blocks."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["copy"]["elements"] > 2**31 and r["copy"]["last_segment_offset"] > 2**31 and r["copy"]["ok"]
    assert r["attention"]["largest_offset"] > 2**31
    att = r["attention"]
    assert att["forward_equal"] and att["split_decode_equal"] and att["kv_written_equal"]
