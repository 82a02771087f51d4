"""The local fleet: simulated inference servers over a deterministic MoE model.

`serve_inference(SimInferenceConfig(...))` runs one server until cancelled. It speaks the
real protocol (orchestrator.wire, docs/protocol.md): vLLM's tokens-in/tokens-out
`POST /inference/v1/generate`, answered as prime-rl's vLLM extension does (packed arrays
inline, or segments by handle) or as upstream vLLM does (`reply_form`; each form is one
module of orchestrator.sim.reply_forms, `REPLY_FORMS` their registry). `SimModel` and the
pure functions below are what it computes, usable without a server (a test can recompute
what a server returned). A server may be one side of disaggregated prefill/decode
(`role`), or a whole P/D deployment behind a router (`disaggregated`,
orchestrator.sim.pd_router).
"""

from ._faults import Fault as Fault
from ._faults import FaultRates as FaultRates
from ._model import Completion as Completion
from ._model import Generation as Generation
from ._model import SamplingParams as SamplingParams
from ._model import SimModel as SimModel
from ._model import generate as generate
from ._model import prefix_hashes as prefix_hashes
from ._model import route as route
from ._model import sample_completion as sample_completion
from ._pd import SimRole as SimRole
from ._server_config import SimInferenceConfig as SimInferenceConfig
from .inference import serve_inference as serve_inference
from .reply_forms import REPLY_FORMS as REPLY_FORMS
from .reply_forms import ReplyForm as ReplyForm

__all__ = [
    "REPLY_FORMS",
    "Completion",
    "Fault",
    "FaultRates",
    "Generation",
    "ReplyForm",
    "SamplingParams",
    "SimInferenceConfig",
    "SimModel",
    "SimRole",
    "generate",
    "prefix_hashes",
    "route",
    "sample_completion",
    "serve_inference",
]
