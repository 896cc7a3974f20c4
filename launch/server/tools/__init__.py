"""OpenAI tool calling for ``/v1/chat/completions`` (vLLM's ``--enable-auto-tool-choice --tool-call-parser``).

``scan`` (JSON of a call in growing text), ``base`` (the parser contract and the shared section scan),
the formats (``json_formats``: hermes, llama3_json; ``mistral``; ``deepseek``: deepseek_v3, deepseek_v31),
``registry`` (names, the startup check against the tokenizer), ``stream`` (a choice's calls, whole or as
deltas), ``requests`` (the request's tool fields) and ``calling`` (the server's setup and per-request
choice). Modules are imported by name: this package imports nothing, so ``launch.server.protocol`` can
use ``requests`` without a cycle.
"""
