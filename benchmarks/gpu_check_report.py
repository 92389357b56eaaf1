"""benchmarks/gpu_check.py's report: the JSON of a run as the table a person reads (its own file
so the check itself stays readable)."""
from __future__ import annotations


def print_report(res: dict, sections: tuple[str, ...]) -> None:
    print(f"\n== {res['device']} | torch {res['torch']} | triton {res['triton']} | {res['date']}"
          + (" | DRY RUN" if res["dry_run"] else ""))
    dev = res.get("basics")
    if isinstance(dev, dict):
        mem = f"{dev['total_gib']:.1f} GiB ({dev['free_gib']:.1f} free), {dev['sms']} SMs, sm_{dev['capability']}" \
            if "total_gib" in dev else "no GPU"
        cow, att = dev["copy_on_write_past_2_31"], dev["attention_past_2_31"]
        print(f"\n-- 0. basics: {dev['name']}: {mem}; CUDA {dev['cuda']}, triton {dev['triton']}"
              + (" (interpreted)" if dev["interpreted"] else ""))
        print(f"   copy-on-write in a cache of {cow['elements'] / 2**30:.2f} Gi elements (offset "
              f"{cow['largest_offset'] / 2**30:.2f} Gi): {'ok' if cow['ok'] else 'WRONG'}; KV write, decode, prefill "
              f"at offset {att['largest_offset'] / 2**30:.2f} Gi: {'ok' if att['ok'] else 'WRONG'}")
    k = res.get("kernels")
    if isinstance(k, dict):
        print("\n-- 1. Triton kernels vs the torch backend in float32 (ok: max|err| within bf16 3e-2, fp16 1e-2, or "
              "twice the torch backend's own error in that dtype; the KV cache written exactly)")
        print(f"{'':4}{'case':<50}{'block':>6}{'dtype':>10}{'max ctx':>9}{'max|err|':>10}{'torch':>10}  cache")
        for r in k["rows"]:
            print(f"{'ok ' if r['ok'] else 'BAD'} {r['case']:<50}{r['block_size']:>6}{r['dtype']:>10}"
                  f"{r['max_context']:>9}{r['max_abs_err']:>10.1e}{r['torch_max_abs_err']:>10.1e}  "
                  f"{'equal' if r['cache_equal'] else 'DIFFERS'}")
    dec = res.get("decode")
    if isinstance(dec, dict):
        print(f"\n-- 2. paged decode attention (bf16, block 16); device copy {dec['copy_gb_s']:.0f} GB/s "
              f"(goal: >= {dec['goal_fraction_of_copy']:.0%} of it)")
        for c in dec["configs"]:
            print(f"   config BLOCK_N={c['block_n']:<4} warps={c['num_warps']} stages={c['num_stages']}: "
                  + (f"{c['gb_s']:.0f} GB/s" if "gb_s" in c else c["error"]))
        u = dec["used"]
        print(f"   using BLOCK_N={u['block_n']} warps={u['num_warps']} stages={u['num_stages']} "
              f"(code default {dec['default']})")
        print(f"{'heads':>10}{'batch':>7}{'context':>9}{'us':>10}{'GB/s':>9}{'% copy':>8}{'contig us':>11}"
              f"{'paged/contig':>14}")
        for r in dec["rows"]:
            contig = (f"{r['contiguous_us']:>11.1f}{r['paged_over_contiguous_time']:>13.2f}x"
                      if "contiguous_us" in r else f"  {r.get('contiguous_error', '')[:40]}")
            print(f"{r['heads']:>10}{r['batch']:>7}{r['context']:>9}{r['us']:>10.1f}{r['gb_s']:>9.0f}"
                  f"{100 * r['fraction_of_copy']:>7.0f}%{contig}")
    eng = res.get("engine")
    if isinstance(eng, dict):
        print(f"\n-- 3. engine on {res['device']} vs {eng['reference']}: {eng['model']}, {eng['prompts']} prompts x "
              f"{eng['tokens_per_prompt']} greedy tokens")
        for name, r in eng["runs"].items():
            print(f"   {name:<18} prompts equal {r['prompts_equal']}/{r['prompts']}, equal up to the first near tie "
                  f"{r['equal_to_first_near_tie']}/{r['prompts']}, tokens before the first difference "
                  f"{r['mean_share_before_first_difference']:.0%}")
        print(f"   float32 equal up to each prompt's first near tie (gap < {eng['near_tie']:g}; steps "
              f"{eng['runs']['float32 eager']['first_near_tie_steps']}): {'yes' if eng['float32_equal'] else 'NO'}; "
              f"decode steps through the CUDA graphs' "
              f"buffers {eng['graph_steps']}" + ("" if eng["graphs_captured"] else " (not captured: run eagerly)"))
    m = res.get("model_8b")
    if isinstance(m, dict):
        bound = m["weight_read_bound_tok_s"]
        print(f"\n-- 4. {m['model']} with dummy weights, bf16 ({m['weight_gb']:.1f} GB of weights; weight-read bound "
              + (f"{bound:.0f} tok/s at {m['bandwidth_for_bound_gb_s']:.0f} GB/s)" if bound else "unknown)"))
        t = m["trace"]
        print(f"   ShareGPT-like: {t['num_requests']} requests, mean {t['mean_input']:.0f} in / "
              f"{t['mean_output']:.0f} out; CUDA graph sizes {m['capture_sizes']}")
        print(f"{'mode':>8}{'1-stream tok/s':>16}{'% bound':>9}{'out tok/s':>11}{'% bf16 peak':>13}{'batch':>7}"
              f"{'done':>12}{'s':>7}")
        for mode in ("graphs", "eager"):
            if mode not in m:
                continue
            s, tp = m[mode]["single_stream"], m[mode]["throughput"]
            share = tp.get("share_of_bf16_peak")
            print(f"{mode:>8}{s['tok_s']:>16.1f}{100 * s.get('fraction_of_bound', float('nan')):>8.0f}%"
                  f"{tp['output_tok_s']:>11.0f}{100 * share if share else float('nan'):>12.1f}%{tp['avg_batch']:>7.1f}"
                  f"{tp['requests_finished']:>6}/{t['num_requests']:<5}{tp['seconds']:>7.1f}")
        if "graphs_speedup_single_stream" in m:
            print(f"   CUDA graphs vs eager: single stream {m['graphs_speedup_single_stream']:.2f}x, "
                  f"throughput {m['graphs_speedup_throughput']:.2f}x")
    p = res.get("paper")
    if isinstance(p, dict):
        print(f"\n-- 5. paper comparison: {p['model']} (dummy bf16), KV cache {p['kv_cache_gb']:.1f} GB = "
              f"{p['kv_slots']} slots = {p['max_length_sequences']:.1f} sequences of {p['max_model_len']}; "
              f"steady state over {p['window']}")
        print(f"{'allocator':>10}{'out tok/s':>11}{'avg batch':>11}{'preempt':>9}{'steps':>7}")
        for a, r in p["allocators"].items():
            print(f"{a:>10}{r['output_tok_s']:>11.0f}{r['avg_batch']:>11.1f}{r['preemptions']:>9}{r['steps']:>7}")
        ratio = {k: f"{p[f'paged_over_{k}']:.2f}x" if p[f"paged_over_{k}"] else "n/a" for k in ("oracle", "max")}
        print(f"   paged / Orca-Oracle {ratio['oracle']}, paged / Orca-Max {ratio['max']} (paper: {p['paper']})")
    for name, (planned, used) in res.get("time_boxes_shortened", {}).items():
        print(f"\n!! {name} shortened from {planned:.0f} to {used:.0f} to fit --budget-seconds "
              f"(measured overheads: {res.get('measured_overheads_s')})")
    for key in sections:
        for note, text in (res[key].items() if isinstance(res.get(key), dict) else ()):
            if "cuda_graphs_error" in note:
                print(f"\n!! {key}: building the engine with CUDA graphs failed, ran eagerly: "
                      f"{text.strip().splitlines()[-1]}")
        if isinstance(res.get(key), str):
            print(f"\n!! {key} failed: {res[key].strip().splitlines()[-1]}")
    print("\nseconds per section: " + ", ".join(f"{k} {v:.0f}" for k, v in res["seconds"].items()))
    if any(v is not None for v in res["peak_memory_gib"].values()):
        print("peak GPU memory per section (GiB): "
              + ", ".join(f"{k} {v:.2f}" for k, v in res["peak_memory_gib"].items() if v is not None))

