"""Errors the command line turns into one clear line and exit code 2."""


class UserError(Exception):
    """Bad input from the person running a command: a config key, a file, an argument.

    The message is one line that names what is wrong and, where it helps, how to proceed.
    The CLI prints it without a traceback and exits with code 2.
    """
