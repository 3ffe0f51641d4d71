"""Pallas kernels (block verification, attention over a reused target KV cache).

Filled by a later issue; each kernel will live in its own folder beside a pure-jnp
reference selectable at run time.
"""
