"""webchat's benchmarks: each script runs as `python -m bench.<script>` from the repository root (bench/README.md)."""
