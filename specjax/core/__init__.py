"""The floor under drafters and decoding: what both need and neither owns.

`sampling` (filtered distributions and sampling), `tree` (the static-shape draft tree and
its builders), `drafter` (the loop view, the Drafter and TreeDrafter protocols, the
attention-kernel type, the row gather). Drafters and decoding import this package; it
imports neither of them (tests/decoding/test_layering.py)."""
