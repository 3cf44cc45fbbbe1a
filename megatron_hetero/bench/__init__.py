"""Benchmarks (`megatron-hetero bench ...`): not timed tests. Each runs its cases side by side in one
process tree, prints ratios measured in the same run, and writes JSON (and a PNG plot when
matplotlib is installed: `pip install -e '.[bench]'`)."""
