"""An OpenAI-compatible HTTP frontend beside tritonserver: `/v1/chat/completions` and `/v1/models` over the `mol2`
ensemble's gRPC stream, so the `openai` client, AIPerf and every other OpenAI tool can talk to the server.

Modules, one job each:

==================  ================================================================================================
``errors``          OpenAI-format errors and their status codes; Triton's error messages classified
``model_ids``       model ids (``mol2``, ``mol2:base``, ``mol2:<adapter>``) <-> the ``adapter`` tensor
``schemas``         the request body (pydantic), validated into a :class:`schemas.ChatRequest`
``prefix_cache``    message-list prefix -> server session (LRU, byte budget): a resent conversation reuses its session
``session_cost``    the bytes a server session holds, estimated from the model's layout (the cache's budget unit)
``triton_stream``   the async gRPC client: one turn as a stream of pieces, the adapter list, cancel
``stop_text``       holds back streamed text that may begin a stop string, cuts the stop string off
``responses``       the OpenAI JSON objects: completion, chunk, usage, model list
``service``         one chat completion: prefix lookup, the turn (reused session or ``history`` rebuild), bookkeeping
``app``             the FastAPI application: routes, headers, server-sent events, error handlers
``cli``             ``python -m openai_frontend`` / ``scripts/openai_server.py``: arguments, uvicorn
``process``         the frontend as a subprocess on a loopback port (tests, the main job, the benchmark)
==================  ================================================================================================
"""
