"""Loads the plugin both test trees share, the orchestrator's (`tests/`) and payload-gc's
(`payload-gc/tests/`): tests/support/suite_plugin.py (on `sys.path` through pytest's `pythonpath`,
pyproject.toml). Here, at the repository's root, it is loaded whichever paths pytest is
given, and once."""

pytest_plugins = ["suite_plugin"]
