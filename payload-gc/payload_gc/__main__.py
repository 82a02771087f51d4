"""`python -m payload_gc`: the `payload-gc` command."""

from .cli import main

raise SystemExit(main())
