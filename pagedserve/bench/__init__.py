"""`pagedserve bench latency | throughput | serve`: measurements with vLLM's flag names where
they exist (--input-len, --output-len, --num-prompts, --dataset-name, --request-rate,
--percentile-metrics, --output-json), a table like vLLM's, and JSON. datasets.py makes the
seeded workloads, report.py prints and writes the results; each subcommand is one module."""
