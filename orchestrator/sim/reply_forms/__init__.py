"""The reply forms the local fleet answers in, one module each, and their registry.

Each module implements `ReplyForm` (`_protocol.py`): `primerl.py` (prime-rl's vLLM
extension, inline or by handle) and `upstream.py` (vLLM as released, inline only). A new
form is a new module beside them, its name added to `orchestrator.reply_form_names` (the
names' one home, which the config checks `[sim] reply_form` against), and one line in
`REPLY_FORMS` below.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from orchestrator.reply_form_names import ReplyFormName

from ._protocol import ByHandleForm as ByHandleForm
from ._protocol import MaskRows as MaskRows
from ._protocol import ReplyForm as ReplyForm
from ._protocol import RoutingIds as RoutingIds
from .primerl import PRIME_RL
from .upstream import UPSTREAM

__all__ = [
    "REPLY_FORMS",
    "ByHandleForm",
    "MaskRows",
    "ReplyForm",
    "RoutingIds",
    "routing_form",
]

#: Every reply form, by name, in the order of `orchestrator.reply_form_names`.
REPLY_FORMS: Mapping[ReplyFormName, ReplyForm] = MappingProxyType(
    {form.name: form for form in (PRIME_RL, UPSTREAM)}
)


def routing_form(value: object) -> ReplyForm | None:
    """The form an inline `routed_experts` value is in (the first that holds it), else None."""
    return next((form for form in REPLY_FORMS.values() if form.holds_routing(value)), None)
