"""Payloads by handle: segments, the writer, stitching and the reader.

Inference servers write routed expert ids and sampling masks into files under
``<root>/v<k>/`` and return small `PayloadSegment` records (docs/design.md §4); the orchestrator
validates and stitches them into per-sample segments; the trainer reads them back.
"""

from ._digest import is_digest_hex as is_digest_hex
from ._digest import payload_digest as payload_digest
from ._errors import BadSegment as BadSegment
from ._errors import PayloadCorrupt as PayloadCorrupt
from ._errors import PayloadError as PayloadError
from ._errors import PayloadMissing as PayloadMissing
from ._json import check_json_types as check_json_types
from ._json import is_json_int as is_json_int
from ._json import segment_object as segment_object
from ._model_shape import CHECKED_ROUTING_ROWS as CHECKED_ROUTING_ROWS
from ._model_shape import RoutingShape as RoutingShape
from ._model_shape import repeated_ids_problem as repeated_ids_problem
from ._overlap import overlap_problem as overlap_problem
from ._overlap import overlap_rows as overlap_rows
from ._overlap import read_rows as read_rows
from ._reader import read_sample_payload as read_sample_payload
from ._reader import read_segment as read_segment
from ._routing import compact_routed_experts as compact_routed_experts
from ._segment import FIELD_NDIM as FIELD_NDIM
from ._segment import FIELDS as FIELDS
from ._segment import PayloadSegment as PayloadSegment
from ._stitch import SENTINEL as SENTINEL
from ._stitch import Clip as Clip
from ._stitch import FinalTokenRoute as FinalTokenRoute
from ._stitch import clip_segment as clip_segment
from ._stitch import plan_routing as plan_routing
from ._stitch import sentinel_dtype as sentinel_dtype
from ._stitch import stitch_inline_masks as stitch_inline_masks
from ._stitch import stitch_inline_routing as stitch_inline_routing
from ._stitch import stitch_masks as stitch_masks
from ._stitch import stitch_routing as stitch_routing
from ._validate import check_segment as check_segment
from ._validate import check_segment_layout as check_segment_layout
from ._validate import check_within as check_within
from ._validate import open_version_dir as open_version_dir
from ._validate import regular_file_size as regular_file_size
from ._validate import validate_segment as validate_segment
from ._validate import version_dir as version_dir
from ._writer import write_payload as write_payload
from ._writer import write_payload_file as write_payload_file

__all__ = [
    "CHECKED_ROUTING_ROWS",
    "FIELDS",
    "FIELD_NDIM",
    "SENTINEL",
    "BadSegment",
    "Clip",
    "FinalTokenRoute",
    "PayloadCorrupt",
    "PayloadError",
    "PayloadMissing",
    "PayloadSegment",
    "RoutingShape",
    "check_json_types",
    "check_segment",
    "check_segment_layout",
    "check_within",
    "clip_segment",
    "compact_routed_experts",
    "is_digest_hex",
    "is_json_int",
    "open_version_dir",
    "overlap_problem",
    "overlap_rows",
    "payload_digest",
    "plan_routing",
    "read_rows",
    "read_sample_payload",
    "read_segment",
    "regular_file_size",
    "repeated_ids_problem",
    "segment_object",
    "sentinel_dtype",
    "stitch_inline_masks",
    "stitch_inline_routing",
    "stitch_masks",
    "stitch_routing",
    "validate_segment",
    "version_dir",
    "write_payload",
    "write_payload_file",
]
