"""`flowprefill epp`: FlowPrefill's routing as the endpoint picker (EPP) of the Gateway API Inference
Extension, for Envoy-based gateways (Envoy Gateway, kgateway, Istio, agentgateway, GKE).

The gateway asks the picker, over Envoy's external processing (ext_proc) gRPC protocol, which model
server takes each request (the protocol: the extension's proposal 004, as llm-d's router serves it).
The pick is the gateway's own: the same classification (gateway/classify.py), load from the workers'
/load and prefix affinity (gateway/routing.py, gateway/affinity.py), the same configuration file.

- `picker.py`: the decision (no gRPC): a request's headers and body in, endpoints or a refusal out.
- `messages.py`: ext_proc messages: header mutations, the body echoed in 62,000-byte chunks,
  immediate responses, metadata in and out.
- `processor.py`: one HTTP request's ext_proc stream, message by message.
- `h2.py`: gRPC's server side on HTTP/2, one asyncio protocol per connection (why not grpcio's
  server: its header comment, with the measurement); `h2out.py`: a connection's frames out (flow
  control, the graceful stop); `h2call.py`: what a call sees of its stream; `h2wire.py`: frames,
  header blocks, gRPC status.
- `grpc_server.py`: the listening port (plaintext or TLS), a graceful stop, the gRPC health service.
- `server.py`: the picker's process: the ext_proc and health services, the metrics endpoint, the
  pool's life.

Needs the `epp` extra (grpcio, grpcio-health-checking, xds-protos, hpack): `missing_extra()` says
what is missing before anything imports them.
"""

from __future__ import annotations

import importlib.util

EXTRA = {"grpc": "grpcio", "grpc_health": "grpcio-health-checking", "envoy": "xds-protos", "hpack": "hpack"}


def missing_extra() -> str | None:
    """One line naming the `epp` extra's missing packages, or None when all are installed."""
    absent = [package for module, package in EXTRA.items() if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return (f"the endpoint picker needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} not "
            "installed: pip install 'flowprefill[epp]'")
