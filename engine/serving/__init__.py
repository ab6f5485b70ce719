"""The serving layer: the worker's HTTP server (`worker.py`) and its endpoints over one engine. The
generating endpoints share `generation.py` (completions, chat completions and the Responses API,
whose answer `responses_api.py` writes) and `choices.py` (an answer's `n` choices as a body or as
server-sent events); `tokenize_api.py` (vLLM's tokenize and detokenize), `endpoint.py` (what the
handlers share); the output parsers `tool_calls.py` and `reasoning.py`, `structured_output.py`, and
`kv_transport.py`, the KV hand-off's transport. It builds on the engine core (engine/core/), which
imports nothing of it (tests/test_layers.py keeps it so). Nothing is imported here: `serve` reads
the parsers' names without loading the rest."""
