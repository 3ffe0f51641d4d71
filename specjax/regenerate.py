"""`python -m specjax.regenerate`: the target's continuations of training-file prompts, as
drafter training data. The command is `specjax.tools.regenerate`, the data set
`specjax.data.regenerate`; this module keeps the documented command's path."""

import sys

if __name__ == "__main__":  # `python -m specjax.regenerate`: specjax.tools.regenerate
    from specjax.tools.regenerate import main

    sys.exit(main())
