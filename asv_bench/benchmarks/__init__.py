"""asv benchmarks for armdb (see asv_bench/asv.conf.json and CONVENTIONS.md, Benchmarks)."""
