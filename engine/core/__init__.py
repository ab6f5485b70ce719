"""The engine core: it runs requests and knows nothing of HTTP or OpenAI's formats. A request
(`request.py`) arrives at the engine thread (`engine.py`, which owns its state: `owner.py`, and is told
things by `messages.py`); the event-driven scheduler and its policies (`scheduler/`) choose the prefill
batch (`prefill.py`) that runs, step by step, with its steps sized by the cost model (engine/model/:
`cost.py`, calibrated by `calibration.py`); answers decode (`decode.py`, `sampling.py`, `text.py`) into
the paged KV cache (`kv_cache.py`, `prefix_cache.py`). Beside them: the configuration (`config.py`),
tokenizers (`tokenizer.py`), the KV hand-off's format (`handoff.py`), telemetry's hooks (`observer.py`),
the batch log (`batch_log.py`) and the CPU placement of its threads (`cpu_affinity.py`,
`thread_cpu.py`). It builds on engine/protocol/, engine/model/ and engine/attention/ and imports nothing
of the serving layer (tests/test_layers.py keeps it so). Nothing is imported here: the gateway's
telemetry loads `observer.py` without torch."""
