"""Upstream vLLM with payloads by handle.

`orchestrator-vllm serve MODEL [any flag of vllm serve]` runs vLLM's own server with one
ASGI middleware added (`orchestrator_vllm.middleware.PayloadWriter`, through vLLM's
`--middleware` flag). A generate request whose `sampling_params.extra_args.payload_dir`
names a directory below the server's `--payload-root` gets its choices' routed experts
(and sampling masks, on builds that capture them) written into one new file per choice,
`<payload_dir>/<uuid hex>.bin`, and segments pointing into it in the reply, in the form
prime-rl's server extension replies with. Requests without `payload_dir` are untouched.

- `payloads`: a reply's arrays and the segments that describe them (pure).
- `files`: where a file may be written, and writing it (no symbolic link, no `..`,
  nothing outside the payload root; fd-relative, closed before the reply).
- `middleware`: the ASGI middleware.
- `cli`: the command, and the vLLM versions it knows.
"""

#: The vLLM versions this writer is tested with (`make test-vllm`); any other is refused
#: at start, since the middleware reads vLLM's reply form, which may change.
SUPPORTED_VLLM = ("0.30.0",)

__all__ = ["SUPPORTED_VLLM"]
