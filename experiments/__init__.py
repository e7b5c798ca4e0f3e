"""Experiments: each a frozen config and `run()` that measures through the benchmark registry and plots into
docs/img/. Run one with `python -m experiments.<name> [full|tiny]`."""
