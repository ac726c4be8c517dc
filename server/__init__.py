"""The OpenAI-compatible HTTP server (``trellm serve``; needs the ``server`` extra).

``trellm.server.app.create_app(ServerConfig(...))`` builds the FastAPI app; ``trellm.server.testing.ServerThread``
runs it on loopback inside a process. docs/server.md describes the endpoints and settings.
"""
