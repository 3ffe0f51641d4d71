"""The command-line error contract every specjax script follows: bad input prints ONE
line, `<prog>: error: <message> (see --help)`, on stderr and exits with code 2 (no usage
dump, no traceback). Errors found after parsing are `SpecjaxError`s that each script's
`main` prints the same way."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose parse errors are one line and exit code 2.

    Pass `prog` where the script's name must not depend on how it was started (`main()`
    called in-process sees the caller's `sys.argv[0]`)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
