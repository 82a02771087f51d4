"""The names of the reply forms the local fleet can answer in: their one home.

A leaf, so that the config (`[sim] reply_form`, which sits below the simulator) and the
command line can check a name without importing the simulator; each name is one module
of `orchestrator.sim.reply_forms`, whose registry must hold exactly these names (a unit
test checks it).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["DEFAULT_REPLY_FORM", "REPLY_FORM_NAMES", "ReplyFormName"]

#: prime-rl's vLLM extension (packed arrays inline, or segments by handle), or vLLM as
#: released (`.npy` routing and mask lists inline; `payload_dir` ignored).
ReplyFormName = Literal["prime-rl", "upstream"]
REPLY_FORM_NAMES: tuple[ReplyFormName, ...] = get_args(ReplyFormName)
#: What a server answers in unless told otherwise.
DEFAULT_REPLY_FORM: ReplyFormName = "prime-rl"
