"""System benchmarks (issue 6): each section is a script, `python -m bench.system.<section> [--quick]`;
`python -m bench.system.run_all` runs them all and writes bench/results/REPORT.md."""
