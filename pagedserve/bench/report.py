"""Printing and saving a benchmark's result: vLLM-style tables and a JSON file that records the
command, the configuration and the machine (CPU model and flags, kernel variants)."""
from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import numpy as np

WIDTH = 50


def percentiles(values: list[float], which: list[float]) -> dict[str, float]:
    """mean, median, std and the percentiles `which` of values (NaN for none)."""
    arr = np.array(values, dtype=np.float64) if values else np.array([math.nan])
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    out.update({f"p{p:g}": float(np.percentile(arr, p)) for p in which})
    return out


def title(text: str, fill: str = "=") -> str:
    return f"{' ' + text + ' ' if text else ''}".center(WIDTH, fill)


def row(label: str, value, fmt: str = "{:.2f}") -> str:
    text = fmt.format(value) if isinstance(value, (int, float)) else str(value)
    return f"{label + ':':<40}{text:>10}"


def print_totals(requests: int, seconds: float, input_tokens: int, output_tokens: int) -> None:
    """The rows every throughput table starts with (vLLM's names)."""
    print(row("Successful requests", requests, "{:d}"))
    print(row("Benchmark duration (s)", seconds))
    print(row("Total input tokens", input_tokens, "{:d}"))
    print(row("Total generated tokens", output_tokens, "{:d}"))
    print(row("Request throughput (req/s)", requests / seconds))
    print(row("Output token throughput (tok/s)", output_tokens / seconds))
    print(row("Total token throughput (tok/s)", (input_tokens + output_tokens) / seconds))


def machine() -> dict:
    """What the numbers were measured on (the kernels' variants, the CPU's model and flags)."""
    info = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        from pagedserve.kernels import cpu, quant
        info.update(cpu.describe())
        info["quant_kernels"] = quant.variant()
    except Exception as e:        # no compiler: the numbers are torch's
        info["kernels_error"] = str(e)
    return info


def jsonable(value):
    if callable(value):              # argparse's func
        return getattr(value, "__name__", str(value))
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(path: str | None, result: dict, config: dict) -> None:
    """The result with its command, configuration and machine, to `path` (None: not written)."""
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(["pagedserve", *sys.argv[1:]]), "config": jsonable(config), "machine": machine(),
           **jsonable(result)}
    out.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {out}")
