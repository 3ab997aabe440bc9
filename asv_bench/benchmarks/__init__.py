"""asv benchmarks for armdb (see asv_bench/asv.conf.json and docs/performance.md, The asv suite)."""
