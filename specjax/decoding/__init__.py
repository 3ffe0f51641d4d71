"""Speculative decoding: the jitted draft-and-verify loop (`generate`), its host driver
that pads prompts and reports statistics (`engine`), lossless verification (`verify`) and
sampling (`sampling`), the attention-kernel policy (`kernel_policy`), the mesh placement
of the target (`sharding`), and the library entry points that load a target, a drafter
and prompts (`loading`, `prompts`). Imports no training code (tests/decoding/test_layering.py)."""
