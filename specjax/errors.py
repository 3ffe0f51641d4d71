"""The one exception type a user can cause; CLIs turn it into exit code 2."""


class SpecjaxError(Exception):
    """A user-caused error (bad path, flag or input) with a one-line message.

    The message names the input and, where there is one, the fix.
    """
