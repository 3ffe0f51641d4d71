"""Finished studies: their scripts, run matrices and report generators, kept runnable
(each study's folder says how to reproduce it; docs/benchmarks.md lists the commands)."""
