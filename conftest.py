"""Loads the plugin both test trees share, the orchestrator's (`tests/`) and payload-gc's
(`payload-gc/tests/`): tests/support/suite_plugin.py (on `sys.path` through pytest's `pythonpath`,
pyproject.toml). Here, at the repository's root, it is loaded whichever paths pytest is
given, and once.

pytest rewrites the asserts of every test module, conftest and plugin it imports, and keeps
the result as bytecode beside the source (`__pycache__/*-pytest-*.pyc`, not the file
`make setup`'s compileall writes), unless `sys.dont_write_bytecode`: where the environment
sets PYTHONDONTWRITEBYTECODE, as this machine and many containers do, each session and each
xdist worker rewrote and compiled all of them again (8 CPU-s a collection). Let pytest keep
them: the rewritten code is the same, only its cache is kept. (Processes the tests start
keep the environment's setting.)
"""

import sys

sys.dont_write_bytecode = False

pytest_plugins = ["suite_plugin"]
