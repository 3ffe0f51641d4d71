"""`python -m specjax.regenerate`: the command-line entry point of
`specjax.data.regenerate` (the target's greedy continuations of training-file prompts, as
drafter training data), kept at this path so the documented command stays the same."""

import sys

from specjax.data.regenerate import main

if __name__ == "__main__":
    sys.exit(main())
