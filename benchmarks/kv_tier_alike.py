"""Are the tier run's answers exact? (issue 53) Compares kv_tier.py runs' saved sessions turn by turn.

    .venv/bin/python benchmarks/kv_tier_alike.py --tier-dir D --pool-dir P

D: a kv_tier.py --dir after its tier part (D/sessions/tier.json, no_tier.json); P: the --dir of a
kv_tier.py --part no-tier run on the first sessions of the same workload (same --system, --user,
--answer, --turns; fewer --sessions) with --pool-share well above 1, so that no block is evicted and
every turn's history is a pool hit computed turn by turn, as the tier run computed it. A tier load is a
byte copy of a block, so the tier run's answers must equal that run's; the no-tier run recomputes each
history in one prefill chunk (bf16 rounds otherwise: near ties may go either way), a control the
comparison can tell apart. Prints the share of (session, turn) answers alike for each pair.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kv_tier import load_sessions, same_share  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier-dir", required=True)
    ap.add_argument("--pool-dir", required=True)
    args = ap.parse_args()
    pool = load_sessions(Path(args.pool_dir) / "sessions" / "no_tier.json")
    n = len(pool)
    for name in ("tier", "no_tier"):
        other = load_sessions(Path(args.tier_dir) / "sessions" / f"{name}.json")[:n]
        if [s.users for s in other] != [s.users for s in pool]:
            sys.exit("the runs' sessions differ: run the pool-hit run with the tier run's --system, --user, --turns")
        turns = min(len(s.answers) for s in other + pool)
        print(f"{name} run vs pool hits: {100 * same_share(other, pool):.1f}% of {n} sessions x {turns} turns alike")


if __name__ == "__main__":
    main()
