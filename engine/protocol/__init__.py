"""What the gateway and the workers say to each other and to clients, in one torch-free layer: the
OpenAI request bodies (`openai.py`, `responses.py`, `tokenize.py`) with their error bodies and ids,
sampling parameters and structured-output guides (`sampling.py`), SLO classes (`slo.py`) and every
`x-…` header name (`headers.py`). It imports nothing but msgspec and the standard library, so a
gateway installed without the engine extra (no torch, numpy or tokenizers) can use it; the engine
core and the serving layer build on it (tests/test_layers.py keeps it so)."""
