"""Memory saved by sharing KV blocks (the paper's Figure 15), and what prefix caching buys.

    .venv/bin/python benchmarks/sharing.py                  # both parts
    .venv/bin/python benchmarks/sharing.py --quick          # a smoke run: few requests, short outputs
    .venv/bin/python benchmarks/sharing.py --part saving    # only Figure 15 (or --part prefix)

Part 1, Figure 15: parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) on an
alpaca-like and a sharegpt-like trace (benchmarks/workloads.py: the paper's mean lengths,
19/58 and 161/338 tokens). Prefix caching is off, so only sharing inside a request counts.
After every engine step we add up the block tables' entries (the blocks the sequences would
hold without sharing) and the physical blocks in use; the saving is
(logical - physical) / logical over the whole run: the paper's "number of blocks saved by
sharing / number of total blocks without sharing". Every request produces its trace's output
length (ignore_eos), as in the paper's runs.

Part 2, shared prefix: every request is one few-shot prefix (~80 or ~340 tokens, like the
paper's 1-shot and 5-shot translation prompts) plus its own short question; the same requests
run with prefix caching on and off, and we report throughput and the cache hit rate.

Writes benchmarks/results/sharing.json and sharing.png.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workloads import TraceRequest, make_trace  # noqa: E402

# The paper's Figure 15 / Section 6.3 ranges over n (or width) = 2..6, in percent.
PAPER_SAVING = {
    ("parallel", "alpaca"): (6.1, 9.8),
    ("parallel", "sharegpt"): (16.2, 30.5),
    ("beam", "alpaca"): (37.6, 55.2),
    ("beam", "sharegpt"): (44.3, 66.3),
}
# Paper Section 6.4 (shared prefix, translation): vLLM's throughput over Orca (Oracle).
PAPER_PREFIX_SPEEDUP = {"1-shot (80 tok)": 1.67, "5-shot (341 tok)": 3.58}

FEW_SHOT = [
    ("The weather is lovely today.", "Il fait très beau aujourd'hui."),
    ("Where is the nearest train station?", "Où est la gare la plus proche ?"),
    ("I would like a cup of coffee, please.", "Je voudrais une tasse de café, s'il vous plaît."),
    ("My brother lives in a small village near the sea.", "Mon frère habite dans un petit village près de la mer."),
    ("We are going to the museum on Sunday morning.", "Nous allons au musée dimanche matin."),
    ("Could you speak a little more slowly?", "Pourriez-vous parler un peu plus lentement ?"),
    ("The children are playing in the garden.", "Les enfants jouent dans le jardin."),
    ("This book was written more than a hundred years ago.", "Ce livre a été écrit il y a plus de cent ans."),
    ("She forgot her umbrella at the restaurant.", "Elle a oublié son parapluie au restaurant."),
    ("How much does this bicycle cost?", "Combien coûte ce vélo ?"),
    ("The library closes at eight in the evening.", "La bibliothèque ferme à huit heures du soir."),
    ("I have never seen such a beautiful sunset.", "Je n'ai jamais vu un si beau coucher de soleil."),
    ("Please close the window before you leave.", "Veuillez fermer la fenêtre avant de partir."),
    ("Our neighbours have a very friendly dog.", "Nos voisins ont un chien très gentil."),
    ("The train was late because of the snow.", "Le train était en retard à cause de la neige."),
    ("He plays the piano every evening after dinner.", "Il joue du piano tous les soirs après le dîner."),
]
QUESTIONS = [
    "The market opens early on Saturdays.", "My sister is learning to swim.", "The soup is too hot to eat.",
    "They bought a new house last year.", "The museum is closed on Mondays.", "I am reading a long novel.",
    "The bus stops in front of the school.", "We watched a film at the cinema.", "The cat sleeps on the sofa.",
    "It rained all afternoon yesterday.", "Her garden is full of roses.", "The shop sells fresh bread.",
    "He walks to work every day.", "The river is very cold in winter.", "I lost my keys this morning.",
    "The teacher wrote on the board.",
]


# ---- part 1: memory saving (Figure 15) -----------------------------------------------------

def run_saving(llm, trace: list[TraceRequest], mode: str, k: int) -> dict:
    """Submit the whole trace with n = k (parallel) or width k (beam) and step to the end,
    summing logical and physical blocks over the steps."""
    from pagedserve import BeamSearchParams, SamplingParams
    engine = llm.engine
    for i, r in enumerate(trace):
        if mode == "parallel":
            params = SamplingParams(n=k, temperature=1.0, seed=i, max_tokens=r.output_len, ignore_eos=True)
        else:
            params = BeamSearchParams(beam_width=k, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(None, {"prompt_token_ids": r.prompt_token_ids}, params)
    logical = physical = steps = 0
    peak = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.kv_cache_stats()
        logical += stats["num_logical_blocks"]
        physical += stats["num_used_blocks"]
        peak = max(peak, stats["num_used_blocks"])
        steps += 1
    assert stats["num_preemptions"] == 0, "raise --kv-cache-memory: preemption distorts the saving"
    return dict(mode=mode, k=k, saving_pct=100 * (logical - physical) / logical, logical_block_steps=logical,
                physical_block_steps=physical, peak_blocks=peak, steps=steps,
                seconds=time.perf_counter() - start)


def part_saving(args, model: str | None) -> list[dict]:
    from pagedserve import LLM
    llm = LLM(model, dtype=args.dtype, block_size=args.block_size, enable_prefix_caching=False,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs)
    rows = []
    for workload, n_req in (("alpaca", args.alpaca_requests), ("sharegpt", args.sharegpt_requests)):
        trace = make_trace(workload, n_req, seed=args.seed, vocab_size=llm.engine.vocab_size)
        if args.quick:
            for r in trace:
                r.output_len = min(r.output_len, 32)
        mean_in = sum(len(r.prompt_token_ids) for r in trace) / len(trace)
        mean_out = sum(r.output_len for r in trace) / len(trace)
        for mode in ("parallel", "beam"):
            for k in (2, 4, 6):
                res = run_saving(llm, trace, mode, k)
                res.update(workload=workload, num_requests=n_req, mean_input=mean_in, mean_output=mean_out,
                           paper_range_pct=PAPER_SAVING[(mode, workload)])
                rows.append(res)
                print(f"  {workload:<9}{mode:<9}k={k}  saving {res['saving_pct']:5.1f}%  "
                      f"({res['steps']} steps, {res['seconds']:.0f}s)", flush=True)
    return rows


# ---- part 2: shared prefix -----------------------------------------------------------------

def few_shot_prefix(tokenizer, num_tokens: int) -> list[int]:
    """An English-to-French few-shot prompt, cut to exactly `num_tokens` tokens."""
    text = "Translate English to French.\n\n" + "".join(f"English: {en}\nFrench: {fr}\n\n" for en, fr in FEW_SHOT * 4)
    ids = tokenizer.encode(text)
    assert len(ids) >= num_tokens, "extend FEW_SHOT"
    return ids[:num_tokens]


def run_prefix(llm, prompts: list[list[int]], output_len: int) -> dict:
    from pagedserve import SamplingParams
    before = llm.kv_cache_stats()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.kv_cache_stats()
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return dict(seconds=elapsed, requests_s=len(prompts) / elapsed, total_tok_s=(n_in + n_out) / elapsed,
                output_tok_s=n_out / elapsed, hit_rate=hits / queries if queries else 0.0,
                outputs=[o.outputs[0].token_ids for o in outs])


def part_prefix(args, model: str | None) -> list[dict]:
    from pagedserve import LLM
    rows = []
    engines = {caching: LLM(model, dtype=args.dtype, block_size=args.block_size, enable_prefix_caching=caching,
                            kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs)
               for caching in (False, True)}
    tok = engines[True].get_tokenizer()
    for label, target in (("1-shot (80 tok)", 80), ("5-shot (341 tok)", 341)):
        prefix = few_shot_prefix(tok, target)
        prompts = [prefix + tok.encode(f"English: {QUESTIONS[i % len(QUESTIONS)]} ({i})\nFrench:")
                   for i in range(args.prefix_requests)]
        res = {caching: run_prefix(llm, prompts, args.prefix_output_len) for caching, llm in engines.items()}
        # Equal in float32; in bfloat16 a prefix computed in another batch can round differently.
        same = sum(a == b for a, b in zip(res[True]["outputs"], res[False]["outputs"]))
        row = dict(prefix=label, prefix_tokens=len(prefix), num_requests=len(prompts),
                   output_len=args.prefix_output_len,
                   without_caching={k: v for k, v in res[False].items() if k != "outputs"},
                   with_caching={k: v for k, v in res[True].items() if k != "outputs"},
                   speedup=res[True]["requests_s"] / res[False]["requests_s"], identical_outputs=same,
                   paper_speedup_over_orca=PAPER_PREFIX_SPEEDUP[label])
        rows.append(row)
        print(f"  {label:<17} {len(prefix)} prefix tokens: {row['without_caching']['requests_s']:.2f} -> "
              f"{row['with_caching']['requests_s']:.2f} req/s ({row['speedup']:.2f}x), "
              f"hit rate {100 * row['with_caching']['hit_rate']:.0f}%, identical outputs {same}/{len(prompts)}",
              flush=True)
    return rows


# ---- report --------------------------------------------------------------------------------

def plot(saving: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    colors = {"alpaca": "tab:blue", "sharegpt": "tab:orange"}
    for ax, mode, title in zip(axes, ("parallel", "beam"), ("(a) Parallel sampling", "(b) Beam search")):
        for j, workload in enumerate(("alpaca", "sharegpt")):
            rows = [r for r in saving if r["mode"] == mode and r["workload"] == workload]
            if not rows:
                continue
            xs = [r["k"] + (j - 0.5) * 0.7 for r in rows]
            ax.bar(xs, [r["saving_pct"] for r in rows], width=0.7, color=colors[workload],
                   label=f"pagedserve, {workload}-like")
            lo, hi = PAPER_SAVING[(mode, workload)]
            ax.axhspan(lo, hi, color=colors[workload], alpha=0.15, label=f"paper range, {workload}")
        ax.set_title(title)
        ax.set_xticks([2, 4, 6])
        ax.set_xlabel("# output sequences" if mode == "parallel" else "beam width")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("memory saving (%)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--part", choices=["saving", "prefix", "both"], default="both")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-memory", type=int, default=2 * 1024**3)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--alpaca-requests", type=int, default=32)
    ap.add_argument("--sharegpt-requests", type=int, default=8)
    ap.add_argument("--prefix-requests", type=int, default=32)
    ap.add_argument("--prefix-output-len", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="4 + 2 requests with outputs capped at 32 tokens; "
                                                         "8 shared-prefix requests of 8 tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/sharing")
    args = ap.parse_args()
    if args.quick:
        args.alpaca_requests, args.sharegpt_requests = min(args.alpaca_requests, 4), min(args.sharegpt_requests, 2)
        args.prefix_requests, args.prefix_output_len = min(args.prefix_requests, 8), min(args.prefix_output_len, 8)

    result: dict = dict(command=" ".join(sys.argv), quick=args.quick, block_size=args.block_size, dtype=args.dtype)
    if args.part in ("saving", "both"):
        print("memory saving from sharing (Figure 15):", flush=True)
        result["saving"] = part_saving(args, args.model)
    if args.part in ("prefix", "both"):
        print("shared prefix, prefix caching off vs on:", flush=True)
        result["prefix"] = part_prefix(args, args.model)

    if "saving" in result:
        print(f"\n{'workload':<10}{'mode':<10}{'k':>3}{'saving %':>10}{'paper % (k=2..6)':>18}")
        for r in result["saving"]:
            lo, hi = r["paper_range_pct"]
            print(f"{r['workload']:<10}{r['mode']:<10}{r['k']:>3}{r['saving_pct']:>10.1f}{f'{lo}-{hi}':>18}")
    if "prefix" in result:
        print(f"\n{'prefix':<18}{'tokens':>7}{'off req/s':>11}{'on req/s':>10}{'speedup':>9}{'hit rate':>10}")
        for r in result["prefix"]:
            print(f"{r['prefix']:<18}{r['prefix_tokens']:>7}{r['without_caching']['requests_s']:>11.2f}"
                  f"{r['with_caching']['requests_s']:>10.2f}{r['speedup']:>8.2f}x"
                  f"{100 * r['with_caching']['hit_rate']:>9.0f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    if "saving" in result:
        plot(result["saving"], out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}" + (f" and {out.with_suffix('.png')}" if "saving" in result else ""))


if __name__ == "__main__":
    main()
