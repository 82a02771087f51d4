"""The real-scale benchmark's parts (`bench/system_scale.py` runs it), one topic a module."""
