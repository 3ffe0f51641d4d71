"""The command-line tools above the library: one module per tool, each holding its
argparse parser (`specjax.cli.ArgumentParser`: bad input is one line on stderr and exit
code 2) and `main(argv=None) -> int`, driving library functions it imports. No library
module defines a `main`.

The documented commands keep their paths: `python -m specjax.X` runs the library module
`specjax/X.py`, whose `if __name__ == "__main__":` block hands over to the tool
(`specjax/regenerate.py` is that block alone).

| command                               | tool                          | library              |
|---------------------------------------|-------------------------------|----------------------|
| `python -m specjax.prepare`           | `specjax.tools.prepare`       | `specjax.prepare`    |
| `python -m specjax.plan`              | `specjax.tools.plan`          | `specjax.plan`       |
| `python -m specjax.export`            | `specjax.tools.export`        | `specjax.export`     |
| `python -m specjax.regenerate`        | `specjax.tools.regenerate`    | `specjax.data.regenerate` |
| `python -m specjax.drafters.convert`  | `specjax.tools.convert`       | `specjax.drafters.convert` |
| `python -m specjax.drafters.vocab`    | `specjax.tools.vocab`         | `specjax.drafters.vocab` |
| `python -m specjax.decoding.prompts`  | `specjax.tools.prompts`       | `specjax.decoding.prompts` |
| `python -m specjax.train.plot`        | `specjax.tools.plot`          | `specjax.train.plot` |
| `python -m specjax.testing.tiny`      | `specjax.tools.tiny`          | `specjax.testing.tiny` |
"""
