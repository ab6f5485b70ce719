"""Every `x-…` header the gateway, the workers and the load generator send or read."""

from __future__ import annotations

# The request's id: a client's, else the gateway's (new_id); a worker answers with it, made unique if
# the client's was in use there.
REQUEST_ID_HEADER = "x-request-id"

# The SLO: a class by name, llm-d's inference objective, or explicit targets. Where llm-d's router
# (home of the Gateway API Inference Extension's endpoint picker) has its own name, both are read,
# llm-d's first: a request sending both names is served by llm-d's.
SLO_CLASS_HEADER = "x-slo-class"  # also on every answer: the class the request ran at
SLO_TTFT_HEADER = "x-slo-ttft-ms"  # the gateway sends the time left of the TTFT target to its workers
SLO_TPOT_HEADER = "x-slo-tpot-ms"  # time per output token: the TBT target
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", SLO_TTFT_HEADER)
TPOT_HEADERS = ("x-llm-d-slo-tpot-ms", SLO_TPOT_HEADER)

# On an answer that was refused instead of served (shed): why (queue_full, predicted_slo_miss,
# no_healthy_worker); a gateway tries another worker for it.
DROPPED_REASON_HEADER = "x-flowprefill-dropped-reason"
# On an answer served though its TTFT target was predicted missed (a gateway may shed it instead).
PREDICTED_MISS_HEADER = "x-flowprefill-predicted-miss"

# Prefill/decode disaggregation (engine/core/handoff.py, engine/serving/kv_transport.py): the gateway sends a
# request's prefill half with KV_TO_HEADER (where the KV goes) and its decode half with KV_ID_HEADER
# (which handed-off KV to decode from).
KV_TO_HEADER = "x-flowprefill-kv-to"
KV_ID_HEADER = "x-flowprefill-kv-id"
# On the prefill half's answer, and from the gateway on the decode half: the prompt tokens the
# prefill worker found in its prefix cache (the decode worker reports them in usage).
CACHED_TOKENS_HEADER = "x-flowprefill-cached-tokens"
# How long the decode half waits for its KV, at most the worker's own limit.
HANDOFF_TIMEOUT_HEADER = "x-flowprefill-handoff-timeout-s"
# On the prefill half: "http" for no shared memory (benchmarks); on its answer: the transport used
# ("shm" or "http"), the bytes sent and the milliseconds the hand-off took.
KV_TRANSPORT_HEADER = "x-flowprefill-kv-transport"
KV_BYTES_HEADER = "x-flowprefill-kv-bytes"
KV_MS_HEADER = "x-flowprefill-kv-ms"
# On the prefill worker's internal POST to the decode worker: the KV is in this file of its shm folder.
KV_SHM_HEADER = "x-flowprefill-kv-shm"
