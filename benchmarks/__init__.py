"""Benchmarks of hybridlm: kernels and whole-model runs beside their peers, one JSON line per measurement.

`python -m benchmarks list` names them; `benchmarks.registry` holds them (see its docstring for the commands).
"""
