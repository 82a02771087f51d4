import sys

from orchestrator_trainer.cli import main

sys.exit(main())
