"""Trainer for drafters and small language models (a later issue: objectives lm, ttt, block)."""

import sys

if __name__ == "__main__":
    print("train.py: not yet implemented; the training issue adds it", file=sys.stderr)
    sys.exit(1)
