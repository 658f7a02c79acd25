"""eds-server: an asyncio Endpoint Discovery Service (EDS) server for Envoy."""

__version__ = "0.1.0"
