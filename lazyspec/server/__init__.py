"""The HTTP server: OpenAI-compatible and SGLang-native endpoints over the engine.

``worker.EngineWorker`` owns the engine in one thread, ``app.create_app`` builds the FastAPI
app, ``protocol`` parses requests, ``metrics`` exports Prometheus metrics. Launch with
``python scripts/serve.py`` (``lazyspec.server.launch``).
"""
